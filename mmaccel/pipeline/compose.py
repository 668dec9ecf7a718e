"""Composition: a visual-token method, a KV-cache method and a speculative method resolved once into one typed object.

>>> composed = compose(vision="pooling:keep_ratio=0.25", kv=ChunkKV(SnapKV(ratio=0.25)), speculative="prompt_lookup")
>>> composed.check(model)                     # the refusals of check_composition, before anything runs
>>> with composed.applied(model):             # the visual-token method's hooks, removed on exit
...     run = composed.run(model, input_ids, max_new_tokens=32, gen_kwargs=generation_kwargs(model, tok))

How the pieces compose, from the outside in:

1. ``with vision.apply(model):`` -- the visual-token method's per-instance hooks (pre-LLM reduction, in-tower ToMe,
   or in-LLM pruning) around the whole run;
2. the generation: with a speculative method, :func:`mmaccel.speculative.speculative_generate` decodes into the KV
   method's fresh cache (for a prefill-only eviction method -- SnapKV, PyramidKV, KNorm --
   ``make_cache(model, speculative=True)``, which compresses the engine's prefill and then only appends, so rejected
   drafts crop exactly); without one, ``model.generate(past_key_values=kv.make_cache(model))``
   (:class:`~mmaccel.pipeline.runners.KVCacheRun`).

:class:`mmaccel.Pipeline`, the CLI, the app and :func:`mmaccel.eval.generate_measured` all build this object; the
measuring module times what it runs and never decides what a method is.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from ..longctx.base import close_cache
from .resolve import resolve_kv, resolve_method, resolve_speculative, resolve_vision
from .runners import runner_for


def engine_cache(kv, model):
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
    cache = engine_cache(kv, model)
    try:
        return all(getattr(layer, "is_croppable", True) for layer in getattr(cache, "layers", []))
    finally:
        close_cache(cache)


def check_composition(model, method, *, kv=None, vision=None) -> None:
    """Refuse, before any run, a composition of a visual-token method, a KV method and a speculative method that
    cannot run exactly together.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    method : KV-cache method, speculative method or transformers peer
        What runs the generation (resolved, see :func:`~mmaccel.pipeline.resolve_method`).
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


@dataclass
class Composition:
    """What runs one generation: a visual-token method, a KV-cache method and a speculative method, resolved once.

    Built by :func:`compose` (or :func:`compose_run`); every field is an object, never a spec string.

    Attributes
    ----------
    vision : VisionTokenMethod or None
        Applied around the run (``None`` = off).
    kv : KVMethod or None
        The KV-cache method (``None`` = full attention). Under a speculative method its fresh engine cache is the
        engine's cache (:func:`engine_cache`).
    speculative : SpeculativeMethod, TransformersPeer or None
        ``None`` = autoregressive ``generate``.
    vision_label, kv_label, speculative_label : str or None
        The spec text (or registry name) of each piece that is on.
    method : object
        What runs the generation: ``speculative``, else ``kv``, else full attention (derived).
    engine_kv : KVMethod or None
        ``kv`` under ``speculative`` (``None`` without a speculative method, and for ``full`` under a transformers
        peer, whose ``generate`` builds its own cache) (derived).
    """

    vision: Any = None
    kv: Any = None
    speculative: Any = None
    vision_label: str | None = None
    kv_label: str | None = None
    speculative_label: str | None = None
    method: Any = field(init=False, repr=False)
    engine_kv: Any = field(init=False, repr=False)

    def __post_init__(self):
        if self.speculative is not None:
            self.method = self.speculative
            peer_full = (getattr(self.speculative, "kind", "") == "transformers"
                         and getattr(self.kv, "name", None) == "full")
            self.engine_kv = None if peer_full else self.kv
        else:
            self.method = self.kv if self.kv is not None else resolve_method(None)[0]
            self.engine_kv = None

    @property
    def label(self) -> str:
        """The pieces that are on, e.g. ``"vision=pooling:keep_ratio=0.25 + speculative=prompt_lookup"``;
        ``"plain"`` when none is."""
        parts = [f"{slot}={label}" for slot, label in
                 (("vision", self.vision_label), ("kv", self.kv_label), ("speculative", self.speculative_label))
                 if label]
        return " + ".join(parts) or "plain"

    @property
    def short_label(self) -> str:
        """The labels of the pieces joined by ``" + "`` (``"pooling:keep_ratio=0.25 + full + prompt_lookup"``);
        ``"full"`` when none is on."""
        return " + ".join(x for x in (self.vision_label, self.kv_label, self.speculative_label) if x) or "full"

    @property
    def method_name(self) -> str | None:
        """Registry name of :attr:`method` (``"full"``, ``"snapkv"``, ``"prompt_lookup"``, ...)."""
        return getattr(self.method, "name", None)

    def check(self, model) -> None:
        """:func:`check_composition` of these pieces on ``model`` (raises ``ValueError``, see there)."""
        check_composition(model, self.method, kv=self.engine_kv, vision=self.vision)

    def prepare(self, model, tokenizer) -> None:
        """Load a named draft model once and check it against the target (``ValueError`` for another vocabulary or
        tokenizer); a no-op without a speculative method that needs it."""
        prepare = getattr(self.method, "prepare", None)
        if callable(prepare) and hasattr(self.method, "timed_generate"):
            prepare(model, tokenizer)

    @contextlib.contextmanager
    def applied(self, model):
        """The visual-token method's hooks on ``model`` for the duration (its ``telemetry`` reset first); nothing
        without one."""
        if self.vision is None:
            yield self
            return
        self.vision.telemetry = {}
        with self.vision.apply(model):
            yield self

    def run(self, model, input_ids, *, max_new_tokens: int, gen_kwargs: dict, model_inputs: dict | None = None) -> dict:
        """One generation of the composed method from ``input_ids`` [1, L] (inside :meth:`applied` when a visual-token
        method is on).

        Parameters
        ----------
        model : transformers.PreTrainedModel
        input_ids : torch.LongTensor
            [1, L] on the model's device.
        max_new_tokens : int
        gen_kwargs : dict
            :func:`~mmaccel.pipeline.generation_kwargs`.
        model_inputs : dict, optional
            A VLM's other inputs (``pixel_values``, ``image_grid_thw``, ...), on the model's device and dtype.

        Returns
        -------
        dict
            The runner's ``new_ids``, ``ttft_s``, ``decode_s`` (seconds), ``kv_cache_bytes_prefill``,
            ``kv_cache_bytes_final`` (bytes) and ``telemetry`` (with ``telemetry["kv"]`` for a KV method under a
            speculative one, ``telemetry["vision"]`` and ``visual_tokens`` / ``visual_tokens_kept`` with a
            visual-token method).
        """
        extra: dict = {"model_inputs": model_inputs} if model_inputs else {}
        cache = engine_cache(self.engine_kv, model) if self.engine_kv is not None else None
        if cache is not None:
            extra["cache"] = cache
        try:
            run = runner_for(self.method).timed_generate(model, input_ids, max_new_tokens=max_new_tokens,
                                                         gen_kwargs=gen_kwargs, **extra)
            if cache is not None:
                run["telemetry"] = {**run["telemetry"], "kv": self.engine_kv.telemetry(cache)}
        finally:
            close_cache(cache)
        if self.vision is not None:
            run["telemetry"] = {**run["telemetry"], "vision": dict(self.vision.telemetry)}
            run["visual_tokens"], run["visual_tokens_kept"] = visual_token_counts(self.vision.telemetry)
        return run


def compose(vision=None, kv=None, speculative=None, *, draft=None, model=None) -> Composition:
    """Resolve a visual-token method, a KV-cache method and a speculative method into one :class:`Composition`.

    Parameters
    ----------
    vision : None, str, MethodSpec or VisionTokenMethod
        ``None`` = off; a spec of :data:`mmaccel.vision_tokens.METHODS` (``"pooling:keep_ratio=0.25"``) or an object.
    kv : None, str, MethodSpec or KVMethod
        ``None`` = full attention; a spec of :data:`mmaccel.longctx.METHODS` or an object, e.g.
        ``ChunkKV(SnapKV(ratio=0.25))`` (the same method as ``"chunkkv:method=snapkv,ratio=0.25"``).
    speculative : None, str, MethodSpec, Drafter or speculative method
        ``None`` = autoregressive decoding; an engine drafter (``"prompt_lookup"``, ``"draft:model=micro-draft:k=4"``),
        a transformers peer (``"hf_prompt_lookup"``) or an object.
    draft : str or transformers.PreTrainedModel, optional
        The draft model of a ``"draft"`` / ``"hf_assisted"`` spec that names no ``model=``.
    model : transformers.PreTrainedModel, optional
        When given, :meth:`Composition.check` runs on it before returning.

    Returns
    -------
    Composition

    Raises
    ------
    ValueError
        An unknown spec or argument (the message lists the registry, and names the right slot when a spec is given
        to the wrong one, e.g. ``kv="prompt_lookup"``); with ``model``, a composition that cannot be exact
        (:func:`check_composition`).
    """
    vision_obj, vision_label = resolve_vision(vision)
    kv_obj, kv_label = resolve_kv(kv)
    spec_obj, spec_label = resolve_speculative(speculative, draft=draft)
    composed = Composition(vision_obj, kv_obj, spec_obj, vision_label, kv_label, spec_label)
    if model is not None:
        composed.check(model)
    return composed


def compose_run(method=None, *, kv=None, vision=None, draft=None) -> Composition:
    """:func:`compose` from :func:`mmaccel.eval.generate_measured`'s arguments, where ``method`` is either kind.

    Parameters
    ----------
    method : None, spec, KV-cache method, speculative method, Drafter or Composition
        What runs the generation (a :class:`Composition` is returned as it is, when ``kv`` and ``vision`` are
        ``None``).
    kv : None, spec or KVMethod
        A KV method under a speculative ``method``, or the KV method itself when ``method`` is ``None``.
    vision, draft
        As in :func:`compose`.

    Raises
    ------
    ValueError
        As :func:`compose`; a :class:`Composition` given with ``kv`` or ``vision``; a KV method given both as
        ``method`` and ``kv`` (one KV method sets the cache).
    """
    if isinstance(method, Composition):
        if kv is not None or vision is not None:
            raise ValueError("a Composition already holds its vision and kv methods; pass kv=None and vision=None")
        return method
    kv_obj, kv_label = resolve_kv(kv)
    vision_obj, vision_label = resolve_vision(vision)
    if method is None:
        return Composition(vision_obj, kv_obj, None, vision_label, kv_label or "full", None)  # a KV method alone
    method_obj, method_label = resolve_method(method, draft=draft)
    if hasattr(method_obj, "timed_generate"):
        return Composition(vision_obj, kv_obj, method_obj, vision_label, kv_label, method_label)
    if kv_obj is not None:
        raise ValueError(f"kv={getattr(kv_obj, 'name', kv_label)!r} and the KV method "
                         f"{getattr(method_obj, 'name', method_label)!r} both set the cache; give one KV method")
    return Composition(vision_obj, method_obj, None, vision_label, method_label, None)
