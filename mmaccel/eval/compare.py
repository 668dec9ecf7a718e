"""Side-by-side comparison of methods on one input: ``mmaccel.compare`` and ``mmaccel compare``.

Every method runs in turn on the same prompt through :func:`~mmaccel.eval.generation.generate_measured` (the KV methods
that only compress after a full prefill, together through one shared prefill when that is available), on the sweep
harness (:func:`mmaccel.eval.sweep.sweep`: with ``out_dir`` each record is appended to ``results.jsonl`` as it
finishes, and ``resume`` reuses the finished ones), so all rows have the same fields; the table, the JSON, the charts (:meth:`Comparison.plot`, the same ones the app draws, from
:mod:`mmaccel.eval.plots`) and the app are built from those records.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..data.haystack import NIAHSample, score_answer, score_answer_contains
from ..pipeline import resolve_methods, split_inputs
from .generation import RunRecord, generate_measured, median_or_none
from .sweep import Cell, run_measured_group, save_figure, shares_prefill, sweep, write_atomic

logger = logging.getLogger(__name__)

DEFAULT_METHODS = ("full", "snapkv:budget=1024", "streaming:window=1024")


def text_tokenizer(processor, model: str = "the model"):
    """The tokenizer a text task (NIAH, spec-bench) needs, from what the model's checkpoint loaded.

    Parameters
    ----------
    processor : a tokenizer, or a processor with a ``tokenizer`` (a vision-language model's)
    model : str
        The model's name, for the message.

    Returns
    -------
    The tokenizer.

    Raises
    ------
    ValueError
        If there is no tokenizer: a vision encoder (its processor is an image processor, e.g. ``dinov2-small``) gets
        the commands that take one.
    """
    tokenizer = getattr(processor, "tokenizer", None) or processor
    if callable(getattr(tokenizer, "encode", None)):
        return tokenizer
    from transformers import ImageProcessingMixin

    kind = type(processor).__name__
    if isinstance(processor, ImageProcessingMixin):
        raise ValueError(f"{model} is a vision encoder (it comes with a {kind}, no tokenizer): `mmaccel tome-sweep "
                         f"--model {model}` measures it; compare --task niah, niah and spec-bench need a language "
                         "model (e.g. --model smollm2-135m), compare --task vqa/video-qa and vision-sweep a "
                         "vision-language model (e.g. --model smol-llava)")
    raise ValueError(f"{model} has no tokenizer (it comes with a {kind}); text tasks need a language model, e.g. "
                     "--model smollm2-135m")


def format_bytes(n: int | None) -> str:
    """Human-readable bytes (``"1.5 MiB"``); ``"-"`` for ``None``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def _cell(text: str, width: int = 24) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


@dataclass
class Comparison:
    """Records of several methods run on the same input.

    Attributes
    ----------
    records : list of RunRecord
        One per method, in the order given.
    answer : str or None
        The expected answer, when known (e.g. the needle value of a NIAH sample).
    inputs : dict
        Facts about the input (``prompt_tokens``; NIAH ``length``, ``depth``, ``key``, ``needle_position``).
    """

    records: list[RunRecord]
    answer: str | None = None
    inputs: dict = field(default_factory=dict)

    @property
    def baseline(self) -> RunRecord | None:
        """The first successful ``full`` record, the reference of the KV ratio (``None`` if there is none)."""
        return next((r for r in self.records if r.method_name == "full" and r.ok), None)

    def kv_ratio(self, record: RunRecord) -> float | None:
        """``record.kv_cache_bytes_final / baseline.kv_cache_bytes_final`` (``None`` without a baseline)."""
        base = self.baseline
        if base is None or not record.ok or not base.kv_cache_bytes_final or record.kv_cache_bytes_final is None:
            return None
        return record.kv_cache_bytes_final / base.kv_cache_bytes_final

    def to_dict(self) -> dict:
        """``{"answer", "inputs", "records": [RunRecord.to_dict() + "kv_ratio_vs_full"]}``."""
        rows = []
        for r in self.records:
            row = r.to_dict()
            row["kv_ratio_vs_full"] = self.kv_ratio(r)
            rows.append(row)
        return {"answer": self.answer, "inputs": self.inputs, "records": rows}

    def to_json(self, path=None, indent: int = 2) -> str:
        """The comparison as JSON text; also written to ``path`` when given, atomically (a temp file, then a rename;
        parent folders are created)."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            write_atomic(path, text + "\n")
        return text

    def plot(self, kind: str = "ratios", path=None):
        """Draw the comparison as the app does.

        Parameters
        ----------
        kind : {"ratios", "niah"}
            ``"ratios"``: a grouped bar plot, one group per metric (TTFT, vision-encoder and prefill seconds when
            measured, decode time, tokens/s, peak memory, KV bytes), each bar a record's value divided by the first
            record's (:func:`mmaccel.eval.plots.ratio_figure`). ``"niah"``: the NIAH accuracy heatmap of each method
            (records of NIAH prompts; a comparison on one NIAH sample is a one-cell map).
        path : str or os.PathLike, optional
            Also write the figure there as a PNG (parent folders are created).

        Returns
        -------
        matplotlib.figure.Figure

        Raises
        ------
        ValueError
            An unknown ``kind``; a ratio plot with fewer than two successful records or a failed first record (the
            reference); a NIAH plot of records without NIAH lengths and depths.
        """
        from .plots import metric_rows, niah_figure, ratio_figure

        if kind == "ratios":
            fig = ratio_figure([r.method for r in self.records],
                               [metric_rows(r) if r.ok else None for r in self.records])
            if fig is None:
                raise ValueError("a ratio plot needs at least two successful records, the first of them the reference; "
                                 f"got statuses {[r.status for r in self.records]}")
        elif kind == "niah":
            niah = {k: self.inputs[k] for k in ("length", "depth") if k in self.inputs}
            rows = []
            for r in self.records:
                row = r.to_dict()
                row["extra"] = {**niah, **row["extra"]}
                rows.append(row)
            fig = niah_figure(rows)
        else:
            raise ValueError(f"unknown plot kind {kind!r}; choose 'ratios' or 'niah'")
        if path is not None:
            save_figure(fig, path)
        return fig

    def to_markdown(self) -> str:
        """A Markdown table: method, answer, correct, TTFT (s), tok/s, peak mem, KV bytes, KV ratio vs full.

        "KV bytes" is the K/V held at the end of generation; a failed run shows its error in the answer column.
        """
        header = ["method", "answer", "correct", "TTFT (s)", "tok/s", "peak mem", "KV bytes", "KV ratio vs full"]
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
        for r in self.records:
            if not r.ok:
                cells = [r.method, _cell(f"FAILED: {r.error}", 48), "-", "-", "-", "-", "-", "-"]
            else:
                correct = r.extra.get("correct")
                cells = [
                    r.method,
                    _cell(r.output_text),
                    "-" if correct is None else ("yes" if correct else "no"),
                    _num(r.ttft_s, ".3f"),
                    _num(r.tokens_per_s, ".1f"),
                    format_bytes(r.peak_memory_bytes),
                    format_bytes(r.kv_cache_bytes_final),
                    _num(self.kv_ratio(r), ".3f"),
                ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def compare(
    model,
    tokenizer,
    inputs,
    methods: Sequence = DEFAULT_METHODS,
    *,
    max_new_tokens: int = 32,
    repeats: int = 1,
    warmup: int = 1,
    answer: str | None = None,
    warmup_inputs=None,
    out_dir=None,
    resume: bool = False,
    overwrite: bool = False,
    shared_prefill: bool = True,
    progress: bool | None = None,
) -> Comparison:
    """Run each method in turn on the same input and collect one :class:`RunRecord` per method.

    Parameters
    ----------
    model, tokenizer
        Any Hugging Face causal LM and its tokenizer.
    inputs : str, list of int, torch.Tensor [L] or [1, L], NIAHSample, or a mapping
        One prompt. A NIAH sample also supplies the expected answer. A mapping is a vision-language processor's
        output (``input_ids`` plus ``pixel_values``, ...), passed whole to every run.
    methods : sequence of str or KVMethod
        Specs such as ``["full", "snapkv:budget=256", "streaming:window=256"]`` (default :data:`DEFAULT_METHODS`).
    max_new_tokens, repeats, warmup : int
        See :func:`~mmaccel.eval.generation.generate_measured`.
    answer : str, optional
        Expected answer; when known (given or from a NIAH sample) each record gets ``extra["answer"]``,
        ``extra["correct"]`` (strict: the first number is the answer, :func:`~mmaccel.data.haystack.score_answer`)
        and ``extra["correct_contains"]`` (the answer appears anywhere).
    warmup_inputs : prompt, optional
        What warm-up runs use (e.g. a short prompt); default ``inputs`` itself.
    out_dir : path, optional
        Append each record to ``out_dir/results.jsonl`` as it finishes (``compare.json`` is the caller's:
        :meth:`Comparison.to_json`). A non-empty folder is refused unless ``resume`` (reuse the finished methods)
        or ``overwrite`` (:func:`mmaccel.eval.sweep.check_out_dir`).
    resume, overwrite : bool
        See ``out_dir``.
    shared_prefill : bool
        Run the KV methods that only compress after a full prefill with one shared prefill (when
        ``mmaccel.eval.shared`` is installed); ``False``: each separately.
    progress : bool or None
        The progress bar (``None``: only on a terminal).

    Returns
    -------
    Comparison

    Raises
    ------
    ValueError
        Before any run: an unknown method or bad method arguments, an empty or batched prompt, a bad ``out_dir``.
        A method whose run fails (e.g. out of memory) gets a ``status="failed"`` record and the others still run.
    """
    resolved = resolve_methods(methods)
    info: dict = {}
    if isinstance(inputs, NIAHSample):
        answer = answer if answer is not None else inputs.answer
        info.update(length=inputs.length, depth=inputs.depth, key=inputs.key, needle_position=inputs.needle_position,
                    chat_template=inputs.chat_template)
    ids, _ = split_inputs(inputs, tokenizer)
    info["prompt_tokens"] = int(ids.shape[1])
    prompt = inputs if isinstance(inputs, Mapping) else ids
    fields = {"prompt_tokens": info["prompt_tokens"], **{k: info[k] for k in ("length", "depth") if k in info}}
    cells = [Cell(label, "input", fields, payload=i,
                  group="shared-prefill" if shared_prefill and shares_prefill(method) else None)
             for i, (method, label) in enumerate(resolved)]

    def finish(rec: RunRecord) -> dict:
        if "chat_template" in info:
            rec.extra["chat_template"] = info["chat_template"]
        if answer is not None:
            rec.extra.update(answer=answer, correct=rec.ok and score_answer(rec.output_text, answer),
                             correct_contains=rec.ok and score_answer_contains(rec.output_text, answer))
        return rec.to_dict()

    def run(cell: Cell) -> dict:
        method, label = resolved[cell.payload]
        logger.info("compare: running %s on %d tokens", label, ids.shape[1])
        return finish(generate_measured(
            model, tokenizer, prompt, method=method, label=label, max_new_tokens=max_new_tokens, repeats=repeats,
            warmup=warmup, warmup_ids=warmup_inputs,
        ))

    def run_group(group: list[Cell]) -> list[dict]:
        recs = run_measured_group(model, tokenizer, prompt, [resolved[c.payload] for c in group],
                                  max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup,
                                  warmup_ids=warmup_inputs)
        return [finish(r) for r in recs]

    config = {"methods": [label for _, label in resolved], "max_new_tokens": max_new_tokens, "repeats": repeats,
              "warmup": warmup, "answer": answer, **fields}
    result = sweep(cells, run, out=out_dir, resume=resume, overwrite=overwrite, run_group=run_group, config=config,
                   progress=progress, desc="compare", rotate=False)
    known = set(RunRecord.__dataclass_fields__)
    records = [RunRecord(**{k: v for k, v in r.items() if k in known}) for r in result.records]
    return Comparison(records=records, answer=answer, inputs=info)


#: ``mmaccel compare --task niah``'s methods: full, the bounded method that held full's accuracy on real prose at a
#: quarter of the K/V (issue 35's measurements), a 4-bit quantized cache, and StreamingLLM as the floor
NIAH_DOCS_METHODS = ("full", "chunkkv:method=snapkv,ratio=0.25", "kvquant:bits=4", "streaming:ratio=0.25")


def _per_doc_ratio(records: list[dict], label: str, key: str, *, invert: bool = False,
                   same: str | None = None) -> float | None:
    """Median over documents of ``record[key] / full's record[key]`` on the same document (``invert``: full / it);
    with ``same``, only documents where the record's ``same`` field equals full's (e.g. the same memory meter)."""
    def doc(r):
        return r["extra"].get("length"), r["extra"].get("depth"), r["extra"].get("trial")

    full = {doc(r): r for r in records if r.get("method_name") == "full" and r["status"] == "ok"}
    ratios = []
    for r in records:
        ref = full.get(doc(r))
        base = None if ref is None else ref.get(key)
        if r["method"] != label or r["status"] != "ok" or not base or r.get(key) is None:
            continue
        if same is not None and r.get(same) != ref.get(same):
            continue
        ratios.append(base / r[key] if invert else r[key] / base)
    return median_or_none(ratios)


def _refusal(failed: list[dict]) -> str | None:
    """The one error every failed record of a method shares (a refusal), else ``None``."""
    errors = {str(r.get("error") or "").strip() for r in failed}
    return errors.pop() if len(errors) == 1 else None


def niah_docs_rows(records: list[dict], *, bandwidth_gbps: float | None = None,
                   weight_bytes: int | None = None) -> list[dict]:
    """One row per method over a multi-document NIAH run (``mmaccel compare --task niah``).

    Parameters
    ----------
    records : list of dict
        ``RunRecord.to_dict()`` rows with NIAH ``extra`` (``length``, ``depth``, ``trial``, ``correct``), ``full``
        among them for the ratios.
    bandwidth_gbps, weight_bytes : optional
        The measured memory bandwidth and the model's decode weight bytes
        (:mod:`mmaccel.kernels.roofline`): with both, each row has ``roofline_fraction``, the median over documents
        of tokens/s over ``bandwidth / (weight_bytes + K/V bytes held at the end)``.

    Returns
    -------
    list of dict
        ``method``, ``n`` (successful documents), ``failed``, ``refused`` (the error every document failed with, when
        there is one and no document succeeded; else ``None``), ``correct`` / ``correct_contains`` (counts, strict and
        lenient), ``kv_bytes`` (median K/V bytes after prefill), ``peak_bytes`` (median ``peak_memory_bytes``: for
        members of a shared prefill their own phase, kept K/V plus their decode's growth, see
        :mod:`mmaccel.eval.shared`; otherwise the whole run's growth), ``peak_method`` (how, one string or several
        joined by ``", "``), ``prefill_peak_bytes`` (median of the shared prefill's peak, the group's; ``None``
        without one), and medians over documents of the ratios to ``full`` on the same document: ``kv_ratio``,
        ``peak_memory_ratio`` (only over documents where full's peak was measured the same way), ``prefill_ratio``
        (full's TTFT / the method's: > 1 is faster), ``decode_ratio`` (tokens/s over full's);
        ``roofline_fraction`` when measurable.
    """
    from ..kernels.roofline import roofline_fraction

    rows = []
    for label in dict.fromkeys(r["method"] for r in records):
        mine = [r for r in records if r["method"] == label]
        ok = [r for r in mine if r["status"] == "ok"]
        row = {
            "method": label, "n": len(ok), "failed": len(mine) - len(ok),
            "refused": None if ok else _refusal(mine),
            "correct": sum(bool(r["extra"].get("correct")) for r in ok),
            "correct_contains": sum(bool(r["extra"].get("correct_contains")) for r in ok),
            "kv_bytes": median_or_none([r.get("kv_cache_bytes_prefill") for r in ok]),
            "peak_bytes": median_or_none([r.get("peak_memory_bytes") for r in ok]),
            "peak_method": ", ".join(dict.fromkeys(r.get("peak_memory_method") or "unavailable" for r in ok)) or None,
            "prefill_peak_bytes": median_or_none([r["extra"].get("shared_prefill_peak_bytes") for r in ok]),
            "kv_ratio": _per_doc_ratio(records, label, "kv_cache_bytes_prefill"),
            "peak_memory_ratio": _per_doc_ratio(records, label, "peak_memory_bytes", same="peak_memory_method"),
            "prefill_ratio": _per_doc_ratio(records, label, "ttft_s", invert=True),
            "decode_ratio": _per_doc_ratio(records, label, "tokens_per_s"),
            "shared_prefill": any(r["extra"].get("shared_prefill") for r in ok),
        }
        if bandwidth_gbps and weight_bytes:
            row["roofline_fraction"] = median_or_none([
                roofline_fraction(r.get("tokens_per_s"), bandwidth_gbps, weight_bytes, r.get("kv_cache_bytes_final"))
                for r in ok])
        rows.append(row)
    return rows


def niah_docs_markdown(rows: list[dict], *, speed: bool = True) -> str:
    """The rows of :func:`niah_docs_rows` as a Markdown table (ratios to ``full`` on the same documents).

    Columns: method, correct n/N (or ``refused: <reason>`` when every document failed with one error), K/V bytes and
    ratio, the peak memory (bytes; a member of a shared prefill marks it ``(own phase)``) and its ratio to full's
    measured the same way, the shared prefill's peak (when any row shared one), and with ``speed`` the prefill and
    decode speed ratios (plus the roofline fraction when measured). ``speed=False`` leaves the timings out (for a
    record taken on a loaded machine).
    """
    roofline = speed and any("roofline_fraction" in r for r in rows)
    shared = any(r.get("prefill_peak_bytes") is not None for r in rows)
    header = (["method", "correct", "K/V bytes", "K/V vs full", "peak mem", "peak mem vs full"]
              + (["shared prefill peak"] if shared else [])
              + (["prefill speed vs full", "decode speed vs full"] if speed else [])
              + (["decode / roofline"] if roofline else []))
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for r in rows:
        if r.get("refused"):
            correct = _cell(f"refused: {r['refused']}", 90)
        else:
            correct = f"{r['correct']}/{r['n']}" + (f" ({r['failed']} failed)" if r["failed"] else "")
        own = r.get("prefill_peak_bytes") is not None
        cells = [r["method"], correct, format_bytes(r["kv_bytes"]), _num(r["kv_ratio"], ".3f"),
                 format_bytes(r.get("peak_bytes")) + (" (own phase)" if own and r.get("peak_bytes") else ""),
                 _num(r["peak_memory_ratio"], ".2f")]
        if shared:
            cells.append(format_bytes(r.get("prefill_peak_bytes")))
        if speed:
            cells += [_num(r["prefill_ratio"], ".2f") + (" (shared)" if r["shared_prefill"] else ""),
                      _num(r["decode_ratio"], ".2f")]
        if roofline:
            cells.append(_num(r.get("roofline_fraction"), ".0%"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
