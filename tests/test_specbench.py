"""Speculative methods through the one measured path (generate_measured -> RunRecord) and `mmaccel spec-bench`.

micro-lm + micro-draft (committed) and a tiny random Llama; no timing assertions.
"""
import json

import pytest
import torch
from test_eval import tiny_model_and_tokenizer
from tiny_models import tiny_llama

import mmaccel
from mmaccel.cli import main
from mmaccel.eval import RunRecord, generate_measured
from mmaccel.eval.specbench import build_prompt_set, run_spec_bench, summarize_spec_bench
from mmaccel.speculative import (
    PEERS,
    HFAssisted,
    SpeculativeMethod,
    build_speculative_method,
    speculative_method_names,
)

pytestmark = pytest.mark.usefixtures("one_thread")

RECORD_FIELDS = set(RunRecord.__dataclass_fields__)
SPEC_TELEMETRY = {"new_tokens", "target_forwards", "draft_forwards", "steps", "proposed_total", "accepted_total",
                  "acceptance_rate", "mean_accepted_length", "forward_ratio", "draft_seconds", "verify_seconds",
                  "prefill_seconds", "total_seconds", "lossless"}
SPECS = ["draft:model=micro-draft", "prompt_lookup:max_ngram=3", "jacobi:k=3", "draft:k=2:adaptive=true",
         "hf_assisted:model=micro-draft", "hf_prompt_lookup:num_tokens=10", "hf_early_exit:layers=2"]


@pytest.fixture(scope="module")
def micro():
    return mmaccel.load("micro-lm", device="cpu")


@pytest.fixture(scope="module")
def micro_prompt(micro):
    _, tok = micro
    return build_prompt_set(tok, "copy", n=1)[0].input_ids


@pytest.fixture(scope="module")
def micro_full(micro, micro_prompt):
    model, tok = micro
    return generate_measured(model, tok, micro_prompt, method="full", max_new_tokens=16, warmup=0)



def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------------- records through one path
@pytest.mark.parametrize("spec", SPECS)
def test_speculative_records_have_the_shared_fields_and_telemetry(micro, micro_prompt, micro_full, spec):
    model, tok = micro
    rec = generate_measured(model, tok, micro_prompt, method=spec, max_new_tokens=16, warmup=0)
    assert rec.ok, rec.error
    assert set(rec.to_dict()) == RECORD_FIELDS and rec.method == spec
    assert rec.output_ids == micro_full.output_ids  # greedy: lossless
    assert rec.new_tokens == len(rec.output_ids) and rec.prompt_tokens == micro_prompt.shape[1]
    assert rec.ttft_s > 0 and rec.decode_s >= 0 and rec.kv_cache_bytes_final > 0
    assert rec.peak_memory_method != "" and rec.threads == 1 and len(rec.samples) == 1
    tel = rec.telemetry
    assert SPEC_TELEMETRY <= set(tel)
    assert tel["new_tokens"] == rec.new_tokens
    assert tel["mean_accepted_length"] >= 1.0 and 0.0 <= (tel["acceptance_rate"] or 0.0) <= 1.0
    assert tel["accepted_total"] <= tel["proposed_total"]
    assert tel["draft_seconds"] >= 0 and tel["verify_seconds"] >= 0
    json.dumps(rec.to_dict())  # JSON-safe
    if spec.startswith(("draft", "hf_assisted", "hf_early_exit")):
        assert tel["draft_forwards"] > 0


def test_registry_resolves_drafters_and_peers():
    assert set(PEERS) == {"hf_assisted", "hf_prompt_lookup", "hf_early_exit"}
    assert {"draft", "prompt_lookup", "pld", "jacobi"} <= set(speculative_method_names())
    m = build_speculative_method("prompt_lookup")
    assert isinstance(m, SpeculativeMethod) and m.num_draft_tokens == 16 and m.lossless  # DEFAULT_K
    assert build_speculative_method("draft:k=6").num_draft_tokens == 6
    assert isinstance(build_speculative_method("hf_assisted", draft="micro-draft"), HFAssisted)
    assert build_speculative_method("hf_prompt_lookup:num_tokens=5").generate_kwargs(None) == {
        "prompt_lookup_num_tokens": 5}
    assert build_speculative_method("hf_early_exit:layers=3").generate_kwargs(None) == {"assistant_early_exit": 3}


@pytest.mark.slow  # 30-60 s on 2 cores; covered in part by faster tests; CI stays inside 25 minutes
def test_tiny_random_llama_with_a_draft_object_is_identical(tmp_path):
    model, tok = tiny_model_and_tokenizer()
    draft = tiny_llama(layers=1, heads=4, kv_heads=2, head_dim=16, max_positions=2048, tokenizer=tok, seed=3)
    res = run_spec_bench(model, tok, ["draft", "prompt_lookup", "jacobi", "hf_assisted", "hf_prompt_lookup"],
                         prompts="copy", n_prompts=2, max_new_tokens=12, repeats=1, warmup=0, draft=draft,
                         out_dir=tmp_path)
    rows = res.summary["sets"]["copy"]
    assert list(rows) == ["full", "draft", "prompt_lookup", "jacobi", "hf_assisted", "hf_prompt_lookup"]
    for label, row in rows.items():
        assert row["failed"] == 0 and not row["flagged"]
        if label != "full":
            assert row["identical"] == row["compared"] == 2
    assert rows["full"]["forward_ratio"] == 1.0 and rows["full"]["speedup"] == 1.0
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 12 and json.loads((tmp_path / "summary.json").read_text())["baseline"] == "full"
    # on the sweep harness: a rerun into the finished folder is refused; --resume reruns nothing, same table
    with pytest.raises(ValueError, match="--resume|--overwrite"):
        run_spec_bench(model, tok, ["draft"], prompts="copy", n_prompts=2, max_new_tokens=12, repeats=1, warmup=0,
                       draft=draft, out_dir=tmp_path)
    again = run_spec_bench(model, tok, ["draft", "prompt_lookup", "jacobi", "hf_assisted", "hf_prompt_lookup"],
                           prompts="copy", n_prompts=2, max_new_tokens=12, repeats=1, warmup=0, draft=draft,
                           out_dir=tmp_path, resume=True)
    assert (tmp_path / "results.jsonl").read_text().splitlines() == lines
    assert [r.output_ids for r in again.records] == [r.output_ids for r in res.records]
    assert again.summary["sets"]["copy"]["draft"]["identical"] == 2


# -------------------------------------------------------------------------------------------------- identity
def test_identity_flag_is_set_and_can_fail(micro, monkeypatch):
    model, tok = micro
    kw = {"prompts": "free", "n_prompts": 1, "max_new_tokens": 8, "repeats": 1, "warmup": 0}
    ok = run_spec_bench(model, tok, ["prompt_lookup"], **kw)
    rec = next(r for r in ok.records if r.method == "prompt_lookup")
    assert rec.extra["identical_to_baseline"] is True and rec.extra["lossless"] is True
    assert ok.summary["sets"]["free"]["prompt_lookup"]["flagged"] is False
    assert "yes 1/1" in ok.to_markdown() and "NOT IDENTICAL" not in ok.to_markdown()

    real = SpeculativeMethod.timed_generate

    def corrupted(self, *args, **kwargs):  # a "lossless" method that changes one token
        run = real(self, *args, **kwargs)
        run["new_ids"] = run["new_ids"][:-1] + [(run["new_ids"][-1] + 1) % 2048]
        return run

    monkeypatch.setattr(SpeculativeMethod, "timed_generate", corrupted)
    bad = run_spec_bench(model, tok, ["prompt_lookup"], **kw)
    rec = next(r for r in bad.records if r.method == "prompt_lookup")
    assert rec.extra["identical_to_baseline"] is False and rec.extra["first_difference"] == rec.new_tokens - 1
    row = bad.summary["sets"]["free"]["prompt_lookup"]
    assert row["flagged"] is True and row["identical"] == 0
    table = bad.to_markdown()
    assert "**NOT IDENTICAL 0/1**" in table and "WARNING: prompt_lookup is lossless" in table


def test_summary_marks_sampling_runs_as_not_compared():
    rec = RunRecord(method="draft", method_name="draft", new_tokens=4, output_ids=[1, 2, 3, 4],
                    telemetry={"target_forwards": 3, "steps": 2, "proposed_total": 4, "accepted_total": 2},
                    extra={"prompt_set": "free", "identical_to_baseline": None, "lossless": True, "total_s": 1.0})
    row = summarize_spec_bench([rec.to_dict()], baseline="full")["sets"]["free"]["draft"]
    assert row["compared"] == 0 and not row["flagged"]
    assert row["mean_accepted_length"] == 2.0 and row["acceptance_rate"] == 0.5


# ------------------------------------------------------------------------------------------------------ CLI
@pytest.mark.slow  # 30-60 s on 2 cores; covered in part by faster tests; CI stays inside 25 minutes
def test_spec_bench_cli_end_to_end(capsys, tmp_path):
    rc, out, err = _run(capsys, "spec-bench", "--model", "micro-lm", "--draft", "micro-draft", "--methods", "draft",
                        "prompt_lookup", "hf_assisted", "hf_prompt_lookup", "--prompts", "both", "--n-prompts", "1",
                        "--max-new-tokens", "8", "--repeats", "1", "--warmup", "1", "--threads", "1", "--out",
                        str(tmp_path))
    assert rc == 0, err
    assert "### prompt set: free" in out and "### prompt set: copy" in out and "1 threads" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "method" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["full (autoregressive)", "draft", "prompt_lookup",
                                                      "hf_assisted", "hf_prompt_lookup"] * 2
    assert all("yes 1/1" in r for r in rows if "autoregressive" not in r)
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 10 and all(set(r) == RECORD_FIELDS | {"cell_id"} and r["status"] == "ok" for r in records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["sets"]) == {"free", "copy"} and summary["config"]["threads"] == 1


@pytest.mark.parametrize(
    "args, match",
    [
        (["--methods", "nosuch"], "unknown KV-cache method 'nosuch' (nor a speculative method)"),
        (["--methods", "draft:k=0"], "draft length k must be an integer >= 1"),
        (["--methods", "prompt_lookup:k=-3"], "draft length k must be an integer >= 1"),
        (["--methods", "hf_prompt_lookup:num_tokens=0"], "num_tokens must be an integer >= 1"),
        (["--methods", "draft:depth=3"], "drafter 'draft' has no argument 'depth'; valid keys: model"),
        (["--temperature", "-0.5"], "--temperature must be >= 0"),
    ],
)
def test_spec_bench_bad_inputs_give_one_error_line(capsys, tmp_path, args, match):
    rc, _, err = _run(capsys, "spec-bench", "--model", "micro-lm", "--out", str(tmp_path), *args)
    assert rc == 2
    assert err.startswith("error: ") and match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results.jsonl").exists()


def test_spec_bench_refuses_a_draft_with_another_tokenizer(capsys, tmp_path, tiny_dir):
    for args in (["--methods", f"draft:model={tiny_dir}"], ["--methods", f"hf_assisted:model={tiny_dir}"],
                 ["--draft", str(tiny_dir), "--methods", "cascade:first=prompt_lookup:then=draft"]):  # nested too
        rc, _, err = _run(capsys, "spec-bench", "--model", "micro-lm", *args, "--out", str(tmp_path))
        assert rc == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
        assert "another tokenizer than the target" in err


def test_python_api_bad_inputs(micro):
    model, tok = micro
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        generate_measured(model, tok, [1, 5, 6], method="prompt_lookup", temperature=-1.0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        run_spec_bench(model, tok, ["prompt_lookup"], temperature=-0.1)
    with pytest.raises(ValueError, match="draft length k must be an integer >= 1"):
        generate_measured(model, tok, [1, 5, 6], method="jacobi:k=0")
    other = tiny_llama(layers=1, vocab_size=64, seed=2)  # another vocabulary, as an object: refused before any run
    with pytest.raises(ValueError, match=r"vocabulary \(64 tokens\) differs"):
        generate_measured(model, tok, [1, 5, 6], method="draft", draft=other)
    with pytest.raises(ValueError, match=r"vocabulary \(64 tokens\) differs"):
        generate_measured(model, tok, [1, 5, 6], method=HFAssisted(other))
    with pytest.raises(ValueError, match="layers=9 must be below the target's 4 layers"):
        generate_measured(model, tok, [1, 5, 6], method="hf_early_exit:layers=9")
    rec = generate_measured(model, tok, [1, 5, 6, 7], method="draft", max_new_tokens=4, warmup=0, temperature=0.8)
    assert rec.ok and rec.new_tokens <= 4 and "acceptance_rate" in rec.telemetry  # sampling runs too
    assert torch.get_num_threads() == 1


# ------------------------------------------------------------------------------------ code prompts, a shared draft
def test_code_prompt_sets_are_seeded_and_shaped():
    from mmaccel.data.code_prompts import CODE_PROMPT_SETS, FUNCTIONS, code_prompts

    assert CODE_PROMPT_SETS == ("code-completion", "code-edit") and len(FUNCTIONS) >= 8
    for name in CODE_PROMPT_SETS:
        a, b = code_prompts(name, 8, seed=0), code_prompts(name, 8, seed=0)
        assert a == b and len(a) == 8 and len({p.function for p in a}) == 8
        assert code_prompts(name, 8, seed=1) != a
        assert all(p.user.strip() and p.lead.startswith("```python\n") for p in a)
    for p in code_prompts("code-completion", 12):  # signature + docstring, no body: the free set
        assert p.task == "complete" and f"def {p.function}(" in p.user and '"""' in p.user
        assert "\n    return" not in p.user and p.lead.endswith('"""\n') and f"def {p.function}(" in p.lead
    edits = code_prompts("code-edit", 12)
    assert {p.task for p in edits} == {"rename_variable", "rename_function", "add_parameter"}
    for p in edits:  # a whole function and an instruction: the copy-heavy set
        signature = next(f[0] for f in FUNCTIONS if f[0].startswith(f"def {p.function}("))
        body = next(f[2] for f in FUNCTIONS if f[0] == signature)
        assert signature in p.user and body in p.user and "\n    return" in p.user and p.lead == "```python\n"
        assert p.user.index("`") < p.user.index("```python")  # the instruction comes first
    for bad in (0, 13):
        with pytest.raises(ValueError, match="ask for 1 to 12"):
            code_prompts("code-edit", bad)
    with pytest.raises(ValueError, match="unknown code prompt set"):
        code_prompts("code", 2)


def test_code_prompt_sets_through_spec_bench(micro):
    _, tok = micro
    from mmaccel.eval.specbench import prompt_set_names

    plain = build_prompt_set(tok, "code-edit", n=2, seed=3)
    assert [p.task for p in plain] == [p.task for p in build_prompt_set(tok, "code-edit", n=2, seed=3)]
    assert plain[0].text.endswith("```python\n") and plain[0].input_ids.shape[1] > 40
    assert prompt_set_names(["both", "code-edit", "free"]) == ["free", "copy", "code-edit"]
    with pytest.raises(ValueError, match="--n-prompts 12 or fewer"):
        prompt_set_names(["code-completion"], 13)
    with pytest.raises(ValueError, match="unknown prompt set 'cod'"):
        prompt_set_names("cod")


def test_int8_draft_and_assistant_share_one_quantized_copy(micro, tmp_path):
    """draft:quantize=int8 and hf_assisted:quantize=int8 get one int8 copy of the one shared draft, plain draft
    keeps the float one; both int8 rows token-identical to greedy (transformers runs the int8 assistant)."""
    from mmaccel.pipeline import resolve_methods
    from mmaccel.speculative import share_draft_models

    model, tok = micro
    specs = ["draft:quantize=int8", "hf_assisted:quantize=int8:schedule=constant", "draft"]
    resolved = resolve_methods(specs, draft="micro-draft")
    shared = share_draft_models([obj for obj, _ in resolved], model)["micro-draft"][0]
    q = resolved[0][0].drafter.model
    assert q is resolved[1][0].model and q is not shared and resolved[2][0].drafter.model is shared
    res = run_spec_bench(model, tok, specs[:2], prompts=["code-edit"], n_prompts=1, max_new_tokens=6, repeats=1,
                         warmup=0, draft="micro-draft", out_dir=tmp_path)
    rows = res.summary["sets"]["code-edit"]
    assert all(rows[s]["identical"] == rows[s]["compared"] == 1 for s in specs[:2])


def test_two_model_pair_on_code_prompts_shares_one_draft(micro, capsys, tmp_path):
    """micro-lm + micro-draft on both code sets: one draft object for the engine's draft model, the cascade's and
    transformers' assistant, each peer's schedule put back after its call; the prompt-lookup -> draft cascade
    token-identical to greedy on both sets (transformers' assistant: test_speculative_records_...); too many code
    prompts refused before loading."""
    from mmaccel.pipeline import resolve_methods
    from mmaccel.speculative import share_draft_models

    model, tok = micro
    specs = ["draft", "hf_assisted:schedule=constant", "hf_assisted:schedule=heuristic:num_tokens=3",
             "cascade:first=prompt_lookup:then=draft:then_k=3"]
    resolved = resolve_methods(specs, draft="micro-draft")
    loaded = share_draft_models([obj for obj, _ in resolved], model)
    shared = loaded["micro-draft"][0]
    assert list(loaded) == ["micro-draft"]
    assert resolved[0][0].drafter.model is shared and resolved[3][0].drafter.then.model is shared
    assert resolved[1][0].model is shared and resolved[2][0].model is shared
    nested = build_speculative_method("cascade:first=prompt_lookup:then=draft,stop_below=0.3", draft="other")
    assert nested.drafter.then.model_ref == "other" and nested.drafter.then.stop_below == 0.3
    named = build_speculative_method("cascade:first=prompt_lookup:then=draft,model=micro-draft", draft="other")
    assert named.drafter.then.model_ref == "micro-draft"
    gc = shared.generation_config
    before = gc.num_assistant_tokens, gc.num_assistant_tokens_schedule
    with resolved[2][0].configured(model):
        assert (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule) == (3, "heuristic")
    assert (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule) == before

    res = run_spec_bench(model, tok, specs[3:], prompts=["code-completion", "code-edit"], n_prompts=1,
                         max_new_tokens=6, repeats=1, warmup=0, draft="micro-draft", out_dir=tmp_path)
    for name in ("code-completion", "code-edit"):
        rows = res.summary["sets"][name]
        assert list(rows) == ["full", *specs[3:]]
        assert all(row["identical"] == row["compared"] == 1 for label, row in rows.items() if label != "full")
    assert {r.extra["task"] for r in res.records if r.extra["prompt_set"] == "code-completion"} == {"complete"}
    cascade = [r for r in res.records if r.method.startswith("cascade")]
    assert all(r.telemetry["drafter_telemetry"]["then"]["draft_model"].endswith("micro-draft") for r in cascade)
    capsys.readouterr()
    rc, _, err = _run(capsys, "spec-bench", "--model", "micro-lm", "--prompts", "code-edit", "--n-prompts", "13",
                      "--out", str(tmp_path / "bad"))
    assert rc == 2 and err.startswith("error: ") and "--n-prompts 12 or fewer" in err
    assert not (tmp_path / "bad" / "results.jsonl").exists()


def test_prompt_sets_take_turns_so_an_interrupted_run_is_balanced(micro, tmp_path):
    """Cells run prompt by prompt with the sets alternating (completion 0, edit 0, completion 1, edit 1), each
    prompt's baseline first: a run stopped half-way holds as many prompts of each set."""
    model, tok = micro
    sets = ["code-completion", "code-edit"]  # built from code, not from the standard library's docstrings: fast
    res = run_spec_bench(model, tok, ["prompt_lookup"], prompts=sets, n_prompts=2, max_new_tokens=2,
                         repeats=1, warmup=0, out_dir=tmp_path)
    order = [(r.extra["prompt_set"], r.extra["prompt_id"], r.method) for r in res.records]
    written = [(r["extra"]["prompt_set"], r["extra"]["prompt_id"], r["method"])
               for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())]
    assert written == order
    assert [(s, m) for s, _, m in order] == [(sets[0], "full"), (sets[0], "prompt_lookup"), (sets[1], "full"),
                                              (sets[1], "prompt_lookup")] * 2
    assert [i for _, i, _ in order][::4] == [0, 1]
