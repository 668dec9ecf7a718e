"""RULER-style tasks (mmaccel.data.ruler), compress once / ask many (mmaccel.longctx.compress) and `mmaccel ruler`
(mmaccel.eval.ruler) on the committed micro-lm, prompts <= 512 tokens."""
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mmaccel.cli import main
from mmaccel.data.ruler import (
    SYNTHETIC_TASKS,
    TASKS,
    load_qa_file,
    make_ruler_sample,
    resolve_tasks,
    score,
    word_list,
)
from mmaccel.longctx import SnapKV, answer, build_method, compress, compress_shared, kv_cache_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
HAYSTACK = ROOT / "README.md"  # any prose file: the built-in one takes a minute to harvest on a busy machine
PROSE = HAYSTACK.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def micro():
    from mmaccel.models import load

    return load("micro-lm", device="cpu")


@pytest.fixture(scope="module")
def tok(micro):
    return micro[1]


# ------------------------------------------------------------------------------------------------------- tasks
def test_task_list_is_rulers():
    assert len(SYNTHETIC_TASKS) == 11 and set(TASKS) == set(SYNTHETIC_TASKS) | {"qa_1", "qa_2"}
    assert resolve_tasks(["all"]) == list(SYNTHETIC_TASKS)
    assert resolve_tasks(["niah", "vt", "niah_single_1"])[-1] == "vt"
    with pytest.raises(ValueError, match="--qa-file"):
        resolve_tasks(["qa_1"])
    with pytest.raises(ValueError, match="unknown RULER task"):
        resolve_tasks(["nope"])
    words = word_list("noun")
    assert len(words) > 1000 and all(w.isalpha() and w.islower() for w in words)


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_every_task_is_seeded_fits_and_holds_its_answers(tok, task):
    a = make_ruler_sample(tok, task, 512, seed=3, haystack=PROSE)
    b = make_ruler_sample(tok, task, 512, seed=3, haystack=PROSE)
    c = make_ruler_sample(tok, task, 512, seed=4, haystack=PROSE)
    assert a.context_ids == b.context_ids and a.queries == b.queries
    assert a.context_ids != c.context_ids
    assert 400 < a.prompt_tokens <= 512  # as much haystack as fits
    context = tok.decode(a.context_ids)
    for q in a.queries:
        assert q.references and all(ref in context for ref in q.references)
        assert not any(ref in tok.decode(q.question_ids) for ref in q.references if len(ref) > 5)  # not given away
        assert a.input_ids(0)[:len(a.context_ids)] == a.context_ids
    if task == "niah_multivalue":
        assert len(a.queries[0].references) == 4
    if task == "cwe":
        assert len(a.queries[0].references) == 10
        counts = {w: context.count(f". {w} ") for w in a.queries[0].references}
        assert min(counts.values()) >= 3  # the common words appear 3 times at this length, the others once


def test_too_short_names_the_minimum(tok):
    with pytest.raises(ValueError, match="at least"):
        make_ruler_sample(tok, "cwe", 40, haystack=PROSE)


def test_score_matches_hand_cases():
    assert score("The numbers are 123 and 456.", ["123", "456"], "all") == 1.0
    assert score("the numbers are 123", ["123", "456"], "all") == 0.5
    assert score("nothing", ["123", "456"], "all") == 0.0
    assert score("It was PARIS.", ["Paris", "Lyon"], "part") == 1.0
    assert score("Lyon\x00!", ["paris", "lyon"], "part") == 1.0
    assert score("Berlin", ["paris", "lyon"], "part") == 0.0
    with pytest.raises(ValueError, match="metric"):
        score("x", ["x"], "most")


def test_qa_loader_on_tiny_squad_and_hotpotqa(tmp_path, tok):
    squad = {"data": [{"paragraphs": [
        {"context": "The capital of Zorbia is Quellon, a city on the river Ast.",
         "qas": [{"question": "What is the capital of Zorbia?", "answers": [{"text": "Quellon"}],
                  "is_impossible": False},
                 {"question": "Who won?", "answers": [], "is_impossible": True}]},
        {"context": "Zorbia exports tin and wool to its neighbours.", "qas": []}]},
        {"paragraphs": [{"context": f"Filler paragraph {i} about the weather in the hills." , "qas": []}
                        for i in range(30)]}]}
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(squad))
    qa = load_qa_file(path)
    assert qa.dataset == "squad" and len(qa.questions) == 1 and len(qa.docs) == 32
    assert qa.questions[0]["related"]  # the article's other paragraph comes first among the distractors
    s = make_ruler_sample(tok, "qa_1", 400, seed=0, qa=qa)
    assert "Quellon" in tok.decode(s.context_ids) and s.queries[0].references == ["Quellon"] and s.metric == "part"
    with pytest.raises(ValueError, match="qa_1"):
        make_ruler_sample(tok, "qa_2", 400, qa=qa)
    hotpot = [{"question": "Which is older?", "answer": "Ast", "context": [["Ast", ["Ast is old. ", "Very."]],
                                                                             ["Bel", ["Bel is new."]]]}]
    (tmp_path / "hotpot.json").write_text(json.dumps(hotpot))
    hq = load_qa_file(tmp_path / "hotpot.json")
    assert hq.dataset == "hotpotqa" and hq.docs == ["Ast\nAst is old. Very.", "Bel\nBel is new."]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="neither SQuAD"):
        load_qa_file(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        load_qa_file(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------------- compress once, ask many
def _kv(cache):
    """Every K/V tensor a cache holds (each KV head's segment for a layer that stores its heads apart)."""
    return [t for layer in cache.layers for t in (layer.kv_tensors() if hasattr(layer, "kv_tensors") else
                                                   (getattr(layer, "keys", None), getattr(layer, "values", None)))
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("spec", ["snapkv:budget=100000", "kvquant:bits=8", "kvzip:ratio=0.25:chunk=128"])
def test_answer_leaves_the_cache_alone_and_an_unbounded_budget_is_plain_generate(micro, spec):
    model, tok = micro
    s = make_ruler_sample(tok, "niah_single_2", 256, seed=1, haystack=PROSE)
    s2 = make_ruler_sample(tok, "niah_multikey_1", 256, seed=1, haystack=PROSE)
    ctx = compress(spec, model, s.context_ids)
    before = [t.clone() for t in _kv(ctx.cache)]
    a1 = answer(model, ctx, s.queries[0].question_ids, 8, do_sample=False)
    answer(model, ctx, s2.queries[0].question_ids, 8, do_sample=False)
    after = _kv(ctx.cache)
    assert len(before) == len(after) > 0 and all(torch.equal(x, y) for x, y in zip(before, after))
    if spec.startswith("snapkv"):
        ids = torch.tensor([s.input_ids()])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        assert a1.new_ids == ref[0, ids.shape[1]:].tolist()


def test_compress_really_compresses_and_shared_gives_the_same_caches(micro):
    model, tok = micro
    s = make_ruler_sample(tok, "niah_single_1", 320, seed=2)
    alone = compress("snapkv:ratio=0.25", model, s.context_ids)
    held = alone.cache.layers[0].keys.shape[-2]
    assert held == -(-len(s.context_ids) // 4)
    zipped = compress("kvzip:ratio=0.25:chunk=128", model, s.context_ids)
    full, snap, kvzip = compress_shared(["full", build_method("snapkv:ratio=0.25"),
                                         build_method("kvzip:ratio=0.25:chunk=128")], model, s.context_ids)
    assert all(torch.equal(x, y) for x, y in zip(_kv(snap.cache), _kv(alone.cache)))
    assert full.cache.layers[0].keys.shape[-2] == len(s.context_ids)
    # KVzip's reconstruction runs after the shared forward: the same slots as its own compress, and it evicted as
    # many slots in all as SnapKV (its budgets are global over layers and KV heads)
    assert kv_cache_bytes(kvzip.cache) == kv_cache_bytes(alone.cache) and kvzip.compress_s > 0
    assert len(_kv(kvzip.cache)) == len(_kv(zipped.cache))
    assert all(torch.equal(x, y) for x, y in zip(_kv(kvzip.cache), _kv(zipped.cache)))
    # the retrieval-head split (dense prefill) shares it too: its streaming heads trimmed as in its own compress
    split = "retrieval_heads:pattern=micro-lm:window=24"
    own, (shared,) = compress(split, model, s.context_ids), compress_shared([split], model, s.context_ids)
    assert len(_kv(shared.cache)) == len(_kv(own.cache)) > 0
    assert all(torch.equal(x, y) for x, y in zip(_kv(shared.cache), _kv(own.cache)))
    assert kv_cache_bytes(shared.cache) < kv_cache_bytes(full.cache)
    question = s.queries[0].question_ids
    assert (answer(model, shared, question, 6, do_sample=False).new_ids
            == answer(model, own, question, 6, do_sample=False).new_ids)


def test_a_method_that_needs_the_question_is_refused(micro):
    @dataclass
    class Peeking(SnapKV):
        needs_question = True

    with pytest.raises(ValueError, match="aware"):
        compress(Peeking(), micro[0], [1, 2, 3])
    with pytest.raises(ValueError, match="KV-cache method"):
        compress(object(), micro[0], [1, 2, 3])


# ---------------------------------------------------------------------------------------------------------- CLI
ARGS = ["ruler", "--model", "micro-lm", "--haystack", str(HAYSTACK), "--chat-template", "off", "--methods",
        "snapkv:ratio=0.25", "kvquant:bits=4", "--tasks", "niah_single_1", "--lengths", "256", "--n", "1",
        "--mode", "both", "--max-new-tokens", "4", "--warmup", "0", "--no-progress"]


def test_ruler_cli_end_to_end_then_resume(capsys, tmp_path):
    out = tmp_path / "r"
    assert main(ARGS + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| full | agnostic |" in printed and "| kvquant:bits=4 | aware |" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sweep"] == {"expected": 6, "found": 6, "failed": 0, "complete": True}
    cells = {(c["method"], c["mode"]): c for c in summary["cells"]}
    assert len(cells) == 6
    fields = {"method", "task", "length", "mode", "accuracy", "n", "kv_bytes_ratio", "peak_memory_ratio", "ttft_ratio",
              "decode_ratio"}
    assert all(fields <= set(c) and c["n"] == 1 for c in cells.values())
    assert cells[("full", "aware")]["kv_bytes_ratio"] == 1.0
    for mode in ("aware", "agnostic"):
        assert 0.2 < cells[("snapkv:ratio=0.25", mode)]["kv_bytes_ratio"] < 0.3
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    full = {(r["extra"]["mode"], r["extra"]["index"]): r["output_ids"] for r in records if r["method"] == "full"}
    assert full[("aware", 0)] == full[("agnostic", 0)]  # same ids, nothing compressed: the same answer
    for name in ("heatmap_aware_256.png", "heatmap_agnostic_256.png", "pareto.png"):
        assert (out / name).stat().st_size > 1000

    # an interrupted run: the last two records lost; --resume runs exactly those again
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text("".join(lines[:-2]))
    (out / "summary.json").unlink()
    assert main(ARGS + ["--out", str(out)]) == 2  # a non-empty folder without --resume is refused
    assert "--resume" in capsys.readouterr().err
    assert main(ARGS + ["--out", str(out), "--resume"]) == 0
    capsys.readouterr()
    again = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(again) == 6 and again[:4] == records[:4]
    assert {r["cell_id"] for r in again} == {r["cell_id"] for r in records}
    assert json.loads((out / "summary.json").read_text())["sweep"]["complete"]


def test_ruler_cli_errors_before_loading(capsys, tmp_path):
    assert main(["ruler", "--tasks", "qa_1", "--out", str(tmp_path / "x")]) == 2
    assert "--qa-file" in capsys.readouterr().err
    assert main(["ruler", "--methods", "snapkv:budget=0", "--out", str(tmp_path / "x")]) == 2
    assert "budget" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
