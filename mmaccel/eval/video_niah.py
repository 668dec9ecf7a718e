"""Video needle-in-a-haystack (V-NIAH): frames x depth accuracy per method, peak memory, what fits a memory budget.

``mmaccel video-niah --model smol-llava --frames 64 256 1024 --depths 0.1 0.5 0.9 --methods ... --out DIR`` and
:func:`video_niah`. The task is V-NIAH of LongVA (Zhang et al., "Long Context Transfer from Language to Vision", 2024,
arXiv 2406.16852) on the seeded clips of :mod:`mmaccel.data.clips`: one needle frame showing a number at a relative
depth of a slowly changing clip, and the question "What number appeared in the video?" (or its colour, or the motion;
``kind``). Clips come from the held-out test seeds; a depth sweep moves the same needle through the same clip.

A LLaVA-1.5-style model has no video input: the clip's frames are a batch of images in one prompt, one ``<image>`` per
frame (``smol-llava``'s processor expands each to the frame's 144 visual tokens, so a 1,024-frame clip is 147,456
visual tokens). Every (method, clip) runs through the one measured path
(:func:`~mmaccel.eval.generation.generate_measured`) and is scored by the first word of the answer
(:mod:`mmaccel.eval.visual`).

Methods and memory
------------------
A method is ``VISION[+KV]`` (:func:`~mmaccel.eval.visual.parse_visual_config`), e.g.
``pooling:keep_ratio=0.0625+streaming:window=1024``:

- the visual-token method reduces every frame's tokens between projector and LLM (pooling, VisionZip, PruMerge; ToMe in
  the tower; FastV inside the LLM). Kept tokens keep their positions, so a long clip's positions can pass the LM's
  ``max_position_embeddings`` (a warning says so). Temporal ToMe reads the clip's frames (consecutive images of one
  size) as one clip and merges similar tokens across adjacent frames
  (:class:`~mmaccel.vision_tokens.TemporalToMe`);
- the KV-cache method (``kv=`` slot) bounds what the cache holds after prefill and while decoding (StreamingLLM's
  window, SnapKV's budget, ...);
- ``chunked`` prefill (:class:`mmaccel.longctx.Chunked`, e.g. ``pooling:keep_ratio=0.0625+chunked:chunk=1024`` or
  ``...+chunked:chunk=1024:method=streaming,window=4096``) runs the vision tower, the projector and the visual-token
  method once on the whole clip and splits only the language model's prefill, on the merged and reduced
  ``inputs_embeds``: the LM's activations are bounded by the chunk, and with an evicting inner method its K/V too
  (the tower's activations and the merged embeddings still grow with the clip).
  In-LLM pruning (FastV, Progressive, AIM's pruning layers) needs the whole prompt in one forward and is refused with
  ``chunked`` (:func:`check_video_config`).

One encoding per clip: the methods that leave the vision tower alone (all but in-tower ToMe and the tower-scored
VisionZip and PruMerge) share one tower pass per clip (``share_encoding``, on by default; ``--no-shared-encoding``),
which is most of a long clip's cost. Their records count the shared pass in ``vision_encoder_s`` and ``ttft_s``; the
first clip of each frame count runs every method with its own pass, and gives the summary's peak memory.

Output folder
-------------
``results.jsonl``
    One :class:`~mmaccel.eval.generation.RunRecord` per (method, frames, depth, trial), written as it exists;
    ``extra`` holds ``frames`` (also as ``length``, the NIAH field), ``depth``, ``trial``, ``clip_seed``,
    ``needle_frame``, ``kind``, ``question``, ``answer``, ``correct``, ``correct_contains``,
    ``visual_tokens_input``. A run that raised (e.g. out of memory) is recorded as ``failed`` and the sweep goes on.
``summary.json``
    :func:`mmaccel.eval.niah.summarize` over frames (its ``length``) x depth -- accuracy, medians of TTFT and peak
    memory per cell, the K/V ratio after prefill against the ``none`` method on the same clip -- plus ``memory``:
    per method the peak memory per frame count, the largest measured frame count within ``memory_budget`` and a
    linear extrapolation of it.
``heatmap_<method>.png``
    Accuracy over frames (x) x depth (y), drawn by :func:`mmaccel.eval.niah.draw_heatmap`.
``peak_memory.png``
    Peak memory against frames, one line per method, the budget dashed.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..pipeline import resolve_vision
from ..vision_tokens.batched_tower import BatchedVisionEncoding
from ..vision_tokens.shared_encoding import SharedVisionEncoding, reads_tower_output_only
from .memory import PeakMemory, check_cpu_meter
from .niah import draw_heatmap, safe_label, summarize
from .visual import (
    NO_REDUCTION,
    VisualConfig,
    chat_inputs,
    check_vlm_processor,
    image_token_count,
    parse_visual_config,
    run_config,
)

logger = logging.getLogger(__name__)

DEFAULT_METHODS = ("pooling:keep_ratio=0.25", "pooling:keep_ratio=0.0625+streaming:window=1024")
DEFAULT_FRAMES = (64, 256, 1024)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
WARMUP_FRAMES = 2
"""Frames of the short clip the warm-up runs use (once per method), so a warm-up never costs a long prefill."""


def check_video_config(config: VisualConfig, model) -> None:
    """Refuse, before any run, a configuration that cannot run on a video of images.

    Raises
    ------
    ValueError
        ``chunked`` prefill with a visual-token method that prunes inside the language model (FastV, Progressive,
        AIM with pruning layers): it ranks the prompt's tokens inside one prefill forward, which chunked prefill
        splits, so it would prune nothing.
    UnsupportedModelError
        (a ``ValueError``) a visual-token method the model does not support.
    """
    from ..longctx import build_method as build_kv
    from ..pipeline import check_composition
    from ..vision_tokens import UnsupportedModelError
    from ..vision_tokens import build_method as build_vision

    if config.vision is None:
        return
    kv = None if config.kv is None else build_kv(config.kv)
    try:
        check_composition(model, kv, vision=build_vision(config.vision))
    except UnsupportedModelError:
        raise
    except ValueError as exc:
        raise ValueError(f"{config.label!r}: {exc}") from None


@dataclass
class VideoNIAHResult:
    """The outcome of :func:`video_niah`.

    Attributes
    ----------
    records : list of dict
        ``RunRecord.to_dict()`` per run, as in ``results.jsonl``.
    summary : dict
        As in ``summary.json``.
    out_dir : pathlib.Path or None
    heatmaps : dict
        Method label -> PNG path.
    memory_plot : pathlib.Path or None
    """

    records: list
    summary: dict
    out_dir: Path | None = None
    heatmaps: dict = field(default_factory=dict)
    memory_plot: Path | None = None

    def accuracy(self, method: str) -> float | None:
        """Overall accuracy of one method over its successful runs (``None`` if none succeeded)."""
        return self.summary["methods"][method]["accuracy"]


def clip_images(clip) -> list:
    """Every frame of a :class:`~mmaccel.data.clips.Clip` as an RGB PIL image, rendered one at a time."""
    from PIL import Image

    return [Image.fromarray(clip.frame(t)) for t in range(len(clip))]


def video_prompt_layout(model, processor, frame, question: str) -> tuple:
    """The token ids around a video's frames in the model's chat prompt, from a two-frame prompt.

    Parameters
    ----------
    model : LlavaForConditionalGeneration
        Its ``config.image_token_id`` marks the visual tokens.
    processor : its processor
    frame : PIL.Image.Image or numpy.ndarray
        Any one frame (only the ids are read).
    question : str

    Returns
    -------
    (prefix, separator, suffix) : tuple of torch.Tensor
        int64 [p], [s], [q]: the ids before the first frame's visual tokens, between two frames' (``smol-llava``: one
        newline), and after the last frame's (the question and the assistant turn).

    Raises
    ------
    ValueError
        A processor that is not a VLM's, or a prompt whose two frames are not two runs of visual tokens of one length.
    """
    from PIL import Image

    image = Image.fromarray(frame) if not isinstance(frame, Image.Image) else frame
    ids = chat_inputs(processor, [image, image], question)["input_ids"][0]
    visual = (ids == model.config.image_token_id).long()
    edges = visual.diff(prepend=visual.new_zeros(1), append=visual.new_zeros(1)).nonzero().squeeze(1).tolist()
    if len(edges) != 4 or edges[1] - edges[0] != edges[3] - edges[2]:
        raise ValueError("the prompt of two frames does not hold two runs of visual tokens of one length; the "
                         "streamed path needs a LLaVA-1.5-style prompt (one <image> per frame)")
    return ids[: edges[0]], ids[edges[1]: edges[2]], ids[edges[3]:]


def frame_pixels(image_processor, frames, batch: int):
    """Processed frames a batch at a time: yields [b, 3, S, S] ``pixel_values`` (``b <= batch``) from an iterable of
    frames (``[H, W, 3]`` uint8 arrays or PIL images), holding one batch of frames at a time."""
    from PIL import Image

    held = []
    for frame in frames:
        held.append(Image.fromarray(frame) if not isinstance(frame, Image.Image) else frame)
        if len(held) == batch:
            yield image_processor(images=held, return_tensors="pt")["pixel_values"]
            held = []
    if held:
        yield image_processor(images=held, return_tensors="pt")["pixel_values"]


@dataclass
class StreamedRun:
    """What :func:`streamed_generate` did.

    Attributes
    ----------
    output_ids : list of int
        Greedy new tokens (the end-of-sequence token included when reached).
    frames : int
    prompt_tokens : int
        Tokens the language model prefilled (text and kept visual tokens): its last prompt position + 1.
    visual_tokens, visual_tokens_kept : int
        Visual tokens before and after the per-frame reduction, summed over the frames.
    vision_encoder_s, prefill_s, decode_s : float
        Seconds in the frame encoding (processor excluded), in the language model's prefill forwards, and decoding.
    kv_cache_bytes_prefill, kv_cache_bytes_final : int
        K/V bytes the cache holds after the prefill and at the end (:func:`mmaccel.longctx.kv_cache_bytes`).
    telemetry : dict
        The KV method's telemetry (``{}`` for full attention).
    """

    output_ids: list
    frames: int
    prompt_tokens: int
    visual_tokens: int
    visual_tokens_kept: int
    vision_encoder_s: float
    prefill_s: float
    decode_s: float
    kv_cache_bytes_prefill: int
    kv_cache_bytes_final: int
    telemetry: dict = field(default_factory=dict)


def streamed_generate(model, prefix, separator, suffix, pixel_batches, *, vision=None, kv=None, chunk: int = 1024,
                      max_new_tokens: int = 8, eos_token_id=None, frames: int | None = None,
                      position_limit: int | None = None) -> StreamedRun:
    """Answer about a video of any length in memory that does not grow with its frames: encode, reduce and prefill
    the frames as they come, with a KV-cache method that bounds what is held.

    The prompt is ``prefix, frame 1, separator, frame 2, ..., frame T, suffix`` (:func:`video_prompt_layout`). Each
    batch of frames goes through the tower and the projector and each frame's tokens are reduced at once
    (:func:`~mmaccel.vision_tokens.batched_tower.encode_frames`); the kept tokens' embeddings are prefilled into the
    cache in pieces of exactly ``chunk`` tokens as they accumulate. A scored KV method compresses the held slots plus
    each piece back to its budget (:class:`mmaccel.longctx.Chunked`'s semantics), so with an evicting method
    (``streaming``, ``snapkv:budget=...``) the K/V held is bounded, and with it the whole run: what is alive is one
    batch of frames, one piece and the bounded cache; nothing of size O(frames) is kept. Without ``position_limit``
    the language model's inputs and pieces are those of the unstreamed path under
    ``VISION:positions=contiguous+chunked:chunk=C:method=KV`` (tested token for token).

    Positions: the reduced prompt is numbered contiguously ``0, 1, ...``. A long video still passes the language
    model's trained positions (10,000 frames pooled to 9 tokens: ~100,000); with ``position_limit`` and ``frames``
    the video's tokens are given evenly spaced fractional positions instead, so that the whole prompt and
    ``max_new_tokens`` fit in ``position_limit`` (Position Interpolation, Chen et al., "Extending Context Window of
    Large Language Models via Positional Interpolation", 2023, arXiv 2306.15595, here without fine-tuning and on the
    video's span only: the text before and after keeps unit steps).

    Parameters
    ----------
    model : LlavaForConditionalGeneration
    prefix, separator, suffix : torch.Tensor
        int64 [p], [s], [q] ids.
    pixel_batches : iterable of torch.Tensor
        [b, 3, S, S] processed frames per batch (:func:`frame_pixels`), consumed once.
    vision : ImageReducer or str, optional
        A per-frame pre-LLM method (pooling, AIM merging) with ``positions="contiguous"``; ``None`` keeps every
        token.
    kv : KVMethod or str, optional
        The KV-cache method (default ``full``: all K/V is held, and grows with the video). A
        :class:`~mmaccel.longctx.Chunked` wrapper's inner method is used with its ``chunk``.
    chunk : int
        Prefill piece in tokens, >= 1 (ignored when ``kv`` is ``Chunked``).
    max_new_tokens : int
        Greedy new tokens, >= 1.
    eos_token_id : int or list of int, optional
        Stop after emitting one of these.
    frames : int, optional
        The number of frames ``pixel_batches`` holds (needed by ``position_limit``).
    position_limit : int, optional
        Positions the prompt and the answer must stay below (e.g. the model's ``max_position_embeddings``); the
        video's span is interpolated only when the contiguous numbering would pass it.

    Returns
    -------
    StreamedRun
        ``telemetry["position_scale"]``: the positions per video token (1.0 without interpolation).

    Raises
    ------
    ValueError
        Before anything runs: a method that cannot reduce a frame alone, ``positions="original"`` (add
        ``:positions=contiguous``), a KV method that cannot prefill in chunks, ``chunk < 1``, ``max_new_tokens < 1``,
        ``position_limit`` without ``frames`` or too small for the text; from the first batch, a model that is not a
        fixed-grid LLaVA; after the frames, an empty stream.
    """
    import time

    import torch

    from ..longctx import Chunked, kv_cache_bytes
    from ..longctx import build_method as build_kv
    from ..vision_tokens.batched_tower import encode_frames

    vision, kv = check_streamed(vision, kv)
    if isinstance(kv, Chunked):
        kv, chunk = kv.method, kv.chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or max_new_tokens < 1:
        raise ValueError(f"chunk and max_new_tokens must be integers >= 1, got {chunk} and {max_new_tokens}")
    text_tokens = len(prefix) + len(suffix) + max_new_tokens
    if position_limit is not None and (frames is None or position_limit <= text_tokens + 1):
        raise ValueError(f"position_limit needs frames= and more than the text's {text_tokens + 1} positions; got "
                         f"position_limit={position_limit}, frames={frames}")
    kv = kv if kv is not None else build_kv("full")
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    embed = model.get_input_embeddings()
    device = embed.weight.device
    cache = kv.make_cache(model)
    state = {"pos": 0.0, "step": 1.0, "prefill_s": 0.0, "vision_s": 0.0, "kept": 0, "frames": 0}
    pending: list = []  # (embeddings [n, D], positions [n]) not yet prefilled: under chunk + one frame's tokens

    def forward(positions, **inputs):
        out = model(**inputs, cache=cache, position_ids=positions[None], use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def feed(embeds, step=1.0):
        n = int(embeds.shape[0])
        positions = state["pos"] + step * torch.arange(n, device=device, dtype=torch.float64)
        state["pos"] += step * n
        pending.append((embeds, positions if step != 1.0 else positions.long()))

    def prefill(flush=False):
        """Run every whole ``chunk`` of the queue (and, with ``flush``, the rest); the last piece's logits."""
        held, logits = sum(int(e.shape[0]) for e, _ in pending), None
        while held >= chunk or (flush and held):
            embeds = torch.cat([e for e, _ in pending])
            positions = torch.cat([p.double() for _, p in pending])
            positions = positions if positions.frac().any() else positions.long()
            take = min(chunk, held)
            pending[:] = [(embeds[take:], positions[take:])] if held > take else []
            t0 = time.perf_counter()
            logits = forward(positions[:take], inputs_embeds=embeds[None, :take])
            state["prefill_s"] += time.perf_counter() - t0
            held -= take
            del embeds, positions
        return logits

    def text(ids):
        return embed(ids.to(device))

    with torch.no_grad(), cache if hasattr(cache, "close") else contextlib.nullcontext():
        feed(text(prefix))
        prefill()
        stream = encode_frames(model, pixel_batches, vision)
        while True:
            t0 = time.perf_counter()
            batch = next(stream, None)
            state["vision_s"] += time.perf_counter() - t0
            if batch is None:
                break
            if not state["frames"] and position_limit is not None:
                video = frames * int(batch.shape[1]) + (frames - 1) * len(separator)
                state["step"] = min(1.0, (position_limit - text_tokens - 1) / video)
            for tokens in batch:
                if state["frames"]:
                    feed(text(separator), state["step"])
                feed(tokens, state["step"])
                state["frames"] += 1
                state["kept"] += int(tokens.shape[0])
                prefill()
            del batch
        if not state["frames"]:
            raise ValueError("no frames were given; pass at least one")
        state["pos"] = float(math.ceil(state["pos"] - 1e-9))  # the text after the video on whole positions again
        feed(text(suffix))
        logits = prefill(flush=True)
        prompt_tokens, kv_prefill = int(state["pos"]), kv_cache_bytes(cache)
        t0 = time.perf_counter()
        output = []
        while True:
            token = int(logits.argmax())
            output.append(token)
            if token in stops or len(output) == max_new_tokens:
                break
            logits = forward(torch.tensor([int(state["pos"])], device=device),
                             input_ids=torch.tensor([[token]], device=device))
            state["pos"] += 1
        decode_s = time.perf_counter() - t0
        telemetry = {**(kv.telemetry(cache) if kv.name != "full" else {}), "position_scale": state["step"],
                     "last_position": int(state["pos"]) - 1}
        kv_final = kv_cache_bytes(cache)
    vc = model.config.vision_config
    per_frame = (vc.image_size // vc.patch_size) ** 2
    return StreamedRun(output_ids=output, frames=state["frames"], prompt_tokens=prompt_tokens,
                       visual_tokens=per_frame * state["frames"], visual_tokens_kept=state["kept"],
                       vision_encoder_s=state["vision_s"], prefill_s=state["prefill_s"], decode_s=decode_s,
                       kv_cache_bytes_prefill=kv_prefill, kv_cache_bytes_final=kv_final, telemetry=telemetry)


def run_streamed(model, processor, clip, config: VisualConfig, *, batch: int = 16, max_new_tokens: int = 6,
                 memory_meter: str = "rss"):
    """One measured :func:`streamed_generate` run of ``config`` on a :class:`~mmaccel.data.clips.Clip`, its frames
    rendered one batch at a time, scored against the clip's answer; positions kept inside the language model's
    ``max_position_embeddings``.

    Returns
    -------
    RunRecord
        As :func:`~mmaccel.eval.visual.run_config`'s (``correct``, ``correct_contains``, ``answer`` in ``extra``;
        the position scale in ``telemetry``); ``status="failed"`` with the error when the run raised.

    Raises
    ------
    ValueError
        A configuration :func:`check_streamed` refuses (before anything runs).
    """
    import os
    import time

    import torch

    from .generation import RunRecord, _error_text, load_average
    from .visual import score

    check_streamed(config.vision, config.kv)
    device = model.get_input_embeddings().weight.device
    record = RunRecord(method=config.label, repeats=1, device=str(device), dtype=str(model.dtype),
                       threads=torch.get_num_threads(), load_avg_1m=load_average())
    text_config = getattr(model.config, "text_config", model.config)
    prefix, separator, suffix = video_prompt_layout(model, processor, clip.frame(0), clip.question)
    try:
        with PeakMemory(device, cpu_meter=memory_meter) as mem:
            t0 = time.perf_counter()
            run = streamed_generate(model, prefix, separator, suffix,
                                    mem.checkpointed(frame_pixels(processor.image_processor, iter(clip), batch)),
                                    vision=config.vision, kv=config.kv, max_new_tokens=max_new_tokens,
                                    eos_token_id=processor.tokenizer.eos_token_id, frames=len(clip),
                                    position_limit=getattr(text_config, "max_position_embeddings", None))
            total = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - a failed run (e.g. out of memory) is recorded, the sweep goes on
        record.status, record.error = "failed", _error_text(exc)
        record.extra.update(answer=clip.answer, correct=False, correct_contains=False)
        return record
    text = processor.tokenizer.decode(run.output_ids, skip_special_tokens=True)
    ttft = total - run.decode_s
    record.__dict__.update(
        output_text=text, output_ids=run.output_ids, prompt_tokens=run.prompt_tokens, new_tokens=len(run.output_ids),
        ttft_s=ttft, decode_s=run.decode_s, vision_encoder_s=run.vision_encoder_s,
        prefill_s=ttft - run.vision_encoder_s,
        visual_tokens=run.visual_tokens, visual_tokens_kept=run.visual_tokens_kept, peak_memory_bytes=mem.peak,
        peak_memory_method=mem.method, kv_cache_bytes_prefill=run.kv_cache_bytes_prefill,
        kv_cache_bytes_final=run.kv_cache_bytes_final, telemetry={**run.telemetry, "streamed": True,
                                                                  "lm_prefill_s": run.prefill_s, "pid": os.getpid()},
        samples=[{"ttft_s": ttft, "decode_s": run.decode_s, "peak_memory_bytes": mem.peak}])
    record.extra.update(answer=clip.answer, correct=score(text, clip.answer),
                        correct_contains=str(clip.answer).lower() in text.lower(),
                        visual_tokens_input=run.visual_tokens)
    return record


def check_streamed(vision, kv) -> tuple:
    """Build and check a streamed run's methods (specs or objects) before anything runs; returns them built.

    Raises
    ------
    ValueError
        A visual-token method that cannot reduce a frame alone
        (:func:`~mmaccel.vision_tokens.batched_tower.per_frame_reducer`), one with ``positions="original"``, or a
        KV method that cannot prefill in chunks (``supports_chunking`` false).
    """
    from ..longctx import build_method as build_kv
    from ..vision_tokens import build_method as build_vision
    from ..vision_tokens.batched_tower import per_frame_reducer

    vision = build_vision(vision) if isinstance(vision, str) else vision
    kv = build_kv(kv) if isinstance(kv, str) else kv
    if vision is not None and not per_frame_reducer(vision):
        raise ValueError(f"{vision.name!r} cannot reduce a streamed frame alone; use a pre-LLM method planned on one "
                         "frame's projected tokens, e.g. pooling:keep_ratio=0.0625:positions=contiguous")
    if vision is not None and vision.positions != "contiguous":
        raise ValueError(f"the streamed path numbers the kept tokens contiguously; add ':positions=contiguous' to "
                         f"{vision.name!r}")
    if kv is not None and not getattr(kv, "supports_chunking", True):
        raise ValueError(f"{kv.name} cannot prefill in chunks ({getattr(kv, 'chunking_error', '')}); use an "
                         "evicting method, e.g. streaming:window=2048")
    return vision, kv


def video_niah(
    model,
    processor,
    methods: Sequence[str] = DEFAULT_METHODS,
    frames: Sequence[int] = DEFAULT_FRAMES,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    *,
    trials: int = 1,
    seed: int = 0,
    kind: str = "number",
    size: int = 168,
    max_new_tokens: int = 6,
    repeats: int = 1,
    warmup: int = 1,
    memory_budget: int | None = None,
    vision_batch: int | None = None,
    out_dir=None,
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
    stream: bool = False,
    memory_meter: str = "rss",
    share_encoding: bool = True,
) -> VideoNIAHResult:
    """Run every method on every (frames, depth, trial) clip.

    Parameters
    ----------
    model : LlavaForConditionalGeneration (or another model :class:`~mmaccel.vision_tokens.VLMParts` supports)
    processor : its processor
    methods : sequence of str
        ``VISION[+KV]`` configurations or ``"none"`` (all visual tokens, full attention).
    frames : sequence of int
        Clip lengths in frames, each >= 1.
    depths : sequence of float
        Needle depths in [0, 1] (``needle_frame = round(depth * (frames - 1))``).
    trials : int
        Clips per (frames, depth); trial ``t`` is test-split clip ``t`` of draw ``seed``.
    kind : {"number", "colour", "motion"}
        The question (:data:`mmaccel.data.clips.CLIP_KINDS`).
    size : int
        Frame side in pixels (the processor resizes to the model's input).
    max_new_tokens : int
        Greedy new tokens per run.
    repeats, warmup : int
        See :func:`~mmaccel.eval.generation.generate_measured`; ``warmup`` runs happen once per method, on a
        :data:`WARMUP_FRAMES`-frame clip.
    memory_budget : int, optional
        Bytes of peak memory growth a run may take: the summary's ``memory`` section then says the largest frame
        count that fits, per method.
    out_dir : path, optional
        Where the files of the module docstring go; nothing is written when ``None``.
    progress : bool
        Show a tqdm progress bar.
    resume, overwrite : bool
        What to do with a non-empty ``out_dir`` (:func:`mmaccel.eval.sweep.sweep`): finish it, skipping the runs
        already recorded, or replace it; refused otherwise.
    stream : bool
        Run every clip through :func:`streamed_generate` (frames rendered, encoded ``vision_batch`` at a time (16 by
        default), reduced and prefilled as they come; the video's positions interpolated into the language model's
        ``max_position_embeddings`` when they would pass it): memory flat in the frame count under an evicting KV
        method. Methods as in :func:`check_streamed`; the ``chunked`` wrapper sets the prefill piece (1,024 tokens
        otherwise). ``repeats`` is 1.
    memory_meter : {"rss", "allocator"}
        How peak memory is measured off CUDA (:class:`~mmaccel.eval.memory.PeakMemory`).
    share_encoding : bool
        Encode each clip's frames through the vision tower once and give that output to every method that leaves
        the tower alone (:func:`~mmaccel.vision_tokens.shared_encoding.reads_tower_output_only`: ``none``, pooling,
        temporal ToMe, AIM, in-LLM pruners, with any KV method), as
        :class:`~mmaccel.vision_tokens.shared_encoding.SharedVisionEncoding` does; their answers are those of their
        own encodings. Such a record's ``vision_encoder_s`` and ``ttft_s`` include the shared encoding's seconds
        (``telemetry["shared_vision_encoder_s"]``) and its ``peak_memory_bytes`` is ``None`` (the stored encoding
        predates the run, so the meter cannot see it): the first clip of each frame count (first depth, trial 0)
        runs every method with its own encoding, and the summary's peak memory is that clip's. Not with
        ``stream`` (which encodes as it goes), and only on fixed-grid LLaVA models (others encode per method).

    Returns
    -------
    VideoNIAHResult

    Raises
    ------
    ValueError
        Before any run: no methods, a bad or unknown method (:func:`check_video_config`), frames < 1, a depth outside
        [0, 1], ``trials < 1``, an unknown ``kind``, ``memory_budget <= 0``, a processor that is not a VLM's, a
        ``vision_batch`` below 1 or on a model it does not support. A run
        that fails is recorded as ``status="failed"`` and the sweep goes on.
    """
    from ..data.clips import CLIP_KINDS, make_clip
    from ..data.splits import split_seed
    from .sweep import Cell as SweepCell
    from .sweep import check_out_dir, sweep

    check_vlm_processor(processor)
    if isinstance(methods, str):
        methods = [methods]
    if not methods:
        raise ValueError(f"no methods given; pass at least one, e.g. {DEFAULT_METHODS[0]!r} or {NO_REDUCTION!r}")
    configs = [parse_visual_config(m) for m in methods]
    for c in configs:
        check_streamed(c.vision, c.kv) if stream else check_video_config(c, model)
    check_cpu_meter(memory_meter, "memory_meter")
    frames = [int(t) for t in frames]
    depths = [float(d) for d in depths]
    if not frames or min(frames) < 1:
        raise ValueError(f"frames must be clip lengths >= 1, got {frames}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be fractions in [0, 1], got {depths}")
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if kind not in CLIP_KINDS:
        raise ValueError(f"unknown clip question kind {kind!r}; use one of {', '.join(CLIP_KINDS)}")
    if memory_budget is not None and not memory_budget > 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
    batched = None if vision_batch is None or stream else BatchedVisionEncoding(model, vision_batch)
    shared = None
    if share_encoding and not stream:
        try:
            shared = SharedVisionEncoding(model, vision_batch)
        except ValueError:  # not a fixed-grid LLaVA (Qwen2-VL, AnyRes): every method encodes its clip itself
            shared = None
    sharable = {c.label: reads_tower_output_only(resolve_vision(c.vision)[0]) for c in configs}
    warm_clip = make_clip(WARMUP_FRAMES, seed=split_seed("test", seed, 0), depth=0.5, size=size, kind=kind)
    warm_inputs = chat_inputs(processor, clip_images(warm_clip), warm_clip.question)
    if not stream:
        _warn_positions(model, image_token_count(model, warm_inputs) // WARMUP_FRAMES, max(frames), max_new_tokens,
                        configs)

    labels = [c.label for c in configs]
    config = {"methods": labels, "frames": frames, "depths": depths, "trials": trials, "seed": seed,
              "kind": kind, "size": size, "max_new_tokens": max_new_tokens, "repeats": repeats,
              "warmup": warmup, "memory_budget_bytes": memory_budget, "vision_batch": vision_batch,
              "stream": stream, "memory_meter": memory_meter, "share_encoding": shared is not None}
    out = check_out_dir(out_dir, resume=resume, overwrite=overwrite) if out_dir is not None else None
    cells = [SweepCell(c.label, sample=f"T={n}/d={d:g}/t={t}", fields={"frames": n, "depth": d, "trial": t},
                       payload=c)
             for n in frames for d in depths for t in range(trials) for c in configs]
    warmed: set[str] = set()
    clips: dict[tuple, tuple] = {}

    def run(cell) -> dict:
        n_frames, depth, trial = cell.fields["frames"], cell.fields["depth"], cell.fields["trial"]
        if stream:
            clip_seed = split_seed("test", seed, trial)
            clip = make_clip(n_frames, seed=clip_seed, depth=depth, size=size, kind=kind)
            if warmup and cell.payload.label not in warmed:
                run_streamed(model, processor, warm_clip, cell.payload, batch=vision_batch or 16, max_new_tokens=1)
            warmed.add(cell.payload.label)
            rec = run_streamed(model, processor, clip, cell.payload, batch=vision_batch or 16,
                               max_new_tokens=max_new_tokens, memory_meter=memory_meter)
            rec.extra.update(frames=n_frames, length=n_frames, depth=depth, trial=trial, clip_seed=clip_seed,
                             needle_frame=clip.needle_frame, kind=kind, question=clip.question)
            return rec.to_dict()
        key = (n_frames, depth, trial)
        if key not in clips:
            clips.clear()  # one clip's frames at a time
            if shared is not None:
                shared.clear()
            clip_seed = split_seed("test", seed, trial)
            clip = make_clip(n_frames, seed=clip_seed, depth=depth, size=size, kind=kind)
            clips[key] = (clip, clip_seed, chat_inputs(processor, clip_images(clip), clip.question))
        clip, clip_seed, inputs = clips[key]
        config = cell.payload
        share = shared is not None and sharable[config.label] and (depth, trial) != (depths[0], 0)
        if share and shared.encode_s is None:
            shared.encode(inputs["pixel_values"])
        with shared.applied() if share else contextlib.nullcontext():
            rec = run_config(model, processor, inputs, config, answer=clip.answer, max_new_tokens=max_new_tokens,
                             repeats=repeats, warmup=0 if config.label in warmed else warmup,
                             warmup_inputs=warm_inputs, memory_meter=memory_meter)
        if share:
            _add_shared_encoding(rec, shared.encode_s)
        warmed.add(config.label)
        rec.extra.update(frames=n_frames, length=n_frames, depth=depth, trial=trial, clip_seed=clip_seed,
                         needle_frame=clip.needle_frame, kind=kind, question=clip.question)
        return rec.to_dict()

    def summarize(records: list[dict]) -> dict:
        summary = summarize_video(records, labels, frames, depths, memory_budget)
        summary["config"] = config
        return summary

    result = VideoNIAHResult(records=[], summary={}, out_dir=out)

    def plots(folder, summary, records):
        for label in labels:
            result.heatmaps[label] = plot_frames_heatmap(summary["methods"][label]["cells"], frames, depths,
                                                         f"video NIAH accuracy: {label}",
                                                         folder / f"heatmap_{safe_label(label)}.png")
        result.memory_plot = plot_memory(summary, folder / "peak_memory.png")

    with contextlib.ExitStack() as stack:
        if batched is not None:
            stack.enter_context(batched)
        done = sweep(cells, run, out=out, resume=resume, overwrite=overwrite, summarize=summarize,
                     write_extra=plots, config=config, progress=progress, desc="video-niah")
    result.records, result.summary = done.records, done.summary
    if out is not None:
        logger.info("wrote %s", out)
    return result


def _add_shared_encoding(record, seconds: float) -> None:
    """Count a shared vision encoding's ``seconds`` in a run's ``vision_encoder_s`` and ``ttft_s`` (and in each
    repeat's), and set its peak memory to ``None``: the meter started after the stored encoding was allocated."""
    for row in (record.__dict__, *record.samples):
        for name in ("vision_encoder_s", "ttft_s"):
            if row.get(name) is not None:
                row[name] = row[name] + seconds
        if "peak_memory_bytes" in row:
            row["peak_memory_bytes"] = None
    record.telemetry = {**(record.telemetry or {}), "shared_vision_encoder_s": seconds}


def _warn_positions(model, per_frame: int, most_frames: int, max_new_tokens: int, configs) -> None:
    """Warn when the longest clip's positions pass the language model's ``max_position_embeddings``, naming the
    methods that reach them: kept visual tokens keep their original positions by default, so reducing tokens does not
    shorten the position range; a pre-LLM method with ``positions=contiguous`` does, and is left out (no warning when
    every method given renumbers)."""
    from ..vision_tokens import build_method as build_vision

    config = getattr(model.config, "text_config", model.config)
    limit = getattr(config, "max_position_embeddings", None)
    last = per_frame * most_frames + max_new_tokens
    if not limit or last <= limit:
        return
    original = [c.label for c in configs
                if c.vision is None or getattr(build_vision(c.vision), "positions", "original") != "contiguous"]
    if original:
        logger.warning("%d frames x %d visual tokens reach position %d, past the language model's "
                       "max_position_embeddings=%d, under %s: answers there test position extrapolation too (a "
                       "pre-LLM method with ':positions=contiguous' numbers only the kept tokens)", most_frames,
                       per_frame, last, limit, ", ".join(original))


def summarize_video(records: list[dict], labels: Sequence[str], frames: Sequence[int], depths: Sequence[float],
                    memory_budget: int | None = None) -> dict:
    """:func:`mmaccel.eval.niah.summarize` over frames x depth, plus the ``memory`` section.

    The K/V ratio after prefill is taken against the ``none`` configuration's run on the same clip (when the sweep
    has one). ``memory["methods"][label]``: ``by_frames`` (per frame count: the largest and the median peak memory
    growth of its runs, bytes, and whether every run succeeded), ``largest_frames_within_budget`` (the largest
    measured frame count whose runs all succeeded within the budget; ``None`` if none did or there is no budget) and
    ``estimated_max_frames`` (the budget solved on a least-squares line ``peak = a + b * frames`` through the
    successful frame counts; ``None`` with fewer than two of them, a non-positive slope or no budget).
    """
    view = [{**r, "method_name": "full" if r["method"] == NO_REDUCTION else None} for r in records]
    summary = summarize(view, frames, depths)
    memory = {"budget_bytes": memory_budget, "methods": {}}
    for label in labels:
        rows = [r for r in records if r["method"] == label]
        by_frames = []
        for t in frames:
            at = [r for r in rows if r["extra"]["frames"] == t]
            peaks = [r["peak_memory_bytes"] for r in at if r["status"] == "ok" and r["peak_memory_bytes"] is not None]
            all_ok = bool(at) and all(r["status"] == "ok" for r in at)
            by_frames.append({"frames": t, "all_ok": all_ok, "max_peak_memory_bytes": max(peaks) if peaks else None,
                              "median_peak_memory_bytes": sorted(peaks)[len(peaks) // 2] if peaks else None,
                              "method": at[0]["peak_memory_method"] if at else None})
        memory["methods"][label] = {"by_frames": by_frames, **_fit_budget(by_frames, memory_budget)}
    summary["memory"] = memory
    return summary


def _fit_budget(by_frames: list[dict], budget: int | None) -> dict:
    usable = [b for b in by_frames if b["all_ok"] and b["max_peak_memory_bytes"] is not None]
    if budget is None:
        return {"largest_frames_within_budget": None, "estimated_max_frames": None}
    fits = [b["frames"] for b in usable if b["max_peak_memory_bytes"] <= budget]
    estimate = None
    if len({b["frames"] for b in usable}) >= 2:
        xs = [b["frames"] for b in usable]
        ys = [b["max_peak_memory_bytes"] for b in usable]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if slope > 0:
            estimate = max(0, math.floor((budget - (my - slope * mx)) / slope))
    return {"largest_frames_within_budget": max(fits) if fits else None, "estimated_max_frames": estimate}


def plot_frames_heatmap(cells: list[dict], frames: Sequence[int], depths: Sequence[float], title: str, path) -> Path:
    """The NIAH accuracy heatmap (:func:`mmaccel.eval.niah.draw_heatmap`) with frames on the x axis; a PNG at
    ``path``, returned."""
    from .plots import _figure

    fig = _figure(max(5.0, 1.8 + 0.9 * len(frames)), max(3.0, 1.4 + 0.5 * len(depths)))
    ax = fig.add_subplot()
    fig.colorbar(draw_heatmap(ax, cells, frames, depths, title), ax=ax, label="accuracy")
    ax.set_xlabel("clip length (frames)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def plot_memory(summary: dict, path) -> Path:
    """Peak memory growth (MiB, the largest run per frame count) against frames, one line per method, the budget
    dashed; a PNG at ``path``, returned."""
    from .plots import _figure

    fig = _figure(6.5, 3.6)
    ax = fig.add_subplot()
    memory = summary["memory"]
    for label, m in memory["methods"].items():
        points = [(b["frames"], b["max_peak_memory_bytes"] / 2**20) for b in m["by_frames"]
                  if b["max_peak_memory_bytes"] is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=label[:48])
    if memory["budget_bytes"]:
        ax.axhline(memory["budget_bytes"] / 2**20, color="k", ls="--", lw=0.8, label="budget")
    ax.set_xscale("log", base=2)
    ticks = sorted({b["frames"] for m in memory["methods"].values() for b in m["by_frames"]})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("clip length (frames)")
    ax.set_ylabel("peak memory growth (MiB)")
    ax.set_title("peak memory per run (largest over depths and trials)", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def video_table(summary: dict) -> str:
    """Markdown: per method and frame count the accuracy, runs, failures, median TTFT and peak memory; then, with a
    budget, the largest frame count that fits per method."""
    from .compare import format_bytes

    lines = ["| method | frames | accuracy | n | failed | median TTFT (s) | median peak mem |", "|" + "---|" * 7]
    for label, m in summary["methods"].items():
        for row in m["by_length"]:
            acc = "-" if row["accuracy"] is None else f"{100 * row['accuracy']:.0f}%"
            ttft = "-" if row["median_ttft_s"] is None else f"{row['median_ttft_s']:.2f}"
            lines.append(f"| {label} | {row['length']} | {acc} | {row['n']} | {row['failed']} | {ttft} | "
                         f"{format_bytes(row['median_peak_memory_bytes'])} |")
    budget = summary["memory"]["budget_bytes"]
    if budget:
        lines.append(f"\nmemory budget {format_bytes(budget)}:")
        for label, m in summary["memory"]["methods"].items():
            est = m["estimated_max_frames"]
            lines.append(f"- {label}: largest measured frame count within budget "
                         f"{m['largest_frames_within_budget'] or 'none'}; linear estimate "
                         f"{'-' if est is None else est} frames")
    return "\n".join(lines)


__all__ = ["DEFAULT_METHODS", "StreamedRun", "VideoNIAHResult", "check_streamed", "check_video_config", "clip_images",
           "frame_pixels", "plot_frames_heatmap", "plot_memory", "run_streamed", "streamed_generate",
           "summarize_video", "video_niah", "video_prompt_layout", "video_table"]
