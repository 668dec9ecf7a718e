"""GGUF -> plain Hugging Face causal-LM checkpoint, through transformers' own GGUF loader.

transformers reads a GGUF file (``from_pretrained(folder, gguf_file=...)``, with the ``gguf`` package installed) and
dequantizes every tensor, but refuses to ``save_pretrained`` the result ("quantized with gguf"). This module builds a
plain model of the same class from the config without ``quantization_config``, loads the dequantized state dict into
it (strictly), and saves safetensors + config + tokenizer (chat template included) + generation config. The weights
are the *dequantized* values of the quantized file (e.g. Q4_1), not the original bf16 release.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def convert_gguf_causal_lm(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> dict:
    """Convert a GGUF causal LM into a plain checkpoint folder.

    Parameters
    ----------
    gguf_path : path
        The ``.gguf`` file (any architecture transformers' GGUF loader supports: llama, qwen2, mistral, ...).
    out_dir : path
        An existing, empty folder; receives ``config.json``, ``model.safetensors`` (fp32), the tokenizer files and
        ``generation_config.json``.

    Returns
    -------
    dict
        Conversion facts for the manifest: ``architecture``, ``parameters``, ``tensor_types`` (GGUF quantization types
        and their counts), ``file_type``, ``chat_template`` (bool), ``transformers_version``.

    Raises
    ------
    FileNotFoundError
        If ``gguf_path`` does not exist.
    ValueError
        If the file is not GGUF, or transformers cannot load its architecture as a causal LM.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_path} is not a GGUF file (no GGUF magic bytes)")
    tensor_types = _gguf_tensor_types(gguf_path)
    folder, fname = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    plain = _plain_copy(quantized)
    del quantized
    plain.eval()
    out_dir = Path(out_dir)
    plain.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(out_dir)
    gen = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    gen.save_pretrained(out_dir)
    return {
        "architecture": type(plain).__name__,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "tensor_types": tensor_types,
        "dtype": "float32 (dequantized)",
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "transformers_version": transformers.__version__,
    }


def _plain_copy(quantized):
    """A model of the same class and config as ``quantized`` that *shares* its (dequantized) tensors.

    Built on the meta device and filled with ``load_state_dict(assign=True)``, so the conversion holds one copy of the
    weights (a 1.5 B model: 6 GB fp32, not 12). Non-persistent buffers (RoPE frequencies) are taken from ``quantized``
    and tied weights are tied again.

    Raises
    ------
    ValueError
        If the state dict does not match the class (a key missing or unexpected), or a tensor is left unset.
    """
    with torch.device("meta"):
        plain = type(quantized)(quantized.config)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False, assign=True)
    tied = set(getattr(plain, "_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"GGUF state dict does not match {type(plain).__name__}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    source = dict(quantized.named_buffers())
    for name, buf in list(plain.named_buffers()):
        if buf.is_meta:
            module, _, attr = name.rpartition(".")
            plain.get_submodule(module)._buffers[attr] = source[name]
    plain.tie_weights()
    left = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"GGUF conversion left {left[:5]} of {type(plain).__name__} unset")
    return plain


def _gguf_tensor_types(path: Path) -> dict:
    """Counts of the GGUF tensor (quantization) types in the file, e.g. ``{"Q4_1": 210, "F32": 61, "Q8_0": 1}``."""
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - a dependency of mmaccel
        raise ValueError("reading GGUF needs the `gguf` package: pip install gguf") from exc
    reader = gguf.GGUFReader(str(path))
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))
