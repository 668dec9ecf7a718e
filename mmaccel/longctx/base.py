"""Shared mechanics of the KV-cache methods: cache layer, lifecycle hooks, scorer contract, top-k keep, bytes.

A KV-cache method is a small dataclass that says only what is new about it; everything that touches transformers'
``Cache`` or the model lives here once (the design of kvpress's ``ScorerPress``, Jegou et al., 2024):

- :class:`EvictingLayer` -- a ``DynamicLayer`` that remembers the true sequence index of every slot it holds, carries
  named per-slot state (e.g. H2O's accumulated attention) and keeps a subset of its slots per KV head
  (:meth:`EvictingLayer.keep`), really freeing the dropped K/V.
- :class:`KVMethodCache` -- a ``DynamicCache`` whose full-attention layers are :class:`EvictingLayer` s. It attaches
  one forward hook per decoder self-attention module of *one* model instance and calls the method once per layer and
  forward with a :class:`LayerStep` (phase ``"prefill"`` for every multi-token forward, ``"decode"`` for every
  one-token step). The hooks are removed by :meth:`KVMethodCache.close`, when a forward with this cache raises, and
  when the cache is garbage-collected.
- :class:`KVScorer` -- the scorer contract: a method supplies :meth:`KVScorer.score` ([B, Hkv, S] float, higher =
  keep) and optionally :meth:`KVScorer.observe` (per-step state); the base owns the budget (tokens or a kept
  fraction), the top-k, the gather and the cache surgery, at prefill and, for methods that ask, at every decode step.
- :func:`kv_cache_bytes`, :func:`bookkeeping_bytes` -- honest byte accounting, K/V and bookkeeping apart.

Positions and masks
-------------------
Keys are cached after RoPE, so an evicted cache keeps the true positions of what it holds. The new tokens must then
also get their true positions: ``generate`` derives ``position_ids`` from the attention mask and advances them by one
per step, independently of the cache length, and a hand-written loop that omits ``position_ids`` gets them from
``cache.get_seq_length()``, which for an :class:`EvictingLayer` is the number of tokens *seen* (like
``DynamicSlidingWindowLayer``), not the number held. ``get_mask_sizes`` returns ``(held + q_len, seen - held)``, so the
causal mask lets every query see every held slot plus the causal part of its own chunk.

Chunked prefill
---------------
Every multi-token forward on a non-empty cache (``generate(..., prefill_chunk_size=C)``, :class:`~mmaccel.longctx.
chunked.Chunked`, or a second turn) is a prefill step: a prefill-time method compresses the held slots *plus* the new
chunk back to its budget, scored with that chunk's own queries. For SnapKV-like methods "the window" is therefore the
last ``window`` queries of the *current chunk*; for the last chunk it is the last ``window`` prompt tokens, as without
chunking, but the candidates are only what earlier chunks kept.

Batch > 1: rows are compressed independently (per row and per KV head); all rows hold the same number of slots.
With left padding the 2-D padding mask is lined up with the *last* held slots (``get_mask_sizes``' offset), which is
right only when a method keeps a contiguous recent window. So every evicting method refuses padded batches at prefill
with a clear error (:func:`has_padding`), except those that set ``padding_safe`` (a plain sliding window).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from ..kernels.hf import attention_modules, hooked_cache

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------- byte accounting
def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``: a view of a larger tensor counts the whole storage."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return int(sum(seen.values()))


def kv_cache_bytes(cache: Cache) -> int:
    """Bytes of key and value memory a cache actually keeps alive.

    Parameters
    ----------
    cache : transformers.Cache
        Any cache whose layers keep ``.keys``/``.values`` tensors (``DynamicCache``, :class:`KVMethodCache`, ...).

    Returns
    -------
    int
        Bytes of the distinct storages behind every layer's ``keys`` and ``values`` (or what its ``kv_tensors()``
        returns, for layers that store K/V otherwise: two head groups, padded per-head slots, quantized codes). A
        tensor that is a view of a larger one (``DynamicSlidingWindowLayer`` keeps a slice of the concatenated K/V
        until its next update) counts its whole storage, which is what it keeps alive. Uninitialised layers count 0. Bookkeeping (slot positions,
        scores) is not counted here: see :func:`bookkeeping_bytes`.
    """
    tensors = [t for layer in getattr(cache, "layers", []) for t in _kv_tensors(layer)]
    return _storage_bytes(tensors)


def _kv_tensors(layer) -> list:
    """The K/V tensors a layer holds: its ``kv_tensors()`` when it stores more than ``keys``/``values`` (e.g. two
    head groups, padded per-head slots or quantized codes), else ``[keys, values]``."""
    own = getattr(layer, "kv_tensors", None)
    if callable(own):
        return list(own())
    return [getattr(layer, "keys", None), getattr(layer, "values", None)]


def bookkeeping_bytes(cache: Cache) -> int:
    """Bytes of a cache's per-slot bookkeeping: :attr:`EvictingLayer.positions` and its per-slot state.

    Returns
    -------
    int
        Bytes of the distinct storages of every layer's bookkeeping tensors (0 for transformers' own layers); any
        layer with a ``bookkeeping_tensors()`` method contributes what it returns.
    """
    tensors = []
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, EvictingLayer) or callable(getattr(layer, "bookkeeping_tensors", None)):
            tensors.extend(layer.bookkeeping_tensors())
    return _storage_bytes(tensors)


def close_cache(cache) -> None:
    """Close ``cache`` if it has a ``close`` (a :class:`KVMethodCache` removes the hooks it attached to the model);
    a plain transformers cache, or ``None``, is left as it is."""
    close = getattr(cache, "close", None)
    if callable(close):
        close()


def held_tokens(layer) -> int:
    """Number of sequence slots a cache layer holds (0 if uninitialised)."""
    keys = getattr(layer, "keys", None)
    if not isinstance(keys, torch.Tensor) or keys.dim() < 2 or keys.numel() == 0:
        return 0
    return int(keys.shape[-2])


#: spare room a growable layer allocates on growth, as a fraction of what it then holds (see :func:`append_slots`):
#: decode steps write their token in place, and the layer copies its store once per ``held / 32`` steps instead of
#: at every step, for at most 1/32 more bytes (none below 32 slots)
SPARE_FRACTION = 1 / 32


def append_slots(store: torch.Tensor | None, held: torch.Tensor, new: torch.Tensor,
                 spare: float = SPARE_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``new`` to ``held`` along dim 2 in the spare room of ``store``, growing it only when it is full.

    ``DynamicLayer.update`` concatenates, copying every held slot at every decode step (at 4k tokens on a CPU that
    copy moves more bytes than the attention reads). Here ``held`` is a prefix view of ``store`` (dim 2) and ``new``
    is written after it in place; when ``held`` is not such a view (first call, after a gather) or the room is too
    small, a new store of ``S + q + floor(spare * (S + q))`` slots is allocated and ``held`` copied once.

    Parameters
    ----------
    store : torch.Tensor or None
        [B, H, C, ...] the buffer ``held`` may live in (``None``: none yet).
    held : torch.Tensor
        [B, H, S, ...] what the layer holds.
    new : torch.Tensor
        [B, H, q, ...] what to append (cast to ``held``'s dtype).
    spare : float
        Extra room allocated on growth, a fraction of the slots then held (default 1/32; 0: none). It counts in
        :func:`kv_cache_bytes`, which measures storages.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        The store and the new held view [B, H, S + q, ...] (a prefix of the store). Views returned earlier keep
        their content: only slots past them are written.
    """
    if held.dim() != new.dim() or held.numel() == 0:  # nothing held yet (DynamicLayer starts from a 1-D empty)
        held = new[:, :, :0]
    S, q = held.shape[2], new.shape[2]
    fits = (store is not None and held.numel() and held.data_ptr() == store.data_ptr()
            and held.stride() == store.stride() and held.shape[:2] == store.shape[:2]
            and held.shape[3:] == store.shape[3:] and held.dtype == store.dtype and S + q <= store.shape[2])
    if not fits:
        store = held.new_empty(*held.shape[:2], S + q + int(spare * (S + q)), *held.shape[3:])
        store[:, :, :S].copy_(held)
    store[:, :, S:S + q].copy_(new)
    return store, store[:, :, :S + q]


# --------------------------------------------------------------------------------------------------------- padding
def has_padding(attention_mask) -> bool:
    """Whether the mask an attention module received hides any key from the last query (a padded batch).

    Parameters
    ----------
    attention_mask : torch.Tensor, BlockMask or None
        - [B, 1 or H, q, k] boolean (True = attend) or additive float mask (eager, sdpa, mmaccel);
        - [B, k] 0/1 padding mask (flash-attention);
        - a flex-attention ``BlockMask``: its ``mask_mod`` is evaluated on the last query row;
        - ``None`` (an unpadded sdpa/flash batch) counts as unpadded.

    Returns
    -------
    bool

    Raises
    ------
    ValueError
        For a mask it cannot read (another type, or a ``BlockMask`` without a usable ``mask_mod``): rather than
        compress pads silently, the caller refuses.
    """
    if attention_mask is None:
        return False
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dim() == 4:
            last = attention_mask[..., -1, :]
            return bool((~last).any()) if last.dtype == torch.bool else bool((last != 0).any())
        if attention_mask.dim() == 2:
            return bool((attention_mask == 0).any())
        raise ValueError(f"cannot tell padding from a {attention_mask.dim()}-D attention mask")
    mask_mod = getattr(attention_mask, "mask_mod", None)
    shape = getattr(attention_mask, "shape", None)
    if mask_mod is not None and shape is not None and len(shape) == 4:
        B, _, q_len, k_len = (int(s) for s in shape)
        dev = attention_mask.kv_num_blocks.device if hasattr(attention_mask, "kv_num_blocks") else "cpu"
        b = torch.arange(B, device=dev)[:, None]
        h = torch.zeros(1, 1, dtype=torch.long, device=dev)
        q = torch.full((1, 1), q_len - 1, dtype=torch.long, device=dev)
        kv = torch.arange(k_len, device=dev)[None, :]
        try:
            allowed = torch.as_tensor(mask_mod(b, h, q, kv)).expand(B, k_len)
        except Exception as exc:  # a mask_mod that cannot be evaluated on index tensors
            raise ValueError(f"cannot tell padding from this flex BlockMask ({exc}); run unpadded") from exc
        return bool((~allowed.bool()).any())
    raise ValueError(f"cannot tell padding from an attention mask of type {type(attention_mask).__name__}")


# --------------------------------------------------------------------------------------------------- scoring helpers
def mean_over_query_groups(scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Average per-query-head scores [B, Hq, L] within each GQA group, giving [B, Hkv, L]: ``query_group_scores``
    with ``group="mean"`` (see it for the layout and the errors)."""
    return query_group_scores(scores, num_kv_heads, "mean")


GROUP_REDUCTIONS = ("mean", "max")


def check_group(owner: str, group: str) -> None:
    """Raise one clear ``ValueError`` unless ``group`` is one of :data:`GROUP_REDUCTIONS`."""
    if group not in GROUP_REDUCTIONS:
        raise ValueError(f"{owner}: group must be 'mean' or 'max' (how a GQA group's query heads combine), got "
                         f"{group!r}; e.g. {owner}:group=max")


def query_group_scores(scores: torch.Tensor, num_kv_heads: int, group: str = "mean") -> torch.Tensor:
    """Combine per-query-head scores within each GQA group into one score per KV head: their mean or their maximum.

    ``"max"`` keeps a slot that one query head of the group needs even if the others ignore it (the reduction that
    finds the needle more often for Quest's page bounds on smollm2-135m; ``studies/needle_digits/quest_recall.py``).

    Parameters
    ----------
    scores : torch.Tensor
        [B, Hq, L] scores per query head (query head ``h`` belongs to KV head ``h // (Hq // num_kv_heads)``).
    num_kv_heads : int
        Number of key/value heads ``Hkv``.
    group : {"mean", "max"}
        The reduction over a group's query heads.

    Returns
    -------
    torch.Tensor
        [B, Hkv, L], same dtype as ``scores``.

    Raises
    ------
    ValueError
        If ``Hq`` is not a multiple of ``num_kv_heads``, or ``group`` is unknown.
    """
    B, Hq, L = scores.shape
    if Hq % num_kv_heads:
        raise ValueError(f"{Hq} query heads are not a multiple of {num_kv_heads} KV heads")
    check_group("query_group_scores", group)
    grouped = scores.reshape(B, num_kv_heads, Hq // num_kv_heads, L)
    return grouped.amax(dim=2) if group == "max" else grouped.mean(dim=2)


def topk_keep_indices(scores: torch.Tensor, keep: int, *, tail: int = 0) -> torch.Tensor:
    """Indices to keep per KV head: the ``keep`` best-scored slots of the prefix, then the last ``tail`` slots.

    Parameters
    ----------
    scores : torch.Tensor
        [B, Hkv, P] scores of the first ``P`` slots, higher = keep.
    keep : int
        How many prefix slots to keep per row and head, ``0 <= keep <= P``.
    tail : int
        Slots ``P .. P + tail - 1`` that are always kept (e.g. SnapKV's observation window).

    Returns
    -------
    torch.LongTensor
        [B, Hkv, keep + tail] slot indices, ascending (original order is preserved).

    Raises
    ------
    ValueError
        If ``keep`` is outside ``[0, P]`` or ``tail < 0``.
    """
    B, H, P = scores.shape
    if not 0 <= keep <= P or tail < 0:
        raise ValueError(f"cannot keep {keep} of {P} prefix slots (+{tail} tail slots)")
    top = scores.topk(keep, dim=-1).indices.sort(dim=-1).values
    window = torch.arange(P, P + tail, device=scores.device).expand(B, H, tail)
    return torch.cat([top, window], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE helper, HF Llama convention: ``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def project_heads(module: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings, window: int,
                  which: str = "q", projected: torch.Tensor | None = None) -> torch.Tensor:
    """Recompute the post-RoPE queries (``which="q"``) or keys (``"k"``) of the last ``window`` tokens of an attention
    module's input, as the module computes them, reading the variant from the module (never from a model name):

    - separate ``q_proj``/``k_proj``, or one fused ``qkv_proj`` (Phi-3) split at ``num_attention_heads * head_dim``
      and ``num_key_value_heads * head_dim`` (read from the module's config);
    - an optional ``q_norm``/``k_norm`` per head (Qwen3, Gemma 3) or over the whole projection (OLMo2: its weight
      spans ``heads * head_dim``);
    - RoPE in the rotate-half convention on the first ``rotary_dim = cos.shape[-1]`` dimensions (partial RoPE, as
      Phi-3 and GPT-NeoX apply it), or none on a layer whose module has ``use_rope`` false (SmolLM3's
      ``no_rope_layers``).

    Parameters
    ----------
    module : torch.nn.Module
        The ``self_attn`` module whose forward received ``hidden_states``.
    hidden_states : torch.Tensor
        [B, Lq, hidden] the attention input (after the input layer norm).
    position_embeddings : tuple of torch.Tensor
        ``(cos, sin)``, each [B or 1, Lq, rotary_dim], as the model passed them to the module.
    window : int
        Number of trailing tokens, ``1 <= window <= Lq``.
    which : {"q", "k"}
    projected : torch.Tensor, optional
        [B, Lq, out] the output of this forward's ``{which}_proj`` (or fused ``qkv_proj``) when it was captured
        (:class:`KVMethodCache` captures query projections for methods with ``captures_queries``): used instead of
        running the projection again.

    Returns
    -------
    torch.Tensor
        [B, H, window, D] (H = query or key/value heads), in the model's dtype.

    Raises
    ------
    ValueError
        If the module has neither ``q_proj`` nor ``qkv_proj`` or no ``head_dim`` (e.g. GPT-NeoX's fused
        ``query_key_value`` with ``head_size``), got no ``position_embeddings``, or the rotary dimension exceeds
        ``head_dim``. A convention this function does not know (interleaved RoPE) is caught by
        :meth:`LayerStep.queries`, which checks the recomputed keys against the cached ones.
    """
    D = getattr(module, "head_dim", None)
    fused = getattr(module, "qkv_proj", None)
    proj = getattr(module, f"{which}_proj", None)
    if D is None or (proj is None and fused is None) or position_embeddings is None:
        raise ValueError(
            f"{type(module).__name__} has no q_proj (or fused qkv_proj) and head_dim, or got no position_embeddings; "
            "query-scored KV methods need a Llama-style attention module (use streaming or knorm with this model)"
        )
    h = hidden_states[:, -window:]
    B = h.shape[0]
    if proj is not None:
        x = proj(h) if projected is None else projected[:, -window:]
    else:
        config = module.config
        nq, nk = config.num_attention_heads * D, config.num_key_value_heads * D
        x = fused(h) if projected is None else projected[:, -window:]
        x = x[..., :nq] if which == "q" else x[..., nq:nq + nk]
    norm = getattr(module, f"{which}_norm", None)
    whole = norm is not None and getattr(getattr(norm, "weight", None), "shape", (D,))[-1] == x.shape[-1] != D
    if whole:
        x = norm(x)  # OLMo2: one norm over every head of the projection
    x = x.view(B, window, -1, D)
    if norm is not None and not whole:
        x = norm(x)
    x = x.transpose(1, 2)
    if not getattr(module, "use_rope", True):  # SmolLM3's no-RoPE layers
        return x
    cos, sin = position_embeddings
    rot = cos.shape[-1]
    if rot > D:
        raise ValueError(f"rotary dim {rot} > head_dim {D}: an attention layout the query recomputation does not know")
    cos, sin = cos[:, -window:].unsqueeze(1).to(x.dtype), sin[:, -window:].unsqueeze(1).to(x.dtype)
    if rot == D:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]  # partial RoPE: the first rot dims rotate, the rest pass
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


def window_queries(module: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings, window: int,
                   projected: torch.Tensor | None = None):
    """[B, Hq, window, D] post-RoPE queries of the last ``window`` tokens: :func:`project_heads` with ``which="q"``
    (see it for the attention variants handled, ``projected`` and the errors)."""
    return project_heads(module, hidden_states, position_embeddings, window, "q", projected)


def check_recomputed_keys(module: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings,
                          cached_keys: torch.Tensor, owner: str = "query-scored KV methods") -> None:
    """Check that :func:`project_heads` reproduces the keys the model cached for this forward, so that the recomputed
    queries (same projection, norm and RoPE path) are the model's too.

    Parameters
    ----------
    cached_keys : torch.Tensor
        [B, Hkv, w, D] the keys the model computed for the last ``w`` tokens of ``hidden_states``.

    Raises
    ------
    ValueError
        If they differ by more than 1e-2 of their magnitude (an attention variant the recomputation does not know,
        e.g. interleaved RoPE), naming the layer, the gap and the fix.
    """
    w = int(cached_keys.shape[-2])
    keys = project_heads(module, hidden_states, position_embeddings, w, "k").to(cached_keys.dtype)
    gap = float((keys - cached_keys).abs().max()) if keys.shape == cached_keys.shape else float("inf")
    if not gap <= 1e-2 * float(cached_keys.abs().max()) + 1e-5:
        raise ValueError(
            f"{owner}: cannot recompute layer {getattr(module, 'layer_idx', '?')}'s queries for "
            f"{type(module).__name__} (recomputed keys differ from the cached ones by {gap:.3g}: an attention layout "
            "such as interleaved RoPE that mmaccel does not know); use a method that scores keys only (streaming, knorm)"
        )


# ----------------------------------------------------------------------------------------------------- cache layer
class EvictingLayer(DynamicLayer):
    """A ``DynamicLayer`` that can drop slots per KV head while keeping the true positions of what it holds.

    Attributes
    ----------
    keys, values : torch.Tensor
        [B, Hkv, S, D] held K/V (keys after RoPE).
    positions : torch.LongTensor
        [B, Hkv, S] sequence index of every held slot (equal to its RoPE position for unpadded rows).
    slot_state : dict of str to torch.Tensor
        Named per-slot state, each [B, Hkv, S] (e.g. H2O's accumulated attention). Registered with
        :meth:`add_slot_state`; new slots get the registered fill value, :meth:`keep` gathers it with the K/V.
    cumulative_length : int
        Tokens seen so far; this is what :meth:`get_seq_length` returns.
    target : int or None
        The slot budget a method fixed for this layer at its last prefill step (for decode-time eviction).
    prefill_length : int
        Tokens seen at the end of the last prefill step.

    Notes
    -----
    :meth:`update` appends the new K/V and returns them; evictions happen afterwards (from the method's hook, after
    the layer's attention ran), so the tokens of the current forward attend to everything held before it plus their
    own chunk. Evictions cannot be undone, so ``crop`` (assisted decoding) raises, except on a layer of a
    speculative cache (``KVMethod.make_cache(model, speculative=True)``), which sets ``is_croppable`` and may drop
    slots appended after its last eviction (the rejected draft tokens of speculative decoding).
    """

    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cumulative_length = 0
        self.positions: torch.Tensor | None = None
        self.slot_state: dict[str, torch.Tensor] = {}
        self._fills: dict[str, tuple[float, torch.dtype]] = {}
        self.target: int | None = None
        self.prefill_length = 0
        self.evicted_length = 0  # tokens seen at the last keep(): slots appended later can be cropped exactly
        self.free: torch.Tensor | None = None  # [B, Hkv] a dead slot per row and head, overwritten by the next token
        self._stores: dict[str, torch.Tensor] = {}  # growable buffers behind keys/values/positions/state (append_slots)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        B, H = key_states.shape[:2]
        self.positions = torch.empty(B, H, 0, dtype=torch.long, device=key_states.device)

    @property
    def held(self) -> int:
        """Number of slots held (``S``)."""
        return held_tokens(self)

    def add_slot_state(self, name: str, fill: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Register (once) a per-slot state tensor [B, Hkv, S] filled with ``fill``; return it."""
        if name not in self.slot_state:
            self._fills[name] = (fill, dtype)
            shape = tuple(self.positions.shape) if self.positions is not None else (0, 0, 0)
            self.slot_state[name] = torch.full(shape, fill, dtype=dtype, device=self.positions.device)
        return self.slot_state[name]

    def bookkeeping_tensors(self) -> list[torch.Tensor]:
        """The positions and per-slot state tensors (for :func:`bookkeeping_bytes`)."""
        return [t for t in (self.positions, *self.slot_state.values()) if t is not None]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states``/``value_states`` [B, Hkv, q, D] and return the held K/V [B, Hkv, S + q, D].

        With a dead slot marked by :meth:`evict_one`, a one-token update is written into that slot in place instead
        (no copy of the cache; the returned K/V keep their size S, in no particular order); a multi-token update
        first drops the dead slot.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, q = key_states.shape[:3]
        if self.free is not None:
            if q == 1:
                return self._write_free(key_states, value_states)
            self._drop_free()
        new_pos = torch.arange(self.cumulative_length, self.cumulative_length + q, device=self.positions.device)
        stores = self._stores
        # a layer that evicts in place never grows past target + 1 slots: no spare room for it
        spare = 0 if getattr(self, "in_place_ok", False) else SPARE_FRACTION
        stores["k"], self.keys = append_slots(stores.get("k"), self.keys, key_states, spare)
        stores["v"], self.values = append_slots(stores.get("v"), self.values, value_states, spare)
        stores["p"], self.positions = append_slots(stores.get("p"), self.positions, new_pos.expand(B, H, q), spare)
        for name, state in self.slot_state.items():
            fill, _dtype = self._fills[name]
            key = "state:" + name
            stores[key], self.slot_state[name] = append_slots(stores.get(key), state, state.new_full((B, H, q), fill),
                                                              spare)
        self.cumulative_length += q
        return self.keys, self.values

    def evict_one(self, slot: torch.Tensor) -> None:
        """Evict one slot per row and KV head without moving the cache: mark ``slot`` [B, Hkv] dead, to be
        overwritten in place by the next one-token :meth:`update` (decode-time eviction at O(1) copies per step,
        where :meth:`keep` copies every held slot). Until then the dead slot's bytes stay allocated (one slot)."""
        self.free = slot.to(torch.long)

    def _write_free(self, key_states: torch.Tensor, value_states: torch.Tensor):
        idx = self.free[..., None, None].expand(-1, -1, 1, self.keys.shape[-1])
        self.keys.scatter_(2, idx, key_states.to(self.keys.dtype))
        self.values.scatter_(2, idx, value_states.to(self.values.dtype))
        slot = self.free[..., None]
        self.positions.scatter_(2, slot, self.cumulative_length)  # a scalar value: no filled tensor per step
        for name, state in self.slot_state.items():
            state.scatter_(2, slot, self._fills[name][0])
        self.free = None
        self.cumulative_length += 1
        return self.keys, self.values

    def _drop_free(self) -> None:
        """Physically remove the dead slot (before a multi-token update, a crop or a :meth:`keep`)."""
        free, self.free = self.free, None
        S = self.keys.shape[2]
        alive = torch.ones(*free.shape, S, dtype=torch.bool, device=free.device)
        alive.scatter_(2, free[..., None], False)
        order = torch.arange(S, device=free.device).expand_as(alive)
        self.keep(order[alive].view(*free.shape, S - 1))

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the given slots, per row and KV head, and free the rest.

        Parameters
        ----------
        indices : torch.LongTensor
            [B, Hkv, K] or [K] slot indices into the held sequence (ascending keeps the original order). A dead
            slot of :meth:`evict_one` must not be among them; it is forgotten.
        """
        self.free = None
        self._stores = {}  # the gathered tensors below are new: drop the old buffers (their memory is freed)
        if indices.dim() == 1:
            indices = indices.expand(*self.keys.shape[:2], -1)
        gather = indices.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, gather)
        self.values = self.values.gather(2, gather)
        self.positions = self.positions.gather(2, indices)
        for name, state in self.slot_state.items():
            self.slot_state[name] = state.gather(2, indices)
        self.evicted_length = self.cumulative_length

    def get_seq_length(self) -> int:
        """Tokens seen so far (not the number held), so default position ids stay true after eviction."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(held + query_length, seen - held)``: every query sees all held slots and the causal part of its chunk
        (``(held, ...)`` for one token written into a dead slot)."""
        held = self.held
        if self.free is not None and query_length == 1:
            return held, self.cumulative_length + 1 - held
        return held + query_length, self.cumulative_length - held

    def reset(self) -> None:
        super().reset()
        self.positions = None
        self.slot_state.clear()
        self._stores = {}
        self.target = None
        self.prefill_length = 0
        self.evicted_length = 0
        self.free = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens seen (transformers 5's negative count).

        Only on a croppable layer (a speculative cache), and only tokens appended after the last eviction: those
        are the newest held slots of every row and KV head, so dropping them is exact.

        Raises
        ------
        ValueError
            On a layer that is not croppable (an evicting cache outside speculative decoding), for a positive count,
            or when the crop would reach tokens seen before the last eviction.
        """
        if not self.is_croppable:
            raise ValueError(
                f"{type(self).__name__} evicts tokens and cannot be cropped (e.g. by assisted/speculative decoding); "
                "use the 'full' KV-cache method there, or a prefill-only method's make_cache(model, speculative=True)"
            )
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        n = -int(tokens_to_remove)
        if n == 0 or not self.is_initialized:
            return
        if self.free is not None:
            self._drop_free()
        if self.cumulative_length - n < self.evicted_length:
            raise ValueError(
                f"cannot crop {n} tokens: the cache has seen {self.cumulative_length} and evicted slots among its first "
                f"{self.evicted_length}, which a crop cannot restore"
            )
        self.keys, self.values = self.keys[..., :-n, :], self.values[..., :-n, :]
        self.positions = self.positions[..., :-n]
        for name, state in self.slot_state.items():
            self.slot_state[name] = state[..., :-n]
        self.cumulative_length -= n

    def _per_row(self, fn) -> None:
        if self.free is not None:
            self.free = fn(self.free)
        if self.positions is not None and self.positions.numel():
            self.positions = fn(self.positions)
            for name, state in self.slot_state.items():
                self.slot_state[name] = fn(state)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._per_row(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._per_row(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._per_row(lambda t: t[indices, ...])


# ------------------------------------------------------------------------------------------------------ layer step
@dataclass
class LayerStep:
    """What a method sees of one layer after one attention forward with its cache.

    Attributes
    ----------
    cache : KVMethodCache
        The cache (for cache-wide facts: ``num_layers``, ``warn``).
    layer : EvictingLayer
        The layer; it already holds this forward's K/V, [B, Hkv, S, D].
    layer_idx : int
    module : torch.nn.Module
        The attention module (``q_proj``, ``head_dim``, ``scaling``, ...).
    hidden_states : torch.Tensor
        [B, q, hidden] the module's input of this forward.
    position_embeddings : tuple or None
        ``(cos, sin)`` as the model passed them.
    attention_mask : object
        The mask the module received.
    phase : {"prefill", "decode"}
        ``"prefill"`` for a multi-token forward (or the first forward), ``"decode"`` for a one-token step.
    projected_queries : torch.Tensor or None
        [B, q, out] the module's own query (or fused qkv) projection of this forward, captured by the cache for
        methods with ``captures_queries``; :meth:`queries` then applies only the norm and RoPE.
    """

    cache: KVMethodCache
    layer: EvictingLayer
    layer_idx: int
    module: torch.nn.Module
    hidden_states: torch.Tensor
    position_embeddings: tuple | None
    attention_mask: object
    phase: str
    projected_queries: torch.Tensor | None = None

    def __post_init__(self):
        self._queries: dict[int, torch.Tensor] = {}

    @property
    def query_length(self) -> int:
        """Tokens in this forward (``q``)."""
        return int(self.hidden_states.shape[1])

    @property
    def keys(self) -> torch.Tensor:
        """[B, Hkv, S, D] held keys, this forward's included (after RoPE)."""
        return self.layer.keys

    @property
    def values(self) -> torch.Tensor:
        """[B, Hkv, S, D] held values."""
        return self.layer.values

    @property
    def num_kv_heads(self) -> int:
        return int(self.layer.keys.shape[1])

    @property
    def scaling(self) -> float | None:
        return getattr(self.module, "scaling", None)

    def queries(self, window: int | None = None) -> torch.Tensor:
        """[B, Hq, w, D] post-RoPE queries of this forward's last ``w = min(window, q)`` tokens (all by default).

        Recomputed once per step from the module input (:func:`window_queries`), so SDPA/flash models need no
        attention weights. The first call per layer checks the recomputation against the keys the model cached
        (:func:`check_recomputed_keys`; ``ValueError`` for an attention layout it does not reproduce).
        """
        w = self.query_length if window is None else max(1, min(int(window), self.query_length))
        checked = self.cache.checked_projections
        if self.layer_idx not in checked:  # once per layer: the recomputation reproduces the model's own keys
            check_recomputed_keys(self.module, self.hidden_states, self.position_embeddings,
                                  self.layer.keys[..., -w:, :], getattr(self.cache.method, "name", "kv-method"))
            checked.add(self.layer_idx)
        if w not in self._queries:
            self._queries[w] = window_queries(self.module, self.hidden_states, self.position_embeddings, w,
                                              self.projected_queries)
        return self._queries[w]


# ----------------------------------------------------------------------------------------------------------- cache
class KVMethodCache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers are built by a KV method, for one ``generate`` run.

    Sliding-window or other special layers of the model's config keep transformers' own layer classes.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model the cache will be used with (its decoder config decides the layer types).
    method : KVMethod
        The method: ``method.make_layer(layer_idx)`` builds each full-attention layer, and, if ``method.uses_hooks``,
        ``method.on_step(step)`` is called after every attention forward of a layer with this cache.
    speculative : bool
        A cache for draft-and-verify decoding (only methods with ``supports_speculative``): the method sees each
        layer's first forward (the prefill) only; later forwards (verifications of drafts) just append, and the
        layers are croppable, so the engine can drop rejected draft tokens exactly.
    attach : bool
        Attach the hooks (default). ``False`` builds the layers only, for a cache that another cache's hooks fill
        (the shared prefill of :mod:`mmaccel.longctx.shared_prefill`).

    Attributes
    ----------
    warnings : list of str
        Warnings the method raised during the run (e.g. "budget >= context: ran as full"); telemetry copies them.

    Notes
    -----
    The hooks are per-instance forward hooks (``with_kwargs=True``) on the decoder's self-attention modules found by
    :func:`mmaccel.kernels.hf.attention_modules`, plus one ``always_call`` hook on ``model`` that closes the cache if a
    forward with it raises; a forward pre-hook per module fits a 4-D mask to that layer's own length
    (:func:`fit_layer_mask`, for methods with ``per_layer_lengths`` under eager attention). Sliding-window layers keep transformers'
    own class and are left alone; a model with only sliding-window layers is refused (:func:`no_method_layers_error`). They are removed by :meth:`close` (or ``with cache:``), on such an error, and when the cache
    is garbage-collected (they hold only a weak reference to it). A hook ignores forwards with another cache.
    """

    def __init__(self, model: torch.nn.Module, method: KVMethod, *, speculative: bool = False, attach: bool = True):
        super().__init__(config=model.config)
        for i, layer in enumerate(self.layers):
            if type(layer) is DynamicLayer:
                self.layers[i] = method.make_layer(i)
                self.layers[i].is_croppable = speculative
        self.method = method
        self.speculative = speculative
        self._prefilled: set[int] = set()
        self.checked_projections: set[int] = set()  # layers whose query recomputation was checked
        self._capturing: int | None = None  # the layer whose query projection the projection hook keeps now
        self._captured: dict[int, torch.Tensor] = {}
        self.warnings: list[str] = []
        self._hooks: list = []
        if method.uses_hooks and attach:
            self._attach(model)
        self._finalizer = weakref.finalize(self, _remove_handles, self._hooks)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def warn(self, message: str) -> None:
        """Record a warning once (it goes to the method's telemetry and to the log)."""
        if message not in self.warnings:
            self.warnings.append(message)
            logger.warning("%s: %s", getattr(self.method, "name", "kv-method"), message)

    def _attach(self, model: torch.nn.Module) -> None:
        modules = {i: m for i, m in attention_modules(model).items() if
                   i < len(self.layers) and isinstance(self.layers[i], EvictingLayer)}
        if not modules:
            raise no_method_layers_error(model, self, getattr(self.method, "name", "kv"))
        ref = weakref.ref(self)

        def fit_mask(module, args, kwargs):
            cache = ref()
            if cache is None or hooked_cache(kwargs) is not cache:
                return None
            mask = kwargs.get("attention_mask")
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            fitted = fit_layer_mask(mask, cache.layers[module.layer_idx].held, int(hidden.shape[1]))
            if fitted is mask:
                return None
            return args, {**kwargs, "attention_mask": fitted}

        def start_capture(module, args, kwargs):
            cache = ref()
            if cache is not None:
                cache._capturing = module.layer_idx if hooked_cache(kwargs) is cache else None

        def keep_projection(layer_idx):
            def hook(proj, args, output):
                cache = ref()
                if cache is not None and cache._capturing == layer_idx:
                    cache._captured[layer_idx] = output
            return hook

        def after_attention(module, args, kwargs, output):
            cache = ref()
            if cache is not None:
                cache._capturing = None
            if cache is None or hooked_cache(kwargs) is not cache:
                return
            if output is None:  # the attention forward raised
                cache.close()
                return
            try:
                cache._step(module, args, kwargs)
            except BaseException:
                cache.close()
                raise

        def after_model(module, args, kwargs, output):
            cache = ref()
            if cache is not None and output is None and hooked_cache(kwargs) is cache:
                cache.close()  # the forward raised: leave nothing attached to the model

        fits = _lengths_vary_by_layer(self.method)
        captures = getattr(self.method, "captures_queries", False)
        for module in modules.values():
            if fits:
                self._hooks.append(module.register_forward_pre_hook(fit_mask, with_kwargs=True))
            proj = getattr(module, "q_proj", None) or getattr(module, "qkv_proj", None)
            if captures and isinstance(proj, torch.nn.Module):  # reuse the module's own query projection
                self._hooks.append(module.register_forward_pre_hook(start_capture, with_kwargs=True))
                self._hooks.append(proj.register_forward_hook(keep_projection(module.layer_idx)))
            self._hooks.append(module.register_forward_hook(after_attention, with_kwargs=True, always_call=True))
        self._hooks.append(model.register_forward_hook(after_model, with_kwargs=True, always_call=True))

    def _step(self, module, args, kwargs) -> None:
        layer = self.layers[module.layer_idx]
        projected = self._captured.pop(module.layer_idx, None)
        if self.speculative:
            if module.layer_idx in self._prefilled:
                return  # a verification forward: appended only, so the engine can crop its rejected drafts
            self._prefilled.add(module.layer_idx)
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        q = int(hidden.shape[1])
        phase = "prefill" if q > 1 or layer.cumulative_length == q else "decode"
        mask = kwargs.get("attention_mask")
        if phase == "prefill" and not self.method.padding_safe and has_padding(mask):
            raise ValueError(
                f"{self.method.name} cannot compress a padded batch (left padding would be scored, and the padding "
                "mask no longer lines up once tokens are evicted); run prompts one at a time or with equal lengths"
            )
        if projected is not None and tuple(projected.shape[:2]) != tuple(hidden.shape[:2]):
            projected = None  # not this forward's projection of these tokens: recompute
        step = LayerStep(self, layer, module.layer_idx, module, hidden, kwargs.get("position_embeddings"), mask, phase,
                         projected)
        with torch.no_grad():  # scores and per-slot state never carry an autograd graph
            self.method.on_step(step)

    @property
    def hooks_attached(self) -> int:
        """Number of hooks this cache still has on the model."""
        return len(self._hooks)

    def close(self) -> None:
        """Remove every hook this cache attached to the model (idempotent)."""
        _remove_handles(self._hooks)

    def __enter__(self) -> KVMethodCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lengths_vary_by_layer(method) -> bool:
    """Whether ``method`` (or the method it wraps, through ``.method``) keeps different numbers of slots per layer."""
    seen = 0
    while isinstance(method, KVMethod) and seen < 8:
        if method.per_layer_lengths:
            return True
        method, seen = getattr(method, "method", None), seen + 1
    return False


def no_method_layers_error(model: torch.nn.Module, cache: Cache, name: str) -> ValueError:
    """The error for a model none of whose layers a KV method can act on: every attention layer is a sliding-window
    layer (Mistral with ``sliding_window`` set), or no decoder self-attention module was found."""
    sliding = [layer for layer in getattr(cache, "layers", []) if getattr(layer, "is_sliding", False)]
    if attention_modules(model) and sliding and len(sliding) == len(cache.layers):
        window = getattr(sliding[0], "sliding_window", "?")
        return ValueError(
            f"every attention layer of {type(model).__name__} is a sliding-window layer (sliding_window={window}); "
            f"the {name} KV-cache method acts on full-attention layers only and this model has none. Its window "
            f"already bounds the cache to {window} tokens per layer: run it with 'full'"
        )
    return ValueError(
        f"found no self-attention modules (with layer_idx and head_dim) in {type(model).__name__}; the {name} "
        "KV-cache method needs a transformers decoder"
    )


def fit_layer_mask(mask, held: int, query_length: int):
    """The model's attention mask fitted to one layer's own cache length, for methods that keep different numbers of
    slots per layer (PyramidKV, ...).

    transformers builds one mask per layer type, sized by the first layer of that type (``get_mask_sizes``); with
    eager attention (or any 4-D mask) a layer holding another number of slots would not match it. Every held slot is
    visible to every query of the forward (padded batches are refused by evicting methods), so the layer's mask is
    "all held slots allowed" followed by the mask's own last ``query_length`` columns (the causal part of the chunk).

    Parameters
    ----------
    mask : torch.Tensor or other
        [B, 1 or H, q, k] bool (True = attend) or additive float mask; anything else is returned as it is.
    held : int
        Slots the layer holds before this forward's update.
    query_length : int
        Tokens in this forward (``q``).

    Returns
    -------
    The mask itself when it already fits (or is not a 4-D tensor), else a [B, 1 or H, q, held + q] mask.

    Raises
    ------
    ValueError
        If the mask hides a held slot (a padded or custom mask), which cannot be fitted to another cache length.
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] == held + query_length:
        return mask
    ref_held = mask.shape[-1] - query_length
    if ref_held < 0:
        return mask
    head = mask[..., :ref_held]
    visible = head.all() if mask.dtype == torch.bool else (head == 0).all()
    if not bool(visible):
        raise ValueError("this KV method keeps a different number of slots per layer, which cannot be fitted to a "
                         "padded or custom attention mask; run prompts one at a time or with equal lengths")
    fill = True if mask.dtype == torch.bool else 0
    allowed = mask.new_full((*mask.shape[:-1], held), fill)
    return torch.cat([allowed, mask[..., ref_held:]], dim=-1)


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


# ---------------------------------------------------------------------------------------------------------- method
def _check_int(owner: str, name: str, value, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}; {fix}")


def _check_ratio(owner: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{owner}: ratio must be a kept fraction in (0, 1], got {value!r}; e.g. {owner}:ratio=0.25")


@dataclass
class KVMethod:
    """Base class of the KV-cache methods: a dataclass of hyper-parameters that builds a fresh cache per run.

    Use as ``model.generate(**inputs, past_key_values=method.make_cache(model))``.

    Subclasses set ``method_name``; most derive from :class:`KVScorer` and only write ``score``. A method that needs
    other lifecycle behaviour overrides :meth:`on_step` (called per layer after every attention forward).

    Attributes
    ----------
    uses_hooks : bool (class)
        Whether the cache hooks the model's attention modules (False for full attention).
    padding_safe : bool (class)
        Whether the method is exact on left-padded batches; otherwise a padded prefill raises ``ValueError``.
    supports_chunking : bool (class)
        Whether :class:`~mmaccel.longctx.chunked.Chunked` may wrap it (``chunking_error`` says why not).
    supports_speculative : bool (class)
        Whether the method evicts at prefill only, so that ``make_cache(model, speculative=True)`` gives a cache the
        speculative engine can crop (SnapKV, PyramidKV, KNorm).
    prefill_is_full : bool (class)
        Whether the method's prefill forward computes exactly full attention and the method only chooses what to keep
        afterwards (in ``make_layer``'s ``update`` and ``on_step``), so that one shared full-attention prefill can
        serve it (:mod:`mmaccel.longctx.shared_prefill`). False (the default) for methods that change the prefill.
    per_layer_lengths : bool (class)
        Whether layers keep different numbers of slots (PyramidKV); the cache then fits the model's 4-D mask to
        each layer's length (:func:`fit_layer_mask`), which eager attention needs.
    """

    method_name: ClassVar[str] = "kv-method"
    uses_hooks: ClassVar[bool] = True
    padding_safe: ClassVar[bool] = False
    supports_chunking: ClassVar[bool] = True
    chunking_error: ClassVar[str] = ""
    supports_speculative: ClassVar[bool] = False
    prefill_is_full: ClassVar[bool] = False
    per_layer_lengths: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """Registry name, e.g. ``"snapkv"``."""
        return self.method_name

    @property
    def spec(self) -> str:
        """Spec string that rebuilds this method, e.g. ``"snapkv:budget=256:ratio=None:window=32:..."``."""
        parts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)]
        return ":".join([self.name, *parts])

    def make_layer(self, layer_idx: int) -> EvictingLayer:
        """A fresh cache layer for full-attention layer ``layer_idx``."""
        return EvictingLayer()

    def prefill_holder(self, model: torch.nn.Module) -> KVMethodCache:
        """The cache a shared full-attention prefill (:mod:`mmaccel.longctx.shared_prefill`) fills for this method:
        its layers, no hooks of its own. Only for methods with ``prefill_is_full``."""
        return KVMethodCache(model, self, attach=False)

    def keep_shared(self, step: LayerStep) -> None:
        """At one layer of a shared full-attention prefill, after ``step.layer`` (this method's holder layer) took
        the layer's K/V [B, Hkv, S, D]: keep this method's share, as its own prefill forward would at that layer.
        Default: :meth:`on_step` for a method that hooks the attention, nothing otherwise."""
        if self.uses_hooks:
            self.on_step(step)

    def finish_shared_prefill(self, holder: KVMethodCache, model: torch.nn.Module, input_ids: torch.Tensor) -> None:
        """What the method does after a shared prefill forward of ``input_ids`` [B, L] filled ``holder`` and before
        it decodes, where its own run would do it after its prefill forward (KVzip's reconstruction); nothing by
        default (the method chose what to keep inside the forward)."""

    def make_cache(self, model: torch.nn.Module, *, speculative: bool = False) -> Cache:
        """A fresh cache for one ``generate`` run of ``model`` (close it, or use ``with``, when done).

        ``speculative=True``: a cache for the speculative engine (see :class:`KVMethodCache`); raises ``ValueError``
        for a method without ``supports_speculative``.
        """
        if speculative and not self.supports_speculative:
            raise ValueError(f"{self.name} evicts during decoding, which the speculative engine's rollback cannot "
                             "undo; use a prefill-only method (snapkv, pyramidkv, knorm) or 'full'")
        return KVMethodCache(model, self, speculative=speculative)

    def on_step(self, step: LayerStep) -> None:
        """Called per layer after every attention forward with this method's cache. Default: nothing."""

    def telemetry(self, cache: Cache) -> dict:
        """JSON-serialisable facts about a cache after a run.

        Returns
        -------
        dict
            ``method``, ``spec``, the hyper-parameters, ``seen_tokens`` (tokens that went through the cache),
            ``kept_tokens_per_layer`` (live slots), ``evicted_tokens`` (seen - kept, summed over layers),
            ``kv_cache_bytes`` (K/V storage, a dead slot awaiting its overwrite included), ``bookkeeping_bytes`` (positions and per-slot state) and ``warnings`` (list of str).
        """
        layers = list(getattr(cache, "layers", []))
        # live slots: a slot marked dead by in-place decode eviction (EvictingLayer.evict_one) is not kept
        kept = [held_tokens(layer) - (getattr(layer, "free", None) is not None) for layer in layers]
        seen = [int(layer.get_seq_length()) if getattr(layer, "is_initialized", False) else 0 for layer in layers]
        return {
            "method": self.name,
            "spec": self.spec,
            **{f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)},
            "seen_tokens": max(seen, default=0),
            "kept_tokens_per_layer": kept,
            "evicted_tokens": int(sum(s - k for s, k in zip(seen, kept))),
            "kv_cache_bytes": kv_cache_bytes(cache),
            "bookkeeping_bytes": bookkeeping_bytes(cache),
            "warnings": [*_full_budget_warning(layers), *getattr(cache, "warnings", [])],
        }


def _full_budget_warning(layers) -> list[str]:
    """["budget B >= context N tokens: ran as full attention"] when no layer evicted anything, else []."""
    evicting = [layer for layer in layers if isinstance(layer, EvictingLayer) and layer.target is not None]
    targets = [(layer.target, layer.prefill_length) for layer in evicting]
    if not targets or any(t < n for t, n in targets) or any(l.held < l.cumulative_length for l in evicting):
        return []
    budget = min(t for t, _ in targets)
    message = f"budget {budget} >= context {targets[0][1]} tokens: ran as full attention"
    logger.info(message)  # the record carries it in telemetry["warnings"]
    return [message]


def _jsonable(value):
    if isinstance(value, KVMethod):
        return value.spec
    return value


@dataclass
class KVScorer(KVMethod):
    """The scorer contract: a method supplies :meth:`score`; the base owns budget, top-k, gather and cache surgery.

    After every prefill step (a multi-token forward) of a layer, the base keeps the :meth:`layer_budget` best-scored
    held slots per row and KV head, in original order. Methods with ``evicts_on_decode`` also evict after every
    decode step, back to the budget fixed at the last prefill step. :meth:`observe` runs first at every step (prefill
    and decode, whether or not anything is evicted), for methods that accumulate per-slot state.

    Parameters
    ----------
    budget : int or None
        Slots kept per layer and KV head (tokens), >= 1. ``None`` with ``ratio`` unset means the method's
        ``default_budget``.
    ratio : float or None
        Kept fraction of the context instead, in (0, 1]: ``keep = ceil(ratio * seen tokens)`` at each prefill step
        (``snapkv:ratio=0.25``; kvpress's ``compression_ratio`` is ``1 - ratio``). Exclusive with ``budget``.

    Notes
    -----
    A budget at least the context length keeps everything (bit-exact with full attention); :meth:`KVMethod.telemetry`
    then carries the warning "budget B >= context N tokens: ran as full attention".

    Raises
    ------
    ValueError
        If both ``budget`` and ``ratio`` are given, or either is out of range.
    """

    budget: int | None = None
    ratio: float | None = None

    default_budget: ClassVar[int] = 256
    evicts_on_decode: ClassVar[bool] = False
    #: the cache keeps each attention module's own query projection of the current forward (a hook on ``q_proj`` /
    #: ``qkv_proj``), so :meth:`LayerStep.queries` does not run the projection again (methods that score with the
    #: queries of every decode step)
    captures_queries: ClassVar[bool] = False

    def __post_init__(self):
        if self.budget is not None and self.ratio is not None:
            raise ValueError(
                f"{self.method_name}: give budget (tokens) or ratio (kept fraction), not both; "
                f"e.g. {self.method_name}:budget=256 or {self.method_name}:ratio=0.25"
            )
        if self.ratio is not None:
            _check_ratio(self.method_name, self.ratio)
        else:
            if self.budget is None:
                self.budget = self.default_budget
            _check_int(self.method_name, "budget", self.budget, 1,
                       f"pass the number of tokens to keep, e.g. {self.method_name}:budget=256")

    # ---------------------------------------------------------------- what a method writes
    def score(self, step: LayerStep) -> torch.Tensor:
        """Scores of the held slots, [B, Hkv, S] float, higher = keep (``inf`` = always keep). To override."""
        raise NotImplementedError

    def observe(self, step: LayerStep) -> None:
        """Update per-slot state after every forward (before any eviction). Default: nothing."""

    def min_budget(self, step: LayerStep) -> int:
        """The fewest slots the method can keep (e.g. SnapKV's window). Default 1."""
        return 1

    # ---------------------------------------------------------------- what the base owns
    def context_budget(self, seen: int) -> int:
        """Slots to keep for a context of ``seen`` tokens: ``budget``, or ``ceil(ratio * seen)``."""
        if self.ratio is not None:
            return max(1, math.ceil(self.ratio * seen))
        return int(self.budget)

    def layer_budget(self, step: LayerStep) -> int:
        """Slots layer ``step.layer_idx`` keeps after a prefill step; override for layer-wise budgets."""
        return self.context_budget(step.layer.cumulative_length)

    def select(self, scores: torch.Tensor, keep: int, step: LayerStep) -> torch.Tensor:
        """[B, Hkv, keep] ascending indices of the ``keep`` best slots per row and KV head (override for AdaKV)."""
        return topk_keep_indices(scores, keep)

    def compress(self, step: LayerStep, keep: int) -> None:
        """Score the held slots of ``step.layer`` and keep the ``keep`` best per row and KV head."""
        scores = self.score(step)
        expected = tuple(step.layer.positions.shape)
        if tuple(scores.shape) != expected:
            raise ValueError(f"{self.name}.score returned {tuple(scores.shape)}, expected [B, Hkv, S] = {expected}")
        step.layer.keep(self.select(scores.float(), keep, step))

    def on_step(self, step: LayerStep) -> None:
        layer = step.layer
        self.observe(step)
        if step.phase == "prefill":
            keep = self.layer_budget(step)
            low = self.min_budget(step)
            if keep < low and self.ratio is not None:
                # A fraction is relative to the prompt: on a short prompt (a warm-up, a short document) it can fall
                # below what the method needs (e.g. SnapKV's window). Keep the minimum and say so in the record.
                step.cache.warn(f"ratio={self.ratio} of {layer.cumulative_length} tokens is {keep} slots, fewer than "
                                f"the {low} {self.method_name} needs; kept {low}")
                keep = low
            elif keep < low:
                raise ValueError(
                    f"{self.name}: layer {step.layer_idx} would keep {keep} slots of {layer.cumulative_length} "
                    f"tokens, fewer than the {low} it needs; raise the budget or ratio"
                )
            layer.target = keep
            layer.prefill_length = layer.cumulative_length
            layer.in_place_ok = self._evicts_in_place() and not has_padding(step.attention_mask)
        elif not self.evicts_on_decode or layer.target is None:
            return
        if step.phase == "decode" and layer.held == layer.target + 1 and getattr(layer, "in_place_ok", False):
            # one slot too many after a decode step: drop the worst one in place (the next token overwrites it),
            # the same slots as compress() keeps, without copying the cache at every step
            layer.evict_one(self.score(step).float().argmin(dim=-1))
        elif layer.held > layer.target:
            self.compress(step, layer.target)

    def _evicts_in_place(self) -> bool:
        """Whether decode-time eviction may use :meth:`EvictingLayer.evict_one`: the method keeps the top-scored
        slots with the base's own :meth:`select` and :meth:`compress`, and its scores do not depend on slot order."""
        cls = type(self)
        return cls.select is KVScorer.select and cls.compress is KVScorer.compress and self.scores_ignore_order

    #: scores depend on what each slot holds and its position, not on where it sits in the cache (methods whose
    #: score() reads slot order, e.g. "the last W slots", set False)
    scores_ignore_order: ClassVar[bool] = True
