"""Train ``micro-ar``, a tiny autoregressive image/video model over palette tokens (``mmaccel zoo train micro-ar``).

One ``LlamaForCausalLM`` reads a prompt of words (:data:`mmaccel.data.palette.WORDS`) and paints, one token per
pixel in raster order, a ``16 x 16`` palette image or a clip of 8 frames of ``8 x 8`` (frame after frame), the
LlamaGen recipe (Sun et al., 2024, "Autoregressive Model Beats Diffusion: Llama for Scalable Image Generation",
arXiv 2406.06525) at toy scale with the VQ tokenizer replaced by a 16-colour palette. Each row of pixels starts with
a row token ``<rNN>`` (its row within the image or frame), as Lumina-mGPT and Emu3 end each row with a line token:
with only relative (RoPE) positions, a 4-layer model trained for minutes on a CPU did not learn where a shape starts
from the raster index alone (first run, notes in the card), while the row is then read off the last row token and
the column is a short distance from it. Sequences::

    <s> red circle at top-left on black <image> <r00> p p ... p <r01> p ... p </s>          (16 x 17 = 272 tokens)
    <s> red square at top moving right on black <video> <r00> p ... (8 rows of 9 per frame)  (8 x 72 = 576 tokens)

Token ids: ``0 .. 15`` are the palette colours (``<c00>`` .. ``<c15>``, id = palette index), then ``<pad>``, ``<s>``,
``</s>``, ``<image>``, ``<video>``, the row tokens ``<r00>`` .. ``<r15>`` and the words. Data are generated at
training time by :func:`mmaccel.data.palette.make_palette_sample` from the train split; the card's quality metric is
the greedy palette accuracy (:func:`mmaccel.data.palette.palette_accuracy`) on held-out test prompts. For
speculative decoding, :data:`RASTER` gives the token strides of a row (the pixel above is ``row`` tokens back) and of
a frame.
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ...data.palette import (
    COLOURS,
    IMAGE_SIZE,
    VIDEO_FRAMES,
    VIDEO_SIZE,
    WORDS,
    make_palette_sample,
    palette_accuracy,
    palette_samples,
)
from ...data.splits import split_seed
from ...models.zoo import ZOO, Recipe, zoo_path
from .lm import _lr_at, _save, weighted_ce_step

logger = logging.getLogger(__name__)

NAME = "micro-ar"
SPECIAL = ("<pad>", "<s>", "</s>", "<image>", "<video>")
ROW_TOKENS = tuple(f"<r{i:02d}>" for i in range(IMAGE_SIZE))
#: Id of ``<r00>``; row token ``i`` is ``ROW_TOKEN_OFFSET + i``.
ROW_TOKEN_OFFSET = len(COLOURS) + len(SPECIAL)
#: Tokens of a kind: (start token, generated tokens per picture, picture shape); rows carry a leading row token.
LAYOUT = {
    "image": ("<image>", IMAGE_SIZE * (IMAGE_SIZE + 1), (IMAGE_SIZE, IMAGE_SIZE)),
    "video": ("<video>", VIDEO_FRAMES * VIDEO_SIZE * (VIDEO_SIZE + 1), (VIDEO_FRAMES, VIDEO_SIZE, VIDEO_SIZE)),
}
#: Token strides of a kind: (row, frame); the pixel above is ``row`` tokens back, the previous frame ``frame``.
RASTER = {
    "image": (IMAGE_SIZE + 1, IMAGE_SIZE * (IMAGE_SIZE + 1)),
    "video": (VIDEO_SIZE + 1, VIDEO_SIZE * (VIDEO_SIZE + 1)),
}
#: One optimizer step in ``VIDEO_EVERY`` is a batch of clips (half as many sequences: a clip is twice as long).
VIDEO_EVERY = 3


def build_tokenizer():
    """The word-level tokenizer of ``micro-ar`` (``tokenizers`` WordLevel, split on spaces).

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        Vocabulary (71): 16 palette tokens (ids 0..15 = palette index), ``<pad>`` 16, ``<s>`` 17, ``</s>`` 18,
        ``<image>`` 19, ``<video>`` 20, row tokens ``<r00>`` .. ``<r15>`` 21..36, then
        :data:`mmaccel.data.palette.WORDS`; unknown words map to ``<pad>``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = [f"<c{i:02d}>" for i in range(len(COLOURS))] + list(SPECIAL) + list(ROW_TOKENS) + list(WORDS)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
        model_max_length=1024,
    )


def prompt_ids(tokenizer, prompt: str, kind: str = "image") -> list[int]:
    """``<s> words <image>`` (or ``<video>``): the prefix after which ``micro-ar`` paints.

    Raises
    ------
    ValueError
        For an unknown kind or a word outside the vocabulary.
    """
    if kind not in LAYOUT:
        raise ValueError(f"unknown kind {kind!r}; use one of {tuple(LAYOUT)}")
    unknown = [w for w in prompt.split() if w not in WORDS]
    if unknown:
        raise ValueError(f"words {unknown} are not in micro-ar's vocabulary (mmaccel.data.palette.WORDS)")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return [tokenizer.bos_token_id, *ids, tokenizer.convert_tokens_to_ids(LAYOUT[kind][0])]


def picture_to_tokens(indices, kind: str = "image") -> list[int]:
    """Palette indices -> the generated tokens of a picture: per row, its row token then its pixels.

    Parameters
    ----------
    indices : array-like of int
        ``[16, 16]`` (image) or ``[8, 8, 8]`` (clip) palette indices.

    Returns
    -------
    list of int
        272 (image) or 576 (clip) token ids.

    Raises
    ------
    ValueError
        For an unknown kind or a picture of the wrong shape.
    """
    if kind not in LAYOUT:
        raise ValueError(f"unknown kind {kind!r}; use one of {tuple(LAYOUT)}")
    arr = np.asarray(indices, dtype=np.int64)
    if arr.shape != LAYOUT[kind][2]:
        raise ValueError(f"a {kind} is {LAYOUT[kind][2]} palette indices, got shape {arr.shape}")
    rows = arr.reshape(-1, arr.shape[-1])
    height = arr.shape[-2]
    markers = ROW_TOKEN_OFFSET + (np.arange(len(rows)) % height)
    return np.concatenate([markers[:, None], rows], axis=1).reshape(-1).tolist()


def tokens_to_picture(tokens, kind: str = "image") -> np.ndarray:
    """Generated tokens -> palette indices: ``[16, 16]`` or ``[8, 8, 8]``; row tokens are dropped, and a pixel
    position holding anything but a palette token becomes 255 (wrong for :func:`palette_accuracy`).

    Parameters
    ----------
    tokens : sequence of int
        Exactly the 272 (image) or 576 (clip) generated tokens.

    Raises
    ------
    ValueError
        For an unknown kind or the wrong number of tokens.
    """
    if kind not in LAYOUT:
        raise ValueError(f"unknown kind {kind!r}; use one of {tuple(LAYOUT)}")
    _, n, shape = LAYOUT[kind]
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if arr.size != n:
        raise ValueError(f"a {kind} is {n} tokens, got {arr.size}")
    pixels = arr.reshape(-1, shape[-1] + 1)[:, 1:]
    pixels = np.where((pixels >= 0) & (pixels < len(COLOURS)), pixels, 255)
    return pixels.astype(np.uint8).reshape(shape)


def event_pixels(indices) -> np.ndarray:
    """Pixels that differ from the pixel above (first row of an image or frame: from the pixel to the left): where a
    shape starts, ends or moves, the few tokens the copy-from-above default gets wrong.

    Parameters
    ----------
    indices : numpy.ndarray
        ``[H, W]`` or ``[T, H, W]`` palette indices.

    Returns
    -------
    numpy.ndarray
        bool, the same shape.
    """
    arr = np.asarray(indices)
    events = np.zeros(arr.shape, dtype=bool)
    events[..., 1:, :] = arr[..., 1:, :] != arr[..., :-1, :]
    events[..., 0, 1:] = arr[..., 0, 1:] != arr[..., 0, :-1]
    return events


class _Batches:
    """Training batches of one kind whose prompts all have the same length (no padding, so attention takes the
    causal fast path): samples from a stream of train-split seeds, bucketed by prompt length."""

    def __init__(self, tokenizer, kind: str, seed: int, device: str, event_weight: float = 1.0):
        self.tok, self.kind, self.seed, self.device = tokenizer, kind, seed, device
        self.event_weight = event_weight
        self.next_index = 0
        self.buckets: dict[int, list[tuple[list[int], list[float]]]] = {}

    def __call__(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] token ids (prompt, picture tokens, ``</s>``) and [B, n] loss weights of the picture tokens and
        ``</s>`` (``event_weight`` on :func:`event_pixels`, 1 elsewhere)."""
        while True:
            sample = make_palette_sample(split_seed("train", self.seed, self.next_index), self.kind)
            self.next_index += 1
            row = (prompt_ids(self.tok, sample.prompt, self.kind) + picture_to_tokens(sample.indices, self.kind)
                   + [self.tok.eos_token_id])
            events = event_pixels(sample.indices).reshape(-1, sample.indices.shape[-1])
            weights = np.concatenate([np.zeros((len(events), 1), dtype=bool), events], axis=1).reshape(-1)
            weights = np.where(weights, self.event_weight, 1.0).tolist() + [1.0]
            bucket = self.buckets.setdefault(len(row), [])
            bucket.append((row, weights))
            if len(bucket) == batch_size:
                self.buckets[len(row)] = []
                return (torch.tensor([b[0] for b in bucket], device=self.device),
                        torch.tensor([b[1] for b in bucket], device=self.device))


def left_pad(rows: list[list[int]], pad_id: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one left-padded batch: ids [B, T] and attention mask [B, T] (0 = pad)."""
    T = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (T - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


@torch.inference_mode()
def paint(model, tokenizer, prompts: list[str], kind: str = "image", batch_size: int = 32) -> list[np.ndarray]:
    """Greedy autoregressive painting with ``model.generate`` (the plain decoding SJD is compared against).

    Parameters
    ----------
    model : transformers.LlamaForCausalLM
        ``micro-ar``.
    prompts : list of str
        Prompts of one kind.
    kind : str
        ``"image"`` or ``"video"``.

    Returns
    -------
    list of numpy.ndarray
        Palette indices per prompt (:func:`tokens_to_picture`).
    """
    n = LAYOUT[kind][1]
    out = []
    for i in range(0, len(prompts), batch_size):
        ids, mask = left_pad([prompt_ids(tokenizer, p, kind) for p in prompts[i:i + batch_size]],
                             tokenizer.pad_token_id, model.device)
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        out += [tokens_to_picture(g[ids.shape[1]:].tolist(), kind) for g in gen]
    return out


def evaluate(model, tokenizer, n_images: int = 64, n_clips: int = 16, seed: int = 0) -> dict:
    """Greedy palette accuracy of ``model`` on held-out prompts (the test split of :mod:`mmaccel.data.splits`).

    Returns
    -------
    dict
        Per kind: ``palette_accuracy`` (mean over samples), ``exact`` (fraction of pictures with every pixel right),
        ``n``.
    """
    model.eval()
    result = {}
    for kind, n in (("image", n_images), ("video", n_clips)):
        if n <= 0:
            continue
        samples = palette_samples(n, kind=kind, split="test", seed=seed)
        pics = paint(model, tokenizer, [s.prompt for s in samples], kind)
        accs = [palette_accuracy(p, s.indices) for p, s in zip(pics, samples)]
        result[kind] = {"palette_accuracy": float(np.mean(accs)), "exact": float(np.mean([a == 1.0 for a in accs])),
                        "n": n}
    return result


def train(
    out_dir: str | Path | None = None,
    *,
    device: str = "cpu",
    threads: int | None = None,
    max_steps: int | None = None,
    log_every: int = 25,
    recipe: Recipe | None = None,
    eval_images: int = 64,
    eval_clips: int = 16,
    invocation: str | None = None,
) -> dict:
    """Train ``micro-ar`` from scratch, save it as a HF checkpoint with ``train_log.json`` and write its card.

    Parameters
    ----------
    out_dir : path, optional
        Where to write; default ``assets/models/micro-ar``.
    device : str
        ``"cpu"`` reproduces the committed model; ``"cuda"`` trains the same recipe faster.
    threads : int, optional
        ``torch.set_num_threads`` for CPU training.
    max_steps : int, optional
        Stop early (trial runs); the cosine schedule still spans the recipe's steps.
    log_every : int
        Log and record metrics every this many steps.
    recipe : Recipe, optional
        Override the zoo entry's recipe (experiments only).
    eval_images, eval_clips : int
        Held-out prompts for the final greedy palette accuracy.
    invocation : str, optional
        The shell command that ran this training, recorded in the log and the card (default: the zoo command).

    Returns
    -------
    dict
        Summary: steps, wall_time_s (seconds), tokens, loss history, held-out quality, hardware.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    entry = ZOO[NAME]
    recipe = recipe if recipe is not None else entry.recipe
    out = Path(out_dir) if out_dir is not None else zoo_path(NAME)
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    tokenizer = build_tokenizer()
    cfg_kwargs = dict(entry.model_config)
    config = AutoConfig.for_model(cfg_kwargs.pop("model_type"), **cfg_kwargs)
    config.vocab_size = len(tokenizer)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("training %s: %.2fM parameters on %s", NAME, n_params / 1e6, device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=recipe.betas)
    phase = recipe.phases[0]
    total = recipe.total_steps if max_steps is None else min(max_steps, recipe.total_steps)
    history: list[dict] = []
    batches = {kind: _Batches(tokenizer, kind, recipe.seed + j, device, recipe.answer_weight)
               for j, kind in enumerate(LAYOUT)}
    tokens, t0 = 0, time.perf_counter()
    win = {"loss": 0.0, "token_acc": 0.0, "n": 0, "tokens": 0, "t": t0}
    model.train()
    for step in range(total):
        kind = "video" if step % VIDEO_EVERY == VIDEO_EVERY - 1 else "image"
        bs = phase.batch_size if kind == "image" else max(phase.batch_size // 2, 1)
        ids, weights = batches[kind](bs)
        n_pix = LAYOUT[kind][1] + 1  # picture tokens and </s>
        logits = model(input_ids=ids, logits_to_keep=n_pix + 1).logits[:, :-1].float()
        labels = ids[:, -n_pix:]
        _, loss = weighted_ce_step(model, opt, logits, labels, weights, _lr_at(step, recipe), recipe.grad_clip)
        with torch.no_grad():
            acc = (logits.argmax(-1) == labels).float().mean().item()
        tokens += ids.numel()
        win["loss"] += loss.item()
        win["token_acc"] += acc
        win["n"] += 1
        win["tokens"] += ids.numel()
        if (step + 1) % log_every == 0 or step + 1 == total:
            now = time.perf_counter()
            row = {"step": step + 1, "loss": win["loss"] / win["n"], "token_acc": win["token_acc"] / win["n"],
                   "lr": _lr_at(step, recipe), "tokens_per_s": win["tokens"] / (now - win["t"]),
                   "elapsed_s": now - t0}
            history.append(row)
            logger.info("step %d/%d loss %.4f teacher-forced token acc %.4f %.0f tok/s %.0fs", row["step"], total,
                        row["loss"], row["token_acc"], row["tokens_per_s"], row["elapsed_s"])
            win = {"loss": 0.0, "token_acc": 0.0, "n": 0, "tokens": 0, "t": now}
        if (step + 1) % 300 == 0:
            _save(model, tokenizer, out)  # a usable checkpoint while the run goes on
    wall = time.perf_counter() - t0
    _save(model, tokenizer, out)
    t_eval = time.perf_counter()
    quality = evaluate(model, tokenizer, eval_images, eval_clips)
    summary = {
        "name": NAME,
        "command": f"mmaccel zoo train {NAME}" + ("" if max_steps is None else f" --max-steps {max_steps}"),
        "invocation": invocation or f"mmaccel zoo train {NAME}",
        "parameters": n_params,
        "steps": total,
        "tokens": tokens,
        "wall_time_s": wall,
        "eval_seconds": time.perf_counter() - t_eval,
        "device": device,
        "threads": torch.get_num_threads(),
        "hardware": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "final_loss": history[-1]["loss"] if history else None,
        "quality": quality,
        "recipe": {"steps": recipe.total_steps, "image_batch": phase.batch_size,
                   "video_batch": max(phase.batch_size // 2, 1), "video_every": VIDEO_EVERY, "lr": recipe.lr,
                   "betas": list(recipe.betas), "weight_decay": recipe.weight_decay,
                   "warmup_steps": recipe.warmup_steps, "min_lr_ratio": recipe.min_lr_ratio,
                   "grad_clip": recipe.grad_clip, "seed": recipe.seed,
                   "event_weight": recipe.answer_weight},
        "history": history,
    }
    (out / "train_log.json").write_text(json.dumps(summary, indent=1))
    write_card(out, summary)
    return summary


def background_only_accuracy(kind: str, n: int, seed: int = 0) -> float:
    """Palette accuracy of painting only the background on ``n`` held-out prompts (the card's floor)."""
    samples = palette_samples(n, kind=kind, split="test", seed=seed)
    return float(np.mean([palette_accuracy(np.full_like(s.indices, np.bincount(s.indices.reshape(-1)).argmax()),
                                           s.indices) for s in samples]))


def write_card(out: str | Path, summary: dict | None = None) -> Path:
    """Write ``README.md`` of ``micro-ar`` from its ``train_log.json`` (or ``summary``).

    Raises
    ------
    FileNotFoundError
        If there is no training log (train first: ``mmaccel zoo train micro-ar``).
    """
    out = Path(out)
    if summary is None:
        log = out / "train_log.json"
        if not log.exists():
            raise FileNotFoundError(f"no training log at {log}; run `mmaccel zoo train {NAME}` first")
        summary = json.loads(log.read_text())
    cfg = ZOO[NAME].model_config
    weights = out / "model.safetensors"
    hist = summary["history"]
    keep = hist[:: max(len(hist) // 16, 1)] + hist[-1:]
    seen, rows = set(), []
    for h in keep:
        if h["step"] not in seen:
            seen.add(h["step"])
            rows.append(f"| {h['step']} | {h['loss']:.4f} | {h['token_acc']:.4f} | {h['tokens_per_s']:.0f} | "
                        f"{h['elapsed_s'] / 60:.1f} |")
    q = summary.get("quality", {})
    qual = "\n".join(f"| {kind} | {v['n']} | {100 * v['palette_accuracy']:.2f}% | {100 * v['exact']:.1f}% | "
                     f"{100 * background_only_accuracy(kind, v['n']):.2f}% |" for kind, v in q.items())
    speeds = [h["tokens_per_s"] for h in hist]
    r = summary["recipe"]
    text = f"""# micro-ar

{ZOO[NAME].description}. Part of the mmaccel micro-model zoo, trained from scratch, offline, by mmaccel's own script.
It exists so that image/video speculative decoding (SJD, LANTERN: `mmaccel.speculative.sjd`, `.lantern`) has a real
autoregressive image model to accelerate and a quality metric that can fail. It draws nothing else.

- Architecture: `LlamaForCausalLM`: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers,
  {cfg['num_attention_heads']} query heads / {cfg['num_key_value_heads']} KV heads (GQA), intermediate
  {cfg['intermediate_size']}, RoPE base {cfg['rope_theta']}, tied embeddings; word-level vocabulary of 71 tokens
  (16 palette colours, 5 specials, 16 row tokens, 34 words).
- Parameters: {summary['parameters']:,}; weights {weights.stat().st_size / 1e6 if weights.exists() else 0:.1f} MB
  (safetensors, fp32).
- Pictures: images are 16 x 16 pixels, clips 8 frames of 8 x 8 (frame after frame), one token per pixel in raster
  order, 16 colours (`mmaccel.data.palette.PALETTE16`); each row starts with a row token `<r00>`..`<r15>` (its row
  within the image or frame), so an image is 16 x 17 = 272 tokens and a clip 8 x 8 x 9 = 576. 32 x 32 images
  (1,024+ tokens) would not train on 2 CPU cores within the 45-minute budget.
- Command: `{summary['command']}` (the trainer is `mmaccel.zoo.train.micro_ar.train`, named by the zoo entry's
  `trainer`); this run was started as `{summary.get('invocation', summary['command'])}`, which runs the same
  function.
- Hardware: {summary['device']} ({summary['hardware']}), {summary['threads']} threads; Python {summary['python']},
  torch {summary['torch']}. The 2 cores were shared with another training job and other helpers' tests during the
  run: throughput per logging window ranged from {min(speeds):,.0f} to {max(speeds):,.0f} tokens/s, so on idle cores
  the same steps would take about {summary['tokens'] / max(speeds) / 60:.0f} min (tokens / best window's rate).
- Steps: {summary['steps']}; tokens seen: {summary['tokens']:,}; wall time: {summary['wall_time_s'] / 60:.1f} min
  (+ {summary['eval_seconds']:.0f} s held-out evaluation).
- Final training loss: {summary['final_loss']:.4f} (cross-entropy on the picture's tokens and `</s>`).

## Data
Generated at training time by `mmaccel.data.palette.make_palette_sample` on train-split seeds
(`mmaccel.data.splits`): images with one or two shapes (circle, square, triangle; 12 object colours) at named cells
of a 3 x 3 grid on one of 4 backgrounds ("red circle at top-left and blue square at center on white"); clips of one
shape crossing the frame along a lane ("red square at top moving right on black"). The picture is a deterministic
function of the prompt (`mmaccel.data.palette.render_prompt`).

## Recipe
AdamW lr {r['lr']}, betas {tuple(r['betas'])}, weight decay {r['weight_decay']}, {r['warmup_steps']} warm-up steps then
cosine decay to {r['min_lr_ratio']}x over {r['steps']} steps, gradient clip {r['grad_clip']}, seed {r['seed']}. One
step in {r['video_every']} is a batch of {r['video_batch']} clips, the others batches of {r['image_batch']} images.
Loss on the picture's tokens (pixels and row tokens) and `</s>` only, weighted {r.get('event_weight', 1.0)} on
"event" pixels (a pixel that differs from the one above it, or on a first row from the one to its left:
`mmaccel.zoo.train.micro_ar.event_pixels`) and 1 elsewhere; the reported loss is that weighted mean.

## Training curve
| step | loss | teacher-forced token accuracy | tokens/s | minutes |
|---|---|---|---|---|
{chr(10).join(rows)}

## Quality (held-out test prompts, greedy `generate`)
Palette accuracy = fraction of pixels whose palette index equals the prompt's rendered target
(`mmaccel.data.palette.palette_accuracy`); exact = pictures with every pixel right; background only = the accuracy
of a picture painted in the background colour alone (what a model that never draws a shape gets).

| kind | prompts | palette accuracy | exact | background only |
|---|---|---|---|---|
{qual}
"""
    if ZOO[NAME].notes:
        text += "\n## How the recipe was found\n" + ZOO[NAME].notes + "\n"
    text += _speculative_section()
    path = out / "README.md"
    path.write_text(text)
    return path


BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "speculative" / "sjd_micro_ar.json"


def _speculative_section() -> str:
    """The card's SJD / LANTERN table from ``benchmarks/sjd_micro_ar.py``'s JSON ('' before it has run)."""
    if not BENCHMARK.exists():
        return ""
    bench = json.loads(BENCHMARK.read_text())
    cfg = bench["config"]
    lines = [
        "\n## Speculative Jacobi decoding on this model (`benchmarks/sjd_micro_ar.py`)",
        (f"{cfg['images']} test images and {cfg['clips']} test clips, one prompt at a time, CPU, {cfg['threads']} "
         f"thread(s); load average {cfg['load_avg_start'][0]:.1f} at the start. Forwards = target forward passes per "
         "picture (prefill included); ratio = AR forwards / method forwards; window = draft tokens per forward. SJD "
         "is lossless (greedy: token-identical to AR, tolerance 0); LANTERN is lossy. Sampled runs draw independent "
         "samples, so their accuracy differs from AR's by chance: the tolerance there is the larger of 1 point and two "
         "standard errors of the difference.\n"),
        "| setting | method | forwards | ratio vs AR | palette accuracy | vs AR (points) | within tolerance |",
        "|---|---|---|---|---|---|---|",
    ]
    for tag, rows in bench["results"].items():
        for label, r in rows.items():
            lines.append(f"| {tag} | `{label}` | {r['target_forwards_mean']:.1f} | {r['forward_ratio_vs_ar']:.2f} | "
                         f"{100 * r['palette_accuracy']:.2f}% | {100 * r['palette_accuracy_delta_vs_ar']:+.2f} "
                         f"(tol. {100 * r['quality_tolerance']:.2f}) | {'yes' if r['within_tolerance'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m mmaccel.zoo.train.micro_ar [--threads N] [--max-steps N] [--out DIR] [--device D]``."""
    parser = argparse.ArgumentParser(description="train micro-ar (what `mmaccel zoo train micro-ar` runs)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    invocation = "python -m mmaccel.zoo.train.micro_ar " + " ".join(argv if argv is not None else sys.argv[1:])
    summary = train(args.out, device=args.device, threads=args.threads, max_steps=args.max_steps,
                    invocation=invocation.strip())
    logger.info("trained %s: %d steps in %.1f min; quality %s", NAME, summary["steps"], summary["wall_time_s"] / 60,
                summary["quality"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
