"""mmaccel's layering, enforced with import-linter (contracts in pyproject.toml's [tool.importlinter]).

Top to bottom: cli, zoo (trainers, cards), eval (measurement, sweeps), pipeline (composition), speculative,
longctx | vision_tokens, models, data, specs | kernels. A module imports only from layers below its own, and no
library module imports eval, the zoo or the CLI (grimp, which import-linter builds on, counts imports inside
functions too).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not found: install the test extra (pip install -e '.[test]'), it has import-linter")
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_the_zoo_workshop_is_out_of_the_library():
    """The trainers and the card writer live in mmaccel.zoo; the old library paths are gone."""
    import importlib

    for old in ("mmaccel.models.train", "mmaccel.models.train_smol_llava", "mmaccel.models.train_micro_ar",
                "mmaccel.models.clip_training", "mmaccel.models.card", "mmaccel.speculative.train_eagle"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    from mmaccel.zoo.train import eagle, lm, micro_ar, smol_llava
    from mmaccel.zoo.train.schedule import warmup_cosine

    # one schedule: every trainer's learning rate comes from warmup_cosine
    assert smol_llava.lr_at is warmup_cosine
    assert eagle.warmup_cosine is warmup_cosine and lm.warmup_cosine is warmup_cosine
    assert micro_ar._lr_at is lm._lr_at
    assert warmup_cosine(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert warmup_cosine(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert warmup_cosine(100, 100, 1.0, 10, floor=0.1) == pytest.approx(0.1)
    assert warmup_cosine(55, 100, 1.0, 10, floor=0.0) == pytest.approx(0.5)


def test_no_import_circles_among_mmaccel_modules():
    """No module of mmaccel reaches itself through imports (imports inside functions included): the registries live
    in each package's ``registry`` module below its methods, and ``models.paths`` resolves checkpoints for both
    ``models.loading`` and ``models.built``."""
    import graphlib

    import grimp

    graph = grimp.build_graph("mmaccel", cache_dir=None)
    sorter = graphlib.TopologicalSorter({m: graph.find_modules_directly_imported_by(m) for m in graph.modules})
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")
