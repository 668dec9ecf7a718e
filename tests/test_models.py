"""Model loading, the zoo, the tokenizer and the training-document generator."""
import json
import random
import re

import pytest
import torch
from tiny_models import tiny_llama

from mmaccel.data.haystack import stdlib_paragraphs
from mmaccel.models import ModelLoadError, load, resolve_model_path
from mmaccel.models import zoo as zoo_mod
from mmaccel.models.tokenizer import train_bpe_tokenizer
from mmaccel.models.zoo import Phase, Recipe
from mmaccel.zoo.train.lm import NeedleDocuments, train


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(stdlib_paragraphs("train")[:300], vocab_size=400)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tokenizer):
    model = tiny_llama(layers=1, heads=2, kv_heads=1, tokenizer=tokenizer)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_tokenizer_splits_digits_and_has_specials(tokenizer):
    ids = tokenizer.encode(" is 40817.", add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert [p for p in pieces if p.isdigit()] == ["4", "0", "8", "1", "7"]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.decode(ids) == " is 40817."


def test_tokenizer_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        train_bpe_tokenizer(["abc"], vocab_size=100)


def test_load_local_checkpoint_roundtrip(tiny_checkpoint):
    model, tok = load(tiny_checkpoint, device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert tok.encode(" is 1", add_special_tokens=False)[-1] == tok.convert_tokens_to_ids("1")
    model16, _ = load(str(tiny_checkpoint), device="cpu", dtype="float16")
    assert next(model16.parameters()).dtype == torch.float16


def test_load_missing_path_names_the_fix(tmp_path):
    with pytest.raises(ModelLoadError, match="not a zoo model"):
        load(str(tmp_path / "nope" / "deeper"))


def test_load_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load(tmp_path)


def test_load_unknown_name():
    with pytest.raises(ModelLoadError, match="micro-lm"):
        resolve_model_path("definitely-not-a-model")


def test_load_hub_id_offline_says_pass_a_local_path(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="local directory"):
        load("some-org/some-model")


def test_load_unsupported_architecture(tmp_path):
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load(tmp_path, device="cpu")


def test_untrained_zoo_model_names_the_train_command(monkeypatch, tmp_path):
    monkeypatch.setattr(zoo_mod, "assets_dir", lambda: tmp_path)
    with pytest.raises(ModelLoadError, match="mmaccel zoo train micro-lm"):
        resolve_model_path("micro-lm")


def test_zoo_list_rows():
    rows = {r["name"]: r for r in zoo_mod.list_models()}
    assert set(rows) == {"micro-lm", "micro-draft", "micro-ar"}
    for row in rows.values():
        assert row["trained"] == (row["size_bytes"] > 0)


def test_zoo_models_within_size_limit():
    for row in zoo_mod.list_models():
        assert row["size_bytes"] <= 20 * 1024 * 1024


def test_needle_documents_match_the_niah_layout(tokenizer):
    docs = NeedleDocuments(tokenizer, random.Random(0), max_needles=2, answer_weight=2.0)
    for n in (120, 333, 1000):
        ids, weights = docs.sample(n)
        assert len(ids) == len(weights) == n
        assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
        answer = [i for i, w in zip(ids, weights) if w > 1]
        text = tokenizer.decode(answer[:-1]).strip()
        assert text.isdigit() and len(text) == 5
        # the question before the answer is phrased exactly as the NIAH prompt ends
        prompt = tokenizer.decode(ids[: n - len(answer)])
        assert re.search(r"\nWhat is the secret number of the (\w+ \w+)\? The secret number of the \1 is$", prompt)
    with pytest.raises(ValueError, match="cannot hold a needle"):
        docs.sample(20)


def test_train_with_a_recipe_override(tmp_path):
    """A recipe passed to train() replaces the zoo entry's; a phase's max_needles is used and logged."""
    recipe = Recipe(phases=(Phase(steps=2, min_len=128, max_len=128, batch_size=2, max_needles=3),), warmup_steps=1)
    summary = train("micro-draft", tmp_path, threads=1, recipe=recipe, log_every=1)
    assert summary["steps"] == 2
    assert [h["max_needles"] for h in summary["history"]] == [3, 3]
    assert json.loads((tmp_path / "train_log.json").read_text())["recipe"]["phases"][0]["max_needles"] == 3
    model, tok = load(str(tmp_path), device="cpu")
    assert model.config.num_hidden_layers == zoo_mod.ZOO["micro-draft"].model_config["num_hidden_layers"]
    assert tok.bos_token_id == 1


def test_model_card_renders_committed_results(tmp_path):
    """The card is built from the files in the model folder: training log, NIAH summaries, the SnapKV study."""
    import shutil

    from mmaccel.zoo.card import write_model_card

    src = zoo_mod.zoo_path("micro-draft")
    for f in ("train_log.json", "config.json", "model.safetensors"):
        shutil.copy(src / f, tmp_path / f)
    cell = {"length": 1024, "depth": 0.5, "accuracy": 0.7, "n": 10}
    (tmp_path / "niah_kv").mkdir()
    (tmp_path / "niah_kv" / "summary.json").write_text(json.dumps({"methods": {"snapkv:budget=256": {"cells": [cell]}}}))
    study = {"args": {"length": 4096, "depth": 0.5, "seeds": 8, "budget": 256, "window": 32},
             "results": {"full": [True] * 8, "snapkv layer 1 only": [True, False] * 4},
             "snapkv_answers": ["36116", "31416"], "expected_answers": ["31416", "31416"],
             "snapkv_wrong_digit_positions": [0, 1, 1, 0, 0],
             "worst_layer_decode_targets": {"layer": 1, "median_distance_from_end": 900,
                                            "per_step_in_needle": {"0": [0, 24], "1": [5, 24]}}}
    (tmp_path / "snapkv_diagnosis.json").write_text(json.dumps(study))
    text = write_model_card("micro-draft", tmp_path).read_text()
    assert "`snapkv:budget=256`:" in text and "| 0.50 | 70% (10) |" in text
    assert "| snapkv layer 1 only | 4/8 |" in text and "| full | 8/8 |" in text
    assert "| facts per document |" in text
    assert "wrong digits by position: digit 1: 0, digit 2: 1, digit 3: 1" in text
    assert "step 0: 0/24; step 1: 5/24" in text and "median 900 tokens" in text


def test_seed_study_line_reads_the_committed_summary(monkeypatch, tmp_path):
    from mmaccel.zoo.card import seed_study_line

    monkeypatch.setattr(zoo_mod, "assets_dir", lambda: tmp_path)
    assert seed_study_line("micro-lm", ["full"], 4096, 0.5) is None  # no study committed
    (tmp_path / "micro-lm" / "niah_seeds").mkdir(parents=True)
    summary = {
        "config": {"lengths": [4096], "depths": [0.5], "trials": 10},
        "methods": {
            "full": {"accuracy": 0.9, "n": 10, "by_length": [{"kv_ratio_prefill": 1.0}]},
            "snapkv:budget=1024": {"accuracy": 0.6, "n": 10, "by_length": [{"kv_ratio_prefill": 0.25}]},
        },
    }
    (tmp_path / "micro-lm" / "niah_seeds" / "summary.json").write_text(json.dumps(summary))
    line = seed_study_line("micro-lm", ["full", "snapkv:budget=1024", "streaming:window=1024"], 4096, 0.5)
    assert line == ("Over 10 seeds at 4096 tokens, depth 0.5 (committed in assets/models/micro-lm/niah_seeds/, strict "
                    "match): full 9/10, snapkv:budget=1024 6/10 (KV ratio 0.25).")
    assert seed_study_line("micro-lm", ["full"], 2048, 0.5) is None  # another length: not the same study
    assert seed_study_line("/some/local/dir", ["full"], 4096, 0.5) is None
