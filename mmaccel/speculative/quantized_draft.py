"""A draft model with int8 weights: its ``nn.Linear`` layers quantized dynamically (weights int8 per output channel,
activations quantized per call), through PyTorch's own ``torch.ao.quantization.quantize_dynamic`` (fbgemm/x86).

PyTorch marks ``torch.ao.quantization`` deprecated in favour of torchao, whose eager int8 layers were slower than
float32 on this project's 2-core CPU (no ``torch.compile``): the fbgemm path is kept while PyTorch ships it, and a
build without it is refused with that reason.

Speculative decoding stays lossless with any draft: the target verifies every token (Leviathan et al., "Fast
Inference from Transformers via Speculative Decoding", 2023, arXiv 2211.17192), so a cheaper, slightly different
draft changes the acceptance rate and the cost of a draft token, never the output. Quantized drafts as a way to cut
that cost: e.g. "QSpec", Zhao et al., 2024, arXiv 2410.11305 (int4 activations for drafting, weights shared).
"""
from __future__ import annotations

import copy
import warnings
import weakref

import torch

#: the supported ``quantize=`` schemes of draft models.
SCHEMES = ("int8",)

_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # float model -> its quantized copy
_QUANTIZED: weakref.WeakSet = weakref.WeakSet()  # the copies made here


def check_scheme(scheme, owner: str) -> None:
    """Refuse a ``quantize=`` value that is not ``None`` or one of :data:`SCHEMES`.

    Raises
    ------
    ValueError
        Naming the valid values, e.g. ``draft:quantize=int8``.
    """
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"{owner}: quantize must be one of {', '.join(SCHEMES)} (or left out), got {scheme!r}; "
                         f"e.g. {owner}:quantize=int8")


def quantized_draft(model, scheme: str | None, owner: str = "draft"):
    """``model`` with int8 dynamic-quantized ``nn.Linear`` layers (LM head included), made once per model object
    and shared by every method that asks (``draft:quantize=int8`` beside ``hf_assisted:quantize=int8`` run the
    same int8 weights). ``scheme=None`` returns ``model``; a copy made here is returned as it is.

    The copy keeps the config, generation config and embeddings (float32); its linear weights are int8 with one
    float scale per output channel (measured draft costs: RESULTS.md, the Qwen2.5-Coder pair).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A float32 model on the CPU.
    scheme : {"int8"} or None
    owner : str
        The spec name used in error messages.

    Returns
    -------
    torch.nn.Module
        The quantized copy (``model`` itself is left unchanged).

    Raises
    ------
    ValueError
        An unknown scheme; a model that is not float32 or not on the CPU (the int8 kernels are fbgemm's, CPU only);
        a PyTorch build without a CPU quantization engine.
    """
    check_scheme(scheme, owner)
    if scheme is None or model in _QUANTIZED:
        return model
    if model in _COPIES:
        return _COPIES[model]
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise ValueError(f"{owner}:quantize=int8 needs a float32 draft on the CPU (PyTorch's int8 kernels are "
                         f"CPU-only), got {p.dtype} on {p.device}; load in float32 on the CPU or leave quantize out")
    engines = torch.backends.quantized.supported_engines
    if not {"x86", "fbgemm"} & set(engines):
        raise ValueError(f"{owner}:quantize=int8: this PyTorch build has no CPU quantization engine (x86/fbgemm; "
                         f"has {engines}); leave quantize out")
    try:
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    except ImportError as e:
        raise ValueError(f"{owner}:quantize=int8: this PyTorch has no torch.ao.quantization.quantize_dynamic ({e}); "
                         f"leave quantize out") from e
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(deprecated|quantized tensor creation).*")  # the choice above
        q = quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    q.eval()
    _COPIES[model] = q
    _QUANTIZED.add(q)
    return q
