"""Long video streamed: frames encoded, reduced and prefilled as they come (mmaccel.eval.video_niah.streamed_generate).

The tiny random LlavaForConditionalGeneration of test_video_chunked (CLIP tower + Llama, 56 px, 16 visual tokens per
frame); the prompt is built from ids (no processor)."""
import pytest
import torch
from test_video_chunked import IMAGE, PER_IMAGE, llava  # noqa: F401 - the tiny LLaVA fixture (16 tokens per frame)

from mmaccel.eval.memory import PeakMemory
from mmaccel.eval.video_niah import check_streamed, streamed_generate

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX, SEP, SUFFIX = torch.tensor([1, 7, 8]), torch.tensor([9]), torch.tensor([20, 21, 22])


def _batches(n_frames, batch, seed=0):
    """Random frames a batch at a time, each batch made when asked for (no tensor of all the frames exists)."""
    for start in range(0, n_frames, batch):
        b = min(batch, n_frames - start)
        yield torch.randn(b, 3, 56, 56, generator=torch.Generator().manual_seed(seed * 100_003 + start))


def _unstreamed_inputs(n_frames, pixels):
    ids = PREFIX.tolist()
    for f in range(n_frames):
        ids += ([SEP.item()] if f else []) + [IMAGE] * PER_IMAGE
    ids = torch.tensor([ids + SUFFIX.tolist()])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


@pytest.mark.parametrize("kv", ["full", "streaming:window=24:sink=2"])
def test_streamed_equals_the_unstreamed_chunked_path(llava, kv):  # noqa: F811 - the imported fixture
    """Same kept tokens, same positions, same chunk pieces, same cache policy: the same greedy tokens and logits as
    the whole prompt through generate under pooling:positions=contiguous + chunked."""
    from mmaccel.longctx import Chunked, build_method
    from mmaccel.vision_tokens import build_method as build_vision

    n, chunk = 12, 16
    pixels = torch.cat(list(_batches(n, 5)))
    vision = "pooling:keep_ratio=0.25:positions=contiguous"
    run = streamed_generate(llava, PREFIX, SEP, SUFFIX, _batches(n, 5), vision=vision, kv=kv, chunk=chunk,
                            max_new_tokens=6)
    method = Chunked(build_method(kv), chunk=chunk)
    with torch.no_grad(), build_vision(vision).apply(llava):
        cache = method.make_cache(llava)
        ref = llava.generate(**_unstreamed_inputs(n, pixels), cache=cache, max_new_tokens=6,
                             do_sample=False, eos_token_id=None)
        cache.close() if hasattr(cache, "close") else None
    assert run.output_ids == ref[0, -6:].tolist()
    assert run.frames == n and run.visual_tokens == n * PER_IMAGE and run.visual_tokens_kept == n * 4
    assert run.prompt_tokens == len(PREFIX) + n * 4 + (n - 1) + len(SUFFIX)


def _peak(llava, n_frames, kv):  # noqa: F811 - the imported fixture
    with PeakMemory(torch.device("cpu"), cpu_meter="allocator") as mem:
        run = streamed_generate(llava, PREFIX, SEP, SUFFIX, _batches(n_frames, 8),
                                vision="pooling:keep_ratio=0.25:positions=contiguous", kv=kv, chunk=32,
                                max_new_tokens=2)
    return mem.peak, run


def test_peak_is_flat_in_frames_under_an_evicting_cache_and_grows_without(llava):  # noqa: F811 - the imported fixture
    small, run_small = _peak(llava, 16, "streaming:window=32:sink=4")
    large, run_large = _peak(llava, 64, "streaming:window=32:sink=4")
    assert run_large.prompt_tokens > 3.5 * run_small.prompt_tokens
    assert run_large.kv_cache_bytes_final == run_small.kv_cache_bytes_final
    assert large <= 1.05 * small, (small, large)
    full, run_full = _peak(llava, 64, "full")  # the meter sees the K/V of a cache that is not bounded
    assert full - large >= 0.5 * (run_full.kv_cache_bytes_final - run_large.kv_cache_bytes_final) > 0


def test_bad_streamed_configurations_fail_before_anything_runs():
    with pytest.raises(ValueError, match="positions=contiguous"):
        check_streamed("pooling:keep_ratio=0.25", None)
    with pytest.raises(ValueError, match="cannot reduce a streamed frame alone"):
        check_streamed("temporal-tome:keep_ratio=0.25:positions=contiguous", None)
    with pytest.raises(ValueError, match="cannot reduce a streamed frame alone"):
        check_streamed("visionzip:keep_ratio=0.25:positions=contiguous", None)
    assert check_streamed("aim:keep_ratio=0.25:positions=contiguous", "streaming:window=8")[0].name == "aim"


def test_position_limit_interpolates_the_video_span_into_the_trained_range(llava):  # noqa: F811 - the imported fixture
    """60 frames x (4 kept + 1 separator) tokens would reach position ~300: under position_limit=128 the video's
    positions are spaced by < 1 and the last answer token stays below the limit; rotary takes fractional positions."""
    n, limit = 60, 128
    seen = []
    handle = llava.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["position_ids"].clone()), with_kwargs=True)
    try:
        run = streamed_generate(llava, PREFIX, SEP, SUFFIX, _batches(n, 16), vision="pooling:keep_ratio=0.25"
                                ":positions=contiguous", kv="full", chunk=64, max_new_tokens=4, frames=n,
                                position_limit=limit)
    finally:
        handle.remove()
    positions = torch.cat([p[0].double() for p in seen])
    assert run.telemetry["position_scale"] < 1.0 and run.telemetry["last_position"] < limit
    assert positions.max() < limit and bool((positions.diff() > 0).all())  # increasing, fractional inside the video
    assert positions[: len(PREFIX)].tolist() == list(range(len(PREFIX)))
    with pytest.raises(ValueError, match="frames="):
        streamed_generate(llava, PREFIX, SEP, SUFFIX, _batches(2, 2), position_limit=limit)
