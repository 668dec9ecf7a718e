"""Method specs: the one syntax every CLI command, eval and app uses to name a method.

A spec is ``name`` or ``name:key=value:key=value``, e.g. ``snapkv:budget=256:window=32``.
Values are parsed as int, then float, then ``true``/``false``/``none``, else kept as strings (``shape=3,2,2`` stays
``"3,2,2"`` for the method to read). A key given twice is an error.

One dialect for wrappers: a wrapped method is a nested spec with commas for colons, e.g.
``chunked:chunk=1024:method=streaming,window=2048`` or ``chunkkv:method=snapkv,ratio=0.25``; the wrapper's
constructor turns it into the wrapped method object (:func:`resolve_nested`), the same object
``Chunked(StreamingLLM(window=2048), chunk=1024)`` is given directly. A wrapper never wraps itself.

A spec string is parsed once: :func:`parse_method_spec` returns a :class:`MethodSpec`, and every builder
(:func:`build_from_registry`, the registries' ``build_method``, :mod:`mmaccel.pipeline`) takes that object as it is.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method spec.

    Attributes
    ----------
    name : str
        Registry name, lower case (``"snapkv"``).
    kwargs : dict
        Keyword arguments for the method's constructor.
    text : str
        The spec as the user wrote it; used as the label in tables and files.
    """

    name: str
    kwargs: dict = field(default_factory=dict)
    text: str = ""

    @property
    def label(self) -> str:
        return self.text or self.name


def _parse_value(raw: str) -> Any:
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    return raw


def parse_method_spec(spec: str | MethodSpec) -> MethodSpec:
    """Parse ``name[:key=value...]`` into a :class:`MethodSpec`.

    Parameters
    ----------
    spec : str or MethodSpec
        The spec text (a :class:`MethodSpec` is returned as it is, not parsed again).

    Returns
    -------
    MethodSpec
        ``name`` lower case, ``kwargs`` with parsed values, ``text`` the stripped spec.

    Raises
    ------
    ValueError
        If the spec is empty, a ``key=value`` part is malformed, or a key is given twice
        (``"snapkv:budget=1:budget=2"``); the message shows the expected syntax or names the key.
    """
    if isinstance(spec, MethodSpec):
        return spec
    return _parse_text(str(spec).strip())


def _parse_text(text: str) -> MethodSpec:
    """The one parse of a spec's text (every :func:`parse_method_spec` of a string comes here, once)."""
    if not text:
        raise ValueError("empty method spec; expected 'name' or 'name:key=value:key=value', e.g. 'snapkv:budget=256'")
    name, *parts = text.split(":")
    kwargs: dict[str, Any] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"bad method spec {text!r}: part {part!r} is not key=value; "
                "expected 'name:key=value:key=value', e.g. 'snapkv:budget=256'"
            )
        key = key.strip()
        if key in kwargs:
            raise ValueError(f"bad method spec {text!r}: key {key!r} is given twice; give each key once, e.g. "
                             f"'{name.strip()}:{key}={raw.strip()}'")
        kwargs[key] = _parse_value(raw.strip())
    return MethodSpec(name=name.strip().lower(), kwargs=kwargs, text=text)


def build_from_registry(spec: str | MethodSpec, registry: Mapping[str, type], kind: str = "method"):
    """Instantiate ``registry[spec.name](**spec.kwargs)``.

    Raises
    ------
    ValueError
        For an unknown name (the message lists the registry) or arguments the method does not take.
    """
    parsed = parse_method_spec(spec)
    if parsed.name not in registry:
        raise ValueError(
            f"unknown {kind} {parsed.name!r}; choose one of: {', '.join(sorted(registry))} "
            "(syntax: name:key=value, e.g. snapkv:budget=256)"
        )
    cls = registry[parsed.name]
    valid = accepted_keys(cls)
    unknown = [k for k in parsed.kwargs if valid is not None and k not in valid]
    if unknown:
        keys = ", ".join(valid) if valid else "none"
        raise ValueError(
            f"{kind} {parsed.name!r} has no argument {', '.join(map(repr, unknown))}; valid keys: {keys} "
            f"(in {parsed.text!r})"
        )
    try:
        return cls(**parsed.kwargs)
    except TypeError as exc:
        raise ValueError(f"bad arguments for {kind} {parsed.name!r} in {parsed.text!r}: {exc}") from exc


class Registry:
    """A package's registry of methods: name -> class, and the builder of a spec against it.

    Each of :mod:`mmaccel.longctx`, :mod:`mmaccel.vision_tokens` and :mod:`mmaccel.speculative` keeps one in its
    ``registry`` module, below its method modules: the package's ``__init__`` fills :attr:`methods` (one line per
    method), and a wrapper that takes a nested spec builds it through :meth:`build` without importing its package.

    Parameters
    ----------
    kind : str
        What a method is, for messages (``"KV-cache method"``).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.methods: dict[str, type] = {}

    def build(self, spec: str | MethodSpec):
        """Build a method from a spec such as ``"name:key=value"``.

        Raises
        ------
        ValueError
            For an unknown name (the message lists the registry), an unknown argument, or a bad value.
        """
        return build_from_registry(spec, self.methods, self.kind)


def accepted_keys(cls) -> list[str] | None:
    """The keyword arguments ``cls(...)`` takes, in order (``None`` when it takes ``**kwargs``, i.e. any key)."""
    import inspect

    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def read_shipped_json(name_or_path, directory, what: str, fix: str) -> dict:
    """Read a JSON file named by a path, or by the stem of a file shipped in ``directory`` (a spec value such as
    ``pattern=smollm2-135m`` or ``skip=smollm2-135m``).

    Parameters
    ----------
    name_or_path : str or os.PathLike
        An existing file, or a shipped name (no ``/``, no ``.json`` suffix).
    directory : pathlib.Path
        The folder of shipped ``NAME.json`` files.
    what : str
        What the file holds, for messages (``"head pattern"``).
    fix : str
        How to make one, appended to the unknown-name message.

    Returns
    -------
    dict
        The parsed JSON object.

    Raises
    ------
    ValueError
        For an unknown name or a missing file (the message lists the shipped names), or unreadable JSON.
    """
    text = str(name_or_path)
    path = Path(text)
    if not path.is_file():
        path = Path(directory) / f"{text}.json"
        if "/" in text or text.endswith(".json") or not path.is_file():
            shipped = ", ".join(sorted(p.stem for p in Path(directory).glob("*.json"))) or "none"
            raise ValueError(f"unknown {what} {text!r}: no such file, and not a shipped name (shipped: {shipped}); "
                             f"{fix}")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {what} {text!r}: {exc}") from exc


def resolve_nested(value, base: type, build, owner: str, example: str):
    """A wrapped component given as an object or as a nested spec with commas for colons
    (``"snapkv,budget=64,window=8"`` -> ``build("snapkv:budget=64:window=8")``), as wrappers such as
    ``chunked:method=...`` and ``cascade:then=...`` take them.

    Parameters
    ----------
    value : object or str
        An instance of ``base``, or a nested spec.
    base : type
        What the component must be.
    build : callable
        Spec string -> component (a registry's builder).
    owner, example : str
        For the message: the wrapper's name and a valid nested spec.

    Returns
    -------
    object
        The wrapped component, an instance of ``base`` (a string is parsed once, here).

    Raises
    ------
    ValueError
        For anything else; a component named ``owner`` itself (a wrapper that wraps itself, e.g.
        ``"chunked:method=chunked,chunk=8"`` or ``ChunkKV(ChunkKV(...))``); or as ``build`` raises for an unknown
        name or argument.
    """
    if isinstance(value, str):
        value = parse_method_spec(value.replace(",", ":"))
        if value.name == owner:
            raise ValueError(f"{owner} cannot wrap itself (method={value.name!r} in {owner!r}); wrap the method "
                             f"directly, e.g. {owner}:method={example}")
        value = build(value)
    if isinstance(value, base):
        if getattr(value, "name", None) == owner or getattr(value, "method_name", None) == owner:
            raise ValueError(f"{owner} cannot wrap itself (got {type(value).__name__}({getattr(value, 'spec', '')!s})); "
                             f"wrap the method directly, e.g. {owner}:method={example}")
        return value
    raise ValueError(f"{owner}: expected a {base.__name__} or a spec such as {example!r}, got {value!r}")
