"""Per-prompt identity, acceptance and counts from a spec-bench results.jsonl; a cost model from counts.

Modeled cost of one generation, in target one-token forwards: target_forwards * v + draft_forwards * c, with
c = 494M / 1543M multiply-adds per token (qwen2.5-coder-0.5b over -1.5b, LM heads included: arithmetic, not timed)
and v = 1 (a packed verification forward of a few tokens costs about one token's: RESULTS.md, smollm2 packed).
"""
import collections
import json
import sys

C = 494 / 1543
recs = [json.loads(l) for l in open(sys.argv[1])]
print("| set | prompt | task | method | identical | first diff | new tokens | target fwd | draft fwd | mean accepted | acceptance |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
agg = collections.defaultdict(lambda: [0, 0, 0, 0, 0])
for r in recs:
    e, t = r["extra"], r["telemetry"] or {}
    tf = t.get("target_forwards", r["new_tokens"]); df = t.get("draft_forwards", 0) or 0
    if r["method"] == "full": tf, df = r["new_tokens"], 0
    print(f"| {e['prompt_set']} | {e['prompt_id']} | {e['task']} | {r['method']} | {e.get('identical_to_baseline')} | "
          f"{e.get('first_difference')} | {r['new_tokens']} | {tf} | {df} | {t.get('mean_accepted_length') or 1:.2f} | "
          f"{t.get('acceptance_rate') if t.get('acceptance_rate') is None else round(t['acceptance_rate'], 2)} |")
    a = agg[(e["prompt_set"], r["method"])]
    a[0] += r["new_tokens"]; a[1] += tf; a[2] += df; a[3] += bool(e.get("identical_to_baseline") or r["method"] == "full"); a[4] += 1
print()
print("| set | method | identical | new tokens | target fwd | draft fwd | tokens / target fwd | modeled speed-up (v=1, c=0.32) |")
print("|---|---|---|---|---|---|---|---|")
for (s, m), (n, tf, df, ok, cnt) in agg.items():
    print(f"| {s} | {m} | {ok}/{cnt} | {n} | {tf} | {df} | {n / tf:.2f} | {n / (tf + C * df):.2f}x |")
