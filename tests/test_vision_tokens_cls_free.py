"""VisionZip, PruMerge and ToMe on towers without a usable [CLS] score: tiny random LLaVA-NeXT (AnyRes crops of a
CLIP tower), LLaVA-OneVision (SigLIP, no [CLS]), Qwen2-VL and Qwen2.5-VL (windowed), batch 2 with left padding; the
CLS-free dominance score on a hand-computed case; temporal-tome's word on a still image."""
import copy
import math

import pytest
import torch
from test_vision_tokens_onevision import _generate, llava_next, onevision  # noqa: F401 - fixtures by name
from test_vision_tokens_vlm import llava, qwen2vl  # noqa: F401 - fixtures by name

from mmaccel.vision_tokens import (
    PruMerge,
    TemporalToMe,
    UnsupportedModelError,
    VisionZip,
    VLMParts,
    adapters,
    build_method,
)
from mmaccel.vision_tokens.adapters import received_attention, tower_score_attention
from mmaccel.vision_tokens.base import kept_count
from mmaccel.vision_tokens.prumerge import prumerge_plan
from mmaccel.vision_tokens.tome import tome_plan
from mmaccel.vision_tokens.visionzip import visionzip_plan

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = ["visionzip", "prumerge", "tome"]
MODELS = ["next", "onevision", "qwen2vl", "qwen2_5vl"]


@pytest.fixture(scope="module")
def qwen2_5vl(request):
    """A tiny Qwen2_5_VLForConditionalGeneration (windows of 2 x 2 merged tokens, full attention in block 1) and the
    tiny Qwen2-VL's left-padded batch of 2 images (same ids and patches; 4 x 4 merged tokens: 4 windows per image)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": 200, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
                     "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 32, "num_heads": 4,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [1]},
        image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval(), request.getfixturevalue("qwen2vl")[1]


@pytest.fixture(scope="module")
def models(request):
    """name -> (model, batch-2 inputs with left padding), built lazily."""
    cache = {}

    def get(name):
        if name not in cache:
            if name == "next":
                cache[name] = request.getfixturevalue("llava_next")
            elif name == "onevision":
                model, _, prompts = request.getfixturevalue("onevision")
                cache[name] = (model, prompts["uneven"])
            else:
                cache[name] = request.getfixturevalue(name)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def references(models):
    """Plain greedy tokens and logits per model, computed once."""
    cache = {}

    def get(name):
        if name not in cache:
            model, inputs = models(name)
            cache[name] = _generate(model, inputs)
        return cache[name]

    return get


def _lm_prefill_lengths(model, method, inputs):
    """Run greedy generation under ``method``; return the tokens, logits and the sequence length of the language
    model's prefill (as it receives it)."""
    lengths = []

    def grab(module, args, kwargs):
        if not lengths:
            lengths.append(kwargs["inputs_embeds"].shape[1])

    with method.apply(model):
        handle = VLMParts.find(model).lm.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            out, scores = _generate(model, inputs)
        finally:
            handle.remove()
    return out, scores, lengths[0]


# ------------------------------------------------------------------------------------------------ the score
def test_received_attention_ranks_the_most_attended_token_first():
    """Hand-computed: 2 heads, 3 queries, 3 keys; key 2 receives the most attention on average."""
    probs = torch.tensor([[[[0.2, 0.2, 0.6], [0.1, 0.3, 0.6], [0.5, 0.4, 0.1]],
                           [[0.3, 0.3, 0.4], [0.6, 0.2, 0.2], [0.2, 0.2, 0.6]]]])  # [1, 2, 3, 3]
    got = received_attention(probs)
    want = torch.tensor([[(0.2 + 0.1 + 0.5 + 0.3 + 0.6 + 0.2) / 6, (0.2 + 0.3 + 0.4 + 0.3 + 0.2 + 0.2) / 6,
                          (0.6 + 0.6 + 0.1 + 0.4 + 0.2 + 0.6) / 6]])
    torch.testing.assert_close(got, want)
    assert got.argmax().item() == 2
    keys = torch.eye(3)
    assert visionzip_plan(got[0], keys, keep=1, contextual=0).index[0].tolist() == [2]
    # keep 2 of 3: token 2 first, PruMerge's fill takes another, and the third merges into one of them
    assert 2 in prumerge_plan(got[0], keys, keep=2).index[0].tolist()


def test_tower_score_attention_records_the_columns_and_returns_the_modules_own_output(monkeypatch):
    """Queries that all point at key 1: the recorded score ranks key 1 first; the output equals SDPA's, and the
    eager form (no implementation recorded) gives the same output from the same probabilities."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 8)
    k = torch.randn(2, 4, 5, 8)
    k[:, :, 1] = q.mean(dim=2) * 4  # every query's dot product with key 1 is large
    v = torch.randn(2, 4, 5, 8)
    seen = []
    module = torch.nn.Module()
    module.is_causal = False  # as a vision tower's attention (transformers' SDPA reads it)
    module._mmaccel_tower_scores = ([lambda s, keys: seen.append((s, keys))], "sdpa")
    out, _ = tower_score_attention(module, q, k, v, None, scaling=8 ** -0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=8 ** -0.5).transpose(1, 2)
    torch.testing.assert_close(out, want)
    scores, keys = seen[0]
    probs = torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5, dim=-1)
    torch.testing.assert_close(scores, probs.mean(dim=(1, 2)))
    torch.testing.assert_close(keys, k.mean(dim=1))
    assert scores.argmax(dim=-1).tolist() == [1, 1]
    module._mmaccel_tower_scores = ([lambda s, keys: seen.append((s, keys))], "eager")
    monkeypatch.setattr(adapters, "_QUERY_CHUNK", 2)  # 5 queries in chunks of 2, 2 and 1
    eager, _ = tower_score_attention(module, q, k, v, None, scaling=8 ** -0.5)
    torch.testing.assert_close(eager, want)
    torch.testing.assert_close(seen[1][0], scores)


def test_tome_plan_keeps_exactly_keep_tokens_and_merges_the_most_similar():
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.01], [0.0, 1.0], [0.0, -1.0], [-1.0, 0.0]])
    plan = tome_plan(keys, 4)
    assert plan.num_kept == 4
    slot = plan.slot_of()[0]
    assert slot[0] == slot[1] and len(set(slot.tolist())) == 4  # only the two near-identical keys are one token
    assert tome_plan(keys, 1).num_kept == 1 and tome_plan(keys, 5).is_identity()


# ------------------------------------------------------------------------------------------------ on the models
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("method_name", METHODS)
def test_lossy_keep_keeps_exactly_the_tokens_it_says(models, name, method_name):
    model, inputs = models(name)
    method = build_method(f"{method_name}:keep_ratio=0.5")
    assert method.supports(model) is None
    out, _, prefill = _lm_prefill_lengths(model, method, inputs)
    t = method.telemetry
    assert out.shape == (2, 4)
    assert len(t["raster_before"]) == (4 if name in ("next", "onevision") else 2)  # AnyRes: base + crops per image
    assert t["raster_after"] == [kept_count(n, 0.5) for n in t["raster_before"]]
    assert t["sequence_after"] == prefill < t["sequence_before"] == inputs["input_ids"].shape[1]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("method_name", METHODS)
def test_keep_one_equals_plain_generate(models, references, name, method_name):
    model, inputs = models(name)
    ref, ref_scores = references(name)
    method = build_method(f"{method_name}:keep_ratio=1.0")
    out, scores, prefill = _lm_prefill_lengths(model, method, inputs)
    assert torch.equal(out, ref)
    assert (scores - ref_scores).abs().max().item() <= 1e-4
    assert prefill == inputs["input_ids"].shape[1]


def test_temporal_tome_on_a_still_image_says_it_keeps_everything(models):
    model, inputs = models("qwen2vl")
    method = TemporalToMe(keep_ratio=0.5)
    with pytest.warns(UserWarning, match=r"2 of the 2 clips .* single frames .* all kept"):
        _, _, prefill = _lm_prefill_lengths(model, method, inputs)
    assert prefill == inputs["input_ids"].shape[1] and math.isclose(method.keep_ratio, 0.5)


def _dominance_seen(method_cls, model, inputs, **kwargs):
    """The ``dominance`` scores [N] each grid's plan got under ``method_cls(keep_ratio=0.5, **kwargs)``."""
    seen = []

    class Spy(method_cls):
        def plan_image(self, features, grid, info):
            seen.append(info["dominance"])
            return super().plan_image(features, grid, info)

    with Spy(keep_ratio=0.5, **kwargs).apply(model), torch.no_grad():
        model(**inputs)
    return seen


def test_received_score_on_a_cls_tower_is_the_column_mean_of_its_attention(request):
    """score='received' on LLaVA's CLIP tower: the mean over heads and queries of the attention of the projected
    layer, as the tower's own eager attention returns it, without the [CLS] column; score='auto' stays [CLS]."""
    model, _, inputs = request.getfixturevalue("llava")
    seen = _dominance_seen(VisionZip, model, inputs, score="received")
    tower = copy.deepcopy(model.model.vision_tower)
    tower.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = tower(inputs["pixel_values"], output_attentions=True).attentions
    layer = model.config.vision_feature_layer  # -2: the output of the second-to-last block
    want = attentions[len(attentions) + 1 + layer - 1].mean(dim=(1, 2))[:, 1:]
    torch.testing.assert_close(torch.stack(seen), want)
    cls = _dominance_seen(VisionZip, model, inputs)
    assert not torch.allclose(torch.stack(cls), want)


def test_qwen2_5_window_order_is_undone(qwen2_5vl):
    """With every block attending over the whole image, the window order is only a permutation of the tokens: the
    scores per token must not depend on the window size (56: 4 windows per image, reordered; 112: one window)."""
    model, inputs = qwen2_5vl
    scores = []
    for window in (56, 112):
        config = copy.deepcopy(model.config)
        config.vision_config.window_size = window
        config.vision_config.fullatt_block_indexes = [0, 1, 2]
        twin = type(model)(config).eval()
        twin.load_state_dict(model.state_dict())
        scores.append(torch.stack(_dominance_seen(PruMerge, twin, inputs)))
    torch.testing.assert_close(scores[0], scores[1], atol=1e-6, rtol=1e-5)
    assert scores[0].std() > 0


def test_score_cls_is_refused_where_the_tower_has_none(models):
    for name in ("onevision", "qwen2vl"):
        model, _ = models(name)
        with pytest.raises(UnsupportedModelError, match="no \\[CLS\\] token .* use score='auto' or 'received'"), \
                VisionZip(score="cls").apply(model):
            pass
    with pytest.raises(ValueError, match="score must be one of"):
        PruMerge(score="attention")


def test_two_scored_methods_applied_together_on_anyres_restore_the_model(models, references):
    """VisionZip inside PruMerge on OneVision (each records pack_image_features' arguments): at keep 1.0 the logits
    are plain generate's, and on exit the model's own method is back."""
    model, inputs = models("onevision")
    ref, ref_scores = references("onevision")
    with PruMerge(keep_ratio=1.0).apply(model), VisionZip(keep_ratio=1.0).apply(model):
        out, scores = _generate(model, inputs)
    assert torch.equal(out, ref) and (scores - ref_scores).abs().max().item() <= 1e-4
    assert "pack_image_features" not in vars(model.model)
