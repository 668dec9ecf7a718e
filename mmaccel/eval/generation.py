"""Measured generation: the one generation path every CLI command, eval and the app uses.

:func:`generate_measured` resolves the method to an object that runs one timed generation and returns one
:class:`RunRecord` with the same fields for every method (the harness contract of Spec-Bench, Xia et al., 2024,
arXiv 2401.07851): the output, timings in seconds, memory in bytes, and the method's telemetry. Three kinds of
method share that path:

- KV-cache methods (:data:`mmaccel.longctx.METHODS`, e.g. ``"snapkv:budget=256"``): ``model.generate`` with the
  method's fresh cache (timed by the probe below);
- speculative drafters (:data:`mmaccel.speculative.METHODS`, e.g. ``"draft:model=micro-draft"``,
  ``"prompt_lookup:max_ngram=3"``): :func:`mmaccel.speculative.speculative_generate`; ``ttft_s`` is its
  ``first_token_seconds`` and ``decode_s`` is ``total_seconds - first_token_seconds``;
- transformers' own speculative paths (:data:`mmaccel.speculative.PEERS`: ``"hf_assisted:model=micro-draft"``,
  ``"hf_prompt_lookup:num_tokens=10"``, ``"hf_early_exit:layers=15"``): ``model.generate(**kwargs)``, timed by
  forward hooks (:mod:`mmaccel.speculative.harness`).

Speculative records' telemetry holds the mean accepted length, the acceptance rate, draft/verify seconds and target
forward counts.

Composition
-----------
The same path runs the composed pipeline (:class:`mmaccel.Pipeline`): ``vision=`` (a visual-token method,
:data:`mmaccel.vision_tokens.METHODS`) is applied around every run with ``with vision.apply(model):``, and ``kv=``
stacks a KV-cache method under an engine drafter: its ``make_cache(model)`` is the cache the speculative engine
decodes into. Vision-language inputs (a processor's output: ``input_ids`` plus ``pixel_values``, ``image_sizes`` /
``image_grid_thw``, ...) go to ``generate`` as they are, and to the engine's prefill forward only.
:func:`check_composition` refuses, up front, the pairs that cannot be exact together.

Timing
------
A :class:`~transformers.LogitsProcessor` probe is called by ``generate`` once per new token, right after the forward
that produced its logits. Its first call therefore marks the end of prefill:

- ``ttft_s``: from the start of ``generate`` to the first probe call (prefill + the first logits), seconds.
- ``decode_s``: from the first probe call to the return of ``generate``, i.e. the ``new_tokens - 1`` decode
  forwards, seconds.
- ``tokens_per_s``: ``(new_tokens - 1) / decode_s`` (decode throughput; the first token is counted in TTFT);
  ``None`` when fewer than two tokens were generated.
- ``vision_encoder_s``: seconds inside the vision tower's forwards during the run (forward hooks on the tower of a
  vision-language model, removed on exit); ``None`` when the model has no tower or it did not run.
- ``prefill_s``: ``ttft_s - vision_encoder_s`` (``ttft_s`` without a tower): everything before the first token that
  is not the vision encoder -- projector, language-model prefill, the first logits.

On CUDA every timestamp is taken after ``torch.cuda.synchronize``. ``warmup`` unrecorded runs come first; the record
holds the median of ``repeats`` measured runs (each run's numbers are kept in ``RunRecord.samples``).

Memory
------
``peak_memory_bytes`` is the peak memory growth during one run, measured by :class:`mmaccel.eval.memory.PeakMemory`
(CUDA: ``max_memory_allocated``; CPU: sampled RSS growth -- see that module for what it does and does not see).

``kv_cache_bytes_prefill`` / ``kv_cache_bytes_final`` are the bytes of K/V tensors the cache really holds after
prefill (at the first probe call, i.e. after any prefill-time compression) and when ``generate`` returns
(:func:`mmaccel.longctx.kv_cache_bytes`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ..kernels.hf import cache_kwarg
from ..longctx import METHODS as KV_METHODS
from ..longctx import build_method, kv_cache_bytes
from ..specs import parse_method_spec
from .memory import PeakMemory, check_cpu_meter

logger = logging.getLogger(__name__)

_TIMED_FIELDS = ("ttft_s", "decode_s", "tokens_per_s", "peak_memory_bytes", "vision_encoder_s", "prefill_s")


@dataclass
class RunRecord:
    """One measured generation run: the record every method, eval, table, JSON file and the app is built from.

    Attributes
    ----------
    method : str
        Label of the method, e.g. the spec as written (``"snapkv:budget=256"``).
    method_name : str or None
        Registry name (``"full"``, ``"snapkv"``, ...), used to find the baseline.
    status : {"ok", "failed"}
    error : str or None
        ``"ExceptionType: message"`` of a failed run.
    output_text : str
        Decoded new tokens (special tokens skipped).
    output_ids : list of int
        The new token ids.
    prompt_tokens, new_tokens : int
        Prompt length and number of generated tokens.
    ttft_s, decode_s : float or None
        Time to first token and decode time, seconds (medians over ``repeats``).
    tokens_per_s : float or None
        Decode throughput, ``(new_tokens - 1) / decode_s``, tokens per second.
    vision_encoder_s, prefill_s : float or None
        Seconds in the vision tower, and ``ttft_s`` minus them (medians; see the module docstring). ``vision_encoder_s``
        is ``None`` without a vision tower run.
    visual_tokens, visual_tokens_kept : int or None
        Visual tokens of the prompt before and after the visual-token method (summed over images; ``None`` without
        a vision method). The method's own facts are in ``telemetry["vision"]``.
    peak_memory_bytes : int or None
        Peak memory growth during the run, bytes; how it was measured is in ``peak_memory_method``.
    peak_memory_method : str
        ``"cuda_max_memory_allocated"``, ``"rss_delta_sampled"`` or ``"unavailable"``.
    kv_cache_bytes_prefill, kv_cache_bytes_final : int or None
        Bytes of K/V held after prefill and at the end, bytes.
    telemetry : dict
        The method's own facts, JSON-serialisable: ``KVMethod.telemetry`` for KV-cache methods; for speculative
        methods and transformers peers the acceptance (``mean_accepted_length``, ``acceptance_rate``), forward counts
        (``target_forwards``, ``draft_forwards``) and the draft/verify time split in seconds (see
        :mod:`mmaccel.speculative.harness`). A composed run adds ``telemetry["vision"]`` (the visual-token method's
        ``telemetry``) and, for a KV method under a speculative method, ``telemetry["kv"]`` (``KVMethod.telemetry``).
    repeats, warmup : int
        Measured and warm-up runs behind the medians.
    device : str
        Device of the model, e.g. ``"cpu"`` or ``"cuda:0"``.
    dtype : str
        Dtype of the model's parameters, e.g. ``"torch.float32"``.
    threads : int
        ``torch.get_num_threads()`` during the run (CPU timings depend on it).
    load_avg_1m : float or None
        The machine's 1-minute load average when the run started (``os.getloadavg``): a busy machine explains slow
        timings. ``None`` where the OS has none.
    samples : list of dict
        Per measured run: ``ttft_s``, ``decode_s``, ``tokens_per_s``, ``peak_memory_bytes``, ``vision_encoder_s``,
        ``prefill_s``.
    extra : dict
        Free-form, e.g. ``answer``/``correct``, NIAH ``length``/``depth``/``trial``.
    """

    method: str
    method_name: str | None = None
    status: str = "ok"
    error: str | None = None
    output_text: str = ""
    output_ids: list = field(default_factory=list)
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float | None = None
    decode_s: float | None = None
    tokens_per_s: float | None = None
    vision_encoder_s: float | None = None
    prefill_s: float | None = None
    visual_tokens: int | None = None
    visual_tokens_kept: int | None = None
    peak_memory_bytes: int | None = None
    peak_memory_method: str = "unavailable"
    kv_cache_bytes_prefill: int | None = None
    kv_cache_bytes_final: int | None = None
    telemetry: dict = field(default_factory=dict)
    repeats: int = 0
    warmup: int = 0
    device: str = ""
    dtype: str = ""
    threads: int = 0
    load_avg_1m: float | None = None
    samples: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the run succeeded."""
        return self.status == "ok"

    def to_dict(self) -> dict:
        """A JSON-serialisable dict of every field (``extra`` kept nested)."""
        return asdict(self)


# ------------------------------------------------------------------------------------------------------- methods
def resolve_method(method, *, draft=None) -> tuple[Any, str]:
    """Turn ``None``, a spec string or a method object into ``(method, label)``.

    Parameters
    ----------
    method : None, str, mmaccel.longctx.KVMethod, mmaccel.speculative.Drafter or a speculative method object
        ``None`` means full attention; a string is a spec whose text becomes the label: a KV-cache method
        (``"snapkv:budget=256"``), an engine drafter (``"draft:model=micro-draft:k=4"``, ``"prompt_lookup"``) or a
        transformers peer (``"hf_prompt_lookup:num_tokens=10"``); an object is used as is (a bare ``Drafter`` is
        wrapped with its default draft length) and labelled by its registry name.
    draft : str or transformers.PreTrainedModel, optional
        The draft model of ``draft`` / ``hf_assisted`` specs that name no ``model=``.

    Raises
    ------
    ValueError
        For an unknown method name or bad arguments (the message lists KV-cache methods, drafters and peers).
    """
    from ..speculative import Drafter, build_speculative_method, speculative_method_names
    from ..speculative.harness import SpeculativeMethod

    if method is None:
        return build_method("full"), "full"
    if isinstance(method, str):
        name = parse_method_spec(method).name
        if name in KV_METHODS:
            return build_method(method), method.strip()
        if name in speculative_method_names():
            return build_speculative_method(method, draft=draft), method.strip()
        raise ValueError(
            f"unknown KV-cache method {name!r} (nor a speculative method); KV-cache methods: "
            f"{', '.join(sorted(KV_METHODS))}; speculative: {', '.join(speculative_method_names())} "
            "(syntax: name:key=value, e.g. snapkv:budget=256 or draft:model=micro-draft)"
        )
    if isinstance(method, Drafter):
        method = SpeculativeMethod(method)
    if not (hasattr(method, "make_cache") or hasattr(method, "timed_generate")):
        raise ValueError(f"{method!r} is not a KV-cache or speculative method (no make_cache / timed_generate); pass "
                         "a spec such as 'snapkv:budget=256' or 'draft:model=micro-draft'")
    return method, getattr(method, "name", type(method).__name__)


def resolve_methods(methods: Sequence, *, draft=None) -> list[tuple[Any, str]]:
    """:func:`resolve_method` for each entry, checked up front; duplicate labels get ``#2``, ``#3`` suffixes.

    ``draft`` is passed on to :func:`resolve_method`.

    Raises
    ------
    ValueError
        If ``methods`` is empty, or for the first unknown/badly configured method.
    """
    if isinstance(methods, str) or hasattr(methods, "make_cache") or hasattr(methods, "timed_generate"):
        methods = [methods]
    if not methods:
        raise ValueError("no methods given; pass at least one, e.g. 'full'")
    out, seen = [], {}
    for m in methods:
        obj, label = resolve_method(m, draft=draft)
        seen[label] = seen.get(label, 0) + 1
        out.append((obj, label if seen[label] == 1 else f"{label}#{seen[label]}"))
    return out


def as_input_ids(inputs, tokenizer=None) -> torch.Tensor:
    """Normalise a prompt to a [1, L] long tensor.

    Parameters
    ----------
    inputs : str, list of int, torch.Tensor [L] or [1, L], or an object with ``input_ids`` (e.g. NIAHSample)
        A string is tokenised with ``tokenizer`` (special tokens added, as the tokenizer does by default).

    Raises
    ------
    ValueError
        For an empty prompt, a batch of more than one row, or a string without a tokenizer.
    """
    if hasattr(inputs, "input_ids") and not isinstance(inputs, (str, torch.Tensor)):
        inputs = inputs.input_ids
    if isinstance(inputs, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer")
        inputs = tokenizer(inputs, return_tensors="pt")["input_ids"]
    ids = torch.as_tensor(inputs, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"expected one prompt ([L] or [1, L] token ids), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    return ids


def split_inputs(inputs, tokenizer=None) -> tuple[torch.Tensor, dict]:
    """A prompt as ``(input_ids, model_inputs)``: the token ids and a vision-language model's other inputs.

    Parameters
    ----------
    inputs : str, list of int, torch.Tensor, an object with ``input_ids``, or a mapping
        A mapping (a processor's ``BatchFeature`` or a dict) holds ``input_ids`` [1, L] and any of
        ``attention_mask`` (all ones), ``pixel_values``, ``image_sizes``, ``image_grid_thw``,
        ``mm_token_type_ids``, ...; the other forms are text prompts (see :func:`as_input_ids`).

    Returns
    -------
    input_ids : torch.LongTensor
        [1, L].
    model_inputs : dict
        The mapping's entries other than ``input_ids`` and ``attention_mask`` (empty for a text prompt).

    Raises
    ------
    ValueError
        A mapping without ``input_ids``, an attention mask with padding (one unpadded prompt is measured), or any
        error of :func:`as_input_ids`.
    """
    if not isinstance(inputs, Mapping):
        return as_input_ids(inputs, tokenizer), {}
    if "input_ids" not in inputs:
        raise ValueError(f"the inputs mapping has no input_ids (keys: {', '.join(map(str, inputs))}); pass the "
                         "processor's output, e.g. processor(images=..., text=..., return_tensors='pt')")
    ids = as_input_ids(inputs["input_ids"], tokenizer)
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError("the attention mask has padding; measured generation takes one unpadded prompt")
    return ids, {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}


def _to_model(model_inputs: dict, device: torch.device, dtype: torch.dtype | None) -> dict:
    """Tensors moved to the model's device; floating-point ones (pixel values) also to its dtype."""
    out = {}
    for k, v in model_inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device=device, dtype=dtype) if v.is_floating_point() and dtype is not None else v.to(device)
        out[k] = v
    return out


def _misplaced(name: str, slot: str) -> str:
    """A hint when a spec name belongs to another slot than ``slot`` (``""`` when it belongs nowhere)."""
    from ..speculative import speculative_method_names
    from ..vision_tokens import METHODS as VISION_METHODS

    owners = [("vision", VISION_METHODS), ("kv", KV_METHODS), ("speculative", speculative_method_names())]
    for other, names in owners:
        if other != slot and name in names:
            return f"; {name!r} is a {other} method: pass it as {other}={name!r}"
    return ""


def _resolve_spec(spec: str, slot: str, names, build, kind: str, example: str) -> tuple[Any, str]:
    """Build the method a spec names in the registry ``names`` of ``slot``; ``(method, spec text)``.

    Raises
    ------
    ValueError
        An unknown name: the message lists ``names`` and, when the name belongs to another slot, says which.
    """
    name = parse_method_spec(spec).name
    if name not in names:
        raise ValueError(f"unknown {kind} {name!r}; {kind}s: {', '.join(sorted(names))} (e.g. {example!r})"
                         f"{_misplaced(name, slot)}")
    return build(spec), spec.strip()


def resolve_vision(vision) -> tuple[Any, str | None]:
    """Turn ``None``, a visual-token spec or a :class:`~mmaccel.vision_tokens.VisionTokenMethod` into
    ``(method, label)``; ``(None, None)`` for ``None`` (off).

    Raises
    ------
    ValueError
        An unknown name (the message lists :data:`mmaccel.vision_tokens.METHODS`, and says where a KV or speculative
        name belongs), a bad argument, or an object that is not a visual-token method.
    """
    from ..vision_tokens import METHODS as VISION_METHODS
    from ..vision_tokens import VisionTokenMethod
    from ..vision_tokens import build_method as build_vision

    if vision is None:
        return None, None
    if isinstance(vision, str):
        return _resolve_spec(vision, "vision", VISION_METHODS, build_vision, "visual-token method",
                             "pooling:keep_ratio=0.25")
    if isinstance(vision, VisionTokenMethod):
        return vision, vision.name
    raise ValueError(f"vision must be a visual-token spec such as 'pooling:keep_ratio=0.25' or a VisionTokenMethod, "
                     f"got {type(vision).__name__}")


def resolve_kv(kv) -> tuple[Any, str | None]:
    """Turn ``None``, a KV-cache spec or a :class:`~mmaccel.longctx.KVMethod` into ``(method, label)``;
    ``(None, None)`` for ``None``.

    Raises
    ------
    ValueError
        An unknown name (the message lists :data:`mmaccel.longctx.METHODS`, and says where a visual-token or
        speculative name belongs), a bad argument, or an object without ``make_cache``.
    """
    if kv is None:
        return None, None
    if isinstance(kv, str):
        return _resolve_spec(kv, "kv", KV_METHODS, build_method, "KV-cache method", "snapkv:budget=256")
    if hasattr(kv, "make_cache") and not hasattr(kv, "timed_generate"):
        return kv, getattr(kv, "name", type(kv).__name__)
    raise ValueError(f"kv must be a KV-cache spec such as 'snapkv:budget=256' or a KVMethod, got {type(kv).__name__}")


def resolve_speculative(speculative, *, draft=None) -> tuple[Any, str | None]:
    """Turn ``None``, a speculative spec, a :class:`~mmaccel.speculative.Drafter` or a speculative method object into
    ``(method, label)``; ``(None, None)`` for ``None``. ``draft`` is the draft model of a ``"draft"`` spec that
    names no ``model=``.

    Raises
    ------
    ValueError
        An unknown name (the message lists drafters and transformers peers, and says where a visual-token or KV
        name belongs), a bad argument, or an object that is not a speculative method.
    """
    from ..speculative import speculative_method_names

    if speculative is None:
        return None, None
    if isinstance(speculative, str):
        return _resolve_spec(speculative, "speculative", speculative_method_names(),
                             lambda spec: resolve_method(spec, draft=draft)[0], "speculative method", "prompt_lookup")
    method, label = resolve_method(speculative, draft=draft)
    if not hasattr(method, "timed_generate"):
        raise ValueError(f"speculative must be a drafter or speculative method, got {type(speculative).__name__}")
    return method, label


def _engine_cache(kv, model):
    """``kv``'s fresh cache for the speculative engine: the speculative variant for a prefill-only method (its hooks
    see the prefill only, its layers crop the rejected drafts), else the method's plain cache."""
    if getattr(kv, "supports_speculative", False):
        return kv.make_cache(model, speculative=True)
    return kv.make_cache(model)


def _croppable(kv, model) -> bool:
    """Whether ``kv``'s engine cache can be rolled back (every layer croppable) and stays passive after the prefill
    (no hooks that would read the engine's multi-token verification forwards as prefill chunks)."""
    if getattr(kv, "uses_hooks", False) and not getattr(kv, "supports_speculative", False):
        return False
    cache = _engine_cache(kv, model)
    try:
        return all(getattr(layer, "is_croppable", True) for layer in getattr(cache, "layers", []))
    finally:
        close = getattr(cache, "close", None)
        if callable(close):
            close()


def check_composition(model, method, *, kv=None, vision=None) -> None:
    """Refuse, before any run, a composition of a visual-token method, a KV method and a speculative method that
    cannot run exactly together.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    method : KV-cache method, speculative method or transformers peer
        What runs the generation (resolved, see :func:`resolve_method`).
    kv : KVMethod, optional
        A KV method stacked under a speculative ``method`` (its cache is the engine's).
    vision : VisionTokenMethod, optional

    Raises
    ------
    UnsupportedModelError
        (a ``ValueError``) ``vision`` on a model it does not support (e.g. a text-only LM).
    ValueError
        - ``kv`` with a ``method`` that is itself a KV method (give one);
        - ``kv`` other than ``full`` under transformers' own speculative paths (``generate`` builds their cache);
        - a ``kv`` that evicts during decoding, quantises or hooks attention under an engine drafter: the engine
          crops the cache to drop rejected drafts, which such a cache cannot undo. Prefill-only eviction (SnapKV,
          PyramidKV, KNorm: ``supports_speculative``) composes: its cache compresses the engine's prefill (the
          prompt minus its last token) and then only appends;
        - an in-LLM visual-token method (FastV) with any speculative method: it picks tokens with the attention of
          the prompt's last token at the prefill forward, which the engine verifies later instead;
        - any visual-token method with transformers' peers: their rollback crops to absolute sequence lengths,
          which a reduced cache no longer has;
        - a visual-token method that prunes inside the language model (FastV, Progressive, AIM with pruning layers)
          with chunked prefill (``chunked``, as ``method`` or ``kv``): it ranks the prompt's tokens inside one
          prefill forward, which chunked prefill splits, so it would prune nothing.
    """
    speculative = hasattr(method, "timed_generate")
    name = getattr(method, "name", type(method).__name__)
    if vision is not None:
        vision.check(model)
        in_llm = vision.stage == "in-llm" or getattr(vision, "pruner", None) is not None
        if in_llm and any(getattr(m, "name", None) == "chunked" for m in (method, kv)):
            raise ValueError(
                f"vision={vision.name!r} conflicts with chunked prefill: {vision.name} prunes visual tokens inside the "
                "language model's prefill forward, and chunked prefill splits that forward, so nothing would be "
                "pruned; use a pre-LLM method with chunked prefill, e.g. 'pooling:keep_ratio=0.0625' with "
                "'chunked:chunk=1024'")
        if speculative and vision.stage == "in-llm":
            raise ValueError(
                f"vision={vision.name!r} conflicts with speculative={name!r}: {vision.name} picks visual tokens with the "
                "attention of the prompt's last token in the prefill forward, and speculative decoding prefills the "
                "prompt without its last token (it is verified with the first drafts), so the kept tokens and the "
                f"output would differ from {vision.name} alone; use a pre-LLM method (pooling, visionzip, prumerge, "
                "tome) with speculative decoding, or speculative=None")
        if getattr(method, "kind", "") == "transformers":
            raise ValueError(
                f"vision={vision.name!r} conflicts with speculative={name!r}: transformers' assisted generation rolls "
                "its cache back to absolute sequence lengths, which a visual-token reduction shortens; use an engine "
                "drafter (draft, prompt_lookup, jacobi)")
    if kv is None:
        return
    kv_name = getattr(kv, "name", type(kv).__name__)
    if not speculative:
        raise ValueError(f"kv={kv_name!r} and the KV method {name!r} both set the cache; give one KV method")
    if getattr(method, "kind", "") == "transformers":
        if kv_name != "full":
            raise ValueError(f"kv={kv_name!r} conflicts with speculative={name!r}: transformers' generate builds that "
                             "peer's cache itself; use an engine drafter (draft, prompt_lookup, jacobi) with a KV "
                             "method, or kv='full'")
        return
    if not _croppable(kv, model):
        raise ValueError(
            f"kv={kv_name!r} conflicts with speculative={name!r}: speculative decoding crops the cache after each "
            f"step to drop rejected draft tokens, and {kv_name} evicts, quantises or re-scores the cache in ways a "
            f"crop cannot undo (its cache is not croppable); use kv='full' or a prefill-only method (snapkv, "
            f"pyramidkv, knorm) with speculative decoding, or "
            f"speculative=None with {kv_name}")


# ------------------------------------------------------------------------------------------------------- probes
def _sync(device: torch.device) -> None:
    """Wait for queued CUDA work on ``device`` (no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StepProbe(LogitsProcessor):
    """Timestamps each generation step; at the first (end of prefill) records the K/V bytes the cache holds."""

    def __init__(self, cache, device: torch.device):
        self.cache, self.device = cache, device
        self.first_step_time: float | None = None
        self.kv_bytes_prefill: int | None = None
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.steps == 0:
            _sync(self.device)
            self.first_step_time = time.perf_counter()
            self.kv_bytes_prefill = kv_cache_bytes(self.cache)
        self.steps += 1
        return scores


# ------------------------------------------------------------------------------------------------------- running
def generation_kwargs(model, tokenizer, temperature: float = 0.0) -> dict:
    """The ``generate`` keyword arguments every measured run uses: greedy decoding (``temperature == 0``) or plain
    sampling at ``temperature`` (no top-k / top-p), stopping at EOS; EOS and pad ids come from the tokenizer when
    the model's generation config has none.

    Returns
    -------
    dict
        ``do_sample``, ``num_beams``, ``temperature``, ``top_p``, ``top_k``, ``eos_token_id``, ``pad_token_id``.
    """
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    pad = getattr(gen_cfg, "pad_token_id", None)
    if pad is None and tokenizer is not None:
        pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    sampling = temperature > 0
    return {"do_sample": sampling, "num_beams": 1, "temperature": temperature if sampling else None, "top_p": None,
            "top_k": None, "eos_token_id": eos, "pad_token_id": pad}


class _KVCacheRun:
    """How a KV-cache method runs one timed generation: ``model.generate`` with the method's fresh cache."""

    def __init__(self, method):
        self.method = method

    def timed_generate(self, model, input_ids: torch.Tensor, *, max_new_tokens: int, gen_kwargs: dict,
                       model_inputs: dict | None = None) -> dict:
        """One ``generate`` from ``input_ids`` [1, L] (plus a VLM's ``model_inputs``, e.g. ``pixel_values``); returns
        the new ids, TTFT/decode seconds, K/V bytes after prefill and at the end, and the method's telemetry."""
        method, device = self.method, input_ids.device
        cache = method.make_cache(model)
        probe = _StepProbe(cache, device)
        try:
            _sync(device)
            t0 = time.perf_counter()
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                **cache_kwarg(model, cache, generate=True),
                max_new_tokens=max_new_tokens,
                logits_processor=LogitsProcessorList([probe]),
                **gen_kwargs,
                **(model_inputs or {}),
            )
            _sync(device)
            t_end = time.perf_counter()
            first = probe.first_step_time if probe.first_step_time is not None else t_end
            return {
                "new_ids": out[0, input_ids.shape[1]:].tolist(),
                "ttft_s": first - t0,
                "decode_s": t_end - first,
                "kv_cache_bytes_prefill": probe.kv_bytes_prefill,
                "kv_cache_bytes_final": kv_cache_bytes(cache),
                "telemetry": method.telemetry(cache) if hasattr(method, "telemetry") else {},
            }
        finally:
            close = getattr(cache, "close", None)
            if callable(close):
                close()  # remove any hooks a failed run left on the model


def runner_for(method):
    """The object that runs one timed generation of ``method``: itself when it has ``timed_generate``
    (speculative drafters and transformers peers, :mod:`mmaccel.speculative.harness`), else a KV-cache run."""
    return method if hasattr(method, "timed_generate") else _KVCacheRun(method)


class _VisionTimer:
    """Seconds spent in the forwards of a model's vision tower, by per-instance forward hooks removed on exit.

    ``seconds`` is ``None`` when the model has no tower (found by attribute: ``vision_tower``, ``visual`` or
    ``vision_model`` on the model or its inner ``model``) or the tower did not run.
    """

    def __init__(self, model, device: torch.device):
        self.tower = vision_tower(model)
        self.device = device
        self.seconds: float | None = None
        self._starts: list[float] = []
        self._handles: list = []

    def _pre(self, module, args):
        _sync(self.device)
        self._starts.append(time.perf_counter())

    def _post(self, module, args, output):
        _sync(self.device)
        if self._starts:
            self.seconds = (self.seconds or 0.0) + time.perf_counter() - self._starts.pop()

    def __enter__(self):
        if self.tower is not None:
            self._handles = [self.tower.register_forward_pre_hook(self._pre),
                             self.tower.register_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def vision_tower(model) -> torch.nn.Module | None:
    """The vision encoder of a vision-language model (``vision_tower`` / ``visual`` / ``vision_model`` on the model or
    its inner ``model``), or ``None`` for a text-only model."""
    for owner in (model, getattr(model, "model", None)):
        for name in ("vision_tower", "visual", "vision_model"):
            tower = getattr(owner, name, None)
            if isinstance(tower, torch.nn.Module):
                return tower
    return None


def _total(value) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return int(sum(value))
    return None


def visual_token_counts(telemetry: dict) -> tuple[int | None, int | None]:
    """``(before, kept)`` visual tokens from a visual-token method's ``telemetry`` (summed over images), whatever
    its stage names them: ``image_tokens_before/after`` (in-LLM pruning), ``tokens_before/after`` (pre-LLM and
    in-tower methods); ``(None, None)`` when it reports neither."""
    for before, after in (("image_tokens_before", "image_tokens_after"), ("tokens_before", "tokens_after")):
        if before in telemetry and after in telemetry:
            return _total(telemetry[before]), _total(telemetry[after])
    return None, None


def _one_run(model, method, input_ids: torch.Tensor, max_new_tokens: int, gen_kwargs: dict, *, vision=None,
             kv=None, model_inputs: dict | None = None, memory_meter: str = "rss") -> dict:
    """One timed generation of any method, composed with a visual-token method (applied around the run) and a KV
    method under a speculative one (its cache is the engine's); returns timings, memory, K/V bytes, telemetry and
    the new ids."""
    device = input_ids.device
    extra: dict = {"model_inputs": model_inputs} if model_inputs else {}
    cache = _engine_cache(kv, model) if kv is not None else None
    if cache is not None:
        extra["cache"] = cache
    try:
        with contextlib.ExitStack() as stack:
            if vision is not None:
                vision.telemetry = {}
                stack.enter_context(vision.apply(model))
            timer = stack.enter_context(_VisionTimer(model, device))
            with PeakMemory(device, cpu_meter=memory_meter) as mem:
                run = runner_for(method).timed_generate(model, input_ids, max_new_tokens=max_new_tokens,
                                                        gen_kwargs=gen_kwargs, **extra)
        if cache is not None:
            run["telemetry"] = {**run["telemetry"], "kv": kv.telemetry(cache)}
    finally:
        close = getattr(cache, "close", None)
        if callable(close):
            close()
    if vision is not None:
        run["telemetry"] = {**run["telemetry"], "vision": dict(vision.telemetry)}
        run["visual_tokens"], run["visual_tokens_kept"] = visual_token_counts(vision.telemetry)
    n, decode_s = len(run["new_ids"]), run["decode_s"]
    run["tokens_per_s"] = (n - 1) / decode_s if n > 1 and decode_s and decode_s > 0 else None
    run["peak_memory_bytes"] = mem.peak
    run["peak_memory_method"] = mem.method
    run["vision_encoder_s"] = timer.seconds
    run["prefill_s"] = None if run["ttft_s"] is None else run["ttft_s"] - (timer.seconds or 0.0)
    return run


def load_average() -> float | None:
    """The 1-minute load average (runnable processes), or ``None`` where the OS does not report one."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # pragma: no cover - Windows
        return None


def median_or_none(values):
    """Median of the non-``None`` values (an ``int`` when they all are ints); ``None`` if there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    med = statistics.median(values)
    return int(med) if all(isinstance(v, int) for v in values) else float(med)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def generate_measured(
    model,
    tokenizer,
    input_ids,
    *,
    method=None,
    label: str | None = None,
    max_new_tokens: int = 16,
    repeats: int = 1,
    warmup: int = 1,
    warmup_ids=None,
    temperature: float = 0.0,
    draft=None,
    vision=None,
    kv=None,
    raise_errors: bool = False,
    memory_meter: str = "rss",
) -> RunRecord:
    """Generate from one prompt with a KV-cache, speculative or transformers-peer method -- optionally composed with
    a visual-token method and a KV method under the speculative one -- and measure it.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Any Hugging Face causal LM or vision-language model (LLaVA, Qwen2-VL); it is run under
        ``torch.inference_mode``.
    tokenizer : a Hugging Face tokenizer
        Decodes the output; supplies EOS/pad when the model's generation config has none.
    input_ids : str, list of int, torch.Tensor [L] or [1, L], an object with ``input_ids``, or a mapping
        One prompt (batch size 1). A mapping is a processor's output: ``input_ids`` [1, L] plus a VLM's
        ``pixel_values``, ``image_sizes`` / ``image_grid_thw``, ``mm_token_type_ids``, ... (see
        :func:`split_inputs`); floating-point tensors are cast to the model's dtype.
    method : None, str or a method object
        ``None`` = full attention; a spec: a KV-cache method (``"streaming:window=256"``; a fresh cache is built for
        every run with ``method.make_cache(model)``), an engine drafter (``"draft:model=micro-draft:k=4"``,
        ``"prompt_lookup"``, ``"jacobi"``) or a transformers peer (``"hf_assisted:model=micro-draft"``,
        ``"hf_prompt_lookup:num_tokens=10"``, ``"hf_early_exit:layers=15"``); or an object of one of those kinds
        (see :func:`resolve_method`).
    label : str, optional
        Label for the record; default the spec text (or the method's registry name).
    max_new_tokens : int
        Upper bound of generated tokens; generation stops early at EOS.
    repeats : int
        Measured runs; timings and peak memory are their medians.
    warmup : int
        Unrecorded runs before the measured ones.
    warmup_ids : prompt, optional
        What the warm-up runs use (same forms as ``input_ids``), e.g. a short prompt so that warming up a long-context
        run does not cost a second full prefill. Default: ``input_ids`` itself.
    temperature : float
        ``0`` (default) = greedy; ``> 0`` = sampling at that temperature (the engine's lossless speculative
        sampling for drafters; ``generate(do_sample=True)`` otherwise).
    draft : str or transformers.PreTrainedModel, optional
        Draft model for ``draft`` / ``hf_assisted`` specs that name no ``model=``.
    vision : None, str or VisionTokenMethod
        A visual-token method (``"pooling:keep_ratio=0.25"``, :data:`mmaccel.vision_tokens.METHODS`), applied around
        every run with ``with vision.apply(model):``; its ``telemetry`` goes to ``record.telemetry["vision"]`` and
        the token counts to ``visual_tokens`` / ``visual_tokens_kept``. Needs image or video inputs.
    kv : None, str or KVMethod
        A KV-cache method. With a speculative ``method`` its fresh ``make_cache(model)`` is the engine's cache every
        run (``record.telemetry["kv"]``); with ``method=None`` it is the method itself.
    raise_errors : bool
        Re-raise the exception of a failed run instead of returning a ``"failed"`` record.
    memory_meter : {"rss", "allocator"}
        How ``peak_memory_bytes`` is measured off CUDA (:class:`~mmaccel.eval.memory.PeakMemory`'s ``cpu_meter``):
        the sampled process RSS (default), or torch's CPU allocations under the profiler, exact tensor bytes that
        compare across processes, but with the profiler's per-op cost inside the timings (use it for memory, not
        speed).

    Returns
    -------
    RunRecord
        ``status="ok"``, or ``status="failed"`` with ``error`` when a run raised (e.g. ``torch.OutOfMemoryError``, an
        input longer than the model handles): failures of a run are recorded, not raised, so sweeps go on.
        Timings include ``vision_encoder_s`` and ``prefill_s`` (see the module docstring).

    Raises
    ------
    ValueError
        Configuration errors, before any run: an unknown method or bad method arguments (e.g. a draft length
        ``k <= 0``), a draft model with another vocabulary or tokenizer, an empty or batched prompt,
        ``max_new_tokens < 1``, ``repeats < 1``, ``warmup < 0``, ``temperature < 0`` or an unknown
        ``memory_meter``; a composition that cannot be exact (:func:`check_composition`), or ``vision`` without
        image/video inputs.
    UnsupportedModelError
        (a ``ValueError``) ``vision`` on a model the method does not support.
    """
    if max_new_tokens < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need max_new_tokens >= 1, repeats >= 1 and warmup >= 0; got {max_new_tokens}, {repeats}, {warmup}"
        )
    if temperature is None or not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    check_cpu_meter(memory_meter, "memory_meter")
    kv_obj, kv_label = resolve_kv(kv)
    vision_obj, vision_label = resolve_vision(vision)
    if method is None and kv_obj is not None:
        method_obj, default_label, kv_obj, kv_label = kv_obj, kv_label, None, None  # a KV method alone
    else:
        method_obj, default_label = resolve_method(method, draft=draft)
        if kv_obj is not None and getattr(method_obj, "kind", "") == "transformers" and kv_obj.name == "full":
            kv_obj = None  # generate's own DynamicCache is full attention
    check_composition(model, method_obj, kv=kv_obj, vision=vision_obj)
    if kv_obj is not None or vision_obj is not None:
        default_label = " + ".join(x for x in (vision_label, kv_label, default_label) if x)
    device = getattr(model, "device", torch.device("cpu"))
    dtype = next(model.parameters()).dtype if hasattr(model, "parameters") else None
    ids, model_inputs = split_inputs(input_ids, tokenizer)
    ids, model_inputs = ids.to(device), _to_model(model_inputs, device, dtype)
    if vision_obj is not None and not any(k in model_inputs for k in ("pixel_values", "pixel_values_videos")):
        raise ValueError(f"vision={vision_label!r} needs image or video inputs; pass the processor's output (with "
                         "pixel_values), e.g. processor(images=image, text=prompt, return_tensors='pt')")
    if warmup_ids is None:
        warm_ids, warm_inputs = ids, model_inputs
    else:
        warm_ids, warm_inputs = split_inputs(warmup_ids, tokenizer)
        warm_ids, warm_inputs = warm_ids.to(device), _to_model(warm_inputs, device, dtype)
    record = RunRecord(
        method=label or default_label,
        method_name=getattr(method_obj, "name", None),
        prompt_tokens=int(ids.shape[1]),
        repeats=repeats,
        warmup=warmup,
        device=str(device),
        dtype=str(next(model.parameters()).dtype) if hasattr(model, "parameters") else "",
        threads=torch.get_num_threads(),
    )
    prepare = getattr(method_obj, "prepare", None)
    if callable(prepare) and hasattr(method_obj, "timed_generate"):  # speculative methods: load a draft once, check it against the target (ValueError)
        prepare(model, tokenizer)
    gen_kwargs = generation_kwargs(model, tokenizer, temperature)
    runs = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            if i == warmup:
                record.load_avg_1m = load_average()
            try:
                warm = i < warmup
                run = _one_run(model, method_obj, warm_ids if warm else ids, max_new_tokens, gen_kwargs,
                               vision=vision_obj, kv=kv_obj, model_inputs=warm_inputs if warm else model_inputs,
                               memory_meter=memory_meter)
            except Exception as exc:
                if raise_errors:
                    raise
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                phase = "warm-up" if i < warmup else "measured"
                logger.warning("%s: %s run failed: %s", record.method, phase, _error_text(exc))
                record.status, record.error = "failed", _error_text(exc)
                return record
            if i >= warmup:
                runs.append(run)
    last = runs[-1]
    if any(r["new_ids"] != last["new_ids"] for r in runs):
        logger.warning("%s: greedy outputs differ between repeats; reporting the last one", record.method)
    record.output_ids = last["new_ids"]
    record.new_tokens = len(last["new_ids"])
    record.output_text = tokenizer.decode(last["new_ids"], skip_special_tokens=True) if tokenizer is not None else ""
    record.samples = [{k: r[k] for k in _TIMED_FIELDS} for r in runs]
    for k in _TIMED_FIELDS:
        setattr(record, k, median_or_none([r[k] for r in runs]))
    record.peak_memory_method = last["peak_memory_method"]
    record.kv_cache_bytes_prefill = last["kv_cache_bytes_prefill"]
    record.kv_cache_bytes_final = last["kv_cache_bytes_final"]
    record.telemetry = _jsonable(last["telemetry"])
    record.visual_tokens = last.get("visual_tokens")
    record.visual_tokens_kept = last.get("visual_tokens_kept")
    return record


def _jsonable(obj):
    """Telemetry made JSON-safe: tensors to lists, unknown objects to ``repr``."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)
