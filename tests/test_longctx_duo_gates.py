"""DuoAttention's optimization-based finder: the gated attention is exactly full / streaming attention at gates 1 / 0
(checked against the retrieval-head split's own prefill), and a short training run moves the gates, keeps the model
frozen and gives every module back its own attention."""
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama
from transformers import PreTrainedTokenizerFast

from mmaccel.longctx import RetrievalHeads, load_head_pattern
from mmaccel.longctx.duo_gates import find_retrieval_heads_by_gates, gated_attention, streaming_mask
from mmaccel.longctx.head_pattern import HeadPattern, config_fingerprint

pytestmark = pytest.mark.usefixtures("one_thread")

MICRO_LM = Path(__file__).resolve().parents[1] / "assets" / "models" / "micro-lm"
PROSE = ("The river bends twice before it reaches the old mill. Farmers bring their grain in autumn, and the wheel "
         "turns from dawn until dusk. Children count the boats that pass under the stone bridge. ") * 4


def test_streaming_mask_hand_computed():
    mask = streaming_mask(5, 5, sink=1, window=1, device="cpu")
    assert mask.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0],
                                   [1, 0, 0, 1, 1]]


def test_gates_at_one_and_zero_are_the_retrieval_head_split():
    model = tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    alphas = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    with torch.no_grad(), gated_attention(model, alphas, sink=2, window=6):
        gated = model(ids).logits
    pattern = HeadPattern(2, 2, 4, alphas.tolist(), [(0, 0), (1, 1)], config_fingerprint(model.config))
    # the gated model is the split with the sparse prefill (the default is dense since the measured best)
    method = RetrievalHeads(pattern=pattern, sink=2, window=6, prefill="sparse")
    with method.make_cache(model) as cache, torch.no_grad():
        split = model(ids, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(gated, split, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        plain = model(ids).logits  # full attention again after the block
        with gated_attention(model, torch.ones(2, 2), sink=2, window=6):
            torch.testing.assert_close(model(ids).logits, plain, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(plain, gated, atol=1e-3)
    assert model.model.layers[0].self_attn.config is model.config


def test_a_short_training_run_moves_the_gates_and_leaves_the_model_as_it_was():
    tokenizer = PreTrainedTokenizerFast.from_pretrained(MICRO_LM)
    from mmaccel.data.haystack import HaystackTokens

    model = tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16, tokenizer=tokenizer, max_positions=1024)
    model.model.layers[1].self_attn.q_proj.weight.requires_grad_(False)  # a flag that must come back as it was
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pattern = find_retrieval_heads_by_gates(model, tokenizer, lengths=(96,), steps=3, window=8, supervise=8,
                                            fraction=0.5, haystack=HaystackTokens(tokenizer, text=PROSE))
    assert len(pattern.found_by["distill_loss"]) == 3 and pattern.found_by["finder"].startswith("optimization")
    assert pattern.found_by["haystacks"] == ["custom text"]
    flat = [a for row in pattern.scores for a in row]
    assert all(0 <= a <= 1 for a in flat) and min(flat) < 1  # the L1 term moved them
    assert len(pattern.retrieval_heads) == 2 and pattern.check_model(model.config) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.model.layers[1].self_attn.q_proj.weight.requires_grad
    assert model.model.layers[0].self_attn.q_proj.weight.requires_grad
    assert model.model.layers[0].self_attn.config is model.config
    with pytest.raises(ValueError, match="steps >= 1"):
        find_retrieval_heads_by_gates(model, tokenizer, steps=0)


def test_shipped_gate_pattern_overlaps_the_training_free_one_on_the_retrieval_head():
    gates, free = load_head_pattern("micro-lm-gates"), load_head_pattern("micro-lm")
    assert gates.found_by["finder"].startswith("optimization") and free.found_by["finder"].startswith("training-free")
    assert gates.with_fraction(0.125).retrieval_heads == free.with_fraction(0.125).retrieval_heads == [(1, 0)]
