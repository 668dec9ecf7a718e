"""Forms generated from a method class: its constructor signature gives the fields, its docstring the help text.

A registry (``mmaccel.longctx.METHODS``, ``mmaccel.speculative.METHODS``, ...) maps names to classes. For each class,
:func:`method_fields` reads ``inspect.signature(cls)`` (the keys :func:`mmaccel.specs.accepted_keys` lists) and the
numpydoc ``Parameters`` section of the class docstring (and of its base classes, for inherited fields such as
``budget``/``ratio``), and returns one :class:`Field` per parameter a form can set: its kind (int, float, bool,
choice, text), default, whether it may be empty (``None``), a lower bound when the docstring states one (``>= 1``) and
the help text. :func:`compose_spec` turns the values of a filled form back into a method spec
(``snapkv:budget=256:window=16``), the one syntax the CLI, the Python API and the app share. No form is written by
hand, so a method added to a registry appears in the app with its own fields.

Nothing here imports gradio; :mod:`mmaccel.apps.workbench` builds components from the fields.
"""
from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_SECTION = re.compile(r"^\s*([A-Z][A-Za-z ]+)\n\s*-{3,}\s*$", re.MULTILINE)
_MIN = re.compile(r"(?:>=|≥)\s*(-?\d+(?:\.\d+)?)(?!\s*``)")
_CHOICES = re.compile(r"\{([^{}]+)\}")


@dataclass
class Field:
    """One form field generated from a constructor parameter.

    Attributes
    ----------
    name : str
        The keyword argument (and the spec key).
    kind : {"int", "float", "bool", "choice", "text"}
        What component edits it: a number field (int or float), a checkbox, a dropdown, a text box.
    default : object
        The constructor's default (``None`` when it has none or it is ``None``).
    optional : bool
        Whether ``None`` (an empty field) is allowed: the method then uses its own rule (e.g. ``ratio`` instead of
        ``budget``).
    minimum : float or None
        A lower bound stated in the docstring (``>= 1``), else ``None``.
    choices : list
        For ``kind == "choice"``: the values the docstring lists (``{"avg", "max"}``; numbers when the annotation
        is ``int`` or ``float``, as in ``bits : {2, 4, 8, 16}``).
    help : str
        The parameter's description from the docstring (one paragraph, whitespace collapsed).
    """

    name: str
    kind: str
    default: Any = None
    optional: bool = False
    minimum: float | None = None
    choices: list = field(default_factory=list)
    help: str = ""

    @property
    def zero_is_unset(self) -> bool:
        """Whether 0 means "not set": a number field whose default is ``None`` (a browser sends an empty number
        field as 0, and none of these parameters takes 0 -- a budget, a ratio, a threshold)."""
        return self.default is None and self.kind in ("int", "float")

    @property
    def label(self) -> str:
        """A short label for the component: the name, and how to leave it unset when it is optional."""
        if self.zero_is_unset:
            return f"{self.name} (optional; empty or 0 = unset)"
        return f"{self.name} (optional)" if self.optional and self.default is None else self.name


def docstring_sections(doc: str | None) -> dict[str, str]:
    """Split a numpydoc docstring into ``{section title: body}`` (the text before the first section is ``""``)."""
    doc = inspect.cleandoc(doc or "")
    sections: dict[str, str] = {}
    matches = list(_SECTION.finditer(doc))
    sections[""] = doc[: matches[0].start()] if matches else doc
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(doc)
        sections[m.group(1).strip()] = doc[m.end():end]
    return sections


def parse_parameters(doc: str | None) -> dict[str, tuple[str, str]]:
    """The numpydoc ``Parameters`` section as ``{name: (type text, description)}``.

    A header line ``a, b : type`` documents several names at once; a header without ``:`` (``budget, ratio``) has an
    empty type. Continuation lines (indented deeper than the header) form the description.
    """
    body = docstring_sections(doc).get("Parameters", "")
    out: dict[str, tuple[str, str]] = {}
    names: list[str] = []
    type_text, desc_lines = "", []
    base_indent = None

    def flush():
        for n in names:
            out[n] = (type_text, " ".join(" ".join(desc_lines).split()))

    for line in body.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if base_indent is None:
            base_indent = indent
        if indent <= base_indent:
            flush()
            head, _, type_text = line.strip().partition(" : ")
            head = head.removesuffix(":")  # "name:" with no type
            names = [n.strip() for n in head.split(",") if n.strip().isidentifier()]
            type_text, desc_lines = type_text.strip(), []
        else:
            desc_lines.append(line.strip())
    flush()
    return out


def _documented(cls) -> dict[str, tuple[str, str, str]]:
    """Parameters documented by ``cls`` or its base classes: ``{name: (type text, description, bound text)}``.

    The type text and description come from the most derived class that gives them (a subclass that writes
    ``window, pooling`` / "As in SnapKV" keeps its description but takes the base's ``{"avg", "max"}``); the bound
    text is every description in MRO order, so a bound stated only by a base class is found too.
    """
    docs: dict[str, tuple[str, str, str]] = {}
    for klass in getattr(cls, "__mro__", [cls]):
        if klass is object:
            continue
        for name, (type_text, desc) in parse_parameters(klass.__doc__).items():
            old_type, old_desc, bounds = docs.get(name, ("", "", ""))
            docs[name] = (old_type or type_text, old_desc or desc, f"{bounds} {desc}".strip())
    return docs


def _kind(annotation: Any, default: Any, type_text: str) -> tuple[str | None, bool, list]:
    """(kind, optional, choices) from an annotation (a string under ``from __future__ import annotations``), the
    default and the docstring's type text; kind ``None`` when a form cannot set it (e.g. a tokenizer object)."""
    ann = "" if annotation is inspect.Parameter.empty else (
        annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation)))
    choices = []
    m = _CHOICES.search(type_text)
    if m:
        choices = [c.strip().strip("'\"") for c in m.group(1).split(",") if c.strip()]
    optional = default is None or "None" in ann or "optional" in type_text or "None" in type_text
    tokens = set(re.findall(r"[A-Za-z_]+", ann))
    doc_tokens = set(re.findall(r"[A-Za-z_]+", type_text.split(",")[0] if not choices else ""))
    if choices:
        # typed like the annotation (bits : {2, 4, 8, 16} with ``bits: int``), so the default is one of them
        for typ in (int, float):
            if typ.__name__ in tokens:
                try:
                    choices = [typ(c) for c in choices]
                except ValueError:
                    pass
                break
        return "choice", optional, choices
    if "bool" in tokens or (not tokens and isinstance(default, bool)):
        return "bool", optional, []
    if "int" in tokens and "float" not in tokens:
        return "int", optional, []
    if "float" in tokens:
        return "float", optional, []
    if "str" in tokens:
        return "text", optional, []
    if tokens - {"None"}:
        # another annotation (object, a class): editable as text only when the default is a string (a nested spec)
        return ("text" if isinstance(default, str) else None), optional, []
    # no annotation: the default's type, else the docstring's type text
    for typ, kind in ((bool, "bool"), (int, "int"), (float, "float"), (str, "text")):
        if default is not None and isinstance(default, typ):
            return kind, optional, []
    for word, kind in (("int", "int"), ("float", "float"), ("bool", "bool"), ("str", "text")):
        if word in doc_tokens:
            return kind, optional, []
    return None, optional, []


def method_fields(cls) -> list[Field]:
    """The form fields of a method class: one per constructor keyword a form can set.

    Parameters
    ----------
    cls : type
        A registry class, e.g. ``mmaccel.longctx.SnapKV`` or ``mmaccel.speculative.PromptLookup``.

    Returns
    -------
    list of Field
        In signature order. Parameters whose value cannot come from a form (an object such as a tokenizer, with no
        default a form could show) are left out; ``**kwargs`` is ignored.
    """
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    docs = _documented(cls)
    fields = []
    for p in params:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        default = None if p.default is inspect.Parameter.empty else p.default
        type_text, help_text, bounds = docs.get(p.name, ("", "", ""))
        kind, optional, choices = _kind(p.annotation, default, type_text)
        if kind is None:
            logger.debug("%s.%s: no form field (type %r)", getattr(cls, "__name__", cls), p.name, p.annotation)
            continue
        m = _MIN.search(bounds)
        minimum = float(m.group(1)) if m and kind in ("int", "float") else None
        fields.append(Field(name=p.name, kind=kind, default=default, optional=optional, minimum=minimum,
                            choices=choices, help=help_text))
    return fields


def summary(cls) -> str:
    """The first paragraph of a class docstring, whitespace collapsed (the method's one-line description)."""
    text = docstring_sections(cls.__doc__).get("", "").strip().split("\n\n")[0]
    return " ".join(text.split())


def unique_names(registry: Mapping[str, type]) -> list[str]:
    """Registry names with aliases removed: the first name of each class, in registry order
    (``streamingllm`` is an alias of ``streaming``, ``pld`` of ``prompt_lookup``)."""
    seen, names = set(), []
    for name, cls in registry.items():
        if id(cls) in seen:
            continue
        seen.add(id(cls))
        names.append(name)
    return names


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def coerce(f: Field, value: Any) -> Any:
    """A component's value as the parameter's type: ``None`` for an empty field (or 0 where
    :attr:`Field.zero_is_unset`), ``int`` for a whole number field.

    Raises
    ------
    ValueError
        For a value that is not of the field's kind (e.g. ``2.5`` for an int field).
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if f.zero_is_unset and float(value) == 0:
        return None
    if f.kind == "int":
        num = float(value)
        if not num.is_integer():
            raise ValueError(f"{f.name} must be a whole number, got {value!r}")
        return int(num)
    if f.kind == "float":
        return float(value)
    if f.kind == "bool":
        return bool(value)
    if f.kind == "choice":
        return next((c for c in f.choices if str(c) == str(value).strip()), str(value).strip())
    return str(value).strip()


def compose_spec(name: str, fields: list[Field], values: list[Any]) -> str:
    """The method spec of a filled form: ``name`` plus ``:key=value`` for every field that differs from its default.

    Parameters
    ----------
    name : str
        Registry name of the method.
    fields : list of Field
        From :func:`method_fields`.
    values : list
        The components' values, in the order of ``fields`` (``None``/empty for "use the default").

    Returns
    -------
    str
        e.g. ``"snapkv:budget=256"``. Values equal to the default and empty optional fields are left out, so the spec
        stays short and reads as the user's choices. A text value containing ``:`` (a nested spec such as the method
        of ``chunked``) has its colons written as commas, the nesting syntax of :mod:`mmaccel.specs`.

    Raises
    ------
    ValueError
        For a value of the wrong kind (see :func:`coerce`).
    """
    parts = [name]
    for f, raw in zip(fields, values):
        value = coerce(f, raw)
        if value is None or value == f.default:
            continue
        text = _format(value)
        if f.kind == "text":
            text = text.replace(":", ",")
        parts.append(f"{f.name}={text}")
    return ":".join(parts)
