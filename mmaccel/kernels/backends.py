"""Backend availability and the ``backend="auto"`` choice, decided once for every kernel family.

Backends
--------
``"flash"``
    flash-attn (Dao, 2023, "FlashAttention-2", arXiv 2307.08691), only when the package is installed and a CUDA
    device holds the tensors. Never required.
``"flex"``
    PyTorch FlexAttention with a ``BlockMask`` (Dong et al., 2024, "Flex Attention", arXiv 2412.05496). Compiled on
    CUDA; on the CPU it runs eagerly under ``torch.no_grad()`` (correct, but it materialises the score matrix).
``"triton"``
    The Triton kernels in :mod:`mmaccel.kernels.triton_kernels`. On CUDA they are compiled; on the CPU they only run
    through the interpreter (``TRITON_INTERPRET=1``), which is for correctness tests, never for speed.
``"sdpa"``
    ``torch.nn.functional.scaled_dot_product_attention`` (dense functions only).
``"reference"``
    Plain PyTorch, fp32 arithmetic. For sparse prefill it still skips blocks, so it is the fast path on the CPU.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("auto", "flash", "flex", "triton", "sdpa", "reference")


@functools.cache
def _find(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def has_flash_attn(device: torch.device | None = None) -> bool:
    """Whether flash-attn can run here: the package is installed and the device (default: any) is CUDA."""
    if not _find("flash_attn") or not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


def has_flex() -> bool:
    """Whether ``torch.nn.attention.flex_attention`` is importable (torch >= 2.5)."""
    return _find("torch.nn.attention.flex_attention")


def triton_interpreted() -> bool:
    """Whether Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def has_triton(device: torch.device | None = None) -> bool:
    """Whether the Triton kernels can launch on ``device``: compiled on CUDA, interpreted on the CPU."""
    if not _find("triton"):
        return False
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return kind == "cuda" or (kind == "cpu" and triton_interpreted())


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends that can run on ``device``, fastest first (what ``"auto"`` chooses from)."""
    dev = torch.device(device)
    names = []
    if has_flash_attn(dev):
        names.append("flash")
    if dev.type == "cuda":
        names += [n for n, ok in (("flex", has_flex()), ("triton", has_triton(dev))) if ok]
    names.append("sdpa")
    names.append("reference")
    if dev.type != "cuda":  # slow but correct paths on the CPU: never picked by "auto"
        names += [n for n, ok in (("flex", has_flex()), ("triton", has_triton(dev))) if ok]
    return names


def resolve_backend(backend: str, device: torch.device, supported: tuple[str, ...], op: str) -> str:
    """Turn ``backend`` into a concrete backend that ``op`` supports on ``device``.

    Parameters
    ----------
    backend : str
        One of :data:`BACKENDS`.
    device : torch.device
        Where the tensors live.
    supported : tuple of str
        The backends ``op`` implements, in its own order of preference for ``"auto"``.
    op : str
        Function name, used in error messages.

    Returns
    -------
    str
        The backend to run. ``"auto"`` picks the first of ``supported`` that is available and real on the device:
        on the CPU it never picks the Triton interpreter or eager FlexAttention.

    Raises
    ------
    ValueError
        If ``backend`` is unknown or ``op`` does not implement it.
    RuntimeError
        If an explicitly requested backend cannot run on ``device``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} for {op}; choose from {BACKENDS}")
    if backend == "auto":
        usable = available_backends(device)
        if device.type != "cuda":
            usable = [n for n in usable if n not in ("flex", "triton")]
        for name in supported:
            if name in usable:
                return name
        return "reference"
    if backend not in supported:
        raise ValueError(f"{op} has no {backend!r} backend; it supports {supported}")
    if backend == "flash" and not has_flash_attn(device):
        raise RuntimeError(f"{op}: backend 'flash' needs flash-attn installed and CUDA tensors")
    if backend == "flex" and not has_flex():
        raise RuntimeError(f"{op}: backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
    if backend == "triton" and not has_triton(device):
        raise RuntimeError(
            f"{op}: backend 'triton' needs triton and CUDA tensors, or TRITON_INTERPRET=1 set before import on the CPU"
        )
    return backend
