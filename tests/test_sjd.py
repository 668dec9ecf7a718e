"""Speculative Jacobi Decoding and LANTERN relaxed acceptance on tiny random Llamas (no downloads)."""
import numpy as np
import pytest
import torch
from scipy import stats
from tiny_models import random_prompt, tiny_llama

from mmaccel.speculative.engine import speculative_generate
from mmaccel.speculative.lantern import Lantern, latent_neighbours, relax
from mmaccel.speculative.sampling import Sampler
from mmaccel.speculative.sjd import SpeculativeJacobi

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 32


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=VOCAB, seed=3)


def _greedy_reference(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)


@pytest.mark.parametrize("drafter", [
    lambda: SpeculativeJacobi(),
    lambda: SpeculativeJacobi(init="neighbour", width=4),
    lambda: SpeculativeJacobi(init="previous_frame", width=4, frame=12, init_tokens=range(8)),
    lambda: Lantern(k=1, delta=0.5),
    lambda: Lantern(k=4, delta=0.0, init="neighbour", width=4),
], ids=["random", "neighbour", "previous_frame", "lantern_k1", "lantern_delta0"])
def test_greedy_sjd_is_token_identical_to_greedy_decoding(model, drafter):
    prompt = random_prompt(5, seed=2, batch=2, vocab_size=VOCAB)
    ref = _greedy_reference(model, prompt, 40)
    out = speculative_generate(model, prompt, drafter(), max_new_tokens=40, num_draft_tokens=6, eos_token_id=None)
    assert torch.equal(out.sequences, ref)
    assert out.target_forwards == 1 + out.steps
    tele = out.drafter_telemetry
    assert tele["stale_tokens"] + tele["initialised_tokens"] == sum(out.proposed)


def test_sjd_commits_the_whole_window_once_jacobi_has_converged():
    """A model whose next token never depends on the context (always 7): the first step's drafts are rejected, its
    stale guesses are then all right, and every later step commits the whole window plus the bonus token."""
    model = tiny_llama(vocab_size=VOCAB, seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            for p in layer.parameters():
                p.zero_()  # attention and MLP add nothing: the last hidden state is the token's embedding
        v = torch.ones(model.config.hidden_size)
        model.model.embed_tokens.weight.copy_(v.expand(VOCAB, -1))
        model.lm_head.weight.zero_()
        model.lm_head.weight[7] = v
    prompt = torch.tensor([[3, 5]])
    out = speculative_generate(model, prompt, SpeculativeJacobi(init="neighbour", width=1, init_tokens=[0]),
                               max_new_tokens=30, num_draft_tokens=5, eos_token_id=None)
    assert out.sequences[0, 2:].tolist() == [7] * 30
    # step 1: the drafts (token 0) are rejected, 1 token; steps 2-5: 5 + 1 tokens each; step 6: the last 5
    assert out.accepted == [0, 5, 5, 5, 5, 4]
    assert out.target_forwards == 7
    # step 2 drafts from step 1's stale guesses; after a fully accepted window nothing is stale, and the neighbour
    # initialisation (the previous token, width 1) fills windows 3-6
    assert out.drafter_telemetry["stale_tokens"] == 5
    assert out.drafter_telemetry["initialised_tokens"] == 5 + 3 * 5 + 4


def _exact_joint(model, prompt, n, temperature):
    """P(x_1..x_n | prompt) of a tiny-vocabulary model for every sequence, by the chain rule."""
    vocab = model.config.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(vocab)] * n).reshape(-1, n)
    ids = torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = model(ids).logits[:, prompt.shape[1] - 1:-1].float() / temperature
    logp = logits.log_softmax(-1).gather(-1, seqs[..., None]).squeeze(-1).sum(-1)
    return seqs, logp.exp()


@pytest.mark.parametrize("init", ["random", "neighbour"])
def test_sjd_sampling_preserves_the_distribution(init):
    model = tiny_llama(vocab_size=4, seed=5)
    prompt = torch.tensor([[0, 1, 2]])
    n, rows, temperature = 3, 4000, 1.3
    _, exact = _exact_joint(model, prompt, n, temperature)
    gen = torch.Generator().manual_seed(0)
    drafter = SpeculativeJacobi(init=init, width=2)
    out = speculative_generate(model, prompt.expand(rows, -1), drafter, max_new_tokens=n, temperature=temperature,
                               num_draft_tokens=2, eos_token_id=None, generator=gen)
    # rows share one cache and commit the batch minimum, but every row's own first draft token is kept when its
    # acceptance test passes: drafts from stale distributions were accepted and resampled on rejection
    assert sum(a > 0 for row in out.accepted_per_row for a in row) > rows // 2
    assert out.drafter_telemetry["stale_tokens"] > 0
    got = out.sequences[:, prompt.shape[1]:]
    code = (got * torch.tensor([16, 4, 1])).sum(-1)
    observed = torch.bincount(code, minlength=64).numpy()
    expected = exact.double().numpy()
    expected = expected / expected.sum() * rows
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if not big.all():  # pool the rare sequences into one cell
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    p_value = stats.chisquare(obs, exp).pvalue
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}: SJD sampling does not match the model's distribution"


def test_lantern_without_relaxation_equals_sjd_when_sampling(model):
    prompt = random_prompt(4, seed=7, batch=3, vocab_size=VOCAB)
    kwargs = {"max_new_tokens": 30, "temperature": 0.8, "num_draft_tokens": 5, "eos_token_id": None}
    base = speculative_generate(model, prompt, SpeculativeJacobi(init="neighbour", width=4),
                                generator=torch.Generator().manual_seed(11), **kwargs)
    for lantern in (Lantern(k=1, delta=0.9, init="neighbour", width=4),
                    Lantern(k=8, delta=0.0, init="neighbour", width=4)):
        out = speculative_generate(model, prompt, lantern, generator=torch.Generator().manual_seed(11), **kwargs)
        assert torch.equal(out.sequences, base.sequences)
        assert out.accepted == base.accepted
        assert out.drafter_telemetry["relaxed_positions"] == 0
        assert not model._forward_hooks  # the hook is gone after the generation


def test_lantern_relaxation_accepts_more_and_is_marked_lossy(model):
    prompt = random_prompt(4, seed=8, batch=4, vocab_size=VOCAB)
    kwargs = {"max_new_tokens": 40, "temperature": 1.0, "num_draft_tokens": 6, "eos_token_id": None}
    base = speculative_generate(model, prompt, SpeculativeJacobi(), generator=torch.Generator().manual_seed(1),
                                **kwargs)
    relaxed = speculative_generate(model, prompt, Lantern(k=VOCAB, delta=1.0),
                                   generator=torch.Generator().manual_seed(1), **kwargs)
    assert Lantern.lossless is False and SpeculativeJacobi.lossless is True
    assert relaxed.drafter_telemetry["relaxed_positions"] > 0
    assert relaxed.drafter_telemetry["lantern_k"] == VOCAB
    # with every token in the neighbourhood and delta = 1, any draft token takes all the mass: everything accepted
    assert relaxed.acceptance_rate == 1.0 > base.acceptance_rate
    assert not model._forward_hooks


def test_relax_moves_the_nearest_mass_within_delta():
    p = torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])
    x = torch.tensor([[2]])
    table = torch.tensor([[0, 1, 2, 3], [1, 0, 2, 3], [2, 1, 3, 0], [3, 2, 1, 0]])
    full, moved = relax(p, x, table, k=3, delta=0.36)
    assert torch.allclose(full, torch.tensor([[[0.5, 0.0, 0.5, 0.0]]])) and moved.item() == pytest.approx(0.35)
    part, moved = relax(p, x, table, k=3, delta=0.32)  # token 1 (0.3) fits, token 3 would make 0.35
    assert torch.allclose(part, torch.tensor([[[0.5, 0.0, 0.45, 0.05]]])) and moved.item() == pytest.approx(0.3)
    none, moved = relax(p, x, table, k=3, delta=0.2)  # the nearest neighbour alone exceeds delta: nothing moves
    assert torch.equal(none, p) and moved.item() == 0.0
    # total variation between p and p~ equals the moved mass
    assert 0.5 * (part - p).abs().sum().item() == pytest.approx(0.3)


def test_latent_neighbours_orders_by_distance_and_pads():
    latents = torch.tensor([[0.0], [1.0], [3.0]])
    table = latent_neighbours(latents, 3, vocab_size=5, token_ids=[0, 1, 4])
    assert table.tolist() == [[0, 1, 4], [1, 0, 4], [2, -1, -1], [3, -1, -1], [4, 1, 0]]


def _begun(drafter, prompt_len=2, vocab=VOCAB):
    target = tiny_llama(vocab_size=vocab)
    ids = torch.zeros(1, prompt_len, dtype=torch.long)
    drafter.begin(target, ids, torch.ones_like(ids), Sampler())
    return drafter


def test_neighbour_init_copies_the_pixel_above_then_the_one_to_the_left():
    # prompt of 2 tokens, then a 3-wide raster: committed pixels a b c d (raster 0..3)
    seq = torch.tensor([[9, 9, 11, 12, 13, 14]])
    d = _begun(SpeculativeJacobi(init="neighbour", width=3))
    draft = d.propose(seq, torch.ones_like(seq), 4, Sampler())
    # raster 4 <- 1 (b), 5 <- 2 (c), 6 <- 3 (d), 7 <- 4 (the first draft token, itself b)
    assert draft.tokens.tolist() == [[12, 13, 14, 12]]
    assert torch.equal(draft.probs.argmax(-1), draft.tokens) and torch.equal(draft.probs.sum(-1), torch.ones(1, 4))
    first_row = torch.tensor([[9, 9, 11]])
    draft = _begun(SpeculativeJacobi(init="neighbour", width=3)).propose(first_row, first_row, 2, Sampler())
    assert draft.tokens.tolist() == [[11, 11]]  # raster 1, 2: the pixel to the left


def test_previous_frame_init_copies_the_same_pixel_one_frame_back():
    # 2x2 frames (frame = 4 tokens, width 2); frame 0 committed as 11 12 13 14
    seq = torch.tensor([[9, 11, 12, 13, 14]])
    d = _begun(SpeculativeJacobi(init="previous_frame", width=2, frame=4), prompt_len=1)
    draft = d.propose(seq, torch.ones_like(seq), 5, Sampler())
    assert draft.tokens.tolist() == [[11, 12, 13, 14, 11]]
    # inside the first frame it falls back to the pixel above
    draft = _begun(SpeculativeJacobi(init="previous_frame", width=2, frame=4), prompt_len=1).propose(
        seq[:, :3], seq[:, :3], 2, Sampler())
    assert draft.tokens.tolist() == [[11, 12]]


def test_random_init_draws_from_init_tokens_with_a_uniform_q():
    d = _begun(SpeculativeJacobi(init_tokens=[5, 6]))
    seq = torch.tensor([[1, 2]])
    draft = d.propose(seq, seq, 50, Sampler(), torch.Generator().manual_seed(0))
    assert set(draft.tokens.flatten().tolist()) == {5, 6}
    assert torch.allclose(draft.probs[0, :, [5, 6]], torch.full((50, 2), 0.5))
    assert draft.probs[0].sum(-1).allclose(torch.ones(50))


@pytest.mark.parametrize("build, match", [
    (lambda: SpeculativeJacobi(init="spiral"), "unknown SJD init"),
    (lambda: SpeculativeJacobi(init="neighbour"), "needs width"),
    (lambda: SpeculativeJacobi(init="previous_frame", width=4), "needs frame"),
    (lambda: SpeculativeJacobi(init="neighbour", width=0), "width must be a positive int"),
    (lambda: SpeculativeJacobi(init_tokens=[]), "init_tokens is empty"),
    (lambda: Lantern(k=0), "k must be an int >= 1"),
    (lambda: Lantern(k=-2), "k must be an int >= 1"),
    (lambda: Lantern(delta=-0.1), "delta must be a number in"),
    (lambda: Lantern(delta=1.5), "delta must be a number in"),
    (lambda: Lantern(k=4, neighbours=torch.zeros(8, 2, dtype=torch.long)), "neighbours must be"),
    (lambda: Lantern(SpeculativeJacobi(), init="neighbour"), "configure the default SJD drafter"),
    (lambda: latent_neighbours(torch.zeros(3, 2), 0), "k must be an int >= 1"),
])
def test_bad_arguments_raise_one_clear_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_generation_arguments_raise(model):
    prompt = random_prompt(3, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        speculative_generate(model, prompt, SpeculativeJacobi(), max_new_tokens=4, temperature=-0.5)
    with pytest.raises(ValueError, match="top_p would filter it again"):
        speculative_generate(model, prompt, Lantern(), max_new_tokens=4, temperature=1.0, top_p=0.9)
    assert not model._forward_hooks
