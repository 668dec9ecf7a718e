"""Does Quest's page bound find the needle? Per decode step, layer and KV head: the pages Quest would read against the
pages the real attention weighs most (a study of the Quest misses on smollm2-135m, quality not speed).

One greedy run with full attention per document. At every decode step a forward hook on each attention module
recomputes the step's post-RoPE queries (``q_proj`` + transformers' ``apply_rotary_pos_emb`` with the step's
``position_embeddings``); the keys are the full cache's. For each (step, layer, KV head) and budget:

- ``quest``: Quest's top pages by the min/max upper bound (:func:`mmaccel.longctx.quest.quest_page_scores`, averaged
  over the GQA group, the newest page always included), as ``quest:ratio=R`` reads them;
- ``quest_group_max``: the same bound, but the maximum over the group's query heads instead of the mean;
- ``oracle``: the same number of pages ranked by the true attention mass they receive (summed over the group).

It reports the needle-digit recall of both (the fraction of the answer's digit tokens whose page is read), overall
and restricted to the (layer, head) pairs that put at least ``--mass`` of their attention on the digits (the heads
that do the retrieval), and the attention mass each selection keeps.

Usage::

    python studies/needle_digits/quest_recall.py --length 4096 --documents 6 --ratios 0.1 0.25 --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from needle_digits_kept import needle_digit_positions  # the script's own folder
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import mmaccel
from mmaccel.data.haystack import make_niah_sample
from mmaccel.kernels.hf import attention_modules
from mmaccel.longctx.quest import page_bounds, quest_page_scores


def capture_queries(model) -> tuple[dict, list]:
    """Forward hooks storing each decode step's post-RoPE queries per layer: ``store[layer] = [[B, Hq, 1, D], ...]``."""
    store: dict[int, list] = {}
    handles = []
    for idx, module in attention_modules(model).items():
        def hook(mod, args, kwargs, output, idx=idx):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            if hidden.shape[1] != 1:
                return  # the prefill
            B, D = hidden.shape[0], mod.head_dim
            q = mod.q_proj(hidden).view(B, 1, -1, D).transpose(1, 2)
            cos, sin = kwargs["position_embeddings"]
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            store.setdefault(idx, []).append(q.detach())
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return store, handles


def page_selection(scores: torch.Tensor, k: int) -> torch.Tensor:
    """bool [Hkv, P]: the top-``k`` pages of ``scores`` [Hkv, P], the newest page always among them."""
    scores = scores.clone()
    scores[:, -1] = float("inf")
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    return chosen.scatter_(1, scores.topk(k, dim=-1).indices, True)


def study_document(model, tok, length: int, depth: float, seed: int, ratios, page_size: int, mass: float,
                   new_tokens: int) -> dict:
    sample = make_niah_sample(tok, length, depth, seed=seed, chat_template=True)
    ids = torch.tensor([sample.input_ids])
    digits = torch.tensor(needle_digit_positions(tok, sample, ids))
    store, handles = capture_queries(model)
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False)
    finally:
        for h in handles:
            h.remove()
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    rows = []  # one per (ratio, step, layer, kv head)
    for layer, queries in store.items():
        keys = cache.layers[layer].keys[0]  # [Hkv, T, D]
        Hkv, D = keys.shape[0], keys.shape[-1]
        for step, q in enumerate(queries):
            T = ids.shape[1] + step + 1  # keys visible to this decode step's query (itself included)
            k_t = keys[:, :T].float()
            Hq = q.shape[1]
            g = Hq // Hkv
            probs = torch.softmax((q[0, :, 0].float().view(Hkv, g, D) @ k_t.transpose(1, 2)) / math.sqrt(D), -1)
            attn = probs.sum(1)  # [Hkv, T] attention mass summed over the group
            on_digits = attn[:, digits].sum(-1) / g  # [Hkv] mean over the group's heads
            P = -(-T // page_size)
            page_mass = torch.zeros(Hkv, P).index_add_(1, torch.arange(T) // page_size, attn)
            lo, hi = page_bounds(k_t[None], page_size)
            bound = quest_page_scores(q.float(), lo, hi)[0]  # [Hkv, P], averaged over the group
            bound_max = quest_page_scores(q.float(), lo, hi, group="max")[0]
            digit_pages = digits // page_size
            for ratio in ratios:
                k = min(P, max(1, math.ceil(math.ceil(ratio * T) / page_size)))
                for name, scores in (("quest", bound), ("quest_group_max", bound_max), ("oracle", page_mass)):
                    sel = page_selection(scores, k)
                    recall = sel[:, digit_pages].float().mean(-1)  # [Hkv]
                    kept = (page_mass * sel).sum(-1) / g  # attention mass read, mean over the group
                    for h in range(Hkv):
                        rows.append({"ratio": ratio, "selector": name, "step": step, "layer": layer, "head": h,
                                     "digit_mass": float(on_digits[h]), "digit_recall": float(recall[h]),
                                     "mass_read": float(kept[h])})
    return {"depth": depth, "seed": seed, "answer": sample.answer, "output": text,
            "correct": sample.answer in text, "rows": rows}


def summarize(docs: list[dict], ratios, mass: float) -> dict:
    """Mean digit recall and attention mass read per (ratio, selector), over all heads and over retrieval heads."""
    out = {}
    for ratio in ratios:
        for name in ("quest", "quest_group_max", "oracle"):
            rows = [r for d in docs for r in d["rows"] if r["ratio"] == ratio and r["selector"] == name]
            hot = [r for r in rows if r["digit_mass"] >= mass]
            out[f"{name}@{ratio}"] = {
                "digit_recall_all_heads": sum(r["digit_recall"] for r in rows) / max(1, len(rows)),
                "digit_recall_retrieval_heads": sum(r["digit_recall"] for r in hot) / max(1, len(hot)),
                "retrieval_head_rows": len(hot),
                "mass_read": sum(r["mass_read"] for r in rows) / max(1, len(rows)),
                "retrieval_recall_by_step": [
                    round(sum(r["digit_recall"] for r in at) / len(at), 3) if at else None
                    for at in ([r for r in hot if r["step"] == t] for t in range(max((r["step"] for r in rows),
                                                                                     default=-1) + 1))
                ],
            }
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--documents", type=int, default=6, help="depths spread over (0, 1), one seed each")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.25])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--mass", type=float, default=0.1, help="digit attention mass that marks a retrieval head")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = mmaccel.load(args.model, device="cpu")
    docs = []
    for i in range(args.documents):
        depth = (i + 0.5) / args.documents
        docs.append(study_document(model, tok, args.length, depth, i, args.ratios, args.page_size, args.mass,
                                   args.new_tokens))
        print(f"document {i}: depth {depth:.2f}, answer {docs[-1]['answer']}, output {docs[-1]['output']!r}",
              flush=True)
    summary = summarize(docs, args.ratios, args.mass)
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "documents": [{k: v for k, v in d.items() if k != "rows"} for d in docs], "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
