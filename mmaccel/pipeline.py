"""One composed pipeline: a visual-token method, a KV-cache policy and a speculative method on one model.

>>> pipe = mmaccel.Pipeline(model, processor, vision="pooling:keep_ratio=0.25", kv="full", speculative="prompt_lookup")
>>> record = pipe.generate("USER: <image>\\nWhat is shown? ASSISTANT:", images=image, max_new_tokens=64)
>>> record.output_text, record.vision_encoder_s, record.prefill_s, record.decode_s

Every generation goes through the one measured path, :func:`mmaccel.eval.generation.generate_measured`, so a pipeline
run returns the same :class:`~mmaccel.eval.RunRecord` as every other run (the app, the CLI and ``mmaccel.compare``
tables are built from it).

How the pieces compose, from the outside in:

1. ``with vision.apply(model):`` -- the visual-token method's per-instance hooks (pre-LLM reduction, in-tower ToMe,
   or in-LLM pruning) are attached around the whole run, and removed after it;
2. a timer on the vision tower's forward (hooks, removed on exit) that gives ``vision_encoder_s``;
3. the generation itself: with a speculative method, :func:`mmaccel.speculative.speculative_generate` decodes into
   the KV method's fresh cache (the engine's cache; the VLM inputs go to its prefill forward only): for a
   prefill-only eviction method (SnapKV, PyramidKV, KNorm) ``make_cache(model, speculative=True)``, which compresses
   the engine's prefill and then only appends, so rejected drafts crop exactly; without one,
   ``model.generate(past_key_values=kv.make_cache(model))``.

Which combinations refuse, and why, is :func:`mmaccel.eval.generation.check_composition`: KV methods that evict
during decoding, quantise or re-score cannot be rolled back by speculative decoding, in-LLM pruning (FastV) scores
with the prompt's last token,
which the engine does not prefill, and transformers' own speculative paths crop to absolute lengths.
"""
from __future__ import annotations

from .eval.compare import Comparison
from .eval.generation import (
    RunRecord,
    check_composition,
    generate_measured,
    resolve_kv,
    resolve_method,
    resolve_speculative,
    resolve_vision,
    split_inputs,
)


class Pipeline:
    """A visual-token method, a KV-cache policy and a speculative method stacked on one model.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A vision-language model (LLaVA-style ``LlavaForConditionalGeneration``, ``Qwen2VLForConditionalGeneration``)
        or a plain causal LM (then ``vision`` must be ``None``).
    processor_or_tokenizer : processor or tokenizer
        A VLM's processor (turns ``text`` + ``images`` into inputs; its ``.tokenizer`` decodes) or a tokenizer.
    vision : None, str or VisionTokenMethod
        ``None`` = off; a spec of :data:`mmaccel.vision_tokens.METHODS` (``"pooling:keep_ratio=0.25"``,
        ``"tome:keep_ratio=0.5"``, ``"fastv:keep_ratio=0.25:layer=2"``) or a method object.
    kv : None, str or KVMethod
        ``None`` = full attention; a spec of :data:`mmaccel.longctx.METHODS` (``"full"``, ``"snapkv:budget=256"``)
        or a method object.
    speculative : None, str, Drafter or speculative method
        ``None`` = autoregressive decoding; a spec of an engine drafter (``"prompt_lookup"``,
        ``"draft:model=micro-draft:k=4"``, ``"jacobi"``) or a transformers peer (``"hf_prompt_lookup"``); or a
        :class:`~mmaccel.speculative.Drafter` (e.g. ``DraftModel(draft_model)``).
    draft : str or transformers.PreTrainedModel, optional
        The draft model of a ``"draft"`` / ``"hf_assisted"`` spec that names no ``model=``.

    Attributes
    ----------
    vision, kv, speculative : method objects or None
        The resolved pieces (``kv`` is ``None`` for full attention given as ``None``).
    label : str
        ``"vision=... + kv=... + speculative=..."`` of the pieces that are on, or ``"plain"``.

    Raises
    ------
    ValueError
        At construction: an unknown spec or argument (the message lists the registry, and names the right slot
        when a spec is given to the wrong one, e.g. ``kv="prompt_lookup"``); a composition that cannot be exact,
        naming the two pieces and why (see :func:`~mmaccel.eval.generation.check_composition`).
    UnsupportedModelError
        (a ``ValueError``) a visual-token method on a model it does not support, e.g. a text-only LM.
    """

    def __init__(self, model, processor_or_tokenizer, vision=None, kv=None, speculative=None, *, draft=None):
        self.model = model
        self.processor = processor_or_tokenizer
        self.tokenizer = getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)
        self.vision, self._vision_label = resolve_vision(vision)
        self.kv, self._kv_label = resolve_kv(kv)
        self.speculative, self._speculative_label = resolve_speculative(speculative, draft=draft)
        method = self._method() if self._method() is not None else resolve_method(None)[0]
        check_composition(model, method, kv=self.kv if self.speculative is not None else None, vision=self.vision)

    @property
    def label(self) -> str:
        """The pieces that are on, e.g. ``"vision=pooling:keep_ratio=0.25 + speculative=prompt_lookup"``."""
        parts = [f"{slot}={label}" for slot, label in
                 (("vision", self._vision_label), ("kv", self._kv_label), ("speculative", self._speculative_label))
                 if label]
        return " + ".join(parts) or "plain"

    def __repr__(self) -> str:
        return f"Pipeline({type(self.model).__name__}, {self.label})"

    def inputs(self, prompt, images=None, videos=None):
        """The model inputs of a prompt: a processor's output when ``images``/``videos`` are given, else the prompt.

        Parameters
        ----------
        prompt : str, token ids, or a mapping (a processor's output, returned as is)
        images, videos : optional
            Passed to the processor with ``text=prompt`` (the prompt must hold the model's image/video placeholder,
            e.g. LLaVA's ``"<image>"``).

        Raises
        ------
        ValueError
            ``images``/``videos`` with a plain tokenizer, or with a prompt that is not text.
        """
        if images is None and videos is None:
            return prompt
        if not isinstance(prompt, str):
            raise ValueError(  # noqa: TRY004 - bad input to a pipeline is one ValueError, whatever its kind
                "images/videos go with a text prompt; pass the processor's output as the prompt instead")
        if not hasattr(self.processor, "image_processor") and not hasattr(self.processor, "video_processor"):
            raise ValueError(f"images need a processor (e.g. AutoProcessor.from_pretrained(...)); got a "
                             f"{type(self.processor).__name__}")
        kwargs = {k: v for k, v in (("images", images), ("videos", videos)) if v is not None}
        return self.processor(text=prompt, return_tensors="pt", **kwargs)

    def generate(self, inputs, max_new_tokens: int = 32, *, images=None, videos=None, temperature: float = 0.0,
                 repeats: int = 1, warmup: int = 0, label: str | None = None) -> RunRecord:
        """Generate with every piece active, measured.

        Parameters
        ----------
        inputs : str, token ids [L] or [1, L], or a mapping
            One prompt: text (with ``images``/``videos``, turned into inputs by the processor), token ids, or a
            processor's output (``input_ids`` [1, L], ``pixel_values``, ``image_sizes`` / ``image_grid_thw``, ...).
        max_new_tokens : int
            Upper bound of new tokens; generation stops early at EOS.
        images, videos : optional
            Media for a text prompt (see :meth:`inputs`).
        temperature : float
            ``0`` = greedy (exact where every piece is lossless); ``> 0`` = sampling (lossless speculative sampling
            for engine drafters).
        repeats, warmup : int
            Measured and unrecorded runs; timings are medians (see
            :func:`~mmaccel.eval.generation.generate_measured`).
        label : str, optional
            The record's ``method``; default :attr:`label`.

        Returns
        -------
        RunRecord
            ``output_ids`` (list of int) and ``output_text``; ``ttft_s``, ``vision_encoder_s``, ``prefill_s``,
            ``decode_s`` (seconds), ``visual_tokens`` / ``visual_tokens_kept``, ``kv_cache_bytes_prefill`` /
            ``kv_cache_bytes_final`` (bytes) and ``telemetry`` (the speculative method's, with
            ``mean_accepted_length``, or the KV method's; ``telemetry["vision"]`` and ``telemetry["kv"]`` for the
            other pieces).

        Raises
        ------
        ValueError
            Bad inputs (an empty or padded prompt, no images with a vision method, a prompt that ends on an image
            placeholder under speculative decoding) or bad settings (``max_new_tokens < 1``, ...).
        Exception
            Whatever the run raised (e.g. ``torch.OutOfMemoryError``).
        """
        return generate_measured(
            self.model, self.tokenizer, self.inputs(inputs, images, videos), method=self._method(),
            kv=self.kv if self.speculative is not None else None, vision=self.vision, label=label or self.label,
            max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup, temperature=temperature,
            raise_errors=True,
        )

    def _method(self):
        """What runs the generation: the speculative method, else the KV method (``None``: full attention)."""
        return self.speculative if self.speculative is not None else self.kv

    def compare_pieces(self, inputs, max_new_tokens: int = 32, *, images=None, videos=None, repeats: int = 1,
                       warmup: int = 1, temperature: float = 0.0) -> Comparison:
        """Run the plain model, each piece alone and all pieces together on the same input, one after another.

        The composed speedup beside each piece alone: ``compare_pieces(...).plot()`` draws every metric relative to
        the plain model, ``.to_markdown()`` tabulates them.

        Parameters
        ----------
        inputs, max_new_tokens, images, videos, repeats, warmup, temperature
            As in :meth:`generate` (``warmup`` defaults to one run per configuration).

        Returns
        -------
        Comparison
            Records labelled ``"plain"``, ``"vision=..."``, ``"kv=..."``, ``"speculative=..."`` (the pieces that are
            on) and, with two or more pieces, :attr:`label` for all of them together. A configuration whose run
            fails gets a ``status="failed"`` record.

        Raises
        ------
        ValueError
            As :meth:`generate`, before any run.
        """
        prompt = self.inputs(inputs, images, videos)
        ids, _ = split_inputs(prompt, self.tokenizer)
        configs = [("plain", None, None, None)]
        if self.vision is not None:
            configs.append((f"vision={self._vision_label}", self.vision, None, None))
        if self.kv is not None:
            configs.append((f"kv={self._kv_label}", None, self.kv, None))
        if self.speculative is not None:
            configs.append((f"speculative={self._speculative_label}", None, None, self.speculative))
        if len(configs) > 2:
            configs.append((self.label, self.vision, self.kv, self.speculative))
        records = []
        for label, vision, kv, speculative in configs:  # the same inputs (and media) for every configuration
            records.append(generate_measured(
                self.model, self.tokenizer, prompt, method=speculative if speculative is not None else kv,
                kv=kv if speculative is not None else None, vision=vision, label=label,
                max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup, temperature=temperature,
            ))
        return Comparison(records=records, inputs={"prompt_tokens": int(ids.shape[1])})
