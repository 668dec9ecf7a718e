"""mmaccel.speculative.layer_skip: skip-set search on a hand-made case, greedy exactness, the target left untouched,
skip-set files, bad input."""
import json

import pytest
import torch
from tiny_models import tiny_llama

import mmaccel
from mmaccel.speculative import (
    METHODS,
    LayerSkip,
    SkipSet,
    available_skip_sets,
    build_drafter,
    build_speculative_method,
    load_skip_set,
    search_skip_layers,
    skipping_layers,
    speculative_generate,
)
from mmaccel.speculative.layer_skip import draft_agreement, draft_cost

pytestmark = pytest.mark.usefixtures("one_thread")

IDENTITY = (2, 4)  # layers of the hand-made model whose output is exactly their input


@pytest.fixture(scope="module")
def hand():
    """A 6-layer random Llama whose layers 2 and 4 add nothing to the residual stream (zero attention output and MLP
    down projections: skipping them is exact) and whose other layers are made to matter (outputs scaled by 10)."""
    model = tiny_llama(layers=6, vocab_size=128, seed=0)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            scale = 0.0 if i in IDENTITY else 10.0
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def micro():
    return mmaccel.load("micro-lm", device="cpu")


def _plain(model, ids, n, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kw)


def _calibration():
    return torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------------------------ search
def test_search_finds_the_layers_that_do_nothing(hand):
    found = search_skip_layers(hand, _calibration(), model_name="hand")
    path = found.found_by["path"]
    assert sorted(layer for layer, _ in path[:2]) == list(IDENTITY)
    assert [agreement for _, agreement in path[:2]] == [1.0, 1.0]
    assert found.skip == list(IDENTITY) and found.agreement == 1.0
    # skipping any further layer (all of them matter) costs agreement: the search stops or scores it lower
    assert draft_agreement(hand, list(_calibration()[:, None]), [*IDENTITY, 1]) < 1.0
    assert found.draft_cost == pytest.approx(draft_cost(hand, IDENTITY)) and 0 < found.draft_cost < 1
    rates = found.found_by["rates"]
    assert rates[1]["expected_rate"] > rates[0]["expected_rate"] > 1.0  # cheaper draft, same acceptance


def test_skipped_identity_layers_draft_exactly_what_the_target_decodes(hand):
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(4))
    out = speculative_generate(hand, ids, LayerSkip(skip=list(IDENTITY)), max_new_tokens=21, num_draft_tokens=4,
                               eos_token_id=None)
    assert torch.equal(out.sequences, _plain(hand, ids, 21, eos_token_id=None))
    assert out.acceptance_rate == 1.0 and out.accepted[:4] == [4, 4, 4, 4]
    assert out.drafter_telemetry["skipped_layers"] == list(IDENTITY)
    # the target's cache holds only its own K/V of the committed tokens: 6 layers x (16 + 21 - 1) slots, K and V,
    # 2 KV heads of 16 fp32 values; the draft's cache is separate
    assert out.kv_cache_bytes == 2 * 6 * 2 * (16 + 21 - 1) * 16 * 4


# ------------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("skip", [[2], "1,3"])
def test_greedy_equals_generate_on_micro_lm(micro, skip):
    model, tok = micro
    ids = tok(" ".join(json.__doc__.split()), return_tensors="pt").input_ids[:, :48]
    out = speculative_generate(model, ids, LayerSkip(skip=skip), max_new_tokens=32, num_draft_tokens=3)
    assert torch.equal(out.sequences, _plain(model, ids, 32))
    assert out.draft_forwards > 0 and out.target_forwards == out.steps + 1


def test_greedy_equals_generate_on_tiny_random_llama_batch():
    """Left-padded rows: each row equals its own plain decoding; sampling runs too."""
    model = tiny_llama(layers=4, vocab_size=128, seed=3)
    gen = torch.Generator().manual_seed(6)
    rows = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (12, 7)]
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, 12 - len(row):], mask[b, 12 - len(row):] = torch.tensor(row), 1
    out = speculative_generate(model, ids, LayerSkip(skip=[1, 2]), max_new_tokens=16, attention_mask=mask,
                               eos_token_id=None, pad_token_id=0)
    for b, row in enumerate(rows):
        own = _plain(model, torch.tensor([row]), 16, eos_token_id=None)[0, len(row):]
        assert torch.equal(out.sequences[b, 12:], own), b
    sampled = speculative_generate(model, ids[:1], LayerSkip(skip=[1]), max_new_tokens=8, temperature=0.8,
                                   generator=torch.Generator().manual_seed(0), eos_token_id=None)
    assert sampled.new_tokens == 8


def test_the_target_is_restored(hand):
    layers = hand.model.layers
    with skipping_layers(hand, IDENTITY):
        assert len(hand.model.layers) == 4 and all(hand.model.layers[i] is layers[j] for i, j in enumerate([0, 1, 3, 5]))
    assert hand.model.layers is layers and len(layers) == 6
    with pytest.raises(RuntimeError, match="inside"), skipping_layers(hand, [1]):
        raise RuntimeError("inside")
    assert hand.model.layers is layers


# ------------------------------------------------------------------------------------------------ files
def test_skip_set_round_trips_through_json(hand, tmp_path):
    found = search_skip_layers(hand, _calibration(), model_name="hand")
    path = found.save(tmp_path / "sets" / "hand.json")
    back = load_skip_set(path)
    assert back.to_dict() == found.to_dict() and back.source == str(path)
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    out = speculative_generate(hand, ids, LayerSkip(skip_set=str(path)), max_new_tokens=9, eos_token_id=None)
    assert out.acceptance_rate == 1.0 and out.drafter_telemetry["skipped_layers"] == list(IDENTITY)


def test_shipped_skip_sets_load_and_micro_lm_uses_its_own(micro):
    assert {"micro-lm", "smollm2-135m"} <= set(available_skip_sets())
    for name in available_skip_sets():
        found = load_skip_set(name)
        assert found.skip and found.fingerprint["num_hidden_layers"] == found.num_layers
        assert 0 < found.agreement <= 1 and 0 < found.draft_cost < 1
    model, tok = micro
    drafter = LayerSkip()  # no skip given: the shipped set whose fingerprint is micro-lm's
    ids = tok(" ".join(json.__doc__.split()), return_tensors="pt").input_ids[:, :24]
    out = speculative_generate(model, ids, drafter, max_new_tokens=12)
    assert torch.equal(out.sequences, _plain(model, ids, 12))
    assert drafter.resolved.skip == load_skip_set("micro-lm").skip


# ------------------------------------------------------------------------------------------------ registry
def test_registry_and_spec():
    assert METHODS["layer_skip"] is LayerSkip
    assert build_drafter("layer_skip:skip=1,3").skip == "1,3"
    method = build_speculative_method("layer_skip:skip=2:k=3")
    assert isinstance(method.drafter, LayerSkip) and method.num_draft_tokens == 3


# ------------------------------------------------------------------------------------------------ bad input
def test_out_of_range_skip_is_refused(hand):
    drafter = LayerSkip(skip=[2, 7])  # the range is known only once the target is
    with pytest.raises(ValueError, match=r"skip index 7 is out of range for a model with 6 decoder layers: skip "
                                         r"layers 1 \.\. 5 \(layer 0 always runs\)"):
        speculative_generate(hand, torch.tensor([[5, 6, 7]]), drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match="skip index 7 is out of range"), skipping_layers(hand, [7]):
        pass
    assert len(hand.model.layers) == 6


@pytest.mark.parametrize("kwargs,message", [
    ({"skip": [2, 2]}, "skip lists a layer twice"),
    ({"skip": "0,2"}, "layer 0 cannot be skipped"),
    ({"skip": [-1]}, "skip index -1 is out of range"),
    ({"skip": "a,b"}, "skip must be layer indices such as '4,7,9'"),
    ({"skip": []}, "skip is empty"),
    ({"skip": [2], "skip_set": "micro-lm"}, "not both"),
    ({"stop_below": 1.5}, r"stop_below must be in \(0, 1\)"),
])
def test_bad_drafter_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerSkip(**kwargs)


def test_bad_skip_sets_are_refused(hand, tmp_path):
    with pytest.raises(ValueError, match=r"unknown skip set 'nope'.*shipped: .*micro-lm"):
        load_skip_set("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read skip set"):
        load_skip_set(bad)
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="is not a skip set"):
        load_skip_set(bad)
    other = SkipSet([1], 4).save(tmp_path / "four.json")
    with pytest.raises(ValueError, match="made for a model with 4 decoder layers; this model has 6"):
        speculative_generate(hand, torch.tensor([[5, 6, 7]]), LayerSkip(skip_set=str(other)), max_new_tokens=4)
    with pytest.raises(ValueError, match="no shipped skip set matches this llama model with 6 layers"):
        speculative_generate(hand, torch.tensor([[5, 6, 7]]), LayerSkip(), max_new_tokens=4)


def test_bad_search_inputs_are_refused(hand, micro):
    with pytest.raises(ValueError, match="calibration text is empty"):
        search_skip_layers(hand, [])
    with pytest.raises(ValueError, match="calibration text is empty"):
        search_skip_layers(micro[0], "", tokenizer=micro[1])
    with pytest.raises(ValueError, match="calibration text needs a tokenizer"):
        search_skip_layers(hand, "some text")
    with pytest.raises(ValueError, match="k_max .* must be an integer >= 1"):
        search_skip_layers(hand, _calibration(), k_max=0)
    with pytest.raises(ValueError, match=r"max_skip must be an integer in 1 \.\. 4"):
        search_skip_layers(hand, _calibration(), max_skip=5)


@pytest.mark.parametrize("k", [0, -1])
def test_draft_length_must_be_positive(hand, k):
    with pytest.raises(ValueError, match="num_draft_tokens must be an int >= 1"):
        speculative_generate(hand, torch.tensor([[5, 6, 7]]), LayerSkip(skip=[2]), max_new_tokens=4,
                             num_draft_tokens=k)
    with pytest.raises(ValueError, match="draft length k must be an integer >= 1"):
        build_speculative_method(f"layer_skip:skip=2:k={k}")
