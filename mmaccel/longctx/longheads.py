"""LongHeads: every head attends only to a few chunks of the context, at positions inside the trained length.

Lu et al., "LongHeads: Multi-Head Attention is Secretly a Long Context Processor", 2024, arXiv 2402.10685.

The context is cut into chunks of ``chunk`` tokens. For each query, each KV head reads ``window // chunk`` chunks:
the first chunk (attention sink), the chunk before its own, its own chunk (causally), and the best-scoring other
earlier chunks. The chunks read are laid side by side at contiguous positions ``0 .. window - 1`` and RoPE is applied
for those positions, so no attention score ever sees a relative distance the model was not trained on, however long
the context. For that the keys are cached *before* RoPE and rotated again at every attention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import attention, decode_attention
from ..kernels.hf import attention_modules
from .base import KVMethod, _check_int, bookkeeping_bytes, kv_cache_bytes, rotate_half
from .owned import AttentionOwningLayer, OwnedAttentionCache

# RoPE variants whose angle at a position depends on the running sequence length: undoing them would need the
# length each key was rotated at, and their point (stretching positions) is what LongHeads replaces.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscaled ``cos`` and ``sin`` of the RoPE angles of some positions, as transformers' rotary embeddings compute
    them (``position * inv_freq`` in float32, each frequency repeated over both halves).

    Parameters
    ----------
    positions : torch.Tensor
        int [N] positions.
    inv_freq : torch.Tensor
        float32 [D / 2] inverse frequencies (the rotary embedding's ``inv_freq``).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        float32 [N, D] each.
    """
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def chunk_means(keys: torch.Tensor, chunk: int) -> torch.Tensor:
    """Chunk representations: the mean key of every *complete* chunk.

    Parameters
    ----------
    keys : torch.Tensor
        [B, Hkv, T, D] pre-RoPE keys.
    chunk : int
        Tokens per chunk.

    Returns
    -------
    torch.Tensor
        [B, Hkv, T // chunk, D] in the keys' dtype (averaged in float32); a trailing partial chunk has none.
    """
    B, H, T, D = keys.shape
    full = T // chunk
    return keys[:, :, : full * chunk].float().reshape(B, H, full, chunk, D).mean(3).to(keys.dtype)


def select_chunks(query: torch.Tensor, reps: torch.Tensor, own: int, count: int) -> torch.Tensor:
    """The earlier chunks each KV head reads for queries of chunk ``own``.

    Parameters
    ----------
    query : torch.Tensor
        [B, Hq, D] pre-RoPE query (for a prefill chunk, the mean of its queries); query head ``h`` reads KV head
        ``h // (Hq // Hkv)``.
    reps : torch.Tensor
        [B, Hkv, C, D] chunk representations (:func:`chunk_means`), ``C >= own``.
    own : int
        Index of the queries' own chunk, >= 0.
    count : int
        Chunks read per head, own chunk included, >= 3.

    Returns
    -------
    torch.LongTensor
        [B, Hkv, min(own, count - 1)] ascending chunk indices, the same for every query head of a GQA group. If
        ``own <= count - 1``: every earlier chunk. Otherwise chunk 0 (the attention sink), chunk ``own - 1`` (the
        local context before the own chunk) and the ``count - 3`` chunks of ``1 .. own - 2`` with the highest
        score ``sum over the group's query heads of query . rep`` (float32).

    Raises
    ------
    ValueError
        If ``count < 3`` or ``reps`` has fewer than ``own`` chunks.
    """
    if count < 3:
        raise ValueError(f"select_chunks reads at least 3 chunks (sink, previous, own), got count={count}")
    B, Hkv = reps.shape[:2]
    if own <= count - 1:
        return torch.arange(own, device=reps.device).expand(B, Hkv, own)
    if reps.shape[2] < own:
        raise ValueError(f"need representations of chunks 0 .. {own - 1}, got {reps.shape[2]}")
    q = query.float().reshape(B, Hkv, -1, query.shape[-1])
    scores = torch.einsum("bhgd,bhcd->bhc", q, reps[:, :, :own].float())
    scores[..., 0] = float("inf")
    scores[..., own - 1] = float("inf")
    return scores.topk(count - 1, dim=-1).indices.sort(dim=-1).values


class LongHeadsLayer(AttentionOwningLayer):
    """Every token's pre-RoPE K/V plus per-chunk mean keys; each attention reads per KV head a few chunks, re-rotated
    at contiguous positions below ``window``.

    Attributes
    ----------
    keys, values : torch.Tensor
        [B, Hkv, T, D] every token seen; ``keys`` *before* RoPE (the model's rotation at the true position undone).
    reps : torch.Tensor or None
        [B, Hkv, T // chunk, D] mean pre-RoPE key of every complete chunk (bookkeeping).
    cos, sin : torch.Tensor
        float32 [window, D] the rotation table for positions ``0 .. window - 1`` (shared by the layers of a cache,
        ``attention_scaling`` included). The re-rotation only indexes this table.
    last_chunks : torch.Tensor or None
        int64 [B, Hkv, count - 1] earlier chunks read by the last query chunk handled beyond the window (``None``
        when it read everything).
    read_fractions, chunks_read : list
        Per decode step: the fraction of held K/V rows read, and the number of chunks read (own one included).
    max_position : int
        Largest position the attention rotated a query or key to (-1 before any forward).
    """

    def __init__(self, chunk: int, window: int, inv_freq: torch.Tensor, scaling: float,
                 cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.chunk, self.window, self.count = chunk, window, window // chunk
        self.inv_freq, self.scaling = inv_freq, scaling
        self.cos, self.sin = cos, sin
        self.reps: torch.Tensor | None = None
        self.last_chunks: torch.Tensor | None = None
        self.read_fractions: list[float] = []
        self.chunks_read: list[int] = []
        self.max_position = -1

    # ------------------------------------------------------------------------------------------------ positions
    def unrotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """float32 [B, H, n, D]: ``x`` (rotated by the model at positions ``start .. start + n - 1``) before RoPE."""
        cos, sin = rope_angles(torch.arange(start, start + x.shape[2], device=x.device), self.inv_freq)
        x = x.float()
        return (x * cos - rotate_half(x) * sin) / self.scaling

    def rotate(self, x: torch.Tensor, first: int) -> torch.Tensor:
        """float32 [B, H, n, D]: pre-RoPE ``x`` rotated to positions ``first .. first + n - 1`` (< ``window``)."""
        last = first + x.shape[2] - 1
        if last >= self.window:
            raise RuntimeError(f"LongHeads would rotate to position {last}, past its window of {self.window}")
        self.max_position = max(self.max_position, last)
        cos, sin = self.cos[first : last + 1], self.sin[first : last + 1]
        x = x.float()
        return x * cos + rotate_half(x) * sin

    # ------------------------------------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.reps = key_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store [B, Hkv, q, D] post-RoPE keys un-rotated (and the values); add the mean keys of the chunks they
        complete; return the held K/V."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plain = self.unrotate(key_states, self.cumulative_length).to(key_states.dtype)
        self.keys = torch.cat([self.keys, plain], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        done = self.reps.shape[2]
        fresh = chunk_means(self.keys[:, :, done * self.chunk :], self.chunk)
        if fresh.shape[2]:
            self.reps = torch.cat([self.reps, fresh], dim=2)
        return self.keys, self.values

    # ------------------------------------------------------------------------------------------------ attention
    def attend(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        q = query.shape[2]
        self.check_unpadded(attention_mask, q, "LongHeads")
        T = self.keys.shape[2]
        start = T - q
        plain_q = self.unrotate(query, start)
        parts = []
        inside = min(T, self.window)
        if start < inside:  # every query of the first `window` tokens sees all before it, at its true position
            keys = self.rotate(self.keys[:, :, :inside], 0).to(self.keys.dtype)
            qs = self.rotate(plain_q[:, :, : inside - start], start).to(query.dtype)
            parts.append(self._dense(qs, keys, self.values[:, :, :inside], scaling))
            if q == 1:
                self._record_step(inside, T, None)
        first = max(start, inside)  # queries past the window: chunk by chunk, over selected chunks
        for own in range(first // self.chunk, -(-T // self.chunk) if first < T else 0):
            lo, hi = max(start, own * self.chunk), min(T, (own + 1) * self.chunk)
            part, chosen, rows = self._chunk_attention(plain_q[:, :, lo - start : hi - start], own, hi, scaling)
            parts.append(part.to(query.dtype))
            if q == 1:
                self._record_step(rows, T, chosen)
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    def _chunk_attention(self, plain_q: torch.Tensor, own: int, end: int, scaling: float):
        """Attention of the pre-RoPE queries of chunk ``own`` (the last of tokens ``.. end - 1``) over the chunks
        :func:`select_chunks` picks plus their own chunk up to ``end``, all re-rotated to contiguous positions.
        Returns (output [B, Hq, m, D], chosen chunks [B, Hkv, n], K/V rows read per KV head)."""
        chosen = select_chunks(plain_q.mean(2), self.reps, own, self.count)
        self.last_chunks = chosen
        span = torch.arange(self.chunk, device=chosen.device)
        rows = torch.cat([(chosen[..., None] * self.chunk + span).flatten(2),
                          torch.arange(own * self.chunk, end, device=chosen.device).expand(*chosen.shape[:2], -1)],
                         dim=2)
        gather = rows[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        keys = self.rotate(self.keys.gather(2, gather), 0).to(self.keys.dtype)
        values = self.values.gather(2, rows[..., None].expand(-1, -1, -1, self.values.shape[-1]))
        n, m = rows.shape[2], plain_q.shape[2]
        qs = self.rotate(plain_q, n - m).to(self.keys.dtype)
        return self._dense(qs, keys, values, scaling), chosen, n

    @staticmethod
    def _dense(qs, keys, values, scaling) -> torch.Tensor:
        if qs.shape[2] == 1:
            return decode_attention(qs, keys, values, scaling=scaling)
        return attention(qs, keys, values, causal=True, scaling=scaling)

    def _record_step(self, rows: int, seen: int, chosen: torch.Tensor | None) -> None:
        self.read_fractions.append(rows / seen)
        self.chunks_read.append(-(-seen // self.chunk) if chosen is None else chosen.shape[2] + 1)
        if chosen is None:
            self.last_chunks = None

    def coverage(self) -> float:
        """Fraction of the context's chunks that at least one KV head of batch row 0 read at the last selection
        (after ``generate``: the last decode step; 1.0 when it read everything): how much of the context the heads
        cover together."""
        total = -(-self.cumulative_length // self.chunk)
        if self.last_chunks is None or total == 0:
            return 1.0
        union = set(self.last_chunks[0].flatten().tolist()) | {total - 1}
        return len(union) / total

    def bookkeeping_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.reps, self.cos, self.sin) if isinstance(t, torch.Tensor)]

    def reset(self) -> None:
        super().reset()
        self.reps = self.last_chunks = None
        self.read_fractions, self.chunks_read = [], []
        self.max_position = -1


@dataclass
class LongHeads(KVMethod):
    """LongHeads (Lu et al., 2024, arXiv 2402.10685): each KV head attends only to ``window // chunk`` chunks,
    placed at contiguous positions below ``window``, so the model runs past its trained length.

    The context is cut into chunks of ``chunk`` tokens; a chunk's representation is the mean of its pre-RoPE keys
    ([B, Hkv, T // chunk, D], bookkeeping). Every query reads, per KV head, ``count = window // chunk`` chunks: the
    first chunk (attention sink), the chunk before its own, its own chunk (causally) and the ``count - 3`` other
    earlier chunks with the highest ``q . mean key`` (pre-RoPE, summed over the query heads of the GQA group, so a
    group reads one set of K/V rows). Prefill queries are handled chunk by chunk: the queries of one chunk share the
    selection, scored with their mean query; a decode step selects with its own query. While a query has fewer than
    ``count`` chunks before and including its own, it reads all of them: attention is then exactly full attention.

    **Positions kept within the trained length**: the chunks a head reads are concatenated in their original order
    and rotated to positions ``0, 1, ..., n - 1`` (n <= ``window``); the queries of the own chunk, last in that row,
    get the positions that follow their offset in it. Every angle the attention scores see comes from a rotation
    table of ``window`` rows (``window <= max_position_embeddings``). To re-rotate, the keys are cached *before* RoPE:
    the model's own forward still rotates q and k at their true positions (transformers computes RoPE for any
    position), and :class:`LongHeadsLayer` undoes that rotation exactly (``R(-p) x / attention_scaling`` in float32,
    the same float32 angles transformers computes), then rotates again from the table. In a bf16/fp16 model the
    round trip adds a rounding error of that dtype to q and k.

    **LongHeads bounds the K/V read per query, not the K/V held**: ``kv_cache_bytes`` equals full attention's (the
    pre-RoPE keys replace the rotated ones); ``bookkeeping_bytes`` counts the chunk means and the rotation table. Each
    attention gathers and re-rotates the rows it reads (at most ``window`` per KV head) and runs through
    :func:`mmaccel.kernels.attention` (prefill) or :func:`mmaccel.kernels.decode_attention` (decode).

    Parameters
    ----------
    chunk : int
        Tokens per chunk, >= 1 (default 256, as in LongHeads).
    window : int or None
        Tokens each head reads per query, and the span of positions RoPE is applied at: a multiple of ``chunk``,
        at least three chunks, at most the model's ``max_position_embeddings`` (default: that length rounded down
        to whole chunks).

    Notes
    -----
    Simplifications against the paper: the chunk representation is the plain mean key (the paper weights the keys by
    attention within the chunk), prefill selects once per query chunk (the paper selects per token), and GQA groups
    share a selection. The rotary embedding must give every position a fixed angle (default, linear, llama3, yarn
    RoPE, full head dimension); ``dynamic`` and ``longrope`` RoPE and M-RoPE are refused. Positions are the cache's
    (unpadded rows; custom ``position_ids`` are not read). Padded batches, beam search and cropping raise; chunked
    prefill works through ``generate(prefill_chunk_size=C)`` (a split inside a chunk changes that chunk's mean query),
    not the ``Chunked`` wrapper.

    Raises
    ------
    ValueError
        On a bad hyper-parameter; in :meth:`make_cache`, for a window past the model's trained length or with fewer
        than three chunks, or a model without a supported RoPE.
    """

    chunk: int = 256
    window: int | None = None

    method_name = "longheads"
    uses_hooks = False

    def __post_init__(self):
        name = self.method_name
        _check_int(name, "chunk", self.chunk, 1, f"pass the tokens per chunk, e.g. {name}:chunk=256")
        if self.window is not None:
            _check_int(name, "window", self.window, 1,
                       f"pass the tokens each head reads, e.g. {name}:chunk={self.chunk}:window={8 * self.chunk}")
            self._check_window(self.window)
        self._rope: dict | None = None

    def _check_window(self, window: int) -> None:
        name, chunk = self.method_name, self.chunk
        if window % chunk:
            fix = max(3, window // chunk) * chunk
            raise ValueError(f"{name}: window ({window}) must be a multiple of chunk ({chunk}); "
                             f"e.g. {name}:chunk={chunk}:window={fix}")
        if window // chunk < 3:
            raise ValueError(f"{name}: window ({window}) holds {window // chunk} chunks of {chunk}; it needs at "
                             f"least 3 (sink, previous, own): e.g. {name}:chunk={chunk}:window={3 * chunk} or a "
                             "smaller chunk")

    def resolve_window(self, trained: int) -> int:
        """The window used with a model trained to ``trained`` positions.

        Raises
        ------
        ValueError
            If ``window`` exceeds ``trained``, or the window holds fewer than three chunks.
        """
        name = self.method_name
        if self.window is None:
            window = (trained // self.chunk) * self.chunk
            if window // self.chunk < 3:
                raise ValueError(f"{name}: the model's trained length {trained} holds {trained // self.chunk} chunks "
                                 f"of {self.chunk}; LongHeads needs at least 3: use e.g. "
                                 f"{name}:chunk={max(1, trained // 8)}")
            return window
        if self.window > trained:
            raise ValueError(f"{name}: window ({self.window}) exceeds the model's trained length "
                             f"(max_position_embeddings={trained}): positions would leave it; use e.g. "
                             f"{name}:chunk={self.chunk}:window={(trained // self.chunk) * self.chunk}")
        return self.window

    def _bind(self, model: torch.nn.Module) -> dict:
        """Read the model's trained length and RoPE; build the shared rotation table."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        trained = getattr(config, "max_position_embeddings", None)
        if not isinstance(trained, int):
            raise ValueError(  # noqa: TRY004 - a model LongHeads cannot run, reported like every other one
                f"{self.name}: the model's config has no max_position_embeddings (its trained length)")
        window = self.resolve_window(trained)
        inv_freq, rope_type, scaling = _full_attention_rope(model)
        params = getattr(config, "rope_parameters", None) or {}
        params = params.get("full_attention", params)  # per layer type (Gemma 3): the global layers' RoPE
        if rope_type in _LENGTH_DEPENDENT_ROPE or "mrope_section" in params:
            raise ValueError(f"{self.name}: {rope_type!r} RoPE{' (M-RoPE)' if 'mrope_section' in params else ''} "
                             "does not give each position one fixed angle; LongHeads needs plain RoPE")
        modules = attention_modules(model)
        head_dim = next(iter(modules.values())).head_dim if modules else None
        if head_dim is None or 2 * inv_freq.numel() != head_dim:
            raise ValueError(f"{self.name}: RoPE covers {2 * inv_freq.numel()} of head_dim {head_dim} dimensions; "
                             "LongHeads needs RoPE over the full head dimension")
        cos, sin = rope_angles(torch.arange(window, device=inv_freq.device), inv_freq)
        self._rope = {"window": window, "trained": trained, "inv_freq": inv_freq, "scaling": scaling,
                      "cos": cos * scaling, "sin": sin * scaling}
        return self._rope

    def make_layer(self, layer_idx: int) -> LongHeadsLayer:
        if self._rope is None:
            raise ValueError(f"{self.name}: build the cache with make_cache(model); it reads the model's RoPE")
        r = self._rope
        return LongHeadsLayer(self.chunk, r["window"], r["inv_freq"], r["scaling"], r["cos"], r["sin"])

    def make_cache(self, model: torch.nn.Module) -> OwnedAttentionCache:
        """A fresh cache for one ``generate`` run of ``model`` (close it, or use ``with``, when done).

        Raises
        ------
        ValueError
            See the class docstring.
        """
        self._bind(model)
        return OwnedAttentionCache(model, self)

    def telemetry(self, cache) -> dict:
        """``method``, ``spec``, ``chunk``, ``window`` (as used), ``trained_length``, ``seen_tokens``,
        ``kv_read_fraction_per_step`` (per decode step, mean over layers of the fraction of held K/V rows read),
        ``kv_read_fraction`` (their mean), ``chunks_per_step`` (chunks read per KV head and decode step, own chunk
        included), ``chunk_coverage`` (per layer, the fraction of chunks some KV head read at the last decode step),
        ``max_rope_position`` (largest position any re-rotation used; < ``window``), ``kv_cache_bytes`` (every
        token: LongHeads does not evict), ``bookkeeping_bytes`` (chunk means, rotation table), ``warnings``."""
        layers = [l for l in getattr(cache, "layers", []) if isinstance(l, LongHeadsLayer)]
        n_steps = min((len(l.read_fractions) for l in layers), default=0)

        def mean_over_layers(series: str, i: int) -> float:
            return sum(getattr(l, series)[i] for l in layers) / len(layers)

        fractions = [round(mean_over_layers("read_fractions", i), 6) for i in range(n_steps)]
        chunks = [mean_over_layers("chunks_read", i) for i in range(n_steps)]
        warnings = list(getattr(cache, "warnings", []))
        if fractions and min(fractions) >= 1.0:
            warnings.append("the context fit in the window at every decode step: every chunk was read (ran as full "
                            "attention)")
        rope = self._rope or {}
        return {
            "method": self.name,
            "spec": self.spec,
            "chunk": self.chunk,
            "window": rope.get("window", self.window),
            "trained_length": rope.get("trained"),
            "seen_tokens": max((l.cumulative_length for l in layers), default=0),
            "kept_tokens_per_layer": [l.keys.shape[2] if l.is_initialized else 0 for l in layers],
            "evicted_tokens": 0,
            "kv_read_fraction_per_step": fractions,
            "kv_read_fraction": sum(fractions) / len(fractions) if fractions else 1.0,
            "chunks_per_step": chunks,
            "chunk_coverage": [round(l.coverage(), 6) for l in layers],
            "max_rope_position": max((l.max_position for l in layers), default=-1),
            "kv_cache_bytes": kv_cache_bytes(cache),
            "bookkeeping_bytes": bookkeeping_bytes(cache),
            "warnings": warnings,
        }


def _full_attention_rope(model: torch.nn.Module) -> tuple[torch.Tensor, str, float]:
    """The RoPE of the decoder's full-attention layers (the layers LongHeads acts on): ``(inv_freq float32 [D / 2],
    rope_type, attention_scaling)``, from a rotary embedding with one ``inv_freq`` buffer, or, for a rotary embedding
    per layer type (Gemma 3: ``full_attention_inv_freq``), from its full-attention entries.

    Raises
    ------
    ValueError
        As :func:`_rotary_of`.
    """
    rotary = _rotary_of(model)
    inv_freq = getattr(rotary, "inv_freq", None)
    rope_type = getattr(rotary, "rope_type", "default")
    if isinstance(inv_freq, torch.Tensor):
        return inv_freq.detach().float(), rope_type, float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    if isinstance(rope_type, dict):
        rope_type = rope_type.get("full_attention", "default")
    scaling = getattr(rotary, "full_attention_attention_scaling", 1.0)
    return rotary.full_attention_inv_freq.detach().float(), rope_type, float(scaling or 1.0)


def _rotary_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder's rotary embedding module (one with an ``inv_freq`` buffer, or a ``full_attention_inv_freq``
    buffer when it holds one RoPE per layer type).

    Raises
    ------
    ValueError
        If the model has none (no RoPE), or several different ones.
    """
    get_decoder = getattr(model, "get_decoder", None)
    root = model
    if callable(get_decoder):
        try:
            root = get_decoder() or model
        except (AttributeError, NotImplementedError, ValueError):
            root = model
    found = [m for m in root.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        per_type = [m for m in root.modules() if isinstance(getattr(m, "full_attention_inv_freq", None), torch.Tensor)]
        if len(per_type) == 1:
            return per_type[0]
    if not found:
        raise ValueError(f"longheads: found no rotary embedding (inv_freq) in {type(model).__name__}; LongHeads "
                         "re-applies RoPE and needs a RoPE model")
    if any(not torch.equal(m.inv_freq, found[0].inv_freq) for m in found[1:]):
        raise ValueError("longheads: the model has several different rotary embeddings (e.g. local and global "
                         "layers); LongHeads supports one RoPE per model")
    return found[0]
