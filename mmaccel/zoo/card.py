"""Model cards for the micro-model zoo, rendered from the training log and the committed NIAH summary."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from ..models.zoo import ZOO, zoo_path


def _fmt_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def niah_table(summary: dict, method: str = "full") -> str:
    """Markdown table, depths as rows and lengths as columns, of one method's NIAH accuracy from ``summary.json``."""
    cells = [c for c in summary.get("methods", {}).get(method, {}).get("cells", []) if c.get("accuracy") is not None]
    if not cells:
        return "(no NIAH results yet)"
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    acc = {(c["length"], c["depth"]): c for c in cells}
    rows = []
    for d in depths:
        row = [f"{d:.2f}"]
        for L in lengths:
            c = acc.get((L, d))
            row.append(f"{100 * c['accuracy']:.0f}% ({c['n']})" if c else "-")
        rows.append(row)
    by_len = []
    for L in lengths:
        cs = [acc[(L, d)] for d in depths if (L, d) in acc]
        n = sum(c["n"] for c in cs)
        by_len.append(f"{100 * sum(c['accuracy'] * c['n'] for c in cs) / max(n, 1):.1f}%")
    rows.append(["**all depths**"] + by_len)
    return _fmt_table(["depth \\ length"] + [str(L) for L in lengths], rows)


_NIAH_COMMAND = (
    "Command: `mmaccel niah --model {name} --methods full --lengths {lengths} --depths 0 0.25 0.5 0.75 1 "
    "--trials 10 --out assets/models/{name}/{out}`"
)


def _facts(max_needles: int) -> str:
    return "1" if max_needles == 1 else f"1-{max_needles}"


def _snapkv_study_findings(study: dict) -> str:
    """The study's per-digit and per-step findings as sentences ('' for a study file without them)."""
    text = ""
    if "snapkv_wrong_digit_positions" in study:
        wrong = ", ".join(f"digit {i + 1}: {n}" for i, n in enumerate(study["snapkv_wrong_digit_positions"]))
        text += (f"\n\nSnapKV's answers {', '.join(study['snapkv_answers'])} (expected "
                 f"{', '.join(study['expected_answers'])}); wrong digits by position: {wrong}.")
    targets = study.get("worst_layer_decode_targets", {})
    if targets.get("per_step_in_needle"):
        steps = "; ".join(f"step {k}: {a}/{b}" for k, (a, b) in targets["per_step_in_needle"].items())
        text += (f" Layer {targets['layer']}'s 4 most-attended prompt positions per query head that lie in the needle, "
                 f"by answer step (step 0 is the last prompt token, which predicts digit 1): {steps}; the others lie "
                 f"a median {targets['median_distance_from_end']} tokens before the end of the prompt.")
    return text


def write_model_card(name: str, out_dir: str | Path | None = None) -> Path:
    """Write ``README.md`` for zoo model ``name`` from ``train_log.json`` and, when present, ``niah/summary.json``.

    Returns
    -------
    Path
        The card's path.

    Raises
    ------
    FileNotFoundError
        If the folder has no ``train_log.json`` (train the model first).
    """
    entry = ZOO[name]
    out = Path(out_dir) if out_dir is not None else zoo_path(name)
    log_path = out / "train_log.json"
    if not log_path.exists():
        raise FileNotFoundError(f"no training log at {log_path}; run `mmaccel zoo train {name}` first")
    log = json.loads(log_path.read_text())
    cfg = json.loads((out / "config.json").read_text())
    weights = out / "model.safetensors"
    recipe = log["recipe"]
    phases = _fmt_table(
        ["phase", "steps", "document tokens", "batch", "facts per document"],
        [
            [i, p["steps"], f"{p['min_len']}-{p['max_len']}", p["batch_size"],
             _facts(p.get("max_needles") or recipe["max_needles"])]
            for i, p in enumerate(recipe["phases"])
        ],
    )
    hist = log.get("history", [])
    keep = hist[:: max(len(hist) // 16, 1)] + ([hist[-1]] if hist else [])
    seen, curve_rows = set(), []
    for h in keep:
        if h["step"] in seen:
            continue
        seen.add(h["step"])
        curve_rows.append(
            [h["step"], h["phase"], f"{h['loss']:.3f}", f"{h['answer_loss']:.3f}", f"{h['answer_acc']:.2f}",
             f"{h['tokens_per_s']:.0f}", f"{h['elapsed_s'] / 60:.1f}"]
        )
    curve = _fmt_table(
        ["step", "phase", "loss", "answer loss", "answer exact (train batch)", "tokens/s", "minutes"], curve_rows
    )
    niah_dir = out / "niah"
    niah_md = f"(not evaluated yet: `mmaccel niah --model {name} --out assets/models/{name}/niah`)"
    if (niah_dir / "summary.json").exists():
        summary = json.loads((niah_dir / "summary.json").read_text())
        niah_md = niah_table(summary) + "\n\n" + _NIAH_COMMAND.format(name=name, out="niah", lengths="512 1024 2048 4096")
        niah_md += "\n\nHeatmap: `niah/heatmap_full.png`; per-trial records: `niah/results.jsonl.gz`."
        if (out / "niah_8k" / "summary.json").exists():
            extra = json.loads((out / "niah_8k" / "summary.json").read_text())
            niah_md += "\n\nBeyond the trained lengths (8k):\n\n" + niah_table(extra) + "\n\n"
            niah_md += _NIAH_COMMAND.format(name=name, out="niah_8k", lengths="8192")
    kv_md = ""
    if (out / "niah_kv" / "summary.json").exists():
        kv_summary = json.loads((out / "niah_kv" / "summary.json").read_text())
        kv_md += "\n## Needle-in-a-haystack under KV-cache methods (greedy, exact match)\n"
        for method in kv_summary.get("methods", {}):
            kv_md += f"\n`{method}`:\n\n" + niah_table(kv_summary, method) + "\n"
        kv_md += (
            f"\nCommand: `mmaccel niah --model {name} --methods {' '.join(kv_summary.get('methods', {}))} "
            f"--lengths 512 1024 2048 4096 --depths 0 0.25 0.5 0.75 1 --trials 10 --warmup 0 "
            f"--out assets/models/{name}/niah_kv`. Heatmaps and per-trial records are in `niah_kv/`.\n"
        )
    if (out / "snapkv_diagnosis.json").exists():
        study = json.loads((out / "snapkv_diagnosis.json").read_text())
        a = study["args"]
        rows = [[condition, f"{sum(hits)}/{len(hits)}"] for condition, hits in study["results"].items()]
        kv_md += (
            "\n## Under SnapKV (`studies/snapkv_diagnosis/snapkv_diagnosis.py`)\n"
            f"{a['length']} tokens, needle depth {a['depth']}, {a['seeds']} seeds, SnapKV budget {a['budget']}, "
            f"window {a['window']}; greedy, exact match. \"layer L only\" compresses one layer and leaves the others "
            "full; \"+ needle\" adds the needle's tokens to SnapKV's selection in every layer; \"+ decode top-n\" adds, "
            "per query head, the n prompt positions the answer tokens attend to most under full attention.\n\n"
            + _fmt_table(["condition", "correct"], rows)
            + _snapkv_study_findings(study)
            + f"\n\nCommand: `python studies/snapkv_diagnosis/snapkv_diagnosis.py --model {name} --out "
            f"assets/models/{name}/snapkv_diagnosis.json`.\n"
        )
    arch = (
        f"`{cfg['architectures'][0]}`: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} query heads / {cfg['num_key_value_heads']} KV heads (GQA), intermediate "
        f"{cfg['intermediate_size']}, RoPE base {cfg.get('rope_parameters', {}).get('rope_theta', cfg.get('rope_theta'))}, "
        f"vocab {cfg['vocab_size']} (byte-level BPE, single digits), tied embeddings"
    )
    text = f"""# {name}

{entry.description}. Part of the mmaccel micro-model zoo: trained from scratch, offline, by mmaccel's own script.
It exists to make quality trade-offs of efficiency methods real and measurable without downloading weights.
It is not a useful language model for anything else.

- Architecture: {arch}.
- Parameters: {log['parameters']:,}; weights {weights.stat().st_size / 1e6:.1f} MB (safetensors, fp32).
- Command: `{log['command']}` (reproduces this folder; `--device cuda` trains the same recipe faster).
- Hardware: {log['device']} ({log['hardware']}), {log['threads']} threads; Python {log['python']}, torch {log['torch']}.
- Steps: {log['steps']}; tokens seen: {log['tokens']:,}; wall time: {log['wall_time_s'] / 60:.1f} min.
- Final training loss: {log['final_loss']:.3f} (all tokens, answer tokens weighted {recipe['answer_weight']}); final answer-token loss: {log['final_answer_loss']:.3f}.

## Data
Documents are generated at training time by `mmaccel.zoo.train.lm.NeedleDocuments`: real English prose from the
docstrings of the running Python's standard library (parsed with `ast`, digits removed so the needle's value is the
only number; 90% training split by a stable hash, the other 10% is the NIAH haystack), with up to
{recipe['max_needles']} planted fact(s) "The secret number of the KEY is NNNNN." with distinct keys, and at the end the question "What is the secret number of the KEY? The secret number of the KEY is"
followed by the answer digits and `</s>`. No third-party text is committed.

## Recipe
AdamW lr {recipe['lr']}, betas {tuple(recipe['betas'])}, weight decay {recipe['weight_decay']}, {recipe['warmup_steps']} warm-up steps then
cosine decay to {recipe['min_lr_ratio']}x, gradient clip {recipe['grad_clip']}, answer-token loss weight {recipe['answer_weight']}, seed {recipe['seed']}.
Length curriculum:

{phases}

{entry.notes}

## Training curve
{curve}

## Needle-in-a-haystack (greedy, full attention, exact match)
{niah_md}
{kv_md}"""
    card = out / "README.md"
    card.write_text(text)
    return card


SEED_STUDY_DIR = "niah_seeds"


def seed_study_line(name: str, labels: list[str], length: int, depth: float) -> str | None:
    """One line with each method's accuracy over the committed many-seed study of a zoo model, for ``compare``.

    Reads ``assets/models/NAME/niah_seeds/summary.json`` (written by ``mmaccel niah ... --out`` that folder). Returns
    ``None`` when ``name`` is not a zoo model, the study does not exist, or it was made at another length or depth,
    so that a single document is never shown without the many-document figure beside it when one exists.
    """
    from ..models.fetched import FETCHED
    from ..models.zoo import ZOO, assets_dir

    if name not in ZOO and name not in FETCHED:
        return None
    path = assets_dir() / name / SEED_STUDY_DIR / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text(encoding="utf-8"))
    cfg = summary.get("config", {})
    if cfg.get("lengths") != [length] or cfg.get("depths") != [depth]:
        return None
    parts = []
    for label in labels:
        m = summary["methods"].get(label)
        if m is None or m["accuracy"] is None:
            continue
        ratio = (m.get("by_length") or [{}])[0].get("kv_ratio_prefill")
        kv = "" if ratio is None or label == "full" else f" (KV ratio {ratio:.2f})"
        parts.append(f"{label} {round(m['accuracy'] * m['n'])}/{m['n']}{kv}")
    if not parts:
        return None
    return (f"Over {cfg.get('trials')} seeds at {length} tokens, depth {depth:g} (committed in "
            f"assets/models/{name}/{SEED_STUDY_DIR}/, strict match): " + ", ".join(parts) + ".")


def _method_rows(summary: dict) -> list[list]:
    from ..eval.compare import format_bytes

    rows = []
    for label, m in summary.get("methods", {}).items():
        for b in m.get("by_length", []):
            ratio = "-" if b.get("kv_ratio_prefill") is None else f"{b['kv_ratio_prefill']:.3f}"
            acc = "-" if b["accuracy"] is None else f"{round(b['accuracy'] * b['n'])}/{b['n']}"
            contains = "-" if b.get("accuracy_contains") is None else f"{round(b['accuracy_contains'] * b['n'])}/{b['n']}"
            ttft = "-" if b.get("median_ttft_s") is None else f"{b['median_ttft_s']:.1f}"
            rows.append([f"`{label}`", b["length"], acc, contains, ratio,
                         format_bytes(b.get("median_kv_cache_bytes_prefill")),
                         format_bytes(b.get("median_peak_memory_bytes")), ttft])
    return rows


def _records_context(folder: Path) -> str:
    """Threads, device and load averages of the records behind a summary, in one sentence."""
    path = next((p for p in (folder / "results.jsonl", folder / "results.jsonl.gz") if p.is_file()), None)
    if path is None:
        return ""
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    loads = sorted(r["load_avg_1m"] for r in recs if r.get("load_avg_1m") is not None)
    threads = sorted({r.get("threads") for r in recs})
    devices = sorted({r.get("device") for r in recs})
    text = f"{len(recs)} runs on {', '.join(map(str, devices))}, {', '.join(map(str, threads))} torch thread(s)"
    if loads:
        text += f", 1-minute load average {loads[0]:.1f}-{loads[-1]:.1f} (other jobs shared the 2 cores: timings are noisy)"
    return text + "."


def _memory_text(mem: dict | None) -> str:
    """The memory paragraph of a card from ``sanity.json``'s ``memory`` ('' without it)."""
    if not mem:
        return ""
    from ..eval.compare import format_bytes

    return (f"\n\nMemory: {mem['parameters']:,} parameters (tied weights once): "
            f"{format_bytes(mem['fp32_bytes'])} in fp32, {format_bytes(mem['bf16_bytes'])} in bf16. Peak resident "
            f"memory of the process after `mmaccel.load` (fp32, checksums included; the safetensors file is "
            f"memory-mapped, so pages count once read): {format_bytes(mem['peak_rss_after_load_bytes'])} (before: "
            f"{format_bytes(mem['peak_rss_before_load_bytes'])}).")


def write_fetched_card(name: str, out_dir: str | Path | None = None) -> Path:
    """Render the measured sections of a fetched model's card into ``assets/models/NAME/README.md``.

    The hand-written part of the card (source, license, conversion, caveats) is kept: everything from the line
    ``<!-- measured: generated by mmaccel.models.card.write_fetched_card -->`` down is replaced by tables built from
    the committed ``sanity.json``, ``niah_seeds/summary.json`` and ``niah/summary.json``.

    Raises
    ------
    FileNotFoundError
        If the card has no hand-written part yet.
    """
    from ..models.zoo import assets_dir

    marker = "<!-- measured: generated by mmaccel.models.card.write_fetched_card -->"
    out = Path(out_dir) if out_dir is not None else assets_dir() / name
    card = out / "README.md"
    if not card.is_file():
        raise FileNotFoundError(f"{card} does not exist: write the hand-written part of the card first")
    head = card.read_text(encoding="utf-8").split(marker)[0].rstrip() + "\n\n" + marker + "\n"
    parts = []
    if (out / "sanity.json").is_file():
        s = json.loads((out / "sanity.json").read_text())
        p = s["perplexity"]
        parts.append(
            "## Sanity checks\n\n"
            f"Perplexity on held-out prose ({p['text']}; {p['windows']} windows of {p['window_tokens']} tokens, "
            f"{p['tokens_scored']:,} tokens scored): **{p['perplexity']:.1f}**. Greedy answers "
            + ("as raw text (the tokenizer has no chat template)" if s.get("chat_template") is False else
               "through the chat template")
            + f" ({s['device']}, {s['dtype']}):\n\n"
            + _fmt_table(["prompt", "answer"], [[g["prompt"], " ".join(g["answer"].split())] for g in s["greedy"]])
            + (("\n\nGreedy raw completions (no chat template, 12 new tokens):\n\n"
                + _fmt_table(["prompt", "completion"], [[" ".join(g["prompt"].split()), " ".join(g["answer"].split())]
                                                        for g in s["completions"]]))
               if s.get("completions") else "")
            + _memory_text(s.get("memory"))
            + f"\n\nCommand: `python benchmarks/causal_lm_sanity.py --model {name} --out assets/models/{name}/sanity.json`."
        )
    header = ["method", "length", "strict", "contains", "KV ratio after prefill", "KV bytes after prefill",
              "peak memory (median)", "TTFT s (median)"]
    for folder, title in ((SEED_STUDY_DIR, "Needle in a haystack over 10 seeds at 4k, depth 0.5"),
                          ("niah", "Needle-in-a-haystack grid")):
        path = out / folder / "summary.json"
        if not path.is_file():
            continue
        summary = json.loads(path.read_text())
        cfg = summary.get("config", {})
        text = (f"## {title}\n\n"
                f"Lengths {cfg.get('lengths')}, depths {cfg.get('depths')}, {cfg.get('trials')} trial(s) per cell, "
                f"chat template {'on' if cfg.get('chat_template') else 'off'}, greedy, max {cfg.get('max_new_tokens')} "
                "new tokens. Strict: the first number of the answer is the needle (the headline); contains: the "
                "needle appears in the answer. The KV ratio is measured against `full` on the same prompts. "
                + _records_context(out / folder) + "\n\n" + _fmt_table(header, _method_rows(summary)))
        if folder == "niah":
            for label in summary.get("methods", {}):
                text += f"\n\n`{label}` by depth (rows) and length (columns):\n\n" + niah_table(summary, label)
            text += "\n\nHeatmaps: `niah/heatmap_*.png`; per-run records: `niah/results.jsonl.gz`."
        else:
            text += f"\n\nPer-run records: `{folder}/results.jsonl.gz`."
        parts.append(text)
    card.write_text(head + "\n" + "\n\n".join(parts) + "\n", encoding="utf-8")
    return card
