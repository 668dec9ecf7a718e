"""The one-call GPU stage (benchmarks/gpu_stage.py): its plan fits the call, and it runs end to end as a CPU rehearsal."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_stage.py"


@pytest.fixture(scope="module")
def stage():
    spec = importlib.util.spec_from_file_location("gpu_stage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_stage"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_plan_fits_one_call_by_its_own_estimate(stage):
    steps = stage.plan()
    assert stage.check_plan(steps) <= 480
    assert len({s.name for s in steps}) == len(steps)
    with pytest.raises(ValueError, match="over the"):
        stage.check_plan(steps, budget_s=100)
    with pytest.raises(ValueError, match="below its estimate"):
        stage.check_plan([stage.Step("x", 10, 5, ["true"])])


def test_the_video_steps_run_the_streamed_path_and_the_trainer_on_cuda(stage):
    from mmaccel.eval.video_niah import check_streamed
    from mmaccel.eval.visual import parse_visual_config

    steps = {s.name: s for s in stage.plan()}
    video, train = steps["video_niah_shape"].argv, steps["train_smol_llava_shape"].argv
    assert "--stream" in video and video[video.index("--device") + 1] == "cuda" and "bfloat16" in video
    assert video[video.index("--frames") + 1:video.index("--depths")] == ["1024", "4096"]
    config = parse_visual_config(stage.VIDEO_METHOD)
    assert check_streamed(config.vision, config.kv)[1].name == "chunked"  # a configuration the streamed path takes
    assert train[train.index("--device") + 1] == "cuda" and "mmaccel.zoo.train.smol_llava" in train
    assert all("cpu" in steps[n].rehearse for n in ("video_niah_shape", "train_smol_llava_shape"))


@pytest.mark.slow  # ~250 s on 2 cores (nine fresh processes): over what CI's 25 minutes leave; run with -m slow
def test_rehearsal_runs_every_step_on_the_cpu(stage, tmp_path):
    out = tmp_path / "stage"
    records = stage.run_stage(out, rehearse=True)
    assert [r["step"] for r in records] == [s.name for s in stage.plan()]
    failed = {r["step"]: (out / f"{r['step']}.log").read_text()[-1500:] for r in records if r["status"] != "ok"}
    assert not failed, failed
    lines = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert lines == records and all(r["device"] == "cpu (rehearsal)" for r in lines)
    # the measured steps wrote their records, each with its device
    niah = [json.loads(x) for x in (out / "e2e_smollm2_shape" / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in niah} >= {"full", "snapkv:ratio=0.25"} and all(r["device"] == "cpu" for r in niah)
    assert json.loads((out / "kernel_decode" / "k.json").read_text())["bandwidth"]["gbps"] > 0
    video = [json.loads(x) for x in (out / "video_niah_shape" / "results.jsonl").read_text().splitlines()]
    assert video and all(r["status"] == "ok" and r["telemetry"]["streamed"] for r in video)
    assert (out / "train_smol_llava_shape" / "train_log.json").exists()
    stage.fold(out)
    assert (out / "e2e_smollm2_shape.tgz").exists() and not (out / "shapes.tgz").exists()
