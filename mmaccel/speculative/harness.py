"""Speculative methods as measured-generation methods: the engine's drafters and transformers' own speculative paths.

The composition layer (:func:`mmaccel.pipeline.resolve_method`) resolves a method spec, parsed once, to an object that
knows how to run one timed generation (``timed_generate``); this module supplies those objects for speculative
decoding (a drafter with its draft length, and transformers' own speculative paths: the speculative registry's
members, which need nothing above :mod:`mmaccel.speculative`), so that the
engine's drafters and transformers' peers go through the same measured path and the same ``RunRecord`` as the
KV-cache methods (the harness contract of Spec-Bench: Xia et al., "Unlocking Efficiency in Large Language Model
Inference: A Comprehensive Survey of Speculative Decoding", 2024, arXiv 2401.07851).

Specs
-----
- Engine drafters (:data:`mmaccel.speculative.METHODS`), run by :func:`~mmaccel.speculative.speculative_generate`:
  ``draft:model=micro-draft``, ``prompt_lookup:max_ngram=3``, ``pld``, ``jacobi``, and the token-tree drafters
  ``tree:model=micro-draft:shape=3,2,2`` (static top-k tree) and ``dytree:model=micro-draft:width=4:depth=5``
  (grown by draft confidence), greedy or sampled, batch 1; ``eagle:head=smollm2-135m-eagle`` (a trained EAGLE
  head over the target's features) and ``cascade:first=prompt_lookup:then=eagle`` (copy when a copy pays, else
  EAGLE, ``then_k`` tokens). Every drafter spec also takes ``k`` (draft tokens per step, ``>= 1``; default 4, 16 for
  prompt lookup and the cascade, 10 for ``pld`` as in PLD, the tree's depth for a tree, where ``k`` caps the depth)
  and ``adaptive=true`` (:class:`~mmaccel.speculative.AdaptiveDraftLength` starting at ``k``).
- transformers' own speculative paths (:data:`PEERS`), run by ``model.generate(**kwargs)``:
  ``hf_assisted:model=micro-draft`` (``assistant_model=``), ``hf_prompt_lookup:num_tokens=10``
  (``prompt_lookup_num_tokens=``), ``hf_early_exit:layers=15`` (``assistant_early_exit=``).

Telemetry
---------
Every speculative record's telemetry holds ``new_tokens``, ``target_forwards``, ``draft_forwards``, ``steps``
(verification forwards), ``proposed_total`` / ``accepted_total`` (draft tokens), ``acceptance_rate``,
``mean_accepted_length`` (tokens committed per verification forward, Spec-Bench's "mean accepted tokens"),
``forward_ratio`` (``new_tokens / target_forwards``), ``draft_seconds``, ``verify_seconds``, ``prefill_seconds``
and ``total_seconds``. transformers does not expose acceptance; for the peers it is read off forward hooks on the
target (input length of each forward = candidates + 1), and ``draft_seconds`` is all time outside target forwards
(drafting plus ``generate``'s own bookkeeping). The engine's prefill is a separate forward over the prompt minus its
last token; transformers' first forward covers the prompt and the first candidates at once (reported as
``prefill_seconds`` there, and counted as a verification step).
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext
from typing import Any, ClassVar

import torch

from ..kernels._common import synchronize
from ..longctx import kv_cache_bytes
from ..specs import MethodSpec, accepted_keys, build_from_registry, parse_method_spec
from .base import Drafter
from .draft_model import DraftModel, check_same_vocabulary
from .quantized_draft import check_scheme, quantized_draft
from .schedule import AdaptiveDraftLength, check_draft_length

logger = logging.getLogger(__name__)

#: default draft tokens per step of each drafter (PLD drafts up to 10 tokens, Saxena 2023)
DEFAULT_K = {"prompt_lookup": 16, "pld": 10, "eagle": 4, "cascade": 16}


def _load_draft(ref, target):
    """Load a draft/assistant model named ``ref`` on the target's device and dtype; ``(model, tokenizer)``."""
    from ..models import load

    dtype = next(target.parameters()).dtype
    with torch.inference_mode(False):
        return load(ref, device=str(target.device), dtype=dtype)


class SpeculativeMethod:
    """An engine drafter plus its draft length: one timed :func:`~mmaccel.speculative.speculative_generate` per run.

    Parameters
    ----------
    drafter : Drafter
        From :data:`mmaccel.speculative.METHODS` (e.g. :class:`DraftModel`, :class:`PromptLookup`, :class:`Jacobi`).
    num_draft_tokens : int or AdaptiveDraftLength
        Draft tokens per step, ``>= 1`` (the gamma of Leviathan et al., 2023, arXiv 2211.17192).

    Raises
    ------
    ValueError
        A draft length ``<= 0``; at :meth:`prepare`, a draft model whose vocabulary or tokenizer differs from the
        target's.
    """

    kind: ClassVar[str] = "speculative"

    def __init__(self, drafter: Drafter, num_draft_tokens: int | AdaptiveDraftLength = 4):
        if not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be a Drafter, got {type(drafter).__name__}")
        check_draft_length(num_draft_tokens)
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.name = drafter.name
        self.lossless = bool(getattr(drafter, "lossless", True))

    def draft_modules(self) -> list:
        """The drafter's networks (:meth:`~mmaccel.speculative.Drafter.draft_modules`)."""
        return self.drafter.draft_modules()

    def prepare(self, model, tokenizer) -> None:
        """Load a named draft model (a cascade's too) once and check it against the target (vocabulary, BOS/EOS,
        tokenizer).

        Raises
        ------
        ValueError
            See :func:`~mmaccel.speculative.check_same_vocabulary`.
        """
        for drafter in draft_holders(self.drafter):  # a cascade's nested draft model too
            if not isinstance(drafter, DraftModel):
                continue
            if tokenizer is not None and drafter.target_tokenizer is None:
                drafter.target_tokenizer = tokenizer
            drafter._load(model)
            check_same_vocabulary(drafter.model, model, drafter.tokenizer, drafter.target_tokenizer)

    def timed_generate(self, model, input_ids: torch.Tensor, *, max_new_tokens: int, gen_kwargs: dict,
                       model_inputs: dict | None = None, cache=None) -> dict:
        """One speculative generation from ``input_ids`` [1, L].

        ``model_inputs`` (a VLM's ``pixel_values``, ``image_grid_thw``, ...) go to the prefill forward; ``cache`` (an
        empty, croppable cache such as a KV method's ``make_cache(model)``) replaces the engine's ``DynamicCache``
        (see :func:`~mmaccel.speculative.speculative_generate`).

        Returns
        -------
        dict
            ``new_ids`` (list of int), ``ttft_s`` (``first_token_seconds``, s), ``decode_s`` (``total_seconds -
            first_token_seconds``, s), ``kv_cache_bytes_prefill`` (``None``: the engine does not sample it),
            ``kv_cache_bytes_final`` (bytes of the target's K/V at the end) and ``telemetry``.
        """
        from .engine import speculative_generate

        temperature = float(gen_kwargs.get("temperature") or 0.0) if gen_kwargs.get("do_sample") else 0.0
        out = speculative_generate(
            model, input_ids, self.drafter, max_new_tokens=max_new_tokens, temperature=temperature,
            num_draft_tokens=self.num_draft_tokens, eos_token_id=gen_kwargs.get("eos_token_id"),
            pad_token_id=gen_kwargs.get("pad_token_id"), attention_mask=torch.ones_like(input_ids), cache=cache,
            model_inputs=model_inputs,
        )
        telemetry = out.telemetry()
        telemetry.update(
            proposed_total=int(sum(out.proposed)), accepted_total=int(sum(out.accepted)),
            num_draft_tokens=(self.num_draft_tokens if isinstance(self.num_draft_tokens, int)
                              else f"adaptive(start={self.num_draft_tokens.start})"),
            lossless=self.lossless, runner="mmaccel.speculative_generate",
        )
        first = out.first_token_seconds if out.steps else out.total_seconds
        return {
            "new_ids": out.sequences[0, out.prompt_length:].tolist(),
            "ttft_s": first,
            "decode_s": out.total_seconds - first,
            "kv_cache_bytes_prefill": None,
            "kv_cache_bytes_final": out.kv_cache_bytes,
            "telemetry": telemetry,
        }


# ------------------------------------------------------------------------------------------------ transformers
class _ForwardLog:
    """Forward hooks on the target (and an assistant): per call, its start/end time, input length, draft or not.

    A forward is a draft forward when it runs on the assistant model, or, for early exit, when the target runs with
    fewer hidden layers than it has (transformers lowers ``config.num_hidden_layers`` while drafting).
    """

    def __init__(self, model, assistant=None):
        self.model, self.assistant = model, assistant
        base = getattr(model, getattr(model, "base_model_prefix", ""), model)
        self._config = getattr(base, "config", model.config)
        self._layers = getattr(self._config, "num_hidden_layers", None)
        self.calls: list[dict] = []
        self._open: list[dict] = []
        self._handles = []
        self.device = getattr(model, "device", torch.device("cpu"))

    def _pre(self, is_assistant):
        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            n = int(ids.shape[1]) if ids is not None else int(kwargs["inputs_embeds"].shape[1])
            draft = is_assistant or getattr(self._config, "num_hidden_layers", None) != self._layers
            synchronize(self.device)
            call = {"start": time.perf_counter(), "tokens": n, "draft": draft}
            self._open.append(call)
            self.calls.append(call)
        return hook

    def _post(self, module, args, output):
        synchronize(self.device)
        if self._open:
            self._open.pop()["end"] = time.perf_counter()

    def __enter__(self):
        self._handles.append(self.model.register_forward_pre_hook(self._pre(False), with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._post))
        if self.assistant is not None and self.assistant is not self.model:
            self._handles.append(self.assistant.register_forward_pre_hook(self._pre(True), with_kwargs=True))
            self._handles.append(self.assistant.register_forward_hook(self._post))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []


class TransformersPeer:
    """Base of transformers' own speculative paths, run as peers through ``model.generate(**generate_kwargs())``.

    Subclasses set ``name`` and implement :meth:`generate_kwargs`. transformers' assisted generation is batch 1 and
    lossless in greedy mode (a linear chain verified against the target's argmax).
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "transformers"
    lossless: ClassVar[bool] = True

    def prepare(self, model, tokenizer) -> None:
        """Load what the peer needs, check it against the target; a no-op by default."""

    def generate_kwargs(self, model) -> dict:
        """The keyword arguments this peer adds to ``model.generate``."""
        raise NotImplementedError

    def _assistant(self):
        return None

    def configured(self, model):
        """A context in which ``model.generate(**generate_kwargs())`` runs this peer as configured (settings that
        live outside the call, e.g. an assistant's generation config, are put back on exit); nothing by default."""
        return nullcontext()

    def timed_generate(self, model, input_ids: torch.Tensor, *, max_new_tokens: int, gen_kwargs: dict,
                       model_inputs: dict | None = None) -> dict:
        """One ``model.generate`` with this peer's kwargs (and a VLM's ``model_inputs``); acceptance and timings from
        forward hooks.

        Returns
        -------
        dict
            The keys of :meth:`SpeculativeMethod.timed_generate`. ``ttft_s`` ends with the first target forward
            (prompt + first candidates), seconds; ``decode_s`` is the rest of the call, seconds.
        """
        extra = self.generate_kwargs(model)
        L = int(input_ids.shape[1])
        device = input_ids.device
        with self.configured(model), _ForwardLog(model, self._assistant()) as log:
            synchronize(device)
            t0 = time.perf_counter()
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                 return_dict_in_generate=True, **gen_kwargs, **extra, **(model_inputs or {}))
            synchronize(device)
            t_end = time.perf_counter()
        new_ids = out.sequences[0, L:].tolist()
        n = len(new_ids)
        target = [c for c in log.calls if not c["draft"] and "end" in c]
        drafts = [c for c in log.calls if c["draft"] and "end" in c]
        proposed = []
        for i, c in enumerate(target):
            proposed.append(c["tokens"] - L if i == 0 else c["tokens"] - 1)
        steps = len(target)
        accepted_total = max(n - steps, 0)
        total = t_end - t0
        prefill = target[0]["end"] - target[0]["start"] if target else 0.0
        verify = sum(c["end"] - c["start"] for c in target[1:])
        first = (target[0]["end"] - t0) if target else total
        telemetry: dict[str, Any] = {
            "runner": "transformers.generate",
            "generate_kwargs": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else type(v).__name__)
                                for k, v in extra.items()},
            "new_tokens": n,
            "target_forwards": steps,
            "draft_forwards": len(drafts),
            "steps": steps,
            "proposed": proposed,
            "proposed_total": int(sum(proposed)),
            "accepted_total": accepted_total,
            "acceptance_rate": accepted_total / sum(proposed) if sum(proposed) > 0 else None,
            "mean_accepted_length": n / steps if steps else None,
            "forward_ratio": n / steps if steps and n else None,
            "prefill_seconds": prefill,
            "verify_seconds": verify,
            "draft_seconds": total - prefill - verify,
            "draft_model_seconds": sum(c["end"] - c["start"] for c in drafts),
            "first_token_seconds": first,
            "total_seconds": total,
            "lossless": self.lossless,
        }
        cache = getattr(out, "past_key_values", None)
        return {
            "new_ids": new_ids,
            "ttft_s": first,
            "decode_s": t_end - t0 - first,
            "kv_cache_bytes_prefill": None,
            "kv_cache_bytes_final": kv_cache_bytes(cache) if cache is not None else None,
            "telemetry": telemetry,
        }


def _check_positive(name: str, key: str, value, example: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}: {key} must be an integer >= 1, got {value!r}; e.g. {example}")


class HFAssisted(TransformersPeer):
    """transformers' assisted generation with a draft model: ``generate(assistant_model=...)`` (Leviathan et al.,
    2023, arXiv 2211.17192; transformers' ``AssistedCandidateGenerator``).

    Parameters
    ----------
    model : str or transformers.PreTrainedModel
        The assistant: a zoo name, a local checkpoint directory, a hub id, or a model object; it must share the
        target's tokenizer (no ``assistant_tokenizer`` is passed).
    num_tokens : int, optional
        ``num_assistant_tokens`` (default: transformers', adapted by its schedule).
    schedule : {"heuristic", "heuristic_transient", "constant"}, optional
        ``num_assistant_tokens_schedule`` (default: transformers'). Set on the assistant's generation config.
    quantize : {"int8"}, optional
        Hand transformers the int8 copy of the assistant that ``draft:quantize=int8`` drafts with
        (:func:`~mmaccel.speculative.quantized_draft.quantized_draft`), to compare the two engines on equal drafts.

    Raises
    ------
    ValueError
        ``num_tokens <= 0``, an unknown schedule or ``quantize``, or (at :meth:`prepare`) an assistant whose
        vocabulary or tokenizer differs from the target's, or that cannot be quantized as asked.
    """

    name: ClassVar[str] = "hf_assisted"

    def __init__(self, model="micro-draft", num_tokens: int | None = None, schedule: str | None = None,
                 quantize: str | None = None):
        _check_positive(self.name, "num_tokens", num_tokens, "hf_assisted:model=micro-draft:num_tokens=5")
        check_scheme(quantize, self.name)
        if schedule is not None and schedule not in ("heuristic", "heuristic_transient", "constant"):
            raise ValueError(f"hf_assisted: schedule must be heuristic, heuristic_transient or constant, got "
                             f"{schedule!r}")
        self.model_ref = model
        self.model = None if isinstance(model, str) else model
        self.tokenizer = None
        self.num_tokens, self.schedule, self.quantize = num_tokens, schedule, quantize

    def prepare(self, model, tokenizer) -> None:
        """Load (and quantize, if asked) the assistant once; refuse one with another vocabulary or tokenizer."""
        if self.model is None:
            self.model, self.tokenizer = _load_draft(self.model_ref, model)
            logger.info("loaded assistant model %s", self.model_ref)
        self.model = quantized_draft(self.model, self.quantize, self.name)
        check_same_vocabulary(self.model, model, self.tokenizer, tokenizer)

    def draft_modules(self) -> list:
        """The assistant model, once loaded (:meth:`prepare`)."""
        return [] if self.model is None else [self.model]

    def _assistant(self):
        return self.model

    def generate_kwargs(self, model) -> dict:
        if self.model is None:
            raise RuntimeError("hf_assisted: call prepare(model, tokenizer) first")
        return {"assistant_model": self.model}

    @contextmanager
    def configured(self, model):
        """``num_assistant_tokens`` and its schedule set on the assistant's generation config for one call and put
        back after it, so peers sharing one assistant object (``hf_assisted:schedule=constant`` beside
        ``hf_assisted:schedule=heuristic``) do not see each other's settings."""
        gc = self.model.generation_config
        saved = gc.num_assistant_tokens, gc.num_assistant_tokens_schedule
        try:
            if self.num_tokens is not None:
                gc.num_assistant_tokens = self.num_tokens
            if self.schedule is not None:
                gc.num_assistant_tokens_schedule = self.schedule
            yield
        finally:
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = saved


class HFPromptLookup(TransformersPeer):
    """transformers' prompt lookup decoding: ``generate(prompt_lookup_num_tokens=...)`` (Saxena, "Prompt Lookup
    Decoding", 2023; transformers' ``PromptLookupCandidateGenerator``).

    Parameters
    ----------
    num_tokens : int
        ``prompt_lookup_num_tokens``: tokens copied per candidate, ``>= 1`` (default 10).
    max_ngram : int, optional
        ``max_matching_ngram_size`` (default: transformers', 2).

    Raises
    ------
    ValueError
        ``num_tokens`` or ``max_ngram`` ``<= 0``.
    """

    name: ClassVar[str] = "hf_prompt_lookup"

    def __init__(self, num_tokens: int = 10, max_ngram: int | None = None):
        _check_positive(self.name, "num_tokens", num_tokens, "hf_prompt_lookup:num_tokens=10")
        _check_positive(self.name, "max_ngram", max_ngram, "hf_prompt_lookup:num_tokens=10:max_ngram=3")
        self.num_tokens, self.max_ngram = num_tokens, max_ngram

    def generate_kwargs(self, model) -> dict:
        kw = {"prompt_lookup_num_tokens": self.num_tokens}
        if self.max_ngram is not None:
            kw["max_matching_ngram_size"] = self.max_ngram
        return kw


class HFEarlyExit(TransformersPeer):
    """transformers' self-speculation by early exit: ``generate(assistant_early_exit=layers)`` (LayerSkip: Elhoushi
    et al., 2024, arXiv 2404.16710). The draft is the target's first ``layers`` layers plus its LM head; models not
    trained for early exit draft poorly.

    Parameters
    ----------
    layers : int
        Layers the draft runs, ``1 <= layers < num_hidden_layers`` of the target.

    Raises
    ------
    ValueError
        ``layers <= 0``; at :meth:`prepare`, ``layers >=`` the target's layer count.
    """

    name: ClassVar[str] = "hf_early_exit"

    def __init__(self, layers: int = 1):
        _check_positive(self.name, "layers", layers, "hf_early_exit:layers=2")
        self.layers = layers

    def prepare(self, model, tokenizer) -> None:
        """Check that the target has more layers than the draft runs."""
        total = getattr(model.config, "num_hidden_layers", None)
        if total is not None and self.layers >= total:
            raise ValueError(f"hf_early_exit: layers={self.layers} must be below the target's {total} layers")

    def _assistant(self):
        return None

    def generate_kwargs(self, model) -> dict:
        return {"assistant_early_exit": self.layers}


#: transformers' own speculative paths, by spec name
PEERS: dict[str, type[TransformersPeer]] = {
    "hf_assisted": HFAssisted,
    "hf_prompt_lookup": HFPromptLookup,
    "hf_early_exit": HFEarlyExit,
}


def draft_holders(method):
    """``method`` and the drafters inside it (a :class:`SpeculativeMethod`'s drafter, a cascade's two), depth first:
    where :class:`DraftModel` drafters and :class:`HFAssisted` peers hold their ``model_ref``."""
    stack = [method]
    while stack:
        obj = stack.pop()
        yield obj
        stack.extend(c for c in (getattr(obj, a, None) for a in ("drafter", "first", "then"))
                     if c is not None and not isinstance(c, str))


def share_draft_models(methods, target) -> dict:
    """Load each draft/assistant model that ``methods`` name (``model_ref`` strings of :class:`DraftModel` drafters,
    cascades included, and of :class:`HFAssisted`) once, and hand the one object to every method naming it, so that
    ``draft``, ``hf_assisted:schedule=constant`` and ``hf_assisted:schedule=heuristic`` run the same weights in one
    process without holding three copies (a 0.5B draft is 2.5 GB in float32). Methods asking for ``quantize=int8``
    get the one int8 copy of that object (:func:`~mmaccel.speculative.quantized_draft.quantized_draft`).

    Parameters
    ----------
    methods : iterable
        Resolved methods (objects that are not speculative are skipped).
    target : transformers.PreTrainedModel
        Drafts load on its device and dtype.

    Returns
    -------
    dict
        ``{model_ref: (model, tokenizer)}`` of what was loaded.

    Raises
    ------
    ValueError
        As :func:`mmaccel.models.load` for a name it cannot load.
    """
    loaded: dict = {}
    for method in methods:
        for obj in draft_holders(method):
            ref = getattr(obj, "model_ref", None)
            if not isinstance(obj, (DraftModel, HFAssisted)) or not isinstance(ref, str) or obj.model is not None:
                continue
            if ref not in loaded:
                loaded[ref] = _load_draft(ref, target)
                logger.info("loaded draft model %s (shared)", ref)
            obj.model, obj.tokenizer = loaded[ref]
            obj.model = quantized_draft(obj.model, obj.quantize, obj.name)  # one int8 copy for every asker
    return loaded


def speculative_method_names() -> list[str]:
    """Every spec name this module resolves: the engine's drafters, then transformers' peers."""
    from .registry import METHODS

    return sorted(METHODS) + sorted(PEERS)


def is_speculative_spec(spec: str | MethodSpec) -> bool:
    """Whether ``spec`` names an engine drafter or a transformers peer (no validation of its arguments).

    Raises
    ------
    ValueError
        A malformed spec (see :func:`mmaccel.specs.parse_method_spec`).
    """
    return parse_method_spec(spec).name in speculative_method_names()


def build_speculative_method(spec: str | MethodSpec, *, draft=None):
    """Build a :class:`SpeculativeMethod` or a :class:`TransformersPeer` from a spec.

    Parameters
    ----------
    spec : str or MethodSpec
        ``"draft:model=micro-draft:k=4"``, ``"prompt_lookup:max_ngram=3"``, ``"jacobi:k=4:adaptive=true"``,
        ``"tree:model=micro-draft:shape=3,2,2"``, ``"dytree:width=4:depth=5"``,
        ``"hf_assisted:model=micro-draft"``, ``"hf_prompt_lookup:num_tokens=10"``, ``"hf_early_exit:layers=15"``.
    draft : str or transformers.PreTrainedModel, optional
        The draft/assistant for ``draft`` and ``hf_assisted`` specs that name no ``model=``, nested ones too
        (``cascade:first=prompt_lookup:then=draft``).

    Raises
    ------
    ValueError
        An unknown name (the message lists both registries), an unknown argument (the message lists the valid
        keys), a draft length ``k <= 0``, or a bad value.
    """
    from .registry import METHODS

    parsed = parse_method_spec(spec)
    kwargs = dict(parsed.kwargs)
    if parsed.name in PEERS:
        if parsed.name == "hf_assisted" and draft is not None and "model" not in kwargs:
            kwargs["model"] = draft
        return build_from_registry(MethodSpec(parsed.name, kwargs, parsed.text), PEERS, "transformers peer")
    if parsed.name not in METHODS:
        raise ValueError(f"unknown speculative method {parsed.name!r}; drafters: {', '.join(sorted(METHODS))}; "
                         f"transformers peers: {', '.join(sorted(PEERS))}")
    k = kwargs.pop("k", None)
    adaptive = kwargs.pop("adaptive", False)
    if not isinstance(adaptive, bool):
        raise ValueError(  # noqa: TRY004 - a bad spec value is a configuration error (one `error:` line)
            f"{parsed.name}: adaptive must be true or false, got {adaptive!r} (in {parsed.text!r})")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k <= 0):
        raise ValueError(f"{parsed.name}: draft length k must be an integer >= 1, got {k!r} (in {parsed.text!r}); "
                         f"e.g. {parsed.name}:k=4")
    if issubclass(METHODS[parsed.name], DraftModel) and draft is not None and "model" not in kwargs:
        kwargs["model"] = draft
    if draft is not None:  # a draft model nested in a wrapper (cascade:then=draft) gets the default draft too
        for key in ("first", "then"):
            nested = kwargs.get(key)
            if not isinstance(nested, str):
                continue
            inner = parse_method_spec(nested.replace(",", ":"))
            if inner.name in METHODS and issubclass(METHODS[inner.name], DraftModel) and "model" not in inner.kwargs:
                kwargs[key] = build_from_registry(MethodSpec(inner.name, {**inner.kwargs, "model": draft}, inner.text),
                                                  METHODS, "drafter")
    valid = accepted_keys(METHODS[parsed.name]) or []
    unknown = [key for key in kwargs if key not in valid]
    if unknown:
        raise ValueError(f"drafter {parsed.name!r} has no argument {', '.join(map(repr, unknown))}; valid keys: "
                         f"{', '.join(valid + ['k', 'adaptive'])} (in {parsed.text!r})")
    drafter = build_from_registry(MethodSpec(parsed.name, kwargs, parsed.text), METHODS, "drafter")
    if k is None:  # a tree drafter's depth, else the drafter's usual draft length
        k = getattr(drafter, "depth", None) or DEFAULT_K.get(parsed.name, 4)
    length = AdaptiveDraftLength(start=k, max_tokens=max(16, k)) if adaptive else k
    return SpeculativeMethod(drafter, length)
