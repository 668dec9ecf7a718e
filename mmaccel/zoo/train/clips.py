"""Video needle-in-a-haystack conversations for ``smol-llava``'s training (``--clip-every``).

A LLaVA-1.5-style model reads a video as a batch of frames, one ``<image>`` per frame. At 144 visual tokens per
frame a 256-frame clip is 36,864 positions, far past SmolLM2's 8,192, so long clips are read pooled: every frame's
projected tokens are averaged to a 3 x 3 grid (:class:`mmaccel.vision_tokens.Pooling` at ``keep_ratio=0.0625``,
9 tokens per frame) and numbered contiguously (``positions="contiguous"``, as LLaVA-OneVision numbers its pooled
video tokens), so 256 frames are 2,304 positions. This module trains the model on exactly that input: the
training ids hold 9 ``<image>`` tokens per frame, and :func:`pooled_clip_embeds` averages the projected tokens
with the same :func:`~mmaccel.vision_tokens.pooling.pooling_plan` the method applies at inference.

Cost. The tower is frozen and encodes each frame on its own, so a clip's features are the rows of its frames. A
few long *base* clips of the train split (:func:`mmaccel.data.clips.make_clip`) are encoded once; a training clip
is ``F`` frames sampled uniformly from one base clip (a lower frame rate), with one frame replaced by a needle frame
rendered at that time in that base clip (a seeded number and colour) and encoded separately. The composed
features are exactly what encoding the composed clip would give.

Questions: the needle's number and its colour (:data:`mmaccel.data.clips.CLIP_KINDS` ``"number"`` and
``"colour"``), one conversation of two turns in a seeded order. The motion question is not trained.

Task: V-NIAH of LongVA (Zhang et al., "Long Context Transfer from Language to Vision", 2024, arXiv 2406.16852).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ...data.clips import _QUESTIONS, make_clip
from ...data.scenes import PALETTE
from ...data.splits import split_seed
from ...models.smol_llava import projector_of

#: Frames per training clip, with the batch size of each; a clip's length is drawn in proportion to its batch size,
#: so that every length gets about as many steps (up to about 1,200 visual tokens per batch,
#: 2,300 at 256 frames). Short clips (1 and 4 frames) teach reading the needle, long ones finding it: a first run with
#: 16-256 frames only had learnt neither after 145 clip steps (about 250 conversations). A 256-frame clip shows each
#: of its base clip's 128 frames twice (the test clips change as slowly).
CLIP_FRAMES = {1: 8, 4: 8, 16: 6, 64: 2, 256: 1}
#: The clip lengths of the reading phase (``--clip-short-steps``): 1- and 4-frame clips, where the needle is
#: found at once and only its reading is learnt. In an ad-hoc probe run (2026-11-27, not committed), 250 steps of
#: these from ``smol-llava``'s stage-1 projector (LoRA rank 8, lr 1e-3) took held-out number reading from chance to
#: about 50%, where a mix of every length had learnt nothing after 270 clip steps.
SHORT_FRAMES = {1: 8, 4: 8}
#: Visual tokens per frame after pooling (a 12 x 12 grid averaged to 3 x 3).
TOKENS_PER_FRAME = 9
#: Frames of every base clip; training clips sample up to this many of them.
BASE_FRAMES = 128


@dataclass
class ClipExample:
    """One training conversation about one composed clip.

    Attributes
    ----------
    input_ids, labels : list of int
        The chat with :data:`TOKENS_PER_FRAME` ``<image>`` tokens per frame, then the answers; labels are -100 except
        on answer tokens and EOS.
    base : int
        Index of the base clip whose frames are used.
    frames : list of int
        The base clip's frame indices, in order (``F`` of them; at 256 frames each index appears twice).
    needle : int
        Position in ``frames`` of the needle frame.
    needle_row : int
        Row of the needle frame's features in the needle table.
    answers, kinds : list of str
    """

    input_ids: list
    labels: list
    base: int
    frames: list
    needle: int
    needle_row: int
    answers: list
    kinds: list


def clip_prompt_ids(processor, frames: int, question: str) -> list:
    """Token ids of the first turn about a clip of ``frames`` frames, pooled to :data:`TOKENS_PER_FRAME` tokens per
    frame: the processor's chat text with each ``<image>`` expanded to that many image tokens (the ids the
    language model sees at inference under ``pooling:keep_ratio=0.0625``)."""
    from ...data.scene_prompts import messages

    chat = messages(question)
    chat[0]["content"] = [{"type": "image"}] * frames + chat[0]["content"][1:]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    token = processor.image_token
    return processor.tokenizer(text.replace(token, token * TOKENS_PER_FRAME), add_special_tokens=False)["input_ids"]


def clip_conversations(processor, n: int, *, bases: int, seed: int = 0, frames: dict = CLIP_FRAMES, draw: int = 0):
    """``n`` training conversations over ``bases`` base clips, and the needle frames to encode.

    Parameters
    ----------
    frames : dict
        Clip lengths (frames) and their batch sizes; a length is drawn in proportion to its batch size.
    draw : int
        Which draw of conversations (0 is the first); the base clips depend on ``seed`` only, so draws share them.

    Returns
    -------
    (examples, base_clips, needle_images)
        :class:`ClipExample` list; the base :class:`~mmaccel.data.clips.Clip` objects (train split, draw
        ``seed + 2``, :data:`BASE_FRAMES` frames, their own needle removed: ``needle_frame=None``); the rendered
        needle frames ([S, S, 3] uint8), one per example.
    """
    from ...data.scene_prompts import later_turn_ids

    rng = np.random.default_rng([seed, 11] + ([draw] if draw else []))
    # the base clips' own needles are removed (needle_frame=None matches no frame): a sampled clip has one needle
    base_clips = [dataclasses.replace(make_clip(BASE_FRAMES, split_seed("train", seed + 2, i)), needle_frame=None)
                  for i in range(bases)]
    tok = processor.tokenizer
    colours = list(PALETTE)
    sizes = list(frames)
    weights = np.array([frames[f] for f in sizes], dtype=float)
    weights /= weights.sum()  # a length is drawn in proportion to its batch size: every length gets as many batches
    examples, needles = [], []
    for _ in range(n):
        b = int(rng.integers(bases))
        frames_n = sizes[int(rng.choice(len(sizes), p=weights))]
        frames = np.linspace(0, BASE_FRAMES - 1, frames_n).round().astype(int).tolist()
        needle = int(rng.integers(frames_n))
        number, colour = str(int(rng.integers(10))), colours[int(rng.integers(len(colours)))]
        clip = dataclasses.replace(base_clips[b], needle_frame=frames[needle], number=number, number_colour=colour)
        needles.append(clip.frame(frames[needle]))
        turns = [("number", number), ("colour", colour)]
        if rng.random() < 0.5:
            turns.reverse()
        ids, labels = [], []
        for k, (kind, answer) in enumerate(turns):
            question = _QUESTIONS[kind]
            prompt = clip_prompt_ids(processor, frames_n, question) if k == 0 else later_turn_ids(tok, question)
            target = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
            ids += prompt + target
            labels += [-100] * len(prompt) + target
        examples.append(ClipExample(ids, labels, b, frames, needle, len(needles) - 1, [a for _, a in turns],
                                    [k for k, _ in turns]))
    return examples, base_clips, needles


def pooled_clip_embeds(model, input_ids: torch.Tensor, clip_features: list, *,
                       tokens_per_frame: int = TOKENS_PER_FRAME) -> torch.Tensor:
    """Input embeddings of a batch of clips with their pooled visual tokens on the ``<image>`` positions.

    Parameters
    ----------
    input_ids : torch.Tensor
        [B, L] with ``tokens_per_frame`` ``<image>`` tokens per frame.
    clip_features : list of torch.Tensor
        Per row, [F, N, D_vision] tower features of its frames (N = 144, a square grid).
    tokens_per_frame : int
        Tokens per frame after pooling (:data:`TOKENS_PER_FRAME`, a 3 x 3 grid).

    Returns
    -------
    torch.Tensor
        [B, L, D_text]; differentiable with respect to the projector's parameters. The pooled tokens are
        :func:`~mmaccel.vision_tokens.pooling.pooling_plan`'s merge of the projected tokens, i.e. what
        ``Pooling(keep_ratio=0.0625)`` gives the language model.

    Raises
    ------
    ValueError
        If a row's ``<image>`` count is not ``F * tokens_per_frame``.
    """
    from ...vision_tokens.base import ImageGrid
    from ...vision_tokens.pooling import pooling_plan

    embeds = model.get_input_embeddings()(input_ids)
    mask = input_ids == model.config.image_token_id
    rows = []
    for b, feats in enumerate(clip_features):
        frames, n = feats.shape[:2]
        side = int(round(n ** 0.5))
        projected = projector_of(model)(feats.to(embeds.dtype)).reshape(1, frames * n, -1)
        plan = pooling_plan(ImageGrid(frames, side, side), tokens_per_frame, device=projected.device)
        pooled = plan.merge(projected)[0]
        if int(mask[b].sum()) != pooled.shape[0]:
            raise ValueError(f"row {b} holds {int(mask[b].sum())} image tokens but its {frames} frames pool to "
                             f"{pooled.shape[0]}")
        rows.append(pooled.to(embeds.dtype))
    return embeds.masked_scatter(mask.unsqueeze(-1), torch.cat(rows))


def features_of(example: ClipExample, base_features: list, needle_features: torch.Tensor) -> torch.Tensor:
    """[F, N, D] tower features of a composed clip: its base clip's rows, the needle frame's row replaced."""
    feats = base_features[example.base][example.frames].clone()
    feats[example.needle] = needle_features[example.needle_row]
    return feats


def clip_batches(examples: list, batch_sizes: dict = CLIP_FRAMES, seed: int = 0) -> list:
    """Group conversations into batches of one clip length (``batch_sizes[F]`` each), in a seeded order."""
    gen = torch.Generator().manual_seed(seed + 3)
    by_len: dict[int, list] = {}
    for i, e in enumerate(examples):
        by_len.setdefault(len(e.frames), []).append(i)
    batches = [idx[j:j + batch_sizes[f]] for f, idx in by_len.items() for j in range(0, len(idx), batch_sizes[f])]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
