"""Prepacked oneDNN linear layers for CPU inference, so that a forward of a few tokens costs what one token does.

On x86 CPUs PyTorch's default ``nn.Linear`` runs a forward of 2-4 tokens as that many matrix-vector products: on
``smollm2-135m`` (fp32, 2 cores, a 500-token cache) one step of 2 tokens costs 1.7x a step of 1 and 3 tokens 2.0x,
which is most of what a speculative verification costs on a CPU. oneDNN's matmul on a weight reordered once into its
blocked layout (what ``torch.compile``'s CPU backend does when it freezes weights) reads each weight once for all of
them: 1.0x for 2-5 tokens, 1.3x for 9, and the one-token step itself 1.2x faster (measured in
``benchmarks/results/speculative/smollm2_packed_linear/``).
"""
from __future__ import annotations

import torch
from torch import nn


def packed_linear_available() -> bool:
    """Whether this PyTorch build has the oneDNN (mkldnn) linear ops :class:`PackedLinear` needs."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    try:
        return callable(ops._reorder_linear_weight) and callable(ops._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """One ``nn.Linear`` with its weight reordered once into oneDNN's blocked layout (CPU, float32, inference only).

    Parameters
    ----------
    linear : nn.Linear
        The layer to pack; its weight [out, in] must be a float32 CPU tensor. It is kept (``original``) so that
        :class:`PackedLinears` can put it back; the packed copy adds the weight's bytes (``out * in * 4``) of memory.

    Notes
    -----
    ``forward``: ``x`` [..., in] float32 -> [..., out]. Equal to ``linear(x)`` up to float32 rounding (the summation
    order differs: max abs difference about 1e-4 on ``smollm2-135m``'s logits). No autograd.

    Raises
    ------
    ValueError
        If the layer is not float32 on the CPU, or this PyTorch has no oneDNN linear ops.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(f"PackedLinear packs float32 CPU layers, got {weight.dtype} on {weight.device}; load the "
                             "model with --device cpu --dtype float32, or leave packing off")
        if not packed_linear_available():
            raise ValueError("this PyTorch build has no oneDNN (mkldnn) linear ops; leave packing off")
        self.original = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    @property
    def weight(self) -> torch.Tensor:
        """The original [out, in] weight (read by code that slices an LM head, e.g. the EAGLE drafter)."""
        return self.original.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedLinears:
    """Swap every ``nn.Linear`` of some model instances for a :class:`PackedLinear`, and put them back on exit.

    >>> with PackedLinears(model):
    ...     out = model.generate(**inputs)

    Only this instance changes (its modules are replaced in their parents; no class is patched). Tied weights (an LM
    head tied to the embeddings) are packed as a copy; the embeddings stay as they are.

    Parameters
    ----------
    *models : nn.Module
        Float32 models on the CPU (e.g. a target and its draft); a module reachable twice is packed once.

    Attributes
    ----------
    count : int
        Linear layers packed.
    packed_bytes : int
        Memory the packed copies add (bytes): 4 * the packed weights' elements.

    Raises
    ------
    ValueError
        On entry, as :class:`PackedLinear` raises; nothing is swapped then.
    """

    def __init__(self, *models: nn.Module):
        self.models = models
        self.count = 0
        self.packed_bytes = 0
        self._swapped: list[tuple[nn.Module, str, nn.Linear]] = []

    def __enter__(self) -> PackedLinears:  # noqa: PYI034 - Python 3.10 has no typing.Self
        seen, targets = set(), []
        for model in self.models:
            for parent in model.modules():
                for name, child in parent.named_children():
                    if type(child) is nn.Linear and id(child) not in seen:
                        seen.add(id(child))
                        targets.append((parent, name, child))
        packed = [PackedLinear(child) for _, _, child in targets]  # raises before anything is swapped
        for (parent, name, child), new in zip(targets, packed):
            setattr(parent, name, new)
            self._swapped.append((parent, name, child))
        self.count = len(packed)
        self.packed_bytes = sum(child.weight.numel() * 4 for _, _, child in targets)
        return self

    def restore(self) -> None:
        """Put the original layers back (idempotent)."""
        while self._swapped:
            parent, name, child = self._swapped.pop()
            setattr(parent, name, child)

    def __exit__(self, *exc) -> None:
        self.restore()
