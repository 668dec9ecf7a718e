"""ToMe: bipartite soft matching inside a ViT, size-weighted merging and proportional attention."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..models.parts import vit_layers
from .adapters import VLMParts, _cls_layer, _score_module, _tower_has_cls
from .base import ImageGrid, VisionTokenMethod, kept_count
from .plan import TokenPlan
from .pre_llm import ImageReducer

__all__ = ["ToMe", "bipartite_soft_matching", "parse_schedule", "tome_plan"]


def bipartite_soft_matching(metric: torch.Tensor, r: int, protected: int = 0) -> TokenPlan:
    """ToMe's bipartite soft matching (Bolya et al., "Token Merging: Your ViT But Faster", 2023, arXiv 2210.09461).

    Tokens alternate into sets A (even positions) and B (odd); each A token's most similar B token (cosine of
    ``metric``) is its edge; the ``r`` strongest edges are merged (A into B).

    Parameters
    ----------
    metric : torch.Tensor
        [B, N, C] similarity features (ToMe: the keys averaged over heads).
    r : int
        Tokens to remove, ``>= 0``; clamped to ``(N - protected) // 2``.
    protected : int
        Leading tokens never merged ([CLS], registers).

    Returns
    -------
    TokenPlan
        Over N tokens, ``N - r`` outputs in original order; apply it to the tokens with their sizes as weights.

    Raises
    ------
    ValueError
        If ``r < 0``.
    """
    if r < 0:
        raise ValueError(f"r must be >= 0, got {r}")
    B, N, _ = metric.shape
    r = min(r, max(0, (N - protected) // 2))
    if r == 0:
        return TokenPlan.identity(B, N, metric.device)
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a_pos = torch.arange(0, N, 2, device=metric.device)
    b_pos = torch.arange(1, N, 2, device=metric.device)
    scores = metric[:, a_pos] @ metric[:, b_pos].transpose(-1, -2)  # [B, Na, Nb]
    scores[:, a_pos < protected, :] = -math.inf
    scores[:, :, b_pos < protected] = -math.inf
    node_max, node_idx = scores.max(dim=-1)  # [B, Na]
    src = node_max.argsort(dim=-1, descending=True)[:, :r]  # A tokens merged away
    dst = node_idx.gather(1, src)
    rep = torch.arange(N, device=metric.device).expand(B, N).clone()
    rep.scatter_(1, a_pos[src], b_pos[dst])
    return TokenPlan.from_representatives(rep)


def tome_plan(keys: torch.Tensor, keep: int) -> TokenPlan:
    """ToMe on one image's tokens at once: rounds of :func:`bipartite_soft_matching` (each merges at most half of
    the tokens) until ``keep`` are left; each round matches on the size-weighted mean keys of the groups so far.

    Parameters
    ----------
    keys : torch.Tensor
        [N, d] keys (mean over heads) of the tokens.
    keep : int
        Output tokens, ``1 <= keep``; ``keep >= N`` keeps every token.

    Returns
    -------
    TokenPlan
        Batch 1 over N, ``min(keep, N)`` outputs; a merged token is the mean of its source tokens (ToMe's size
        weighting).
    """
    n = keys.shape[0]
    plan = TokenPlan.identity(1, n, keys.device)
    metric, size = keys.float()[None], torch.ones(1, n, device=keys.device)
    while plan.num_kept > max(keep, 1):
        step = bipartite_soft_matching(metric, plan.num_kept - keep)
        metric, size = step.merge(metric, size), step.merge_weights(size)
        plan = plan.then(step)
    return plan


def parse_schedule(schedule: Any) -> list[int]:
    """A per-layer r schedule from a list of ints or a string ``"8,8,4"`` / ``"8-8-4"``.

    Raises
    ------
    ValueError
        If an entry is not an int >= 0.
    """
    if isinstance(schedule, str):
        parts = [p for p in schedule.replace("-", ",").replace(" ", "").split(",") if p]
        try:
            schedule = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"schedule must be per-layer ints like '8,8,4', got {schedule!r}") from None
    if isinstance(schedule, int) and not isinstance(schedule, bool):
        schedule = [schedule]
    if not isinstance(schedule, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in schedule):
        raise ValueError(f"schedule must be a list of ints >= 0 (one r per layer), got {schedule!r}")
    return list(schedule)


@dataclass
class _BlockParts:
    norm1: nn.Module
    attn: nn.Module
    ls1: nn.Module
    norm2: nn.Module
    mlp: nn.Module
    ls2: nn.Module
    heads: int


class _MHAAdapter:
    """open_clip's ``nn.MultiheadAttention`` (batch first, packed in-projection) called like a HF attention module:
    ``(hidden_states, attention_mask) -> (out, None)``, with SDPA and an additive mask for proportional attention.
    Hands its keys [B, N, D] to ``on_keys`` when ``need_keys``. Without a mask and keys it calls the module itself."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        self.mha, self.on_keys, self.need_keys = mha, None, False
        self.num_heads = mha.num_heads

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        mha = self.mha
        if attention_mask is None and not self.need_keys:
            return mha(hidden_states, hidden_states, hidden_states, need_weights=False)[0], None
        B, N, D = hidden_states.shape
        q, k, v = F.linear(hidden_states, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
        if self.on_keys is not None:
            self.on_keys(k)
        q, k, v = (t.reshape(B, N, mha.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return mha.out_proj(out.transpose(1, 2).reshape(B, N, D)), None


def _block_parts(block: nn.Module) -> _BlockParts | None:
    """The pre-norm pieces of a ViT block, by attribute: HF ``Dinov2Layer``, CLIP/SigLIP ``EncoderLayer``, open_clip
    ``ResidualAttentionBlock`` (batch-first self-attention)."""
    mha = getattr(block, "attn", None)
    if isinstance(mha, nn.MultiheadAttention):
        if not (mha.batch_first and mha._qkv_same_embed_dim) or hasattr(block, "ln_1_kv"):
            return None
        return _BlockParts(block.ln_1, _MHAAdapter(mha), block.ls_1, block.ln_2, block.mlp, block.ls_2, mha.num_heads)
    norm1 = getattr(block, "norm1", None) or getattr(block, "layer_norm1", None)
    norm2 = getattr(block, "norm2", None) or getattr(block, "layer_norm2", None)
    attn = getattr(block, "attention", None) or getattr(block, "self_attn", None)
    mlp = getattr(block, "mlp", None)
    if None in (norm1, norm2, attn, mlp) or not hasattr(attn, "k_proj"):
        return None
    heads = getattr(attn, "num_attention_heads", None) or getattr(attn, "num_heads", None)
    return _BlockParts(norm1, attn, getattr(block, "layer_scale1", nn.Identity()), norm2, mlp,
                       getattr(block, "layer_scale2", nn.Identity()), int(heads))


@dataclass
class _ToMeState:
    method: ToMe
    parts: list
    prefix: int
    schedule: list[int] = field(default_factory=list)
    size: torch.Tensor | None = None
    source: TokenPlan | None = None
    keys: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    tokens_in: int = 0
    unmerge: bool = False  # inside a VLM: the last patched block hands back all N tokens (copies of merged ones)


def _tome_forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
    """A ToMe block: attention with proportional attention (``+ log(size)`` on the logits), merge, then MLP."""
    state, idx = self._tome_state, self._tome_index
    if attention_mask is None:  # open_clip calls its blocks with attn_mask=
        attention_mask = kwargs.pop("attn_mask", None)
    if idx == 0:
        state.method._start(state, hidden_states)
    p = state.parts[idx]
    r = state.schedule[idx] if idx < len(state.schedule) else 0
    if isinstance(p.attn, _MHAAdapter):
        p.attn.need_keys = r > 0
    x = hidden_states
    mask = attention_mask
    if state.method.prop_attn and state.size is not None:
        bias = state.size.log()[:, None, None, :].to(x.dtype)
        mask = bias if mask is None else mask + bias
    h, _ = p.attn(hidden_states=p.norm1(x), attention_mask=mask, **kwargs)
    x = x + p.ls1(h)
    if r > 0:
        B, N, _ = x.shape
        metric = state.keys.view(B, N, p.heads, -1).mean(dim=2)
        plan = bipartite_soft_matching(metric, r, state.prefix)
        size = state.size if state.size is not None else torch.ones(B, N, dtype=x.dtype, device=x.device)
        x = plan.merge(x, size)
        state.size = plan.merge_weights(size)
        state.source = plan if state.source is None else state.source.then(plan)
    state.tokens.append(x.shape[1])
    x = x + p.ls2(p.mlp(p.norm2(x)))
    if idx == len(state.parts) - 1:
        state.method._finish(state)
        if state.unmerge and state.source is not None:  # ToMe's unmerge: every source token gets its slot's value
            slot = state.source.slot_of()
            x = x.gather(1, slot[..., None].expand(*slot.shape, x.shape[-1]))
    return x


_CLASSES: dict[type, type] = {}


def _tome_class(cls: type) -> type:
    """A subclass of one block class whose ``forward`` merges; assigned to one instance's blocks, never globally."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ToMe{cls.__name__}", (cls,), {"forward": _tome_forward})
    return _CLASSES[cls]


@dataclass
class ToMe(VisionTokenMethod):
    """ToMe (Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023, arXiv 2210.09461) inside a ViT.

    In every block, between attention and MLP, ``r`` tokens are merged by bipartite soft matching on the keys
    (averaged over heads); merged tokens are size-weighted averages, and attention adds ``log(size)`` to the logits
    (proportional attention, as an additive mask, so SDPA still runs). The [CLS] token (and registers) are never
    merged. Works on HF ``Dinov2Model``, ``CLIPVisionModel``, ``SiglipVisionModel``, open_clip ViTs (a ``CLIP`` model
    or its ``.visual``; batch-first ``nn.MultiheadAttention``, run through SDPA once sizes differ) and LLaVA-style VLMs
    by swapping ``__class__`` on the blocks of *one* instance, restored on exit (ToMe's ``apply_patch``, reversible).

    The schedule is data: give one of ``r`` (the same r in every block), ``schedule`` (one r per block, e.g.
    ``"16,16,8,8,0,0"``; missing blocks get 0) or ``keep_ratio`` (the fraction of patch tokens left after the last
    block, spread evenly over the blocks; each block can remove at most half of its mergeable tokens).

    Parameters
    ----------
    keep_ratio : float
        In (0, 1]; used when neither ``r`` nor ``schedule`` is given. 1.0 merges nothing.
    r : int, optional
        Tokens removed per block.
    schedule : list of int or str, optional
        Tokens removed per block.
    prop_attn : bool
        Proportional attention (ToMe's default for off-the-shelf models).

    Attributes
    ----------
    telemetry : dict
        ``schedule``, ``tokens_per_layer`` (after each block's merge), ``tokens_before``, ``tokens_after``.
    last_source : TokenPlan or None
        Where every input token ended up in the last forward (ToMe's source map), for unmerging or visualising.

    Raises
    ------
    ValueError
        If ``keep_ratio`` is outside (0, 1], ``r < 0``, a schedule entry is not an int >= 0, or ``r``/``schedule``
        are combined with each other or with ``keep_ratio < 1``; at run time if the schedule is longer than the model.
    UnsupportedModelError
        From ``apply`` on a model that is neither a HF ViT with pre-norm blocks nor a supported VLM; on an AnyRes or
        Qwen2-VL model given ``r`` or ``schedule`` (per-block counts of the tower).

    Notes
    -----
    On a LLaVA-style model ToMe merges in the tower blocks up to the one LLaVA projects (``vision_feature_layer``),
    unmerges there (every patch gets its group's value, ToMe's ``unmerge``), so LLaVA's projector and placeholders
    see N tokens, and the language model then gets one token per group, at the group's representative position.
    The tower saves compute; the projector runs on N copies (cheap); the LLM sees the reduced count.

    AnyRes models (LLaVA-NeXT, LLaVA-OneVision) unpad and resample the crops' tokens after the tower, and a Qwen2-VL
    tower attends within images (windows, in Qwen2.5-VL) and merges 2 x 2 groups after its blocks, so a merge inside
    their towers would not survive to the language model. There ToMe runs between the projector and the LLM instead,
    on each grid (base image, crops, Qwen2-VL image) at once (:func:`tome_plan`): bipartite soft matching on the keys
    of the tower layer the pre-LLM methods score (:func:`~.adapters._attach_tower_scores`: the layer LLaVA projects;
    Qwen2-VL's last full-attention block, keys averaged over each merged 2 x 2 group, after the tower's RoPE) until
    ``keep_ratio`` of the tokens are left; merged tokens are the means of their sources, at the position of the
    group's representative. A LLaVA-1.5-style model whose tower has no [CLS] token (read from its embeddings) is
    treated the same way. ToMe ranks by similarity alone and reads no [CLS] or other dominance score: on these towers
    no token is protected (ToMe protects [CLS] only where there is one). The tower saves no compute there.
    """

    r: int | None = None
    schedule: str | None = None  # also a list of ints
    prop_attn: bool = True
    last_source: TokenPlan | None = field(default=None, init=False, repr=False, compare=False)

    name: ClassVar[str] = "tome"
    stage: ClassVar[str] = "vision"
    paper: ClassVar[str] = "Bolya et al., 2023, arXiv 2210.09461"

    def __post_init__(self) -> None:
        super().__post_init__()
        given = [n for n, v in (("r", self.r), ("schedule", self.schedule)) if v is not None]
        if self.keep_ratio < 1.0:
            given.append("keep_ratio")
        if len(given) > 1:
            raise ValueError(f"give one of r, schedule or keep_ratio < 1, not {' and '.join(given)}")
        if self.r is not None and (isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 0):
            raise ValueError(f"r must be an int >= 0, got {self.r!r}")
        if self.schedule is not None:
            self.schedule = parse_schedule(self.schedule)

    def supports(self, model: nn.Module) -> str | None:
        parts = VLMParts.find(model)
        if not isinstance(parts, str):
            if _merges_before_llm(parts):
                if self.r is not None or self.schedule is not None:
                    return ("on AnyRes and Qwen2-VL models ToMe merges between the projector and the LLM (their towers "
                            "unpad, resample or window the tokens): give keep_ratio, not r or schedule; per-block "
                            "schedules: LLaVA-1.5-style models and bare ViTs")
                reason = _score_module(parts)
                return reason if isinstance(reason, str) else None
            index = _cls_layer(parts)
            if isinstance(index, str):
                return index
            if parts.inner.config.vision_feature_select_strategy != "default":
                return "ToMe in a VLM needs vision_feature_select_strategy='default'"
            model = parts.tower
        layers = vit_layers(model)
        if layers is None or not len(layers):
            return "it has no ViT encoder blocks (encoder.layer / encoder.layers)"
        if any(_block_parts(b) is None for b in layers):
            return "its blocks are not pre-norm ViT blocks (norm, attention with k_proj or a batch-first " \
                   "nn.MultiheadAttention, mlp)"
        if self.schedule is not None and len(self.schedule) > len(layers):
            return f"schedule has {len(self.schedule)} entries for {len(layers)} blocks"
        return None

    def _attach(self, model: nn.Module, undo: list) -> None:
        parts = VLMParts.find(model)
        if isinstance(parts, str):
            self._attach_tower(model, vit_layers(model), undo)
            return
        if _merges_before_llm(parts):
            _GridToMe(keep_ratio=self.keep_ratio, owner=self)._attach(model, undo)
            return
        # a LLaVA-style VLM: merge in the blocks up to the projected one, hand LLaVA all N tokens back (copies), and
        # let the language model see one token per merged group (the copies are identical, so this is exact)
        blocks = vit_layers(parts.tower)[: _cls_layer(parts) + 1]
        state = self._attach_tower(parts.tower, blocks, undo)
        state.unmerge = True
        _SourceMapReducer(owner=self, state=state)._attach(model, undo)

    def _attach_tower(self, model: nn.Module, layers, undo: list) -> _ToMeState:
        config = getattr(model, "config", None)
        embeddings = getattr(model, "embeddings", None) or getattr(getattr(model, "vision_model", None),
                                                                     "embeddings", None)
        visual = getattr(model, "visual", model)  # open_clip keeps class_embedding on its VisionTransformer
        has_cls = any(hasattr(obj, "cls_token") or getattr(obj, "class_embedding", None) is not None
                      for obj in (embeddings, visual) if obj is not None)
        prefix = int(has_cls) + int(getattr(config, "num_register_tokens", 0) or 0)
        state = _ToMeState(method=self, parts=[_block_parts(b) for b in layers], prefix=prefix)
        for i, block in enumerate(layers):
            original = type(block)
            block.__class__ = _tome_class(original)
            block._tome_state, block._tome_index = state, i

            def restore(block=block, original=original):
                block.__class__ = original
                del block._tome_state, block._tome_index

            undo.append(restore)

            attn = state.parts[i].attn
            if isinstance(attn, _MHAAdapter):
                attn.on_keys = lambda k: setattr(state, "keys", k)
                continue

            def keep_keys(module, args, output):
                state.keys = output

            handle = attn.k_proj.register_forward_hook(keep_keys)
            undo.append(handle.remove)
        return state

    def resolve_schedule(self, tokens: int, blocks: int, prefix: int = 0) -> list[int]:
        """The per-block r for ``tokens`` input tokens (``prefix`` of them protected) and ``blocks`` blocks."""
        if self.schedule is not None:
            return list(self.schedule) + [0] * (blocks - len(self.schedule))
        if self.r is not None:
            return [self.r] * blocks
        mergeable = tokens - prefix
        total = mergeable - kept_count(mergeable, self.keep_ratio)
        return [total // blocks + (1 if i < total % blocks else 0) for i in range(blocks)]

    def _start(self, state: _ToMeState, hidden: torch.Tensor) -> None:
        state.size, state.source, state.keys, state.tokens = None, None, None, []
        state.schedule = self.resolve_schedule(hidden.shape[1], len(state.parts), state.prefix)
        state.tokens_in = hidden.shape[1]

    def _finish(self, state: _ToMeState) -> None:
        self.last_source = state.source
        self.telemetry = {"method": self.name, "stage": self.stage, "schedule": list(state.schedule),
                          "tokens_before": state.tokens_in, "tokens_per_layer": list(state.tokens),
                          "tokens_after": state.tokens[-1] if state.tokens else state.tokens_in}


def _merges_before_llm(parts: VLMParts) -> bool:
    """Whether ToMe runs between projector and LLM on this VLM (AnyRes, Qwen2-VL, a tower without [CLS]) rather
    than in its tower."""
    return parts.kind != "llava" or not _tower_has_cls(parts.tower)


@dataclass
class _OwnedReducer(ImageReducer):
    """A pre-LLM reducer run on behalf of a :class:`ToMe` (``owner``), whose telemetry it fills."""

    owner: Any = None
    name: ClassVar[str] = "tome"

    def _sequence_plan(self, pending, embeds, state):
        plan = super()._sequence_plan(pending, embeds, state)
        self.owner.telemetry.update({k: v for k, v in self.telemetry.items() if k not in ("method", "stage")})
        return plan


@dataclass
class _GridToMe(_OwnedReducer):
    """ToMe between projector and LLM on AnyRes and Qwen2-VL models (:func:`tome_plan` on each grid's tower keys).
    Internal to :class:`ToMe`."""

    needs_tower_scores: ClassVar[bool] = True

    def plan_image(self, features: torch.Tensor, grid: ImageGrid, info: dict) -> TokenPlan:
        return tome_plan(info["keys"], kept_count(features.shape[0], self.keep_ratio))

    def _sequence_plan(self, pending, embeds, state):
        self.owner.telemetry = {"method": self.owner.name, "stage": "pre-llm"}
        return super()._sequence_plan(pending, embeds, state)


@dataclass
class _SourceMapReducer(_OwnedReducer):
    """ToMe inside a LLaVA tower, seen from the language model: one token per merged group of the projected
    layer (the group's representative position), from the tower's source map. Internal to :class:`ToMe`."""

    state: Any = None

    def plan_image(self, features: torch.Tensor, grid: ImageGrid, info: dict) -> TokenPlan:
        source = self.state.source
        n = features.shape[0]
        if source is None:
            return TokenPlan.identity(1, n, features.device)
        k = info["image_index"]
        rep = source.index[k][source.slot_of()[k]]  # [1 + N] original position of each token's representative
        return TokenPlan.from_representatives((rep[1:] - 1)[None])  # drop [CLS] (the "default" strategy does)
