"""KV-cache quantization (KIVI-style: keys per channel, values per token) with a full-precision residual window,
composable with prefill-time eviction.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", 2024, arXiv 2402.02750.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import attention, decode_attention
from .base import EvictingLayer, KVMethod, KVScorer, LayerStep, _check_int, bookkeeping_bytes, kv_cache_bytes
from .chunked import resolve_inner
from .owned import AttentionOwningLayer, OwnedAttentionCache

_BITS = (2, 4, 8, 16)
_AXES = ("channel", "token")


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max integer quantization of ``x``, one scale and zero point per slice along ``dim`` (KIVI, Liu
    et al., 2024, arXiv 2402.02750).

    Parameters
    ----------
    x : torch.Tensor
        Float tensor whose last dimension is a multiple of ``8 // bits`` (codes are packed along it).
    bits : {2, 4, 8}
        Code width.
    dim : int
        The dimension reduced for each scale (e.g. the token dimension of a group of tokens: per-channel scales).

    Returns
    -------
    (torch.Tensor, torch.Tensor, torch.Tensor)
        ``codes``: uint8, ``x`` with the last dimension divided by ``8 // bits`` (packed, low bits first);
        ``scale``, ``zero``: ``x.dtype``, ``x``'s shape with ``dim`` of size 1. ``x ~= code * scale + zero``, with an
        error of at most ``scale / 2`` per element.
    """
    levels = (1 << bits) - 1
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / levels).clamp(min=1e-8)
    codes = ((x - lo) / scale).round().clamp(0, levels).to(torch.uint8)
    return pack(codes, bits), scale.to(x.dtype), lo.to(x.dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes of ``bits`` bits, ``8 // bits`` per byte along the last dimension.

    The last dimension (``D`` codes) is cut into ``8 // bits`` consecutive slices of ``D * bits / 8``; byte ``j``
    holds code ``j`` of slice 0 in its low bits, code ``j`` of slice 1 in the next ``bits``, and so on, so unpacking
    writes each slice as one contiguous run of columns (:func:`dequantize`)."""
    per = 8 // bits
    if per == 1:
        return codes
    c = codes.reshape(*codes.shape[:-1], per, codes.shape[-1] // per).to(torch.int32)
    shifts = (torch.arange(per, device=codes.device, dtype=torch.int32) * bits)[:, None]
    return (c << shifts).sum(-2).to(torch.uint8)


def _slices(packed: torch.Tensor, bits: int):
    """The code slices of :func:`pack`'s layout: ``(i, uint8 codes of slice i)`` for each of the ``8 // bits``."""
    per = 8 // bits
    if per == 1:
        yield 0, packed
        return
    mask = (1 << bits) - 1
    for i in range(per):
        if i == 0:
            yield i, packed & mask
        elif i == per - 1:  # the top slice: the shift leaves only its bits
            yield i, packed >> (i * bits)
        else:
            yield i, (packed >> (i * bits)) & mask


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 codes with the last dimension multiplied by ``8 // bits``.

    Works in uint8 throughout (one shift and mask per slice), so a decode step's unpack moves bytes, not int32
    words."""
    per = 8 // bits
    if per == 1:
        return packed
    return torch.cat([codes for _, codes in _slices(packed, bits)], dim=-1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``unpack(codes) * scale + zero`` in the scale's dtype, slice by slice straight from the packed bytes (no
    unpacked copy of the whole cache: each code slice is converted, scaled and shifted in place in ``out``).

    Parameters
    ----------
    codes : torch.Tensor
        uint8 [..., n, D * bits / 8] packed codes (:func:`pack`).
    scale, zero : torch.Tensor
        Broadcastable to [..., n, D]: a last dimension of ``D`` (per-channel) or 1 (per-token).
    bits : {2, 4, 8}
    out : torch.Tensor, optional
        [..., n, D] written in place (a decode step reuses one buffer instead of allocating).

    Returns
    -------
    torch.Tensor
        [..., n, D] in ``scale``'s dtype (``out`` when given).
    """
    width = codes.shape[-1]
    D = width * (8 // bits)
    if out is None:
        out = torch.empty(*torch.broadcast_shapes(codes.shape[:-1] + (D,), scale.shape, zero.shape),
                          dtype=scale.dtype, device=codes.device)
    per_channel = scale.shape[-1] != 1

    def cut(t: torch.Tensor, i: int) -> torch.Tensor:
        return t[..., i * width:(i + 1) * width] if per_channel else t

    for i, c in _slices(codes, bits):  # copy (uint8 -> float) then scale in place: 2x faster than one mixed-dtype
        part = out[..., i * width:(i + 1) * width]  # addcmul on the CPU (measured, 4k x 3 heads x 64: 0.55 vs 1.7 ms)
        part.copy_(c)
        part.mul_(cut(scale, i)).add_(cut(zero, i))
    return out


def unpack_float(codes: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """The integer codes of packed ``codes`` as floats, slice-major, in ``out``'s memory: one shift/mask and one
    contiguous converting copy per code slice of :func:`pack`'s layout, no scale and no zero point. What the folded
    decode attention multiplies with (:meth:`QuantizedLayer.decode_attend`); a contiguous destination per slice
    converts 2.7x faster on the CPU than the interleaved columns of :func:`dequantize` (measured, [1, 3, 4064, 32]
    uint8: 0.047 vs 0.126 ms, 1 thread, fastest of 400 interleaved calls on a loaded 2-core machine).

    Parameters
    ----------
    codes : torch.Tensor
        uint8 [..., n, D * bits / 8] packed codes (:func:`pack`).
    bits : {2, 4, 8}
    out : torch.Tensor
        Contiguous float tensor of ``prod(...) * n * D`` elements (any shape), overwritten.

    Returns
    -------
    torch.Tensor
        [8 // bits, ..., n, D * bits / 8], a view of ``out``: slice ``i`` holds the codes of channels
        ``[i * D * bits / 8, (i + 1) * D * bits / 8)``, 0 .. 2**bits - 1 (exact in every float dtype for bits <= 8).
    """
    per = 8 // bits
    slices = out.view(per, *codes.shape)
    if per == 1:
        slices[0].copy_(codes)
        return slices
    mask = (1 << bits) - 1
    for i in range(per):  # the bit operation converts as it stores (no uint8 temporary for the lowest and top slice)
        if i == 0:
            torch.bitwise_and(codes, mask, out=slices[i])
        elif i == per - 1:
            torch.bitwise_right_shift(codes, i * bits, out=slices[i])
        else:
            torch.bitwise_and(codes >> (i * bits), mask, out=slices[i])
    return slices


def _split(t: torch.Tensor, per: int) -> torch.Tensor:
    """[..., D] -> [per, ..., D / per] (a view): the channel slices of :func:`unpack_float`'s layout."""
    return t.unflatten(-1, (per, t.shape[-1] // per)).movedim(-2, 0)


def _merge(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_split`: [per, ..., w] -> [..., per * w]."""
    return t.movedim(0, -2).flatten(-2)


class _Scratch:
    """One reusable K and V buffer pair, shared by the layers of a :class:`KVQuant` cache (layers attend one at a
    time), grown when a layer needs more room: the dequantized keys and values of the current layer plus its residual
    (prefill), or one buffer for the float codes of its keys and then of its values (a decode step,
    :meth:`QuantizedLayer.decode_attend`, fp32), without an allocation or a concatenation per layer and step. Its
    size is one layer's K/V, a transient working buffer, not held K/V."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @staticmethod
    def _room(buf: torch.Tensor | None, like: torch.Tensor, size: int) -> torch.Tensor:
        if buf is not None and buf.numel() >= size and buf.dtype == like.dtype and buf.device == like.device:
            return buf
        grown = 2 * buf.numel() if buf is not None and buf.dtype == like.dtype else 0
        return like.new_empty(max(size, grown, 64 * like.shape[0] * like.shape[1] * like.shape[3]))

    def get(self, like: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous [B, Hkv, slots, D] K and V views (``like``'s B, Hkv, D, dtype and device) of the buffers."""
        B, H, _, D = like.shape
        self.k, self.v = self._room(self.k, like, B * H * slots * D), self._room(self.v, like, B * H * slots * D)
        return self.k[:B * H * slots * D].view(B, H, slots, D), self.v[:B * H * slots * D].view(B, H, slots, D)

    def one(self, like: torch.Tensor, slots: int) -> torch.Tensor:
        """A contiguous [B, Hkv, slots, D] view of the K buffer alone (the V buffer is dropped if its dtype differs:
        a bf16 cache's decode in fp32 does not keep a bf16 pair besides)."""
        B, H, _, D = like.shape
        self.k = self._room(self.k, like, B * H * slots * D)
        if self.v is not None and self.v.dtype != like.dtype:
            self.v = None
        return self.k[:B * H * slots * D].view(B, H, slots, D)


class QuantizedLayer(EvictingLayer, AttentionOwningLayer):
    """An evicting layer whose older slots are stored as integer codes; the newest ``residual`` stay full precision.

    Attributes
    ----------
    keys, values : torch.Tensor
        [B, Hkv, R, D] the full-precision part (every slot until the first quantization, then the residual window).
    key_codes, value_codes : torch.Tensor or None
        uint8 [B, Hkv, N, D * bits / 8] the quantized slots, oldest first.
    key_scale, key_zero : torch.Tensor or None
        Per-channel keys: [B, Hkv, N / group, 1, D] (one per channel and group of ``group`` tokens); per-token:
        [B, Hkv, N, 1].
    value_scale, value_zero : torch.Tensor or None
        Per-token values: [B, Hkv, N, 1]; per-channel: [B, Hkv, N / group, 1, D].
    quantized_positions : torch.Tensor or None
        int64 [B, Hkv, N] sequence positions of the quantized slots.
    """

    def __init__(self, bits: int, key_axis: str, value_axis: str, group: int, residual: int,
                 scratch: _Scratch | None = None):
        super().__init__()
        self.scratch = scratch if scratch is not None else _Scratch()
        self.bits, self.key_axis, self.value_axis, self.group, self.residual = bits, key_axis, value_axis, group, residual
        self.key_codes = self.value_codes = None
        self.key_scale = self.key_zero = self.value_scale = self.value_zero = None
        self.quantized_positions = None

    @property
    def quantized(self) -> int:
        """Number of quantized slots ``N``."""
        return 0 if self.key_codes is None else int(self.key_codes.shape[2])

    def _quantize(self, x: torch.Tensor, axis: str):
        if axis == "token":  # one scale per token (over its channels)
            return quantize(x, self.bits, dim=-1)
        B, H, n, D = x.shape  # one scale per channel and group of tokens
        codes, scale, zero = quantize(x.reshape(B, H, n // self.group, self.group, D), self.bits, dim=3)
        return codes.reshape(B, H, n, -1), scale, zero

    def _dequantize(self, codes, scale, zero, axis: str, out: torch.Tensor | None = None) -> torch.Tensor:
        if axis == "token":
            return dequantize(codes, scale, zero, self.bits, out=out)
        B, H, n, _ = codes.shape
        grouped = codes.reshape(B, H, n // self.group, self.group, -1)
        if out is not None:  # a slice along the slot axis of the scratch buffer: splitting that axis is a view
            return dequantize(grouped, scale, zero, self.bits, out=out.view(B, H, n // self.group, self.group, -1))
        return dequantize(grouped, scale, zero, self.bits).reshape(B, H, n, -1)

    def quantize_overflow(self) -> None:
        """Move the oldest full-precision slots beyond the ``residual`` newest into the quantized store, in whole
        groups of ``group`` tokens (so every per-channel group is complete)."""
        if self.bits == 16:
            return
        n = (self.held - self.residual) // self.group * self.group
        if n <= 0:
            return
        kc, ks, kz = self._quantize(self.keys[:, :, :n].float(), self.key_axis)
        vc, vs, vz = self._quantize(self.values[:, :, :n].float(), self.value_axis)
        ks, kz, vs, vz = (t.to(self.keys.dtype) for t in (ks, kz, vs, vz))

        def cat(old, new):  # every stored tensor has the sequence (or group) axis at dim 2
            return new if old is None else torch.cat([old, new], dim=2)

        self.key_codes, self.value_codes = cat(self.key_codes, kc), cat(self.value_codes, vc)
        self.key_scale, self.key_zero = cat(self.key_scale, ks), cat(self.key_zero, kz)
        self.value_scale, self.value_zero = cat(self.value_scale, vs), cat(self.value_zero, vz)
        self.quantized_positions = cat(self.quantized_positions, self.positions[:, :, :n].clone())
        self.keep(torch.arange(n, self.held, device=self.keys.device))

    def full_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Hkv, N + R, D] dequantized + full-precision K and V, written into the shared scratch buffer (valid
        until the next layer's call; one layer at a time)."""
        if self.key_codes is None:
            return self.keys, self.values
        n, r = self.quantized, self.held
        k, v = self.scratch.get(self.keys, n + r)
        self._dequantize(self.key_codes, self.key_scale, self.key_zero, self.key_axis, out=k[:, :, :n])
        self._dequantize(self.value_codes, self.value_scale, self.value_zero, self.value_axis, out=v[:, :, :n])
        k[:, :, n:].copy_(self.keys)
        v[:, :, n:].copy_(self.values)
        return k, v

    def attend(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        """Attention of ``query`` [B, Hq, q, D] over the layer: one query token with quantized slots takes
        :meth:`decode_attend` (no dequantized copy); a prefill (``q > 1``) or a layer without codes attends over
        :meth:`full_kv`. Returns [B, Hq, q, D] in ``query``'s dtype."""
        if query.shape[2] == 1 and self.key_codes is not None:
            return self.decode_attend(query, scaling)
        k, v = self.full_kv()
        if query.shape[2] == 1:
            return decode_attention(query, k, v, scaling=scaling)
        return attention(query, k, v, causal=True, scaling=scaling)

    def decode_attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Decode attention straight from the codes: the scales and zero points are folded into the query and the
        probabilities, so no scaled float copy of K or V is ever written (KIVI, Liu et al., 2024, arXiv 2402.02750, fuses
        dequantization into its matmul kernels; here the same algebra runs as batched torch matmuls).

        With codes ``c`` converted to float once (:func:`unpack_float` into the shared scratch buffer, no multiply):

        - keys per channel, ``K[t, d] = s[g(t), d] c[t, d] + z[g(t), d]``:
          ``q . K_t = sum_d (q_d s[g, d]) c[t, d] + q . z[g]``: one query per group, ``[.., G, nq, w] @ [.., G, w,
          group]`` per code slice of ``w = D * bits / 8`` channels, summed over the slices, plus a bias per group;
        - keys per token, ``K[t] = s_t c_t + z_t``: ``q . K_t = s_t (q . c_t) + z_t sum(q)``;
        - values per token: ``sum_t p_t (s_t c_t + z_t) = (p * s) @ c + p @ z``;
        - values per channel: ``sum_g s[g] * (p_g @ c_g) + (sum_{t in g} p_t) @ z[g]``.

        Every (key_axis, value_axis) pair folds; nothing falls back. The full-precision residual enters the same
        softmax: the scores over ``[quantized | residual]`` are one fp32 softmax, then the probabilities are split.
        Quantized slots always come in whole groups (:meth:`quantize_overflow`), so there is no partial group.
        Everything runs in fp32 whatever the cache's dtype (equal to attention over :meth:`full_kv` within fp32
        rounding for an fp32 cache).

        Parameters
        ----------
        query : torch.Tensor
            [B, Hq, 1, D]; ``Hq`` a multiple of the layer's ``Hkv`` (GQA: ``nq = Hq // Hkv`` query heads share a KV
            head and its scales).
        scaling : float
            Softmax scale.

        Returns
        -------
        torch.Tensor
            [B, Hq, 1, D] in ``query``'s dtype.

        Raises
        ------
        ValueError
            If the layer holds no quantized slots or ``query`` is not one token of a multiple of ``Hkv`` heads.
        """
        B, Hq, L, D = query.shape
        H = self.key_codes.shape[1] if self.key_codes is not None else 0
        if L != 1 or H == 0 or Hq % H:
            raise ValueError(f"decode_attend takes one query token [B, Hq, 1, D] with Hq a multiple of the "
                             f"{H} KV heads and quantized slots; got {tuple(query.shape)} (use attend)")
        nq, n, f32 = Hq // H, self.quantized, torch.float32
        q = query.reshape(B, H, nq, D).to(f32) * scaling
        codes = self.scratch.one(q.new_empty(B, H, 0, D), n)  # the keys' codes, then the values' (hot in cache)
        scores = q.new_empty(B, H, nq, n + self.held)
        self._fold_keys(q, unpack_float(self.key_codes, self.bits, codes), scores[..., :n])
        scores[..., n:] = q @ self.keys.to(f32).transpose(-1, -2)
        probs = scores.softmax(-1)
        out = self._fold_values(probs[..., :n], unpack_float(self.value_codes, self.bits, codes))
        out.add_(probs[..., n:] @ self.values.to(f32))
        return out.reshape(B, Hq, 1, D).to(query.dtype)

    def _fold_keys(self, q: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> None:
        """Scores [B, H, nq, n] (written to ``out``) of the scaled queries ``q`` [B, H, nq, D] against the float
        codes, slice-major [per, B, H, n, D / per] (:func:`unpack_float`)."""
        B, H, nq, _D = q.shape
        per, n = codes.shape[0], codes.shape[3]
        scale, zero = self.key_scale.float(), self.key_zero.float()
        if self.key_axis == "channel":  # scale, zero [B, H, G, 1, D]
            G = n // self.group
            per_group = _split(q[:, :, None] * scale, per)  # [per, B, H, G, nq, w]
            # [G, nq, w] @ [G, w, group] (the codes as the transposed operand), summed over the slices
            s = (per_group @ codes.view(per, B, H, G, self.group, -1).transpose(-1, -2)).sum(0)  # [B, H, G, nq, group]
            s += (q[:, :, None] * zero).sum(-1, keepdim=True)  # [B, H, G, nq, 1]
            out.view(B, H, nq, G, self.group).copy_(s.transpose(2, 3))
        else:  # scale, zero [B, H, n, 1]
            s = (_split(q, per) @ codes.transpose(-1, -2)).sum(0)  # [B, H, nq, n]: the codes as the transposed operand
            torch.addcmul(s * scale.transpose(-1, -2), q.sum(-1, keepdim=True), zero.transpose(-1, -2), out=out)

    def _fold_values(self, probs: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """``probs`` [B, H, nq, n] times the quantized values (float codes, slice-major [per, B, H, n, D / per]):
        [B, H, nq, D] fp32."""
        B, H, nq, n = probs.shape
        per = codes.shape[0]
        scale, zero = self.value_scale.float(), self.value_zero.float()
        if self.value_axis == "token":  # scale, zero [B, H, n, 1]
            out = _merge((probs * scale.transpose(-1, -2)) @ codes)  # [B, H, nq, D]
            return out.add_(probs @ zero)
        G = n // self.group  # scale, zero [B, H, G, 1, D]
        p = probs.view(B, H, nq, G, self.group).transpose(2, 3)  # [B, H, G, nq, group]
        parts = p @ codes.view(per, B, H, G, self.group, -1)  # [per, B, H, G, nq, w]
        out = _merge((parts * _split(scale, per)).sum(3))  # [B, H, nq, D]
        return out.add_(p.sum(-1).transpose(-1, -2) @ zero[:, :, :, 0])

    def kv_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.key_codes, self.value_codes) if t is not None]

    def bookkeeping_tensors(self) -> list[torch.Tensor]:
        extra = (self.key_scale, self.key_zero, self.value_scale, self.value_zero, self.quantized_positions)
        return [*super().bookkeeping_tensors(), *(t for t in extra if t is not None)]


@dataclass
class KVQuant(KVMethod):
    """KIVI-style K/V quantization (Liu et al., 2024, arXiv 2402.02750), optionally after prefill-time eviction.

    After every forward, each layer's full-precision slots beyond the ``residual`` newest are quantized in whole
    groups of ``group`` tokens: keys per channel (one scale and zero per channel and group, KIVI's choice: key
    outliers sit in fixed channels), values per token (one per token), or either on either axis. Codes are packed
    ``8 // bits`` per byte. With a wrapped eviction method (``kvquant:bits=4:method=snapkv,budget=256``) the prefill
    is scored and evicted on full-precision K/V first, then what is kept is quantized. A decode step attends straight
    from the codes (:meth:`QuantizedLayer.decode_attend`: scales and zero points folded into the query and the
    probabilities, the codes converted to float once into a transient buffer of one layer, no scaled copy); a
    prefill dequantizes the layer's codes on the fly (the same transient buffer) and runs
    :func:`mmaccel.kernels.attention`.

    ``kv_cache_bytes`` reports the codes plus the full-precision residual; scales, zeros and positions are
    ``bookkeeping_bytes``. ``bits=16`` stores everything in full precision (a passthrough, bit-exact with the wrapped
    method).

    Parameters
    ----------
    bits : {2, 4, 8, 16}
        Code width (default 4).
    key_axis, value_axis : {"channel", "token"}
        The axis a scale covers for keys (default "channel") and values (default "token").
    group : int
        Tokens per per-channel group, >= 1 (default 32); quantization moves whole groups.
    residual : int
        Newest tokens kept in full precision, >= 0 (default 32).
    method : KVMethod or str
        The eviction method run first (default "full": no eviction), or its spec with commas for colons. Only
        prefill-time eviction composes (snapkv, pyramidkv, tova, knorm); methods that evict at every decode step
        (h2o, streaming) or store K/V their own way are refused.

    Notes
    -----
    Chunked prefill (``generate(prefill_chunk_size=C)`` or the ``Chunked`` wrapper) works without eviction; with
    eviction a later chunk would be scored against quantized keys and is refused. Padded batches raise when a method evicts.

    Raises
    ------
    ValueError
        On a bad hyper-parameter or a wrapped method that does not compose; head_dim not divisible by
        ``8 // bits`` at the first quantization.
    """

    bits: int = 4
    key_axis: str = "channel"
    value_axis: str = "token"
    group: int = 32
    residual: int = 32
    method: object = "full"

    method_name = "kvquant"
    prefill_is_full = True  # full-precision prefill, then evict (prefill-time only) and quantize

    @property
    def supports_chunking(self) -> bool:
        """Chunked prefill works without eviction only (a later chunk would score quantized keys)."""
        return self.method.name == "full"

    chunking_error = "with eviction a later prefill chunk would be scored against quantized keys; use method=full"

    def __post_init__(self):
        if self.bits not in _BITS:
            raise ValueError(f"kvquant: bits must be one of {_BITS}, got {self.bits!r}; e.g. kvquant:bits=4")
        for name in ("key_axis", "value_axis"):
            if getattr(self, name) not in _AXES:
                raise ValueError(f"kvquant: {name} must be one of {_AXES}, got {getattr(self, name)!r}")
        _check_int("kvquant", "group", self.group, 1, "e.g. kvquant:group=32")
        _check_int("kvquant", "residual", self.residual, 0, "e.g. kvquant:residual=32")
        inner = resolve_inner(self.method, "kvquant")
        if inner.name != "full" and (not isinstance(inner, KVScorer) or inner.evicts_on_decode
                                     or type(inner.make_layer(0)) is not EvictingLayer):
            raise ValueError(
                f"kvquant composes with prefill-time eviction (snapkv, pyramidkv, tova, knorm), not {inner.name}; "
                "e.g. kvquant:bits=4:method=snapkv,budget=256"
            )
        self.method = inner

    @property
    def spec(self) -> str:
        return (f"kvquant:bits={self.bits}:key_axis={self.key_axis}:value_axis={self.value_axis}:group={self.group}"
                f":residual={self.residual}:method={self.method.spec.replace(':', ',')}")

    @property
    def padding_safe(self) -> bool:
        return self.method.name == "full"

    def make_layer(self, layer_idx: int) -> QuantizedLayer:
        # the layers of one cache share one dequantization buffer: layer 0 starts a cache, and a new one
        scratch = getattr(self, "_scratch", None)
        if layer_idx == 0 or scratch is None:
            scratch = self._scratch = _Scratch()
        return QuantizedLayer(self.bits, self.key_axis, self.value_axis, self.group, self.residual, scratch)

    def make_cache(self, model: torch.nn.Module) -> OwnedAttentionCache:
        """A fresh cache for one ``generate`` run of ``model`` (close it, or use ``with``, when done)."""
        return OwnedAttentionCache(model, self)

    def on_step(self, step: LayerStep) -> None:
        layer = step.layer
        if self.method.name != "full":
            if step.phase == "prefill" and layer.quantized:
                raise ValueError("kvquant with eviction cannot run a second prefill chunk (it would score quantized "
                                 "keys); prefill in one forward or drop the eviction method")
            self.method.on_step(step)
        layer.quantize_overflow()

    def telemetry(self, cache) -> dict:
        """``method``, ``spec``, the hyper-parameters, ``seen_tokens``, ``kept_tokens_per_layer`` (quantized +
        residual), ``quantized_tokens_per_layer``, ``evicted_tokens``, ``kv_cache_bytes`` (codes + residual),
        ``bookkeeping_bytes`` (scales, zeros, positions), ``warnings`` (with the wrapped method's)."""
        layers = [l for l in getattr(cache, "layers", []) if isinstance(l, QuantizedLayer)]
        kept = [l.quantized + l.held for l in layers]
        seen = [l.cumulative_length for l in layers]
        warnings = list(getattr(cache, "warnings", []))
        targets = [(l.target, l.prefill_length) for l in layers if l.target is not None]
        if targets and all(t >= n for t, n in targets):
            warnings.insert(0, f"budget {min(t for t, _ in targets)} >= context {targets[0][1]} tokens: "
                               f"{self.method.name} evicted nothing (quantization only)")
        return {
            "method": self.name,
            "spec": self.spec,
            "bits": self.bits,
            "key_axis": self.key_axis,
            "value_axis": self.value_axis,
            "group": self.group,
            "residual": self.residual,
            "inner_method": self.method.spec,
            "seen_tokens": max(seen, default=0),
            "kept_tokens_per_layer": kept,
            "quantized_tokens_per_layer": [l.quantized for l in layers],
            "evicted_tokens": int(sum(s - k for s, k in zip(seen, kept))),
            "kv_cache_bytes": kv_cache_bytes(cache),
            "bookkeeping_bytes": bookkeeping_bytes(cache),
            "warnings": warnings,
        }
