"""transformers integration: a tiny Llama on attn_implementation="mmaccel" (CPU)."""
import pytest
import torch

from mmaccel.kernels import Chunked, Dense, HeadPatterns, Streaming, attention_patterns, register_attention
from mmaccel.kernels.hf import PATTERN_ATTR
from mmaccel.kernels.sparse_prefill import _masked_reference

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=211, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _load(path, impl):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, attn_implementation=impl).eval()


def _masked_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Oracle attention: the dense masked reference of the layer's patterns (dense causal without)."""
    pattern = getattr(module, PATTERN_ATTR, None) or Dense()
    return _masked_reference(query, key, value, pattern, scaling=scaling).transpose(1, 2), None


def test_greedy_output_equals_sdpa(tiny_llama):
    name = register_attention()
    ids = torch.randint(0, 211, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding in the second row
    ref = _load(tiny_llama, "sdpa").generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    model = _load(tiny_llama, name)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, ref)


def test_patterns_equal_masked_reference_run(tiny_llama):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("masked_oracle", _masked_forward)
    AttentionMaskInterface.register("masked_oracle", sdpa_mask)
    layers = {1: HeadPatterns((Dense(), Streaming(2, 8), Chunked(16, sink=2), Streaming(1, 5))),
              2: Streaming(4, 12)}
    ids = torch.randint(0, 211, (1, 60), generator=torch.Generator().manual_seed(2))
    model, oracle = _load(tiny_llama, register_attention()), _load(tiny_llama, "masked_oracle")
    with attention_patterns(model, layers), attention_patterns(oracle, layers):
        logits = model(ids).logits
        torch.testing.assert_close(logits, oracle(ids).logits, atol=1e-4, rtol=1e-4)
        # prefill (sparse_prefill_attention) then decode steps (decode_attention over the patterns' indices)
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(out, oracle.generate(ids, max_new_tokens=8, do_sample=False))
        sparse = logits
    assert not hasattr(model.model.layers[1].self_attn, PATTERN_ATTR)  # removed on exit
    assert (model(ids).logits - sparse).abs().max() > 1e-3  # and the patterns did change the output


def test_pattern_errors(tiny_llama):
    model = _load(tiny_llama, register_attention())
    with pytest.raises(ValueError, match="no attention layer 7"), attention_patterns(model, {7: Dense()}):
        pass
    with pytest.raises(ValueError, match="does not fit 4 query heads"):
        with attention_patterns(model, {0: HeadPatterns((Dense(),) * 3)}):
            pass
    ids = torch.randint(0, 211, (2, 20))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with attention_patterns(model, {0: Streaming(2, 4)}), pytest.raises(NotImplementedError, match="padded"):
        model(input_ids=ids, attention_mask=mask)


def test_hooked_cache_reads_both_argument_names():
    """transformers <= 5.23 passes the cache as past_key_values, 5.24 (attention modules) as cache."""
    from mmaccel.kernels.hf import hooked_cache

    cache = object()
    assert hooked_cache({"past_key_values": cache}) is cache
    assert hooked_cache({"cache": cache, "hidden_states": None}) is cache
    assert hooked_cache({"past_key_values": None, "cache": cache}) is cache
    assert hooked_cache({"hidden_states": None}) is None
