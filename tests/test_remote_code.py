"""A checkpoint's own code never runs (issue 33): every transformers load passes ``trust_remote_code=False``.

The checkpoint below ships an ``auto_map`` and a Python file that, if imported, writes a marker file. Loading it must
fail with one clear error, whatever is typed on stdin (transformers asks "run the custom code? [y/N]" when
``trust_remote_code`` is left unset).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from mmaccel.models import ModelLoadError, load
from mmaccel.models.zoo import assets_dir

ASSETS = assets_dir() / "micro-lm"


@pytest.fixture()
def custom_code_checkpoint(tmp_path):
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    marker = tmp_path / "marker"
    (ckpt / "config.json").write_text(json.dumps({
        "model_type": "evil_model",
        "architectures": ["EvilModel"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
    }))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a real tokenizer, so the CLI reaches the model load
        shutil.copy(ASSETS / name, ckpt / name)
    (ckpt / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig, PreTrainedModel\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil_model'\n"
        "class EvilModel(PreTrainedModel):\n    config_class = EvilConfig\n"
    )
    return ckpt, marker


def test_load_refuses_a_checkpoint_with_its_own_code(custom_code_checkpoint):
    ckpt, marker = custom_code_checkpoint
    with pytest.raises(ModelLoadError, match="ships its own model code"):
        load(ckpt, device="cpu")
    assert not marker.exists()


def test_cli_with_yes_on_stdin_never_runs_the_code(custom_code_checkpoint, tmp_path):
    ckpt, marker = custom_code_checkpoint
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "mmaccel", "compare", "--task", "niah", "--model", str(ckpt),
                           "--length", "256", "--out", str(tmp_path / "out")],
                          input="y\ny\n", capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "ships its own model code" in done.stderr
    assert not marker.exists()
