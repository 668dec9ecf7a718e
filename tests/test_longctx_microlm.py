"""mmaccel.longctx on the committed micro-lm (4 layers, GQA 6/2, head_dim 32): unbounded budgets are exact, and a real
compression's decode logits match an independent per-head masked reference."""
from pathlib import Path

import pytest
import torch
from test_longctx_methods import COMPRESSING, UNBOUNDED, _live_positions, _perhead_reference
from transformers import AttentionInterface, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mmaccel.longctx import build_method

MICRO_LM = Path(__file__).resolve().parents[1] / "assets" / "models" / "micro-lm"
PROMPT = 200


def _load(attn: str = "sdpa") -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(MICRO_LM, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def micro():
    return _load()


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 2048, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_unbounded_budgets_are_token_identical_on_micro_lm(micro):
    ids = _ids(PROMPT)
    plain = micro.generate(ids, max_new_tokens=6, do_sample=False)
    for spec in UNBOUNDED.values():
        with build_method(spec).make_cache(micro) as cache:
            assert torch.equal(micro.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False), plain)


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova"])
@torch.no_grad()
def test_decode_logits_after_compression_match_per_head_reference_on_micro_lm(name, micro):
    steps = 4
    ids = _ids(PROMPT + steps, seed=1)
    spec = COMPRESSING[name].replace("12", "48")
    held, logits = [], []
    with build_method(spec).make_cache(micro) as cache:
        logits.append(micro(ids[:, :PROMPT], past_key_values=cache, use_cache=True).logits[:, -1])
        assert all(layer.held == 48 for layer in cache.layers)
        for t in range(PROMPT, PROMPT + steps):
            held.append([_live_positions(layer) for layer in cache.layers])
            logits.append(micro(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    total = PROMPT + steps
    reference = _load()
    AttentionInterface.register("perhead_test", _perhead_reference)
    AttentionMaskInterface.register("perhead_test", sdpa_mask)
    reference.set_attn_implementation("perhead_test")
    hkv = micro.config.num_key_value_heads
    for layer_idx, layer in enumerate(reference.model.layers):
        allowed = torch.ones(1, hkv, total, total).tril().bool()
        for step, t in enumerate(range(PROMPT, total)):
            allowed[:, :, t] = False
            allowed[:, :, t].scatter_(-1, held[step][layer_idx], True)
            allowed[:, :, t, t] = True
        layer.self_attn._test_allowed = allowed
    ref = reference(ids).logits[0, PROMPT - 1 : total - 1]
    torch.testing.assert_close(torch.cat(logits[:-1]), ref, rtol=1e-4, atol=1e-4)
