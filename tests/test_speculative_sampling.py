"""Lossless speculative sampling: the first two generated tokens follow the target's exact distribution.

Chi-square goodness of fit of the joint of the first two tokens against the exact target joint
``p(t1) * p(t2 | t1)`` (computed with transformers' own warpers), on a vocabulary-8 model and a deliberately different
draft. Each check is paired with a deliberately wrong rule -- resampling from ``p`` instead of ``norm(max(0, p - q))``
after a rejection -- that must FAIL the same test, so the test can fail.
"""
import pytest
import torch
from tiny_models import tiny_llama
from transformers import TemperatureLogitsWarper, TopKLogitsWarper

import mmaccel.speculative.verify as verify_module
from mmaccel.speculative import (
    DraftModel,
    Eagle,
    EagleHead,
    EagleHeadConfig,
    PromptLookup,
    speculative_generate,
    verify_sampled,
)

V = 8
ALPHA = 1e-3  # a correct sampler fails with this probability (the seeds are fixed, so the test is deterministic)


pytestmark = pytest.mark.usefixtures("one_thread")


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (cells with expected count < 5 are pooled).

    Observations in a zero-probability cell give p = 0.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))


def _joint_counts(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    return torch.bincount(t1 * V + t2, minlength=V * V).reshape(V, V)


@pytest.fixture
def wrong_rule(monkeypatch):
    """After a rejection, resample from p instead of the residual: a classic bug that biases the output."""
    monkeypatch.setattr(verify_module, "residual_distribution", lambda p, q: p)


# ---------------------------------------------------------------------------- the rule itself, 100k chains
def _random_dists(gen, *shape, sharp=2.5):
    return (torch.randn(*shape, V, generator=gen) * sharp).softmax(-1)


def _chain_samples(deterministic: bool, n: int = 100_000, seed: int = 0):
    """First two tokens from verify_sampled on a synthetic 2-token chain with known p and q tables."""
    gen = torch.Generator().manual_seed(seed)
    p1, p2 = _random_dists(gen), _random_dists(gen, V)  # p2[a] = p(t2 | t1 = a)
    q1, q2 = _random_dists(gen), _random_dists(gen, V)
    if deterministic:  # a deterministic drafter: q is the one-hot of its choice
        d1 = torch.full((n,), int(q1.argmax()))
        d2 = q2.argmax(-1)[d1]
        draft_probs = None
    else:
        d1 = torch.multinomial(q1, n, replacement=True, generator=gen)
        d2 = torch.multinomial(q2[d1], 1, generator=gen).squeeze(1)
        draft_probs = torch.stack([q1.expand(n, V), q2[d1]], dim=1)
    bonus = torch.full((n, V), 1.0 / V)
    target_probs = torch.stack([p1.expand(n, V), p2[d1], bonus], dim=1)
    acc, nxt = verify_sampled(target_probs, torch.stack([d1, d2], 1), draft_probs, gen)
    t1 = torch.where(acc >= 1, d1, nxt)
    after = torch.multinomial(p2[t1], 1, generator=gen).squeeze(1)  # the next step when t1 was a correction
    t2 = torch.where(acc >= 2, d2, torch.where(acc == 1, nxt, after))
    assert set(acc.unique().tolist()) == {0, 1, 2}  # every branch of the rule is exercised
    return _joint_counts(t1, t2), p1[:, None] * p2


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-q", "one-hot-q"])
def test_verify_rule_preserves_the_target_joint(deterministic):
    counts, exact = _chain_samples(deterministic)
    assert chi_square_pvalue(counts, exact) > ALPHA


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-q", "one-hot-q"])
def test_a_wrong_rule_fails_the_same_check(wrong_rule, deterministic):
    counts, exact = _chain_samples(deterministic)
    assert chi_square_pvalue(counts, exact) < 1e-6


# ------------------------------------------------------------------------- the engine, end to end, batched
def _sharpened(seed: int, scale: float = 10.0):
    model = tiny_llama(layers=1, heads=2, kv_heads=1, head_dim=8, vocab_size=V, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # peaked distributions, so draft and target really differ
    return model


@pytest.fixture(scope="module")
def pair():
    return _sharpened(1), _sharpened(2)


TEMPERATURE, TOP_K = 0.9, 6


def _exact_joint(target, prompt: torch.Tensor) -> torch.Tensor:
    """p(t1) * p(t2 | t1) with transformers' TemperatureLogitsWarper + TopKLogitsWarper (what generate samples)."""

    def dist(ids):
        logits = target(ids).logits[:, -1]
        logits = TopKLogitsWarper(TOP_K)(None, TemperatureLogitsWarper(TEMPERATURE)(None, logits))
        return logits.softmax(-1)

    with torch.no_grad():
        p1 = dist(prompt)[0]
        p2 = dist(torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], dim=1))
    return p1[:, None] * p2


def _engine_counts(target, drafter, prompt, n=3000, seed=0):
    out = speculative_generate(target, prompt.repeat(n, 1), drafter, max_new_tokens=3, temperature=TEMPERATURE,
                               top_k=TOP_K, num_draft_tokens=2, eos_token_id=None,
                               generator=torch.Generator().manual_seed(seed))
    new = out.sequences[:, prompt.shape[1]:]
    return _joint_counts(new[:, 0], new[:, 1])


def _eagle(target, seed=3):
    """A random EAGLE head over 6 of the 8 tokens (its q has zero mass on the other two)."""
    torch.manual_seed(seed)
    return Eagle(EagleHead(EagleHeadConfig.from_target(target, [0, 1, 2, 3, 5, 7], "tiny")).eval())


@pytest.mark.parametrize("drafter", ["draft", "self", "prompt_lookup", "eagle"])
def test_engine_sampling_matches_the_target(pair, drafter):
    """3,000 rows sampled in one batched call match the exact joint.

    With a different draft the batch almost always commits 0 drafts per step (the minimum over rows), so each row's
    tokens are its own accepted draft or a residual draw; with the target as its own draft every row accepts both
    drafts, so t1, t2 come from the accept-all path (q_2 at the right context, bonus token).
    """
    target, draft = pair
    prompt = torch.tensor([[3, 7, 1, 2, 5, 3, 7]])  # the bigram (3, 7) recurs, so prompt lookup drafts (1, 2)
    make = {"draft": lambda: DraftModel(draft), "self": lambda: DraftModel(target),
            "prompt_lookup": lambda: PromptLookup(max_ngram=2), "eagle": lambda: _eagle(target)}[drafter]
    exact = _exact_joint(target, prompt)
    assert chi_square_pvalue(_engine_counts(target, make(), prompt), exact) > ALPHA


def test_engine_with_a_wrong_rule_fails(pair, wrong_rule):
    target, draft = pair
    prompt = torch.tensor([[3, 7, 1, 2, 5, 3, 7]])
    assert chi_square_pvalue(_engine_counts(target, DraftModel(draft), prompt), _exact_joint(target, prompt)) < 1e-6


def test_draft_probs_are_the_distributions_the_draft_tokens_came_from(pair):
    """q_i returned by DraftModel is the filtered draft distribution at the context prompt + d_1..d_{i-1}."""
    target, draft = pair
    from mmaccel.speculative import Sampler

    sampler = Sampler(temperature=TEMPERATURE, top_k=TOP_K)
    prompt = torch.tensor([[3, 7, 1, 2, 5]]).repeat(4, 1)
    mask = torch.ones_like(prompt)
    drafter = DraftModel(draft)
    drafter.begin(target, prompt, mask, sampler)
    d = drafter.propose(prompt, mask, 3, sampler, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i in range(3):
            ctx = torch.cat([prompt, d.tokens[:, :i]], dim=1)
            q = sampler.probs(draft(ctx).logits[:, -1])
            assert torch.allclose(d.probs[:, i], q, atol=1e-5)
            assert bool((q.gather(1, d.tokens[:, i:i + 1]) > 0).all())
    drafter.end()
