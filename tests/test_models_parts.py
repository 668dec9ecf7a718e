"""mmaccel.models.parts: one finder of a model's tower, projector, language model, LM head and text config."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mmaccel.models.parts import (
    ModelParts,
    UnsupportedModelError,
    find_parts,
    held_tower,
    language_model,
    vision_tower,
    vit_layers,
)

TEXT = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0}
CLIP = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "image_size": 28, "patch_size": 14, "projection_dim": 32}


def _llava():
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(vision_config=CLIP, text_config={"model_type": "llama", **TEXT}, image_token_id=60)
    return LlavaForConditionalGeneration(config).eval()


def _llava_next():
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    config = LlavaNextConfig(vision_config=CLIP, text_config={"model_type": "llama", **TEXT}, image_token_id=60,
                             image_grid_pinpoints=[[28, 28], [28, 56]])
    return LlavaNextForConditionalGeneration(config).eval()


ROPE = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}
QWEN_VISION = {"depth": 2, "hidden_size": 32, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2,
               "temporal_patch_size": 2}
QWEN_IDS = {"image_token_id": 60, "video_token_id": 61, "vision_start_token_id": 62, "vision_end_token_id": 63}


def _qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = {**QWEN_VISION, "embed_dim": 32, "mlp_ratio": 2, "in_chans": 3}
    config = Qwen2VLConfig(text_config={**TEXT, "rope_parameters": ROPE}, vision_config=vision, **QWEN_IDS)
    return Qwen2VLForConditionalGeneration(config).eval()


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = {**QWEN_VISION, "intermediate_size": 64, "out_hidden_size": 32, "fullatt_block_indexes": [1],
              "window_size": 56}
    config = Qwen2_5_VLConfig(text_config={**TEXT, "rope_parameters": ROPE}, vision_config=vision, **QWEN_IDS)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**TEXT)).eval()


@pytest.fixture(scope="module")
def llava():
    torch.manual_seed(0)
    return _llava()


def test_llava_parts(llava):
    parts = find_parts(llava)
    inner = llava.model
    assert parts.family == "llava" and parts.is_vlm and parts.model is llava and parts.inner is inner
    assert parts.tower is inner.vision_tower and parts.projector is inner.multi_modal_projector
    assert parts.language_model is inner.language_model and parts.layers is inner.language_model.layers
    assert parts.lm_head is llava.lm_head and parts.text_config is llava.config.text_config
    assert len(parts.layers) == 3
    # the inner LlavaModel alone: the same parts, no LM head
    bare = find_parts(inner)
    assert (bare.family, bare.inner, bare.tower, bare.lm_head) == ("llava", inner, inner.vision_tower, None)
    assert vision_tower(llava) is inner.vision_tower and language_model(llava) is inner.language_model


def test_the_family_is_read_from_the_config_not_the_class(llava):
    """The same LlavaForConditionalGeneration reads as AnyRes once its config has grid pinpoints."""
    config = llava.model.config
    try:
        config.image_grid_pinpoints = [[28, 28]]
        assert find_parts(llava).family == "anyres"
    finally:
        config.image_grid_pinpoints = None
    assert find_parts(llava).family == "llava"


def test_another_tower_beside_a_language_model_is_a_generic_vlm(llava):
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_model = llava.model.vision_tower
            self.language_model = llava.model.language_model

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

    model = Outer()
    parts = find_parts(model)
    assert parts.family == "vlm" and parts.tower is llava.model.vision_tower and parts.projector is None
    assert parts.language_model is llava.model.language_model and parts.inner is model.model and parts.lm_head is None


def test_llava_next_is_anyres():
    torch.manual_seed(0)
    model = _llava_next()
    parts = find_parts(model)
    assert parts.family == "anyres" and parts.tower is model.model.vision_tower
    assert parts.projector is model.model.multi_modal_projector and parts.language_model is model.model.language_model


@pytest.mark.parametrize("build", [_qwen2_vl, _qwen2_5_vl], ids=["qwen2-vl", "qwen2.5-vl"])
def test_qwen2_vl_parts(build):
    torch.manual_seed(0)
    model = build()
    parts = find_parts(model)
    assert parts.family == "qwen2_vl" and parts.tower is model.model.visual
    assert parts.projector is model.model.visual.merger
    assert parts.language_model is model.model.language_model and len(parts.layers) == 3
    assert parts.lm_head is model.lm_head and parts.text_config.hidden_size == 32


def test_plain_causal_lm_has_no_tower():
    torch.manual_seed(0)
    model = _llama()
    parts = find_parts(model)
    assert parts.family == "causal_lm" and not parts.is_vlm
    assert parts.tower is None and parts.projector is None
    assert parts.language_model is model.model and parts.inner is model.model and parts.lm_head is model.lm_head
    assert parts.text_config is model.config
    assert vision_tower(model) is None and language_model(model) is model.model
    decoder = find_parts(model.model)  # the bare decoder
    assert decoder.language_model is model.model and decoder.lm_head is None


def test_bare_vits():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = {key: value for key, value in CLIP.items() if key != "model_type"}
    model = CLIPVisionModel(CLIPVisionConfig(**config)).eval()
    parts = find_parts(model)
    assert parts.family == "vision" and parts.tower is model and parts.language_model is None
    assert vit_layers(model) is model.encoder.layers and len(vit_layers(model)) == 2 and language_model(model) is None
    with pytest.raises(UnsupportedModelError, match="no language model.*pass a causal LM"):
        parts.layers  # noqa: B018 - the property raises


def test_open_clip_tower():
    pytest.importorskip("open_clip")
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    vision = CLIPVisionCfg(layers=2, width=32, head_width=8, patch_size=14, image_size=28)
    model = CLIP(embed_dim=32, vision_cfg=vision, text_cfg=CLIPTextCfg(context_length=8, vocab_size=100, width=32,
                                                                       heads=4, layers=1))
    parts = find_parts(model)
    assert parts.family == "vision" and parts.tower is model.visual and parts.language_model is None
    assert vit_layers(model) is model.visual.transformer.resblocks
    assert find_parts(model.visual).tower is model.visual


def test_held_tower_unwraps_a_releasable_wrapper(llava):
    class Wrapper(nn.Module):
        def __init__(self, tower):
            super().__init__()
            self.tower = tower

        def release(self):
            pass

    tower = llava.model.vision_tower
    assert held_tower(Wrapper(tower)) is tower and held_tower(tower) is tower
    assert vit_layers(Wrapper(tower)) is vit_layers(tower) is tower.encoder.layers


def test_unsupported_models_are_named():
    with pytest.raises(UnsupportedModelError, match="cannot find the parts of Linear.*supported: LLaVA"):
        find_parts(nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError, match="expected a torch nn.Module, got str"):
        find_parts("llava")
    assert vision_tower(nn.Linear(2, 2)) is None and language_model(nn.Linear(2, 2)) is None


def test_supported_list_names_every_family():
    for name in ("LLaVA", "LLaVA-NeXT", "Qwen2-VL", "Qwen2.5-VL", "open_clip", "causal LMs"):
        assert name in ModelParts.SUPPORTED
