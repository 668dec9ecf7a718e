"""EAGLE-style feature-level draft head: one decoder layer over [target feature, next token embedding].

The head reads the target's own last hidden state ``f_i`` (the features its LM head turns into logits) and the
embedding of the token that followed, ``x_{i+1}``, and predicts the next feature ``f_{i+1}``; the target's LM head,
restricted to a frequency-ranked sub-vocabulary (FR-Spec), turns that into the next draft token. Drafting ``k``
tokens costs ``k`` forwards of one small layer; the target's features come for free from its verification forwards
(a forward hook on the target's decoder, removed at :meth:`Eagle.end`). The head's weights are a few MB; the token
embedding and the LM head are read from the target itself, never stored.

A head is a folder (``assets/models/NAME/`` for a zoo name, or any path) holding ``config.json`` (the shapes, the
target's config fingerprint, the sub-vocabulary's token ids) and ``head.safetensors``; ``mmaccel zoo train
smollm2-135m-eagle`` trains one (:mod:`mmaccel.zoo.train.eagle`).

References
----------
Li, Wei, Zhang, Zhang, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", 2024, arXiv 2401.15077
(feature-level autoregression over [feature, shifted token]).
Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test", 2025,
arXiv 2503.01840 (training on the head's own predicted features).
Zhao et al., "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling", 2025,
arXiv 2502.14856 (the draft's LM head over the most frequent tokens only).
"""
from __future__ import annotations

import json
import logging
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..longctx.head_pattern import config_fingerprint
from .base import ColumnPositions, Draft, Drafter, left_padding
from .sampling import Sampler

logger = logging.getLogger(__name__)

FORMAT = "mmaccel-eagle-head/1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "head.safetensors"
_FIX = "train one with `mmaccel zoo train smollm2-135m-eagle` (or mmaccel.zoo.train.eagle.train)"


@dataclass
class EagleHeadConfig:
    """Shapes of an :class:`EagleHead` and what it was trained for (stored as ``config.json``).

    Attributes
    ----------
    hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size : int
        The decoder layer's shapes (those of the target's layers, so it can start from one of them).
    rope_theta : float
        RoPE base of the head's own attention.
    rms_norm_eps : float
    vocab_ids : list of int
        The FR-Spec sub-vocabulary: target token ids the head can propose, most frequent first.
    target : str
        Name of the target it was trained for (``"smollm2-135m"``).
    fingerprint : dict
        The target's :func:`~mmaccel.longctx.head_pattern.config_fingerprint`; :meth:`Eagle.begin` refuses another.
    vocab_size : int
        The target's full vocabulary size.
    train : dict
        Recipe and results of the training run (free-form, for the card).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    vocab_ids: list
    target: str
    fingerprint: dict
    vocab_size: int
    format: str = FORMAT
    train: dict = field(default_factory=dict)

    @classmethod
    def from_target(cls, target, vocab_ids, target_name: str) -> EagleHeadConfig:
        """The shapes of ``target``'s decoder layers (a Llama-like config), with sub-vocabulary ``vocab_ids``."""
        c = target.config
        heads = c.num_attention_heads
        rope = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", None) or 1e4
        return cls(hidden_size=c.hidden_size, num_heads=heads, num_kv_heads=getattr(c, "num_key_value_heads", heads),
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                   intermediate_size=c.intermediate_size, rope_theta=float(rope),
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), vocab_ids=[int(v) for v in vocab_ids],
                   target=target_name, fingerprint=config_fingerprint(c), vocab_size=int(c.vocab_size))


class HeadCache:
    """The head's own K/V, preallocated: [B, H_kv, capacity, D] each, ``length`` slots filled; ``crop`` is O(1)."""

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, capacity: int, dtype, device):
        self.k = torch.empty(batch, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` [B, H_kv, n, D] after the filled slots; return views of all filled slots."""
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:  # grow (doubling)
            grow = max(end, 2 * self.k.shape[2]) - self.k.shape[2]
            pad = self.k.new_empty(*self.k.shape[:2], grow, self.k.shape[3])
            self.k, self.v = torch.cat([self.k, pad], dim=2), torch.cat([self.v, pad.clone()], dim=2)
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` slots."""
        self.length = min(self.length, int(length))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class EagleHead(nn.Module):
    """The draft head: ``fc([embed(x_{i+1}), f_i])``, one pre-norm Llama-style decoder layer (GQA, RoPE, SwiGLU) and
    a final RMSNorm, so its output lives where the target's features do (after the target's final norm).

    Parameters
    ----------
    config : EagleHeadConfig

    Notes
    -----
    Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", 2024, arXiv 2401.15077.
    Written in plain torch (no transformers module in the draft loop) because on a CPU the per-call overhead of a
    library forward is a large part of one small layer's cost.
    """

    def __init__(self, config: EagleHeadConfig):
        super().__init__()
        c = self.config = config
        H, D = c.hidden_size, c.head_dim
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.input_norm = nn.RMSNorm(H, eps=c.rms_norm_eps)
        self.q_proj = nn.Linear(H, c.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, c.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, c.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(c.num_heads * D, H, bias=False)
        self.post_norm = nn.RMSNorm(H, eps=c.rms_norm_eps)
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)
        self.norm = nn.RMSNorm(H, eps=c.rms_norm_eps)  # back to the target's post-norm feature space
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("vocab_ids", torch.tensor(c.vocab_ids, dtype=torch.long), persistent=False)

    # -- pieces, shared by drafting (:meth:`forward`) and training's multi-step unroll
    def inputs(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[B, n, H] features and next-token embeddings -> [B, n, H] the layer's input."""
        return self.fc(torch.cat([embeds, features], dim=-1))

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """Rotated ``q`` [B, Hq, n, D], ``k``, ``v`` [B, H_kv, n, D] of input ``x`` [B, n, H] at ``positions`` [B, n]."""
        c = self.config
        B, n, _ = x.shape
        h = self.input_norm(x)
        q = self.q_proj(h).view(B, n, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        freqs = positions[:, None, :, None].to(self.inv_freq.dtype) * self.inv_freq  # [B, 1, n, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def attend(self, q, k, v, mask=None, causal: bool = False) -> torch.Tensor:
        """GQA attention: ``q`` [B, Hq, n, D] over ``k``, ``v`` [B, H_kv, S, D]; ``mask`` bool [B or 1, 1, n, S]
        (True = attend) or ``causal`` over the last ``n`` keys. Returns [B, n, Hq * D]."""
        c = self.config
        rep = c.num_heads // c.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if causal and mask is None and k.shape[2] != q.shape[2]:
            n, S = q.shape[2], k.shape[2]
            mask = torch.ones(n, S, dtype=torch.bool, device=q.device).tril(S - n)[None, None]
            causal = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    def block_out(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + output projection, the SwiGLU MLP, then the final norm: [B, n, H] predicted features."""
        x = x + self.o_proj(attn)
        h = self.post_norm(x)
        return self.norm(x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)))

    def forward(self, features, embeds, positions, cache: HeadCache | None = None, mask=None) -> torch.Tensor:
        """Predict the next features.

        Parameters
        ----------
        features : torch.Tensor
            [B, n, H] target (or predicted) features ``f_i``.
        embeds : torch.Tensor
            [B, n, H] embeddings of the tokens that follow them, ``x_{i+1}``.
        positions : torch.LongTensor
            [B, n] RoPE positions.
        cache : HeadCache, optional
            The head's K/V of earlier columns; the new ones are appended.
        mask : torch.Tensor, optional
            bool [B, 1, n, S] over all cached + new keys (True = attend); default causal.

        Returns
        -------
        torch.Tensor
            [B, n, H] predicted features ``f_{i+1}``.
        """
        x = self.inputs(features, embeds)
        q, k, v = self.qkv(x, positions)
        if cache is not None:
            k, v = cache.append(k, v)
        return self.block_out(x, self.attend(q, k, v, mask=mask, causal=mask is None))

    def unroll(self, features: torch.Tensor, embeds: torch.Tensor, steps: int):
        """Training-time test (EAGLE-3, Li et al., 2025, arXiv 2503.01840): ``steps`` drafting steps for every
        column at once, each equal to what :class:`Eagle` computes while drafting.

        Column ``i`` at step ``s`` reads the feature predicted at step ``s - 1`` for column ``i`` (step 1: the given
        ``features[:, i]``) and ``embeds[:, i]``, and attends to the step-1 keys of columns ``<= i - s + 1`` plus the
        step-``t`` key of column ``i - (s - t)`` for ``t = 2 .. s``: the head's cache when a chain that started at
        column ``i - s + 1`` drafts its ``s``-th token. Columns ``i < s - 1`` have no such chain (their outputs are
        meaningless).

        Parameters
        ----------
        features, embeds : torch.Tensor
            [B, m, H] true features ``f_i`` and embeddings of ``t_{i+1}``, columns at positions ``0 .. m - 1``.
        steps : int
            ``>= 1``.

        Yields
        ------
        torch.Tensor
            [B, m, H] the predicted features of step ``s = 1 .. steps`` (column ``i`` predicts ``f_{i+1}``).
        """
        B, m, _ = features.shape
        idx = torch.arange(m, device=features.device)
        pos = idx[None].expand(B, -1)
        keys, vals, prev = [], [], None
        for s in range(1, steps + 1):
            x_feat = features if s == 1 else torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
            x = self.inputs(x_feat, embeds)
            q, k, v = self.qkv(x, pos)
            keys.append(k)
            vals.append(v)
            if s == 1:
                attn = self.attend(q, k, v, causal=True)
            else:
                blocks = [idx[None, :] <= idx[:, None] - s + 1]
                blocks += [idx[None, :] == idx[:, None] - (s - t) for t in range(2, s + 1)]
                attn = self.attend(q, torch.cat(keys, dim=2), torch.cat(vals, dim=2),
                                   mask=torch.cat(blocks, dim=1)[None, None])
            prev = self.block_out(x, attn)
            yield prev

    def logits(self, features: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
        """[B, n, V'] logits over the sub-vocabulary, from ``lm_weight`` [V', H] (the target's LM head rows of
        ``vocab_ids``)."""
        return features @ lm_weight.T


# ------------------------------------------------------------------------------------------------ files
def head_dir(name_or_path) -> Path:
    """Folder of a head: a path, or a zoo name under ``assets/models``.

    Raises
    ------
    ValueError
        If neither holds a ``config.json`` and ``head.safetensors``; the message names the training command.
    """
    from ..models.zoo import assets_dir

    path = Path(str(name_or_path))
    for folder in (path, assets_dir() / str(name_or_path)):
        if (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file():
            return folder
    shipped = sorted(p.parent.name for p in assets_dir().glob(f"*/{WEIGHTS_FILE}")) or ["none"]
    raise ValueError(f"unknown EAGLE head {str(name_or_path)!r}: no folder with {CONFIG_FILE} and {WEIGHTS_FILE} there "
                     f"or in the zoo (trained heads: {', '.join(shipped)}); {_FIX}")


#: The dtypes ``head.safetensors`` may store (:func:`save_head`'s ``save_dtype``); :func:`load_head` casts them.
SAVE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def save_head(head: EagleHead, folder, *, save_dtype: torch.dtype = torch.float16) -> Path:
    """Write ``config.json`` and ``head.safetensors`` (the head's own weights only) into ``folder``.

    Parameters
    ----------
    head : EagleHead
    folder : path
        Created if missing; its two files are overwritten.
    save_dtype : torch.dtype
        The stored dtype of the weights, one of :data:`SAVE_DTYPES` (default float16: 2 bytes per parameter, what
        the committed ``smollm2-135m-eagle`` stores). :func:`load_head` casts back to the dtype asked for.

    Returns
    -------
    Path
        ``folder``.

    Raises
    ------
    ValueError
        If ``save_dtype`` is not one of :data:`SAVE_DTYPES` (raised before anything is written).
    """
    from safetensors.torch import save_file

    if save_dtype not in SAVE_DTYPES:
        raise ValueError(f"save_dtype must be one of {', '.join(map(str, SAVE_DTYPES))}; got {save_dtype!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(asdict(head.config), indent=1) + "\n")
    state = {k: v.detach().to("cpu", save_dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": FORMAT})
    return folder


def load_head(name_or_path, dtype=torch.float32, device="cpu") -> EagleHead:
    """Load a trained head (see :func:`head_dir`) in ``dtype`` on ``device``.

    The stored weights (any of :data:`SAVE_DTYPES`; the committed head stores float16) are cast to ``dtype`` as
    they are loaded: every parameter of the returned head is ``dtype``.

    Raises
    ------
    ValueError
        Unknown name or path, a file of another format, or weights of a dtype not in :data:`SAVE_DTYPES`.
    """
    from safetensors.torch import load_file

    folder = head_dir(name_or_path)
    raw = json.loads((folder / CONFIG_FILE).read_text())
    if raw.get("format") != FORMAT:
        raise ValueError(f"{folder / CONFIG_FILE} is not an EAGLE head ({raw.get('format')!r}, expected {FORMAT!r})")
    state = load_file(str(folder / WEIGHTS_FILE))
    odd = {k: str(v.dtype) for k, v in state.items() if v.dtype not in SAVE_DTYPES}
    if odd:
        raise ValueError(f"{folder / WEIGHTS_FILE} stores weights of a dtype a head cannot hold ({odd}); expected one "
                         f"of {', '.join(map(str, SAVE_DTYPES))}: rewrite it with save_head")
    head = EagleHead(EagleHeadConfig(**raw)).to(device=device, dtype=dtype)
    head.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()})
    return head.eval()


def _decoder(model: nn.Module) -> nn.Module:
    """The module whose output's first element is the target's last hidden state, after the final norm."""
    get = getattr(model, "get_decoder", None)
    dec = get() if callable(get) else getattr(model, "model", None)
    if dec is None or not isinstance(dec, nn.Module):
        raise ValueError(f"the EAGLE drafter reads the target's last hidden states from its decoder; "
                         f"{type(model).__name__} exposes none (get_decoder())")
    return dec


# ------------------------------------------------------------------------------------------------ the drafter
class Eagle(Drafter):
    """Draft with an EAGLE head over the target's own features (Li et al., "EAGLE: Speculative Sampling Requires
    Rethinking Feature Uncertainty", 2024, arXiv 2401.15077), proposing from an FR-Spec sub-vocabulary (Zhao et al.,
    2025, arXiv 2502.14856).

    Each step the head first catches up on the columns the target has verified since the last step (their true
    features), then runs ``k`` one-column forwards on its own predicted features. Greedy drafting takes the argmax
    over the sub-vocabulary; sampling draws from the sampler's filtered softmax over the sub-vocabulary (zero mass
    elsewhere) and hands that ``q`` to verification, so speculative sampling stays lossless.

    Parameters
    ----------
    head : str, path or EagleHead
        A trained head: zoo name (default ``"smollm2-135m-eagle"``), folder, or a module.
    stop_below : float, optional
        Stop drafting once the product of the head's top-1 probabilities falls below this, in ``(0, 1)``
        (SpecDec++-style early stop, Huang et al., 2024, arXiv 2405.19715); ``None`` always drafts ``k``.

    Raises
    ------
    ValueError
        At construction: an unknown head or ``stop_below`` outside ``(0, 1)``. At :meth:`begin`: a target whose
        config fingerprint (layers, heads, hidden size, vocabulary) differs from the head's.
    """

    name: ClassVar[str] = "eagle"
    observes_any_draft: ClassVar[bool] = True  # it keeps the verified columns' features, whoever drafted them

    def __init__(self, head="smollm2-135m-eagle", stop_below: float | None = None):
        if stop_below is not None and not 0.0 < float(stop_below) < 1.0:
            raise ValueError(f"stop_below must be in (0, 1) or None, got {stop_below!r}")
        self.head = head if isinstance(head, EagleHead) else load_head(head)
        self.stop_below = None if stop_below is None else float(stop_below)
        self._target_ref = None
        self._hook = None

    # -- per target: shared weights and the feature hook
    def _bind(self, target) -> None:
        if self._target_ref is not None and self._target_ref() is target:
            return
        want, got = self.head.config.fingerprint, config_fingerprint(target.config)
        if want != got:
            diff = {k: (want.get(k), got.get(k)) for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)}
            raise ValueError(f"this EAGLE head was trained for {self.head.config.target}, and the target's config "
                             f"differs ({diff}: head vs target); {_FIX.replace('train one', 'train a head for it')}")
        p = next(target.parameters())
        self.head.to(device=p.device, dtype=p.dtype)
        self._embed = target.get_input_embeddings()
        lm = target.get_output_embeddings().weight
        self._lm_weight = lm.detach()[self.head.vocab_ids.to(lm.device)].contiguous()  # [V', H]
        self._lm_weight_t = self._lm_weight.T.contiguous()  # [H, V']: a one-row product reads it 2.5x faster on a CPU
        self._decoder = _decoder(target)
        self._target_ref = weakref.ref(target)

    def _capture(self, module, args, output) -> None:
        hidden = (output[0] if isinstance(output, (tuple, list)) else output.last_hidden_state).detach()
        if self._expect_prefill:  # the prefill: every column is verified
            self._feats.append(hidden)
            self._expect_prefill = False
        else:  # a verification: kept in part at observe()
            self._captured = hidden

    def draft_modules(self) -> list[nn.Module]:
        """The head (the embedding and LM head it reads are the target's)."""
        return [self.head]

    def begin(self, target, input_ids, attention_mask, sampler: Sampler) -> None:
        """Check the head against the target, hook the target's decoder (its prefill features are caught next),
        start a fresh head cache.

        Raises
        ------
        ValueError
            A target the head was not trained for.
        """
        self._bind(target)
        if self._hook is not None:
            self._hook.remove()
        self._hook = self._decoder.register_forward_hook(self._capture)
        B, L = input_ids.shape
        p = next(self.head.parameters())
        c = self.head.config
        self._cache = HeadCache(B, c.num_kv_heads, c.head_dim, capacity=2 * L + 64, dtype=p.dtype, device=p.device)
        self._pads = left_padding(attention_mask)
        self._positions = ColumnPositions(self._pads, B, p.device, capacity=2 * L + 64)
        self._captured = None
        self._feats = []  # verified target features not yet fed to the head, [B, n, H] each
        self._expect_prefill = L > 1  # the engine prefills the prompt minus its last token
        self._true_length = 0  # head cache slots computed from true target features
        self._forwards = self._proposed = 0

    def _mask(self, attention_mask, start: int, stop: int):
        """bool [B, 1, stop - start, stop] mask (causal, pads off) or ``None`` without padding."""
        if self._pads is None:
            return None
        keys = attention_mask[:, :stop].bool()
        causal = torch.ones(stop - start, stop, dtype=torch.bool, device=keys.device).tril(start)
        return (causal[None] & keys[:, None, :])[:, None]

    def propose(self, sequences, attention_mask, k, sampler, generator=None) -> Draft:
        """Draft up to ``k`` tokens; see :meth:`Drafter.propose`. Returns ``q`` [B, k, V] when sampling."""
        head = self.head
        seq = sequences  # [B, T], last column pending
        B, T = seq.shape
        P = self._cache.length  # columns the head has already seen with true features
        if not self._feats:  # a one-token prompt: no target feature yet, nothing to draft from
            return Draft(tokens=seq.new_zeros(B, 0))
        feats = torch.cat(self._feats, dim=1) if len(self._feats) > 1 else self._feats[0]
        self._feats = []
        if feats.shape[1] != T - 1 - P:
            raise RuntimeError(f"EAGLE head out of step: {feats.shape[1]} new target features for columns {P}..{T - 2}")
        mask_full = None
        if self._pads is not None:
            mask_full = torch.cat([attention_mask, attention_mask.new_ones(B, k)], dim=1)
        emb = self._embed(seq[:, P + 1:T])
        out = head(feats.to(emb.dtype), emb, self._positions(P, T - 1), self._cache,
                   None if mask_full is None else self._mask(mask_full, P, T - 1))[:, -1:]
        self._true_length = T - 1
        forwards = 1
        tokens, probs, confidence = [], [], None
        for i in range(k):
            logits = out[:, -1] @ self._lm_weight_t  # [B, V'], head.logits with the weight pre-transposed
            if sampler.greedy:
                tok = head.vocab_ids[logits.argmax(dim=-1)]
                p = None
                top1 = logits.float().softmax(-1).max(-1).values if self.stop_below is not None else None
            else:
                full = logits.new_full((B, head.config.vocab_size), float("-inf"))
                full[:, head.vocab_ids] = logits
                tok, p = sampler.choose(full, generator)
                top1 = p.max(dim=-1).values
            tokens.append(tok[:, None])
            probs.append(p)
            if self.stop_below is not None:
                confidence = top1 if confidence is None else confidence * top1
                if float(confidence.min()) < self.stop_below:
                    break
            if i + 1 < k:
                col = T - 1 + i  # input (predicted f_col, d_{i+1}) at column col
                out = head(out, self._embed(tok[:, None]), self._positions(col, col + 1), self._cache,
                           None if mask_full is None else self._mask(mask_full, col, col + 1))
                forwards += 1
        self._forwards += forwards
        self._proposed += len(tokens)
        draft_tokens = torch.cat(tokens, dim=1)
        return Draft(tokens=draft_tokens, probs=None if sampler.greedy else torch.stack(probs, dim=1),
                     forwards=forwards)

    def observe(self, target_logits, draft: Draft, kept: int) -> None:
        """Keep the true features of the pending token and the ``kept`` accepted drafts; drop the head's K/V of its
        own predicted columns."""
        self._cache.crop(self._true_length)
        if self._captured is not None:
            self._feats.append(self._captured[:, : kept + 1])
            self._captured = None

    def end(self) -> dict:
        """Remove the feature hook; report head forwards and draft tokens."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._captured, self._feats, self._cache = None, [], None
        return {"head": self.head.config.target + "-eagle", "head_forwards": self._forwards,
                "draft_tokens": self._proposed, "draft_vocab": len(self.head.config.vocab_ids)}


def head_parameters(head: EagleHead) -> int:
    """Parameters of the head's own weights (the embedding and LM head are the target's)."""
    return sum(p.numel() for p in head.parameters())


def expected_head_bytes(head: EagleHead) -> int:
    """Bytes of ``head.safetensors`` in fp16 (2 bytes per parameter), before the small header."""
    return 2 * head_parameters(head)


__all__ = [
    "SAVE_DTYPES",
    "Eagle",
    "EagleHead",
    "EagleHeadConfig",
    "HeadCache",
    "expected_head_bytes",
    "head_dir",
    "head_parameters",
    "load_head",
    "save_head",
]
