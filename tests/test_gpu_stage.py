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


@pytest.mark.slow  # ~190 s on 2 cores (eight fresh processes): over what CI's 25 minutes leave; run with -m slow
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
    stage.fold(out)
    assert (out / "e2e_smollm2_shape.tgz").exists() and not (out / "shapes.tgz").exists()
