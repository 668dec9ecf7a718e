"""The draft-and-verify engine: one loop, any drafter, transformers' ``DynamicCache`` with ``crop`` for rollback.

State between steps: the target's cache holds K/V of every committed token except the last one, the *pending*
token. A step feeds ``[pending, d_1 .. d_k]`` (``k + 1`` tokens, true ``position_ids`` passed explicitly) to the
target, whose ``k + 1`` output distributions verify the drafts and supply one more token; the cache is then cropped
back to the committed tokens. The prompt minus its last token is the prefill, so every generated token, the first
included, comes out of a verification forward.

The rollback is relative: a step removes its ``k - m`` rejected slots from every layer, so the cache may hold fewer
slots than committed tokens (a visual-token method that reduced the prompt at prefill, per layer for in-LLM pruning)
or be a caller's croppable cache (a KV policy's ``make_cache``). A vision-language target gets its ``pixel_values``
etc. (``model_inputs``) at the prefill forward only; M-RoPE targets (Qwen2-VL) get ``generate``'s 4-row position ids.

Batch > 1 (left padding) shares one cache, so every row commits the same number of tokens per step: the minimum
``m`` of the rows' accepted counts (rows that are already finished do not count). Each row then appends its own first
``m`` draft tokens and the token at position ``m``: the target's correction/bonus token for the rows that stopped at
``m``, and the row's own draft token ``d_{m+1}`` for rows that had accepted it -- which the target had already
accepted there (greedy: it equals the argmax; sampling: it passed the acceptance test, so it is a draw from ``p``).
Truncating at ``m``, which depends only on other rows' independent draws and the row's own earlier acceptances, is a
stopping time, so every row's output is still exactly distributed as (greedy: equal to) its own plain decoding.
Per-row acceptance is recorded before taking the minimum (``SpeculativeOutput.accepted_per_row``); what the minimum
costs is the gap between ``row_mean_accepted_length`` and ``mean_accepted_length``.

Per-step bookkeeping stays off the tensor path: positions are slices of one table built from the prompt's left-pad
counts (:class:`~mmaccel.speculative.base.ColumnPositions`; only real tokens are appended), a batch without padding
runs its decoding forwards with no attention mask (transformers then skips the mask checks), the drafter sees views
of one preallocated mask, and acceptance, EOS and padding are decided on Python lists after one ``tolist`` per step
(:func:`_commit`). ``benchmarks/spec_overhead.py`` measures what is left (Python calls and ATen ops per step outside
the two models' forwards, and the wall time they cost).

A tree drafter's :class:`~mmaccel.speculative.TreeDraft` (batch 1) takes the other branch of the step: the whole tree
goes through one forward with a tree attention mask, and the cache is compacted to the accepted path instead of
cropped (:mod:`mmaccel.speculative.tree`; SpecInfer, Miao et al., 2023, arXiv 2305.09781).

References
----------
Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding", 2023, arXiv 2211.17192.
Chen, Borgeaud, Irving, Lespiau, Sifre, Jumper, "Accelerating Large Language Model Decoding with Speculative
Sampling", 2023, arXiv 2302.01318.
Xia et al., "Unlocking Efficiency in Large Language Model Inference: A Comprehensive Survey of Speculative Decoding"
(Spec-Bench), 2024, arXiv 2401.07851 -- the telemetry (mean accepted tokens per target forward).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from ..kernels.hf import cache_kwarg
from ..longctx import kv_cache_bytes
from . import tree as _tree
from . import verify as _verify
from .base import ColumnPositions, Draft, Drafter, crop_cache, croppable_cache, left_padding, positions_from_mask
from .sampling import Sampler
from .schedule import AdaptiveDraftLength, check_draft_length
from .tree import TreeDraft

logger = logging.getLogger(__name__)


@dataclass
class SpeculativeOutput:
    """Result and telemetry of :func:`speculative_generate`: the fields Spec-Bench reports (Xia et al., "Unlocking
    Efficiency in Large Language Model Inference: A Comprehensive Survey of Speculative Decoding", 2024,
    arXiv 2401.07851): mean accepted tokens, acceptance rate, draft/verify time split.

    Attributes
    ----------
    sequences : torch.LongTensor
        [B, L + n] the prompt (as given, left padding kept) followed by ``n`` generated tokens; rows that stopped at
        EOS are filled with ``pad_token_id``, exactly like ``model.generate``.
    prompt_length : int
        ``L``, the prompt columns of ``sequences``.
    target_forwards : int
        Target forward passes, the prefill included (autoregressive decoding of ``n`` tokens needs ``n``).
    draft_forwards : int
        Forward passes of a draft model (0 for model-free drafters).
    proposed : list of int
        Draft tokens proposed per row at each verification step (for a token tree: its nodes, the tree size).
    accepted : list of int
        Draft tokens committed at each step (the same for every row; the minimum over unfinished rows).
    accepted_per_row : list of list of int
        Draft tokens each row's verification accepted at each step, before the minimum; finished rows are ``-1``.
    draft_seconds, verify_seconds : float
        Wall time in the drafter (``propose`` + ``observe``) and in target forwards + verification, seconds (the
        prefill is in ``prefill_seconds``). On CUDA both are measured after ``torch.cuda.synchronize``.
    prefill_seconds : float
        Wall time of the target prefill, seconds; ``0`` when the prompt went into the first verification forward
        (a drafter with ``folds_prefill``, a text prompt without padding, the engine's own cache: one forward
        fewer; that time is then in ``verify_seconds``).
    first_token_seconds : float
        From the call to the end of the first verification step (the first committed token), seconds: the TTFT a
        harness reports. ``total_seconds``: the whole call, seconds.
    prefill_folded : bool
        Whether the prompt went into the first verification forward (see ``prefill_seconds``).
    kv_cache_bytes : int
        Bytes of the target's K/V the cache holds at the end (:func:`mmaccel.longctx.kv_cache_bytes`); the draft
        model's cache is not counted.
    draft_lengths : list of int
        The draft length asked for at each step (varies with :class:`AdaptiveDraftLength`).
    drafter : str
        Registry name of the drafter.
    drafter_telemetry : dict
        What the drafter reported (:meth:`Drafter.end`).
    """

    sequences: torch.Tensor
    prompt_length: int
    target_forwards: int = 0
    draft_forwards: int = 0
    proposed: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    accepted_per_row: list = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0
    total_seconds: float = 0.0
    prefill_folded: bool = False
    kv_cache_bytes: int = 0
    draft_lengths: list = field(default_factory=list)
    drafter: str = ""
    drafter_telemetry: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        """Generated columns ``n`` (the longest row's count; finished rows are padded)."""
        return int(self.sequences.shape[1] - self.prompt_length)

    @property
    def steps(self) -> int:
        """Verification forwards (target forwards, minus the prefill when it had a forward of its own)."""
        return len(self.accepted)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens over all steps and unfinished rows (per-row acceptance, before the
        batch minimum); ``None`` when nothing was proposed."""
        proposed = accepted = 0
        for k, row in zip(self.proposed, self.accepted_per_row):
            live = [a for a in row if a >= 0]
            proposed += k * len(live)
            accepted += sum(live)
        return accepted / proposed if proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens committed per verification forward, ``mean(accepted + 1)`` (Spec-Bench's "mean accepted tokens";
        1.0 = no gain over autoregressive decoding); ``None`` before any step."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else None

    @property
    def row_mean_accepted_length(self) -> list:
        """Per row, ``mean(accepted + 1)`` of its own verification (what a per-row cache would have committed)."""
        if not self.accepted_per_row:
            return []
        out = []
        for b in range(len(self.accepted_per_row[0])):
            vals = [row[b] + 1 for row in self.accepted_per_row if row[b] >= 0]
            out.append(sum(vals) / len(vals) if vals else None)
        return out

    @property
    def forward_ratio(self) -> float | None:
        """Target forwards of autoregressive decoding (``new_tokens``) divided by this run's: the forward-pass
        speedup, before any cost of drafting; ``None`` if nothing was generated."""
        return self.new_tokens / self.target_forwards if self.target_forwards and self.new_tokens else None

    def telemetry(self) -> dict:
        """The JSON-serialisable summary a ``RunRecord.telemetry`` holds (no tensors)."""
        return {
            "drafter": self.drafter,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "steps": self.steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "row_mean_accepted_length": self.row_mean_accepted_length,
            "forward_ratio": self.forward_ratio,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "prefill_seconds": self.prefill_seconds,
            "first_token_seconds": self.first_token_seconds,
            "prefill_folded": self.prefill_folded,
            "total_seconds": self.total_seconds,
            "kv_cache_bytes": self.kv_cache_bytes,
            "proposed": list(self.proposed),
            "accepted": list(self.accepted),
            "draft_lengths": list(self.draft_lengths),
            "drafter_telemetry": dict(self.drafter_telemetry),
        }


def _eos_list(model, eos_token_id) -> list[int]:
    if isinstance(eos_token_id, str):
        if eos_token_id != "config":
            raise ValueError(f"eos_token_id must be an int, a list of ints, None or 'config', got {eos_token_id!r}")
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(e) for e in eos_token_id]


def _pad_id(model, pad_token_id, eos: list[int]) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return int(pad)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _as_batch(input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
        raise ValueError(f"input_ids must be [B, L] with B, L >= 1, got shape {tuple(ids.shape)}")
    if attention_mask is None:
        mask = torch.ones_like(ids)
    else:
        mask = torch.as_tensor(attention_mask, device=ids.device).long()
        if mask.dim() == 1:
            mask = mask[None]
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
        if bool((mask[:, -1] == 0).any()):
            raise ValueError("speculative_generate needs left padding (every row's last token real); "
                             "tokenize with padding_side='left'")
        if bool((mask.sum(dim=1) == 0).any()):
            raise ValueError("a row of attention_mask is all padding; every prompt needs at least one token")
    return ids.long(), mask


def _check_cache(cache):
    """A caller's target cache: empty, and croppable layer by layer (rollback of rejected drafts).

    Raises
    ------
    ValueError
        A cache that already holds tokens, or one with a layer that cannot be cropped (e.g. an evicting KV policy).
    """
    if cache.get_seq_length() != 0:
        raise ValueError("speculative_generate needs an empty cache; build a fresh one per generation")
    stuck = [type(layer).__name__ for layer in getattr(cache, "layers", []) if not getattr(layer, "is_croppable", True)]
    if stuck or not getattr(cache, "is_croppable", True):
        raise ValueError(f"speculative decoding crops the cache to drop rejected draft tokens, and this "
                         f"{type(cache).__name__} ({stuck[0] if stuck else 'cache'}) cannot be cropped; use a "
                         "DynamicCache (the 'full' KV method)")
    return cache


def _multimodal(model, ids: torch.Tensor, mask: torch.Tensor, model_inputs: dict | None):
    """The prefill's extra inputs and the position-id mapping of a vision-language target.

    Returns
    -------
    prefill_inputs : dict
        ``model_inputs`` with integer [B, L] tensors cut to the prefill's ``L - 1`` columns.
    positions : callable
        ``positions(text_positions [B, q], prefill=False)``: the target's ``position_ids``: the text positions
        themselves, or ``[4, B, q]`` (text row + 3 M-RoPE rows) for a target whose inner model has ``get_rope_index``
        and a prompt with image/video grids (prefill: the prompt's own 3-D positions; later: text + rope deltas).
    """
    if not model_inputs:
        return {}, lambda text, prefill=False: text
    config = model.config
    placeholders = {getattr(config, k, None) for k in ("image_token_id", "video_token_id", "image_token_index")}
    placeholders.discard(None)
    B, L = ids.shape
    if L < 2 or bool(torch.isin(ids[:, -1], torch.tensor(sorted(placeholders), device=ids.device)).any()):
        raise ValueError("speculative decoding of a vision-language model prefills the prompt minus its last token, "
                         "so the prompt must end with text after the image (e.g. the chat template's 'ASSISTANT:')")
    prefill = {k: (v[:, :-1] if isinstance(v, torch.Tensor) and v.dim() == 2 and tuple(v.shape) == (B, L)
                   and not v.is_floating_point() else v) for k, v in model_inputs.items()}
    get_rope_index = getattr(getattr(model, "model", None), "get_rope_index", None)
    grids = {k: model_inputs[k] for k in ("image_grid_thw", "video_grid_thw") if model_inputs.get(k) is not None}
    if not callable(get_rope_index) or not grids:
        return prefill, lambda text, prefill=False: text
    if model_inputs.get("mm_token_type_ids") is None:
        raise ValueError("M-RoPE positions need mm_token_type_ids; pass the processor's full output")
    rope, deltas = get_rope_index(ids, mm_token_type_ids=model_inputs["mm_token_type_ids"], attention_mask=mask,
                                  **grids)  # [3, B, L], [B, 1]

    def positions(text: torch.Tensor, prefill: bool = False) -> torch.Tensor:
        spatial = rope[:, :, : text.shape[1]] if prefill else (text + deltas.to(text.device))[None].expand(3, -1, -1)
        return torch.cat([text[None], spatial.to(text.device)], dim=0)

    return prefill, positions


def _verify_chain(model, cache, seq, draft_tokens, position_ids, attention_mask, draft: Draft, sampler: Sampler,
                  generator, start: int = -1):
    """One verification forward of a draft chain: ``[pending, d_1 .. d_k]`` (``draft_tokens`` [B, k]) at
    ``position_ids``, then exact greedy or lossless speculative sampling. ``attention_mask`` [B, T + k] or ``None``
    (no padding). ``start``: the first column of ``seq`` fed (``-1``: the pending token; ``0``: the whole prompt,
    when the prefill is folded into the first verification). Returns ``(logits [B, k + 1, V], accepted [B],
    next_tokens [B])``."""
    k = draft_tokens.shape[1]
    step_in = torch.cat([seq[:, start:], draft_tokens], dim=1)  # [B, k+1] (+ the prompt when folded)
    logits = model(input_ids=step_in, attention_mask=attention_mask, position_ids=position_ids,
                   **cache_kwarg(model, cache), use_cache=True, logits_to_keep=k + 1).logits
    if logits.shape[1] != k + 1:
        logits = logits[:, -(k + 1):]
    if sampler.greedy:
        return (logits, *_verify.verify_greedy(logits, draft_tokens))
    q = None if draft.probs is None else draft.probs.to(device=logits.device, dtype=torch.float32)
    return (logits, *_verify.verify_sampled(sampler.probs(logits), draft_tokens, q, generator))


def _commit(drafts: list, accepted: list, next_tokens: list, finished: list, left: int, eos: set, pad: int):
    """The tokens every row appends after one verification, as Python lists (no tensor ops per step).

    Parameters
    ----------
    drafts : list of list of int
        Per row, the draft tokens verified (a tree: its accepted path).
    accepted, next_tokens : list of int
        Per row, the draft tokens its verification accepted and the target's token after them.
    finished : list of bool
        Rows already past EOS; updated in place.
    left : int
        Tokens still allowed per row.
    eos : set of int
        Stop tokens (empty: never stop early).
    pad : int
        Filler after EOS.

    Returns
    -------
    m : int
        Draft tokens committed to every row: the minimum over unfinished rows.
    rows : list of list of int
        Per row, ``d_1 .. d_m`` then the row's own ``d_{m+1}`` if it accepted it, else its target token; EOS and what
        follows it, and finished rows, padded; cut at the last row's EOS when every row is finished (as ``generate``
        stops).
    """
    live = [b for b, done in enumerate(finished) if not done]
    m = min(accepted[b] for b in live)
    rows = [(d[:m] + [d[m] if a > m else t])[:left] for d, a, t in zip(drafts, accepted, next_tokens)]
    if not eos:
        return m, rows
    stops = []
    for b in range(len(rows)):
        if finished[b]:
            rows[b] = [pad] * len(rows[b])
            continue
        hit = next((i for i, tok in enumerate(rows[b]) if tok in eos), None)
        if hit is not None:
            rows[b][hit + 1:] = [pad] * (len(rows[b]) - hit - 1)
            finished[b] = True
            stops.append(hit)
    if all(finished):
        rows = [r[: max(stops) + 1] for r in rows]
    return m, rows


@torch.inference_mode()
def speculative_generate(
    model,
    input_ids,
    drafter: Drafter,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_draft_tokens: int | AdaptiveDraftLength = 4,
    eos_token_id="config",
    pad_token_id: int | None = None,
    attention_mask=None,
    generator: torch.Generator | None = None,
    cache=None,
    model_inputs: dict | None = None,
) -> SpeculativeOutput:
    """Decode with draft-and-verify: exact greedy, or lossless speculative sampling.

    Greedy output is token-identical to ``model.generate(do_sample=False)``; with ``temperature > 0`` every token is
    distributed exactly as ``model.generate(do_sample=True, temperature=..., top_k=..., top_p=...)`` would draw it
    (Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", 2023, arXiv 2211.17192; Chen et
    al., "Accelerating Large Language Model Decoding with Speculative Sampling", 2023, arXiv 2302.01318).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The target causal LM (any model whose forward takes ``input_ids``, ``attention_mask``, ``position_ids``,
        ``past_key_values`` and returns ``.logits``).
    input_ids : torch.LongTensor
        [B, L] or [L] prompt token ids, left-padded when ``B > 1`` rows differ in length.
    drafter : Drafter
        A drafter from :data:`mmaccel.speculative.METHODS` (e.g. ``DraftModel``, ``PromptLookup``, ``Jacobi``), or a
        tree drafter (``DraftTree``, ``DynamicDraftTree``) whose :class:`~mmaccel.speculative.TreeDraft` is verified
        in one forward with a tree attention mask and depth-based positions, the cache then compacted to the accepted
        path (:func:`mmaccel.speculative.tree.verify_tree`; SpecInfer, Miao et al., 2023, arXiv 2305.09781); batch 1.
    max_new_tokens : int
        Most tokens to generate per row, ``>= 1``.
    temperature : float
        ``0`` = greedy (default); ``> 0`` = speculative sampling at that temperature.
    top_k, top_p : optional
        Filters applied identically to draft and target distributions (transformers' order and rules).
    num_draft_tokens : int or AdaptiveDraftLength
        Draft tokens per step, ``>= 1``, or an adaptive schedule driven by the running acceptance rate; for a tree
        drafter, the most depth a tree may have.
    eos_token_id : int, list of int, None or "config"
        Stop tokens; ``"config"`` (default) takes ``model.generation_config.eos_token_id`` like ``generate``;
        ``None`` never stops early.
    pad_token_id : int, optional
        Filler after EOS; default the generation config's pad token, else the first EOS id.
    attention_mask : torch.LongTensor, optional
        [B, L], 0 on left padding; default all ones.
    generator : torch.Generator, optional
        Randomness for sampling (uniforms, residual resampling and the draft model's draws), on the model's device.
    cache : transformers.Cache, optional
        The target's cache, empty (e.g. a KV policy's ``method.make_cache(model)``); default a fresh
        ``DynamicCache``. Every layer must be croppable: rejected draft tokens are cut off it after each step.
    model_inputs : dict, optional
        Extra tensors of a vision-language target (``pixel_values``, ``image_sizes``, ``image_grid_thw``,
        ``mm_token_type_ids``, ...), passed to the prefill forward only (the prompt minus its last token, which must
        be text). Integer [B, L] tensors (per-token types) are cut like the prompt. A target whose inner model has
        ``get_rope_index`` (Qwen2-VL's M-RoPE) gets its 3-D positions from it: ``[4, B, q]`` position ids (text row
        + 3 M-RoPE rows), as ``generate`` passes them.

    Returns
    -------
    SpeculativeOutput
        ``sequences`` [B, L + n] and telemetry: target and draft forward passes, proposed/accepted tokens per step,
        ``acceptance_rate``, ``mean_accepted_length``, ``forward_ratio``, draft vs verify seconds.

    Raises
    ------
    ValueError
        ``temperature < 0``, ``num_draft_tokens <= 0``, ``max_new_tokens < 1``, bad ``top_k``/``top_p``, right
        padding, a drafter that cannot serve this target (e.g. a draft model with another vocabulary or
        tokenizer), a non-empty or non-croppable ``cache``, or ``model_inputs`` with a prompt of one token or one
        that ends on an image/video placeholder; with a tree drafter, batch size > 1, a cache that is not plain
        ``DynamicLayer`` layers, or an attention implementation that takes no custom 4-D mask; each message names
        the fix.
    TypeError
        If ``drafter`` is not a :class:`Drafter`.

    Notes
    -----
    Batch rows share one cache and commit the minimum of their accepted counts per step (see the module docstring);
    each row still equals its own plain decoding. Exact equality with ``generate`` in greedy mode holds up to
    floating-point differences between a ``k + 1``-token forward and one-token forwards (only exact near-ties of
    the two best logits can flip).
    """
    sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
    check_draft_length(num_draft_tokens)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a Drafter (see mmaccel.speculative.METHODS), got {type(drafter).__name__}")
    device = getattr(model, "device", torch.device("cpu"))
    ids, mask = _as_batch(input_ids, attention_mask)
    ids, mask = ids.to(device), mask.to(device)
    B, L = ids.shape
    eos = _eos_list(model, eos_token_id)
    pad = _pad_id(model, pad_token_id, eos)
    schedule = num_draft_tokens if isinstance(num_draft_tokens, AdaptiveDraftLength) else None
    if schedule is not None:
        schedule.reset()

    out = SpeculativeOutput(sequences=ids, prompt_length=L, drafter=getattr(drafter, "name", type(drafter).__name__))
    own_cache = cache is None
    cache = croppable_cache(cache=_check_cache(cache)) if cache is not None else croppable_cache(model.config)
    prefill_inputs, positions = _multimodal(model, ids, mask, model_inputs)
    # only real tokens are appended, so the prompt's pad counts fix every later position, and an unpadded batch
    # needs no attention mask in the decoding forwards; the drafter sees views of one preallocated mask
    pads = left_padding(mask)
    columns = ColumnPositions(pads, B, device, capacity=L + max_new_tokens)
    mask_buf = mask.new_ones(B, L + max_new_tokens)
    mask_buf[:, :L] = mask
    seq, T = ids, L
    finished = [False] * B
    eos_set = set(eos)
    new = 0

    # a text prompt without padding, in the engine's own cache, before a drafter that needs no target state from
    # the prefill: the prompt goes into the first verification forward (one forward fewer, as transformers does)
    out.prefill_folded = (L > 1 and own_cache and pads is None and not model_inputs
                          and getattr(drafter, "folds_prefill", False))

    def prefill() -> None:
        t0 = time.perf_counter()
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
              position_ids=positions(positions_from_mask(mask)[:, :-1], prefill=True),
              **cache_kwarg(model, cache), use_cache=True, logits_to_keep=1, **prefill_inputs)
        _sync(device)
        out.prefill_seconds += time.perf_counter() - t0
        out.target_forwards += 1

    _sync(device)
    t_start = t0 = time.perf_counter()
    drafter.begin(model, ids, mask, sampler)
    try:
        _sync(device)
        out.draft_seconds += time.perf_counter() - t0
        if L > 1 and not out.prefill_folded:
            prefill()

        while new < max_new_tokens:
            left = max_new_tokens - new
            k_ask = schedule.next_length() if schedule is not None else num_draft_tokens
            k_ask = min(k_ask, left - 1)
            t0 = time.perf_counter()
            if k_ask > 0:
                draft = drafter.propose(seq, mask_buf[:, :T], k_ask, sampler, generator)
                if draft.tokens.dim() != 2 or draft.tokens.shape[0] != B or not 0 <= draft.depth <= k_ask:
                    raise RuntimeError(f"{out.drafter} proposed tokens of shape {tuple(draft.tokens.shape)} (depth "
                                       f"{draft.depth}); expected [{B}, 0..{k_ask}]")
            else:
                draft = Draft(tokens=seq.new_zeros(B, 0))
            _sync(device)
            out.draft_seconds += time.perf_counter() - t0
            out.draft_forwards += draft.forwards
            k = draft.length
            draft_tokens = draft.tokens if draft.tokens.device == device else draft.tokens.to(device)

            first = out.steps == 0
            if first and out.prefill_folded and isinstance(draft, TreeDraft):  # a tree needs a filled cache
                out.prefill_folded = False
                prefill()
            t0 = time.perf_counter()
            held = cache.get_seq_length()  # slots before this step (fewer than committed tokens after a reduction)
            fed_from = 0 if first and out.prefill_folded else T - 1  # the first column of seq this forward feeds
            if isinstance(draft, TreeDraft):
                # one forward over the whole tree; the cache is compacted to the accepted path (tree.py)
                tv = _tree.verify_tree(model, cache, seq[:, -1:], draft, columns(T - 1, T), sampler, generator,
                                       positions)
                logits, draft_tokens = tv.logits, tv.tokens
                accepted, next_tokens = [len(tv.path)], tv.next_token.tolist()
                draft = dataclasses.replace(draft, path=tv.path)
            else:
                logits, acc_rows, next_rows = _verify_chain(
                    model, cache, seq, draft_tokens, positions(columns(fed_from, T + k)),
                    None if pads is None else mask_buf[:, : T + k], draft, sampler, generator, fed_from - T)
                accepted, next_tokens = acc_rows.tolist(), next_rows.tolist()
            out.target_forwards += 1
            was_finished = list(finished)
            m, rows = _commit(draft_tokens.tolist(), accepted, next_tokens, finished, left, eos_set, pad)
            crop_cache(cache, held + T - fed_from + m)  # keep what was fed before the drafts and the m accepted ones
            _sync(device)
            out.verify_seconds += time.perf_counter() - t0

            t0 = time.perf_counter()
            drafter.observe(logits, draft, m)
            _sync(device)
            out.draft_seconds += time.perf_counter() - t0

            c = len(rows[0])
            seq = torch.cat([seq, torch.tensor(rows, dtype=seq.dtype, device=device)], dim=1)
            T += c
            new += c
            out.proposed.append(k)
            out.accepted.append(m)
            out.accepted_per_row.append([-1 if done else a for a, done in zip(accepted, was_finished)])
            out.draft_lengths.append(k_ask)
            if out.steps == 1:
                out.first_token_seconds = time.perf_counter() - t_start
            if schedule is not None:
                schedule.update(draft.depth, m)
            if all(finished):
                break
    finally:
        out.drafter_telemetry = drafter.end()
    out.sequences = seq
    out.kv_cache_bytes = kv_cache_bytes(cache)
    out.total_seconds = time.perf_counter() - t_start
    logger.debug("speculative_generate: %d tokens, %d target forwards, mean accepted length %s",
                 out.new_tokens, out.target_forwards, out.mean_accepted_length)
    return out
