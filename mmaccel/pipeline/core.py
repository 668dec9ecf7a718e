"""One composed pipeline: a visual-token method, a KV-cache policy and a speculative method on one model.

>>> pipe = mmaccel.Pipeline(model, processor, vision="pooling:keep_ratio=0.25", kv="full", speculative="prompt_lookup")
>>> out = pipe.generate("USER: <image>\\nWhat is shown? ASSISTANT:", images=image, max_new_tokens=64)
>>> out.output_text, out.visual_tokens_kept, out.telemetry["mean_accepted_length"]

A pipeline composes and generates; it does not measure. Measured runs of the same pipeline are
:func:`mmaccel.eval.measure_pipeline` (one :class:`~mmaccel.eval.RunRecord`, timings split into vision encoder,
prefill and decode) and :func:`mmaccel.eval.compare_pieces` (the plain model, each piece alone and all together).
Which combinations refuse, and why, is :func:`~mmaccel.pipeline.check_composition`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .compose import Composition, compose
from .inputs import check_vision_inputs, model_inputs_for
from .runners import check_temperature, generation_kwargs


@dataclass
class Generation:
    """The output of one :meth:`Pipeline.generate`.

    Attributes
    ----------
    output_ids : list of int
        The new token ids.
    output_text : str
        Their text (special tokens skipped).
    prompt_tokens, new_tokens : int
    visual_tokens, visual_tokens_kept : int or None
        Visual tokens before and after the visual-token method (``None`` without one).
    kv_cache_bytes_prefill, kv_cache_bytes_final : int or None
        Bytes of K/V held after prefill and at the end.
    telemetry : dict
        The speculative method's (``mean_accepted_length``, ...) or the KV method's; ``telemetry["vision"]`` and
        ``telemetry["kv"]`` for the other pieces.
    """

    output_ids: list = field(default_factory=list)
    output_text: str = ""
    prompt_tokens: int = 0
    new_tokens: int = 0
    visual_tokens: int | None = None
    visual_tokens_kept: int | None = None
    kv_cache_bytes_prefill: int | None = None
    kv_cache_bytes_final: int | None = None
    telemetry: dict = field(default_factory=dict)


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
        or a method object (``ChunkKV(SnapKV(ratio=0.25))``).
    speculative : None, str, Drafter or speculative method
        ``None`` = autoregressive decoding; a spec of an engine drafter (``"prompt_lookup"``,
        ``"draft:model=micro-draft:k=4"``, ``"jacobi"``) or a transformers peer (``"hf_prompt_lookup"``); or a
        :class:`~mmaccel.speculative.Drafter` (e.g. ``DraftModel(draft_model)``).
    draft : str or transformers.PreTrainedModel, optional
        The draft model of a ``"draft"`` / ``"hf_assisted"`` spec that names no ``model=``.

    Attributes
    ----------
    composed : Composition
        The resolved pieces (:func:`~mmaccel.pipeline.compose`).
    vision, kv, speculative : method objects or None
        The resolved pieces (``kv`` is ``None`` for full attention given as ``None``).
    label : str
        ``"vision=... + kv=... + speculative=..."`` of the pieces that are on, or ``"plain"``.

    Raises
    ------
    ValueError
        At construction: an unknown spec or argument (the message lists the registry, and names the right slot
        when a spec is given to the wrong one, e.g. ``kv="prompt_lookup"``); a composition that cannot be exact,
        naming the two pieces and why (see :func:`~mmaccel.pipeline.check_composition`).
    UnsupportedModelError
        (a ``ValueError``) a visual-token method on a model it does not support, e.g. a text-only LM.
    """

    def __init__(self, model, processor_or_tokenizer, vision=None, kv=None, speculative=None, *, draft=None):
        self.model = model
        self.processor = processor_or_tokenizer
        self.tokenizer = getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)
        self.composed: Composition = compose(vision, kv, speculative, draft=draft, model=model)

    vision = property(lambda self: self.composed.vision, doc="The visual-token method, or ``None``.")
    kv = property(lambda self: self.composed.kv, doc="The KV-cache method, or ``None`` (full attention).")
    speculative = property(lambda self: self.composed.speculative, doc="The speculative method, or ``None``.")

    @property
    def label(self) -> str:
        """The pieces that are on, e.g. ``"vision=pooling:keep_ratio=0.25 + speculative=prompt_lookup"``."""
        return self.composed.label

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

    def generate(self, inputs, max_new_tokens: int = 32, *, images=None, videos=None,
                 temperature: float = 0.0) -> Generation:
        """Generate with every piece active (unmeasured; :func:`mmaccel.eval.measure_pipeline` measures).

        Parameters
        ----------
        inputs : str, token ids [L] or [1, L], or a mapping
            One prompt: text (with ``images``/``videos``, turned into inputs by the processor), token ids, or a
            processor's output (``input_ids`` [1, L], ``pixel_values``, ``image_sizes`` / ``image_grid_thw``, ...).
        max_new_tokens : int
            Upper bound of new tokens, >= 1; generation stops early at EOS.
        images, videos : optional
            Media for a text prompt (see :meth:`inputs`).
        temperature : float
            ``0`` = greedy (exact where every piece is lossless); ``> 0`` = sampling (lossless speculative sampling
            for engine drafters).

        Returns
        -------
        Generation

        Raises
        ------
        ValueError
            Bad inputs (an empty or padded prompt, no images with a vision method, a prompt that ends on an image
            placeholder under speculative decoding) or bad settings (``max_new_tokens < 1``, ``temperature < 0``), or a
            draft model with another vocabulary; all before the model runs.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_temperature(temperature)
        ids, model_inputs = model_inputs_for(self.model, self.inputs(inputs, images, videos), self.tokenizer)
        check_vision_inputs(self.composed.vision_label, model_inputs)
        self.composed.prepare(self.model, self.tokenizer)
        gen_kwargs = generation_kwargs(self.model, self.tokenizer, temperature)
        with torch.inference_mode(), self.composed.applied(self.model):
            run = self.composed.run(self.model, ids, max_new_tokens=max_new_tokens, gen_kwargs=gen_kwargs,
                                    model_inputs=model_inputs)
        new = run["new_ids"]
        return Generation(
            output_ids=new, output_text=self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer else "",
            prompt_tokens=int(ids.shape[1]), new_tokens=len(new), visual_tokens=run.get("visual_tokens"),
            visual_tokens_kept=run.get("visual_tokens_kept"), kv_cache_bytes_prefill=run["kv_cache_bytes_prefill"],
            kv_cache_bytes_final=run["kv_cache_bytes_final"], telemetry=run["telemetry"],
        )
