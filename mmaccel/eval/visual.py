"""What the visual-token evaluations share: prompts with images, ``VISION[+KV]`` configurations, a visual compare.

Used by ``mmaccel vision-sweep`` (:mod:`~mmaccel.eval.vision_sweep`), ``mmaccel video-niah``
(:mod:`~mmaccel.eval.video_niah`) and ``mmaccel compare --task vqa|video-qa``. Every run goes through the one measured
path, :func:`~mmaccel.eval.generation.generate_measured` (its ``vision=`` and ``kv=`` slots), so every row is a
:class:`~mmaccel.eval.generation.RunRecord`.

Prompts follow ``smol-llava``'s training and evaluation prompt (:func:`mmaccel.data.scene_prompts.messages`):
one user turn holding the image(s), then the question and LLaVA-1.5's short-answer instruction. A video is a batch of
frames, one ``<image>`` per frame in that turn (a LLaVA-1.5-style model has no video input of its own); answers are
scored like the training evaluation: the first word of the answer equals the expected one
(:func:`mmaccel.data.scene_prompts.first_word`).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ..pipeline import resolve_kv, resolve_vision
from ..specs import parse_method_spec
from .compare import Comparison, _num
from .generation import RunRecord, generate_measured
from .sweep import Cell as SweepCell
from .sweep import sweep

logger = logging.getLogger(__name__)

NO_REDUCTION = "none"
"""The configuration without a visual-token method and with full attention: the reference of every table."""

DEFAULT_VQA_METHODS = (NO_REDUCTION, "pooling:keep_ratio=0.25", "visionzip:keep_ratio=0.25", "fastv:keep_ratio=0.25")
"""``mmaccel compare --task vqa`` / ``video-qa`` methods when none are given."""


@dataclass(frozen=True)
class VisualConfig:
    """One ``VISION[+KV]`` configuration of a visual evaluation.

    Attributes
    ----------
    label : str
        The text as written (``"pooling:keep_ratio=0.25+streaming:window=1024"``); the record's ``method``.
    vision : str or None
        A visual-token spec of :data:`mmaccel.vision_tokens.METHODS`, or ``None`` (all visual tokens).
    kv : str or None
        A KV-cache spec of :data:`mmaccel.longctx.METHODS`, or ``None`` (full attention).
    """

    label: str
    vision: str | None = None
    kv: str | None = None


def parse_visual_config(text: str) -> VisualConfig:
    """Parse ``VISION[+KV]``: a visual-token spec, a KV-cache spec, both joined by ``+``, or ``none``.

    >>> parse_visual_config("pooling:keep_ratio=0.25+streaming:window=1024")
    VisualConfig(label='pooling:keep_ratio=0.25+streaming:window=1024', vision='pooling:keep_ratio=0.25', kv='streaming:window=1024')

    Raises
    ------
    ValueError
        An empty text, an unknown method name (the message lists both registries), two methods of the same kind, or
        a bad argument of either method (built here, so it fails before any model is loaded).
    """
    from ..longctx import METHODS as KV_METHODS
    from ..vision_tokens import METHODS as VISION_METHODS

    label = str(text).strip()
    found: dict[str, str] = {}
    for part in (p.strip() for p in label.split("+")):
        name = parse_method_spec(part).name if part else ""
        if name == NO_REDUCTION:
            continue
        kind = "vision" if name in VISION_METHODS else "kv" if name in KV_METHODS else None
        if kind is None:
            raise ValueError(
                f"unknown method {name or part!r} in {label!r}; write VISION[+KV] or {NO_REDUCTION!r}, e.g. "
                f"'pooling:keep_ratio=0.25+streaming:window=1024'. Visual-token methods: "
                f"{', '.join(sorted(VISION_METHODS))}; KV-cache methods: {', '.join(sorted(KV_METHODS))}")
        if kind in found:
            raise ValueError(f"{label!r} names two {kind} methods ({found[kind]!r} and {part!r}); give one of each")
        found[kind] = part
    resolve_vision(found.get("vision"))
    resolve_kv(found.get("kv"))
    return VisualConfig(label=label, vision=found.get("vision"), kv=found.get("kv"))


def check_vlm_processor(processor) -> None:
    """Raise one clear ``ValueError`` unless ``processor`` is a vision-language processor (images + a tokenizer)."""
    if not (hasattr(processor, "image_processor") and hasattr(processor, "tokenizer")):
        raise ValueError(f"this evaluation needs a vision-language model with a processor (images and text, e.g. "
                         f"--model smol-llava); the model came with a {type(processor).__name__}")


def chat_inputs(processor, images: Sequence, question: str):
    """The model inputs of one question about ``images`` (one image, or the frames of a video).

    The chat of :func:`mmaccel.data.scene_prompts.messages` with one image item per image: the processor's
    chat template writes one ``<image>`` per item, which the processor expands to the visual tokens of that image
    (``smol-llava``: 144 per image). A processor without a chat template gets ``<image>`` lines, then the question.

    Parameters
    ----------
    processor : transformers.LlavaProcessor (or another VLM processor with ``image_token``)
    images : sequence of PIL.Image.Image
        At least one.
    question : str

    Returns
    -------
    transformers.BatchFeature
        ``input_ids`` / ``attention_mask`` [1, L] and ``pixel_values`` [len(images), 3, S, S].

    Raises
    ------
    ValueError
        No images, or a processor that is not a vision-language one.
    """
    from ..data.scene_prompts import INSTRUCTION, messages

    check_vlm_processor(processor)
    images = list(images)
    if not images:
        raise ValueError("no images given; pass at least one image (or video frame)")
    if getattr(processor, "chat_template", None):
        chat = messages(question)
        chat[0]["content"] = [{"type": "image"}] * len(images) + chat[0]["content"][1:]
        text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    else:
        token = getattr(processor, "image_token", "<image>")
        text = f"{token}\n" * len(images) + f"{question} {INSTRUCTION}"
    return processor(images=images, text=[text], return_tensors="pt")


def image_token_count(model, inputs) -> int:
    """Visual placeholder tokens in ``inputs["input_ids"]`` (``model.config.image_token_id``): all visual tokens."""
    return int((inputs["input_ids"] == model.config.image_token_id).sum())


def score(text: str, answer: str) -> bool:
    """The training evaluation's rule: the first word of ``text`` (lower case, no punctuation) equals ``answer``."""
    from ..data.scene_prompts import first_word

    return first_word(text) == str(answer).lower()


def run_config(model, processor, inputs, config: VisualConfig, *, answer: str | None = None, max_new_tokens: int = 8,
               repeats: int = 1, warmup: int = 1, warmup_inputs=None, memory_meter: str = "rss"):
    """One measured run of ``config`` on ``inputs``: :func:`~mmaccel.eval.generation.generate_measured` with the
    config's ``vision=`` and ``kv=``, labelled with the config (``memory_meter``: ``"rss"`` or ``"allocator"``, exact
    tensor bytes, off CUDA; :class:`~mmaccel.eval.memory.PeakMemory`).

    With ``answer``, ``record.extra`` gets ``answer``, ``correct`` (:func:`score`) and ``correct_contains`` (the
    answer appears anywhere, lower case). Returns the :class:`~mmaccel.eval.generation.RunRecord` (``"failed"``
    when the run raised; configuration errors raise ``ValueError``).
    """
    record = generate_measured(
        model, processor.tokenizer, inputs, vision=config.vision, kv=config.kv, label=config.label,
        max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup, warmup_ids=warmup_inputs,
        memory_meter=memory_meter,
    )
    record.extra["visual_tokens_input"] = image_token_count(model, inputs)
    if answer is not None:
        record.extra.update(answer=answer, correct=record.ok and score(record.output_text, answer),
                            correct_contains=record.ok and str(answer).lower() in record.output_text.lower())
    return record


def compare_visual(model, processor, images: Sequence, question: str, configs: Sequence[VisualConfig], *,
                   answer: str | None = None, max_new_tokens: int = 8, repeats: int = 1,
                   warmup: int = 1, out_dir=None, resume: bool = False, overwrite: bool = False) -> Comparison:
    """Every configuration in turn on one question about ``images`` (an image, or a video's frames).

    Parameters
    ----------
    model : LlavaForConditionalGeneration (or another model :class:`~mmaccel.vision_tokens.VLMParts` supports)
    processor : its processor
    images : sequence of PIL.Image.Image
    question : str
    configs : sequence of VisualConfig
        From :func:`parse_visual_config`; the first is the reference of the ratio columns.
    answer : str, optional
        Expected answer: each record gets ``extra["correct"]``.
    max_new_tokens, repeats, warmup : int
        See :func:`~mmaccel.eval.generation.generate_measured`.
    out_dir : path, optional
        Where each record is appended as it finishes (``results.jsonl``, :func:`mmaccel.eval.sweep.sweep`); the
        caller writes ``compare.json`` after its tables.
    resume, overwrite : bool
        What to do with a non-empty ``out_dir``: finish it (configurations already recorded are kept) or replace it.

    Returns
    -------
    Comparison
        ``inputs`` holds ``prompt_tokens``, ``images`` and ``visual_tokens`` (before any reduction).

    Raises
    ------
    ValueError
        No configurations, no images, a processor that is not a VLM's, or a method the model does not support
        (before any run). A run that fails gets a ``"failed"`` record; the others still run.
    """
    if not configs:
        raise ValueError(f"no methods given; pass at least one, e.g. {NO_REDUCTION!r}")
    inputs = chat_inputs(processor, images, question)
    cells = [SweepCell(c.label, sample="question", payload=c) for c in configs]
    done = sweep(cells, lambda cell: run_config(model, processor, inputs, cell.payload, answer=answer,
                                                max_new_tokens=max_new_tokens, repeats=repeats,
                                                warmup=warmup).to_dict(),
                 out=out_dir, resume=resume, overwrite=overwrite, rotate=False, progress=None, desc="compare",
                 config={"question": question, "images": len(images), "answer": answer,
                         "max_new_tokens": max_new_tokens, "repeats": repeats, "warmup": warmup})
    fields = {f.name for f in dataclasses.fields(RunRecord)}
    records = [RunRecord(**{k: v for k, v in r.items() if k in fields}) for r in done.records]
    info = {"prompt_tokens": int(inputs["input_ids"].shape[1]), "images": len(images),
            "visual_tokens": image_token_count(model, inputs), "question": question}
    return Comparison(records=records, answer=answer, inputs=info)


def visual_table(records) -> str:
    """Markdown: per record the visual tokens kept of all, and the vision-encoder, prefill and decode seconds."""
    lines = ["| method | visual tokens kept | vision encoder (s) | prefill (s) | decode (s) |", "|---|---|---|---|---|"]
    for r in records:
        if not r.ok:
            lines.append(f"| {r.method} | FAILED | - | - | - |")
            continue
        total = r.extra.get("visual_tokens_input")
        kept = r.visual_tokens_kept if r.visual_tokens_kept is not None else total
        lines.append(f"| {r.method} | {kept} / {total} | {_num(r.vision_encoder_s, '.3f')} | "
                     f"{_num(r.prefill_s, '.3f')} | {_num(r.decode_s, '.3f')} |")
    return "\n".join(lines)
