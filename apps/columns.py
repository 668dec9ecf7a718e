"""Configuration columns: a method dropdown with a form generated from the registry class, and the outputs under it.

:func:`method_column` builds one column (its fields come from :mod:`mmaccel.apps.forms`, so a method added to a registry
appears here with no edit); :func:`column_row` builds 4 of them with the "columns" radio; :func:`column_outputs`
builds the aligned output row (an HTML output, a metrics table and optionally an image per column).
"""
from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from . import forms
from .common import MAX_COLUMNS, METRIC_HEADERS, metrics_table


@dataclass
class MethodColumn:
    """The components of one configuration column: a method dropdown, one generated parameter group per method,
    the composed spec, and the output components the tab adds."""

    index: int
    container: Any
    dropdown: Any
    spec: Any
    groups: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)


def _component(f: forms.Field, key: str, value: Any = None):
    """A Gradio component for a generated field (``key`` is also its element id), showing ``value`` (default: the
    field's default)."""
    common = {"label": f.label, "info": f.help[:300] if f.help else None, "key": key, "elem_id": key}
    value = f.default if value is None else value
    if f.kind == "int":
        return gr.Number(value=value, precision=0, minimum=f.minimum, **common)
    if f.kind == "float":
        return gr.Number(value=value, minimum=f.minimum, **common)
    if f.kind == "bool":
        return gr.Checkbox(value=bool(value), **common)
    if f.kind == "choice":
        return gr.Dropdown(choices=f.choices, value=value, **common)
    return gr.Textbox(value="" if value is None else str(value), **common)


def method_column(tab: str, index: int, registry: Mapping[str, type], default: str, *,
                  extra: Mapping[str, str] | None = None, initial: Mapping[str, Any] | None = None) -> MethodColumn:
    """Build one configuration column inside the current Blocks context, its form generated from ``registry``.

    Parameters
    ----------
    tab : str
        Tab key (used in element ids: ``{tab}-col{index}-...``).
    index : int
        Column number, 0-based.
    registry : mapping
        Name -> method class, e.g. ``mmaccel.longctx.METHODS``; aliases are listed once.
    default : str
        The method selected at start.
    extra : mapping, optional
        Choices that are not registry classes (name -> description), e.g. the autoregressive baseline.
    initial : mapping, optional
        Starting values of some of the ``default`` method's fields (field name -> value, e.g. ``{"keep_ratio": 0.5}``);
        the starting spec is composed from them. The form itself is still generated from the class.

    Raises
    ------
    ValueError
        If an ``initial`` value does not fit its field (see :func:`mmaccel.apps.forms.compose_spec`).
    """
    extra, initial = dict(extra or {}), dict(initial or {})
    names = list(extra) + forms.unique_names(registry)
    with gr.Column(visible=index < 2, min_width=260, elem_id=f"{tab}-col{index}", key=f"{tab}-col{index}") as box:
        gr.Markdown(f"### Column {index + 1}" + (" (baseline of the ratios)" if index == 0 else ""))
        dropdown = gr.Dropdown(choices=names, value=default, label="method", elem_id=f"{tab}-col{index}-method",
                               key=f"{tab}-col{index}-method")
        col = MethodColumn(index=index, container=box, dropdown=dropdown, spec=None)
        for name in names:
            cls = registry.get(name)
            fields = forms.method_fields(cls) if cls is not None else []
            about = extra.get(name) or (forms.summary(cls) if cls is not None else "")
            with gr.Group(visible=name == default, key=f"{tab}-col{index}-{name}") as group:
                if about:
                    gr.Markdown(f"<small>{html.escape(about[:400])}</small>")
                start = initial if name == default else {}
                comps = [_component(f, key=f"{tab}-col{index}-{name}-{f.name}", value=start.get(f.name))
                         for f in fields]
            col.groups[name] = group
            col.inputs[name] = (fields, comps)
        fields = col.inputs[default][0]
        spec = forms.compose_spec(default, fields, [initial.get(f.name, f.default) for f in fields])
        col.spec = gr.Textbox(value=spec, label="spec (composed from the form; editable)",
                              elem_id=f"{tab}-col{index}-spec", key=f"{tab}-col{index}-spec")
    _wire_column(col)
    return col


def _wire_column(col: MethodColumn) -> None:
    """Events: the dropdown shows its method's group; any field change recomposes the spec."""
    names = list(col.groups)
    all_comps = [c for name in names for c in col.inputs[name][1]]

    def on_method(name, *values):
        updates = [gr.update(visible=n == name) for n in names]
        pos = 0
        spec = name
        for n in names:
            fields, comps = col.inputs[n]
            if n == name:
                spec = _safe_compose(n, fields, values[pos: pos + len(comps)])
            pos += len(comps)
        return [*updates, spec]

    col.dropdown.change(on_method, [col.dropdown, *all_comps], [*col.groups.values(), col.spec], queue=False,
                        api_visibility="private", show_progress="hidden")
    for name in names:
        fields, comps = col.inputs[name]
        if not comps:
            continue

        def on_field(*values, _name=name, _fields=fields):
            return _safe_compose(_name, _fields, values)

        gr.on([c.change for c in comps], on_field, comps, col.spec, queue=False, api_visibility="private",
              show_progress="hidden")


def _safe_compose(name: str, fields, values) -> str:
    try:
        return forms.compose_spec(name, fields, list(values))
    except ValueError as exc:
        gr.Warning(str(exc))
        return name


def _columns_visibility(n) -> list:
    n = int(n)
    return [gr.update(visible=i < n) for i in range(MAX_COLUMNS)]


def column_row(tab: str, registry, defaults: list[str], extra=None, initial=None) -> tuple[Any, list[MethodColumn]]:
    """The "columns" radio (2, 3 or 4) and a row of :data:`MAX_COLUMNS` configuration columns (the first two shown).

    Parameters
    ----------
    tab : str
        Tab key of the element ids (``{tab}-ncols``, ``{tab}-col{i}-...``).
    registry, extra
        As in :func:`method_column`.
    defaults : list of str
        The method selected at start in each column.
    initial : list of mapping, optional
        Per column, starting field values (see :func:`method_column`).

    Returns
    -------
    (gradio.Radio, list of MethodColumn)
    """
    n_cols = gr.Radio([2, 3, 4], value=2, label="columns", elem_id=f"{tab}-ncols")
    initial = list(initial or [None] * MAX_COLUMNS)
    with gr.Row(equal_height=False):
        cols = [method_column(tab, i, registry, defaults[i], extra=extra, initial=initial[i])
                for i in range(MAX_COLUMNS)]
    n_cols.change(_columns_visibility, n_cols, [c.container for c in cols], queue=False, api_visibility="private")
    return n_cols, cols


def column_outputs(tab: str, cols: list[MethodColumn], n_cols, image: bool | str = False) -> tuple[list, list]:
    """A row of output columns under the configuration columns, aligned with them: per column an ``output`` (HTML),
    a ``metrics`` table and, with ``image``, an image under them; shown for the first ``n_cols`` columns.

    ``image``: ``True`` for a heatmap (element id ``{tab}-col{i}-heatmap``), or a label for another image (element id
    ``{tab}-col{i}-image``; PNG, so what the handler drew comes back pixel for pixel).

    Returns
    -------
    (outputs, images)
        ``[html, table] * 4`` and the 4 image components (empty without ``image``).
    """
    outs, images, boxes = [], [], []
    with gr.Row(equal_height=False):
        for col in cols:
            with gr.Column(visible=col.index < 2, min_width=260, elem_id=f"{tab}-out{col.index}") as box:
                out_html = gr.HTML(label="output", elem_id=f"{tab}-col{col.index}-output",
                                   elem_classes=["mm-column-output"])
                table = gr.Dataframe(value=metrics_table([]), headers=METRIC_HEADERS, datatype=["str", "number"],
                                     label=f"metrics, column {col.index + 1}", interactive=False,
                                     elem_id=f"{tab}-col{col.index}-metrics")
                if image is True:
                    images.append(gr.Image(label="heatmap", type="filepath", elem_id=f"{tab}-col{col.index}-heatmap"))
                elif image:
                    images.append(gr.Image(label=image, type="pil", format="png", interactive=False,
                                           elem_id=f"{tab}-col{col.index}-image"))
            boxes.append(box)
            col.outputs = [out_html, table]
            outs += col.outputs
    n_cols.change(_columns_visibility, n_cols, boxes, queue=False, api_visibility="private")
    return outs, images


def run_buttons(tab: str, label: str = "Run side by side") -> tuple[Any, Any]:
    """The primary run button (``#{tab}-run``) and the Stop button (``#{tab}-stop``) in one row."""
    with gr.Row():
        run = gr.Button(label, variant="primary", elem_id=f"{tab}-run")
        stop = gr.Button("Stop", elem_id=f"{tab}-stop")
    return run, stop
