"""One vision-tower pass per clip shared by the methods that leave the tower alone
(:class:`mmaccel.vision_tokens.shared_encoding.SharedVisionEncoding`): the same tokens as each method's own
encoding, the tower run once, the model's own tower back on exit, and video-niah's records saying what they shared."""
import pytest
import torch
from test_smol_llava import parts  # noqa: F401 - the tiny Dinov2 / Llama parts fixture
from test_video_chunked import _frames_prompt, _generate, llava  # noqa: F401 - the tiny LLaVA fixture
from test_vision_eval import vlm  # noqa: F401 - the tiny smol-llava and its processor
from test_vision_tokens_vlm import qwen2vl  # noqa: F401 - the tiny Qwen2-VL fixture

from mmaccel.eval.video_niah import video_niah
from mmaccel.vision_tokens import BatchedVisionEncoding, build_method
from mmaccel.vision_tokens.shared_encoding import SharedVisionEncoding, reads_tower_output_only

pytestmark = pytest.mark.usefixtures("one_thread")


class _TowerCalls:
    """Forwards of the model's own vision tower (a hook on that module, whatever wraps it), removed on exit."""

    def __init__(self, tower):
        self.tower, self.calls = tower, 0

    def __enter__(self):
        self.handle = self.tower.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("spec, shares", [
    (None, True), ("pooling:keep_ratio=0.25", True), ("temporal-tome:keep_ratio=0.25", True),
    ("aim:keep_ratio=0.25", True), ("fastv:keep_ratio=0.25:layer=1", True),
    ("visionzip:keep_ratio=0.25", False), ("prumerge:keep_ratio=0.25", False), ("tome:r=2", False),
])
def test_which_methods_only_read_the_tower_output(spec, shares):
    assert reads_tower_output_only(None if spec is None else build_method(spec)) is shares


@pytest.mark.parametrize("spec", [None, "pooling:keep_ratio=0.25", "temporal-tome:keep_ratio=0.25"])
@pytest.mark.parametrize("batch", [None, 2])
def test_shared_encoding_gives_the_tokens_of_the_own_encoding_and_runs_the_tower_once(llava, spec, batch):  # noqa: F811
    inputs = _frames_prompt(3, seed=1)
    method = None if spec is None else build_method(spec)
    own_tower = llava.model.vision_tower

    def run():
        if method is None:
            return _generate(llava, inputs)
        with method.apply(llava):
            return _generate(llava, inputs)

    with BatchedVisionEncoding(llava, batch) if batch else torch.no_grad():
        own = run()
        shared = SharedVisionEncoding(llava, batch)
        with _TowerCalls(own_tower) as calls:
            seconds = shared.encode(inputs["pixel_values"].clone())  # equal values, another tensor
            assert calls.calls == (3 // batch + 1 if batch else 1) and seconds > 0 and shared.encode_s == seconds
            with shared.applied():
                assert llava.model.vision_tower is not own_tower
                again = run()
                twice = run()
            assert calls.calls == (3 // batch + 1 if batch else 1)  # answered from the store both times
    assert llava.model.vision_tower is own_tower
    assert shared.hits == 2
    assert torch.equal(again.sequences, own.sequences) and torch.equal(twice.sequences, own.sequences)
    assert all(torch.equal(a, b) for a, b in zip(again.logits, own.logits))


def test_other_pixels_run_the_tower_and_clear_drops_the_store(llava):  # noqa: F811 - the imported fixture
    inputs, other = _frames_prompt(2, seed=1), _frames_prompt(2, seed=2)
    shared = SharedVisionEncoding(llava)
    shared.encode(inputs["pixel_values"])
    with _TowerCalls(llava.model.vision_tower) as calls, shared.applied():
        own_other = _generate(llava, other)
        assert calls.calls == 1 and shared.hits == 0  # another clip (a warm-up): the real tower
        shared.clear()
        _generate(llava, inputs)
        assert calls.calls == 2 and shared.hits == 0 and shared.encode_s is None
    assert torch.equal(_generate(llava, other).sequences, own_other.sequences)


def test_shared_encoding_refuses_bad_settings(llava, qwen2vl):  # noqa: F811 - the imported fixtures
    with pytest.raises(ValueError, match="integer >= 1"):
        SharedVisionEncoding(llava, 0)
    with pytest.raises(ValueError, match="fixed-grid LLaVA"):
        SharedVisionEncoding(qwen2vl[0])


def test_video_niah_shares_one_encoding_per_clip_with_the_same_answers(vlm):  # noqa: F811 - the imported fixture
    """Two clips (depths 0 and 1), three methods, one of them tower-scored: the first clip runs every method with its
    own encoding (its peak memory measured), the second encodes once for the two methods that read the tower's
    output only, and VisionZip runs the tower itself. Every answer equals the unshared sweep's."""
    model, processor = vlm
    methods = ["none", "pooling:keep_ratio=0.25+streaming:window=8:sink=2", "visionzip:keep_ratio=0.25"]

    def sweep(share, vision_batch=None):
        with _TowerCalls(model.model.vision_tower) as calls:
            result = video_niah(model, processor, methods, [2], [0.0, 1.0], size=56, max_new_tokens=3, warmup=0,
                                progress=False, share_encoding=share, vision_batch=vision_batch)
        return result, calls.calls

    (own, own_calls), (shared, shared_calls) = sweep(False), sweep(True)
    assert own_calls == 6 and shared_calls == 3 + 1 + 1
    assert [r["output_ids"] for r in shared.records] == [r["output_ids"] for r in own.records]
    # frames encoded one at a time (BatchedVisionEncoding around the sweep): the same answers, one tower call a frame
    batched, batched_calls = sweep(True, vision_batch=1)
    assert batched_calls == 2 * (3 + 1 + 1)
    assert [r["output_ids"] for r in batched.records] == [r["output_ids"] for r in own.records]
    assert all(r["status"] == "ok" for r in shared.records)
    for r in shared.records:
        sharing = r["extra"]["depth"] == 1.0 and not r["method"].startswith("visionzip")
        assert ("shared_vision_encoder_s" in r["telemetry"]) is sharing
        if sharing:
            assert r["peak_memory_bytes"] is None and r["samples"][0]["peak_memory_bytes"] is None
            assert r["vision_encoder_s"] >= r["telemetry"]["shared_vision_encoder_s"] > 0
            assert r["ttft_s"] >= r["vision_encoder_s"] + r["prefill_s"] - 1e-9
        else:
            assert r["peak_memory_bytes"] is not None
    assert shared.summary["config"]["share_encoding"] is True
    for label in methods:  # the summary's peak memory is the own-encoding clip's
        assert shared.summary["memory"]["methods"][label]["by_frames"][0]["max_peak_memory_bytes"] is not None
