"""Spec resolution over the three registries: visual-token methods, KV-cache methods and speculative methods.

Every spec string is parsed once here (:func:`mmaccel.specs.parse_method_spec`) and the parsed
:class:`~mmaccel.specs.MethodSpec` is handed to the registry's builder; what comes back is a method object, passed on
as an object from then on (never re-parsed).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..longctx import METHODS as KV_METHODS
from ..longctx import build_method as build_kv
from ..specs import MethodSpec, parse_method_spec

_SPEC_TYPES = (str, MethodSpec)


def _speculative_names() -> list[str]:
    from ..speculative import speculative_method_names

    return speculative_method_names()


def _misplaced(name: str, slot: str) -> str:
    """A hint when a spec name belongs to another slot than ``slot`` (``""`` when it belongs nowhere)."""
    from ..vision_tokens import METHODS as VISION_METHODS

    owners = [("vision", VISION_METHODS), ("kv", KV_METHODS), ("speculative", _speculative_names())]
    for other, names in owners:
        if other != slot and name in names:
            return f"; {name!r} is a {other} method: pass it as {other}={name!r}"
    return ""


def _resolve_spec(spec: str | MethodSpec, slot: str, names, build, kind: str, example: str) -> tuple[Any, str]:
    """Parse ``spec`` once and build the method it names in the registry ``names`` of ``slot``; ``(method, label)``.

    Raises
    ------
    ValueError
        A malformed spec; an unknown name (the message lists ``names`` and, when the name belongs to another slot,
        says which); what ``build`` raises.
    """
    parsed = parse_method_spec(spec)
    if parsed.name not in names:
        raise ValueError(f"unknown {kind} {parsed.name!r}; {kind}s: {', '.join(sorted(names))} (e.g. {example!r})"
                         f"{_misplaced(parsed.name, slot)}")
    return build(parsed), parsed.label


def resolve_method(method, *, draft=None) -> tuple[Any, str]:
    """Turn ``None``, a spec or a method object into ``(method, label)``: what runs one generation.

    Parameters
    ----------
    method : None, str, MethodSpec, KVMethod, Drafter or a speculative method object
        ``None`` means full attention; a spec is parsed once and its text becomes the label: a KV-cache method
        (``"snapkv:budget=256"``), an engine drafter (``"draft:model=micro-draft:k=4"``, ``"prompt_lookup"``) or a
        transformers peer (``"hf_prompt_lookup:num_tokens=10"``); an object is used as is (a bare ``Drafter`` is
        wrapped with its default draft length) and labelled by its registry name.
    draft : str or transformers.PreTrainedModel, optional
        The draft model of ``draft`` / ``hf_assisted`` specs that name no ``model=``.

    Returns
    -------
    (object, str)
        The method and its label.

    Raises
    ------
    ValueError
        For an unknown method name or bad arguments (the message lists KV-cache methods, drafters and peers), or an
        object that is neither a KV-cache nor a speculative method.
    """
    from ..speculative import Drafter, SpeculativeMethod, build_speculative_method

    if method is None:
        return build_kv(MethodSpec("full", {}, "full")), "full"
    if isinstance(method, _SPEC_TYPES):
        parsed = parse_method_spec(method)
        if parsed.name in KV_METHODS:
            return build_kv(parsed), parsed.label
        if parsed.name in _speculative_names():
            return build_speculative_method(parsed, draft=draft), parsed.label
        raise ValueError(
            f"unknown KV-cache method {parsed.name!r} (nor a speculative method); KV-cache methods: "
            f"{', '.join(sorted(KV_METHODS))}; speculative: {', '.join(_speculative_names())} "
            "(syntax: name:key=value, e.g. snapkv:budget=256 or draft:model=micro-draft)"
        )
    if isinstance(method, Drafter):
        method = SpeculativeMethod(method)
    if not (hasattr(method, "make_cache") or hasattr(method, "timed_generate")):
        raise ValueError(f"{method!r} is not a KV-cache or speculative method (no make_cache / timed_generate); pass "
                         "a spec such as 'snapkv:budget=256' or 'draft:model=micro-draft'")
    return method, getattr(method, "name", type(method).__name__)


def resolve_methods(methods: Sequence, *, draft=None) -> list[tuple[Any, str]]:
    """:func:`resolve_method` for each entry, checked up front; duplicate labels get ``#2``, ``#3`` suffixes.

    Parameters
    ----------
    methods : sequence of specs or method objects, or one of them
    draft : optional
        Passed on to :func:`resolve_method`.

    Returns
    -------
    list of (object, str)

    Raises
    ------
    ValueError
        If ``methods`` is empty, or for the first unknown/badly configured method.
    """
    if isinstance(methods, _SPEC_TYPES) or hasattr(methods, "make_cache") or hasattr(methods, "timed_generate"):
        methods = [methods]
    if not methods:
        raise ValueError("no methods given; pass at least one, e.g. 'full'")
    out, seen = [], {}
    for m in methods:
        obj, label = resolve_method(m, draft=draft)
        seen[label] = seen.get(label, 0) + 1
        out.append((obj, label if seen[label] == 1 else f"{label}#{seen[label]}"))
    return out


def resolve_vision(vision) -> tuple[Any, str | None]:
    """Turn ``None``, a visual-token spec or a :class:`~mmaccel.vision_tokens.VisionTokenMethod` into
    ``(method, label)``; ``(None, None)`` for ``None`` (off).

    Raises
    ------
    ValueError
        An unknown name (the message lists :data:`mmaccel.vision_tokens.METHODS`, and says where a KV or speculative
        name belongs), a bad argument, or an object that is not a visual-token method.
    """
    from ..vision_tokens import METHODS as VISION_METHODS
    from ..vision_tokens import VisionTokenMethod
    from ..vision_tokens import build_method as build_vision

    if vision is None:
        return None, None
    if isinstance(vision, _SPEC_TYPES):
        return _resolve_spec(vision, "vision", VISION_METHODS, build_vision, "visual-token method",
                             "pooling:keep_ratio=0.25")
    if isinstance(vision, VisionTokenMethod):
        return vision, vision.name
    raise ValueError(f"vision must be a visual-token spec such as 'pooling:keep_ratio=0.25' or a VisionTokenMethod, "
                     f"got {type(vision).__name__}")


def resolve_kv(kv) -> tuple[Any, str | None]:
    """Turn ``None``, a KV-cache spec or a :class:`~mmaccel.longctx.KVMethod` into ``(method, label)``;
    ``(None, None)`` for ``None``.

    Raises
    ------
    ValueError
        An unknown name (the message lists :data:`mmaccel.longctx.METHODS`, and says where a visual-token or
        speculative name belongs), a bad argument, or an object without ``make_cache``.
    """
    if kv is None:
        return None, None
    if isinstance(kv, _SPEC_TYPES):
        return _resolve_spec(kv, "kv", KV_METHODS, build_kv, "KV-cache method", "snapkv:budget=256")
    if hasattr(kv, "make_cache") and not hasattr(kv, "timed_generate"):
        return kv, getattr(kv, "name", type(kv).__name__)
    raise ValueError(f"kv must be a KV-cache spec such as 'snapkv:budget=256' or a KVMethod, got {type(kv).__name__}")


def resolve_speculative(speculative, *, draft=None) -> tuple[Any, str | None]:
    """Turn ``None``, a speculative spec, a :class:`~mmaccel.speculative.Drafter` or a speculative method object into
    ``(method, label)``; ``(None, None)`` for ``None``. ``draft`` is the draft model of a ``"draft"`` spec that
    names no ``model=``.

    Raises
    ------
    ValueError
        An unknown name (the message lists drafters and transformers peers, and says where a visual-token or KV
        name belongs), a bad argument, or an object that is not a speculative method.
    """
    from ..speculative import build_speculative_method

    if speculative is None:
        return None, None
    if isinstance(speculative, _SPEC_TYPES):
        return _resolve_spec(speculative, "speculative", _speculative_names(),
                             lambda parsed: build_speculative_method(parsed, draft=draft), "speculative method",
                             "prompt_lookup")
    method, label = resolve_method(speculative, draft=draft)
    if not hasattr(method, "timed_generate"):
        raise ValueError(f"speculative must be a drafter or speculative method, got {type(speculative).__name__}")
    return method, label
