"""PackedLinear / PackedLinears: equal to nn.Linear up to fp32 rounding, swapped on one instance and put back,
lossless speculative decoding still token-identical under it, one clear error for what it cannot pack."""
import pytest
import torch
from test_eval import tiny_model_and_tokenizer
from tiny_models import random_prompt, tiny_llama

from mmaccel.eval.specbench import run_spec_bench
from mmaccel.kernels import PackedLinear, PackedLinears, packed_linear_available

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="this PyTorch build has no oneDNN linear ops")


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_nn_linear(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias)
    for shape in [(1, 1, 24), (2, 3, 24), (5, 24)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)
    assert PackedLinear(linear).weight is linear.weight


def test_packed_linears_swaps_one_instance_and_puts_everything_back():
    model = tiny_llama(layers=2)
    other = tiny_llama(layers=2)
    originals = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    head_weight = model.get_output_embeddings().weight
    ids = random_prompt(20, seed=1)
    plain = model.generate(ids, max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        reference_logits = model(ids).logits
    with PackedLinears(model) as packed:
        assert packed.count == len(originals) == 2 * 7 + 1  # q k v o gate up down per layer, the LM head
        assert packed.packed_bytes == sum(m.weight.numel() * 4 for m in originals.values())
        assert not any(type(m) is torch.nn.Linear and name in originals for name, m in model.named_modules())
        assert not any(isinstance(m, PackedLinear) for m in other.modules())  # only this instance changed
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, reference_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), plain)
    assert {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear} == originals
    assert model.get_output_embeddings().weight is head_weight


def test_lossless_speculative_decoding_stays_identical_with_packed_target_and_draft(monkeypatch):
    model, tok = tiny_model_and_tokenizer()
    draft = tiny_llama(layers=1, heads=4, kv_heads=2, head_dim=16, max_positions=2048, tokenizer=tok, seed=3)
    packed_during_run = []
    real_enter = PackedLinears.__enter__

    def spy(self):
        out = real_enter(self)
        packed_during_run.append([type(m).__name__ for m in (model.lm_head, draft.lm_head)])
        return out

    monkeypatch.setattr(PackedLinears, "__enter__", spy)
    res = run_spec_bench(model, tok, ["draft", "prompt_lookup"], prompts="copy", n_prompts=1, max_new_tokens=12,
                         repeats=1, warmup=0, draft=draft, packed_linear=True)
    assert packed_during_run == [["PackedLinear", "PackedLinear"]]  # the target and the draft model
    assert res.summary["config"]["packed_linear"] is True
    for label in ("draft", "prompt_lookup"):
        row = res.summary["sets"]["copy"][label]
        assert row["failed"] == 0 and row["identical"] == row["compared"] == 1
    assert not any(type(m) is PackedLinear for m in [*model.modules(), *draft.modules()])  # put back


def test_what_cannot_be_packed_raises_before_anything_is_swapped():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="packs float32 CPU layers"), PackedLinears(model):
        pass
    assert all(type(m) is torch.nn.Linear for m in model)


def test_drafters_name_the_networks_they_run():
    from mmaccel.speculative import build_speculative_method
    from mmaccel.speculative.eagle import EagleHead

    assert build_speculative_method("prompt_lookup").draft_modules() == []
    cascade = build_speculative_method("cascade:then_k=3")  # prompt lookup, then the committed smollm2 EAGLE head
    assert [type(m) for m in cascade.draft_modules()] == [EagleHead]
