"""The visual-token evaluations (vision-sweep, video-niah, tome-sweep, compare --task vqa/video-qa) on tiny random
models: the smol-llava build of ``test_smol_llava``'s tiny Dinov2 + Llama parts at 84 px (6 x 6 = 36 visual tokens
per image), saved as a checkpoint folder for the CLI, and the tiny Dinov2 alone for tome-sweep."""
import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
from test_smol_llava import parts  # noqa: F401 - the tiny Dinov2 / Llama parts fixture

from mmaccel.cli import main
from mmaccel.data.scenes import make_scene_qa
from mmaccel.eval.video_niah import summarize_video, video_niah
from mmaccel.eval.vision_sweep import BASELINE, PrefillCost, summarize_sweep, sweep_table, vision_sweep
from mmaccel.eval.visual import VisualConfig, parse_visual_config
from mmaccel.kernels.hf import hooked_cache
from mmaccel.models import smol_llava as sl
from mmaccel.vision_tokens import Pooling
from mmaccel.zoo.train import smol_llava as tr

pytestmark = pytest.mark.usefixtures("one_thread")

PER_IMAGE = 36  # (84 // 14) ** 2


@pytest.fixture(scope="module")
def vlm(parts):  # noqa: F811 - the imported fixture
    """A tiny smol-llava (the real build code) at 84 px and its processor."""
    return sl.build_llava(*parts, recipe=sl.BuildRecipe(image_size=84))


@pytest.fixture(scope="module")
def vlm_dir(vlm, tmp_path_factory):
    """The tiny smol-llava saved as a checkpoint folder with its processor (what ``--model DIR`` loads)."""
    path = tmp_path_factory.mktemp("tiny-smol-llava")
    vlm[0].save_pretrained(path)
    vlm[1].save_pretrained(path)
    return str(path)


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@dataclass
class Broken(Pooling):
    """A visual-token method whose every run raises: the sweep must record it and go on."""

    name: ClassVar[str] = "broken"

    def plan_image(self, features, grid, info):
        raise RuntimeError("boom: planning failed")


# --------------------------------------------------------------------------------------------------- vision-sweep
@pytest.fixture(scope="module")
def sweep(vlm, tmp_path_factory):
    out = tmp_path_factory.mktemp("vision-sweep")
    model, processor = vlm
    result = vision_sweep(model, processor, ["fastv:layer=1", Broken()], [1.0, 0.25], n=2, warmup=0,
                          out_dir=out, progress=False)
    return result, out


def test_vision_sweep_writes_records_summary_and_plot(sweep):
    result, out = sweep
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # pooling is added; per question: the baseline + 3 methods x 2 budgets
    assert len(rows) == 2 * (1 + 3 * 2) == len(result.records)
    assert [r["method"] for r in rows[:7]] == [BASELINE, "pooling:keep_ratio=1", "pooling:keep_ratio=0.25",
                                               "fastv:layer=1:keep_ratio=1", "fastv:layer=1:keep_ratio=0.25",
                                               "broken:keep_ratio=1", "broken:keep_ratio=0.25"]
    for r in rows:
        assert {"cell", "budget", "question_index", "kind", "answer", "correct", "visual_tokens_input",
                "lm_prefill_flops", "flops_ratio", "same_as_baseline"} <= set(r["extra"])
        assert r["extra"]["visual_tokens_input"] == PER_IMAGE
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    assert summary["config"]["methods"] == ["pooling", "fastv:layer=1", "broken"]
    assert summary["config"]["budgets"] == [1.0, 0.25]
    cell_keys = {"label", "method", "budget", "accuracy", "n", "failed", "error", "median_visual_tokens_kept",
                 "kept_ratio", "median_vision_encoder_s", "median_prefill_s", "median_ttft_s", "median_decode_s",
                 "prefill_speedup", "ttft_speedup", "flops_ratio", "agreement", "by_kind", "accuracy_se", "vs_pooling"}
    assert all(cell_keys <= set(c) for c in summary["cells"])
    base = summary["baseline"]
    assert base["n"] == 2 and base["failed"] == 0 and base["visual_tokens"] == PER_IMAGE
    assert base["accuracy"] == np.mean([r["extra"]["correct"] for r in rows if r["method"] == BASELINE])
    assert _is_png(out / "accuracy_vs_budget.png") and result.plot == out / "accuracy_vs_budget.png"


def test_a_failing_method_is_recorded_and_the_rest_run(sweep):
    result, _ = sweep
    for budget in ("1", "0.25"):
        broken = result.cell(f"broken:keep_ratio={budget}")
        assert broken["failed"] == 2 and broken["n"] == 0 and broken["accuracy"] is None
        assert "RuntimeError: boom" in broken["error"]
    ok = [c for c in result.summary["cells"] if c["method"] != "broken"]
    assert len(ok) == 4 and all(c["n"] == 2 and c["failed"] == 0 and c["accuracy"] is not None for c in ok)
    failed = [r for r in result.records if r["status"] == "failed"]
    assert {r["extra"]["cell"] for r in failed} == {"broken"} and all(r["extra"]["flops_ratio"] is None for r in failed)


def test_vision_sweep_refuses_a_finished_out_and_resumes_without_rerunning(sweep, vlm, tmp_path):
    """On the sweep harness: a rerun into the finished folder is refused and leaves it byte-identical; --resume with
    every cell finished runs nothing and gives the same summary; a half-finished folder resumes the missing runs."""
    result, out = sweep
    model, processor = vlm
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    args = (model, processor, ["fastv:layer=1", Broken()], [1.0, 0.25])
    with pytest.raises(ValueError, match="--resume|--overwrite"):
        vision_sweep(*args, n=2, warmup=0, out_dir=out, progress=False)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    half = tmp_path / "half"
    half.mkdir()
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (half / "results.jsonl").write_text("".join(lines[:9]))  # question 0 and two runs of question 1
    (half / "sweep.json").write_text((out / "sweep.json").read_text())
    resumed = vision_sweep(*args, n=2, warmup=0, out_dir=half, progress=False, resume=True)
    rows = [json.loads(line) for line in (half / "results.jsonl").read_text().splitlines()]
    assert [r["cell_id"] for r in rows] == [json.loads(line)["cell_id"] for line in lines]
    assert [r["output_ids"] for r in rows] == [r["output_ids"] for r in result.records]
    # the resumed runs still refer to question 1's baseline, read back from the file
    assert [r["extra"]["same_as_baseline"] for r in rows] == [r["extra"]["same_as_baseline"] for r in result.records]
    assert resumed.summary["sweep"]["complete"]
    assert resumed.summary["baseline"]["accuracy"] == result.summary["baseline"]["accuracy"]


def test_full_budget_gives_the_baseline_answers_and_small_budgets_keep_fewer_tokens(sweep):
    result, _ = sweep
    base = {r["extra"]["question_index"]: r["output_ids"] for r in result.records if r["method"] == BASELINE}
    for label in ("pooling:keep_ratio=1", "fastv:layer=1:keep_ratio=1"):
        runs = [r for r in result.records if r["method"] == label]
        assert [r["output_ids"] for r in runs] == [base[r["extra"]["question_index"]] for r in runs]
        cell = result.cell(label)
        assert cell["agreement"] == 1.0 and cell["median_visual_tokens_kept"] == PER_IMAGE
        assert cell["flops_ratio"] == 1.0 and cell["kept_ratio"] == 1.0
    for label in ("pooling:keep_ratio=0.25", "fastv:layer=1:keep_ratio=0.25"):
        cell = result.cell(label)
        assert cell["median_visual_tokens_kept"] == 9 and cell["kept_ratio"] == 0.25
        assert 0 < cell["flops_ratio"] < 1 and cell["prefill_speedup"] > 0
    # FastV keeps every token in layer 0: it saves less than pooling at the same budget
    assert result.cell("fastv:layer=1:keep_ratio=0.25")["flops_ratio"] > result.cell("pooling:keep_ratio=0.25")[
        "flops_ratio"]


def test_flops_estimate_follows_the_stated_formula(vlm, sweep):
    result, _ = sweep
    model = vlm[0]
    layers = model.model.language_model.layers
    params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    d = model.config.text_config.num_attention_heads * model.config.text_config.head_dim
    rec = next(r for r in result.records if r["method"] == "fastv:layer=1:keep_ratio=0.25")
    base = next(r for r in result.records if r["method"] == BASELINE
                and r["extra"]["question_index"] == rec["extra"]["question_index"])
    L, kept = rec["prompt_tokens"], rec["prompt_tokens"] - PER_IMAGE + 9
    expected = 2 * params[0] * L + 2 * L * L * d + 2 * params[1] * kept + 2 * kept * kept * d
    assert PrefillCost.of(model).tokens_per_layer(rec) == [L, kept]
    assert rec["extra"]["lm_prefill_flops"] == pytest.approx(expected)
    assert base["extra"]["lm_prefill_flops"] == pytest.approx(sum(2 * p * L + 2 * L * L * d for p in params))


def test_tokens_per_layer_follow_every_stage_of_the_telemetry():
    cost = PrefillCost(layer_params=(10, 10, 10, 10, 10), d_attn=4)

    def rec(vision):
        return {"prompt_tokens": 100, "telemetry": {"vision": vision} if vision else {}}

    assert cost.tokens_per_layer(rec(None)) == [100] * 5
    pre = {"stage": "pre-llm", "sequence_before": 100, "sequence_after": 40}
    assert cost.tokens_per_layer(rec(pre)) == [40] * 5
    progressive = {"stage": "in-llm", "sequence_before": 100, "sequence_after": 30,
                   "stages": [{"layer": 1, "sequence_after": 60}, {"layer": 3, "sequence_after": 30}]}
    assert cost.tokens_per_layer(rec(progressive)) == [100, 60, 60, 30, 30]
    aim = {**pre, "in_llm": {"stage": "in-llm", "layer": 2, "sequence_before": 40, "sequence_after": 25}}
    assert cost.tokens_per_layer(rec(aim)) == [40, 40, 25, 25, 25]
    assert cost.flops([40, 40, 25, 25, 25]) == sum(2 * 10 * n + 2 * n * n * 4 for n in [40, 40, 25, 25, 25])


def test_sweep_prompts_and_scores_like_the_training_evaluation(vlm, sweep):
    result, _ = sweep
    model, processor = vlm
    qas = make_scene_qa(2, seed=0, split="test")
    ev = tr.evaluate_scene_qa(model, processor, qas, batch_size=1, max_new_tokens=4)
    base = [r for r in result.records if r["method"] == BASELINE]
    assert [r["output_text"] for r in base] == [s["generated"] for s in ev["samples"]]
    assert result.summary["baseline"]["accuracy"] == ev["accuracy"]


def test_vision_sweep_cli(capsys, vlm_dir, tmp_path):
    rc, out, err = _run(capsys, "vision-sweep", "--model", vlm_dir, "--methods", "pooling", "--budgets", "1.0", "0.5",
                        "--n", "1", "--warmup", "0", "--no-progress", "--out", tmp_path)
    assert rc == 0, err
    table = [line.split(" | ") for line in out.splitlines() if line.startswith("| ")]
    assert [row[0].strip("| ") for row in table[1:]] == [BASELINE, "pooling", "pooling"]
    assert table[0][4] == "visual tokens kept"
    assert table[1][4] == table[2][4] == f"{PER_IMAGE}" and table[3][4] == "16"  # 0.5 of 6 x 6 pools to 4 x 4
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3
    assert _is_png(tmp_path / "accuracy_vs_budget.png")


# ----------------------------------------------------------------------------------------------------- video-niah
def test_video_niah_writes_heatmaps_and_the_memory_report(vlm, tmp_path):
    model, processor = vlm
    methods = ["none", "pooling:keep_ratio=0.25+streaming:window=8:sink=2"]
    result = video_niah(model, processor, methods, [1, 2], [0.0, 1.0], size=56, max_new_tokens=3, warmup=0,
                        memory_budget=2**40, out_dir=tmp_path, progress=False, share_encoding=False)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        frames, depth = r["extra"]["frames"], r["extra"]["depth"]
        assert r["extra"]["needle_frame"] == round(depth * (frames - 1))
        assert r["extra"]["visual_tokens_input"] == PER_IMAGE * frames
        if r["method"] != "none":
            assert r["visual_tokens_kept"] == 9 * frames
            assert r["telemetry"]["method"] == "streaming"
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "heatmap_none.png", "heatmap_pooling_keep_ratio-0.25_streaming_window-8_sink-2.png", "peak_memory.png"]
    assert all(_is_png(p) for p in tmp_path.glob("*.png"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    for label in methods:
        cells = summary["methods"][label]["cells"]
        assert [(c["length"], c["depth"]) for c in cells] == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
        assert all(c["n"] == 1 and c["median_peak_memory_bytes"] is not None for c in cells)
        assert summary["memory"]["methods"][label]["largest_frames_within_budget"] == 2
    # K/V after prefill against the unreduced run on the same clip: pooling to a quarter shrinks it
    by_frames = summary["methods"][methods[1]]["by_length"]
    assert all(0 < b["kv_ratio_prefill"] < 1 for b in by_frames)
    assert summary["methods"]["none"]["by_length"][0]["kv_ratio_prefill"] == 1.0
    # a budget below every run: nothing fits
    tight = summarize_video(result.records, methods, [1, 2], [0.0, 1.0], memory_budget=1)
    assert all(m["largest_frames_within_budget"] is None for m in tight["memory"]["methods"].values())
    # on the sweep harness: a rerun into the finished folder is refused and touches nothing; --resume runs nothing
    before = (tmp_path / "results.jsonl").read_bytes()
    with pytest.raises(ValueError, match="--resume|--overwrite"):
        video_niah(model, processor, methods, [1, 2], [0.0, 1.0], size=56, max_new_tokens=3, warmup=0,
                   out_dir=tmp_path, progress=False)
    again = video_niah(model, processor, methods, [1, 2], [0.0, 1.0], size=56, max_new_tokens=3, warmup=0,
                       memory_budget=2**40, out_dir=tmp_path, progress=False, resume=True, share_encoding=False)
    assert (tmp_path / "results.jsonl").read_bytes() == before
    assert [r["output_ids"] for r in again.records] == [r["output_ids"] for r in result.records]


def test_memory_budget_estimate_solves_the_fitted_line():
    def rec(frames, peak):
        return {"method": "m", "method_name": "full", "status": "ok", "peak_memory_bytes": peak,
                "peak_memory_method": "x", "kv_cache_bytes_prefill": None, "kv_cache_bytes_final": None,
                "ttft_s": 1.0, "tokens_per_s": None, "extra": {"frames": frames, "length": frames, "depth": 0.5,
                                                               "correct": True, "correct_contains": True}}

    records = [rec(4, 1000 + 4 * 100), rec(8, 1000 + 8 * 100), rec(16, 1000 + 16 * 100)]
    memory = summarize_video(records, ["m"], [4, 8, 16], [0.5], memory_budget=2500)["memory"]["methods"]["m"]
    assert memory["largest_frames_within_budget"] == 8 and memory["estimated_max_frames"] == 15


def _video_niah_seeing_the_lm(model, processor, method):
    """``video_niah`` of one method on 2- and 4-frame clips, and per forward of the language model's first layer
    ``(query tokens, key tokens)``: its attention scores are their product, its activations scale with the first."""
    seen = []

    def first_layer(module, args, kwargs):
        q = int((args[0] if args else kwargs["hidden_states"]).shape[1])
        seen.append((q, hooked_cache(kwargs).get_seq_length(0) + q))

    handle = model.model.language_model.layers[0].register_forward_pre_hook(first_layer, with_kwargs=True)
    try:
        result = video_niah(model, processor, [method], [2, 4], [0.5], size=56, max_new_tokens=3, warmup=0,
                            progress=False)
    finally:
        handle.remove()
    return {r["extra"]["frames"]: r for r in result.records}, seen


def test_video_niah_chunked_prefill_bounds_the_lm_forward_and_keeps_the_answers(vlm):
    """pooling + chunked prefill: the same answers and K/V as pooling alone, but no language-model forward takes more
    than the chunk (pooling alone prefills the whole reduced clip at once); with a streaming window inside, the K/V
    held after prefill is the same for 2 and 4 frames."""
    model, processor = vlm
    plain, plain_seen = _video_niah_seeing_the_lm(model, processor, "pooling:keep_ratio=0.25")
    chunked, chunked_seen = _video_niah_seeing_the_lm(model, processor, "pooling:keep_ratio=0.25+chunked:chunk=8")
    window, window_seen = _video_niah_seeing_the_lm(
        model, processor, "pooling:keep_ratio=0.25+chunked:chunk=8:method=streaming,window=8,sink=2")
    for frames in (2, 4):
        a, b, c = plain[frames], chunked[frames], window[frames]
        assert a["status"] == b["status"] == c["status"] == "ok"
        assert b["output_ids"] == a["output_ids"] and b["visual_tokens_kept"] == a["visual_tokens_kept"] == 9 * frames
        assert b["kv_cache_bytes_prefill"] == a["kv_cache_bytes_prefill"]
        assert b["telemetry"]["method"] == "chunked" and b["telemetry"]["chunk"] == 8
    reduced = plain[4]["prompt_tokens"] - 36 * 4 + 9 * 4  # the 4-frame prompt after pooling
    assert max(q for q, _ in plain_seen) == reduced
    assert max(q for q, _ in chunked_seen) == max(q for q, _ in window_seen) == 8
    # attention scores per forward (query x key tokens): the chunk bounds them at 8 x the prompt, not prompt^2
    assert max(q * k for q, k in plain_seen) == reduced * reduced
    assert max(q * k for q, k in chunked_seen) <= 8 * reduced < reduced * reduced
    assert window[2]["kv_cache_bytes_prefill"] == window[4]["kv_cache_bytes_prefill"] < plain[4]["kv_cache_bytes_prefill"]


def test_video_niah_refuses_bad_settings(vlm):
    model, processor = vlm
    with pytest.raises(ValueError, match="prunes visual tokens inside the language model's prefill forward"):
        video_niah(model, processor, ["fastv:layer=1+chunked:chunk=64"], [2], [0.5], progress=False)
    with pytest.raises(ValueError, match=r"depths must be fractions in \[0, 1\]"):
        video_niah(model, processor, ["none"], [2], [1.5], progress=False)
    with pytest.raises(ValueError, match="FastV does not support"):
        video_niah(model, processor, ["fastv:layer=5"], [2], [0.5], progress=False)


def test_position_warning_names_only_the_methods_that_keep_original_positions(caplog):
    from types import SimpleNamespace

    from mmaccel.eval.video_niah import _warn_positions

    model = SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=1000)))
    contiguous = parse_visual_config("pooling:keep_ratio=0.25:positions=contiguous")
    with caplog.at_level("WARNING", logger="mmaccel.eval.video_niah"):
        _warn_positions(model, 144, 8, 6, [contiguous])  # 1,158 > 1,000, but every method renumbers
        assert not caplog.records
        _warn_positions(model, 144, 4, 6, [parse_visual_config("none")])  # 582: inside the range
        assert not caplog.records
        _warn_positions(model, 144, 8, 6, [contiguous, parse_visual_config("none"),
                                           parse_visual_config("pooling:keep_ratio=0.25")])
    (record,) = caplog.records
    assert "reach position 1158" in record.getMessage()
    assert "under none, pooling:keep_ratio=0.25:" in record.getMessage()
    assert "positions=contiguous," not in record.getMessage()


def test_visual_configs_parse_vision_and_kv():
    assert parse_visual_config("none") == VisualConfig("none")
    assert parse_visual_config("pooling:keep_ratio=0.25+snapkv:budget=64") == VisualConfig(
        "pooling:keep_ratio=0.25+snapkv:budget=64", "pooling:keep_ratio=0.25", "snapkv:budget=64")
    assert parse_visual_config("streaming:window=32") == VisualConfig("streaming:window=32", None,
                                                                      "streaming:window=32")
    with pytest.raises(ValueError, match="names two vision methods"):
        parse_visual_config("pooling+fastv")
    with pytest.raises(ValueError, match="keep_ratio must be in"):
        parse_visual_config("pooling:keep_ratio=2")


# ----------------------------------------------------------------------------------------------------- tome-sweep
def test_tome_sweep_cli_on_a_tiny_dinov2(capsys, parts, tmp_path):  # noqa: F811 - the imported fixture
    rc, out, err = _run(capsys, "tome-sweep", "--model", parts[0], "--schedules", "tome:r=0", "tome:r=8",
                        "--train", "8", "--test", "4", "--frames", "2", "--batch", "4", "--repeats", "1",
                        "--no-progress", "--out", tmp_path)
    assert rc == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {r["spec"]: r for r in summary["rows"]}
    assert list(rows) == ["none", "tome:r=0", "tome:r=8"]
    assert summary["config"]["probes"] == ["count", "shape", "colour", "size"]
    none, r0, r8 = rows.values()
    assert none["tokens_after"] == r0["tokens_after"] == 50 and r8["tokens_after"] == 50 - 2 * 8
    assert none["cos_cls_mean"] == pytest.approx(1.0, abs=1e-6) and none["speedup"] == 1.0
    assert r0["cos_cls_min"] > 0.9999 and r8["cos_patch_mean"] < r0["cos_patch_mean"]
    for r in rows.values():
        assert set(r["probe_accuracy"]) == {"count", "shape", "colour", "size"}
        assert all(0.0 <= a <= 1.0 for a in r["probe_accuracy"].values()) and r["images_per_s"] > 0
    assert _is_png(tmp_path / "tome_sweep.png")
    assert "| tome:r=8 | 34 |" in out
    # on the sweep harness: a rerun into the finished folder is refused and touches nothing; --resume keeps the
    # measured schedules (probe rows) and measures the throughput again
    args = ["tome-sweep", "--model", parts[0], "--schedules", "tome:r=0", "tome:r=8", "--train", "8", "--test", "4",
            "--frames", "2", "--batch", "4", "--repeats", "1", "--no-progress", "--out", tmp_path]
    records = (tmp_path / "results.jsonl").read_bytes()
    rc, _, err = _run(capsys, *args)
    assert rc == 2 and "--resume" in err and (tmp_path / "results.jsonl").read_bytes() == records
    rc, _, err = _run(capsys, *args, "--resume")
    assert rc == 0, err
    again = {r["spec"]: r for r in json.loads((tmp_path / "summary.json").read_text())["rows"]}
    assert (tmp_path / "results.jsonl").read_bytes() == records
    assert [r["probe_accuracy"] for r in again.values()] == [r["probe_accuracy"] for r in rows.values()]


def test_probe_fits_a_separable_attribute():
    from mmaccel.eval.tome_sweep import probe_accuracy

    g = torch.Generator().manual_seed(0)
    y = torch.arange(40) % 4
    x = torch.randn(40, 8, generator=g) * 0.1
    x[torch.arange(40), y] += 3.0  # class k lights feature k
    assert probe_accuracy(x[:30], y[:30], x[30:], y[30:]) == 1.0


# -------------------------------------------------------------------------------------------- compare vqa / video
@pytest.fixture(scope="module")
def media(tmp_path_factory):
    from mmaccel.data.clips import make_clip
    from mmaccel.data.media import write_video

    root = tmp_path_factory.mktemp("media")
    qa = make_scene_qa(1, seed=0, split="test")[0]
    qa.image.save(root / "scene.png")
    write_video(make_clip(6, seed=1, size=56), root / "clip.mp4")
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really an image")
    return root, qa


@pytest.mark.parametrize("task", ["vqa", "video-qa"])
def test_compare_vqa_and_video_qa_print_the_side_by_side_table(capsys, vlm_dir, media, tmp_path, task):
    root, qa = media
    source = ["--image", root / "scene.png"] if task == "vqa" else ["--video", root / "clip.mp4", "--frames", "3"]
    n_images = 1 if task == "vqa" else 3
    rc, out, err = _run(capsys, "compare", "--task", task, "--model", vlm_dir, *source, "--question", qa.question,
                        "--answer", qa.answer, "--methods", "none", "pooling:keep_ratio=0.25",
                        "fastv:layer=1:keep_ratio=0.25", "--max-new-tokens", "3", "--warmup", "0", "--out", tmp_path)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"{task}: {n_images} ") and f"{PER_IMAGE * n_images} visual tokens" in lines[0]
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].startswith("| method | answer | correct | TTFT (s) |")
    assert [row.split("|")[1].strip() for row in table[1:4]] == ["none", "pooling:keep_ratio=0.25",
                                                                 "fastv:layer=1:keep_ratio=0.25"]
    assert table[1].endswith("| 1.000 |")  # the first row is the KV reference
    assert table[4].startswith("| method | visual tokens kept |")
    assert table[5].startswith(f"| none | {PER_IMAGE * n_images} / {PER_IMAGE * n_images} |")
    assert table[6].startswith(f"| pooling:keep_ratio=0.25 | {9 * n_images} / {PER_IMAGE * n_images} |")
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["answer"] == qa.answer and data["inputs"]["images"] == n_images
    assert all(r["status"] == "ok" and "correct" in r["extra"] for r in data["records"])
    # on the sweep harness: each record appended as it finished; a rerun is refused, --resume reruns nothing
    records = (tmp_path / "results.jsonl").read_bytes()
    assert len(records.splitlines()) == 3
    argv = ["compare", "--task", task, "--model", vlm_dir, *source, "--question", qa.question, "--answer", qa.answer,
            "--methods", "none", "pooling:keep_ratio=0.25", "fastv:layer=1:keep_ratio=0.25", "--max-new-tokens", "3",
            "--warmup", "0", "--out", tmp_path]
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and "--resume" in err
    rc, _, err = _run(capsys, *argv, "--resume")
    assert rc == 0, err
    assert (tmp_path / "results.jsonl").read_bytes() == records
    assert data["records"][1]["kv_ratio_vs_full"] < 1.0


@pytest.mark.parametrize(
    "argv, match",
    [
        (["vision-sweep", "--budgets", "0"], "budget must be in (0, 1]"),
        (["vision-sweep", "--budgets", "1.5"], "budget must be in (0, 1]"),
        (["vision-sweep", "--methods", "bogus"], "unknown visual-token method 'bogus'"),
        (["vision-sweep", "--methods", "pooling:keep_ratio=0.5"], "sets keep_ratio, which the budgets set"),
        (["video-niah", "--methods", "bogus"], "unknown method 'bogus'"),
        (["video-niah", "--memory-budget", "lots"], "is not a positive size"),
        (["tome-sweep", "--schedules", "pooling"], "is not a ToMe schedule"),
        (["compare", "--task", "vqa", "--question", "q"], "--task vqa needs --image FILE and --question TEXT"),
        (["compare", "--task", "vqa", "--image", "/no/such/image.png", "--question", "q"],
         "no image file at /no/such/image.png"),
        (["compare", "--task", "vqa", "--image", "{root}/corrupt.png", "--question", "q"], "is not a readable image"),
        (["compare", "--task", "vqa", "--image", "{root}", "--question", "q"], "is a folder: pass one image file"),
        (["compare", "--task", "video-qa", "--video", "/no/such/clip.mp4", "--question", "q"],
         "no video file at /no/such/clip.mp4"),
        (["compare", "--task", "vqa", "--image", "{root}/scene.png", "--question", "q", "--methods", "bogus"],
         "unknown method 'bogus'"),
    ],
)
def test_bad_inputs_give_one_clear_error(capsys, media, argv, match):
    root, _ = media
    rc, _, err = _run(capsys, *[a.format(root=root) for a in argv])
    assert rc == 2
    assert err.startswith("error: ") and match in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_sweep_refuses_unsupported_methods_before_any_run(vlm):
    model, processor = vlm
    with pytest.raises(ValueError, match="FastV does not support"):
        vision_sweep(model, processor, ["fastv:layer=5"], [0.5], n=1, progress=False)
    with pytest.raises(ValueError, match="give one of r, schedule or keep_ratio"):
        vision_sweep(model, processor, ["tome:r=4"], [0.5], n=1, progress=False)
    with pytest.raises(ValueError, match="vision-language model with a processor"):
        vision_sweep(model, processor.tokenizer, ["pooling"], [0.5], n=1, progress=False)


def _sweep_row(cell, budget, q, correct, status="ok"):
    label = BASELINE if cell == BASELINE else f"{cell}:keep_ratio={budget:g}"
    return {"method": label, "status": status, "error": None if status == "ok" else "boom",
            "visual_tokens_kept": 4, "vision_encoder_s": 0.1, "prefill_s": 0.2, "ttft_s": 0.3, "decode_s": 0.1,
            "extra": {"cell": cell, "budget": budget, "question_index": q, "kind": "colour", "correct": correct,
                      "visual_tokens_input": 16, "flops_ratio": 0.5, "same_as_baseline": True}}


def test_summary_pairs_each_cell_with_pooling_at_its_budget_and_gives_a_standard_error():
    # 4 questions; pooling@0.5 right on q0, q1; visionzip@0.5 right on q1, q2, q3 (q3 failed for pooling)
    records = [_sweep_row(BASELINE, 1.0, q, True) for q in range(4)]
    records += [_sweep_row("pooling", 0.5, q, q in (0, 1), status="failed" if q == 3 else "ok") for q in range(4)]
    records += [_sweep_row("visionzip", 0.5, q, q in (1, 2, 3)) for q in range(4)]
    records += [_sweep_row("visionzip", 0.25, q, True) for q in range(4)]  # no pooling cell at 0.25
    summary = summarize_sweep(records)
    cells = {c["label"]: c for c in summary["cells"]}
    # paired over q0..q2 only (q3 has no successful pooling run): won q2, lost q0
    assert cells["visionzip:keep_ratio=0.5"]["vs_pooling"] == {"won": 1, "lost": 1}
    assert cells["pooling:keep_ratio=0.5"]["vs_pooling"] is None
    assert cells["visionzip:keep_ratio=0.25"]["vs_pooling"] is None
    assert cells["visionzip:keep_ratio=0.5"]["accuracy_se"] == pytest.approx((0.75 * 0.25 / 4) ** 0.5)
    assert cells["pooling:keep_ratio=0.5"]["accuracy_se"] == pytest.approx((2 / 3 * 1 / 3 / 3) ** 0.5)
    assert summary["baseline"]["accuracy_se"] == 0.0
    table = sweep_table(summary)
    assert "| visionzip | 0.5 | 75.0% ± 21.7 | 75% |" in table and "| 1/1 | 0 |" in table


def test_chunked_prefill_keeps_the_answers_with_contiguous_positions(vlm):
    """The middle pieces of a chunked prefill after a contiguous-position reduction are prefill, not decode steps: their
    positions were shifted a second time (smol-llava at 256 frames answered garbage, 2026-11-29)."""
    model, processor = vlm
    plain, _ = _video_niah_seeing_the_lm(model, processor, "pooling:keep_ratio=0.25:positions=contiguous")
    chunked, seen = _video_niah_seeing_the_lm(model, processor,
                                              "pooling:keep_ratio=0.25:positions=contiguous+chunked:chunk=8")
    assert max(q for q, _ in seen) == 8  # the prefill really ran in pieces
    assert [chunked[f]["output_ids"] for f in (2, 4)] == [plain[f]["output_ids"] for f in (2, 4)]
