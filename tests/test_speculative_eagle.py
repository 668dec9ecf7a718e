"""EAGLE draft head: the training unroll is what drafting computes, greedy output is exact, the trainer's data and
labels line up with the target, training lowers the loss, the trained head round-trips, bad inputs fail clearly."""
import json

import pytest
import torch
from tiny_models import random_prompt, tiny_llama

import mmaccel
from mmaccel.speculative import (
    METHODS,
    Cascade,
    DraftModel,
    DraftTree,
    Eagle,
    EagleHead,
    EagleHeadConfig,
    PromptLookup,
    build_drafter,
    load_head,
    speculative_generate,
)
from mmaccel.speculative.eagle import HeadCache
from mmaccel.zoo.train.eagle import (
    _batch,
    choose_vocab,
    generate_examples,
    greedy_next,
    train,
    training_prompts,
    unrolled_loss,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _head(target, vocab_ids=None, seed=0) -> EagleHead:
    torch.manual_seed(seed)
    V = target.config.vocab_size
    return EagleHead(EagleHeadConfig.from_target(target, vocab_ids or list(range(V)), "tiny")).eval()


def oracle_head(target, feats: torch.Tensor) -> EagleHead:
    """A head that returns the target's own feature of the next column (``feats`` [1, S, H]: the true features of a
    sequence at least as long as the generation), adding zero K/V to the head cache."""

    class Oracle(EagleHead):
        def forward(self, features, embeds, positions, cache=None, mask=None):
            if cache is not None:
                cache.append(*[torch.zeros(1, self.config.num_kv_heads, features.shape[1], self.config.head_dim)] * 2)
            return feats[:, positions[0] + 1]

    return Oracle(EagleHeadConfig.from_target(target, list(range(target.config.vocab_size)), "tiny"))


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(layers=2, vocab_size=128, seed=0)


def test_registry_and_spec():
    assert METHODS["eagle"] is Eagle
    assert Eagle.lossless


def test_unroll_equals_step_by_step_drafting(tiny):
    """Step s of the training unroll at column p + s - 1 equals the s-th draft of a chain started at column p, with
    the head's cache holding the true columns 0..p and the chain's own earlier columns."""
    head = _head(tiny, seed=1)
    m, H, steps = 12, tiny.config.hidden_size, 4
    torch.manual_seed(2)
    feats, embs = torch.randn(1, m, H) * 3, torch.randn(1, m, H)
    with torch.no_grad():
        unrolled = list(head.unroll(feats, embs, steps))
        for p in (0, 3, 7):
            cache = HeadCache(1, head.config.num_kv_heads, head.config.head_dim, 4, torch.float32, "cpu")
            out = head(feats[:, : p + 1], embs[:, : p + 1], torch.arange(p + 1)[None], cache)[:, -1:]
            assert torch.allclose(out[:, 0], unrolled[0][:, p], atol=1e-5)
            for s in range(2, steps + 1):
                col = p + s - 1
                if col >= m:
                    break
                out = head(out, embs[:, col:col + 1], torch.tensor([[col]]), cache)
                assert torch.allclose(out[:, 0], unrolled[s - 1][:, col], atol=1e-5), (p, s)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_generate(tiny, k):
    ids = random_prompt(20, seed=3)
    ref = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    drafter = Eagle(_head(tiny, vocab_ids=list(range(0, 128, 2)), seed=4))  # half the vocabulary
    out = speculative_generate(tiny, ids, drafter, max_new_tokens=30, num_draft_tokens=k, eos_token_id=None)
    assert torch.equal(out.sequences, ref)
    assert out.drafter_telemetry["draft_tokens"] == sum(out.proposed)
    assert drafter._hook is None  # the feature hook is removed at the end


def test_greedy_batch_with_left_padding(tiny):
    a, b = random_prompt(14, seed=5), random_prompt(9, seed=6)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    drafter = Eagle(_head(tiny, seed=7))
    out = speculative_generate(tiny, ids, drafter, attention_mask=mask, max_new_tokens=16, num_draft_tokens=3,
                               eos_token_id=None)
    for row, prompt in ((0, a), (1, b)):
        ref = tiny.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
        assert out.sequences[row, -16:].tolist() == ref[0, -16:].tolist()


def test_a_head_that_predicts_the_target_is_accepted(tiny):
    """A head whose features are the target's own next features (an oracle wired through the cache) gets every
    draft accepted: the drafter's bookkeeping feeds the right columns."""
    ids = random_prompt(10, seed=8)
    plain = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        feats = tiny.model(plain).last_hidden_state  # f_i for every column of the final sequence

    out = speculative_generate(tiny, ids, Eagle(oracle_head(tiny, feats)), max_new_tokens=12, num_draft_tokens=3, eos_token_id=None)
    assert torch.equal(out.sequences, plain)
    assert out.acceptance_rate == 1.0


def test_wrong_target_unknown_head_and_bad_arguments(tiny, tmp_path):
    other = tiny_llama(layers=3, vocab_size=128, seed=0)
    with pytest.raises(ValueError, match="trained for tiny"):
        speculative_generate(other, random_prompt(8), Eagle(_head(tiny)), max_new_tokens=4)
    with pytest.raises(ValueError, match="unknown EAGLE head 'no-such-head'.*mmaccel zoo train"):
        Eagle("no-such-head")
    with pytest.raises(ValueError, match="unknown EAGLE head"):
        build_drafter(f"eagle:head={tmp_path}")
    with pytest.raises(ValueError, match="stop_below"):
        Eagle(_head(tiny), stop_below=1.5)


def test_training_prompts_are_held_out_from_spec_bench():
    from mmaccel.data.prompts import FREE_PROMPTS

    prompts = training_prompts(900)
    assert len(set(prompts)) == 900 and not set(prompts) & set(FREE_PROMPTS)
    with pytest.raises(ValueError, match="distinct prompts"):
        training_prompts(10**6)


def test_batch_labels_are_the_token_after_next_on_answers():
    ex = {"tokens": torch.tensor([5, 6, 7, 8, 9, 10]), "features": torch.randn(6, 4), "answer_start": 3}
    vocab_index = torch.full((16,), -100)
    vocab_index[torch.tensor([7, 8, 9, 10])] = torch.tensor([0, 1, 2, 3])
    vocab_index[10] = -100  # 10 is outside the sub-vocabulary: no label
    _, _, labels, valid = _batch([ex], vocab_index, max_len=64)
    # column i reads (f_i, t_{i+1}) and is labelled t_{i+2} where t_{i+2} is an answer token
    assert labels[0].tolist() == [-100, 1, 2, -100, -100, -100]
    assert valid[0].tolist() == [True] * 5 + [False]


def test_examples_carry_the_targets_features():
    """The features caught during batched greedy generation equal one forward over the final sequence, and the
    answers are the target's greedy continuation."""
    model, tok = mmaccel.load("micro-lm", device="cpu")
    reqs = [("The secret number is", ""), ("Return the value of the key.", "Answer:")]
    ex = generate_examples(model, tok, reqs, max_new_tokens=6, batch_size=2)
    for e, (user, lead) in zip(ex, reqs):
        with torch.no_grad():
            full = model.model(e["tokens"][None]).last_hidden_state[0]
        assert torch.allclose(e["features"], full[: len(e["features"])], atol=1e-4)
        prompt = e["tokens"][None, : e["answer_start"]]
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
        assert e["tokens"].tolist() == ref[0, : len(e["tokens"])].tolist()
    vocab = choose_vocab(ex, 10, model.config.vocab_size, always=[2])
    assert vocab[0] == 2 and len(set(vocab)) == 10


def test_sampled_answers_are_labelled_with_the_targets_argmax():
    """Sampled answers (``temperature``) are not the target's greedy continuation, so each carries ``greedy``: the
    target's argmax after every position, which is what the head is trained to predict."""
    model, tok = mmaccel.load("micro-lm", device="cpu")
    torch.manual_seed(0)
    reqs = [("The secret number is", ""), ("The secret number is", "")]
    ex = generate_examples(model, tok, reqs, max_new_tokens=8, batch_size=2, temperature=1.5)
    sampled_off_greedy = 0
    for e in ex:
        with torch.no_grad():
            logits = model(e["tokens"][None]).logits[0]
        argmax = logits[: len(e["greedy"])].argmax(-1)
        assert e["greedy"].tolist() == argmax.tolist()
        a = e["answer_start"]
        sampled_off_greedy += int((e["tokens"][a:] != argmax[a - 1:len(e["tokens"]) - 1]).sum())
    assert sampled_off_greedy > 0  # the answers really were sampled
    assert greedy_next(ex[0]) is ex[0]["greedy"]


def test_training_learns_the_targets_next_tokens(tiny):
    """On the tiny target's own greedy answers, 60 steps take the 2-step draft accuracy from chance to (nearly) all
    right: the loss, the labels and the unroll's gradients line up (the tiny model's flat softmax keeps its CE high)."""
    torch.manual_seed(9)
    head = _head(tiny, seed=9).train()
    ex = []
    for s in range(4):
        p = random_prompt(4, seed=s)
        seq = tiny.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=20, do_sample=False)[0]
        with torch.no_grad():
            ex.append({"tokens": seq, "features": tiny.model(seq[None]).last_hidden_state[0], "answer_start": 4})
    batch = _batch(ex, torch.arange(128), 64)
    scale = float(batch[1].std())
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    history = []
    for _ in range(60):
        loss, stats = unrolled_loss(head, tiny.get_input_embeddings(), tiny.lm_head.weight.detach(), *batch, steps=2,
                                    scale=scale)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append((float(loss), stats))
    (first, s0), (last, s1) = history[0], history[-1]
    assert last < 0.8 * first
    assert s0[0]["acc"] < 0.2 and s1[0]["acc"] > 0.9 and s1[1]["acc_chain"] > 0.8


def test_train_writes_a_head_that_round_trips(tmp_path):
    """`train` on micro-lm with a seconds-long budget: the files, the card, and a lossless trained drafter."""
    summary = train(tmp_path, target="micro-lm", n_free=6, n_copy=2, max_new_tokens=6, gen_batch=4,
                    data_minutes=1, text_minutes=0.01, train_minutes=0.02, vocab=256, unroll=2, batch_size=2,
                    max_len=96, n_sampled=3, sample_minutes=1)
    assert (tmp_path / "head.safetensors").is_file() and (tmp_path / "README.md").is_file()
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log["data"]["examples"] == 8 and log["train"]["steps"] >= 1
    assert log["data"]["sampled_examples"] == 3 and log["recipe"]["n_sampled"] == 3
    assert log["data"]["text_windows"] >= 1
    assert log["data"]["train_examples"] == 7 + 3 + log["data"]["text_windows"]
    assert f"Teacher-forced text: {log['data']['text_windows']:,} windows" in (tmp_path / "README.md").read_text()
    assert 1.0 <= log["eval_after"]["mean_accepted_length"] <= 1 + len(log["eval_after"]["acc_chain"])
    assert summary["card"] == str(tmp_path / "README.md")
    head = load_head(tmp_path)
    assert len(head.config.vocab_ids) == 256 and head.config.target == "micro-lm"
    model, tok = mmaccel.load("micro-lm", device="cpu")
    ids = tok("The secret number of the", return_tensors="pt").input_ids
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    out = speculative_generate(model, ids, Eagle(tmp_path), max_new_tokens=12, num_draft_tokens=3)
    assert torch.equal(out.sequences, ref)


def test_cascade_copies_or_drafts_and_stays_exact(tiny):
    """prompt lookup in front of EAGLE: each step one of them drafts, EAGLE's feature cache stays in step through the
    steps it sat out, and the output is plain greedy decoding."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11] * 4])
    ref = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    drafter = Cascade(PromptLookup(verify_cost=0.0), Eagle(_head(tiny, seed=11)), then_k=3)
    out = speculative_generate(tiny, ids, drafter, max_new_tokens=30, num_draft_tokens=8, eos_token_id=None)
    assert torch.equal(out.sequences, ref)
    tel = out.drafter_telemetry
    assert tel["first"]["steps"] > 0 and tel["then"]["steps"] > 0
    assert tel["first"]["steps"] + tel["then"]["steps"] == out.steps
    assert max(out.proposed[i] for i in range(out.steps)) > 3  # the copies are longer than then_k
    spec = build_drafter("cascade:first=prompt_lookup,max_ngram=4:then=prompt_lookup")
    assert isinstance(spec.first, PromptLookup) and spec.first.max_ngram == 4


def test_cascade_with_a_draft_model_stays_exact(tiny):
    """prompt lookup in front of a draft LM: the draft's cache holds only committed tokens, so after the steps it sat
    out it catches up in one forward; the output is plain greedy decoding. A tree drafter is refused."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11] * 4 + [40, 41]])
    ref = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    draft = DraftModel(tiny_llama(layers=1, vocab_size=128, seed=1))
    drafter = Cascade(PromptLookup(verify_cost=0.0), draft, then_k=3)
    out = speculative_generate(tiny, ids, drafter, max_new_tokens=30, num_draft_tokens=8, eos_token_id=None)
    assert torch.equal(out.sequences, ref)
    tel = out.drafter_telemetry
    assert tel["first"]["steps"] > 0 and tel["then"]["steps"] > 0
    assert tel["then"]["draft_forwards"] >= tel["then"]["steps"]
    alone = speculative_generate(tiny, ids, DraftModel(draft.model), max_new_tokens=30, num_draft_tokens=3,
                                 eos_token_id=None)
    assert torch.equal(alone.sequences, ref)
    with pytest.raises(ValueError, match="cannot share steps"):
        Cascade(PromptLookup(), DraftTree(tiny_llama(layers=1, vocab_size=128, seed=1)))
    with pytest.raises(ValueError, match="then_k"):
        Cascade(PromptLookup(), Eagle(_head(tiny)), then_k=0)
