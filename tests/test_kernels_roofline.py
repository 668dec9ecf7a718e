"""The decode roofline: the bandwidth meter, the ceiling arithmetic and the weight bytes a decode step reads."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mmaccel.kernels.roofline import decode_weight_bytes, memory_bandwidth, roofline_fraction, roofline_tokens_per_s


def test_bandwidth_meter_counts_read_and_write():
    bw = memory_bandwidth("cpu", nbytes=4 * 2**20, repeats=2)
    assert bw.gbps > 0 and bw.nbytes == 4 * 2**20 and bw.repeats == 2 and bw.threads == torch.get_num_threads()


@pytest.mark.parametrize("kw", [{"nbytes": 1024}, {"nbytes": 2**21, "repeats": 0}, {"nbytes": 2**21, "warmup": -1}])
def test_bandwidth_meter_refuses_what_would_not_measure_memory(kw):
    with pytest.raises(ValueError):
        memory_bandwidth("cpu", **kw)


def test_roofline_arithmetic():
    # 10 GB/s over 400 MB of weights and 100 MB of K/V: 20 tokens/s; 10 tokens/s measured is half of it
    assert roofline_tokens_per_s(10.0, 400_000_000, 100_000_000) == pytest.approx(20.0)
    assert roofline_fraction(10.0, 10.0, 400_000_000, 100_000_000) == pytest.approx(0.5)
    # a quarter of the K/V raises the ceiling: 10e9 / 425e6
    assert roofline_tokens_per_s(10.0, 400_000_000, 25_000_000) == pytest.approx(10e9 / 425e6)
    assert roofline_fraction(None, 10.0, 1, 1) is None and roofline_fraction(1.0, 10.0, 1, None) is None
    for bad in [(0.0, 1, 1), (float("nan"), 1, 1), (1.0, -1, 1), (1.0, 0, 0)]:
        with pytest.raises(ValueError):
            roofline_tokens_per_s(*bad)


@pytest.mark.parametrize("tied", [True, False])
def test_decode_weight_bytes_skips_an_untied_embedding_table(tied):
    cfg = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields tied ones once
    table = 1000 * 32 * 4
    assert decode_weight_bytes(model) == (all_bytes if tied else all_bytes - table)
