"""ExpectedAttention: score each key by the attention that future queries are expected to pay it, from the statistics
(mean, covariance) of the prompt's queries, rotated to the positions that come next.

The method of kvpress's ``ExpectedAttentionPress`` (NVIDIA, 2024-2025; Devoto et al., "Expected Attention: KV Cache
Compression by Estimating Attention from Future Queries Distribution", 2025, arXiv 2510.00636).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import KVScorer, LayerStep, _check_int, rotate_half, window_queries


def future_rotation(position_embeddings, future: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE rotation averaged over the ``future`` positions after a forward's last one, as (cos, sin) vectors.

    RoPE rotates a query at position ``p`` by ``R_p = diag(cos_p) + diag(sin_p) P`` (``P x = rotate_half(x)``); its
    mean over ``p = last + 1 .. last + future`` is ``diag(c) + diag(s) P`` with the returned ``c``, ``s``. The
    per-dimension angle step is read from the forward's own last two (cos, sin) rows (so any RoPE whose angle is
    linear in the position -- default, linear, llama3, YaRN -- is followed, with its attention scaling as the
    amplitude; a dynamic RoPE whose frequencies change with the length is taken at the current length).

    Parameters
    ----------
    position_embeddings : tuple of torch.Tensor
        ``(cos, sin)``, each [B or 1, q, D], as the model passed them to an attention module (consecutive positions).
    future : int
        Number of future positions averaged, >= 1. With ``q == 1`` the step is unknown and the last position's own
        rotation is returned.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``c``, ``s``: float32 [D] (row 0 of the batch).
    """
    cos, sin = (t[0].double() for t in position_embeddings)  # [q, D]
    angle = torch.atan2(sin, cos)
    amplitude = torch.hypot(cos[-1], sin[-1])
    if cos.shape[0] < 2:
        return cos[-1].float(), sin[-1].float()
    step = torch.remainder(angle[-1] - angle[-2] + math.pi, 2 * math.pi) - math.pi  # [D], in [-pi, pi)
    k = torch.arange(1, future + 1, dtype=torch.float64, device=cos.device)[:, None]
    ahead = angle[-1] + k * step  # [future, D]
    return (amplitude * ahead.cos().mean(0)).float(), (amplitude * ahead.sin().mean(0)).float()


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``(diag(c) + diag(s) P) x`` along the last dimension of ``x``."""
    return x * c + rotate_half(x) * s


def expected_attention_scores(
    mean: torch.Tensor, cov: torch.Tensor | None, keys: torch.Tensor, *, scaling: float,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expected attention per query head: ``softmax_j(s k_j . mu + s^2 / 2 k_j^T Sigma k_j)`` over the candidates.

    For a Gaussian query ``q ~ N(mu, Sigma)``, ``E[exp(s q . k)] = exp(s k . mu + s^2 k^T Sigma k / 2)``; normalising
    over the keys gives the attention a future query is expected to pay each key.

    Parameters
    ----------
    mean : torch.Tensor
        [B, Hq, D] mean future query (post-RoPE).
    cov : torch.Tensor or None
        [B, Hq, D, D] its covariance, or ``None`` for the mean only.
    keys : torch.Tensor
        [B, Hkv, S, D] held keys; ``Hq`` is a multiple of ``Hkv`` (GQA).
    scaling : float
        The attention's softmax scale ``s``.
    candidates : torch.Tensor, optional
        [B, Hkv, S] bool, the slots the softmax runs over (others get 0); default all.

    Returns
    -------
    torch.Tensor
        [B, Hq, S] float32 probabilities (each row sums to 1 over the candidates).
    """
    group = mean.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    logits = scaling * torch.einsum("bhsd,bhd->bhs", k, mean.float())
    if cov is not None:
        logits = logits + 0.5 * scaling**2 * torch.einsum("bhsd,bhde,bhse->bhs", k, cov.float(), k)
    if candidates is not None:
        logits = logits.masked_fill(~candidates.repeat_interleave(group, dim=1), float("-inf"))
    return logits.softmax(dim=-1)


@dataclass
class ExpectedAttention(KVScorer):
    """ExpectedAttention (kvpress; Devoto et al., 2025, arXiv 2510.00636): keep the keys future queries will attend.

    At each prefill step, per layer: the pre-RoPE queries of the forward's last ``window`` tokens (all of them by
    default, the first ``sink`` positions excluded) give a mean ``mu`` and covariance ``Sigma`` per query head; both
    are rotated by the RoPE rotation averaged over the ``future`` positions after the prompt
    (:func:`future_rotation`); each held key then scores the attention a Gaussian query with those moments is
    expected to pay it (:func:`expected_attention_scores`), averaged over the GQA group, times ``||v||`` (with
    ``vnorm``, adding ``epsilon`` first). The first ``sink`` positions are always kept. The base keeps the ``budget``
    best slots per row and KV head; decode tokens are appended.

    What is approximated: future queries are modelled as one Gaussian fitted to the prompt's queries (no drift), the
    average of the rotations stands for the rotation at each future position (the expectation of the exponential is
    not averaged over positions), and queries are recomputed from the attention input (``q_proj``, ``q_norm``; no
    attention weights are needed).

    Parameters
    ----------
    budget, ratio
        Slots kept per layer and KV head (default 256) or a kept fraction of the prompt (``expected_attention:
        ratio=0.25``).
    window : int or None
        Queries the statistics come from: the forward's last ``window`` tokens, or all of them (``None``, default,
        as kvpress).
    future : int
        Future positions the rotation is averaged over, >= 1 (default 512, kvpress's).
    sink : int
        First positions always kept and left out of the statistics, >= 0 (default 4).
    covariance : bool
        Use the covariance term (default True); False scores with the mean only.
    vnorm : bool
        Multiply by the value's L2 norm (default True).
    epsilon : float
        Added to the expected attention before the value norm multiplies it (default 0).

    Raises
    ------
    ValueError
        On a bad hyper-parameter; during prefill, for a padded batch, an attention module without ``q_proj`` or with
        partial RoPE.
    """

    window: int | None = None
    future: int = 512
    sink: int = 4
    covariance: bool = True
    vnorm: bool = True
    epsilon: float = 0.0

    method_name = "expected_attention"
    prefill_is_full = True  # full-attention prefill, then it only chooses what to keep (shared_prefill)
    supports_speculative = True  # prefill-only: the speculative engine can crop its decode slots

    def __post_init__(self):
        super().__post_init__()
        if self.window is not None:
            _check_int(self.method_name, "window", self.window, 1, "e.g. expected_attention:window=64, or None for all")
        _check_int(self.method_name, "future", self.future, 1, "e.g. expected_attention:future=512")
        _check_int(self.method_name, "sink", self.sink, 0, "e.g. expected_attention:sink=4")
        for name in ("covariance", "vnorm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(  # noqa: TRY004 - a bad spec value, reported like every other one
                    f"{self.method_name}: {name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, (int, float)) or self.epsilon < 0:
            raise ValueError(f"{self.method_name}: epsilon must be a number >= 0, got {self.epsilon!r}")

    def query_moments(self, step: LayerStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean [B, Hq, D] and covariance [B, Hq, D, D] (or None) of this forward's future queries, post-RoPE."""
        q_len = step.query_length
        first = step.layer.cumulative_length - q_len  # position of this forward's first token
        w = q_len if self.window is None else min(self.window, q_len)
        w = min(w, max(1, first + q_len - self.sink))  # leave out the sink positions when there is anything else
        D = step.module.head_dim
        identity = (step.hidden_states.new_ones(1, w, D), step.hidden_states.new_zeros(1, w, D))
        q = window_queries(step.module, step.hidden_states, identity, w).float()  # pre-RoPE: cos = 1, sin = 0
        mean = q.mean(dim=2)  # [B, Hq, D]
        cov = None
        if self.covariance:
            centred = q - mean[:, :, None]
            cov = centred.transpose(-1, -2) @ centred / w  # [B, Hq, D, D]
        if step.position_embeddings is None or step.position_embeddings[0].shape[-1] != D:
            raise ValueError(f"{self.method_name} needs full-dimension RoPE position embeddings (a Llama-style module)")
        c, s = future_rotation(step.position_embeddings, self.future)
        mean = _rotate(mean, c, s)
        if cov is not None:
            cov = _rotate(_rotate(cov, c, s).transpose(-1, -2), c, s).transpose(-1, -2)  # R Sigma R^T
        return mean, cov

    def score(self, step: LayerStep) -> torch.Tensor:
        mean, cov = self.query_moments(step)
        sink = step.layer.positions < self.sink  # [B, Hkv, S]
        scaling = step.scaling if step.scaling is not None else step.module.head_dim ** -0.5
        probs = expected_attention_scores(mean, cov, step.keys, scaling=scaling, candidates=~sink)
        B, Hkv, S = sink.shape
        scores = probs.reshape(B, Hkv, -1, S).mean(dim=2)
        if self.vnorm:
            scores = (scores + self.epsilon) * step.values.float().norm(dim=-1)
        return scores.masked_fill(sink, float("inf"))
