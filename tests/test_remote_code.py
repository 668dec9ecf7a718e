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
    assert "--trust-remote-code" in done.stderr  # the error names the opt-in


def test_tokenizer_with_its_own_code_is_refused(tmp_path):
    """A checkpoint whose tokenizer alone ships code: the tokenizer load (run first by every CLI command) refuses."""
    from mmaccel.models.loading import load_tokenizer

    ckpt = tmp_path / "evil-tok"
    ckpt.mkdir()
    marker = tmp_path / "marker"
    shutil.copy(ASSETS / "config.json", ckpt / "config.json")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tok.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"}))
    (ckpt / "tok.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                 "from transformers import PreTrainedTokenizer\n"
                                 "class EvilTokenizer(PreTrainedTokenizer):\n    pass\n")
    with pytest.raises(ModelLoadError, match="--trust-remote-code"):
        load_tokenizer(ckpt)
    assert not marker.exists()


def test_trust_remote_code_is_an_explicit_opt_in(custom_code_checkpoint):
    """Asked for, the code runs without any prompt (the user consented); the default never passes it on."""
    ckpt, marker = custom_code_checkpoint
    with pytest.raises(Exception):  # the toy model cannot be built, but its module was imported on request
        load(ckpt, device="cpu", trust_remote_code=True)
    assert marker.exists()
