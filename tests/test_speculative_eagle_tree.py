"""EAGLE-2 tree drafting: greedy output equals plain decoding, an oracle head gets every path accepted (the tree's
feature bookkeeping feeds the right columns), sampling runs, bad inputs fail clearly."""
import pytest
import torch
from test_speculative_eagle import _head, oracle_head
from tiny_models import random_prompt, tiny_llama

from mmaccel.speculative import METHODS, EagleTree, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(layers=2, vocab_size=128, seed=0)


@pytest.mark.parametrize("width, depth, vocab", [(3, 4, None), (1, 3, list(range(0, 128, 2))), (5, 2, None)])
def test_greedy_equals_generate(tiny, width, depth, vocab):
    ids = random_prompt(12, seed=5)
    ref = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    drafter = EagleTree(_head(tiny, vocab_ids=vocab, seed=4), width=width, depth=depth)
    out = speculative_generate(tiny, ids, drafter, max_new_tokens=24, num_draft_tokens=depth, eos_token_id=None)
    assert torch.equal(out.sequences, ref)
    tele = out.drafter_telemetry
    assert tele["tree"] == f"eagle2(width={width}, depth={depth}, threshold=None)"
    assert 1 <= tele["tree_nodes_mean"] <= width * depth


def test_an_oracle_head_gets_every_path_accepted(tiny):
    """The head returns the target's own feature of the next column: the top child at every depth is the target's
    token, so every step accepts the whole depth, which only holds if the accepted path's true features reach the
    head in the right columns."""
    ids = random_prompt(10, seed=8)
    longer = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    with torch.no_grad():
        feats = tiny.model(longer).last_hidden_state

    out = speculative_generate(tiny, ids, EagleTree(oracle_head(tiny, feats), width=2, depth=3), max_new_tokens=12, num_draft_tokens=3,
                               eos_token_id=None)
    assert torch.equal(out.sequences, longer[:, : ids.shape[1] + 12])
    assert out.drafter_telemetry["path_acceptance_rate"] == 1.0


def test_sampling_runs_and_stays_in_the_vocabulary(tiny):
    ids = random_prompt(8, seed=2)
    out = speculative_generate(tiny, ids, EagleTree(_head(tiny, seed=3), width=3, depth=3), max_new_tokens=10,
                               num_draft_tokens=3, temperature=1.0, eos_token_id=None,
                               generator=torch.Generator().manual_seed(0))
    new = out.sequences[0, ids.shape[1]:]
    assert new.numel() == 10 and int(new.max()) < 128


def test_registry_and_bad_inputs(tiny):
    assert METHODS["eagle_tree"] is EagleTree
    for kwargs, match in [({"width": 0}, "width must be"), ({"depth": 1.5}, "depth must be"),
                          ({"threshold": 1.0}, "threshold must be")]:
        with pytest.raises(ValueError, match=match):
            EagleTree(_head(tiny), **kwargs)
    with pytest.raises(ValueError, match="batch size 1 only"):
        speculative_generate(tiny, random_prompt(6, batch=2), EagleTree(_head(tiny)), max_new_tokens=4)
