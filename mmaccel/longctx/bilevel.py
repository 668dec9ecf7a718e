"""Video-XL-2-style bi-level KV: chunk-sparse prefill, then each chunk read densely or through a few of its tokens.

Qin et al., "Video-XL-2: Towards Very Long-Video Understanding Through Task-Aware KV Sparsification", 2025,
arXiv 2506.19225 (chunk-based pre-filling, bi-level KV decoding). The chunk relevance ``query . mean chunk key`` and
the "sink + local chunk + top chunks" rule follow LongHeads (Lu et al., 2024, arXiv 2402.10685). Training-free: it
works on any HF causal LM over a token sequence (text, or the visual tokens of a long video).

Chunks are fixed spans of absolute positions: chunk ``c`` covers ``[c * chunk, (c + 1) * chunk)``. For a query in
chunk ``j``, the *local* chunk is ``j - 1`` and the *candidates* are the closed chunks ``0 .. j - 2``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import Chunked as ChunkPattern
from ..kernels import HeadPatterns, attention, decode_attention, sparse_prefill_attention
from .base import KVMethod, _check_int, _storage_bytes
from .owned import AttentionOwningLayer, OwnedAttentionCache


def chunk_relevance(query: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """Relevance of every chunk to every query row: ``q . mean chunk key``, summed over each KV head's query heads.

    Parameters
    ----------
    query : torch.Tensor
        [B, Hq, R, D] query rows (the decode token's queries, or the mean query of each query chunk at prefill);
        query head ``h`` reads KV head ``h // (Hq // Hkv)`` (HF ``repeat_kv`` layout).
    summaries : torch.Tensor
        [B, Hkv, N, D] mean post-RoPE key of each chunk.

    Returns
    -------
    torch.Tensor
        [B, Hkv, R, N] float32 scores, higher = more relevant.
    """
    B, Hq, R, D = query.shape
    Hkv = summaries.shape[1]
    grouped = query.float().reshape(B, Hkv, Hq // Hkv, R, D)
    return torch.einsum("bhgrd,bhnd->bhrn", grouped, summaries.float())


def dense_chunk_table(scores: torch.Tensor, rows: torch.Tensor, dense_chunks: int) -> torch.Tensor:
    """Which chunks each query chunk reads densely: its own, the previous one, and the best-scored earlier ones.

    Parameters
    ----------
    scores : torch.Tensor
        [B, Hkv, R, N] relevance of the ``N`` chunks to ``R`` query chunks (:func:`chunk_relevance`); only the
        candidates of a row (chunks ``< rows[r] - 1``) are read, the rest may hold anything.
    rows : torch.Tensor
        int64 [R] the chunk index of each query row.
    dense_chunks : int
        Candidates picked per row and KV head (all of them when a row has fewer), >= 0.

    Returns
    -------
    torch.Tensor
        bool [B, Hkv, R, N]: ``True`` = read densely. Per row and KV head, ``min(dense_chunks, candidates)``
        candidates plus the chunk itself and its predecessor (when they are among the ``N``).
    """
    B, H, R, N = scores.shape
    cols = torch.arange(N, device=scores.device)
    rows = rows.to(scores.device)[:, None]
    candidate = cols < rows - 1  # [R, N]
    table = ((cols == rows) | (cols == rows - 1)).expand(B, H, R, N).clone()
    k = min(dense_chunks, N)
    if k:
        best = scores.float().masked_fill(~candidate, float("-inf")).topk(k, dim=-1).indices
        table |= torch.zeros_like(table).scatter_(-1, best, True) & candidate
    return table


def sparse_token_scores(last_query: torch.Tensor, chunk_keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention a chunk's last token pays to each token of its chunk, averaged over each KV head's query heads.

    Parameters
    ----------
    last_query : torch.Tensor
        [B, Hq, M, D] the query of the last token of each of ``M`` chunks.
    chunk_keys : torch.Tensor
        [B, Hkv, M, C, D] the keys of those chunks.
    scaling : float
        Softmax scale.

    Returns
    -------
    torch.Tensor
        [B, Hkv, M, C] float32 softmax probabilities over each chunk's ``C`` keys (rows sum to 1).
    """
    B, Hq, M, D = last_query.shape
    Hkv = chunk_keys.shape[1]
    grouped = last_query.float().reshape(B, Hkv, Hq // Hkv, M, D)
    logits = torch.einsum("bhgmd,bhmcd->bhgmc", grouped, chunk_keys.float()) * scaling
    return logits.softmax(dim=-1).mean(dim=2)


class BiLevelLayer(AttentionOwningLayer):
    """Every token's K/V in chunks, each chunk with a mean key and a sparse subset; attention by chunk relevance.

    Attributes
    ----------
    keys, values : torch.Tensor
        [B, Hkv, T - start, D] K/V on the model's device from position ``start`` on: every token without offload
        (``start == 0``), the local and current chunks with it.
    start : int
        Absolute position of ``keys[:, :, 0]``; the ``start`` tokens before it are in the host store.
    store_keys, store_values : torch.Tensor or None
        Offload only: [B, Hkv, start, D] dense K/V of the candidate chunks, in host memory.
    sink_keys, sink_values, sparse_keys, sparse_values : torch.Tensor or None
        Offload only, on the model's device: copies of the first ``min(sink, start)`` tokens, [B, Hkv, <= sink, D],
        and of each closed chunk's sparse tokens, [B, Hkv, closed, sparse_tokens, D].
    summaries : torch.Tensor or None
        [B, Hkv, closed, D] mean key of each closed chunk (bookkeeping).
    sparse_index : torch.Tensor or None
        int64 [B, Hkv, closed, sparse_tokens] absolute positions of each closed chunk's sparse tokens, ascending:
        the tokens its last token attends most (:func:`sparse_token_scores`) (bookkeeping).
    last_dense : torch.Tensor or None
        bool [B, Hkv, cur + 1] the chunks the last decode step read densely (``None`` when it read everything).
    last_prefill_table : torch.Tensor or None
        bool [B, Hkv, n, n] the chunk table of the last multi-token forward (row = query chunk).
    read_fractions : list of float
        Per decode step, the fraction of the ``T`` tokens read (mean over rows and KV heads).
    prefill_densities : list of float
        Per multi-token forward, the fraction of (query chunk, earlier-or-own chunk) pairs read densely.
    """

    def __init__(self, chunk: int, dense_chunks: int, sparse_tokens: int, sink: int, offload: bool):
        super().__init__()
        self.chunk, self.dense_chunks, self.sparse_tokens = chunk, dense_chunks, sparse_tokens
        self.sink, self.offload = sink, offload
        self._clear()

    def _clear(self) -> None:
        self.start = 0
        self.store_keys = self.store_values = None
        self.sink_keys = self.sink_values = self.sparse_keys = self.sparse_values = None
        self.summaries = self.sparse_index = None
        self.last_dense = self.last_prefill_table = None
        self.read_fractions: list[float] = []
        self.prefill_densities: list[float] = []

    # ------------------------------------------------------------------------------------------------ storage
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append [B, Hkv, q, D] K/V; return the device-resident K/V (chunks are closed in :meth:`attend`)."""
        if not self.is_initialized:
            B, H, _, D = key_states.shape
            self.dtype, self.device = key_states.dtype, key_states.device
            self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
            self.summaries = key_states.new_zeros(B, H, 0, D)
            self.sparse_index = torch.zeros(B, H, 0, self.sparse_tokens, dtype=torch.long, device=self.device)
            if self.offload:
                self.store_keys = key_states.new_zeros(B, H, 0, D, device="cpu")
                self.store_values = value_states.new_zeros(B, H, 0, value_states.shape[-1], device="cpu")
                self.sink_keys, self.sink_values = self.keys, self.values
                self.sparse_keys = key_states.new_zeros(B, H, 0, self.sparse_tokens, D)
                self.sparse_values = value_states.new_zeros(B, H, 0, self.sparse_tokens, value_states.shape[-1])
            self.is_initialized = True
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        return self.keys, self.values

    def rows(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of absolute positions ``[begin, end)`` on the model's device ([B, Hkv, end - begin, D]); rows held in
        the host store are copied back."""
        ks, vs = [], []
        if begin < self.start:
            ks.append(self.store_keys[:, :, begin:min(end, self.start)].to(self.device))
            vs.append(self.store_values[:, :, begin:min(end, self.start)].to(self.device))
        if end > self.start:
            ks.append(self.keys[:, :, max(begin, self.start) - self.start:end - self.start])
            vs.append(self.values[:, :, max(begin, self.start) - self.start:end - self.start])
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def _close_chunks(self, query: torch.Tensor, scaling: float) -> None:
        """Summaries and sparse tokens of the chunks whose last token is among this forward's queries."""
        T, q, C, s = self.cumulative_length, query.shape[2], self.chunk, self.sparse_tokens
        first, last = self.summaries.shape[2], T // C
        if last <= first:
            return
        keys, values = self.rows(first * C, last * C)
        B, H, _, D = keys.shape
        m = last - first
        ck, cv = keys.reshape(B, H, m, C, D), values.reshape(B, H, m, C, -1)
        self.summaries = torch.cat([self.summaries, ck.float().mean(dim=3).to(keys.dtype)], dim=2)
        ends = torch.arange(first + 1, last + 1, device=query.device) * C - 1 - (T - q)  # rows of this forward
        local = sparse_token_scores(query.index_select(2, ends), ck, scaling).topk(s, dim=-1).indices.sort(-1).values
        base = torch.arange(first, last, device=local.device)[:, None] * C
        self.sparse_index = torch.cat([self.sparse_index, local + base], dim=2)
        if self.offload:
            pick = local[..., None]
            self.sparse_keys = torch.cat([self.sparse_keys, ck.gather(3, pick.expand(-1, -1, -1, -1, D))], dim=2)
            self.sparse_values = torch.cat(
                [self.sparse_values, cv.gather(3, pick.expand(-1, -1, -1, -1, cv.shape[-1]))], dim=2)

    def _offload(self) -> None:
        """Move the dense K/V of every candidate chunk (before the local one) to the host store."""
        end = max((self.cumulative_length - 1) // self.chunk - 1, 0) * self.chunk
        if not self.offload or end <= self.start:
            return
        move = end - self.start
        need = min(self.sink, end) - self.sink_keys.shape[2]  # > 0 only while sink_keys ends at ``start``
        if need > 0:
            self.sink_keys = torch.cat([self.sink_keys, self.keys[:, :, :need]], dim=2)
            self.sink_values = torch.cat([self.sink_values, self.values[:, :, :need]], dim=2)
        self.store_keys = torch.cat([self.store_keys, self.keys[:, :, :move].to("cpu")], dim=2)
        self.store_values = torch.cat([self.store_values, self.values[:, :, :move].to("cpu")], dim=2)
        self.keys, self.values = self.keys[:, :, move:].clone(), self.values[:, :, move:].clone()
        self.start = end

    # ---------------------------------------------------------------------------------------------- attention
    def attend(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        """[B, Hq, q, D] attention of this forward's post-RoPE queries: chunk-sparse prefill (``q > 1``) or a
        bi-level decode step; closes the chunks this forward completes first. Raises ``ValueError`` on a
        left-padded prefill."""
        q = query.shape[2]
        self.check_unpadded(attention_mask, q, "bilevel")
        self._close_chunks(query, scaling)
        if q > 1:
            out = self._prefill(query, scaling)
            self._offload()
            return out
        self._offload()
        return self._decode(query, scaling)

    def prefill_table(self, query: torch.Tensor) -> torch.Tensor:
        """bool [B, Hkv, n, n] chunk table of a multi-token forward, ``n = ceil(T / chunk)``: each query chunk of
        this forward reads its own chunk, the previous one and the ``dense_chunks`` candidates most relevant to
        its mean query (:func:`dense_chunk_table`); rows of chunks with no query here read their own chunk."""
        B, Hq, q, D = query.shape
        T, C = self.cumulative_length, self.chunk
        n = -(-T // C)
        rows = torch.arange((T - q) // C, n, device=query.device)
        owner = torch.arange(T - q, T, device=query.device) // C - rows[0]
        sums = query.new_zeros(B, Hq, len(rows), D, dtype=torch.float32).index_add_(2, owner, query.float())
        mean = sums / torch.bincount(owner, minlength=len(rows)).clamp(min=1)[:, None]
        scores = chunk_relevance(mean, self.summaries)
        scores = F.pad(scores, (0, n - scores.shape[-1]), value=float("-inf"))
        table = torch.eye(n, dtype=torch.bool, device=query.device).expand(B, scores.shape[1], n, n).clone()
        table[:, :, rows] = dense_chunk_table(scores, rows, self.dense_chunks)
        read = table[:, :, rows].sum(-1).float() / (rows + 1).float()
        self.prefill_densities.append(float(read.mean()))
        return table

    def _prefill(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        keys, values = self.rows(0, self.cumulative_length)
        table = self.last_prefill_table = self.prefill_table(query)
        if self.prefill_densities[-1] >= 1.0:  # every query chunk reads every earlier chunk: plain causal
            return attention(query, keys, values, causal=True, scaling=scaling)
        out = torch.empty_like(query)
        for b in range(query.shape[0]):  # a kernel pattern has no batch axis: the selection is per row
            patterns = HeadPatterns(tuple(ChunkPattern(self.chunk, self.sink, head) for head in table[b]))
            out[b:b + 1] = sparse_prefill_attention(query[b:b + 1], keys[b:b + 1], values[b:b + 1], patterns,
                                                    scaling=scaling)
        return out

    def decode_dense(self, query: torch.Tensor) -> torch.Tensor | None:
        """bool [B, Hkv, cur + 1] chunks the decode token reads densely (``cur`` = its chunk): its chunk, the
        local one and the ``dense_chunks`` candidates with the highest :func:`chunk_relevance`; ``None`` when
        there are at most ``dense_chunks`` candidates (everything is read)."""
        cur = (self.cumulative_length - 1) // self.chunk
        candidates = max(cur - 1, 0)
        if candidates <= self.dense_chunks:
            return None
        scores = F.pad(chunk_relevance(query, self.summaries[:, :, :candidates]), (0, 2), value=float("-inf"))
        return dense_chunk_table(scores, torch.tensor([cur], device=query.device), self.dense_chunks)[:, :, 0]

    def read_mask(self, dense: torch.Tensor) -> torch.Tensor:
        """bool [B, Hkv, T] tokens a decode step reads: the sink, every token of the ``dense`` chunks
        ([B, Hkv, cur + 1]) and the sparse tokens of the other candidates."""
        T, C = self.cumulative_length, self.chunk
        pos = torch.arange(T, device=dense.device)
        read = dense[..., pos // C] | (pos < self.sink)
        candidates = dense.shape[-1] - 2
        return read.scatter_(-1, self.sparse_index[:, :, :candidates].flatten(2), True)

    def _decode(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        T = self.cumulative_length
        dense = self.last_dense = self.decode_dense(query)
        if dense is None:
            self.read_fractions.append(1.0)
            keys, values = self.rows(0, T)
            return decode_attention(query, keys, values, scaling=scaling)
        if self.offload:
            return self._decode_offloaded(query, dense, scaling)
        read = self.read_mask(dense)
        counts = read.sum(-1)
        self.read_fractions.append(float(counts.float().mean()) / T)
        pos = torch.arange(T, device=read.device)
        order = torch.where(read, pos, T).sort(dim=-1).values[..., :int(counts.max())]
        indices = torch.where(order < T, order, -1)
        return decode_attention(query, self.keys, self.values, indices=indices, scaling=scaling,
                                check_indices=False)  # positions < T by construction: no bounds check, no GPU sync

    def _decode_offloaded(self, query: torch.Tensor, dense: torch.Tensor, scaling: float) -> torch.Tensor:
        """Reload the dense chunks picked from the host store; join them to the sink and sparse copies and the
        device tail; every position is read once (duplicates are masked with index -1)."""
        B, H = dense.shape[:2]
        C, m, D = self.chunk, dense.shape[-1] - 2, self.keys.shape[-1]
        k = min(self.dense_chunks, m)
        chosen = torch.where(dense[..., :m], torch.arange(m, device=dense.device), m).sort(-1).values[..., :k]
        pick = chosen.to(self.store_keys.device)[..., None, None]
        reload_k = self.store_keys.reshape(B, H, m, C, D).gather(2, pick.expand(-1, -1, -1, C, D))
        Dv = self.store_values.shape[-1]
        reload_v = self.store_values.reshape(B, H, m, C, Dv).gather(2, pick.expand(-1, -1, -1, C, Dv))
        sparse_chunks = ~dense[..., :m]
        sink_ok = sparse_chunks[..., torch.arange(self.sink_keys.shape[2], device=dense.device) // C]
        sparse_ok = sparse_chunks[..., None] & (self.sparse_index[:, :, :m] >= self.sink)
        valid = torch.cat([dense.new_ones(B, H, k * C), sink_ok, sparse_ok.flatten(2),
                           dense.new_ones(B, H, self.keys.shape[2])], dim=-1)
        keys = torch.cat([reload_k.reshape(B, H, k * C, D).to(self.device), self.sink_keys,
                          self.sparse_keys[:, :, :m].flatten(2, 3), self.keys], dim=2)
        values = torch.cat([reload_v.reshape(B, H, k * C, Dv).to(self.device), self.sink_values,
                            self.sparse_values[:, :, :m].flatten(2, 3), self.values], dim=2)
        self.read_fractions.append(float(valid.sum(-1).float().mean()) / self.cumulative_length)
        slots = torch.arange(valid.shape[-1], device=valid.device)
        return decode_attention(query, keys, values, indices=torch.where(valid, slots, -1), scaling=scaling,
                                check_indices=False)  # slots of the assembled keys by construction

    # ----------------------------------------------------------------------------------------------- accounting
    def kv_tensors(self) -> list[torch.Tensor]:
        """Every K/V tensor kept: the device part, the host store, and the sink and sparse copies (offload)."""
        held = (self.keys, self.values, self.store_keys, self.store_values, self.sink_keys, self.sink_values,
                self.sparse_keys, self.sparse_values)
        return [t for t in held if isinstance(t, torch.Tensor)]

    def bookkeeping_tensors(self) -> list[torch.Tensor]:
        """Chunk mean keys, sparse-token positions and the last prefill / decode chunk tables."""
        kept = (self.summaries, self.sparse_index, self.last_dense, self.last_prefill_table)
        return [t for t in kept if isinstance(t, torch.Tensor)]

    def reset(self) -> None:
        super().reset()
        self._clear()


@dataclass
class BiLevel(KVMethod):
    """Video-XL-2's chunk-based prefill and bi-level KV decoding (Qin et al., 2025, arXiv 2506.19225), training-free.

    **Prefill.** The sequence is split into chunks of ``chunk`` tokens (absolute positions). A query attends densely
    to its own chunk (causally) and sparsely across chunks: the first ``sink`` tokens, the previous chunk, and the
    ``dense_chunks`` earlier chunks most relevant to its chunk's mean query (``q . mean chunk key``, summed over the
    GQA group; per row and KV head). This is :class:`mmaccel.kernels.Chunked` (one pattern per KV head) run by
    :func:`mmaccel.kernels.sparse_prefill_attention`; per query, ``sink + (dense_chunks + 2) * chunk`` keys at most.

    **Bi-level KV.** Once a chunk is complete it is kept in two forms: *dense* (all its K/V) and *sparse* (the
    ``sparse_tokens`` keys its last token attends most, averaged over the GQA group), with its mean key as summary.
    At each decode step, per row and **KV head** (the query heads of a GQA group share one selection; each layer
    selects on its own), the ``dense_chunks`` candidates with the highest ``q . mean chunk key`` are read densely,
    and so are the sink, the previous chunk and the current one; every other chunk is read through its sparse
    tokens only (:func:`mmaccel.kernels.decode_attention` with ``indices=``).

    **Memory.** As in Video-XL-2, which reloads dense KV from offload, the dense K/V of every chunk is *kept*:
    ``kv_cache_bytes`` is at least full attention's. The method bounds the K/V *read* per decode step (telemetry
    ``kv_read_fraction_per_step``) and the prefill compute. With ``offload=True`` the dense K/V of the candidate
    chunks lives in host memory and only the sink, the sparse copies and the last two chunks stay on the model's
    device (``kv_bytes_by_device``); ``kv_cache_bytes`` then also counts the copies. ``bookkeeping_bytes``: chunk
    mean keys, sparse-token positions and the last chunk tables.

    Parameters
    ----------
    chunk : int
        Tokens per chunk, >= 1 (default 256).
    dense_chunks : int
        Earlier chunks read densely per query chunk at prefill and per decode step (by relevance), besides the
        previous and the current chunk, >= 0 (default 4).
    sparse_tokens : int
        Tokens kept in each chunk's sparse form, >= 0 and at most ``chunk`` (default 32, 1/8 of a chunk).
    sink : int
        Initial tokens every query reads, >= 0 (default 4).
    offload : bool
        Keep the dense K/V of the candidate chunks in host memory and copy the selected ones back at each decode
        step (default false). On a CPU model the layout is the same but nothing moves.

    Notes
    -----
    With ``dense_chunks`` at least the number of chunks (or one chunk covering the sequence) every step reads
    everything: token-identical to full attention, and the telemetry warns. Offload copies are synchronous (no
    pinned buffers, no prefetch); a multi-token forward after chunks were offloaded (chunked prefill, a second
    turn) copies the whole store back for its duration. Padded batches, beam search and cropping raise. Chunked
    prefill works through ``generate(prefill_chunk_size=C)`` and the ``Chunked`` wrapper alike; each forward's
    query chunks are then scored by the mean of their queries in that forward.

    Raises
    ------
    ValueError
        On a bad hyper-parameter; at a forward, on a left-padded batch.
    """

    chunk: int = 256
    dense_chunks: int = 4
    sparse_tokens: int = 32
    sink: int = 4
    offload: bool = False

    method_name = "bilevel"
    uses_hooks = False

    def __post_init__(self):
        name = self.method_name
        for field, low, example in (("chunk", 1, 256), ("dense_chunks", 0, 4), ("sparse_tokens", 0, 32),
                                    ("sink", 0, 4)):
            _check_int(name, field, getattr(self, field), low, f"e.g. {name}:{field}={example}")
        if self.sparse_tokens > self.chunk:
            raise ValueError(f"{name}: sparse_tokens={self.sparse_tokens} exceeds chunk={self.chunk} (the sparse "
                             f"form is a subset of a chunk); lower sparse_tokens or raise chunk")
        if not isinstance(self.offload, bool):
            raise ValueError(  # noqa: TRY004 - a bad spec value, reported like every other one
                f"{name}: offload must be true or false, got {self.offload!r}")

    def make_layer(self, layer_idx: int) -> BiLevelLayer:
        return BiLevelLayer(self.chunk, self.dense_chunks, self.sparse_tokens, self.sink, self.offload)

    def make_cache(self, model: torch.nn.Module) -> OwnedAttentionCache:
        """A fresh cache for one ``generate`` run of ``model`` (close it, or use ``with``, when done)."""
        return OwnedAttentionCache(model, self)

    def telemetry(self, cache) -> dict:
        """``method``, ``spec``, the hyper-parameters, ``seen_tokens``, ``closed_chunks``,
        ``kv_read_fraction_per_step`` (per decode step, mean over layers of the fraction of the tokens read),
        ``kv_read_fraction`` (their mean), ``prefill_chunk_density`` (mean over layers and multi-token forwards of
        the fraction of (query chunk, earlier-or-own chunk) pairs read densely), ``kv_cache_bytes`` (all K/V kept:
        dense, plus the sparse and sink copies with offload), ``kv_bytes_by_device``, ``bookkeeping_bytes`` and
        ``warnings`` (one when nothing was sparse)."""
        record = super().telemetry(cache)  # method, spec, hyper-parameters, seen tokens, bytes, cache warnings
        layers = [l for l in getattr(cache, "layers", []) if isinstance(l, BiLevelLayer)]
        per_step = [sum(step) / len(step) for step in zip(*(l.read_fractions for l in layers))]
        densities = [d for l in layers for d in l.prefill_densities]
        by_device: dict[str, list] = {}
        for t in (t for l in layers for t in l.kv_tensors()):
            by_device.setdefault(str(t.device), []).append(t)
        if (per_step or densities) and min(per_step + densities) >= 1.0:
            record["warnings"].append(f"dense_chunks={self.dense_chunks} with chunk={self.chunk} covers the whole "
                                      "context: every step read all K/V (ran as full attention)")
        record.update(
            closed_chunks=record["seen_tokens"] // self.chunk,
            kept_tokens_per_layer=[l.cumulative_length for l in layers],  # dense K/V is kept (offloaded or not)
            evicted_tokens=0,
            kv_read_fraction_per_step=[round(f, 6) for f in per_step],
            kv_read_fraction=sum(per_step) / len(per_step) if per_step else 1.0,
            prefill_chunk_density=sum(densities) / len(densities) if densities else 1.0,
            kv_bytes_by_device={dev: _storage_bytes(ts) for dev, ts in sorted(by_device.items())},
        )
        return record

