"""Token plans, per-image plans on hand-made tokens, ToMe inside HF Dinov2/CLIP/SigLIP towers, budget errors."""
import math

import pytest
import torch

from mmaccel.vision_tokens import (
    METHODS,
    ImageGrid,
    TokenPlan,
    ToMe,
    UnsupportedModelError,
    bipartite_soft_matching,
    build_method,
    iqr_outliers,
    lift_to_sequence,
    parse_schedule,
    pooling_plan,
    prumerge_plan,
    temporal_merge_plan,
    visionzip_plan,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ plans
def test_keep_plan_applies_to_hidden_positions_masks():
    keep = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 1, 0, 1]], dtype=torch.bool)
    plan = TokenPlan.from_keep(keep)
    assert plan.index.tolist() == [[0, 2, 3], [1, 2, 4]]
    x = torch.arange(2 * 5 * 2, dtype=torch.float).view(2, 5, 2)
    assert torch.equal(plan.merge(x), x[[[0], [1]], plan.index])
    # 1-D, [1, L] and Qwen2-VL's [3, B, L] / [4, B, L] ids: gathered, never renumbered
    assert plan.take_positions(torch.arange(5)).tolist() == [[0, 2, 3], [1, 2, 4]]
    mrope = torch.stack([torch.arange(5) * (i + 1) for i in range(3)])[:, None].expand(3, 2, 5)
    assert plan.take_positions(mrope)[2].tolist() == [[0, 6, 9], [3, 6, 12]]
    assert plan.take_positions(torch.zeros(4, 2, 5)).shape == (4, 2, 3)
    # a 2-D mask grown by 2 decode steps: the prefix is reduced, the new columns stay
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    assert plan.extend_columns(mask).tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    m4 = torch.arange(5 * 5, dtype=torch.float).view(1, 1, 5, 5)
    assert plan.take_mask4d(m4).shape == (2, 1, 3, 3)
    assert plan.take_mask4d(m4)[0, 0].tolist() == [[0, 2, 3], [10, 12, 13], [15, 17, 18]]
    with pytest.raises(ValueError, match="same number of tokens"):
        TokenPlan.from_keep(torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool))


def test_merge_plan_is_size_weighted_and_exact_for_single_sources():
    # tokens 1 -> 0, 3 -> 2 (dropped: 4)
    rep = torch.tensor([[0, 0, 2, 2, -1]])
    plan = TokenPlan.from_representatives(rep)
    assert plan.index.tolist() == [[0, 2]] and plan.sources().tolist() == [[2, 2]]
    x = torch.tensor([[[1.0], [3.0], [10.0], [20.0], [99.0]]])
    size = torch.tensor([[1.0, 3.0, 1.0, 1.0, 1.0]])
    assert plan.merge(x, size).flatten().tolist() == [2.5, 15.0]
    assert plan.merge_weights(size).tolist() == [[4.0, 2.0]]
    ident = TokenPlan.from_representatives(torch.arange(4)[None], torch.rand(1, 4))
    y = torch.randn(1, 4, 3)
    assert torch.equal(ident.merge(y), y) and ident.is_identity()
    # chaining plans tracks sources (ToMe's source map)
    second = TokenPlan.from_representatives(torch.tensor([[0, 0]]))
    chained = plan.then(second)
    assert chained.slot_of().tolist() == [[0, 0, 0, 0, -1]] and chained.index.tolist() == [[0]]


def test_lift_to_sequence_keeps_text_and_maps_images():
    image_mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    grids = [ImageGrid(1, 2, 2)] * 2
    per_image = [TokenPlan.from_representatives(torch.tensor([[0, 0, 2, -1]]))] * 2
    plan = lift_to_sequence(image_mask, grids, per_image)
    assert plan.index.tolist() == [[0, 1, 3, 5], [0, 2, 4, 5]]
    assert plan.slot_of().tolist() == [[0, 1, 1, 2, -1, 3], [0, 0, 1, -1, 2, 3]]


def test_a_kept_cls_prefix_is_prepended_to_an_image_plan():
    from mmaccel.vision_tokens.pre_llm import _with_prefix
    plan = _with_prefix(TokenPlan.from_representatives(torch.tensor([[0, 0, 2, -1]]), torch.rand(1, 4)), 1)
    assert plan.index.tolist() == [[0, 1, 3]] and plan.slot_of().tolist() == [[0, 1, 1, 2, -1]]
    assert plan.weight.shape == (1, 5)


# ----------------------------------------------------------------------------------------- per-image plans
def test_pooling_plan_averages_cells_and_keeps_top_left_positions():
    plan = pooling_plan(ImageGrid(1, 4, 4), keep=4)
    assert plan.index.tolist() == [[0, 2, 8, 10]]
    x = torch.arange(16, dtype=torch.float).view(1, 16, 1)
    assert plan.merge(x).flatten().tolist() == [2.5, 4.5, 10.5, 12.5]
    video = pooling_plan(ImageGrid(2, 4, 4), keep=4)
    assert video.num_kept == 8 and video.index[0, 4:].tolist() == [16, 18, 24, 26]
    assert pooling_plan(ImageGrid(1, 4, 4), keep=16).is_identity()


def test_visionzip_plan_dominant_then_contextual():
    attn = torch.tensor([0.0, 0.9, 0.0, 0.0, 0.8, 0.0, 0.0, 0.0])
    keys = torch.tensor([[1.0, 0], [0, 1], [1, 0.1], [0.1, 1], [0, 1], [0.1, 1], [0.2, 1], [1, 0.3]])
    plan = visionzip_plan(attn, keys, keep=4, contextual=2)
    # dominant: 1 and 4; the rest 0,2,3,5,6,7 -> targets at stride 3: 0 and 5; 2 and 7 join 0, 3 and 6 join 5
    assert plan.index.tolist() == [[0, 1, 4, 5]]
    slots = plan.slot_of()[0].tolist()
    assert slots[1] == 1 and slots[4] == 2
    assert plan.sources().tolist() == [[3, 1, 1, 3]]
    assert visionzip_plan(attn, keys, keep=8, contextual=1).is_identity()


def test_prumerge_plan_keeps_iqr_outliers_first():
    attn = torch.full((16,), 0.01)
    attn[[3, 9]] = torch.tensor([0.5, 0.4])
    assert iqr_outliers(attn).nonzero().flatten().tolist() == [3, 9]
    keys = torch.randn(16, 4)
    plan = prumerge_plan(attn, keys, keep=2)
    assert plan.index.tolist() == [[3, 9]] and int(plan.sources().sum()) == 16
    filled = prumerge_plan(attn, keys, keep=4)  # two outliers + two spatially uniform samples
    assert {3, 9} <= set(filled.index[0].tolist()) and filled.num_kept == 4


def test_temporal_merge_plan_collapses_static_positions_into_the_first_frame():
    torch.manual_seed(0)
    frames = torch.randn(3, 4, 8)  # 3 frames of 2 x 2 tokens
    frames[1, 0] = frames[0, 0]
    frames[2, 0] = frames[0, 0]  # position 0 static over 3 frames
    frames[2, 3] = frames[1, 3]  # position 3 static over the last 2
    plan = temporal_merge_plan(frames.reshape(12, 8), ImageGrid(3, 2, 2), keep=9)
    assert plan.slot_of()[0].tolist() == [0, 1, 2, 3, 0, 4, 5, 6, 0, 7, 8, 6]
    assert plan.sources()[0].tolist() == [3, 1, 1, 1, 1, 1, 2, 1, 1]
    assert temporal_merge_plan(frames.reshape(12, 8), ImageGrid(3, 2, 2), keep=1).num_kept == 4  # one frame min
    assert temporal_merge_plan(frames[0], ImageGrid(1, 2, 2), keep=1).is_identity()  # a single image


def test_bipartite_soft_matching_merges_duplicates_and_protects_cls():
    torch.manual_seed(0)
    base = torch.randn(4, 8)
    # tokens: [cls, a, a', b, b', c, d, e] as (even, odd) pairs: 1~2? no: A = even positions, B = odd positions
    metric = torch.stack([base[0], base[1], base[1], base[2], base[2], base[3], base[0], torch.randn(8)])[None]
    plan = bipartite_soft_matching(metric, r=2, protected=1)
    # A = {0, 2, 4, 6}, B = {1, 3, 5, 7}: 2 ~ 1 and 4 ~ 3 are exact duplicates; 6 ~ cls(0) is not allowed
    assert plan.index.tolist() == [[0, 1, 3, 5, 6, 7]]
    assert plan.slot_of()[0, :5].tolist() == [0, 1, 1, 2, 2]
    assert bipartite_soft_matching(metric, r=0).is_identity()
    assert bipartite_soft_matching(metric, r=100, protected=1).num_kept == 8 - 3  # clamped to (N - 1) // 2


# ------------------------------------------------------------------------------------------------ ToMe in HF towers
def _tiny_dinov2():
    from transformers import Dinov2Config, Dinov2Model
    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                          image_size=56, patch_size=7, attn_implementation="sdpa")
    return Dinov2Model(config).eval()


def test_tome_r0_reproduces_dinov2_exactly_and_restores():
    model = _tiny_dinov2()
    pixels = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        ref = model(pixel_values=pixels).last_hidden_state
        with ToMe(r=0).apply(model):
            out = model(pixel_values=pixels).last_hidden_state
    assert torch.equal(out, ref)
    assert type(model.encoder.layer[0]).__name__ == "Dinov2Layer"
    assert not hasattr(model.encoder.layer[0], "_tome_state")


def test_tome_merges_on_dinov2_per_instance_only():
    model, other = _tiny_dinov2(), _tiny_dinov2()
    pixels = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        ref_other = other(pixel_values=pixels).pooler_output
        method = ToMe(schedule="8,8,4,0")
        with method.apply(model):
            out = model(pixel_values=pixels)
            other_out = other(pixel_values=pixels).pooler_output
    n = 1 + 64
    assert out.last_hidden_state.shape == (2, n - 20, 32)
    assert method.telemetry["tokens_per_layer"] == [57, 49, 45, 45]
    assert torch.equal(other_out, ref_other)  # the other instance of the same class is untouched
    assert type(other.encoder.layer[0]).__name__ == "Dinov2Layer"
    # the source map covers every patch once; [CLS] stays alone in slot 0
    slots = method.last_source.slot_of()
    assert slots.shape == (2, n) and bool((slots[:, 0] == 0).all()) and int((slots == 0).sum()) == 2
    assert method.last_source.sources().sum(1).tolist() == [n, n]


def test_tome_keep_ratio_schedule_and_proportional_attention_on_clip_and_siglip():
    from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel
    torch.manual_seed(0)
    clip = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                            num_attention_heads=4, image_size=56, patch_size=7)).eval()
    siglip = SiglipVisionModel(SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                  num_attention_heads=4, image_size=56, patch_size=7)).eval()
    pixels = torch.randn(1, 3, 56, 56)
    for model, prefix in ((clip, 1), (siglip, 0)):
        method = ToMe(keep_ratio=0.5)
        with torch.no_grad():
            ref = model(pixel_values=pixels).last_hidden_state
            with method.apply(model):
                out = model(pixel_values=pixels).last_hidden_state
        assert out.shape[1] == prefix + 32 and method.telemetry["schedule"] == [11, 11, 10]
        assert torch.nn.functional.cosine_similarity(out[:, :prefix or 1].mean(1), ref[:, :prefix or 1].mean(1)) > 0
        with torch.no_grad(), ToMe(r=0).apply(model):
            assert torch.equal(model(pixel_values=pixels).last_hidden_state, ref)


def test_tome_on_an_open_clip_vit(tmp_path):
    open_clip = pytest.importorskip("open_clip")
    import json
    config = {"embed_dim": 32, "vision_cfg": {"image_size": 56, "layers": 3, "width": 32, "patch_size": 7,
                                              "head_width": 8},
              "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 32, "heads": 4, "layers": 1}}
    (tmp_path / "mmaccel-tiny-vit.json").write_text(json.dumps(config))
    open_clip.add_model_config(str(tmp_path))
    torch.manual_seed(0)
    model = open_clip.create_model_and_transforms("mmaccel-tiny-vit", pretrained=None)[0].eval()
    pixels = torch.randn(2, 3, 56, 56)
    method = ToMe(r=8)
    with torch.no_grad():
        ref = model.encode_image(pixels)
        with ToMe(r=0).apply(model):
            assert torch.equal(model.encode_image(pixels), ref)
        with method.apply(model.visual):
            out = model.encode_image(pixels)
    assert method.telemetry["tokens_per_layer"] == [57, 49, 41]  # [CLS] + 64 patches, [CLS] protected
    assert out.shape == ref.shape and type(model.visual.transformer.resblocks[0]).__name__ == "ResidualAttentionBlock"
    assert bool((torch.nn.functional.cosine_similarity(out, ref) > 0.9).all())


def test_tome_proportional_attention_equals_attending_to_duplicates():
    """A token of size s must weigh like s copies of itself: ToMe's proportional attention, via SDPA's mask."""
    model = _tiny_dinov2()
    layer = model.encoder.layer[0]
    x = torch.randn(1, 5, 32)
    dup = torch.cat([x, x[:, 4:5]], dim=1)  # token 4 twice
    from mmaccel.vision_tokens.tome import _block_parts
    p = _block_parts(layer)
    with torch.no_grad():
        h_dup, _ = p.attn(hidden_states=dup)
        bias = torch.tensor([0.0, 0, 0, 0, math.log(2)]).view(1, 1, 1, 5)
        h_prop, _ = p.attn(hidden_states=x, attention_mask=bias)
    assert torch.allclose(h_dup[:, :5], h_prop, atol=1e-5)


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), "half", True])
def test_keep_ratio_outside_unit_interval_is_one_clear_error(bad):
    for cls in METHODS.values():
        with pytest.raises(ValueError, match=r"keep_ratio must be .*\(0, 1\]"):
            cls(keep_ratio=bad)


def test_specs_build_and_refuse():
    assert build_method("fastv:keep_ratio=0.25:layer=3").layer == 3
    assert build_method("tome:schedule=8-8-4").schedule == [8, 8, 4]
    with pytest.raises(ValueError, match=r"keep_ratio must be in \(0, 1\]"):
        build_method("pooling:keep_ratio=0")
    with pytest.raises(ValueError, match="unknown visual-token method 'nope'; choose one of: aim, atp, fastv"):
        build_method("nope")
    with pytest.raises(ValueError, match="no argument 'budget'"):
        build_method("visionzip:budget=64")
    with pytest.raises(ValueError, match="give one of r, schedule or keep_ratio"):
        ToMe(r=4, keep_ratio=0.5)
    with pytest.raises(ValueError, match="one r per layer"):
        parse_schedule([4, -1])


def test_tome_refuses_a_model_without_vit_blocks():
    with pytest.raises(UnsupportedModelError, match="ToMe does not support Linear: it has no ViT encoder blocks"), ToMe(r=1).apply(torch.nn.Linear(2, 2)):
        pass
