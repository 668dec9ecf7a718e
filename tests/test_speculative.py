"""mmaccel.speculative: greedy exactness of every drafter, batch > 1 per row, telemetry, adaptive length, errors."""
import json
import types
import warnings

import pytest
import torch
from tiny_models import tiny_llama
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import mmaccel
from mmaccel.speculative import (
    METHODS,
    AdaptiveDraftLength,
    DraftModel,
    Jacobi,
    PromptLookup,
    Sampler,
    build_drafter,
    check_same_vocabulary,
    speculative_generate,
)

MAX_NEW = 40


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def micro():
    model, tok = mmaccel.load("micro-lm", device="cpu")
    draft, _ = mmaccel.load("micro-draft", device="cpu")
    return model, tok, draft


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(layers=2, vocab_size=128, seed=0), tiny_llama(layers=1, vocab_size=128, seed=1)


def _text_prompt(tok, text: str, n: int = 48) -> torch.Tensor:
    return tok(" ".join(text.split()), return_tensors="pt").input_ids[:, :n]


def _plain(model, ids, max_new=MAX_NEW, **kw) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, **kw)


def _drafters(draft_model):
    return {"draft": DraftModel(draft_model), "prompt_lookup": PromptLookup(), "jacobi": Jacobi()}


# ---------------------------------------------------------------------------------------------- greedy exactness
@pytest.mark.parametrize("name", ["draft", "prompt_lookup", "jacobi"])
def test_greedy_equals_generate_on_micro_lm(micro, name):
    model, tok, draft = micro
    ids = _text_prompt(tok, json.__doc__)
    ref = _plain(model, ids)
    drafter = build_drafter("draft:model=micro-draft") if name == "draft" else _drafters(draft)[name]  # lazy load
    out = speculative_generate(model, ids, drafter, max_new_tokens=MAX_NEW, num_draft_tokens=4)
    assert torch.equal(out.sequences, ref)
    # telemetry is consistent: one prefill (none when folded into the first step: model-free and draft-model
    # drafters on an unpadded text prompt) + one forward per step, each step commits accepted + 1 tokens
    assert out.prefill_folded == (name != "jacobi")
    assert out.target_forwards == out.steps + (not out.prefill_folded)
    assert out.new_tokens == sum(out.accepted) + out.steps == MAX_NEW or out.sequences[0, -1] == 2
    assert out.forward_ratio == pytest.approx(out.new_tokens / out.target_forwards)


def test_prefill_folded_into_the_first_verification(micro):
    """The prompt goes into the first verification forward for a drafter that needs no target state: the same
    greedy output and the same kept K/V as with a prefill of its own, one target forward fewer; a padded batch
    keeps its prefill."""
    model, tok, draft = micro
    ids = _text_prompt(tok, json.__doc__)

    class Unfolded(DraftModel):
        folds_prefill = False

    folded = speculative_generate(model, ids, DraftModel(draft), max_new_tokens=24, num_draft_tokens=4)
    kept = speculative_generate(model, ids, Unfolded(draft), max_new_tokens=24, num_draft_tokens=4)
    assert folded.prefill_folded and not kept.prefill_folded and folded.prefill_seconds == 0 < kept.prefill_seconds
    assert torch.equal(folded.sequences, kept.sequences) and torch.equal(folded.sequences, _plain(model, ids, 24))
    assert folded.target_forwards == kept.target_forwards - 1 and folded.kv_cache_bytes == kept.kv_cache_bytes
    batch = torch.cat([torch.full((1, 3), tok.pad_token_id or 0), ids[:, :20]], dim=1)
    two = torch.cat([batch, ids[:, :23]])
    mask = torch.cat([torch.cat([torch.zeros(1, 3), torch.ones(1, 20)], 1), torch.ones(1, 23)]).long()
    padded = speculative_generate(model, two, DraftModel(draft), max_new_tokens=8, attention_mask=mask)
    assert not padded.prefill_folded


def test_micro_draft_saves_target_forwards(micro):
    model, tok, draft = micro
    ids = _text_prompt(tok, json.__doc__)
    out = speculative_generate(model, ids, DraftModel(draft), max_new_tokens=MAX_NEW, num_draft_tokens=4)
    assert out.draft_forwards == out.drafter_telemetry["draft_forwards"] > 0
    assert 0 < out.acceptance_rate <= 1
    assert out.mean_accepted_length > 1.2  # micro-draft does predict micro-lm; measured ~1.8 on this prompt
    assert out.target_forwards < MAX_NEW


@pytest.mark.parametrize("name", ["draft", "prompt_lookup", "jacobi"])
def test_greedy_equals_generate_on_tiny_random_llama(tiny, name):
    target, draft = tiny
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    ref = _plain(target, ids, eos_token_id=None)
    out = speculative_generate(target, ids, _drafters(draft)[name], max_new_tokens=MAX_NEW, num_draft_tokens=3,
                               eos_token_id=None)
    assert torch.equal(out.sequences, ref)


def test_self_draft_accepts_everything_and_uses_bonus_tokens(tiny):
    """The target as its own draft: every draft accepted, k + 1 tokens per forward (the bonus-token path)."""
    target, _ = tiny
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings(record=True) as caught:  # caches go in under the models' current argument name
        warnings.simplefilter("always")
        out = speculative_generate(target, ids, DraftModel(target), max_new_tokens=21, num_draft_tokens=4,
                                   eos_token_id=None)
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert torch.equal(out.sequences, _plain(target, ids, 21, eos_token_id=None))
    assert out.accepted[:4] == [4, 4, 4, 4] and out.acceptance_rate == 1.0
    assert out.target_forwards == 5  # 21 tokens in steps of 5 (the last one asks for 0 drafts), prefill folded in
    # the target cache was rolled back to every committed token but the last: 16 + 21 - 1 slots of fp32 K and V
    assert out.kv_cache_bytes == 2 * 2 * 2 * (16 + 21 - 1) * 16 * 4
    assert out.telemetry()["new_tokens"] == 21 and out.telemetry()["target_forwards"] == 5


def test_int8_draft_keeps_greedy_output_and_is_made_once(micro):
    """draft:quantize=int8 drafts with an int8 copy (every Linear, LM head included), made once per draft object;
    greedy output equals plain decoding; the float draft is left as it was."""
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    from mmaccel.speculative.quantized_draft import quantized_draft

    model, tok, draft = micro
    ids = _text_prompt(tok, json.__doc__)
    drafter = build_drafter("draft:quantize=int8")
    drafter.model = draft
    out = speculative_generate(model, ids, drafter, max_new_tokens=MAX_NEW, num_draft_tokens=4)
    assert torch.equal(out.sequences, _plain(model, ids))
    q = drafter.model
    assert q is not draft and q is quantized_draft(draft, "int8") and quantized_draft(q, "int8") is q
    assert isinstance(q.lm_head, Int8Linear) and not any(type(m) is torch.nn.Linear for m in q.modules())
    floats = [m for n, m in draft.named_modules() if n.endswith(("lm_head", "q_proj"))]
    assert floats and all(type(m) is torch.nn.Linear for m in floats)
    assert quantized_draft(draft, None) is draft


@pytest.mark.parametrize("kw, match", [({"quantize": "int4"}, r"quantize must be one of int8"),
                                       ({"quantize": "int8", "bf16": True}, r"needs a float32 draft on the CPU")])
def test_int8_draft_refusals(tiny, kw, match):
    target, small = tiny
    if kw.pop("bf16", False):
        import copy

        drafter = DraftModel(copy.deepcopy(small).to(torch.bfloat16), **kw)
        with pytest.raises(ValueError, match=match):
            drafter.begin(target, torch.ones(1, 4, dtype=torch.long), None, Sampler())
    else:
        with pytest.raises(ValueError, match=match):
            DraftModel(small, **kw)


def test_draft_confidence_stop_keeps_output_and_drafts_less(micro):
    """SpecDec++-style early stop: shorter drafts where the draft is unsure, same greedy output."""
    model, tok, draft = micro
    ids = _text_prompt(tok, json.__doc__)
    full = speculative_generate(model, ids, DraftModel(draft), max_new_tokens=MAX_NEW, num_draft_tokens=6)
    short = speculative_generate(model, ids, DraftModel(draft, stop_below=0.5), max_new_tokens=MAX_NEW,
                                 num_draft_tokens=6)
    assert torch.equal(short.sequences, full.sequences)
    assert min(short.proposed) >= 1 and sum(short.proposed) < sum(full.proposed)
    assert short.acceptance_rate > full.acceptance_rate


def test_confidence_stops_from_measured_costs():
    """stop_below=auto's thresholds: draft cost + the marginal verify cost of the next token (hand-computed), the
    table's last slope extending it."""
    from mmaccel.speculative.schedule import confidence_stops

    assert confidence_stops(0.1, [1.1, 1.3, 1.4], 5) == [0.3, 0.2, 0.2, 0.2, 0.2]
    assert confidence_stops(0.0, [1.0], 2) == [0.0, 0.0]
    with pytest.raises(ValueError, match="draft_cost >= 0"):
        confidence_stops(-0.1, [1.0], 2)


def test_draft_auto_stop_keeps_output_measures_once(micro):
    """stop_below=auto: greedy output unchanged, the pair's costs measured at the first generation only and
    reported with the thresholds they give."""
    model, tok, draft = micro
    ids = _text_prompt(tok, json.__doc__)
    drafter = build_drafter("draft:stop_below=auto")
    drafter.model = draft
    first = speculative_generate(model, ids, drafter, max_new_tokens=MAX_NEW, num_draft_tokens=8)
    again = speculative_generate(model, ids, drafter, max_new_tokens=MAX_NEW, num_draft_tokens=8)
    assert torch.equal(first.sequences, _plain(model, ids)) and torch.equal(again.sequences, first.sequences)
    t1, t2 = first.telemetry()["drafter_telemetry"], again.telemetry()["drafter_telemetry"]
    assert t1["draft_cost"] > 0 and t1["costs_s"] > 0 and t2["costs_s"] == 0 and t2["draft_cost"] == t1["draft_cost"]
    assert len(t1["stop_thresholds"]) == 16 and all(x >= t1["draft_cost"] for x in t1["stop_thresholds"])
    with pytest.raises(ValueError, match="'auto' or None"):
        DraftModel(draft, stop_below="often")


def test_prompt_lookup_finds_the_continuation():
    pl = PromptLookup(max_ngram=2)
    # last bigram (1, 2) occurs at 0 and 4; the most recent one is at 4
    assert pl.lookup(torch.tensor([1, 2, 3, 4, 1, 2, 3, 9, 1, 2]), 3).tolist() == [3, 9, 1]
    # a source close to the end continues periodically (CopySpec); without extend, only the tokens that exist
    assert pl.lookup(torch.tensor([7, 1, 2, 5, 1, 2]), 8).tolist() == [5, 1, 2, 5, 1, 2, 5, 1]
    assert PromptLookup(max_ngram=2, extend=False).lookup(torch.tensor([7, 1, 2, 5, 1, 2]), 8).tolist() == [5, 1, 2]
    assert pl.lookup(torch.tensor([1, 2, 3, 4]), 3) is None
    # the strength of a match is how far back it agrees: the longer match wins over the more recent one
    found = PromptLookup(max_ngram=4).match(torch.tensor([5, 6, 7, 8, 0, 7, 9, 6, 7]), 2)
    assert (found.tokens.tolist(), found.length, found.start) == ([8, 0], 2, 3)


def test_prompt_lookup_drafts_nothing_without_a_match(tiny):
    """No earlier occurrence of the last token: the step proposes 0 tokens, a plain one-token decoding step."""
    target, _ = tiny
    pl = PromptLookup()
    pl.begin(target, None, None, None)
    ids = torch.randperm(120, generator=torch.Generator().manual_seed(0))[None, :24] + 3  # all distinct
    draft = pl.propose(ids, torch.ones_like(ids), 6, Sampler())
    assert draft.length == 0 and draft.tokens.shape == (1, 0) and draft.forwards == 0
    out = speculative_generate(target, ids, PromptLookup(), max_new_tokens=MAX_NEW, num_draft_tokens=6,
                               eos_token_id=None)
    assert torch.equal(out.sequences, _plain(target, ids, eos_token_id=None))
    assert out.proposed[0] == 0 and out.accepted[0] == 0
    assert out.prefill_folded and out.target_forwards == out.steps  # one forward per step, drafts or not
    no_match = out.drafter_telemetry["lookup_misses"]
    assert no_match > 0 and out.proposed.count(0) >= no_match


def test_prompt_lookup_holds_back_matches_that_keep_failing():
    """Every copy is wrong (the committed token never equals the copied one): the estimated chance of the first
    copied token falls and the drafter stops proposing, although a match is found at every step."""
    pl = PromptLookup(verify_cost=0.1)
    pl.begin(None, None, None, None)
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 6, (1, 30), generator=gen)  # six symbols: the last token always recurs
    lengths = []
    for _ in range(40):
        draft = pl.propose(seq, torch.ones_like(seq), 6, Sampler())
        lengths.append(draft.length)
        guess = pl.match(seq[0], 1).tokens[0]
        nxt = (guess + 1 + torch.randint(0, 5, (1,), generator=gen)) % 6  # anything but the copied token
        seq = torch.cat([seq, nxt[None]], dim=1)
    assert lengths[0] > 0 and lengths[-10:] == [0] * 10
    telemetry = pl.end()
    assert telemetry["lookup_hits"] == 40 and telemetry["held_back_steps"] >= 10
    p1, _ = pl.chances(1)
    assert p1 < 0.1  # below verify_cost: one copied token no longer pays


def test_prompt_lookup_classic_and_adaptive_stay_exact(tiny):
    """verify_cost=0 is classic PLD (k tokens on every match, never held back); both equal plain greedy decoding."""
    target, _ = tiny
    ids = torch.randint(3, 40, (1, 48), generator=torch.Generator().manual_seed(2))  # many repeated tokens
    ref = _plain(target, ids, eos_token_id=None)
    for verify_cost in (0.0, 0.1):
        out = speculative_generate(target, ids, PromptLookup(verify_cost=verify_cost), max_new_tokens=MAX_NEW,
                                   num_draft_tokens=6, eos_token_id=None)
        assert torch.equal(out.sequences, ref), verify_cost
        hits = out.drafter_telemetry["lookup_hits"]
        assert hits > 0 and out.drafter_telemetry["drafted_steps"] <= hits
        if verify_cost == 0:
            assert out.drafter_telemetry["held_back_steps"] == 0 and set(out.proposed[:-1]) <= {0, 6}


def test_prompt_lookup_draft_length_follows_the_verification_cost(tiny):
    """Length = argmax of expected tokens per cost: 0 when the first copied token is unlikely, long when a copy run is
    likely to go on; a measured cost table (here: 3 tokens cheaper than 1) overrides the linear model and caps k."""
    linear = PromptLookup(verify_cost=0.15)
    assert linear.draft_length(0.05, 0.5, 8) == 0
    assert linear.draft_length(0.5, 0.5, 8) == 2  # 1.75 tokens for 1.3 forwards
    assert linear.draft_length(0.97, 0.97, 16) == 16
    table = PromptLookup(verify_costs="5,5,1.1")
    assert table.costs == [5.0, 5.0, 1.1] and table.draft_length(0.9, 0.9, 8) == 3
    assert table.draft_length(0.05, 0.5, 8) == 0
    from mmaccel.speculative.schedule import measure_verify_costs

    target, _ = tiny
    costs = measure_verify_costs(target, max_draft=3, context=8, repeats=1, clock="cpu")
    assert len(costs) == 3 and all(c > 0 for c in costs)
    sparse = measure_verify_costs(target, max_draft=6, context=8, repeats=1, sparse=True)  # 1, 2, 4, 6 measured
    assert len(sparse) == 6 and sparse[2] == pytest.approx((sparse[1] + sparse[3]) / 2, abs=1e-3)
    assert sparse[4] == pytest.approx((sparse[3] + sparse[5]) / 2, abs=1e-3)
    PromptLookup(verify_costs=costs)  # a measured table is accepted as is
    with pytest.raises(ValueError, match="need max_draft, context, repeats >= 1"):
        measure_verify_costs(target, max_draft=0)


def test_prompt_lookup_auto_costs_are_measured_once_per_model_and_stay_exact(tiny):
    """``verify_costs="auto"``: the first generation measures the target's table (32 entries, its seconds in the
    telemetry), the next reuses it; the output equals plain greedy decoding both times."""
    from mmaccel.speculative import build_speculative_method
    from mmaccel.speculative.schedule import cached_verify_costs

    target, _ = tiny
    ids = torch.randint(3, 40, (1, 48), generator=torch.Generator().manual_seed(2))
    ref = _plain(target, ids, eos_token_id=None)
    method = build_speculative_method("prompt_lookup:verify_costs=auto")
    assert method.drafter.auto_costs and method.drafter.costs is None
    seconds = []
    for _ in range(2):
        out = speculative_generate(target, ids, method.drafter, max_new_tokens=MAX_NEW, num_draft_tokens=16,
                                   eos_token_id=None)
        assert torch.equal(out.sequences, ref)
        tele = out.drafter_telemetry
        assert len(tele["verify_costs"]) == 32 and all(c > 0 for c in tele["verify_costs"])
        seconds.append(tele["verify_costs_s"])
    assert seconds[0] > 0 and seconds[1] == 0
    assert cached_verify_costs(target)[0] is method.drafter.costs


def test_prompt_lookup_bad_arguments():
    for kwargs in ({"min_ngram": 0}, {"min_ngram": 4, "max_ngram": 3}, {"verify_cost": -0.1}, {"decay": 0},
                   {"prior_weight": 0}):
        with pytest.raises(ValueError, match="prompt lookup"):
            PromptLookup(**kwargs)
    for costs in ("1,x", "", "1,-2", [0.0]):
        with pytest.raises(ValueError, match="verify_costs must be"):
            PromptLookup(verify_costs=costs)


def test_prompt_lookup_copies_a_repeated_paragraph(micro):
    """micro-lm continues a paragraph it has seen once by copying it; prompt lookup drafts exactly that."""
    model, tok, _ = micro
    para = tok(" ".join(json.__doc__.split())).input_ids[:60]
    ids = torch.tensor([para + para[:6]])
    out = speculative_generate(model, ids, PromptLookup(max_ngram=3), max_new_tokens=MAX_NEW, num_draft_tokens=8)
    assert torch.equal(out.sequences, _plain(model, ids))
    assert out.mean_accepted_length > 2 and out.draft_forwards == 0  # measured 2.35: 18 target forwards for 40


def test_adaptive_draft_length(tiny, micro):
    target, _ = tiny
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(5))
    schedule = AdaptiveDraftLength(start=2, max_tokens=8, draft_cost=0.0)
    out = speculative_generate(target, ids, DraftModel(target), max_new_tokens=40, num_draft_tokens=schedule,
                               eos_token_id=None)
    assert torch.equal(out.sequences, _plain(target, ids, 40, eos_token_id=None))
    assert out.draft_lengths[0] == 2 and max(out.draft_lengths) == 8  # grows while everything is accepted
    # a draft that is always wrong drives it down to min_tokens
    model, tok, _ = micro
    ids = _text_prompt(tok, json.__doc__)
    out = speculative_generate(model, ids, Jacobi(), max_new_tokens=24,
                               num_draft_tokens=AdaptiveDraftLength(start=6, min_tokens=1, max_tokens=8,
                                                                    draft_cost=0.0, verify_cost=0.5))
    assert torch.equal(out.sequences, _plain(model, ids, 24))
    assert out.draft_lengths[-1] < 6


# ------------------------------------------------------------------------------------------------------- batch
def _left_pad(rows, pad):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = torch.tensor(r)
        mask[b, width - len(r):] = 1
    return ids, mask


def test_batch_rows_equal_their_own_greedy_output(micro):
    """Left-padded rows of different lengths, rows stopping at different steps: each equals its own generate."""
    model, tok, draft = micro
    texts = [json.__doc__, types.__doc__, str.__doc__]
    rows = [tok(" ".join(t.split())).input_ids[:n] for t, n in zip(texts, (40, 23, 31))]
    ids, mask = _left_pad(rows, pad=0)
    stop = [tok.convert_tokens_to_ids(".")]  # a frequent token, so rows finish at different points
    out = speculative_generate(model, ids, DraftModel(draft), max_new_tokens=MAX_NEW, num_draft_tokens=4,
                               attention_mask=mask, eos_token_id=stop, pad_token_id=0)
    lengths = []
    for b, row in enumerate(rows):
        own = _plain(model, torch.tensor([row]), eos_token_id=stop, pad_token_id=0)[0, len(row):]
        got = out.sequences[b, ids.shape[1]:]
        assert torch.equal(got[: len(own)], own), f"row {b}"
        assert bool((got[len(own):] == 0).all())
        lengths.append(len(own))
    assert out.new_tokens == max(lengths)
    assert len(set(lengths)) > 1  # the rows really did stop at different points
    # the shared cache commits the minimum of the live rows' acceptance; finished rows are recorded as -1
    for m, row in zip(out.accepted, out.accepted_per_row):
        live = [a for a in row if a >= 0]
        assert live and m == min(live)
    assert len(out.row_mean_accepted_length) == 3


def test_batch_prompt_lookup_and_jacobi_rows(tiny):
    target, _ = tiny
    gen = torch.Generator().manual_seed(6)
    rows = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (12, 20, 7)]
    ids, mask = _left_pad(rows, pad=0)
    for drafter in (PromptLookup(), Jacobi()):
        out = speculative_generate(target, ids, drafter, max_new_tokens=20, attention_mask=mask, eos_token_id=None,
                                   pad_token_id=0)
        for b, row in enumerate(rows):
            own = _plain(target, torch.tensor([row]), 20, eos_token_id=None)[0, len(row):]
            assert torch.equal(out.sequences[b, ids.shape[1]:], own), (drafter.name, b)


# ------------------------------------------------------------------------------------------- sampling filter
def test_sampler_matches_transformers_warpers():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    for t, k, p in [(0.7, 10, 0.9), (1.3, None, 0.5), (1.0, 3, None), (0.5, None, None)]:
        ref = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p:
            ref = TopPLogitsWarper(p)(None, ref)
        ours = Sampler(temperature=t, top_k=k, top_p=p).filtered_logits(logits)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))
        assert torch.allclose(ours.softmax(-1), ref.softmax(-1), atol=1e-6)


# ------------------------------------------------------------------------------------------------ registry
def test_registry_builds_every_drafter():
    assert {"draft", "prompt_lookup", "jacobi"} <= set(METHODS)
    assert isinstance(build_drafter("prompt_lookup:max_ngram=4"), PromptLookup)
    assert isinstance(build_drafter("jacobi"), Jacobi)
    d = build_drafter("draft:model=micro-draft")
    assert isinstance(d, DraftModel) and d.model is None  # loaded lazily at the first generation
    with pytest.raises(ValueError, match="unknown drafter 'nope'; choose one of"):
        build_drafter("nope")


# ------------------------------------------------------------------------------------------------- bad input
def test_draft_with_another_vocabulary_is_refused(tiny):
    target, _ = tiny
    other = tiny_llama(layers=1, vocab_size=64, seed=2)
    with pytest.raises(ValueError, match=r"vocabulary \(64 tokens\) differs from the target's \(128\).*tokenizer"):
        speculative_generate(target, torch.tensor([[5, 6, 7]]), DraftModel(other), max_new_tokens=4)


def test_draft_with_another_tokenizer_is_refused(tiny):
    target, draft = tiny
    a = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    b = types.SimpleNamespace(get_vocab=lambda: {"a": 1, "b": 0})
    with pytest.raises(ValueError, match="tokenizer maps tokens to ids differently"):
        check_same_vocabulary(draft, target, a, b)
    with pytest.raises(ValueError, match="tokenizer maps tokens to ids differently"):
        speculative_generate(target, torch.tensor([[5, 6, 7]]), DraftModel(draft, tokenizer=a, target_tokenizer=b),
                             max_new_tokens=4)


@pytest.mark.parametrize("k", [0, -2])
def test_draft_length_must_be_positive(tiny, k):
    target, draft = tiny
    with pytest.raises(ValueError, match="num_draft_tokens must be an int >= 1"):
        speculative_generate(target, torch.tensor([[5, 6, 7]]), DraftModel(draft), max_new_tokens=4,
                             num_draft_tokens=k)


def test_negative_temperature_is_refused(tiny):
    target, draft = tiny
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        speculative_generate(target, torch.tensor([[5, 6, 7]]), DraftModel(draft), max_new_tokens=4,
                             temperature=-0.5)


def test_right_padding_is_refused(tiny):
    target, _ = tiny
    with pytest.raises(ValueError, match="left padding"):
        speculative_generate(target, torch.tensor([[5, 6, 0]]), PromptLookup(), max_new_tokens=4,
                             attention_mask=torch.tensor([[1, 1, 0]]))


# ------------------------------------------------------------------------------------ per-step bookkeeping
def test_column_positions_equal_positions_from_mask():
    """The pad counts of the prompt give every later position: equal to the cumsum rule, pads included, and the
    growing table agrees with the direct computation."""
    from mmaccel.speculative import column_positions, left_padding, positions_from_mask
    from mmaccel.speculative.base import ColumnPositions

    gen = torch.Generator().manual_seed(0)
    for width, batch in ((9, 1), (13, 4)):
        lengths = torch.randint(1, width + 1, (batch,), generator=gen)
        mask = (torch.arange(width)[None] >= (width - lengths)[:, None]).long()
        mask = torch.cat([mask, torch.ones(batch, 7, dtype=torch.long)], dim=1)  # decoded tokens are all real
        pads = left_padding(mask[:, :width])
        assert (pads is None) == bool(mask.all())
        ref = positions_from_mask(mask)
        table = ColumnPositions(pads, batch, capacity=2)
        for start, stop in ((0, mask.shape[1]), (width - 1, width + 3), (3, 4)):
            assert torch.equal(column_positions(start, stop, pads, batch), ref[:, start:stop])
            assert torch.equal(table(start, stop), ref[:, start:stop])
    assert left_padding(torch.ones(2, 5, dtype=torch.long)) is None


def test_commit_cuts_at_the_last_live_rows_eos():
    """When the last live row stops, the chunk ends at its EOS; an EOS inside an already finished row's filler
    does not lengthen it (generate stops at the step the last row finishes)."""
    from mmaccel.speculative.engine import _commit

    finished = [True, False]
    m, rows = _commit([[5, 2, 7, 7], [2, 8, 9, 9]], [4, 1], [3, 4], finished, left=10, eos={2}, pad=0)
    assert m == 1 and finished == [True, True]
    assert rows == [[0], [2]]
    finished = [False, False]  # rows accept different counts: the minimum is committed, each row its own next token
    m, rows = _commit([[5, 6, 7], [5, 8, 9]], [3, 1], [4, 3], finished, left=10, eos=set(), pad=0)
    assert (m, rows, finished) == (1, [[5, 6], [5, 3]], [False, False])


def test_vocabulary_check_reruns_for_other_tokenizers(tiny):
    """The draft's vocabulary check is skipped only for the very objects it already passed."""
    target, draft = tiny
    a = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    b = types.SimpleNamespace(get_vocab=lambda: {"a": 1, "b": 0})
    drafter = DraftModel(draft, tokenizer=a, target_tokenizer=a)
    speculative_generate(target, torch.tensor([[5, 6, 7]]), drafter, max_new_tokens=4)
    drafter.target_tokenizer = b
    with pytest.raises(ValueError, match="tokenizer maps tokens to ids differently"):
        speculative_generate(target, torch.tensor([[5, 6, 7]]), drafter, max_new_tokens=4)
