"""Spec-Bench-style comparison of speculative decoding methods: ``mmaccel spec-bench`` and :func:`run_spec_bench`.

Every method -- plain autoregressive decoding (``full``, the baseline), the engine's drafters and transformers' own
speculative paths -- runs on the same prompts in the same process through the one measured path,
:func:`~mmaccel.eval.generation.generate_measured`, so every row is a :class:`~mmaccel.eval.generation.RunRecord`
with the same fields. Per prompt set and method the summary reports what Spec-Bench reports (Xia et al., "Unlocking
Efficiency in Large Language Model Inference: A Comprehensive Survey of Speculative Decoding", 2024, arXiv
2401.07851): the mean accepted length (tokens per verification forward), the acceptance rate, the draft/verify time
split, tokens/s and the speedup over autoregressive decoding, plus whether each output is token-identical to plain
greedy decoding (Spec-Bench's ``equal.py`` check). A lossless method whose output differs is flagged in the table.

Prompt sets (built offline)
---------------------------
- ``free``: open chat requests (stories, explanations, advice), wrapped in the tokenizer's chat template when it has
  one; the answer has little to copy from the prompt.
- ``copy``: edit, repeat or summarise a held-out paragraph of standard-library prose
  (:func:`mmaccel.data.haystack.stdlib_paragraphs` ``"eval"``) given in the prompt; the answer copies from it (the
  regime where prompt lookup shines: Saxena, 2023; Dumitru et al., 2025, arXiv 2502.08923). The answer starts with
  the text's first words, so base models without a chat template copy too.
- ``code-completion`` (free) and ``code-edit`` (copy-heavy): a coder model's own two regimes
  (:mod:`mmaccel.data.code_prompts`): complete a function's body from its signature and docstring; rewrite a given
  function with a variable or the function renamed or a parameter added. ``both`` means ``free`` and ``copy``.

Timing: one warm-up per method first (unrecorded), then per prompt every method in turn (so a load spike hits all
methods alike), each the median of ``repeats`` runs. ``tokens_per_s`` in the summary is end to end (all new tokens
over all TTFT + decode seconds); ``speedup`` is that divided by the baseline's on the same prompts. On a shared CPU,
forward counts (``forward_ratio``) are the trustworthy number; timings need a quiet machine or one thread.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import statistics
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.code_prompts import CODE_PROMPT_SETS, FUNCTIONS, code_prompts
from ..data.prompts import COPY_TASKS, FREE_PROMPTS, add_typos
from ..kernels.packed_linear import PackedLinears
from ..pipeline import check_temperature, resolve_methods
from ..speculative import draft_holders, share_draft_models
from .generation import RunRecord, generate_measured, load_average
from .sweep import Cell as SweepCell
from .sweep import check_out_dir, finished_records, sweep

logger = logging.getLogger(__name__)

PROMPT_SETS = ("free", "copy", *CODE_PROMPT_SETS)
DEFAULT_METHODS = ("draft", "prompt_lookup", "hf_assisted", "hf_prompt_lookup")
BASELINE = "full"

@dataclass
class BenchPrompt:
    """One prompt of a prompt set.

    Attributes
    ----------
    prompt_set : {"free", "copy", "code-completion", "code-edit"}
    prompt_id : int
        Index within its set.
    task : str
        ``"chat"`` for free prompts; ``"edit"``, ``"repeat"`` or ``"summarise"`` for copy-heavy ones; the
        :class:`~mmaccel.data.code_prompts.CodePrompt` task for code prompts.
    text : str
        The prompt as a string (after the chat template, when used).
    input_ids : torch.LongTensor
        [1, L] token ids.
    """

    prompt_set: str
    prompt_id: int
    task: str
    text: str
    input_ids: torch.Tensor


def _encode(tokenizer, user: str, lead: str, chat: bool) -> tuple[str, torch.Tensor]:
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                             tokenize=False) + lead
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        text = f"{user}\n\n{lead}" if lead else f"{user}\n"
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
    return text, ids


def build_prompt_set(tokenizer, name: str, *, n: int = 8, chat_template: bool = False, seed: int = 0,
                     min_chars: int = 300, max_chars: int = 900) -> list[BenchPrompt]:
    """Build one of the built-in prompt sets, offline and deterministically.

    Parameters
    ----------
    tokenizer : a Hugging Face tokenizer
    name : {"free", "copy", "code-completion", "code-edit"}
        ``"free"``: :data:`FREE_PROMPTS`; ``"copy"``: :data:`COPY_TASKS` in turn over held-out stdlib paragraphs;
        the code sets: :func:`mmaccel.data.code_prompts.code_prompts`.
    n : int
        Prompts, ``>= 1`` (free prompts repeat after :data:`FREE_PROMPTS` runs out; at most 12 code prompts).
    chat_template : bool
        Wrap the user turn in the tokenizer's chat template (the answer lead follows the generation prompt).
    seed : int
        Picks the paragraphs and the typos of the copy set, the functions and edits of the code sets.
    min_chars, max_chars : int
        Length range of the paragraphs, characters.

    Returns
    -------
    list of BenchPrompt

    Raises
    ------
    ValueError
        An unknown set name, ``n < 1``, too few paragraphs in the length range, or more code prompts than
        functions.
    """
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose {', '.join(PROMPT_SETS)} or both")
    if n < 1:
        raise ValueError(f"need at least one prompt per set, got n={n}")
    out = []
    if name in CODE_PROMPT_SETS:
        for i, cp in enumerate(code_prompts(name, n, seed)):
            text, ids = _encode(tokenizer, cp.user, cp.lead, chat_template)
            out.append(BenchPrompt(name, i, cp.task, text, ids))
        return out
    if name == "free":
        for i in range(n):
            text, ids = _encode(tokenizer, FREE_PROMPTS[i % len(FREE_PROMPTS)], "", chat_template)
            out.append(BenchPrompt("free", i, "chat", text, ids))
        return out
    from ..data.haystack import stdlib_paragraphs

    rng = random.Random(seed)
    paras = [p for p in stdlib_paragraphs("eval") if min_chars <= len(p) <= max_chars]
    if len(paras) < n:
        raise ValueError(f"only {len(paras)} held-out paragraphs of {min_chars}-{max_chars} characters; ask for fewer")
    for i, para in enumerate(rng.sample(paras, n)):
        task, instruction, lead = COPY_TASKS[i % len(COPY_TASKS)]
        shown = add_typos(para, rng) if task == "edit" else para
        start = " ".join(para.split()[:3])
        text, ids = _encode(tokenizer, f"{instruction}\n\n{shown}", f"{lead} {start}", chat_template)
        out.append(BenchPrompt("copy", i, task, text, ids))
    return out


def prompt_set_names(prompts: str | Sequence[str], n_prompts: int | None = None) -> list[str]:
    """The prompt sets a ``prompts`` argument names, in order, without repeats (``"both"``: free and copy).

    Parameters
    ----------
    prompts : str or sequence of str
        Set names of :data:`PROMPT_SETS`, or ``"both"``.
    n_prompts : int, optional
        Prompts per set, checked against the code sets' size.

    Returns
    -------
    list of str

    Raises
    ------
    ValueError
        An unknown set name (the message lists the sets), or ``n_prompts`` (when given) above the 12 functions of
        the code sets.
    """
    names = [prompts] if isinstance(prompts, str) else list(prompts)
    out: list[str] = []
    for name in names:
        for s in (("free", "copy") if name == "both" else (name,)):
            if s not in PROMPT_SETS:
                raise ValueError(f"unknown prompt set {s!r}; choose {', '.join(PROMPT_SETS)} or both")
            if s not in out:
                out.append(s)
    limit = len(FUNCTIONS)
    if n_prompts is not None and n_prompts > limit and any(s in CODE_PROMPT_SETS for s in out):
        raise ValueError(f"the code prompt sets have {limit} prompts; use --n-prompts {limit} or fewer")
    return out


def check_draft_tokenizers(resolved: Sequence, tokenizer) -> None:
    """Refuse, from the tokenizers alone (before the target loads), a draft/assistant named by a spec whose
    tokenizer maps tokens to ids differently from the target's (speculative decoding compares token ids: Leviathan
    et al., 2023, arXiv 2211.17192).

    Parameters
    ----------
    resolved : sequence of (method, label)
        From :func:`~mmaccel.eval.generation.resolve_methods`.
    tokenizer : the target's tokenizer

    Raises
    ------
    ValueError
        The message names the method and says to use a draft trained with the target's tokenizer.
    """
    from ..models.loading import load_tokenizer

    refs = {}  # every named draft once, nested ones (a cascade's) included
    for obj, label in resolved:
        for holder in draft_holders(obj):
            ref = getattr(holder, "model_ref", None)
            if isinstance(ref, str):
                refs.setdefault(ref, label)
    for ref, label in refs.items():
        draft_tok = load_tokenizer(ref)
        draft_tok = getattr(draft_tok, "tokenizer", None) or draft_tok
        if draft_tok.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"{label}: the draft model {ref!r} has another tokenizer than the target (its tokens map "
                             "to different ids); use a draft trained with the target's tokenizer "
                             "(e.g. micro-draft for micro-lm)")


@dataclass
class SpecBenchResult:
    """What :func:`run_spec_bench` measured.

    Attributes
    ----------
    records : list of RunRecord
        One per prompt and method; ``extra`` holds ``prompt_set``, ``prompt_id``, ``task``,
        ``identical_to_baseline`` (``None`` when sampling or when the baseline failed), ``first_difference`` (index
        of the first differing token, or ``None``), ``lossless`` and ``baseline``.
    summary : dict
        See :func:`summarize_spec_bench`.
    out_dir : pathlib.Path or None
        Where ``results.jsonl`` and ``summary.json`` were written.
    """

    records: list[RunRecord]
    summary: dict
    out_dir: Path | None = None

    def to_markdown(self) -> str:
        """The Spec-Bench-style table per prompt set (see :func:`spec_bench_table`)."""
        return spec_bench_table(self.summary)


def _kind(obj) -> str:
    return getattr(obj, "kind", "kv")


def _first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _total_seconds(rec: RunRecord) -> float | None:
    totals = [s["ttft_s"] + s["decode_s"] for s in rec.samples
              if s.get("ttft_s") is not None and s.get("decode_s") is not None]
    return statistics.median(totals) if totals else None


def run_spec_bench(
    model,
    tokenizer,
    methods: Sequence,
    *,
    prompts: str | Sequence[str] = "both",
    n_prompts: int = 8,
    max_new_tokens: int = 64,
    repeats: int = 3,
    warmup: int = 1,
    temperature: float = 0.0,
    draft=None,
    chat_template: bool = False,
    seed: int = 0,
    baseline: str = BASELINE,
    out_dir=None,
    packed_linear: bool = False,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
) -> SpecBenchResult:
    """Run every method and the autoregressive baseline on the same prompts; Spec-Bench's table and identity check.

    Parameters
    ----------
    model, tokenizer
        The target causal LM (batch 1) and its tokenizer.
    methods : sequence of str or method objects
        Specs resolved by :func:`~mmaccel.eval.generation.resolve_method`: drafters (``"draft"``,
        ``"prompt_lookup:max_ngram=3"``, ``"jacobi"``), transformers peers (``"hf_assisted"``,
        ``"hf_prompt_lookup:num_tokens=10"``, ``"hf_early_exit:layers=15"``) or KV-cache methods.
    prompts : {"free", "copy", "code-completion", "code-edit", "both"} or a sequence of them
    n_prompts : int
        Prompts per set.
    max_new_tokens : int
        New tokens per generation (fewer at EOS).
    repeats : int
        Measured runs per prompt and method (their median is recorded).
    warmup : int
        Unrecorded warm-up runs per method before anything is measured (on the first prompt).
    temperature : float
        ``0`` = greedy (the identity check applies); ``> 0`` = sampling (identity is not expected: ``None``).
    draft : str or transformers.PreTrainedModel, optional
        Draft model of ``draft`` / ``hf_assisted`` specs that name no ``model=`` (default ``micro-draft``).
    chat_template : bool
        Wrap prompts in the tokenizer's chat template.
    seed : int
        Selects the copy-heavy paragraphs.
    baseline : str
        The autoregressive reference, run first on every prompt (default ``"full"``: plain ``generate``).
    out_dir : path, optional
        Writes ``results.jsonl`` (one record per line, appended and fsynced as it goes) and ``summary.json``
        (atomically), through :func:`mmaccel.eval.sweep.sweep`.
    resume, overwrite : bool
        What to do with a non-empty ``out_dir``: finish it (the runs recorded are kept, the rest run) or replace
        it; refused otherwise, before anything runs.
    progress : bool or None
        The progress bar (``None``: only on a terminal).
    packed_linear : bool
        Run everything, the baseline included, with the linear layers of the target and of the drafts (a draft
        model, an EAGLE head, transformers' assistant) prepacked for oneDNN (:class:`~mmaccel.kernels.PackedLinears`;
        float32 CPU only), so that a verification forward of a few tokens costs about one token's, as on a GPU. The
        originals are put back at the end.

    Returns
    -------
    SpecBenchResult

    Raises
    ------
    ValueError
        Before any run: an unknown method or argument, a draft length ``<= 0``, ``temperature < 0``, a draft model
        with another vocabulary or tokenizer, an unknown prompt set, more than 12 code prompts,
        ``n_prompts``/``max_new_tokens``/``repeats`` ``< 1`` or ``warmup < 0``; with ``packed_linear``, a model
        that is not float32 on the CPU.
    """
    check_temperature(temperature)
    if max_new_tokens < 1 or repeats < 1 or warmup < 0 or n_prompts < 1:
        raise ValueError(f"need max_new_tokens, repeats, n_prompts >= 1 and warmup >= 0; got {max_new_tokens}, "
                         f"{repeats}, {n_prompts}, {warmup}")
    sets = prompt_set_names(prompts, n_prompts)
    methods = [methods] if isinstance(methods, str) else list(methods)
    out_dir = check_out_dir(out_dir, resume=resume, overwrite=overwrite) if out_dir is not None else None
    resolved = resolve_methods([baseline] + [m for m in methods if m != baseline], draft=draft)
    share_draft_models([obj for obj, _ in resolved], model)  # one copy of each named draft for every method
    for obj, _ in resolved:
        prepare = getattr(obj, "prepare", None)
        if callable(prepare) and hasattr(obj, "timed_generate"):
            prepare(model, tokenizer)  # loads drafts once; refuses another vocabulary before any run
    drafts = [m for obj, _ in resolved for m in getattr(obj, "draft_modules", list)()]
    with PackedLinears(model, *drafts) if packed_linear else nullcontext():
        return _measure(model, tokenizer, resolved, sets, n_prompts=n_prompts, max_new_tokens=max_new_tokens,
                        repeats=repeats, warmup=warmup, temperature=temperature, chat_template=chat_template,
                        seed=seed, out_dir=out_dir, packed_linear=packed_linear, resume=resume,
                        overwrite=overwrite, progress=progress)


def _measure(model, tokenizer, resolved, sets, *, n_prompts, max_new_tokens, repeats, warmup, temperature,
             chat_template, seed, out_dir, packed_linear, resume, overwrite, progress) -> SpecBenchResult:
    """The runs of :func:`run_spec_bench`, after its checks (``resolved``: its (method, label) pairs, baseline
    first)."""
    base_label = resolved[0][1]
    prompt_sets = {s: build_prompt_set(tokenizer, s, n=n_prompts, chat_template=chat_template, seed=seed)
                   for s in sets}

    kw = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    first = prompt_sets[sets[0]][0]
    if warmup:
        logger.info("warming up %d methods", len(resolved))
        for obj, label in resolved:
            generate_measured(model, tokenizer, first.input_ids, method=obj, label=label, repeats=warmup, warmup=0,
                              **kw)
    config = {"max_new_tokens": max_new_tokens, "repeats": repeats, "warmup": warmup, "temperature": temperature,
              "n_prompts": n_prompts, "prompt_sets": sets, "chat_template": chat_template, "seed": seed,
              "packed_linear": packed_linear, "methods": [label for _, label in resolved]}
    # every method on one prompt, the baseline first (the others' identity check refers to it); the sets take
    # turns prompt by prompt, so an interrupted run holds as many prompts of each set
    order = [(s, p) for i in range(n_prompts) for s in sets for p in prompt_sets[s][i:i + 1]]
    cells = [SweepCell(label, sample=f"{s}/{p.prompt_id}", fields={"prompt_set": s, "prompt_id": p.prompt_id},
                       payload=(obj, p)) for s, p in order for obj, label in resolved]
    baselines = {(r["extra"]["prompt_set"], r["extra"]["prompt_id"]): r["output_ids"]
                 for r in (finished_records(out_dir) if resume and out_dir else {}).values()
                 if r.get("method") == base_label and r.get("status") == "ok"}

    def run(cell) -> dict:
        obj, p = cell.payload
        s, label = cell.fields["prompt_set"], cell.method
        rec = generate_measured(model, tokenizer, p.input_ids, method=obj, label=label, repeats=repeats, warmup=0,
                                **kw)
        if label == base_label and rec.ok:
            baselines[(s, p.prompt_id)] = rec.output_ids
        base_ids = baselines.get((s, p.prompt_id))
        identical = first_diff = None
        if temperature == 0 and base_ids is not None and rec.ok:
            identical = rec.output_ids == base_ids
            first_diff = None if identical else _first_difference(rec.output_ids, base_ids)
        lossless = bool(getattr(obj, "lossless", True))
        rec.extra.update(prompt_set=s, prompt_id=p.prompt_id, task=p.task, kind=_kind(obj),
                         baseline=label == base_label, identical_to_baseline=identical, first_difference=first_diff,
                         lossless=lossless, total_s=_total_seconds(rec))
        if identical is False and lossless:
            logger.warning("%s: output differs from plain greedy decoding on %s prompt %d (first at token %s) "
                           "although the method is lossless", label, s, p.prompt_id, first_diff)
        return rec.to_dict()

    def summarize(records: list[dict]) -> dict:
        summary = summarize_spec_bench(records, base_label)
        summary["config"] = {**{k: v for k, v in config.items() if k != "methods"},
                             "threads": torch.get_num_threads(), "load_avg_1m_end": load_average(),
                             "device": records[0]["device"] if records else "",
                             "dtype": records[0]["dtype"] if records else ""}
        return summary

    done = sweep(cells, run, out=out_dir, resume=resume, overwrite=overwrite, summarize=summarize, config=config,
                 progress=progress, desc="spec-bench", rotate=False)
    fields = {f.name for f in dataclasses.fields(RunRecord)}
    records = [RunRecord(**{k: v for k, v in r.items() if k in fields}) for r in done.records]
    return SpecBenchResult(records=records, summary=done.summary, out_dir=out_dir)


def _sum(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) if values else None


def summarize_spec_bench(records: list[dict], baseline: str = BASELINE) -> dict:
    """Aggregate records (``RunRecord.to_dict()`` with the ``extra`` of :func:`run_spec_bench`) per set and method.

    Returns
    -------
    dict
        ``{"baseline": label, "sets": {set: {label: row}}}``; a row holds ``n``, ``failed``, ``kind``, ``lossless``,
        ``identical`` (prompts token-identical to the baseline), ``compared``, ``flagged`` (a lossless method not
        identical on some prompt), ``new_tokens``, ``total_s`` (s), ``tokens_per_s`` (end to end),
        ``median_decode_tokens_per_s``, ``speedup`` (vs the baseline's ``tokens_per_s``), ``target_forwards``,
        ``forward_ratio`` (new tokens per target forward; 1.0 for autoregressive decoding),
        ``mean_accepted_length`` (new tokens per verification step), ``acceptance_rate`` (accepted / proposed draft
        tokens), ``draft_s`` and ``verify_s`` (s) -- aggregated over the prompts, ``None`` where not defined.
    """
    out: dict = {"baseline": baseline, "sets": {}}
    for rec in records:
        s = rec["extra"]["prompt_set"]
        out["sets"].setdefault(s, {}).setdefault(rec["method"], []).append(rec)
    for s, by_method in out["sets"].items():
        rows = {}
        for label, recs in by_method.items():
            ok = [r for r in recs if r["status"] == "ok"]
            tel = [r["telemetry"] for r in ok]
            is_ar = bool(ok) and all("target_forwards" not in t for t in tel)
            new = sum(r["new_tokens"] for r in ok)
            total = _sum(r["extra"].get("total_s") for r in ok)
            if is_ar:  # autoregressive: one target forward per new token, nothing drafted
                forwards, steps, proposed, accepted, draft_s, verify_s = new, new, None, None, None, None
            else:
                forwards = _sum(t.get("target_forwards") for t in tel)
                steps = _sum(t.get("steps") for t in tel)
                proposed = _sum(t.get("proposed_total") for t in tel)
                accepted = _sum(t.get("accepted_total") for t in tel)
                draft_s = _sum(t.get("draft_seconds") for t in tel)
                verify_s = _sum(t.get("verify_seconds") for t in tel)
            compared = [r["extra"].get("identical_to_baseline") for r in ok
                        if r["extra"].get("identical_to_baseline") is not None]
            lossless = all(r["extra"].get("lossless", True) for r in recs)
            decode_tps = [r["tokens_per_s"] for r in ok if r["tokens_per_s"] is not None]
            rows[label] = {
                "n": len(recs),
                "failed": len(recs) - len(ok),
                "kind": recs[0]["extra"].get("kind"),
                "method_name": recs[0].get("method_name"),
                "lossless": lossless,
                "compared": len(compared),
                "identical": sum(bool(c) for c in compared),
                "flagged": lossless and any(c is False for c in compared),
                "new_tokens": new,
                "total_s": total,
                "tokens_per_s": new / total if total else None,
                "median_decode_tokens_per_s": statistics.median(decode_tps) if decode_tps else None,
                "target_forwards": forwards,
                "forward_ratio": new / forwards if forwards else None,
                "mean_accepted_length": new / steps if steps else None,
                "acceptance_rate": accepted / proposed if proposed else None,
                "draft_s": draft_s,
                "verify_s": verify_s,
            }
        base = rows.get(baseline)
        for row in rows.values():
            row["speedup"] = (row["tokens_per_s"] / base["tokens_per_s"]
                              if base and base["tokens_per_s"] and row["tokens_per_s"] else None)
        out["sets"][s] = rows
    return out


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def spec_bench_table(summary: dict) -> str:
    """Markdown: per prompt set, one row per method (Spec-Bench's columns plus forward counts and identity).

    A lossless method whose output is not token-identical to the baseline on some prompt shows
    ``**NOT IDENTICAL k/n**`` and a warning line under its table.
    """
    lines = []
    base = summary.get("baseline", BASELINE)
    for s, rows in summary["sets"].items():
        lines.append(f"### prompt set: {s}")
        lines.append("| method | identical to greedy | mean accepted length | acceptance rate | draft s | verify s | "
                     "target forwards | tokens / forward | tokens/s | speedup |")
        lines.append("|" + "---|" * 10)
        warnings = []
        for label, r in rows.items():
            if label == base:
                ident = "(baseline)"
            elif not r["compared"]:
                ident = "-"
            elif r["identical"] == r["compared"]:
                ident = f"yes {r['identical']}/{r['compared']}"
            elif r["flagged"]:
                ident = f"**NOT IDENTICAL {r['identical']}/{r['compared']}**"
                warnings.append(f"WARNING: {label} is lossless but its output differs from plain greedy decoding on "
                                f"{r['compared'] - r['identical']} of {r['compared']} prompts")
            else:
                ident = f"no {r['identical']}/{r['compared']} (lossy)"
            name = f"{label} (autoregressive)" if label == base else label
            if r["failed"]:
                name += f" ({r['failed']} failed)"
            lines.append(
                f"| {name} | {ident} | {_f(r['mean_accepted_length'], '.2f')} | {_f(r['acceptance_rate'], '.2f')} | "
                f"{_f(r['draft_s'], '.3f')} | {_f(r['verify_s'], '.3f')} | {_f(r['target_forwards'], 'd')} | "
                f"{_f(r['forward_ratio'], '.2f')} | {_f(r['tokens_per_s'], '.1f')} | {_f(r['speedup'], '.2f')}x |"
            )
        lines.extend(warnings)
        lines.append("")
    return "\n".join(lines).rstrip()
