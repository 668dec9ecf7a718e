"""One shared full-attention prefill for every prefill-only KV method (mmaccel.longctx.shared_prefill,
mmaccel.eval.shared): the output of each method is token-identical to its own separate run, on micro-lm and on a
tiny random GQA Llama and a tiny Qwen2 with a sliding-window layer, at budgets that really evict; methods that change
the prefill are refused."""
from pathlib import Path

import pytest
import torch
from arch_configs import ARCHS, tiny_arch
from tiny_models import random_prompt, tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from mmaccel.eval.generation import generate_measured
from mmaccel.eval.shared import generate_shared
from mmaccel.kernels.hf import cache_kwarg
from mmaccel.longctx import METHODS, SnapKV, build_method
from mmaccel.longctx.base import _kv_tensors, held_tokens
from mmaccel.longctx.shared_prefill import SharedPrefill, shares_prefill

MICRO_LM = Path(__file__).resolve().parents[1] / "assets" / "models" / "micro-lm"
NEW = 5  # enough steps for the evicting methods to leave full's greedy path (test_budgets_change_the_output)

# Every method the shared prefill serves, at budgets far below the prompt (150-200 tokens): each one evicts (or, for
# kvquant without eviction, quantizes; for quest, reads pages sparsely at decode).
SERVED = [
    "full",
    "streaming:window=40:sink=4",
    "snapkv:budget=48:window=8",
    "pyramidkv:budget=48:window=8",
    "h2o:budget=48:recent=8",
    "tova:budget=48",
    "knorm:budget=48",
    "chunkkv:chunk=4:method=snapkv,budget=48,window=8",
    "adakv:method=snapkv,budget=48,window=8",
    "adakv:method=h2o,budget=48,recent=8",
    "kvquant:bits=4:group=8:residual=8:method=snapkv,budget=48,window=8",
    "kvquant:bits=2",
    "quest:budget=32:page_size=8",
    "kvzip:budget=48:chunk=64",  # the reconstruction (three chunks) runs on the filled holder after the forward
]
# Methods that change the prefill itself keep their own.
OWN_PREFILL = {
    "chunked": "chunked:chunk=32:method=snapkv,budget=48",
    "chunked_ffn": "chunked_ffn:chunk=32",
    "retrieval_heads": "retrieval_heads:pattern=micro-lm:prefill=sparse",  # streaming heads' prefill is a window
    "razor": "razor:pattern=micro-lm:prefill=sparse",
    "bilevel": "bilevel",
    "longheads": "longheads",
    "minference": "minference",  # a sparse prefill
}


@pytest.fixture(scope="module")
def micro_lm():
    model = AutoModelForCausalLM.from_pretrained(MICRO_LM).eval()
    tokenizer = AutoTokenizer.from_pretrained(MICRO_LM)
    ids = torch.randint(3, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    return model, tokenizer, ids


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16), None, random_prompt(150)


@pytest.fixture(scope="module")
def sliding():
    """A tiny Qwen2 whose middle layer is a 16-token sliding window (the Gemma 3 / Mistral layout in small)."""
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=16,
                         layer_types=["full_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval(), None, random_prompt(150)


@pytest.fixture(scope="module", params=["micro_lm", "tiny", "sliding"])
def setup(request):
    """(model, tokenizer, prompt [1, L], the shared records, the separate records), once per model."""
    model, tokenizer, ids = request.getfixturevalue(request.param)
    torch.manual_seed(0)
    shared = generate_shared(model, tokenizer, ids, methods=[(s, s) for s in SERVED], max_new_tokens=NEW, warmup=0,
                             raise_errors=True)
    alone = [generate_measured(model, tokenizer, ids, method=s, max_new_tokens=NEW, warmup=0, raise_errors=True)
             for s in SERVED]
    return model, tokenizer, ids, shared, alone


@pytest.mark.parametrize("index", range(len(SERVED)), ids=SERVED)
def test_shared_output_is_token_identical_to_a_separate_run(setup, index):
    _, _, _, shared, alone = setup
    mine, own = shared[index], alone[index]
    assert mine.ok and own.ok
    assert mine.method == SERVED[index]
    assert mine.output_ids == own.output_ids
    assert mine.new_tokens == NEW
    assert mine.kv_cache_bytes_prefill == own.kv_cache_bytes_prefill
    assert mine.kv_cache_bytes_final == own.kv_cache_bytes_final
    tele = mine.telemetry
    assert tele["spec"] == own.telemetry["spec"]
    if mine.method_name in ("snapkv", "pyramidkv", "h2o", "tova", "knorm", "chunkkv", "adakv", "streaming", "kvzip"):
        assert tele["evicted_tokens"] > 0  # the budget really bit
        assert tele["kept_tokens_per_layer"] == own.telemetry["kept_tokens_per_layer"]
    if mine.method_name == "kvquant":
        assert sum(tele["quantized_tokens_per_layer"]) > 0
        assert tele["quantized_tokens_per_layer"] == own.telemetry["quantized_tokens_per_layer"]


@pytest.mark.parametrize("model_name", ["micro_lm", "tiny"])
def test_prefilled_caches_equal_each_method_s_own_prefill(request, model_name):
    """Bit for bit: every member's cache after the one shared prefill holds what its own prefill forward keeps."""
    model, _, ids = request.getfixturevalue(model_name)
    for method, mine, theirs in _shared_and_own_layers(model, ids, SERVED):
        tensors = [*_kv_tensors(mine), *getattr(mine, "bookkeeping_tensors", list)()]
        expected = [*_kv_tensors(theirs), *getattr(theirs, "bookkeeping_tensors", list)()]
        assert len(tensors) == len(expected) > 0
        assert all(torch.equal(x, y) for x, y in zip(tensors, expected)), method.spec
        assert mine.get_seq_length() == theirs.get_seq_length() == ids.shape[1]


def _shared_and_own_layers(model, ids, specs):
    """(method, layer after one shared prefill, the same layer after the method's own prefill) for every member and
    layer; KVzip reconstructs and evicts in ``finish``, as after its own forward."""
    methods = [build_method(s) for s in specs]
    shared = SharedPrefill(methods)
    leader = shared.make_cache(model)
    out = []
    with torch.inference_mode():
        model(ids, **cache_kwarg(model, leader))
        leader.close()
        shared.finish(model, ids)
        for method, holder in zip(methods, shared.holders):
            own = method.make_cache(model)
            model(ids, **cache_kwarg(model, own))
            getattr(own, "close", lambda: None)()
            out += [(method, mine, theirs) for mine, theirs in zip(holder.layers, own.layers)]
    return out


def test_kvzip_member_needs_finish_before_its_decode_cache(tiny):
    """KVzip evicts only after its reconstruction: decoding its holder without :meth:`SharedPrefill.finish` would run
    full attention under its name, so it is refused; the other members do not need it."""
    model, _, ids = tiny
    shared = SharedPrefill([build_method("snapkv:budget=48"), build_method("kvzip:budget=48")])
    leader = shared.make_cache(model)
    with torch.inference_mode():
        model(ids, **cache_kwarg(model, leader))
    leader.close()
    shared.decode_cache(0, model).close()
    with pytest.raises(ValueError, match="finish"):
        shared.decode_cache(1, model)
    with torch.inference_mode():
        shared.finish(model, ids)
        cache = shared.decode_cache(1, model)
    kept = sum(int(layer.valid_counts().sum()) for layer in cache.layers)  # over layers and KV heads (2 x 2)
    assert kept == 48 * 2 * 2 < ids.shape[1] * 2 * 2  # evicted to the budget
    cache.close()


def test_budgets_change_the_output(setup):
    """The compressed methods do not all just reproduce full attention (else identity would prove little)."""
    _, _, _, shared, _ = setup
    full = shared[SERVED.index("full")].output_ids
    assert sum(r.output_ids != full for r in shared) >= 4


def test_timings_say_what_they_are(setup):
    _, _, ids, shared, _ = setup
    prefill = {r.extra["shared_prefill_s"] for r in shared}
    assert len(prefill) == 1 and prefill.pop() > 0  # one prefill, the same for every method of the group
    for r in shared:
        assert r.extra["shared_prefill"] is True and r.extra["shared_with"] == SERVED
        assert r.extra["compress_s"] > 0
        assert r.ttft_s == pytest.approx(r.extra["shared_prefill_s"] + r.extra["compress_s"])
        assert r.prefill_s == r.ttft_s
        assert r.extra["shared_group_s"] >= r.ttft_s
        assert r.decode_s > 0 and r.tokens_per_s == pytest.approx((NEW - 1) / r.decode_s)
        assert r.prompt_tokens == ids.shape[1] and len(r.samples) == 1
        # memory: one repeat is timed, so nothing is metered (the meter slows a CPU decode; with 2+ repeats the
        # last one meters: tests/test_compare_niah_docs.py)
        assert r.peak_memory_method == "unavailable" and r.peak_memory_bytes is None
        assert r.extra["shared_prefill_peak_bytes"] is None and not r.samples[0]["metered"]


def test_one_new_token_needs_no_decode(micro_lm):
    model, tokenizer, ids = micro_lm
    recs = generate_shared(model, tokenizer, ids, methods=[("snapkv:budget=48:window=8", None)], max_new_tokens=1,
                           warmup=0, repeats=2, raise_errors=True)  # the 2nd repeat meters
    own = generate_measured(model, tokenizer, ids, method="snapkv:budget=48:window=8", max_new_tokens=1, warmup=0)
    assert recs[0].output_ids == own.output_ids and recs[0].new_tokens == 1
    assert recs[0].decode_s == 0.0 and recs[0].tokens_per_s is None
    assert recs[0].extra["decode_peak_bytes"] == 0 and recs[0].peak_memory_bytes == recs[0].kv_cache_bytes_prefill
    assert recs[0].method == build_method("snapkv:budget=48:window=8").spec  # no label: the spec


def test_leader_holds_no_kv_after_the_prefill_and_serves_one_forward(tiny):
    model, _, ids = tiny
    shared = SharedPrefill([SnapKV(budget=16, window=4), build_method("full")])
    leader = shared.make_cache(model)
    with torch.inference_mode():
        model(ids, **cache_kwarg(model, leader))
        assert all(held_tokens(layer) == 0 for layer in leader.layers)  # full K/V lived one layer at a time
        assert [held_tokens(layer) for layer in shared.holders[0].layers] == [16, 16]
        assert [held_tokens(layer) for layer in shared.holders[1].layers] == [ids.shape[1]] * 2
        with pytest.raises(ValueError, match="one prefill forward"):
            model(ids[:, :1], **cache_kwarg(model, leader))
    leader.close()
    cache = shared.decode_cache(0, model)
    assert [held_tokens(layer) for layer in cache.layers] == [16, 16]
    assert cache.get_seq_length() == ids.shape[1]
    cache.close()
    with pytest.raises(ValueError, match="handed over once"):
        shared.decode_cache(0, model)


def test_shares_prefill_over_the_registry():
    """Every registered method has decided: the ones that change the prefill say False."""
    built = {name: build_method(OWN_PREFILL.get(name, name)) for name in METHODS
             if name not in ("duo", "streamingllm")}
    sharing = {name for name, method in built.items() if shares_prefill(method)}
    assert sharing == {"full", "streaming", "snapkv", "pyramidkv", "h2o", "tova", "knorm", "quest", "adakv",
                       "chunkkv", "kvquant", "keydiff", "expected_attention", "kvzip"}
    assert set(built) - sharing == set(OWN_PREFILL)
    assert not shares_prefill("snapkv") and not shares_prefill(object())
    # with their default dense prefill every head attends to the whole prompt: the split is kept afterwards
    assert all(shares_prefill(build_method(f"{name}:pattern=micro-lm")) for name in ("retrieval_heads", "razor"))


# The retrieval-head split with its default dense prefill, at a window far below the prompt (micro-lm's pattern)
SPLIT = ["retrieval_heads:pattern=micro-lm:window=24:sink=4", "razor:pattern=micro-lm:window=24:sink=4:fraction=0.5"]


def test_retrieval_head_split_shares_the_prefill_bit_for_bit(micro_lm):
    """The split's caches after the shared prefill equal its own dense prefill's (streaming heads trimmed, the
    compensation slot folded), and the decoded tokens are its own run's."""
    model, tokenizer, ids = micro_lm
    pairs = _shared_and_own_layers(model, ids, SPLIT)
    assert len(pairs) == len(SPLIT) * model.config.num_hidden_layers
    for method, mine, theirs in pairs:
        assert mine.stream_keys.shape[2] == theirs.stream_keys.shape[2] == 4 + 24
        assert len(_kv_tensors(mine)) == len(_kv_tensors(theirs)) >= 4
        assert all(torch.equal(x, y) for x, y in zip(_kv_tensors(mine), _kv_tensors(theirs))), method.spec
        assert mine.comp_count == theirs.comp_count == (ids.shape[1] - 28 if method.compensation else 0)
    torch.manual_seed(0)
    together = generate_shared(model, tokenizer, ids, methods=[(s, s) for s in ["full", *SPLIT]], max_new_tokens=NEW,
                               warmup=0, raise_errors=True)
    for spec, record in zip(SPLIT, together[1:]):
        alone = generate_measured(model, tokenizer, ids, method=spec, max_new_tokens=NEW, warmup=0, raise_errors=True)
        assert record.extra["shared_prefill"] and record.output_ids == alone.output_ids
        assert record.kv_cache_bytes_final == alone.kv_cache_bytes_final < together[0].kv_cache_bytes_final


@pytest.mark.parametrize("name", sorted(OWN_PREFILL))
def test_a_method_with_its_own_prefill_is_refused(micro_lm, name):
    model, tokenizer, ids = micro_lm
    with pytest.raises(ValueError, match="generate_measured"):
        generate_shared(model, tokenizer, ids, methods=[("snapkv:budget=48", "a"), (OWN_PREFILL[name], "b")])
    with pytest.raises(ValueError, match="generate_measured"):
        SharedPrefill([build_method(OWN_PREFILL[name])])


@pytest.mark.parametrize("kwargs, match", [
    ({"methods": []}, "non-empty list"),
    ({"methods": ["snapkv"]}, r"\(method, label\) pair"),
    ({"methods": [("snapkv", None)], "max_new_tokens": 0}, "max_new_tokens >= 1"),
    ({"methods": [("snapkv", None)], "repeats": 0}, "repeats >= 1"),
    ({"methods": [("snapkv", None)], "temperature": -1.0}, "temperature"),
    ({"methods": [("nonexistent", None)]}, "nonexistent"),
])
def test_bad_arguments_raise_before_any_run(tiny, kwargs, match):
    model, _, ids = tiny
    with pytest.raises(ValueError, match=match):
        generate_shared(model, None, ids, **kwargs)


def test_sliding_window_layers_start_from_the_prefilled_window(sliding):
    """Each member's decode cache holds the window its own prefill would leave in the sliding layer, and its full
    layer what the method kept; one member's decode step leaves another's window as it was."""
    model, _, ids = sliding
    shared = SharedPrefill([SnapKV(budget=16, window=4), build_method("full")])
    leader = shared.make_cache(model)
    with torch.inference_mode():
        model(ids, **cache_kwarg(model, leader))
    leader.close()
    caches = [shared.decode_cache(i, model) for i in range(2)]
    own = build_method("full").make_cache(model)
    with torch.inference_mode():
        model(ids, **cache_kwarg(model, own))
    window = own.layers[1]
    assert window.is_sliding and window.keys.shape[-2] == 15  # transformers keeps sliding_window - 1 tokens
    for cache in caches:
        assert type(cache.layers[1]) is type(window) and cache.layers[1].get_seq_length() == ids.shape[1]
        assert torch.equal(cache.layers[1].keys, window.keys) and torch.equal(cache.layers[1].values, window.values)
    assert [held_tokens(c.layers[2]) for c in caches] == [16, ids.shape[1]]
    with torch.inference_mode():
        model(ids[:, -1:], **cache_kwarg(model, caches[0]))  # SnapKV's first decode step
    assert caches[0].layers[1].get_seq_length() == ids.shape[1] + 1
    assert torch.equal(caches[1].layers[1].keys, window.keys) and caches[1].layers[1].get_seq_length() == ids.shape[1]
    for cache in (*caches, own):
        getattr(cache, "close", lambda: None)()


# Lossy specs of the matrix test (a 40-token prompt): a scorer, one that computes decode attention itself, and the
# three whose caches own their attention (AdaKV, KVQuant, Quest).
ARCH_SERVED = ["snapkv:budget=12:window=4", "h2o:budget=12:recent=4", "adakv:method=snapkv,budget=12,window=4",
               "kvquant:bits=4:group=8:residual=4", "quest:budget=8:page_size=4", "kvzip:budget=12:chunk=16"]


#: the matrix's architectures whose attention differs in a way the shared prefill meets (Llama and Qwen2 are the
#: fixtures above; the MoE rows differ in their MLPs only)
ARCH_ROWS = ["gemma2", "gemma3", "mistral-sw", "olmo2", "phi3", "smollm3"]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", ARCH_ROWS)
def test_shared_prefill_over_the_architecture_matrix(arch):
    """Sliding + global layers (Gemma 2 and 3), a softcap (Gemma 2), a fused qkv (Phi-3), a q norm over the whole
    projection (OLMo2), a no-RoPE layer (SmolLM3): each member of one shared prefill decodes exactly what its own run
    does, or refuses as it refuses alone; a model whose every layer is a sliding window (Mistral here) is refused."""
    assert arch in ARCHS
    model, ids = tiny_arch(arch), random_prompt(40)
    if arch == "mistral-sw":
        with pytest.raises(ValueError, match="sliding-window layer"):
            generate_shared(model, None, ids, methods=[(ARCH_SERVED[0], None)], max_new_tokens=3)
        return
    shared = generate_shared(model, None, ids, methods=[(s, s) for s in ARCH_SERVED], max_new_tokens=4, warmup=0)
    if arch == "gemma2":  # a refusal comes before the prefill: with raise_errors it is the method's own ValueError
        with pytest.raises(ValueError, match="softcap"):
            generate_shared(model, None, ids, methods=[(s, s) for s in ARCH_SERVED], max_new_tokens=4,
                            raise_errors=True)
        assert not any(layer.self_attn._forward_hooks for layer in model.model.layers)
        # AdaKV, KVQuant, Quest and KVzip (head-wise storage) own their attention: refused; SnapKV and H2O served
        assert sum(not r.ok for r in shared) == 4 and all(r.ok for r in shared[:2])
    for spec, mine in zip(ARCH_SERVED, shared):
        own = generate_measured(model, None, ids, method=spec, max_new_tokens=4, warmup=0)
        if not own.ok:  # a method that refuses this architecture alone (Gemma 2's softcap) refuses it here too
            assert not mine.ok and own.error.split(": ", 1)[-1] in mine.error, (arch, spec, own.error, mine.error)
            continue
        assert mine.ok, (arch, spec, mine.error)
        assert mine.output_ids == own.output_ids, (arch, spec)
        assert mine.kv_cache_bytes_prefill == own.kv_cache_bytes_prefill, (arch, spec)
