"""AdaKV: a head-wise budget wrapper over any scorer; a layer's slots go to the KV heads whose scores need them.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference", 2024,
arXiv 2407.11550.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import attention
from ..kernels.dense import causal_mask
from .base import EvictingLayer, KVScorer, LayerStep, append_slots
from .owned import AttentionOwningLayer, OwnedAttentionCache
from .wrapper import ScorerWrapper


def adakv_keep_indices(scores: torch.Tensor, keep: int, alpha: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaKV's head-wise allocation: the layer's ``keep * Hkv`` slots go to the best scores over all its KV heads.

    Each head first gets its ``floor(alpha * keep)`` best slots (AdaKV's safeguard), then the rest of the layer's
    budget goes to the best remaining scores of any head.

    Parameters
    ----------
    scores : torch.Tensor
        [B, Hkv, S] float, higher = keep (``inf`` = always, ``-inf`` = never); comparable across heads (e.g.
        attention probabilities, as SnapKV's).
    keep : int
        Mean slots per KV head, ``1 <= keep <= S``.
    alpha : float
        Safeguard fraction in [0, 1].

    Returns
    -------
    (torch.LongTensor, torch.BoolTensor)
        ``indices`` [B, Hkv, K] and ``valid`` [B, Hkv, K], ``K`` = the most slots any head of any row got. Per head,
        the valid indices come first, ascending; padding repeats the head's last valid index (or 0) and is invalid.
        ``valid.sum(-1).sum(-1) == keep * Hkv`` for every row.

    Raises
    ------
    ValueError
        If ``keep`` is outside ``[1, S]`` or ``alpha`` outside [0, 1].
    """
    B, H, S = scores.shape
    if not 1 <= keep <= S or not 0 <= alpha <= 1:
        raise ValueError(f"adakv: cannot keep {keep} of {S} slots per head with alpha={alpha}")
    total = keep * H
    floor = math.floor(alpha * keep)
    chosen = torch.zeros(B, H, S, dtype=torch.bool, device=scores.device)
    if floor:
        chosen.scatter_(2, scores.topk(floor, dim=-1).indices, True)
    rest = total - floor * H
    if rest:
        flat = scores.masked_fill(chosen, float("-inf")).reshape(B, H * S)
        top = flat.topk(rest, dim=-1).indices
        chosen.view(B, H * S).scatter_(1, top, True)
    return chosen_keep_indices(chosen)


def chosen_keep_indices(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and KV head, the slots marked in ``chosen`` as padded index lists for :meth:`EvictingLayer.keep`.

    Parameters
    ----------
    chosen : torch.BoolTensor
        [B, Hkv, S] the slots to keep; heads may keep different numbers.

    Returns
    -------
    (torch.LongTensor, torch.BoolTensor)
        ``indices`` [B, Hkv, K] and ``valid`` [B, Hkv, K], ``K`` = the most slots any head keeps (at least 1). Per
        head, the chosen indices come first, ascending; padding repeats the head's last chosen index (or 0) and is
        invalid.
    """
    B, H, S = chosen.shape
    counts = chosen.sum(-1)  # [B, H]
    width = max(1, int(counts.max()))
    order = torch.arange(S, device=chosen.device).expand(B, H, S)
    # chosen slots first (ascending), then the rest: sort by (not chosen, index)
    ranked = torch.argsort((~chosen).long() * S + order, dim=-1)[..., :width]
    valid = torch.arange(width, device=chosen.device) < counts[..., None]
    last = ranked.gather(2, (counts - 1).clamp(min=0)[..., None])
    return torch.where(valid, ranked, last), valid


def ragged_telemetry(cache) -> dict:
    """Slot counts of a cache's :class:`RaggedLayer` s: ``kept_tokens_per_layer`` (mean real slots per KV head, row
    0), ``evicted_tokens`` (seen - kept, summed over layers), ``valid_tokens_per_head`` ([layer][KV head] real slots
    of row 0) and ``padding_fraction`` (padded slots / held slots: 0 once the heads are stored apart; > 0 only for a
    layer still rectangular with invalid slots)."""
    layers = [l for l in getattr(cache, "layers", []) if isinstance(l, RaggedLayer) and l.is_initialized]
    counts = [l.valid_counts() for l in layers]
    real = sum(int(c.sum()) for c in counts)
    held = real + sum(c.numel() * l.held - int(c.sum()) for c, l in zip(counts, layers) if not l.ragged)
    kept = [round(float(c[0].float().mean()), 3) for c in counts]
    seen = [l.cumulative_length for l in layers]
    return {"kept_tokens_per_layer": kept, "evicted_tokens": round(sum(s - k for s, k in zip(seen, kept)), 3),
            "valid_tokens_per_head": [c[0].tolist() for c in counts],
            "padding_fraction": (held - real) / held if held else 0.0}


class RaggedLayer(EvictingLayer, AttentionOwningLayer):
    """An :class:`~mmaccel.longctx.base.EvictingLayer` whose KV heads hold different numbers of tokens, unpadded.

    Two states:

    - *rectangular* (before the first head-wise eviction, and while a compression runs): the base's [B, Hkv, S, D]
      K/V, positions and per-slot state, with a per-slot state ``"valid"`` ([B, Hkv, S] bool) marking real slots;
      :meth:`attend` masks invalid slots per head.
    - *ragged* (:meth:`pack`, after an eviction left heads of unequal length): one segment per row and KV head,
      ``[1, 1, n_bh, D]`` K/V (and ``[1, 1, n_bh]`` positions and per-slot state) in its own growable buffer
      (:func:`~mmaccel.longctx.base.append_slots`: a decode token is written into spare room, 1/32 of the held
      slots, instead of copying the segment); ``keys``/``values`` are then empty [B, Hkv, 0, D] markers. Only
      the kept slots (plus that spare room) are held, and :func:`~mmaccel.longctx.base.kv_cache_bytes` counts the
      segments' buffers (:meth:`kv_tensors`).

    A decode token appends to every segment; :meth:`attend` runs one attention per segment (the head's query group
    over its own slots). A multi-token forward (a later prefill chunk) and any re-compression first return to the
    rectangular state (:meth:`unpack`: heads padded to the widest, padding repeating the head's last real slot and
    marked invalid), so scorers see the usual [B, Hkv, S] layout.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.segments: dict[str, list[torch.Tensor]] | None = None  # "k", "v", "p", "state:NAME" -> [B * Hkv]
        self._segment_stores: dict[str, list] = {}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.add_slot_state("valid", fill=True, dtype=torch.bool)

    # ------------------------------------------------------------------ state changes
    @property
    def ragged(self) -> bool:
        """Whether the layer holds per-head segments (see the class)."""
        return self.segments is not None

    def pack(self) -> None:
        """Rectangular -> ragged, keeping only the valid slots of each row and KV head (a no-op when every slot is
        valid: equal heads stay one [B, Hkv, S, D] tensor, or when already ragged)."""
        if self.ragged or not self.is_initialized:
            return
        valid = self.slot_state["valid"]
        if bool(valid.all()):
            return
        B, H = valid.shape[:2]
        fields = {"k": self.keys, "v": self.values, "p": self.positions,
                  **{"state:" + n: t for n, t in self.slot_state.items() if n != "valid"}}
        self.segments = {name: [t[b, h][valid[b, h]][None, None] for b in range(B) for h in range(H)]
                         for name, t in fields.items()}
        self._segment_stores = {name: [None] * (B * H) for name in self.segments}
        self.keys, self.values = self.keys[:, :, :0].clone(), self.values[:, :, :0].clone()  # empty markers
        self.positions = self.positions[:, :, :0].clone()
        self.slot_state = {n: t[:, :, :0].clone() for n, t in self.slot_state.items()}
        self._stores = {}

    def unpack(self) -> None:
        """Ragged -> rectangular: heads padded to the widest, padding repeating the head's last real slot (zeros
        for an empty head) and marked invalid in ``slot_state["valid"]``. A no-op when rectangular."""
        if not self.ragged:
            return
        counts = self.valid_counts()
        B, H = counts.shape
        width = max(1, int(counts.max()))
        slots = torch.arange(width, device=counts.device)

        def padded(pieces):
            rows = []
            for (b, h), piece in zip(((b, h) for b in range(B) for h in range(H)), pieces):
                n = int(counts[b, h])
                piece = piece[0, 0]
                if n == 0:
                    rows.append(piece.new_zeros(width, *piece.shape[1:]))
                else:
                    rows.append(piece.index_select(0, slots.clamp(max=n - 1)))
            return torch.stack(rows).view(B, H, width, *rows[0].shape[1:])

        segments, self.segments, self._segment_stores = self.segments, None, {}
        self.keys, self.values, self.positions = (padded(segments[n]) for n in ("k", "v", "p"))
        self.slot_state = {n[len("state:"):]: padded(t) for n, t in segments.items() if n.startswith("state:")}
        self.slot_state["valid"] = slots < counts[..., None]
        self._stores = {}

    # ------------------------------------------------------------------ cache protocol
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append [B, Hkv, q, D] K/V: into every head's segment when ragged and ``q == 1``; otherwise (after
        :meth:`unpack`) as the base does."""
        if not self.ragged or key_states.shape[2] != 1:
            self.unpack()
            return super().update(key_states, value_states, *args, **kwargs)
        B, H = key_states.shape[:2]
        new = {"k": key_states, "v": value_states,
               "p": torch.full((B, H, 1), self.cumulative_length, dtype=torch.long, device=key_states.device)}
        for name in self.segments:
            if name.startswith("state:"):
                fill, dtype = self._fills[name[len("state:"):]]
                new[name] = torch.full((B, H, 1), fill, dtype=dtype, device=key_states.device)
        for name, pieces in self.segments.items():
            stores, value = self._segment_stores[name], new[name]
            for i in range(B * H):
                stores[i], pieces[i] = append_slots(stores[i], pieces[i], value[i // H, i % H][None, None])
        self.cumulative_length += 1
        return self.keys, self.values

    def attend(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        B, Hq, q = query.shape[:3]
        if self.ragged:  # one decode token: each KV head's query group over the head's own slots
            H = len(self.segments["k"]) // B
            g = Hq // H
            keys, values = self.segments["k"], self.segments["v"]
            parts = [attention(query[b:b + 1, h * g:(h + 1) * g], keys[b * H + h], values[b * H + h], causal=True,
                               scaling=scaling) for b in range(B) for h in range(H)]
            return torch.cat(parts, dim=1).view(B, Hq, q, -1)
        valid = self.slot_state["valid"]
        if bool(valid.all()):
            return attention(query, self.keys, self.values, causal=True, scaling=scaling)
        allowed = valid.repeat_interleave(Hq // valid.shape[1], dim=1)[:, :, None, :]  # [B, Hq, 1, K]
        if q > 1:
            allowed = allowed & causal_mask(q, valid.shape[-1], valid.device)
        return attention(query, self.keys, self.values, causal=False, attention_mask=allowed, scaling=scaling)

    @property
    def held(self) -> int:
        """Slots of the widest head (the rectangular width when rectangular)."""
        return int(self.valid_counts().max()) if self.ragged else super().held

    def valid_counts(self) -> torch.Tensor:
        """int64 [B, Hkv] real slots per row and KV head."""
        if self.ragged:
            B, H = self.keys.shape[:2]
            return torch.tensor([p.shape[2] for p in self.segments["p"]], dtype=torch.long).view(B, H)
        return self.slot_state["valid"].sum(-1)

    def head_positions(self) -> list[list[torch.Tensor]]:
        """[B][Hkv] int64 [n_bh] sequence positions of each head's real slots, in slot order."""
        B, H = self.keys.shape[:2]
        if self.ragged:
            return [[self.segments["p"][b * H + h][0, 0] for h in range(H)] for b in range(B)]
        valid = self.slot_state["valid"]
        return [[self.positions[b, h][valid[b, h]] for h in range(H)] for b in range(B)]

    def kv_tensors(self) -> list[torch.Tensor]:
        """The K/V held: each segment (its buffer counts) when ragged, else ``keys`` and ``values``."""
        if self.ragged:
            return [*self.segments["k"], *self.segments["v"]]
        return [self.keys, self.values]

    def bookkeeping_tensors(self) -> list[torch.Tensor]:
        if self.ragged:
            return [t for name, pieces in self.segments.items() if name not in ("k", "v") for t in pieces]
        return super().bookkeeping_tensors()

    def reset(self) -> None:
        super().reset()
        self.segments, self._segment_stores = None, {}


@dataclass(init=False)
class AdaKV(ScorerWrapper):
    """AdaKV (Feng et al., 2024, arXiv 2407.11550): head-wise budgets over any scorer, ``AdaKV(SnapKV(...))``.

    The wrapped scorer scores the held slots as usual ([B, Hkv, S]); instead of ``budget`` slots per KV head, each
    layer keeps its ``budget * Hkv`` best-scored slots over all its KV heads (each head first gets
    ``floor(alpha * budget)``, AdaKV's safeguard): :func:`adakv_keep_indices`. Heads whose attention is spread get
    more slots, peaked heads fewer. Each KV head then holds only its own slots, unpadded (:class:`RaggedLayer`:
    one segment per row and KV head), so ``kv_cache_bytes`` is the kept slots' bytes (plus the 1/32 spare room
    every growable cache layer keeps for decode tokens), the same as a uniform budget's at the same ``budget``.
    Decode tokens append to every head; attention runs per KV head over its segment.

    Parameters
    ----------
    method : KVScorer or str
        The wrapped scorer or its spec with commas for colons (``adakv:method=snapkv,budget=256``). Its budget,
        ratio, layer budgets (PyramidKV), decode-time eviction (H2O) and minimum budget are used.
    alpha : float
        Safeguard fraction in [0, 1] (default 0.2, as in AdaKV).
    budget, ratio
        Taken from the wrapped scorer; if given they must equal its own.

    Notes
    -----
    Scores must be comparable across heads (attention probabilities are: SnapKV, PyramidKV, H2O, TOVA). A second
    compression (a later prefill chunk, or every decode step under H2O/StreamingLLM) pads the heads back to one
    [B, Hkv, S] layout for the scorer (:meth:`RaggedLayer.unpack`, then :meth:`RaggedLayer.pack`; a copy of the
    layer per step for scorers that evict while decoding): padding slots score ``-inf``, but attention-based
    scorers normalise over them (they repeat a real slot), a small distortion. Padded batches raise, as for the wrapped methods. Works with ``generate(prefill_chunk_size=C)`` and under the ``Chunked`` wrapper.

    Raises
    ------
    ValueError
        If ``method`` is not a scorer, ``alpha`` is out of range, or budget/ratio disagree with the scorer's.
    """

    alpha: float = 0.2

    method_name = "adakv"

    def __init__(self, method: object = "snapkv", alpha: float = 0.2, budget: int | None = None,
                 ratio: float | None = None):
        self.method, self.alpha, self.budget, self.ratio = method, alpha, budget, ratio
        self.__post_init__()

    def __post_init__(self):
        self.resolve()
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
            raise ValueError(f"adakv: alpha must be in [0, 1], got {self.alpha!r}; e.g. adakv:alpha=0.2")

    def own_spec(self) -> str:
        return f":alpha={self.alpha}"

    def make_layer(self, layer_idx: int) -> RaggedLayer:
        return RaggedLayer()

    def make_cache(self, model: torch.nn.Module) -> OwnedAttentionCache:
        """A fresh cache for one ``generate`` run of ``model`` (close it, or use ``with``, when done)."""
        return OwnedAttentionCache(model, self)

    def score(self, step: LayerStep) -> torch.Tensor:
        scores = self.method.score(step).float()
        return scores.masked_fill(~step.layer.slot_state["valid"], float("-inf"))

    def on_step(self, step: LayerStep) -> None:
        """The base's step on the rectangular layout, then :meth:`RaggedLayer.pack`. A decode step of a scorer
        that neither observes nor evicts while decoding (SnapKV, PyramidKV, KNorm) leaves the segments as they are."""
        layer = step.layer
        observes = type(self.method).observe is not KVScorer.observe
        if layer.ragged and step.phase == "decode" and not (self.evicts_on_decode or observes):
            return
        layer.unpack()
        super().on_step(step)
        layer.pack()

    def compress(self, step: LayerStep, keep: int) -> None:
        """Keep the layer's ``keep * Hkv`` best slots over its KV heads (see the class); marks the rest invalid
        (:meth:`on_step` then packs the heads apart)."""
        layer = step.layer
        if int(layer.valid_counts().sum(-1).max()) <= keep * step.num_kv_heads:
            return  # wider than the budget only through padding: nothing to evict
        scores = self.score(step)
        indices, valid = adakv_keep_indices(scores, min(keep, scores.shape[-1]), self.alpha)
        layer.keep(indices)
        layer.slot_state["valid"] = valid

    def telemetry(self, cache) -> dict:
        """The base telemetry with ``kept_tokens_per_layer`` = mean real slots per KV head (row 0) and
        ``evicted_tokens`` from it, plus ``valid_tokens_per_head`` ([layer][KV head] real slots of row 0) and
        ``padding_fraction`` (padded slots / held slots: 0 once the heads are stored apart; > 0 only for a layer
        still rectangular with invalid slots)."""
        out = super().telemetry(cache)
        out.update(spec=self.spec, method=self.name, inner_method=self.method.spec, **ragged_telemetry(cache))
        return out
