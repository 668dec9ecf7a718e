"""Trained adapters stored in half precision: the savers write bf16/fp16, the loaders cast to the model's dtype.

Covers the LLaVA projector files (:mod:`mmaccel.models.smol_llava`) and the EAGLE head (:mod:`mmaccel.speculative.eagle`)
on tiny random modules, and the committed files (``smol-llava``, ``micro-llava``: bfloat16; ``smollm2-135m-eagle``:
float16), which must load into float32 modules as float32 weights equal to the stored values.
"""
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Dinov2Config, LlamaConfig, LlamaForCausalLM, LlavaConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from mmaccel.models import smol_llava as sl
from mmaccel.models.zoo import assets_dir
from mmaccel.speculative.eagle import EagleHead, EagleHeadConfig, load_head, save_head

pytestmark = pytest.mark.usefixtures("one_thread")


def _llava_like(vision_hidden: int, lm: torch.nn.Module | None = None, text_hidden: int | None = None, seed: int = 0):
    """An object with what the projector functions read: ``.model.multi_modal_projector`` (float32, seeded) and,
    when ``lm`` is given, ``.model.language_model`` (``lm.model``)."""
    text = lm.config if lm is not None else LlamaConfig(hidden_size=text_hidden, num_hidden_layers=1,
                                                         num_attention_heads=2, num_key_value_heads=1,
                                                         intermediate_size=2 * text_hidden, vocab_size=32)
    config = LlavaConfig(vision_config=Dinov2Config(hidden_size=vision_hidden, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=2 * vision_hidden),
                         text_config=text, projector_hidden_act="gelu", multimodal_projector_bias=True)
    torch.manual_seed(seed)
    proj = LlavaMultiModalProjector(config)
    for p in proj.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return SimpleNamespace(model=SimpleNamespace(multi_modal_projector=proj.float(),
                                                 language_model=lm.model if lm is not None else None))


def _tiny_lm(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=32, vocab_size=32)).float().eval()


@pytest.mark.parametrize("save_dtype", [torch.bfloat16, torch.float16])
def test_a_half_projector_file_loads_cast_to_float32(tmp_path, save_dtype):
    lm = _tiny_lm()
    src = _llava_like(12, lm)
    torch.manual_seed(1)
    lora = {"scale": 2.0, "rank": 2, "alpha": 4.0,
            "modules": {"layers.0.self_attn.q_proj": (torch.randn(2, 16), torch.randn(16, 2)),
                        "layers.0.mlp.down_proj": (torch.randn(2, 32), torch.randn(16, 2))}}
    path = sl.save_projector(src, tmp_path / "p.safetensors", lora=lora, save_dtype=save_dtype,
                             parts={"language": {"name": "tiny"}})
    stored = load_file(str(path))
    assert {v.dtype for v in stored.values()} == {save_dtype}
    full = sl.save_projector(src, tmp_path / "f32.safetensors", lora=lora)  # 2 bytes fewer per stored number
    numbers = sum(v.numel() for v in stored.values())
    assert full.stat().st_size - path.stat().st_size in range(2 * numbers - 64, 2 * numbers + 64)  # headers differ
    assert sl.read_projector_parts(path) == {"language": {"name": "tiny"}}
    assert sl.read_projector_lora(path) == {"scale": 2.0, "rank": 2, "alpha": 4.0}

    base = {n: p.detach().clone() for n, p in lm.named_parameters()}
    dst = _llava_like(12, lm, seed=5)
    sl.load_projector(dst, path)
    for name, p in dst.model.multi_modal_projector.state_dict().items():
        assert p.dtype == torch.float32
        # cast at load: the float32 weight is exactly the stored half value, not the float32 original
        assert torch.equal(p, stored[name].float())
        assert not torch.equal(p, src.model.multi_modal_projector.state_dict()[name])
        torch.testing.assert_close(p, src.model.multi_modal_projector.state_dict()[name], rtol=1e-2, atol=1e-2)
    back = sl.read_lora(path)
    assert all(a.dtype == b.dtype == torch.float32 for a, b in back["modules"].values())
    assert sl.merge_lora(dst, path) == 2
    q = lm.model.layers[0].self_attn.q_proj.weight
    assert q.dtype == torch.float32
    a, b = (t.float() for t in (stored["lora.layers.0.self_attn.q_proj.A"], stored["lora.layers.0.self_attn.q_proj.B"]))
    torch.testing.assert_close(q, base["model.layers.0.self_attn.q_proj.weight"] + 2.0 * b @ a)


def test_a_projector_file_in_bfloat16_loads_into_a_bfloat16_model(tmp_path):
    src = _llava_like(12, text_hidden=16)
    path = sl.save_projector(src, tmp_path / "p.safetensors", save_dtype=torch.bfloat16)
    dst = _llava_like(12, text_hidden=16, seed=3)
    dst.model.multi_modal_projector.to(torch.bfloat16)
    sl.load_projector(dst, path)
    for name, p in dst.model.multi_modal_projector.state_dict().items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, load_file(str(path))[name])


def test_bad_save_dtype_and_bad_stored_dtype_are_refused(tmp_path):
    src = _llava_like(12, text_hidden=16)
    with pytest.raises(ValueError, match="save_dtype must be one of"):
        sl.save_projector(src, tmp_path / "new" / "p.safetensors", save_dtype=torch.int8)
    assert not (tmp_path / "new").exists()
    path = sl.save_projector(src, tmp_path / "p.safetensors")
    with safe_open(str(path), "pt") as f:
        meta, state = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    state["linear_1.bias"] = state["linear_1.bias"].to(torch.float64)
    save_file(state, str(tmp_path / "odd.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="linear_1.bias.*float64.*save_projector"):
        sl.load_projector(_llava_like(12, text_hidden=16), tmp_path / "odd.safetensors")


def _tiny_head(seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    cfg = EagleHeadConfig(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                          rope_theta=10000.0, rms_norm_eps=1e-6, vocab_ids=[0, 3, 5], target="tiny",
                          fingerprint={}, vocab_size=8)
    head = EagleHead(cfg)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return head


@pytest.mark.parametrize("save_dtype", [torch.float16, torch.bfloat16])
def test_a_half_eagle_head_loads_cast_to_the_asked_dtype(tmp_path, save_dtype):
    head = _tiny_head()
    save_head(head, tmp_path, save_dtype=save_dtype)
    stored = load_file(str(tmp_path / "head.safetensors"))
    assert {v.dtype for v in stored.values()} == {save_dtype}
    for dtype in (torch.float32, torch.bfloat16):
        again = load_head(tmp_path, dtype=dtype)
        assert {p.dtype for p in again.parameters()} == {dtype}
        assert again.vocab_ids.tolist() == [0, 3, 5]
        for name, p in again.state_dict().items():
            assert torch.equal(p, stored[name].to(dtype))
    with pytest.raises(ValueError, match="save_dtype must be one of"):
        save_head(head, tmp_path / "new", save_dtype=torch.int8)
    assert not (tmp_path / "new").exists()


def _committed(name: str, file: str):
    path = assets_dir() / name / file
    if not path.is_file():
        pytest.skip(f"{path} is not in this checkout")
    return path


@pytest.mark.parametrize("name", ["smol-llava", "micro-llava"])
def test_committed_projectors_are_bfloat16_and_load_into_float32(name):
    path = _committed(name, "projector.safetensors")
    stored = load_file(str(path))
    assert {v.dtype for v in stored.values()} == {torch.bfloat16}
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "mmaccel-llava-projector-v1" and {"recipe", "parts", "lora"} <= set(meta)
    parts = json.loads(meta["parts"])
    lm = None
    if parts["language"]["name"] == "micro-lm":  # committed: the adapters can be merged into the real LM here
        import mmaccel

        lm, _ = mmaccel.load("micro-lm", device="cpu")
        lm.float()
    width = stored["linear_1.weight"].shape
    model = _llava_like(width[1], lm, text_hidden=stored["linear_2.weight"].shape[0])
    sl.load_projector(model, path)
    for key, p in model.model.multi_modal_projector.state_dict().items():
        assert p.dtype == torch.float32 and torch.equal(p, stored[key].float())
    lora = sl.read_lora(path)
    assert lora["modules"] and all(a.dtype == torch.float32 for a, _ in lora["modules"].values())
    if lm is not None:
        name0, (a, b) = next(iter(lora["modules"].items()))
        before = lm.model.get_submodule(name0).weight.detach().clone()
        assert sl.merge_lora(model, path) == len(lora["modules"])
        after = lm.model.get_submodule(name0).weight
        assert after.dtype == torch.float32
        torch.testing.assert_close(after, before + lora["scale"] * b @ a)


def test_committed_eagle_head_is_half_and_loads_into_float32():
    path = _committed("smollm2-135m-eagle", "head.safetensors")
    stored = load_file(str(path))
    assert {v.dtype for v in stored.values()} <= {torch.float16, torch.bfloat16}
    head = load_head("smollm2-135m-eagle")
    assert {p.dtype for p in head.parameters()} == {torch.float32}
    for key, p in head.state_dict().items():
        assert torch.equal(p, stored[key].float())
