"""AIM (iterative pre-LLM merging, optional progressive pruning), Progressive (multi-stage in-LLM pruning) and ATP
(an instance-adaptive budget by attention mass): hand-computed plans, then the tiny LLaVA / Qwen2-VL of
``test_vision_tokens_vlm`` (positions after pruning, batch 2, full-budget equality, telemetry)."""
import contextlib

import pytest
import torch
from test_vision_tokens_vlm import N_IMG, _generate, _rope_positions, llava, qwen2vl  # noqa: F401 - fixtures by name

from mmaccel.vision_tokens import (
    AIM,
    ATP,
    FastV,
    ImageGrid,
    Progressive,
    UnsupportedModelError,
    adaptive_keep,
    build_method,
    image_segments,
    iterative_merge_plan,
    lift_to_sequence,
    mass_count,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------- hand-made tokens
def test_iterative_merge_plan_rounds_of_bipartite_matching():
    # A = even positions, B = odd: 0 -> 1 (cos .995), 2 -> 3 (.995), 4 = [1, .5] -> 1 (.93 vs .53 for 3)
    x = torch.tensor([[1.0, 0], [1, 0.1], [0, 1], [0.1, 1], [1, 0.5], [-1, 1]])
    one = iterative_merge_plan(x, keep=3)
    assert one.index.tolist() == [[1, 3, 5]] and one.slot_of().tolist() == [[0, 0, 1, 1, 0, 2]]
    assert one.sources().tolist() == [[3, 2, 1]]
    assert torch.allclose(one.merge(x[None])[0], torch.tensor([[1.0, 0.2], [0.05, 1], [-1, 1]]))
    # round 2 on the merged tokens [1, .2], [.05, 1], [-1, 1]: A = {slot 0, slot 2}, B = {slot 1};
    # slot 2 is closer to slot 1 (cos .67 vs .25), so token 5 joins {2, 3}
    two = iterative_merge_plan(x, keep=2)
    assert two.index.tolist() == [[1, 3]] and two.slot_of().tolist() == [[0, 0, 1, 1, 0, 1]]
    assert two.sources().tolist() == [[3, 3]]
    # the size-weighted average of the rounds is the plain mean of each group's tokens
    assert torch.allclose(two.merge(x[None])[0], torch.tensor([[1.0, 0.2], [-0.3, 1.0]]))
    assert iterative_merge_plan(x, keep=6).is_identity()


def test_aim_merges_video_frames_within_each_frame_only():
    frame = torch.tensor([[1.0, 0], [1, 0.1], [0, 1], [0.1, 1]])
    features = torch.cat([frame, frame])  # frame 1 repeats frame 0: merging across frames would be tempting
    plan = AIM(keep_ratio=0.5).plan_image(features, ImageGrid(2, 2, 2), {"image_index": 0})
    assert plan.index.tolist() == [[1, 3, 5, 7]]
    assert plan.slot_of().tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]]
    assert AIM(keep_ratio=1.0).plan_image(features, ImageGrid(2, 2, 2), {}).is_identity()


def test_mass_count_is_the_smallest_set_reaching_the_mass():
    s = torch.tensor([0.25, 0.5, 0.09375, 0.15625])  # sorted: .5, .25, .15625, .09375; cumulative .5, .75, .90625, 1
    assert mass_count(s, 0.75) == 2  # .5 + .25 reaches .75 exactly
    assert mass_count(s, 0.76) == 3
    assert mass_count(s, 0.5) == 1
    assert mass_count(s, 1.0) == 4
    assert mass_count(torch.zeros(5), 0.9) == 1


def test_adaptive_keep_per_image_then_rows_evened_out():
    segments = torch.tensor([[-1, 0, 0, 0, 0, -1], [-1, 1, 1, 1, 1, -1]])
    scores = torch.tensor([[0.9, 0.5, 0.09375, 0.25, 0.15625, 0.1],  # image 0 needs 2 tokens for .75: {1, 3}
                           [0.0, 0.2, 0.3, 0.22, 0.28, 0.5]])  # image 1: .3 + .28 = .58 < .75, + .22 -> 3 tokens
    keep, needed = adaptive_keep(scores, segments, mass=0.75)
    assert needed == [2, 3]
    # row 0 also keeps its next most important token (position 4) so that both rows keep 5 tokens
    assert keep.tolist() == [[True, True, False, True, True, True], [True, False, True, True, True, True]]
    keep, needed = adaptive_keep(scores, segments, mass=0.75, keep_ratio=0.5)  # the cap: 2 of 4
    assert needed == [2, 2]
    assert keep.tolist() == [[True, True, False, True, False, True], [True, False, True, False, True, True]]
    assert adaptive_keep(scores, segments, mass=0.75, min_keep_ratio=0.75)[1] == [3, 3]  # the floor: 3 of 4
    assert adaptive_keep(scores, segments, mass=0.75, keep_ratio=0.25, min_keep_ratio=0.75)[1] == [1, 1]  # cap wins
    keep, needed = adaptive_keep(scores, segments, mass=1.0)
    assert needed == [4, 4] and bool(keep.all())
    uneven = torch.tensor([[-1, 0, 0, 0, 0, -1], [-1, 1, -1, -1, -1, -1]])  # a row cannot be padded up
    with pytest.raises(ValueError, match="rows hold different numbers of visual tokens"):
        adaptive_keep(scores, uneven, mass=1.0)


def test_image_segments_split_a_row_by_image():
    mask = torch.tensor([[False, True, True, False, True, True]])
    grids = [ImageGrid(1, 1, 2)] * 2
    assert image_segments(mask, grids).tolist() == [[-1, 0, 0, -1, 1, 1]]
    assert image_segments(mask).tolist() == [[-1, 0, 0, -1, 0, 0]]  # no grids: the row is one group
    two_rows = torch.tensor([[False, True, True], [True, True, False]])
    assert image_segments(two_rows, grids).tolist() == [[-1, 0, 0], [1, 1, -1]]
    # two images in one row get their own budgets: image 0 holds .8 of its mass in 1 token, image 1 needs both
    scores = torch.tensor([[0.0, 0.9, 0.1, 0.0, 0.5, 0.5]])
    keep, needed = adaptive_keep(scores, image_segments(mask, grids), mass=0.8)
    assert needed == [1, 2] and keep.tolist() == [[True, True, False, True, True, True]]


# ------------------------------------------------------------------------------------------- parameters
def test_spec_forms_and_schedules():
    p = build_method("progressive:method=fastv,window=2:layers=1,3:keep_ratio=0.25")
    assert p.layers == [1, 3] and p.keep_ratios == [0.5, 0.25] and p.keep_ratio == 0.25
    assert [(s.layer, s.window) for s in p.stages] == [(1, 2), (3, 2)]
    q = Progressive(FastV(window=3), layers=[2, 8], keep_ratios=[0.5, 0.25])  # composition by wrapping
    assert q.keep_ratio == 0.25 and q.stages[1].window == 3
    wrapped = build_method("progressive:method=atp,mass=0.8:layers=1,2")
    assert all(isinstance(s, ATP) and s.mass == 0.8 for s in wrapped.stages)
    aim = build_method("aim:keep_ratio=0.5:layers=1,3")
    assert aim.pruner.keep_ratios == [pytest.approx(0.5 ** 0.5), 0.5]  # prune_keep_ratio defaults to keep_ratio


@pytest.mark.parametrize("spec, match", [
    ("aim:keep_ratio=0", r"keep_ratio must be in \(0, 1\]"),
    ("aim:keep_ratio=0.5:prune_keep_ratio=1.5", r"prune_keep_ratio must be in \(0, 1\]"),
    ("atp:mass=0", r"mass must be in \(0, 1\]"),
    ("atp:mass=1.5", r"mass must be in \(0, 1\]"),
    ("atp:keep_ratio=2", r"keep_ratio must be in \(0, 1\]"),
    ("progressive:layers=8,2", "layers must be strictly increasing"),
    ("progressive:layers=2,2", "layers must be strictly increasing"),
    ("progressive:layers=0,2", "layers must be strictly increasing"),
    ("progressive:layers=2,x", "layers must be a non-empty list of ints"),
    ("aim:layers=3,1", "layers must be strictly increasing"),
    ("progressive:keep_ratio=1.5", r"keep_ratio must be in \(0, 1\]"),
    ("progressive:keep_ratios=0.25,0.5", "non-increasing"),
    ("progressive:keep_ratios=0.5,0.25:keep_ratio=0.5", "contradicts"),
    ("progressive:method=pooling", "must be an in-LLM method"),
])
def test_bad_parameters_get_one_clear_error(spec, match):
    with pytest.raises(ValueError, match=match):
        build_method(spec)


def test_a_layer_outside_the_model_is_refused_before_anything_is_attached(llava):  # noqa: F811 - the fixture
    model = llava[0]
    with pytest.raises(UnsupportedModelError, match=r"stage at layer 4: layer must be an int in \[1, 3\]"), \
            Progressive(layers=[1, 4]).apply(model):
        pass
    assert not model.model.language_model._forward_pre_hooks


# ------------------------------------------------------------------------------------------- tiny LLaVA
def _run(model, inputs, method, n=3):
    """Greedy-generate ``n`` tokens under ``method`` with probes.

    Returns the new tokens [B, n], the sequence length every decoder layer got at the prefill, the position ids the
    rotary embedding got at each forward (``_rope_positions``), and the rotary cos table the last layer got at the
    prefill (after the method's reductions: its hook is registered after the method's).
    """
    layers = model.model.language_model.layers
    lengths, cos = {}, {}

    def length_of(i):
        def hook(module, args, output):
            lengths.setdefault(i, output.shape[1])  # returns None: the output is left as it is
        return hook

    def grab_cos(module, args, kwargs):
        cos.setdefault("last", kwargs["position_embeddings"][0])

    hooks = [layer.register_forward_hook(length_of(i)) for i, layer in enumerate(layers)]
    seen, handle = _rope_positions(model)
    try:
        with method.apply(model):
            hooks.append(layers[-1].register_forward_pre_hook(grab_cos, with_kwargs=True))
            out = _generate(model, inputs, n=n)
    finally:
        handle.remove()
        for h in hooks:
            h.remove()
    return out, [lengths[i] for i in range(len(layers))], seen, cos["last"]


def _llm_inputs(model, inputs, method=None):
    """The ``inputs_embeds`` [B, L, D] the language model gets in a plain forward (under ``method``: reduced)."""
    captured = []
    with torch.no_grad(), (method.apply(model) if method is not None else contextlib.nullcontext()):
        handle = model.model.language_model.register_forward_pre_hook(
            lambda m, a, k: captured.append(k["inputs_embeds"]), with_kwargs=True)  # after the method's hook
        try:
            model(**inputs)
        finally:
            handle.remove()
    return captured[0]


def _full_positions(inputs):
    mask = inputs["attention_mask"]
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def test_progressive_prunes_in_stages_and_keeps_original_positions_batch2(llava):  # noqa: F811 - the fixture
    model, _, inputs = llava
    method = Progressive(FastV(), layers=[1, 3], keep_ratios=[0.5, 0.25])
    out, lengths, seen, cos = _run(model, inputs, method)
    assert out.shape == (2, 3)
    L = inputs["input_ids"].shape[1]
    assert lengths == [L, L - N_IMG + 32, L - N_IMG + 32, L - N_IMG + 16]
    t = method.telemetry
    assert t["image_tokens_before"] == N_IMG and t["image_tokens_per_stage"] == [32, 16]
    assert t["sequence_before"] == L and t["sequence_after"] == L - N_IMG + 16
    kept = torch.tensor(t["kept_positions"])  # [2, K] into the prompt
    first = torch.tensor(t["stages"][0]["kept_positions"])
    assert all(set(kept[b].tolist()) <= set(first[b].tolist()) for b in range(2))  # pruned once, pruned for good
    image = inputs["input_ids"] == model.config.image_token_id
    assert bool(image.gather(1, kept).sum(1).eq(16).all()) and int((~image.gather(1, kept)).sum()) == 2 * (L - N_IMG)
    # layer 3 rotates the kept tokens by their original (left-padded) positions; decoding continues after L
    full_pos = _full_positions(inputs)
    rotary = model.model.language_model.rotary_emb
    assert torch.allclose(cos, rotary(torch.zeros(1), full_pos.gather(1, kept))[0])
    assert torch.equal(seen[1][:, -1], full_pos[:, -1] + 1)
    assert not hasattr(model.model.language_model, "_mmaccel_visual_mask")  # removed on exit


@pytest.mark.parametrize("layers, keep_ratios, fastv", [
    ([2], [0.25], FastV(layer=2, keep_ratio=0.25)),  # one stage
    ([1, 3], [0.5, 0.5], FastV(layer=1, keep_ratio=0.5)),  # the second stage keeps everything it is given
    ([1, 3], [1.0, 0.25], FastV(layer=3, keep_ratio=0.25)),  # the first stage keeps everything
], ids=["one-stage", "identity-second", "identity-first"])
def test_progressive_with_one_effective_stage_is_fastv(llava, layers, keep_ratios, fastv):  # noqa: F811 - the fixture
    model, _, inputs = llava
    method = Progressive(FastV(), layers=layers, keep_ratios=keep_ratios)
    with fastv.apply(model):
        ref = _generate(model, inputs, n=4)
    with method.apply(model):
        out = _generate(model, inputs, n=4)
    assert torch.equal(out, ref)
    assert method.telemetry["kept_positions"] == fastv.telemetry["kept_positions"]


@pytest.mark.parametrize("method", [AIM(keep_ratio=1.0, layers="1,3"),
                                    Progressive(ATP(mass=1.0), layers=[1, 3])], ids=["aim+pruning", "progressive-atp"])
def test_full_budget_compositions_equal_the_unmodified_model(llava, method):  # noqa: F811 - the fixture
    model, _, inputs = llava
    ref = _generate(model, inputs)
    with method.apply(model):
        assert torch.equal(_generate(model, inputs), ref)


def test_atp_keeps_each_rows_most_attended_tokens_up_to_its_mass(llava):  # noqa: F811 - the fixture
    model, _, inputs = llava
    atp = ATP(layer=1, window=1, mass=0.5)
    out, lengths, _, _ = _run(model, inputs, atp)
    assert out.shape == (2, 3)
    t = atp.telemetry
    k = t["image_tokens_after"]
    assert t["tokens_before"] == [N_IMG, N_IMG] and t["tokens_after"] == [k, k] and t["mass"] == 0.5
    assert len(t["tokens_needed"]) == 2 and max(t["tokens_needed"]) == k and min(t["tokens_needed"]) >= 6  # floor
    L = inputs["input_ids"].shape[1]
    assert lengths[0] == L and lengths[1] == lengths[3] == L - N_IMG + k == t["sequence_after"]
    # the kept image tokens of each row are its top k by the same score (the last query's attention at layer 0):
    # FastV at the ratio that keeps k makes the same choice
    fastv = FastV(layer=1, window=1, keep_ratio=k / N_IMG)
    with torch.no_grad(), fastv.apply(model):
        model(**inputs)
    assert t["kept_positions"] == fastv.telemetry["kept_positions"]
    # with a cap below what the mass needs, ATP is FastV at the cap
    capped = ATP(layer=1, window=1, mass=1.0, keep_ratio=0.25)
    with torch.no_grad(), capped.apply(model):
        model(**inputs)
    assert capped.telemetry["tokens_needed"] == [16, 16]
    fastv = FastV(layer=1, window=1, keep_ratio=0.25)
    with torch.no_grad(), fastv.apply(model):
        model(**inputs)
    assert capped.telemetry["kept_positions"] == fastv.telemetry["kept_positions"]


def test_progressive_atp_adapts_per_stage(llava):  # noqa: F811 - the fixture
    model, _, inputs = llava
    method = Progressive(ATP(mass=0.6, min_keep_ratio=0.05), layers=[1, 3])
    with method.apply(model):
        out = _generate(model, inputs, n=3)
    assert out.shape == (2, 3)
    t = method.telemetry
    first, second = t["stages"]
    assert first["tokens_before"] == [N_IMG, N_IMG]
    # stage 2 works on what stage 1 kept, one group per row (the images are no longer told apart)
    assert second["tokens_before"] == [first["image_tokens_after"]] * 2
    assert t["image_tokens_per_stage"] == [first["image_tokens_after"], second["image_tokens_after"]]
    assert second["image_tokens_after"] <= first["image_tokens_after"] < N_IMG


def test_aim_merges_before_the_llm_and_keeps_original_positions_batch2(llava):  # noqa: F811 - the fixture
    model, _, inputs = llava
    full = _llm_inputs(model, inputs)
    method = AIM(keep_ratio=0.25)
    seen, handle = _rope_positions(model)
    try:
        merged = _llm_inputs(model, inputs, method)
    finally:
        handle.remove()
    t = method.telemetry
    assert t["tokens_before"] == [N_IMG, N_IMG] and t["tokens_after"] == [16, 16]
    kept = torch.tensor(t["kept_positions"])
    assert torch.equal(seen[0], kept)  # a plain forward numbers the prompt 0..L-1: the LLM sees the kept numbers
    maps = method.source_map()
    assert all(int(p.sources().sum()) == N_IMG and int(p.sources().max()) > 1 for p in maps)
    image_mask = inputs["input_ids"] == model.config.image_token_id
    lifted = lift_to_sequence(image_mask, [ImageGrid(1, 8, 8)] * 2, maps)
    assert lifted.index.tolist() == t["kept_positions"]
    # every merged token is the mean of the projected tokens it holds
    assert torch.allclose(merged, lifted.merge(full), atol=1e-6)


def test_aim_with_in_llm_pruning(llava):  # noqa: F811 - the fixture
    model, _, inputs = llava
    method = AIM(keep_ratio=0.5, layers="1,3", prune_keep_ratio=0.25)
    out, lengths, _, _ = _run(model, inputs, method)
    assert out.shape == (2, 3)
    L = inputs["input_ids"].shape[1]
    assert lengths == [L - N_IMG + 32, L - N_IMG + 16, L - N_IMG + 16, L - N_IMG + 8]
    t = method.telemetry
    assert t["tokens_after"] == [32, 32]
    assert t["in_llm"]["image_tokens_before"] == 32 and t["in_llm"]["image_tokens_per_stage"] == [16, 8]
    # the pruned tokens' indices are into the merged sequence; every one left is visual or text of the prompt
    pre_kept = torch.tensor(t["kept_positions"])
    final = pre_kept.gather(1, torch.tensor(t["in_llm"]["kept_positions"]))
    image = inputs["input_ids"] == model.config.image_token_id
    assert bool(image.gather(1, final).sum(1).eq(8).all())
    # a record taken from this run (a shallow copy, as the eval harness takes) is not rewritten by the next run
    record = dict(t)
    with torch.no_grad(), method.apply(model):
        model(**inputs)
    assert method.telemetry["in_llm"] is not record["in_llm"] and record["in_llm"]["image_tokens_per_stage"] == [16, 8]


# ------------------------------------------------------------------------------------------- tiny Qwen2-VL
@pytest.mark.parametrize("method", [AIM(keep_ratio=0.25), Progressive(FastV(), layers=[1, 3], keep_ratio=0.25)],
                         ids=["aim", "progressive"])
def test_qwen2vl_keeps_mrope_positions(qwen2vl, method):  # noqa: F811 - the fixture
    model, inputs = qwen2vl
    ref_pos, handle = _rope_positions(model)  # the unmodified model's 3-D ids: prefill, then each decode step
    _generate(model, inputs, n=3)
    handle.remove()
    full = ref_pos[0]  # [3, B, L]
    out, _, seen, cos = _run(model, inputs, method)
    assert out.shape == (2, 3)
    kept = torch.tensor(method.telemetry["kept_positions"])
    L = inputs["input_ids"].shape[1]
    assert kept.shape == (2, L - 16 + 4)  # 4 x 4 image tokens -> 4
    if isinstance(method, AIM):  # the LLM gets the merged tokens' original 3-D ids
        assert torch.equal(seen[0], full.gather(2, kept[None].expand(3, -1, -1)))
    else:
        assert method.telemetry["image_tokens_per_stage"] == [8, 4]
    # the last layer rotates the kept tokens by their original 3-D positions; decoding keeps the original ids
    cos_full = model.model.language_model.rotary_emb(torch.zeros(1), full)[0]
    assert torch.allclose(cos, cos_full.gather(1, kept[..., None].expand(-1, -1, cos_full.shape[-1])))
    assert all(torch.equal(a, b) for a, b in zip(seen[1:], ref_pos[1:])) and len(seen) == len(ref_pos) == 3
