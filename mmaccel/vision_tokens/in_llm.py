"""In-LLM pruning: layers ``>= K`` of the language model see the reduced sequence; their rotary tables, position
ids and 4-D masks are reduced by the same plan, at prefill and at every decode step (:class:`LayerPruner`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .adapters import VLMParts, _attach_outer, _even_rows, _past_length, _RunState
from .base import VisionTokenMethod, _hook, kept_count
from .plan import TokenPlan

__all__ = ["LayerPruner"]


@dataclass
class LayerPruner(VisionTokenMethod):
    """In-LLM pruning at decoder layer ``layer``: a subclass scores the sequence at layer ``layer - 1``
    (:meth:`score`) and the base keeps all text tokens plus the top ``keep_ratio`` of each row's image tokens
    (every placeholder token, AnyRes newline tokens included). Rows with different numbers of image tokens (AnyRes
    images of different sizes) keep ``keep_ratio`` of their own and are evened out by dropping padding.

    ``telemetry``: ``image_tokens_before`` / ``image_tokens_after`` (row 0; per row in ``rows_image_tokens_before``
    / ``rows_image_tokens_after``), ``sequence_before`` / ``sequence_after``, ``kept_positions`` [B, K].

    Parameters
    ----------
    layer : int
        ``K``: layers ``0..K-1`` see all tokens, layers ``K..`` the kept ones. ``1 <= K < num_layers``.
    """

    layer: int = 2
    stage: ClassVar[str] = "in-llm"

    def supports(self, model: nn.Module) -> str | None:
        parts = VLMParts.find(model)
        if isinstance(parts, str):
            return parts
        n = len(parts.lm.layers)
        if not isinstance(self.layer, int) or not 1 <= self.layer < n:
            return f"layer must be an int in [1, {n - 1}] for a {n}-layer language model, got {self.layer!r}"
        attn = parts.lm.layers[self.layer - 1].self_attn
        if not (hasattr(attn, "q_proj") and hasattr(attn, "k_proj") and hasattr(attn, "head_dim")):
            return "its decoder attention has no q_proj/k_proj/head_dim"
        return None

    def score(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Scores [B, L] (higher = keep) from RoPE'd ``queries`` [B, Hq, W, D] (last W positions) and ``keys``
        [B, Hkv, L, D] of layer ``K - 1``."""
        raise NotImplementedError

    def _attach(self, model: nn.Module, undo: list) -> None:
        parts = VLMParts.find(model)
        state = _RunState()
        _attach_outer(parts, state, undo)
        layers = parts.lm.layers
        K = self.layer

        def lm_pre(module, args, kwargs):
            if state.pending is not None and kwargs.get("inputs_embeds") is not None:
                state.scratch = {"phase": "prefill", "lm": module, "attention_mask": kwargs.get("attention_mask"),
                                 **state.pending}
                state.pending = None
                state.plan = None
            elif state.plan is not None and _past_length(kwargs) > 0:
                state.scratch["phase"] = "decode"
            else:
                state.scratch = {"phase": "off"}

        _hook(undo, parts.lm, lm_pre, pre=True)

        def capture(module, args, kwargs):  # self_attn of layer K-1, before it runs
            if state.scratch.get("phase") == "prefill":
                state.scratch["attn_in"] = kwargs.get("hidden_states", args[0] if args else None)
                state.scratch["rope"] = kwargs.get("position_embeddings")

        _hook(undo, layers[K - 1].self_attn, capture, pre=True)
        attn = layers[K - 1].self_attn

        def layer_pre(index):
            def pre(module, args, kwargs):
                phase = state.scratch.get("phase")
                if phase == "prefill":
                    if index == K:
                        state.plan = self._build_plan(attn, state)
                    plan = state.plan
                    args, kwargs = _reduce_layer_inputs(plan, args, kwargs, state.scratch, index == K)
                elif phase == "decode":
                    mask = kwargs.get("attention_mask")
                    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
                        kwargs["attention_mask"] = state.plan.extend_columns(mask)
                return args, kwargs
            return pre

        for i in range(K, len(layers)):
            _hook(undo, layers[i], layer_pre(i), pre=True)

    def _build_plan(self, attn: nn.Module, state: _RunState) -> TokenPlan:
        hidden = state.scratch.pop("attn_in")
        cos, sin = state.scratch.pop("rope")
        B, L, _ = hidden.shape
        d = attn.head_dim
        W = min(int(getattr(self, "window", 1)), L)
        q = attn.q_proj(hidden[:, L - W:]).view(B, W, -1, d).transpose(1, 2)
        k = attn.k_proj(hidden).view(B, L, -1, d).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = _rope(q, cos[:, L - W:], sin[:, L - W:])
        k = _rope(k, cos, sin)
        scores = self.score(q, k)  # [B, L]
        image_mask = state.scratch["image_mask"]
        reduced = getattr(state.scratch["lm"], "_mmaccel_visual_mask", None)  # a pre-LLM method ran before us
        if image_mask.shape[1] != L and reduced is not None and reduced.shape == (B, L):
            image_mask = reduced
        if image_mask.shape[1] != L:
            raise ValueError(f"{type(self).__name__}: the language model got {L} tokens for a {image_mask.shape[1]}-"
                             "token prompt and no record of which are visual")
        counts = image_mask.sum(dim=1).tolist()
        n_keep = [kept_count(n, self.keep_ratio) if n else 0 for n in counts]
        masked = scores.float().masked_fill(~image_mask, float("-inf"))
        keep = ~image_mask
        for b in range(B):
            keep[b, masked[b].topk(n_keep[b]).indices] = True
        keep = _even_rows(keep, _padding(state.scratch, B, L))
        plan = TokenPlan.from_keep(keep)
        self.telemetry = {"method": self.name, "stage": self.stage, "layer": self.layer,
                          "image_tokens_before": counts[0] if B else 0, "image_tokens_after": n_keep[0] if B else 0,
                          "rows_image_tokens_before": counts, "rows_image_tokens_after": n_keep,
                          "sequence_before": L, "sequence_after": plan.num_kept,
                          "kept_positions": plan.index.tolist()}
        return plan


def _padding(scratch: dict, B: int, L: int) -> torch.Tensor | None:
    """[B, L] bool padding tokens of the sequence the language model runs on (its 2-D mask, or the reduced mask a
    pre-LLM method handed on), or ``None`` if unknown or there is no 2-D mask."""
    for mask in (scratch.get("attention_mask"), getattr(scratch.get("lm"), "_mmaccel_attention_mask", None)):
        if isinstance(mask, torch.Tensor) and mask.shape == (B, L):
            return mask == 0
    return None


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [B, H, L, D], cos/sin [b, L, D]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _reduce_layer_inputs(plan: TokenPlan, args: tuple, kwargs: dict, scratch: dict, first: bool):
    """Reduce a decoder layer's inputs at prefill: hidden states (at the first reduced layer), rotary tables,
    position ids and a 4-D mask; the reduced kwargs are computed once and reused by the later layers."""
    if first:
        if args:
            args = (plan.take(args[0]),) + tuple(args[1:])
        else:
            kwargs["hidden_states"] = plan.take(kwargs["hidden_states"])
    cached = scratch.setdefault("reduced", {})
    for key in ("position_embeddings", "position_ids", "attention_mask"):
        value = kwargs.get(key)
        if value is None:
            continue
        if key not in cached or cached[key][0] is not value:
            if key == "position_embeddings":
                new = tuple(plan.take(t) for t in value)
            elif key == "position_ids":
                new = plan.take_positions(value)
            elif isinstance(value, torch.Tensor) and value.dim() == 4:
                new = plan.take_mask4d(value)
            else:
                raise ValueError("in-LLM pruning needs a 4-D attention mask or none (SDPA/eager); got another kind")
            cached[key] = (value, new)
        kwargs[key] = cached[key][1]
    return args, kwargs
