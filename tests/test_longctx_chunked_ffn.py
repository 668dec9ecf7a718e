"""chunked_ffn: every decoder layer's MLP over the sequence in pieces, the wrapped method otherwise unchanged."""
import pytest
import torch
from tiny_models import random_prompt, tiny_llama

from mmaccel.eval.memory import PeakMemory
from mmaccel.longctx import METHODS, ChunkedFeedForward, build_method
from mmaccel.longctx.chunked_ffn import ChunkedMLP, feed_forward_owners


@pytest.fixture(scope="module")
def sdpa():
    return tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16, attn="sdpa")


def _mlp_calls(model):
    """``(lengths, handle)``: the sequence lengths each call of layer 0's own MLP sees (a hook on it, found under any
    wrapper), and the hook's handle to remove."""
    seen: list[int] = []
    layer = feed_forward_owners(model)[0]
    own = layer.mlp.mlp if isinstance(layer.mlp, ChunkedMLP) else layer.mlp
    handle = own.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    return seen, handle


def test_chunked_mlp_splits_the_sequence_and_equals_the_whole():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.SiLU(), torch.nn.Linear(32, 6))
    lengths = []
    mlp.register_forward_hook(lambda mod, args, out: lengths.append(args[0].shape[1]))
    x = torch.randn(2, 23, 8)
    out = ChunkedMLP(mlp, chunk=10)(x)
    assert lengths == [10, 10, 3]
    assert out.shape == (2, 23, 6)
    torch.testing.assert_close(out, mlp(x), rtol=1e-6, atol=1e-6)
    lengths.clear()
    ChunkedMLP(mlp, chunk=10)(x[:, :1])  # a decode step goes through whole
    assert lengths == [1]


@pytest.mark.parametrize("inner", ["full", "snapkv:budget=12:window=4", "streaming:window=6:sink=2",
                                   "chunked:chunk=16:method=snapkv,budget=12,window=4"])
def test_greedy_output_and_kept_slots_equal_the_wrapped_method_alone(sdpa, inner):
    """A real compression (12 of 40 slots): same tokens, logits and kept positions as the method alone, while the
    prefill's MLP calls are 8-token pieces; afterwards the layers have their own MLPs back."""
    ids = random_prompt(40, seed=21)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    own_mlps = [layer.mlp for layer in feed_forward_owners(sdpa)]
    alone_method = build_method(inner)
    alone_cache = alone_method.make_cache(sdpa)
    alone = sdpa.generate(ids, past_key_values=alone_cache, **kwargs)
    method = ChunkedFeedForward(build_method(inner), chunk=8)
    seen, handle = _mlp_calls(sdpa)
    try:
        with method.make_cache(sdpa) as cache:
            assert all(isinstance(layer.mlp, ChunkedMLP) for layer in feed_forward_owners(sdpa))
            out = sdpa.generate(ids, past_key_values=cache, **kwargs)
    finally:
        handle.remove()
    assert [layer.mlp for layer in feed_forward_owners(sdpa)] == own_mlps
    assert torch.equal(out.sequences, alone.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(alone.logits), rtol=1e-5, atol=1e-5)
    assert max(seen) <= 8 and seen[-5:] == [1] * 5
    if inner != "full":
        for a, b in zip(cache.layers, alone_cache.layers):
            assert torch.equal(a.positions, b.positions)
        assert method.telemetry(cache)["kept_tokens_per_layer"] == alone_method.telemetry(alone_cache)[
            "kept_tokens_per_layer"]
        assert method.telemetry(cache)["chunk"] == 8 and method.telemetry(cache)["method"] == "chunked_ffn"


def test_prefill_peak_falls_on_exact_allocations():
    """Exact CPU allocations of a 512-token prefill of a model with a wide MLP: the chunked feed-forward holds one
    64-token piece of the [L, 2048] intermediates instead of the whole prompt's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=2048, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="sdpa")).eval()
    ids = torch.randint(0, 64, (1, 512))
    peaks = {}
    for spec in ("full", "chunked_ffn:chunk=64"):
        cache = build_method(spec).make_cache(model)
        with torch.inference_mode(), PeakMemory(torch.device("cpu"), cpu_meter="allocator") as mem:
            model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        getattr(cache, "close", lambda: None)()
        peaks[spec] = mem.peak
    one_intermediate = 512 * 2048 * 4  # bytes of one [1, 512, 2048] fp32 tensor
    assert peaks["full"] - peaks["chunked_ffn:chunk=64"] >= 2 * one_intermediate


def test_a_failed_run_still_gives_the_mlps_back(sdpa):
    own = [layer.mlp for layer in feed_forward_owners(sdpa)]
    cache = build_method("chunked_ffn:chunk=4").make_cache(sdpa)
    with pytest.raises(IndexError), cache:
        sdpa(torch.tensor([[10_000] * 9]), past_key_values=cache, use_cache=True)  # out of the vocabulary
    assert [layer.mlp for layer in feed_forward_owners(sdpa)] == own


def test_spec_round_trips_through_the_registry():
    method = build_method("chunked_ffn:chunk=8:method=snapkv,budget=12,window=4")
    assert isinstance(method, ChunkedFeedForward) and METHODS["chunked_ffn"] is ChunkedFeedForward
    assert method.method.budget == 12 and method.chunk == 8
    assert build_method(method.spec) == method
    assert build_method("chunked_ffn").chunk == 512 and build_method("chunked_ffn").method.name == "full"


@pytest.mark.parametrize("spec, match", [
    ("chunked_ffn:chunk=0", "chunk must be an integer >= 1"),
    ("chunked_ffn:method=chunked_ffn,chunk=4", "chunked_ffn cannot wrap itself"),
    ("chunked_ffn:method=nope", "nope"),
])
def test_bad_specs_give_one_clear_error(spec, match):
    with pytest.raises(ValueError, match=match):
        build_method(spec)


def test_a_model_without_decoder_layers_and_a_second_open_cache_are_refused(sdpa):
    with pytest.raises(ValueError, match="no decoder layer with self_attn and mlp"):
        build_method("chunked_ffn").make_cache(torch.nn.Linear(4, 4))
    with build_method("chunked_ffn").make_cache(sdpa), pytest.raises(ValueError, match="already chunked by another"):
        build_method("chunked_ffn").make_cache(sdpa)


def test_a_feed_forward_that_returns_a_tuple_is_refused_at_its_forward():
    class Router(torch.nn.Module):
        def forward(self, x):
            return x, x.sum(-1)

    with pytest.raises(TypeError, match="returns tuple, not one tensor"):
        ChunkedMLP(Router(), chunk=2)(torch.randn(1, 5, 3))
