"""Long video on a LLaVA-style model: chunked prefill split at the language model (after the vision tower, the
projector and any pre-LLM visual-token method), and temporal ToMe across a prompt's frames (one image per frame).

A tiny random LlavaForConditionalGeneration (CLIP tower + Llama) built here: 56 px images, 4 x 4 = 16 visual tokens
per image; prompts are built from token ids (no processor needed)."""
import pytest
import torch
from test_vision_tokens_vlm import _video_inputs, qwen2vl  # noqa: F401 - the tiny Qwen2-VL fixture

from mmaccel.longctx import Chunked, build_method, kv_cache_bytes
from mmaccel.vision_tokens import ImageGrid, Pooling, TemporalToMe
from mmaccel.vision_tokens.temporal import frame_grids

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGE = 5  # the image placeholder id
PER_IMAGE = 16  # (56 // 14) ** 2


@pytest.fixture(scope="module")
def llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=56, patch_size=14, projection_dim=32)
    text = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).eval()


def _frames_prompt(n_frames, seed=0, duplicate=None):
    """``n_frames`` random images, one ``<image>`` (16 tokens) each, a text token after each, a question after all;
    ``duplicate=(i, j)`` makes frame j a copy of frame i."""
    ids = [1, 7, 8]
    for f in range(n_frames):
        ids += [IMAGE] * PER_IMAGE + [9 + f % 8]
    ids = torch.tensor([ids + [20, 21, 22]])
    pixels = torch.randn(n_frames, 3, 56, 56, generator=torch.Generator().manual_seed(seed))
    if duplicate is not None:
        pixels[duplicate[1]] = pixels[duplicate[0]]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def _generate(model, inputs, cache=None, n=5):
    extra = {"past_key_values": cache} if cache is not None else {}
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=n, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **extra)


class _Seen:
    """Per forward of the first decoder layer: its query tokens, rotary positions and input hidden states (the
    embeddings the LLM got); per vision-tower forward: its batch of images. Removed on exit."""

    def __init__(self, model):
        self.model = model
        self.lengths, self.positions, self.hidden, self.tower_batches = [], [], [], []

    def __enter__(self):
        lm = self.model.model.language_model

        def layer(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.lengths.append(int(hidden.shape[1]))
            self.hidden.append(hidden.clone())
            self.positions.append(kwargs["position_ids"].clone())

        self.handles = [lm.layers[0].register_forward_pre_hook(layer, with_kwargs=True),
                        self.model.model.vision_tower.register_forward_pre_hook(
                            lambda module, args: self.tower_batches.append(int(args[0].shape[0])))]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def _chunks(length, chunk):
    return [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])


def _same_generation(a, b):
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------- chunked prefill
def test_chunked_full_on_a_multi_image_prompt_is_token_identical(llava):
    """4 images (64 visual tokens) in a 74-token prompt, chunks of 7: chunk borders fall inside images, the tower
    still runs once on all 4 images, and the greedy output is the unchunked one."""
    inputs = _frames_prompt(4)
    L = inputs["input_ids"].shape[1]
    ref = _generate(llava, inputs)
    method = Chunked("full", chunk=7)
    with _Seen(llava) as seen, method.make_cache(llava) as cache:
        out = _generate(llava, inputs, cache)
    _same_generation(out, ref)
    assert seen.lengths == _chunks(L, 7) + [1] * 4
    assert seen.tower_batches == [4]
    assert torch.equal(torch.cat(seen.positions[:len(_chunks(L, 7))], dim=1), torch.arange(L)[None])
    assert method.telemetry(cache)["chunk"] == 7
    assert cache.hooks_attached == 0  # closed: nothing left on the model
    with _Seen(llava) as after:
        _generate(llava, inputs, n=1)
    assert after.lengths == [L]


@pytest.mark.parametrize("cache_first", [False, True])
def test_chunked_splits_the_pooled_prompt_and_equals_pooling_alone(llava, cache_first):
    """Pooling to a quarter (16 -> 4 tokens per image) runs once on the whole prompt; the chunks split the 26 reduced
    tokens, with the kept tokens' original positions, whichever of the two was attached first."""
    inputs = _frames_prompt(4, seed=1)
    alone = Pooling(keep_ratio=0.25)
    with _Seen(llava) as plain, alone.apply(llava):
        ref = _generate(llava, inputs)
    K = 4 * 4 + 10
    assert plain.lengths[0] == K
    pooled = Pooling(keep_ratio=0.25)
    method = Chunked("full", chunk=5)
    with _Seen(llava) as seen:
        if cache_first:
            cache = method.make_cache(llava)
            with pooled.apply(llava):
                out = _generate(llava, inputs, cache)
            cache.close()
        else:
            with pooled.apply(llava), method.make_cache(llava) as cache:
                out = _generate(llava, inputs, cache)
    _same_generation(out, ref)
    n_chunks = len(_chunks(K, 5))
    assert seen.lengths == _chunks(K, 5) + [1] * 4 and seen.tower_batches == [4]
    assert torch.equal(torch.cat(seen.positions[:n_chunks], dim=1), plain.positions[0])
    assert torch.equal(seen.positions[n_chunks], plain.positions[1])  # the first decode step's original position
    assert pooled.telemetry["kept_positions"] == alone.telemetry["kept_positions"]
    assert pooled.telemetry["tokens_after"] == [4] * 4


def test_chunked_streaming_holds_the_same_kv_for_any_number_of_frames(llava):
    """Pooling + chunked prefill into a streaming window: the K/V held after prefill does not grow with the clip,
    and no forward of the language model sees more than a chunk."""
    held = []
    for frames in (4, 8):
        inputs = _frames_prompt(frames, seed=2)
        method = Chunked(build_method("streaming:window=8:sink=2"), chunk=6)
        with _Seen(llava) as seen, Pooling(keep_ratio=0.25).apply(llava), method.make_cache(llava) as cache:
            with torch.no_grad():
                llava(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            held.append(kv_cache_bytes(cache))
        assert max(seen.lengths) == 6 and sum(seen.lengths) == frames * 4 + frames + 6
    assert held[0] == held[1] > 0
    full = build_method("full").make_cache(llava)
    with Pooling(keep_ratio=0.25).apply(llava), torch.no_grad():
        llava(**_frames_prompt(8, seed=2), past_key_values=full, use_cache=True, logits_to_keep=1)
    assert kv_cache_bytes(full) > 2 * held[1]


def test_chunked_on_qwen2vl_slices_the_mrope_positions(qwen2vl):  # noqa: F811 - the imported fixture
    """Qwen2-VL hands its language model 3-D M-RoPE position ids (plus the text row): chunks slice them on the last
    dim. A left-padded batch of two images under pooling, and a video under temporal ToMe, equal their unchunked
    runs."""
    model, inputs = qwen2vl
    for method, prompt in ((Pooling(keep_ratio=0.25), inputs), (TemporalToMe(keep_ratio=0.75), _video_inputs())):
        with method.apply(model):
            ref = _generate(model, prompt, n=3)
        with method.apply(model), Chunked("full", chunk=3).make_cache(model) as cache:
            _same_generation(_generate(model, prompt, cache, n=3), ref)


# ----------------------------------------------------------------------------------------------- temporal ToMe
def test_temporal_tome_reads_consecutive_images_as_frames_and_merges_a_repeated_frame(llava):
    """Frames 1 and 2 are the same image: at keep_ratio 0.75 (64 -> 48 tokens) exactly frame 2's tokens merge into
    frame 1's, which keep their positions; every other token reaches the LLM unchanged."""
    inputs = _frames_prompt(4, seed=3, duplicate=(1, 2))
    with _Seen(llava) as plain, torch.no_grad():
        llava(**inputs)
    method = TemporalToMe(keep_ratio=0.75)
    with _Seen(llava) as seen, method.apply(llava):
        out = _generate(llava, inputs, n=3)
    t = method.telemetry
    assert t["frames"] == [4] and t["tokens_before"] == [64] and t["tokens_after"] == [48]
    image_pos = (inputs["input_ids"][0] == IMAGE).nonzero().squeeze(1)
    kept = torch.tensor(t["kept_positions"][0])
    L = inputs["input_ids"].shape[1]
    assert sorted(set(range(L)) - set(kept.tolist())) == image_pos[2 * PER_IMAGE: 3 * PER_IMAGE].tolist()
    assert torch.equal(seen.positions[0], kept[None])  # original positions, not renumbered
    # what the LLM got: the unreduced embeddings at the kept positions (a repeated frame's mean is the frame itself)
    torch.testing.assert_close(seen.hidden[0][0], plain.hidden[0][0, kept], rtol=0, atol=1e-6)
    (plan,) = method.source_map()
    slot = plan.slot_of()[0]
    frame = torch.arange(PER_IMAGE)
    assert torch.equal(slot[2 * PER_IMAGE + frame], slot[PER_IMAGE + frame]) and plan.num_kept == 48
    assert out.sequences.shape == (1, L + 3)


def test_temporal_tome_full_budget_and_chunked_prefill_leave_the_output_unchanged(llava):
    inputs = _frames_prompt(4, seed=4, duplicate=(0, 1))
    ref = _generate(llava, inputs)
    with TemporalToMe(keep_ratio=1.0).apply(llava):
        _same_generation(_generate(llava, inputs), ref)
    merged = TemporalToMe(keep_ratio=0.5)
    with merged.apply(llava):
        alone = _generate(llava, inputs)
    with TemporalToMe(keep_ratio=0.5).apply(llava), Chunked("full", chunk=8).make_cache(llava) as cache:
        _same_generation(_generate(llava, inputs, cache), alone)
    assert merged.telemetry["tokens_after"] == [32]


def test_frame_grids_group_runs_of_same_size_images_per_row():
    one, big = ImageGrid(1, 2, 2), ImageGrid(1, 3, 3)
    # row 0: two 2x2 frames, a 3x3 image, a 2x2 image; row 1: three 2x2 frames
    grids = [one, one, big, one, one, one, one]
    assert frame_grids(grids, [4 + 4 + 9 + 4, 12]) == [ImageGrid(2, 2, 2), big, one, ImageGrid(3, 2, 2)]
    # left alone: a [CLS]-prefixed image, AnyRes base + crops, OneVision multi-image items, a video
    cls = ImageGrid(1, 2, 2, prefix=1)
    anyres = [ImageGrid(1, 2, 2), ImageGrid(1, 2, 3, newline=True, part=1)]
    item = ImageGrid(1, 2, 2, suffix=1)
    video = ImageGrid(3, 2, 2)
    for layout in ([cls, cls], anyres + anyres, [item, item], [video, video]):
        assert frame_grids(layout, [sum(g.tokens for g in layout)]) == layout
    assert frame_grids(anyres + [one, one], [sum(g.tokens for g in anyres) + 8]) == anyres + [ImageGrid(2, 2, 2)]
    with pytest.raises(ValueError, match="image grids give 8 tokens for a row with 9"):
        frame_grids([one, one], [9])


# ------------------------------------------------------------------------------------------ batched vision encoding
def test_batched_vision_encoding_gives_the_same_output_and_keeps_only_the_read_layer(llava):
    from mmaccel.vision_tokens import BatchedTower, BatchedVisionEncoding
    from mmaccel.vision_tokens.batched_tower import BatchedProjector

    inputs = _frames_prompt(7, seed=4)
    plain = _generate(llava, inputs)
    tower, projector = llava.model.vision_tower, llava.model.multi_modal_projector
    calls, projected = [], []
    handle = tower.register_forward_hook(lambda m, a, out: calls.append((a[0].shape[0], out)))
    handle2 = projector.register_forward_hook(lambda m, a, out: projected.append(a[0].shape[0]))
    try:
        with BatchedVisionEncoding(llava, batch=3), Pooling(keep_ratio=0.5).apply(llava):
            assert isinstance(llava.model.vision_tower, BatchedTower)
            assert isinstance(llava.model.multi_modal_projector, BatchedProjector)
            batched = _generate(llava, inputs)
            assert projected == [3, 3, 1]  # the projector too runs 3 frames at a time
        with Pooling(keep_ratio=0.5).apply(llava):
            pooled = _generate(llava, inputs)
        _same_generation(_generate(llava, inputs), plain)
    finally:
        handle.remove()
        handle2.remove()
    assert llava.model.vision_tower is tower and llava.model.multi_modal_projector is projector  # put back
    assert [n for n, _ in calls[:3]] == [3, 3, 1]  # 7 frames, 3 at a time
    _same_generation(batched, pooled)
    with BatchedVisionEncoding(llava, batch=3):
        out = llava.model.vision_tower(inputs["pixel_values"], output_hidden_states=True, return_dict=True)
    read = llava.config.vision_feature_layer % (llava.config.vision_config.num_hidden_layers + 1)
    assert [h is not None for h in out.hidden_states] == [i == read for i in range(len(out.hidden_states))]
    assert out.hidden_states[read].shape[0] == 7


def test_batched_vision_encoding_drops_the_tower_output_once_projected(llava):
    """LLaVA keeps the tower's output in ``image_outputs`` through the language model; in the context only the
    projected features stay, and the logits are those of the plain model."""
    from mmaccel.vision_tokens import BatchedVisionEncoding

    inputs = _frames_prompt(5, seed=6)
    with torch.inference_mode():
        plain = llava(**inputs)
        with BatchedVisionEncoding(llava, batch=2):
            batched = llava(**inputs)
    assert plain.image_outputs.last_hidden_state is not None
    assert batched.image_outputs.last_hidden_state is None and batched.image_outputs.hidden_states is None
    # the ModelOutput's dict entries too, which is what keeps the tensors alive
    assert [batched.image_outputs.get(k) for k in ("last_hidden_state", "hidden_states")] == [None, None]
    assert len(batched.image_outputs.pooler_output) == 5
    torch.testing.assert_close(batched.logits, plain.logits, rtol=1e-5, atol=1e-5)


def test_batched_vision_encoding_refuses_bad_batches_and_other_layouts(llava, qwen2vl):  # noqa: F811
    from mmaccel.vision_tokens import BatchedVisionEncoding

    with pytest.raises(ValueError, match="integer >= 1"):
        BatchedVisionEncoding(llava, batch=0)
    with pytest.raises(ValueError, match="fixed-grid LLaVA models only"):
        BatchedVisionEncoding(qwen2vl[0], batch=4)


@pytest.mark.parametrize("method_first", [False, True])
@pytest.mark.parametrize("spec", ["visionzip:keep_ratio=0.5", "prumerge:keep_ratio=0.5"])
def test_cls_attention_methods_read_every_slice_of_a_batched_tower(llava, spec, method_first):
    """VisionZip and PruMerge read the tower's [CLS] attention per image; with the tower run 2 frames at a time the
    captures of all three calls are used, so the output is the unbatched run's, whichever context is entered
    first."""
    from mmaccel.vision_tokens import BatchedVisionEncoding, build_method

    inputs = _frames_prompt(5, seed=7)
    method = build_method(spec)
    with method.apply(llava):
        plain = _generate(llava, inputs)
    kept = method.telemetry["kept_positions"]
    method = build_method(spec)
    contexts = [BatchedVisionEncoding(llava, batch=2), method.apply(llava)]
    with contexts[method_first], contexts[not method_first]:
        batched = _generate(llava, inputs)
    assert method.telemetry["kept_positions"] == kept
    _same_generation(batched, plain)
