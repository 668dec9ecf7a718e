"""Train a zoo model from scratch on generated needle documents (``mmaccel zoo train NAME``).

The corpus is long documents of real prose (standard-library docstrings, harvested at training time) with 1..N
planted key-value facts and a question about one of them at the end, so that retrieval is learned. Documents follow
exactly the token layout of :func:`mmaccel.data.haystack.make_niah_sample`, so NIAH measures the trained skill.
"""
from __future__ import annotations

import json
import logging
import platform
import random
import time
from pathlib import Path

import torch

from ...data.haystack import HaystackTokens, random_needles, stdlib_paragraphs
from ...models.zoo import ZOO, Recipe, zoo_path
from .schedule import warmup_cosine

logger = logging.getLogger(__name__)


class NeedleDocuments:
    """Sampler of fixed-length training documents with planted facts.

    Parameters
    ----------
    tokenizer : a Hugging Face tokenizer with BOS and EOS
    rng : random.Random
    max_needles : int
        Each document holds 1..max_needles facts with distinct keys; one is asked.
    answer_weight : float
        Loss weight of the answer tokens.
    """

    def __init__(self, tokenizer, rng: random.Random, max_needles: int = 3, answer_weight: float = 2.0):
        self.tok = tokenizer
        self.rng = rng
        self.max_needles = max_needles
        self.answer_weight = answer_weight
        self.hay = HaystackTokens(tokenizer, " ".join(stdlib_paragraphs("train")))

    def sample(self, n: int) -> tuple[list[int], list[float]]:
        """One document of exactly ``n`` tokens and its per-token loss weights (weights index the *target* token)."""
        tok = self.tok
        k = self.rng.randint(1, self.max_needles)
        while True:
            needles = random_needles(self.rng, k)
            asked = self.rng.choice(needles)
            needle_ids = [tok.encode(" " + nd.text(), add_special_tokens=False) for nd in needles]
            q_ids = tok.encode("\n" + asked.question(), add_special_tokens=False)
            a_ids = tok.encode(" " + asked.value, add_special_tokens=False) + [tok.eos_token_id]
            fixed = 1 + sum(map(len, needle_ids)) + len(q_ids) + len(a_ids)
            if n - fixed >= 8 or k == 1:
                break
            k -= 1
        if n < fixed:
            raise ValueError(f"a {n}-token document cannot hold a needle, question and answer ({fixed} tokens)")
        n_body = n - fixed
        body = self.hay.span(n_body, self.rng) if n_body else []
        cuts = sorted(self.hay.boundary(body, self.rng.randint(0, n_body)) for _ in needle_ids)
        ids = [tok.bos_token_id]
        prev = 0
        for cut, nid in zip(cuts, needle_ids):
            ids += body[prev:cut] + nid
            prev = cut
        ids += body[prev:] + q_ids
        weights = [1.0] * len(ids) + [self.answer_weight] * len(a_ids)
        ids += a_ids
        return ids, weights


def _lr_at(step: int, recipe: Recipe) -> float:
    """The recipe's learning rate at ``step`` (:func:`~mmaccel.zoo.train.schedule.warmup_cosine`)."""
    return warmup_cosine(step, recipe.total_steps, recipe.lr, recipe.warmup_steps, recipe.min_lr_ratio)


def weighted_ce_step(model, opt, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, lr: float,
                     grad_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimiser step on the weighted mean token cross-entropy (the trainers of the micro-models).

    Parameters
    ----------
    model : torch.nn.Module
        Its parameters are clipped to ``grad_clip`` (global L2 norm) before the step.
    opt : torch.optim.Optimizer
        Every parameter group gets learning rate ``lr``.
    logits : torch.Tensor
        [B, T, V] float logits.
    labels : torch.LongTensor
        [B, T] target ids.
    weights : torch.Tensor
        [B, T] per-token loss weights (e.g. 1 for text, more for needle answers or event pixels).

    Returns
    -------
    ce, loss : torch.Tensor
        [B, T] per-token cross-entropy (still attached to the graph: read it under ``torch.no_grad``) and the scalar
        weighted mean that was minimised.
    """
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    loss = (ce * weights).sum() / weights.sum()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return ce, loss


def build_tokenizer(name: str):
    """The tokenizer for zoo model ``name``: trained on the docstring prose, or reused from ``tokenizer_from``."""
    from transformers import AutoTokenizer

    from ...models.tokenizer import train_bpe_tokenizer

    entry = ZOO[name]
    if entry.tokenizer_from:
        src = zoo_path(entry.tokenizer_from)
        if not (src / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"{name} shares the tokenizer of {entry.tokenizer_from}, which is not trained yet: "
                f"run `mmaccel zoo train {entry.tokenizer_from}` first"
            )
        return AutoTokenizer.from_pretrained(src)
    return train_bpe_tokenizer(stdlib_paragraphs("train"), vocab_size=entry.vocab_size)


def train(
    name: str,
    out_dir: str | Path | None = None,
    *,
    device: str = "cpu",
    threads: int | None = None,
    max_steps: int | None = None,
    log_every: int = 50,
    recipe: Recipe | None = None,
) -> dict:
    """Train zoo model ``name`` from scratch and save it as a HF checkpoint with a training log.

    Parameters
    ----------
    name : str
        A zoo name (``micro-lm``, ``micro-draft``).
    out_dir : path, optional
        Where to write; default ``assets/models/NAME``.
    device : str
        ``"cpu"`` reproduces the committed models; ``"cuda"`` trains the same recipe faster.
    threads : int, optional
        ``torch.set_num_threads`` for CPU training.
    max_steps : int, optional
        Stop early (for smoke tests); the curriculum is truncated.
    log_every : int
        Log and record metrics every this many steps.
    recipe : Recipe, optional
        Train with this recipe instead of the zoo entry's (for recipe experiments; the committed models use the
        zoo entry's recipe).

    Returns
    -------
    dict
        Training summary: steps, wall_time_s, tokens, final losses, hardware; also written to ``train_log.json``.

    Raises
    ------
    ValueError
        For an unknown zoo name.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; the zoo has: {', '.join(ZOO)}")
    entry = ZOO[name]
    recipe = recipe if recipe is not None else entry.recipe
    out = Path(out_dir) if out_dir is not None else zoo_path(name)
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)

    tokenizer = build_tokenizer(name)
    cfg_kwargs = dict(entry.model_config)
    config = AutoConfig.for_model(cfg_kwargs.pop("model_type"), **cfg_kwargs)
    config.vocab_size = len(tokenizer)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("training %s: %.2fM parameters on %s", name, n_params / 1e6, device)

    decay = [p for n_, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n_, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=recipe.betas,
    )
    docs = NeedleDocuments(tokenizer, rng, recipe.max_needles, recipe.answer_weight)
    history: list[dict] = []
    step, tokens, t0 = 0, 0, time.perf_counter()
    total = recipe.total_steps if max_steps is None else min(max_steps, recipe.total_steps)
    window = {"loss": 0.0, "answer_loss": 0.0, "answer_acc": 0.0, "n": 0, "tokens": 0, "t": time.perf_counter()}
    model.train()
    for phase_idx, phase in enumerate(recipe.phases):
        docs.max_needles = phase.max_needles or recipe.max_needles
        for _ in range(phase.steps):
            if step >= total:
                break
            n = rng.randint(phase.min_len, phase.max_len)
            batch = [docs.sample(n) for _ in range(phase.batch_size)]
            ids = torch.tensor([b[0] for b in batch], device=device)
            w = torch.tensor([b[1] for b in batch], device=device)[:, 1:]
            logits = model(input_ids=ids).logits[:, :-1].float()
            ce, loss = weighted_ce_step(model, opt, logits, ids[:, 1:], w, _lr_at(step, recipe), recipe.grad_clip)
            with torch.no_grad():
                ans = w > 1.0
                ans_loss = ce[ans].mean().item() if ans.any() else float("nan")
                hit = (logits.argmax(-1) == ids[:, 1:]) | ~ans
                acc = hit.all(dim=1).float().mean().item()
            step += 1
            tokens += ids.numel()
            window["loss"] += loss.item()
            window["answer_loss"] += ans_loss
            window["answer_acc"] += acc
            window["n"] += 1
            window["tokens"] += ids.numel()
            if step % log_every == 0 or step == total:
                now = time.perf_counter()
                row = {
                    "step": step,
                    "phase": phase_idx,
                    "doc_len": [phase.min_len, phase.max_len],
                    "max_needles": docs.max_needles,
                    "loss": window["loss"] / window["n"],
                    "answer_loss": window["answer_loss"] / window["n"],
                    "answer_acc": window["answer_acc"] / window["n"],
                    "lr": _lr_at(step - 1, recipe),
                    "tokens_per_s": window["tokens"] / (now - window["t"]),
                    "elapsed_s": now - t0,
                }
                history.append(row)
                logger.info(
                    "step %d/%d phase %d loss %.3f answer_loss %.3f answer_acc %.2f %.0f tok/s %.0fs",
                    step, total, phase_idx, row["loss"], row["answer_loss"], row["answer_acc"],
                    row["tokens_per_s"], row["elapsed_s"],
                )
                window = {"loss": 0.0, "answer_loss": 0.0, "answer_acc": 0.0, "n": 0, "tokens": 0, "t": now}
        _save(model, tokenizer, out)  # a usable checkpoint after every phase
    wall = time.perf_counter() - t0
    summary = {
        "name": name,
        "command": f"mmaccel zoo train {name}",
        "parameters": n_params,
        "steps": step,
        "tokens": tokens,
        "wall_time_s": wall,
        "device": device,
        "threads": torch.get_num_threads(),
        "hardware": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "final_loss": history[-1]["loss"] if history else None,
        "final_answer_loss": history[-1]["answer_loss"] if history else None,
        "recipe": _recipe_dict(recipe),
        "history": history,
    }
    (out / "train_log.json").write_text(json.dumps(summary, indent=1))
    return summary


def _recipe_dict(recipe: Recipe) -> dict:
    from dataclasses import asdict

    return asdict(recipe)


def _save(model, tokenizer, out: Path) -> None:
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
