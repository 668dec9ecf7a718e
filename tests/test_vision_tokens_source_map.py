"""``VisionTokenMethod.source_map()``: the final token -> patch assignment of the last forward, per image.

ToMe inside a tiny Dinov2 (its tower source map, one plan per image) and the pre-LLM methods on the tiny LLaVA of
``test_vision_tokens_vlm`` (their per-image plans, which must lift to exactly the sequence the LLM saw).
"""
import pytest
import torch
from test_vision_tokens import _tiny_dinov2
from test_vision_tokens_vlm import N_IMG, llava  # noqa: F401 - the fixture is used by name

from mmaccel.vision_tokens import FastV, ImageGrid, Pooling, PruMerge, ToMe, VisionZip, lift_to_sequence

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tome_source_map_is_one_plan_per_image_over_cls_and_patches():
    model = _tiny_dinov2()  # 56 px, patch 7: [CLS] + 8 x 8 patches, 4 blocks
    method = ToMe(schedule="8,8,4,0")
    assert method.source_map() == []  # nothing ran yet
    pixels = torch.randn(2, 3, 56, 56)
    with torch.no_grad(), method.apply(model):
        out = model(pixel_values=pixels).last_hidden_state
    maps = method.source_map()
    assert len(maps) == 2
    for b, plan in enumerate(maps):
        assert plan.batch == 1 and plan.length == 1 + 64 and plan.num_kept == out.shape[1] == 65 - 20
        slot = plan.slot_of()[0]
        assert torch.equal(slot, method.last_source.slot_of()[b])
        assert int(slot[0]) == 0 and int((slot == 0).sum()) == 1  # [CLS] is alone in the first output token
        assert bool((slot >= 0).all())  # ToMe merges, never drops: every patch lands in some output token
        assert int(plan.sources().sum()) == 65 and int(plan.sources().max()) > 1
        # each output token's representative is one of its own sources
        assert torch.equal(slot[plan.index[0]], torch.arange(plan.num_kept))


def test_tome_that_merges_nothing_has_an_empty_source_map():
    model = _tiny_dinov2()
    method = ToMe(r=0)
    with torch.no_grad(), method.apply(model):
        model(pixel_values=torch.randn(1, 3, 56, 56))
    assert method.source_map() == [] and method.telemetry["tokens_after"] == method.telemetry["tokens_before"]


def test_pooling_source_map_is_the_2x2_cells(llava):  # noqa: F811 - the fixture
    model, _, inputs = llava
    method = Pooling(keep_ratio=0.25)
    with torch.no_grad(), method.apply(model):
        model(**inputs)
    maps = method.source_map()
    assert len(maps) == 2  # one image per row
    rows, cols = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    cell = ((rows // 2) * 4 + cols // 2).reshape(-1)
    for plan in maps:
        assert plan.length == N_IMG and plan.num_kept == 16
        assert torch.equal(plan.slot_of()[0], cell)


@pytest.mark.parametrize("method", [Pooling(keep_ratio=0.25), VisionZip(keep_ratio=0.25), PruMerge(keep_ratio=0.25)],
                         ids=["pooling", "visionzip", "prumerge"])
def test_pre_llm_source_maps_lift_to_the_sequence_the_llm_saw(llava, method):  # noqa: F811 - the fixture
    model, _, inputs = llava
    with torch.no_grad(), method.apply(model):
        model(**inputs)
    maps = method.source_map()
    assert [p.num_kept for p in maps] == method.telemetry["tokens_after"]
    image_mask = inputs["input_ids"] == model.config.image_token_id
    lifted = lift_to_sequence(image_mask, [ImageGrid(1, 8, 8)] * len(maps), maps)
    assert lifted.index.tolist() == method.telemetry["kept_positions"]


def test_in_llm_pruning_has_no_per_image_source_map(llava):  # noqa: F811 - the fixture
    model, _, inputs = llava
    method = FastV(keep_ratio=0.25, layer=2)
    with torch.no_grad(), method.apply(model):
        model(**inputs)
    assert method.source_map() == [] and method.telemetry["kept_positions"]
