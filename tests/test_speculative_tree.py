"""Token-tree speculative decoding (mmaccel.speculative.tree): greedy exactness for several tree shapes, the tree
mask and positions, the cache after compaction, tree vs chain acceptance, exact sampling, the harness, errors."""
import collections
import dataclasses
import inspect
import textwrap

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import random_prompt, tiny_llama
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

import mmaccel
from mmaccel.kernels import register_attention
from mmaccel.kernels.tree import tree_attention_mask
from mmaccel.speculative import (
    METHODS,
    DraftModel,
    DraftTree,
    DynamicDraftTree,
    Sampler,
    TokenTree,
    TreeDraft,
    build_drafter,
    build_speculative_method,
    keep_cache_slots,
    model_tree_mask,
    speculative_generate,
    verify_tree,
    walk_tree,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 40
PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]  # a sparse Medusa-style tree


@pytest.fixture(scope="module")
def micro():
    model, tok = mmaccel.load("micro-lm", device="cpu")
    draft, _ = mmaccel.load("micro-draft", device="cpu")
    prompts = [_text_prompt(tok, inspect.getdoc(collections.OrderedDict.move_to_end)),
               _text_prompt(tok, textwrap.dedent.__doc__)]
    refs = [_plain(model, ids) for ids in prompts]
    return model, tok, draft, prompts, refs


def _perturbed(model, scale: float, seed: int):
    """A draft for ``model``: the same weights plus seeded Gaussian noise (same vocabulary, high acceptance)."""
    draft = tiny_llama(layers=2, vocab_size=128, seed=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p_draft, p in zip(draft.parameters(), model.parameters()):
            p_draft.copy_(p + scale * torch.randn(p.shape, generator=gen))
    return draft


@pytest.fixture(scope="module")
def tiny():
    target = tiny_llama(layers=2, vocab_size=128, seed=0)
    return target, _perturbed(target, 0.01, seed=3)


def _text_prompt(tok, text: str, n: int = 48) -> torch.Tensor:
    return tok(" ".join(text.split()), return_tensors="pt").input_ids[:, :n]


def _plain(model, ids, max_new=MAX_NEW) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)


# ---------------------------------------------------------------------------------------------- greedy exactness
@pytest.mark.parametrize("tree", ["3,2,2", "1,1,1,1", "2,2,2,2", "paths", "dytree", "dytree-threshold"])
def test_greedy_equals_generate_on_micro_lm(micro, tree):
    model, _, draft, prompts, refs = micro
    if tree.startswith("dytree"):
        drafter = DynamicDraftTree(draft, width=4, depth=4, threshold=0.2 if tree.endswith("threshold") else None)
    else:
        drafter = DraftTree(draft, TokenTree.from_paths(PATHS) if tree == "paths" else tree)
    out = speculative_generate(model, prompts[0], drafter, max_new_tokens=MAX_NEW, num_draft_tokens=drafter.depth)
    assert torch.equal(out.sequences, refs[0])
    assert out.target_forwards == out.steps + 1 < MAX_NEW + 1  # the tree saves target forwards
    assert out.new_tokens == sum(out.accepted) + out.steps
    nodes = drafter.width * drafter.depth if tree.startswith("dytree") else drafter.tree.size
    assert max(out.proposed) <= nodes and out.drafter_telemetry["tree_nodes_mean"] <= nodes
    if tree == "dytree-threshold":  # unsure contexts get small trees (path probability >= 0.2 only)
        assert out.drafter_telemetry["tree_nodes_mean"] < nodes / 2 and min(out.proposed) < drafter.width
    assert out.acceptance_rate == pytest.approx(sum(out.accepted) / sum(out.proposed))  # accepted / tree nodes
    assert out.draft_forwards <= drafter.depth * out.steps  # one draft forward per depth, like a chain


def test_a_tree_from_a_folding_drafter_gets_its_prefill(micro):
    """A drafter claiming folds_prefill that proposes a tree: the engine prefills before the tree's verification
    (a tree is verified over a filled cache), so output and forward count are as without the claim."""
    model, _, draft, prompts, refs = micro

    class Folding(DraftTree):
        folds_prefill = True

    out = speculative_generate(model, prompts[0], Folding(draft, "3,2,2"), max_new_tokens=MAX_NEW,
                               num_draft_tokens=3)
    assert torch.equal(out.sequences, refs[0])
    assert not out.prefill_folded and out.prefill_seconds > 0 and out.target_forwards == out.steps + 1


@pytest.mark.parametrize("attn", ["sdpa", "eager", "mmaccel"])
@pytest.mark.parametrize("tree", ["3,2,2", "dytree"])
def test_greedy_equals_generate_on_tiny_random_llama(tiny, attn, tree):
    """sdpa and eager (the additive float form of the tree mask), and mmaccel's kernel layer (its ``attention``
    with the tree mask, the path of :func:`mmaccel.kernels.tree_attention`)."""
    target, draft = tiny
    if attn != "sdpa":
        if attn == "mmaccel":
            register_attention()
        target = tiny_llama(layers=2, vocab_size=128, seed=0, attn=attn)
    drafter = DynamicDraftTree(draft, width=6, depth=3) if tree == "dytree" else DraftTree(draft, tree)
    ids = random_prompt(20, seed=2)
    ref = _plain(target, ids, max_new=30)
    out = speculative_generate(target, ids, drafter, max_new_tokens=30, num_draft_tokens=drafter.depth)
    assert torch.equal(out.sequences, ref)
    assert max(out.accepted) >= 2  # paths below depth 1 were accepted, so the cache compaction was exercised


# ---------------------------------------------------------------------------------------------- mask and positions
def test_hand_made_tree_mask_and_positions(tiny):
    target, _ = tiny
    tree = TokenTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])
    assert tree.parents == (-1, 0, 0, 1, 1, 2)
    assert tree.depths == (0, 1, 1, 2, 2, 2)
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],  # root (the pending token)
        [1, 1, 0, 0, 0, 0],  # (0)
        [1, 0, 1, 0, 0, 0],  # (1)
        [1, 1, 0, 1, 0, 0],  # (0, 0)
        [1, 1, 0, 0, 1, 0],  # (0, 1)
        [1, 0, 1, 0, 0, 1],  # (1, 0)
    ], dtype=torch.bool)
    assert torch.equal(tree.mask, expected)
    full = tree_attention_mask(tree.mask, 3, 1)
    assert full.shape == (1, 1, 6, 9) and bool(full[..., :3].all()) and torch.equal(full[0, 0, :, 3:], expected)

    # what verify_tree hands the model: the 4-D mask and positions start + depth
    ids = random_prompt(8, seed=4)
    tokens = torch.tensor([[5, 9, 11, 12, 13]])
    seen = {}
    hook = target.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    cache = DynamicCache(config=target.config)
    try:
        with torch.inference_mode():
            target(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
            tv = verify_tree(target, cache, ids[:, -1:], TreeDraft(tokens=tokens, tree=tree), torch.tensor([[7]]),
                             Sampler())
    finally:
        hook.remove()
    assert seen["position_ids"].tolist() == [[7, 8, 8, 9, 9, 9]]
    assert torch.equal(seen["attention_mask"], tree_attention_mask(expected, 7, 1))

    assert tv.logits.shape == (1, len(tv.path) + 1, 128)


def test_model_tree_mask_forms(tiny):
    target, _ = tiny
    allowed = torch.tensor([[[[True, False], [True, True]]]])
    assert model_tree_mask(target, allowed) is allowed  # sdpa: boolean
    eager = tiny_llama(layers=1, vocab_size=128, attn="eager")
    bias = model_tree_mask(eager, allowed)
    assert bias.dtype == torch.float32 and bias[0, 0, 0, 0] == 0 and bias[0, 0, 0, 1] == torch.finfo(torch.float32).min


def test_every_node_sees_exactly_its_root_path(tiny):
    """Logits at all nodes of one tree forward equal plain forwards over prompt + the node's path (mask + positions)."""
    target, _ = tiny
    tree = TokenTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])
    paths = [[], [5], [9], [5, 11], [5, 12], [9, 13]]
    ids = random_prompt(8, seed=4)
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        step = torch.cat([ids[:, -1:], torch.tensor([[5, 9, 11, 12, 13]])], dim=1)
        logits = target(input_ids=step, attention_mask=model_tree_mask(target, tree_attention_mask(tree.mask, 7, 1)),
                        position_ids=7 + torch.tensor([tree.depths]), past_key_values=cache).logits[0]
        for node, path in enumerate(paths):
            plain = target(input_ids=torch.cat([ids, torch.tensor([path], dtype=torch.long)], dim=1)).logits[0, -1]
            assert torch.allclose(logits[node], plain, atol=1e-5), node


# ---------------------------------------------------------------------------------------------- cache compaction
def _sequential_cache(model, tokens: torch.Tensor) -> DynamicCache:
    """K/V of plain one-token-at-a-time decoding after the first token's prefill."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for i in range(tokens.shape[1]):
            model(input_ids=tokens[:, i:i + 1], position_ids=torch.tensor([[i]]), past_key_values=cache, use_cache=True)
    return cache


def _assert_same_cache(a, b):
    assert a.get_seq_length() == b.get_seq_length()
    for la, lb in zip(a.layers, b.layers):
        assert torch.allclose(la.keys, lb.keys, atol=1e-5) and torch.allclose(la.values, lb.values, atol=1e-5)


def test_cache_after_accepted_path_equals_sequential_decoding(tiny):
    target, _ = tiny
    ids = random_prompt(12, seed=5)
    greedy = _plain(target, ids, max_new=4)[:, 12:]  # g1 .. g4
    g1, g2, g3, g4 = greedy[0].tolist()
    # nodes: 1:(0) 2:(1) 3:(0,0) 4:(1,0) 5:(1,1) 6:(1,1,0); the greedy path is 2 -> 5 -> 6, off the rank-0 branch
    tree = TokenTree.from_paths([[0], [1], [0, 0], [1, 0], [1, 1], [1, 1, 0]])
    other = [t for t in range(128) if t not in (g1, g2, g3)]
    tokens = torch.tensor([[other[0], g1, other[1], other[2], g2, g3]])
    cache = DynamicCache(config=target.config)
    with torch.inference_mode():
        target(input_ids=ids[:, :-1], position_ids=torch.arange(11)[None], past_key_values=cache, use_cache=True)
        tv = verify_tree(target, cache, ids[:, -1:], TreeDraft(tokens=tokens, tree=tree), torch.tensor([[11]]),
                         Sampler())
    assert tv.path == (2, 5, 6) and tv.tokens.tolist() == [[g1, g2, g3]] and int(tv.next_token) == g4
    _assert_same_cache(cache, _sequential_cache(target, torch.cat([ids, greedy[:, :3]], dim=1)))


def test_draft_cache_keeps_the_accepted_nodes_it_has_seen(tiny):
    target, draft = tiny
    ids = random_prompt(10, seed=6)
    drafter = DraftTree(draft, "2,2,2")
    with torch.inference_mode():
        drafter.begin(target, ids, torch.ones_like(ids), Sampler())
        proposal = drafter.propose(ids, torch.ones_like(ids), 3, Sampler())
        assert proposal.forwards == 3 and proposal.tree.size == 14
        path = (2, 6, 14)  # ranks 1, 1, 1; nodes at depth 1 and 2 were fed to the draft, the leaf was not
        tree = proposal.tree
        assert [tree.parents[n] for n in path] == [0, 2, 6] and [tree.ranks[n] for n in path] == [1, 1, 1]
        drafter.observe(None, dataclasses.replace(proposal, path=path), kept=3)
    fed = proposal.tokens[:, [1, 5]]  # nodes 2 and 6
    _assert_same_cache(drafter._cache, _sequential_cache(draft, torch.cat([ids, fed], dim=1)))
    drafter.end()


def test_keep_cache_slots_moves_and_crops():
    cache = DynamicCache()
    keys = torch.arange(8.0).view(1, 1, 8, 1)
    cache.update(keys, -keys, 0)
    keep_cache_slots(cache, 3, [0, 2, 4])
    assert cache.layers[0].keys.flatten().tolist() == [0, 1, 2, 3, 5, 7]
    assert cache.layers[0].values.flatten().tolist() == [0, -1, -2, -3, -5, -7]


# ---------------------------------------------------------------------------------------------- tree vs chain
def test_tree_accepts_more_than_a_chain_of_the_same_depth(micro):
    """micro-lm + micro-draft, 2 prompts x 40 tokens, depth 3: chain k=3 vs tree 3,2,2.

    Measured: chain 80 tokens in 45 steps (mean accepted length 1.78, 47 target forwards, 128 draft forwards), tree
    3,2,2 (21 nodes) 80 in 35 steps (2.29, 37 target forwards, 98 draft forwards); the chain-shaped tree 1,1,1
    accepts exactly as the chain.
    """
    model, _, draft, prompts, refs = micro
    stats = {}
    for name, make in (("chain", lambda: DraftModel(draft)), ("1,1,1", lambda: DraftTree(draft, "1,1,1")),
                       ("3,2,2", lambda: DraftTree(draft, "3,2,2"))):
        runs = [speculative_generate(model, ids, make(), max_new_tokens=MAX_NEW, num_draft_tokens=3) for ids in prompts]
        for out, ref in zip(runs, refs):
            assert torch.equal(out.sequences, ref)
        stats[name] = {"accepted": [o.accepted for o in runs],
                       "mal": sum(o.new_tokens for o in runs) / sum(o.steps for o in runs),
                       "forwards": sum(o.target_forwards for o in runs)}
    assert stats["1,1,1"]["accepted"] == stats["chain"]["accepted"]  # a chain-shaped tree is the chain
    assert stats["3,2,2"]["mal"] >= stats["chain"]["mal"] + 0.3
    assert stats["3,2,2"]["forwards"] < stats["chain"]["forwards"]


# ---------------------------------------------------------------------------------------------- sampling
def test_sampling_with_top_k_1_equals_greedy(micro):
    model, _, draft, prompts, refs = micro
    out = speculative_generate(model, prompts[1], DraftTree(draft, "2,2"), max_new_tokens=MAX_NEW, temperature=0.7,
                               top_k=1, num_draft_tokens=2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.sequences, refs[1])


def test_tree_walk_samples_the_target_distribution():
    """Sampled walks emit every token from the target's own distribution: the first token ~ p_root, the token after
    an accepted child ~ p_child (chi-square, 3000 walks on a 4-token vocabulary)."""
    tree = TokenTree.from_shape("2,1")  # nodes 1, 2 at depth 1; 3 under 1, 4 under 2
    tokens = [0, 1, 2, 3]
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25],
                                     [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]))
    gen = torch.Generator().manual_seed(0)
    first, after_child1 = [], []
    for _ in range(3000):
        path, nxt = walk_tree(logits, tokens, tree, Sampler(temperature=1.0), gen)
        emitted = [tokens[n - 1] for n in path] + [nxt]
        first.append(emitted[0])
        if path and path[0] == 1:
            after_child1.append(emitted[1])
    for sample, p in ((first, [0.5, 0.2, 0.2, 0.1]), (after_child1, [0.1, 0.1, 0.7, 0.1])):
        counts = torch.bincount(torch.tensor(sample), minlength=4).double()
        assert chisquare(counts.numpy(), (torch.tensor(p) * counts.sum()).numpy()).pvalue > 1e-3


# ---------------------------------------------------------------------------------------------- harness
def test_registry_and_harness_run_a_tree(micro):
    model, tok, draft, prompts, refs = micro
    assert METHODS["tree"] is DraftTree and METHODS["dytree"] is DynamicDraftTree
    method = build_speculative_method("tree:shape=3,2,2", draft=draft)
    assert method.num_draft_tokens == 3 and method.drafter.model is draft  # k defaults to the tree's depth
    assert build_speculative_method("dytree:width=3:depth=6:k=4", draft=draft).num_draft_tokens == 4
    method.prepare(model, tok)
    ids = prompts[0]
    res = method.timed_generate(model, ids, max_new_tokens=MAX_NEW, gen_kwargs={})
    assert res["new_ids"] == refs[0][0, ids.shape[1]:].tolist()
    tel = res["telemetry"]
    assert tel["drafter_telemetry"]["tree"] == "3,2,2" and tel["lossless"] is True
    assert tel["mean_accepted_length"] > 1 and 0 < tel["acceptance_rate"] < 1
    assert tel["drafter_telemetry"]["tree_nodes_mean"] == pytest.approx(sum(tel["proposed"]) / tel["steps"])


# ---------------------------------------------------------------------------------------------- errors
def test_batch_above_one_is_refused(tiny):
    target, draft = tiny
    ids = random_prompt(6, seed=1, batch=2)
    with pytest.raises(ValueError, match="batch size 1"):
        speculative_generate(target, ids, DraftTree(draft, "2,2"), max_new_tokens=4)


@pytest.mark.parametrize("spec, match", [
    ("tree:shape=3,0", "shape"), ("tree:shape=3,x", "shape"), ("tree:shape=", "shape"),
    ("dytree:width=0", "width"), ("dytree:depth=2.5", "depth"), ("dytree:threshold=1.5", "threshold"),
])
def test_bad_tree_specs_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        build_drafter(spec)


def test_malformed_trees_are_refused():
    with pytest.raises(ValueError, match="prefix"):
        TokenTree.from_paths([[0], [0, 0, 1]])
    with pytest.raises(ValueError, match="distinct"):
        TokenTree(parents=(-1, 0, 0), ranks=(0, 1, 1))
    with pytest.raises(ValueError, match="TreeDraft"):
        TreeDraft(tokens=torch.zeros(1, 2, dtype=torch.long), tree=TokenTree.from_shape("3"))


def test_attention_without_custom_masks_is_refused():
    fake = type("M", (), {"config": type("C", (), {"_attn_implementation": "flash_attention_2"})()})()
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        model_tree_mask(fake, torch.ones(1, 1, 1, 1, dtype=torch.bool))


def test_cache_layers_that_cannot_be_compacted_are_refused():
    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=4)]
    with pytest.raises(ValueError, match="DynamicLayer"):
        keep_cache_slots(cache, 0, [0])
