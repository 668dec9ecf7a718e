"""Verification rules: exact greedy, and lossless speculative sampling.

Both take the target's distributions at the ``k + 1`` positions of one verification forward (the pending token and
the ``k`` draft tokens as input) and return, per row, how many draft tokens are accepted and the one token the target
adds after them (the correction at the first rejection, or the bonus token when all are accepted).

References
----------
Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding", 2023, arXiv 2211.17192.
Chen, Borgeaud, Irving, Lespiau, Sifre, Jumper, "Accelerating Large Language Model Decoding with Speculative
Sampling", 2023, arXiv 2302.01318.
"""
from __future__ import annotations

import torch


def _accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] long: length of the all-True prefix of each row."""
    if ok.shape[1] == 0:
        return torch.zeros(ok.shape[0], dtype=torch.long, device=ok.device)
    return ok.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact greedy verification: accept draft tokens while each equals the target's argmax (the temperature-0 case
    of Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", 2023, arXiv 2211.17192).

    Parameters
    ----------
    target_logits : torch.Tensor
        [B, k + 1, V] target logits; position ``i`` predicts the token after draft token ``i`` (position 0: after the
        pending token).
    draft_tokens : torch.LongTensor
        [B, k] proposed tokens, ``k >= 0``.

    Returns
    -------
    accepted : torch.LongTensor
        [B] number of accepted draft tokens, ``0 .. k``.
    next_tokens : torch.LongTensor
        [B] the target's argmax at position ``accepted`` (correction or bonus token).

    Notes
    -----
    The output equals plain greedy decoding token for token (up to floating-point differences between a
    ``k + 1``-token forward and ``k + 1`` one-token forwards, which can only flip exact near-ties).
    """
    greedy = target_logits.argmax(dim=-1)  # [B, k+1]
    accepted = _accepted_prefix(draft_tokens == greedy[:, :-1])
    next_tokens = greedy.gather(1, accepted[:, None]).squeeze(1)
    return accepted, next_tokens


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to resample from after a rejection: ``norm(max(0, p - q))`` (Leviathan et al., 2023,
    arXiv 2211.17192, Algorithm 1; Chen et al., 2023, arXiv 2302.01318).

    Parameters
    ----------
    p, q : torch.Tensor
        [..., V] target and draft probabilities (float32).

    Returns
    -------
    torch.Tensor
        [..., V] probabilities. Where ``p - q`` has no positive mass (``p == q``, where a rejection has probability 0
        and only rounding gets here) it falls back to ``p``.
    """
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def verify_sampled(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling: accept token ``x_i ~ q_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``.

    At the first rejection the target token is resampled from ``norm(max(0, p_i - q_i))``
    (:func:`residual_distribution`); when all ``k`` are accepted a bonus token is drawn from ``p_{k+1}``. Each output
    token is then distributed exactly as the target's ``p`` (Leviathan et al., 2023, arXiv 2211.17192, Theorem 3.5;
    Chen et al., 2023, arXiv 2302.01318).

    Parameters
    ----------
    target_probs : torch.Tensor
        [B, k + 1, V] float32 target distributions (already temperature/top-k/top-p filtered).
    draft_tokens : torch.LongTensor
        [B, k] proposed tokens.
    draft_probs : torch.Tensor or None
        [B, k, V] the distributions the draft tokens were sampled from (filtered the same way), or ``None`` for a
        deterministic drafter (prompt lookup, Jacobi), whose ``q`` is the one-hot of its token: then the acceptance
        probability is ``p_i(x_i)`` and the residual is ``p_i`` without ``x_i``, renormalised.
    generator : torch.Generator, optional
        Randomness for the uniforms and the resampling.

    Returns
    -------
    accepted : torch.LongTensor
        [B] number of accepted draft tokens, ``0 .. k``.
    next_tokens : torch.LongTensor
        [B] the resampled correction at position ``accepted``, or the bonus token when ``accepted == k``.
    """
    B, k1, _ = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    if k == 0:
        return (torch.zeros(B, dtype=torch.long, device=device),
                torch.multinomial(target_probs[:, 0], 1, generator=generator).squeeze(1))
    p_draft = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)  # [B, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
    u = torch.rand(B, k, device=device, generator=generator)
    ok = u * q_draft < p_draft  # u < p / q without dividing by q
    accepted = _accepted_prefix(ok)
    rows = torch.arange(B, device=device)
    p_at = target_probs[rows, accepted]  # [B, V]
    if draft_probs is None:
        q_at = torch.zeros_like(p_at)
        has_draft = accepted < k
        q_at[rows[has_draft], draft_tokens[rows[has_draft], accepted[has_draft]]] = 1.0
    else:
        q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # bonus: q = 0 -> residual = p
        q_at = q_pad[rows, accepted]
    dist = residual_distribution(p_at, q_at)
    next_tokens = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    return accepted, next_tokens
