"""Retrieval heads (DuoAttention / RazorAttention): pattern files, the two-group cache, exactness when unbounded,
decode logits after a real split against an independent per-KV-head masked reference, the training-free finder."""
import json
import math
from pathlib import Path

import pytest
import torch
from tiny_models import random_prompt, tiny_llama
from transformers import AttentionInterface, DynamicCache, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mmaccel.longctx import METHODS, Chunked, RazorAttention, RetrievalHeads, build_method, kv_cache_bytes
from mmaccel.longctx.head_finder import copy_scores, find_retrieval_heads, needle_scores
from mmaccel.longctx.head_pattern import HeadPattern, available_head_patterns, config_fingerprint, load_head_pattern
from mmaccel.longctx.owned import LAYER_ATTR, OWNED_ATTENTION
from mmaccel.longctx.retrieval_heads import SplitHeadsLayer

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HQ, HKV, D = 2, 4, 2, 16
MICRO_LM = Path(__file__).resolve().parents[1] / "assets" / "models" / "micro-lm"


@pytest.fixture(scope="module")
def sdpa():
    return tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, attn="sdpa")


def _pattern(model, heads=((0, 0), (1, 1)), scores=((0.9, 0.1), (0.2, 0.8))) -> HeadPattern:
    return HeadPattern(LAYERS, HKV, HQ, [list(r) for r in scores], list(heads), config_fingerprint(model.config), "tiny")




# ------------------------------------------------------------------------------------------------- pattern files
def test_fraction_picks_the_best_scored_pairs_globally_hand_computed(sdpa):
    pattern = _pattern(sdpa, heads=[], scores=((0.9, 0.1), (0.2, 0.8)))
    assert pattern.with_fraction(0.25).retrieval_heads == [(0, 0)]
    assert pattern.with_fraction(0.5).retrieval_heads == [(0, 0), (1, 1)]
    assert pattern.with_fraction(0.75).retrieval_heads == [(0, 0), (1, 0), (1, 1)]
    assert pattern.with_fraction(0.0).retrieval_heads == []
    assert pattern.with_fraction(0.5).heads_of(1) == (1,)


def test_pattern_file_round_trips_and_loads_by_name_or_path(sdpa, tmp_path):
    pattern = _pattern(sdpa)
    path = pattern.save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["format"] == "mmaccel-head-pattern/1" and data["retrieval_heads"] == [[0, 0], [1, 1]]
    assert data["fingerprint"]["num_key_value_heads"] == HKV
    loaded = load_head_pattern(str(path))
    assert loaded.retrieval_heads == pattern.retrieval_heads and loaded.scores == pattern.scores
    assert "micro-lm" in available_head_patterns()
    shipped = load_head_pattern("micro-lm")
    config = LlamaForCausalLM.config_class.from_pretrained(MICRO_LM)
    assert shipped.check_model(config) == [] and shipped.retrieval_heads  # made for micro-lm
    assert shipped.found_by["finder"].startswith("training-free")


def test_a_pattern_card_that_says_it_does_not_transfer_is_kept_and_warned(sdpa, tmp_path):
    pattern = _pattern(sdpa)
    pattern.validation = {"transfers": False, "summary": "loses 14 points on unseen prose", "record": "studies/x"}
    path = pattern.save(tmp_path / "p.json")
    loaded = load_head_pattern(str(path))
    assert loaded.validation == pattern.validation and loaded.with_fraction(0.5).validation == pattern.validation
    cache = RetrievalHeads(pattern=str(path)).make_cache(sdpa)
    assert any("loses 14 points on unseen prose (studies/x)" in w for w in cache.warnings)
    cache.close()
    assert "validation" not in _pattern(sdpa).to_dict()  # no card: nothing written, nothing warned
    quiet = RetrievalHeads(pattern=_pattern(sdpa)).make_cache(sdpa)
    assert quiet.warnings == []
    quiet.close()
    shipped = {name: load_head_pattern(name).validation for name in ("smollm2-135m", "smollm2-135m-gates")}
    assert shipped["smollm2-135m"]["transfers"] is False and shipped["smollm2-135m-gates"]["transfers"] is True


def test_unknown_pattern_file_is_one_clear_error(sdpa):
    with pytest.raises(ValueError, match="unknown head pattern 'no-such-model'.*shipped: .*micro-lm"):
        RetrievalHeads(pattern="no-such-model").make_cache(sdpa)
    with pytest.raises(ValueError, match="pass pattern="):
        build_method("retrieval_heads")


def test_pattern_for_another_model_is_refused(sdpa, tmp_path):
    other = tiny_llama(layers=3, heads=HQ, kv_heads=HKV, head_dim=D)
    path = HeadPattern(3, HKV, HQ, [[0.0] * HKV] * 3, [(2, 0)], config_fingerprint(other.config)).save(
        tmp_path / "other.json")
    with pytest.raises(ValueError, match="made for a model with 3 layers, 2 KV heads.*this model has 2 layers"):
        build_method(f"retrieval_heads:pattern={path}").make_cache(sdpa)
    with pytest.raises(ValueError, match="made for a model with 4 layers, 2 KV heads and 6 query heads"):
        RetrievalHeads(pattern="micro-lm").make_cache(sdpa)
    assert not hasattr(sdpa.model.layers[0].self_attn, LAYER_ATTR)


def test_same_counts_other_config_warns_in_the_record(sdpa):
    pattern = _pattern(sdpa)
    pattern.fingerprint = {**pattern.fingerprint, "vocab_size": 999}
    method = RetrievalHeads(pattern=pattern, window=1000)
    with method.make_cache(sdpa) as cache:
        sdpa.generate(random_prompt(12), past_key_values=cache, max_new_tokens=1, do_sample=False)
        warnings = method.telemetry(cache)["warnings"]
    assert any("vocab_size: 999 vs 128" in w for w in warnings)


# -------------------------------------------------------------------------------------- storage and byte accounting
def test_two_groups_are_stored_apart_and_bytes_really_fall(sdpa):
    method = RetrievalHeads(pattern=_pattern(sdpa), sink=2, window=6)
    ids = random_prompt(40, seed=2)
    with method.make_cache(sdpa) as cache:
        sdpa.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)  # 40 + 3 cached tokens
        telemetry = method.telemetry(cache)
        for layer_idx, layer in enumerate(cache.layers):
            assert isinstance(layer, SplitHeadsLayer)
            assert tuple(layer.keys.shape) == (1, 1, 43, D)  # one retrieval KV head, every token
            assert tuple(layer.stream_keys.shape) == (1, 1, 8, D)  # one streaming KV head: 2 sinks + 6 recent
            assert layer.stream_positions().tolist() == [0, 1, 37, 38, 39, 40, 41, 42]
        assert kv_cache_bytes(cache) == LAYERS * 2 * (43 + 8) * D * 4
        assert telemetry["kv_cache_bytes"] == kv_cache_bytes(cache)
        assert telemetry["kept_tokens_per_layer"] == [25.5, 25.5] and telemetry["seen_tokens"] == 43
        assert telemetry["kv_fraction"] == pytest.approx(51 / 86)
        attn = sdpa.model.layers[0].self_attn
        assert attn.config._attn_implementation == OWNED_ATTENTION  # routed on this module only
        assert sdpa.config._attn_implementation == "sdpa"
    assert attn.config is sdpa.config and not hasattr(attn, LAYER_ATTR)  # restored on close


def test_a_second_open_cache_on_the_same_model_is_refused(sdpa):
    method = RetrievalHeads(pattern=_pattern(sdpa))
    with method.make_cache(sdpa), pytest.raises(ValueError, match="already driven by another open"):
        method.make_cache(sdpa)
    method.make_cache(sdpa).close()


def test_a_forward_without_the_cache_while_it_is_open_runs_plain_attention(sdpa):
    ids = random_prompt(30, seed=7)
    with torch.no_grad():
        plain = sdpa(ids).logits
        with RetrievalHeads(pattern=_pattern(sdpa), sink=2, window=4, prefill="sparse").make_cache(sdpa) as cache:
            split = sdpa(ids, past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(sdpa(ids).logits, plain)  # no cache: the module's own attention
            torch.testing.assert_close(sdpa(ids, past_key_values=DynamicCache(config=sdpa.config)).logits, plain)
    assert not torch.allclose(split, plain, atol=1e-3)


def test_a_failing_forward_gives_the_modules_back(sdpa):
    method = RetrievalHeads(pattern=_pattern(sdpa))
    cache = method.make_cache(sdpa)
    with pytest.raises(ValueError, match="left-padded batch"):
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[0, :3] = 0
        sdpa.generate(random_prompt(20, batch=2), attention_mask=mask, past_key_values=cache, max_new_tokens=2,
                      do_sample=False)
    assert sdpa.model.layers[0].self_attn.config is sdpa.config


# ------------------------------------------------------------------------------------------ exact when unbounded
@pytest.mark.parametrize("spec_kwargs", [{"window": 1000}, {"window": 2, "fraction": 1.0},
                                         {"window": 1000, "compensation": True}])
def test_unbounded_split_is_token_identical_to_full(sdpa, spec_kwargs):
    ids = random_prompt(40, seed=2)
    plain = sdpa.generate(ids, max_new_tokens=8, do_sample=False)
    with RetrievalHeads(pattern=_pattern(sdpa), **spec_kwargs).make_cache(sdpa) as cache:
        assert torch.equal(sdpa.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False), plain)


def test_generate_prefill_chunks_give_the_unchunked_result(sdpa):
    ids = random_prompt(40, seed=5)
    method = RetrievalHeads(pattern=_pattern(sdpa), sink=2, window=6, prefill="sparse")
    with method.make_cache(sdpa) as cache:
        once = sdpa.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    with method.make_cache(sdpa) as cache:
        chunked = sdpa.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, prefill_chunk_size=9)
    assert torch.equal(once.sequences, chunked.sequences)
    torch.testing.assert_close(torch.stack(once.logits), torch.stack(chunked.logits), rtol=1e-4, atol=1e-5)
    with Chunked(method, chunk=9).make_cache(sdpa) as cache:
        wrapped = sdpa.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(wrapped, chunked.sequences)


def test_unpadded_batch_rows_match_single_rows(sdpa):
    ids = random_prompt(30, seed=6, batch=2)
    method = RetrievalHeads(pattern=_pattern(sdpa), sink=2, window=5)
    with method.make_cache(sdpa) as cache:
        both = sdpa.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
    for row in range(2):
        with method.make_cache(sdpa) as cache:
            one = sdpa.generate(ids[row : row + 1], past_key_values=cache, max_new_tokens=5, do_sample=False)
        assert torch.equal(both[row : row + 1], one)


# ---------------------------------------------------- decode logits after a real split vs per-KV-head masked reference
def _perhead_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Dense softmax attention with the per-KV-head boolean mask [1, Hkv, L, L] the test put on the module."""
    group = query.shape[1] // key.shape[1]
    allowed = module._test_allowed.repeat_interleave(group, dim=1)
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    probs = ((query @ k.transpose(-1, -2)) * scaling).masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("prefill", ["sparse", "dense"])
def test_decode_logits_after_a_real_split_match_a_per_head_masked_reference(sdpa, prefill):
    """Retrieval KV heads see every earlier token; streaming KV heads see sinks + the window before each query plus
    itself, at prefill (``prefill="sparse"``; ``"dense"``: the prompt rows see every earlier token) and at decode.
    The reference is one forward of the whole sequence through dense attention with that per-KV-head mask; the
    method's run is prefill + 6 decode steps through its cache."""
    prompt, steps, sink, window = 40, 6, 2, 6
    pattern = _pattern(sdpa)
    ids = random_prompt(prompt + steps, seed=3)
    logits = []
    with RetrievalHeads(pattern=pattern, sink=sink, window=window, prefill=prefill).make_cache(sdpa) as cache:
        logits.append(sdpa(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[:, -1])
        for t in range(prompt, prompt + steps):
            logits.append(sdpa(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    total = prompt + steps
    reference = tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, attn="sdpa")
    AttentionInterface.register("duo_perhead_test", _perhead_reference)
    AttentionMaskInterface.register("duo_perhead_test", sdpa_mask)
    reference.set_attn_implementation("duo_perhead_test")
    q = torch.arange(total)[:, None]
    k = torch.arange(total)[None, :]
    causal = k <= q
    streaming = causal & ((k < sink) | (q - k <= window))
    if prefill == "dense":
        streaming = torch.where(q < prompt, causal, streaming)
    for layer_idx, layer in enumerate(reference.model.layers):
        allowed = torch.stack([causal if h in pattern.heads_of(layer_idx) else streaming for h in range(HKV)])
        layer.self_attn._test_allowed = allowed[None]
    ref = reference(ids).logits[0, prompt - 1 : total]
    torch.testing.assert_close(torch.cat(logits), ref, rtol=1e-4, atol=1e-5)
    full = sdpa(ids).logits[0, prompt - 1 : total]
    assert not torch.allclose(ref, full, atol=1e-3)  # the split changed the result


def test_razor_compensation_equals_attention_over_dropped_tokens_replaced_by_their_mean():
    """RazorAttention's compensation slot, weighted by its count, is attention over every token where the dropped
    ones are replaced by their mean key and mean value: checked on one layer for 3 decode steps."""
    torch.manual_seed(0)
    B, n, sink, window = 1, 20, 2, 5
    layer = SplitHeadsLayer((0,), num_kv_heads=2, sink=sink, window=window, compensation=True)
    keys, values = torch.randn(B, 2, n + 3, D), torch.randn(B, 2, n + 3, D)
    queries = torch.randn(B, 4, n + 3, D)
    scale = D ** -0.5
    layer.update(keys[:, :, :n], values[:, :, :n])
    layer.attend(queries[:, :, :n], None, scale)
    for t in range(n, n + 3):
        layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        out = layer.attend(queries[:, :, t : t + 1], None, scale)
        dropped = list(range(sink, t - window))  # positions no longer held before this step
        assert layer.comp_count == len(dropped) + 1  # after the step, position t - window left the window too
        k_ref, v_ref = keys[:, 1, : t + 1].clone(), values[:, 1, : t + 1].clone()
        k_ref[:, dropped], v_ref[:, dropped] = k_ref[:, dropped].mean(1, keepdim=True), v_ref[:, dropped].mean(
            1, keepdim=True)
        q_s = queries[:, 2:, t]  # query heads 2, 3 read KV head 1 (streaming)
        probs = (q_s @ k_ref.transpose(-1, -2) * scale).softmax(-1)
        torch.testing.assert_close(out[:, 2:, 0], probs @ v_ref, rtol=1e-4, atol=1e-5)
        full_probs = (queries[:, :2, t] @ keys[:, 0, : t + 1].transpose(-1, -2) * scale).softmax(-1)
        torch.testing.assert_close(out[:, :2, 0], full_probs @ values[:, 0, : t + 1], rtol=1e-4, atol=1e-5)
    # the compensation token is held K/V: one slot per streaming head
    assert sum(t.numel() for t in layer.kv_tensors()) == 2 * D * ((n + 3) + (sink + window) + 1)


def test_dense_prefill_with_no_retrieval_heads_is_streamingllm(sdpa):
    """Every head streaming + a dense prefill is StreamingLLM (the prompt attends fully; decode sees sinks + window):
    an independent implementation of the same policy, through the eviction base instead of owned attention."""
    ids = random_prompt(40, seed=8)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with RetrievalHeads(pattern=_pattern(sdpa), fraction=0.0, sink=2, window=6, prefill="dense").make_cache(
            sdpa) as cache:
        split = sdpa.generate(ids, past_key_values=cache, **kwargs)
    with build_method("streaming:sink=2:window=6").make_cache(sdpa) as cache:
        streaming = sdpa.generate(ids, past_key_values=cache, **kwargs)
    assert torch.equal(split.sequences, streaming.sequences)
    torch.testing.assert_close(torch.stack(split.logits), torch.stack(streaming.logits), rtol=1e-4, atol=1e-5)


def test_razor_is_registered_with_compensation_on_and_specs_round_trip(sdpa, tmp_path):
    assert METHODS["razor"] is RazorAttention and METHODS["duo"] is RetrievalHeads
    path = _pattern(sdpa).save(tmp_path / "tiny.json")
    for spec in [f"razor:pattern={path}:window=8", f"retrieval_heads:pattern={path}:fraction=0.5:sink=0"]:
        method = build_method(spec)
        assert build_method(method.spec) == method
    assert build_method(f"razor:pattern={path}").compensation is True
    assert build_method(f"razor:pattern={path}").prefill == "dense"
    assert build_method(f"duo:pattern={path}").prefill == "dense"  # the measured best (see RetrievalHeads)
    with pytest.raises(ValueError, match="prefill must be 'sparse' or 'dense'"):
        build_method(f"duo:pattern={path}:prefill=full")
    with pytest.raises(ValueError, match="fraction must be in"):
        build_method(f"duo:pattern={path}:fraction=1.5")
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        build_method(f"duo:pattern={path}:window=0")


# ------------------------------------------------------------------------------------------------------- finder
@pytest.fixture(scope="module")
def micro_tokenizer():
    return PreTrainedTokenizerFast.from_pretrained(MICRO_LM)


PROSE = ("The river bends twice before it reaches the old mill. Farmers bring their grain in autumn, and the wheel "
         "turns from dawn until dusk. Children count the boats that pass under the stone bridge. ") * 4


@pytest.fixture(scope="module")
def hay(micro_tokenizer):
    from mmaccel.data.haystack import HaystackTokens

    return HaystackTokens(micro_tokenizer, text=PROSE)  # short filler: the default prose takes seconds to tokenize


def _eager_attentions(model, ids):
    with torch.no_grad():
        return model(ids, output_attentions=True).attentions  # per layer [1, Hq, L, L]


def test_finder_scores_match_eager_attention_weights(micro_tokenizer, hay):
    """needle_scores / copy_scores (recomputed queries + kernel column scores) against the attention weights of an
    eager model on the same inputs."""
    from mmaccel.data.haystack import make_niah_sample

    model = tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16, attn="eager", tokenizer=micro_tokenizer,
                       max_positions=1024)
    sample = make_niah_sample(micro_tokenizer, 160, 0.5, seed=1, haystack=hay)
    answer = micro_tokenizer.encode(" " + sample.answer, add_special_tokens=False)
    needle_len = len(micro_tokenizer.encode(" " + sample.needles[0].text(), add_special_tokens=False))
    ids = torch.tensor([sample.input_ids + answer])
    span = slice(sample.needle_position, sample.needle_position + needle_len)
    rows = slice(len(sample.input_ids) - 1, ids.shape[1] - 1)
    expected = torch.stack([a[0, :, rows, span].sum(-1).mean(-1).reshape(2, 2).mean(-1)
                            for a in _eager_attentions(model, ids)])
    torch.testing.assert_close(needle_scores(model, micro_tokenizer, length=160, depth=0.5, seed=1, haystack=hay), expected,
                               rtol=1e-4, atol=1e-6)
    got = copy_scores(model, micro_tokenizer, length=24, seed=0)
    import random

    special = set(micro_tokenizer.all_special_ids)
    rng = random.Random("copy:0:24")
    x = [rng.choice([t for t in range(len(micro_tokenizer)) if t not in special]) for _ in range(24)]
    ids = torch.tensor([[micro_tokenizer.bos_token_id] + x + x])
    expected = []
    for a in _eager_attentions(model, ids):
        per_head = torch.stack([a[0, :, 25 + i, 1 + i] + a[0, :, 25 + i, 2 + i] for i in range(23)], -1).mean(-1)
        expected.append(per_head.reshape(2, 2).mean(-1))
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-4, atol=1e-6)


def test_finder_on_micro_lm_finds_the_layer_1_retrieval_head(micro_tokenizer, hay):
    """micro-lm's needle is read by layer 1 (the SnapKV diagnosis in its README); the finder puts (1, 0) first."""
    model = LlamaForCausalLM.from_pretrained(MICRO_LM).eval()
    pattern = find_retrieval_heads(model, micro_tokenizer, lengths=(384,), depths=(0.5,), samples=1, copy_length=32,
                                   copy_samples=1, fraction=0.125, model_name="micro-lm", haystack=hay)
    assert pattern.retrieval_heads == [(1, 0)]
    assert pattern.found_by["haystacks"] == ["custom text"]
    assert pattern.num_layers == 4 and pattern.num_kv_heads == 2 and pattern.check_model(model.config) == []
    assert math.isclose(pattern.scores[1][0], 0.5 * pattern.found_by["needle_scores"][1][0]
                        + 0.5 * pattern.found_by["copy_scores"][1][0], rel_tol=1e-4)
    with pytest.raises(ValueError, match="copy_weight and fraction"):
        find_retrieval_heads(model, micro_tokenizer, fraction=2.0)


def test_finder_takes_the_haystacks_of_a_mix_in_turn_and_records_them(micro_tokenizer, hay):
    """Two sources, two samples per depth: sample 0 reads the first, sample 1 the second; the needle scores are
    the mean over both, the names are in the record."""
    from mmaccel.data.haystack import HaystackTokens
    from mmaccel.longctx.head_finder import needle_scores

    model = LlamaForCausalLM.from_pretrained(MICRO_LM).eval()
    other = HaystackTokens(micro_tokenizer, text="Blue lanterns hang over the quiet harbour at night. " * 30,
                           name="lanterns")
    pattern = find_retrieval_heads(model, micro_tokenizer, lengths=(256,), depths=(0.5,), samples=2, copy_samples=0,
                                   copy_weight=0.0, fraction=0.25, haystack=[hay, other])
    assert pattern.found_by["haystacks"] == ["custom text", "lanterns"]
    expected = (needle_scores(model, micro_tokenizer, length=256, depth=0.5, seed=0, haystack=hay)
                + needle_scores(model, micro_tokenizer, length=256, depth=0.5, seed=1, haystack=other)) / 2
    torch.testing.assert_close(torch.tensor(pattern.found_by["needle_scores"]), expected, atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="non-empty sequence"):
        find_retrieval_heads(model, micro_tokenizer, haystack=[])


def test_calibration_mix_excludes_the_evaluation_haystacks(micro_tokenizer, monkeypatch):
    """The fitting mix is the docstrings' train split and random-word sentences (seeded, digit-free); the eval split
    that NIAH and RULER's essay haystack use is never read (the split is stubbed here: the real one is 1 MB to
    tokenize)."""
    from mmaccel.data import haystack
    from mmaccel.data.haystack import CALIBRATION_SOURCES, calibration_haystacks, haystack_mix, word_haystack_text

    words = word_haystack_text(500, seed=1)
    assert words == word_haystack_text(500, seed=1) != word_haystack_text(500, seed=2)
    assert len(words.split()) == 500 and not any(c.isdigit() for c in words) and words.endswith(".")
    asked = []
    monkeypatch.setattr(haystack, "stdlib_paragraphs", lambda split: asked.append(split) or ("Paragraph.",) * 3)
    monkeypatch.setattr(haystack, "_HAYSTACK_CACHE", {})  # the stubbed text stays out of the process's cache
    mix = calibration_haystacks(micro_tokenizer)
    assert asked == ["train"] and [h.name for h in mix] == list(CALIBRATION_SOURCES)
    assert calibration_haystacks(micro_tokenizer) == mix and asked == ["train"]  # tokenized once per tokenizer
    assert len(mix[1].ids) > 10_000 and micro_tokenizer.decode(mix[0].ids).count("Paragraph.") == 3
    assert [h.name for h in haystack_mix(micro_tokenizer, None)] == list(CALIBRATION_SOURCES)
    with pytest.raises(ValueError, match="n_words must be >= 1"):
        word_haystack_text(0)
