"""Token plans: which tokens survive a reduction and what each survivor absorbs, computed once, applied many times.

A :class:`TokenPlan` is the ``merge``/``unmerge`` idea of ToMe (Bolya et al., "Token Merging: Your ViT But Faster",
2023, arXiv 2210.09461, ``tome/merge.py``) written as data: for a sequence of ``L`` tokens it holds

- ``index`` [B, K]: the original position of each output token, ascending (a token's *representative*), and
- ``assign`` [B, L]: the output slot each input token goes to (``-1`` = dropped), with optional merge ``weight``.

Pruning is a plan whose every slot has one source; merging is a plan whose slots average several sources. The same
plan is applied to hidden states (:meth:`TokenPlan.merge`), token sizes (:meth:`TokenPlan.merge_weights`), position
ids of any layout (1-D, ``[B, L]`` and Qwen2-VL's 3-D / 4-D M-RoPE ``[n, B, L]``, :meth:`TokenPlan.take_positions`),
rotary tables and 2-D / 4-D attention masks. A merged token keeps the position of its representative, so kept tokens
keep their original positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TokenPlan"]


def _rank(keep: torch.Tensor) -> torch.Tensor:
    """[B, L] bool -> [B, L] long: the output slot of each kept token (its rank among the kept ones)."""
    return keep.long().cumsum(dim=1) - 1


@dataclass
class TokenPlan:
    """A reduction of ``L`` tokens to ``K`` per row, computed once and applied to every per-token tensor.

    Attributes
    ----------
    index : torch.Tensor
        [B, K] long, ascending: the original position of every output token (its representative).
    assign : torch.Tensor or None
        [B, L] long in ``[-1, K)``: the output slot of every input token; ``-1`` drops it. ``None`` means a pure
        keep plan (every output token is exactly its representative).
    weight : torch.Tensor or None
        [B, L] float >= 0: merge weights (ToMe's token sizes, an attention score...); ``None`` = all ones.
    length : int
        ``L``, the number of input tokens.

    Raises
    ------
    ValueError
        From the constructors, if rows keep different numbers of tokens (a plan is rectangular) or shapes disagree.
    """

    index: torch.Tensor
    length: int
    assign: torch.Tensor | None = None
    weight: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------------ constructors
    @classmethod
    def identity(cls, batch: int, length: int, device=None) -> TokenPlan:
        """Keep all ``length`` tokens of ``batch`` rows."""
        return cls(index=torch.arange(length, device=device).expand(batch, length).clone(), length=length)

    @classmethod
    def from_keep(cls, keep: torch.Tensor) -> TokenPlan:
        """A pruning plan from a [B, L] bool mask of kept tokens.

        Raises
        ------
        ValueError
            If rows keep different numbers of tokens.
        """
        counts = keep.sum(dim=1)
        if keep.shape[0] and not bool((counts == counts[0]).all()):
            raise ValueError(f"every row must keep the same number of tokens; got {counts.tolist()}")
        k = int(counts[0]) if keep.shape[0] else 0
        positions = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
        index = positions[keep].reshape(keep.shape[0], k)
        return cls(index=index, length=keep.shape[1])

    @classmethod
    def from_representatives(cls, rep: torch.Tensor, weight: torch.Tensor | None = None) -> TokenPlan:
        """A merge plan from each token's representative.

        Parameters
        ----------
        rep : torch.Tensor
            [B, L] long: the original position of the token each input token merges into; a token with
            ``rep[b, i] == i`` is kept (it is a representative); ``-1`` drops the token. A representative must be
            its own representative.
        weight : torch.Tensor, optional
            [B, L] merge weights.

        Raises
        ------
        ValueError
            If rows keep different numbers of tokens or a token points at a non-representative.
        """
        B, L = rep.shape
        positions = torch.arange(L, device=rep.device).expand(B, L)
        keep = rep == positions
        plan = cls.from_keep(keep)
        target = rep.clamp(min=0)
        if not bool(keep.gather(1, target)[rep >= 0].all()):
            raise ValueError("a token merges into a position that is not a representative")
        merged_any = bool(((rep >= 0) & ~keep).any())
        if merged_any or weight is not None:
            slot = _rank(keep).gather(1, target)
            plan.assign = torch.where(rep >= 0, slot, torch.full_like(slot, -1))
            plan.weight = weight
        return plan

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def batch(self) -> int:
        return self.index.shape[0]

    @property
    def num_kept(self) -> int:
        """``K``, the number of output tokens per row."""
        return self.index.shape[1]

    def slot_of(self) -> torch.Tensor:
        """[B, L] long: the output slot of every input token, ``-1`` for dropped tokens."""
        if self.assign is not None:
            return self.assign
        slot = torch.full((self.batch, self.length), -1, dtype=torch.long, device=self.index.device)
        slot.scatter_(1, self.index, torch.arange(self.num_kept, device=self.index.device).expand_as(self.index))
        return slot

    def sources(self) -> torch.Tensor:
        """[B, K] long: how many input tokens each output token holds (1 for a pure keep plan)."""
        if self.assign is None:
            return torch.ones_like(self.index)
        valid = self.assign >= 0
        out = torch.zeros(self.batch, self.num_kept, dtype=torch.long, device=self.index.device)
        return out.scatter_add_(1, self.assign.clamp(min=0), valid.long())

    def is_identity(self) -> bool:
        """True if the plan keeps every token unchanged."""
        return self.num_kept == self.length and (self.assign is None or bool((self.sources() == 1).all()))

    # ---------------------------------------------------------------------------------------------- application
    def _index_for(self, x: torch.Tensor, batch_dim: int, seq_dim: int) -> torch.Tensor:
        index = self.index
        if x.shape[batch_dim] == 1 and self.batch > 1:
            shape = list(x.shape)
            shape[batch_dim] = self.batch
            x = x.expand(*shape)
        elif x.shape[batch_dim] != self.batch:
            raise ValueError(f"batch {x.shape[batch_dim]} does not match the plan's {self.batch}")
        if x.shape[seq_dim] != self.length:
            raise ValueError(f"sequence length {x.shape[seq_dim]} does not match the plan's {self.length}")
        view = [1] * x.dim()
        view[batch_dim], view[seq_dim] = self.batch, self.num_kept
        expand = list(x.shape)
        expand[seq_dim] = self.num_kept
        return x, index.view(view).expand(expand)

    def take(self, x: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        """Gather the representatives of a [B, L, ...] tensor (batch 1 broadcasts): [B, K, ...].

        Use for anything that is not averaged: position ids, rotary tables (cos/sin [B, L, D]), masks.
        """
        x, idx = self._index_for(x, 0, seq_dim)
        return x.gather(seq_dim, idx)

    def take_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Position ids of the output tokens, any layout.

        Parameters
        ----------
        position_ids : torch.Tensor
            [L], [b, L] (b = 1 or B) or [n, b, L] (Qwen2-VL's 3-D M-RoPE ids, or 4-D with the text row first).

        Returns
        -------
        torch.Tensor
            [B, K] or [n, B, K]: the original positions of the representatives (never renumbered).
        """
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids.dim() == 2:
            return self.take(position_ids, seq_dim=1)
        if position_ids.dim() == 3:
            x, idx = self._index_for(position_ids, 1, 2)
            return x.gather(2, idx)
        raise ValueError(f"position_ids must be [L], [B, L] or [n, B, L]; got {tuple(position_ids.shape)}")

    def take_mask4d(self, mask: torch.Tensor) -> torch.Tensor:
        """A [b, h, q, kv] additive or boolean mask: rows (if ``q == L``) and the first ``L`` key columns are reduced.

        Key columns after the first ``L`` (tokens generated after the reduced prefix) are kept as they are.
        """
        if mask.shape[-2] == self.length:
            x, idx = self._index_for(mask, 0, 2)
            mask = x.gather(2, idx)
        return self.extend_columns(mask)

    def extend_columns(self, mask: torch.Tensor) -> torch.Tensor:
        """Reduce the first ``L`` entries of the last dim of a [b, ..., L + t] mask: returns [B, ..., K + t]."""
        head, tail = mask[..., : self.length], mask[..., self.length:]
        seq_dim = mask.dim() - 1
        x, idx = self._index_for(head, 0, seq_dim)
        head = x.gather(seq_dim, idx)
        if tail.shape[0] != head.shape[0]:
            tail = tail.expand(head.shape[0], *tail.shape[1:])
        return torch.cat([head, tail], dim=-1)

    def merge(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce [B, L, D] hidden states to [B, K, D].

        A slot with one source is that token, bit for bit; a slot with several sources is their weighted mean
        (ToMe's size-weighted average when ``weight`` is the token sizes).

        Parameters
        ----------
        x : torch.Tensor
            [B, L, D].
        weight : torch.Tensor, optional
            [B, L] weights; default the plan's ``weight``, else ones.
        """
        if self.assign is None:
            return self.take(x)
        B, L, D = x.shape
        w = weight if weight is not None else self.weight
        valid = self.assign >= 0
        w = valid.to(x.dtype) if w is None else w.to(x.dtype) * valid
        slot = self.assign.clamp(min=0)
        num = torch.zeros(B, self.num_kept, D, dtype=x.dtype, device=x.device)
        num.scatter_add_(1, slot[..., None].expand(B, L, D), x * w[..., None])
        den = torch.zeros(B, self.num_kept, dtype=x.dtype, device=x.device).scatter_add_(1, slot, w)
        merged = num / den.clamp_min(torch.finfo(x.dtype).tiny)[..., None]
        return torch.where((self.sources() > 1)[..., None], merged, self.take(x))

    def merge_weights(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Sum [B, L] weights (token sizes) into their slots: [B, K]. ``None`` counts the sources."""
        if weight is None:
            return self.sources().float()
        if self.assign is None:
            return self.take(weight)
        valid = self.assign >= 0
        out = torch.zeros(self.batch, self.num_kept, dtype=weight.dtype, device=weight.device)
        return out.scatter_add_(1, self.assign.clamp(min=0), weight * valid)

    def then(self, other: TokenPlan) -> TokenPlan:
        """The plan that applies ``self`` and then ``other`` (ToMe's source tracking): maps the original ``L``
        tokens straight to ``other``'s ``K`` outputs. Weights are not carried (pass sizes to :meth:`merge`)."""
        if other.length != self.num_kept:
            raise ValueError(f"cannot chain a plan to {self.num_kept} tokens with a plan from {other.length}")
        slot1 = self.slot_of()
        slot2 = other.slot_of()
        final = torch.where(slot1 >= 0, slot2.gather(1, slot1.clamp(min=0)), torch.full_like(slot1, -1))
        index = self.index.gather(1, other.index)
        return TokenPlan(index=index, length=self.length, assign=final)
