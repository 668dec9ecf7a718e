"""Train an EAGLE draft head for a target by self-distillation: ``mmaccel zoo train smollm2-135m-eagle``.

1. **Data.** Chat prompts made from templates (:func:`training_prompts`: stories, explanations, advice, ... -- none of
   them a Spec-Bench prompt of :mod:`mmaccel.eval.specbench`) and copy tasks over the *train* split of the stdlib
   paragraphs (Spec-Bench's copy prompts use the held-out split). The target answers them greedily, in batches; a
   forward hook on its decoder records its last hidden state (the features) at every position, so no second pass is
   needed. Greedy answers make the next token of every answer position the target's own argmax, the token a draft
   must guess to be accepted.
2. **Vocabulary.** The ``vocab`` most frequent tokens of the answers and prompts (FR-Spec).
3. **Head.** Started from the target's last decoder layer; trained with training-time test (EAGLE-3): ``unroll``
   steps, step ``s`` reading the features predicted at step ``s - 1`` and attending to the true columns before them,
   exactly as drafting does. Loss per step: cross-entropy of the greedy next token over the sub-vocabulary (answer
   positions) + a smooth-L1 feature regression (EAGLE-1; every position), step ``s`` weighted ``0.8^(s-1)``.
4. **Evaluation** on held-out answers: per-step accuracy given all earlier steps right, and the mean accepted length a
   chain of ``k`` drafts would get (``1 + sum_s prod_{t<=s} acc_t``, measured per start position).

References
----------
Li, Wei, Zhang, Zhang, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", 2024, arXiv 2401.15077.
Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test", 2025,
arXiv 2503.01840.
Cai et al., "Medusa", 2024, arXiv 2401.10774 (self-distillation: train the draft on the target's own answers).
Zhao et al., "FR-Spec", 2025, arXiv 2502.14856.
"""
from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from ...speculative.eagle import EagleHead, EagleHeadConfig, _decoder, expected_head_bytes, head_parameters, save_head
from .schedule import warmup_cosine

logger = logging.getLogger(__name__)

TARGET = "smollm2-135m"
NAME = "smollm2-135m-eagle"

_CHARACTERS = ("a retired sailor", "a young baker", "a lonely robot", "a museum guard", "a girl who collects stones",
               "an old clockmaker", "a street musician", "a farmer", "a nervous astronaut", "a school librarian",
               "a fox", "a night-shift nurse", "a shy dragon", "a bus driver", "two rival chefs", "a beekeeper")
_EVENTS = ("finds a key that opens nothing", "loses their voice before a big day", "meets a stranger on a train",
           "discovers a garden behind a wall", "has to cross a frozen river", "receives a letter from the future",
           "wins a prize they did not enter for", "gets lost in a snowstorm", "teaches a child to read",
           "finds an injured bird", "builds a boat from old doors", "hears music coming from the attic")
_THINGS = ("a compiler", "a bicycle gear", "a refrigerator", "photosynthesis", "a vaccine", "the stock market",
           "a search engine", "a rainbow", "an electric motor", "recycling", "a solar panel", "the heart",
           "a binary search", "a database index", "encryption", "a volcano", "the internet", "a camera lens",
           "an airplane wing", "inflation", "a battery", "garbage collection in Python", "a neural network",
           "tides", "a thermostat", "version control with git", "a microwave oven", "the immune system")
_AUDIENCES = ("a ten-year-old", "a beginner", "someone who has never studied science", "a curious grandparent",
              "a new employee")
_ACTIVITIES = ("learning a new language", "staying healthy while working from home", "managing money",
               "studying for exams", "running a small team", "writing clear emails", "keeping a garden",
               "learning to play the guitar", "cooking at home", "getting better sleep", "reading more books",
               "saving energy at home", "debugging a program", "public speaking")
_PLACES = ("a quiet library", "a busy train station", "a mountain village", "a beach", "a night market",
           "an old castle", "a small bakery", "a football stadium", "a forest", "a harbour", "a hospital corridor",
           "a school playground")
_TIMES = ("at dawn", "during a thunderstorm", "on a hot summer afternoon", "late at night", "in the first snow",
          "on a foggy morning", "during a festival")
_PEOPLE = ("a new university student", "someone moving to a new city", "a first-time manager",
           "a person starting to exercise", "a parent of a teenager", "someone learning to drive",
           "a person who wants to change careers", "a young programmer")
_WHY = ("leaves change colour in autumn", "ice float on water", "the moon have phases", "bread rise",
        "we get hiccups", "the sea taste salty", "metal feel cold to the touch", "cats purr", "thunder follow lightning",
        "a spoon look bent in a glass of water", "people yawn", "planes leave white trails", "onions make us cry",
        "the ocean have waves", "stars twinkle")
_EMAILS = ("asking a teacher for an extension on an assignment", "thanking a neighbour for their help",
           "inviting friends to a birthday party", "asking a landlord to fix the heating",
           "telling the team about a new meeting time", "congratulating a colleague on a promotion",
           "apologising for missing a meeting", "requesting a day off next week")
_PAIRS = (("cats", "dogs", "a family pet"), ("tea", "coffee", "a morning drink"), ("e-books", "paper books", "reading"),
          ("cycling", "walking", "a daily commute"), ("Python", "JavaScript", "a first programming language"),
          ("renting", "buying", "a first home"), ("the city", "the countryside", "raising children"),
          ("summer", "winter", "a holiday"), ("a laptop", "a desktop", "a student"))
_TASKS = ("make a good cup of tea", "start a vegetable garden", "prepare for a long hike", "write a cover letter",
          "learn to touch type", "organise a small wedding", "fix a flat bicycle tyre", "plan a weekly budget",
          "train a puppy", "make friends in a new city", "bake bread at home", "keep a journal")
_POEMS = ("the sea", "an old tree", "the city at night", "the first day of spring", "a lost umbrella", "the moon",
          "a cup of coffee", "friendship", "a train journey", "the wind")


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct chat requests from templates, shuffled with ``seed``.

    None of them is one of Spec-Bench's evaluation prompts (:data:`mmaccel.data.prompts.FREE_PROMPTS`).

    Raises
    ------
    ValueError
        If the templates cannot make ``n`` distinct prompts.
    """
    from ...data.prompts import FREE_PROMPTS

    pool = []
    pool += [f"Write a short story about {c} who {e}." for c in _CHARACTERS for e in _EVENTS]
    pool += [f"Tell me a bedtime story about {c} who {e}." for c in _CHARACTERS for e in _EVENTS]
    pool += [f"Write a fairy tale about {c} who {e}." for c in _CHARACTERS[::2] for e in _EVENTS]
    pool += [f"Summarise how {t} works in three sentences." for t in _THINGS]
    pool += [f"Give me five tips for {a}." for a in _ACTIVITIES]
    pool += [f"Explain the difference between {a} and {b}." for a, b, _ in _PAIRS]
    pool += [f"Explain how {t} works to {a}." for t in _THINGS for a in _AUDIENCES]
    pool += [f"What is {t}, and what is it used for?" for t in _THINGS]
    pool += [f"Write a paragraph describing {p} {t}." for p in _PLACES for t in _TIMES[::2]]
    pool += [f"What are the most common mistakes people make when {a}?" for a in _ACTIVITIES]
    pool += [f"What are three good habits for {a}? Explain each briefly." for a in _ACTIVITIES]
    pool += [f"Describe {p} {t}." for p in _PLACES for t in _TIMES]
    pool += [f"Give some advice to {p}." for p in _PEOPLE]
    pool += [f"Why does {w}?" for w in _WHY]
    pool += [f"Write a friendly email {e}." for e in _EMAILS]
    pool += [f"Compare {a} and {b} as {c}." for a, b, c in _PAIRS]
    pool += [f"How do I {t}? Give step-by-step instructions." for t in _TASKS]
    pool += [f"Write a short poem about {p}." for p in _POEMS]
    # second families (2026-11-27): more distinct requests, so a longer data phase does not repeat prompts
    pool += [f"Write a diary entry by {c} who {e}." for c in _CHARACTERS for e in _EVENTS[::2]]
    pool += [f"Write a short news report about {c} who {e}." for c in _CHARACTERS[1::2] for e in _EVENTS]
    pool += [f"Describe {t} to {a} using an everyday comparison." for t in _THINGS for a in _AUDIENCES[::2]]
    pool += [f"Write a short scene set in {p} {t}." for p in _PLACES for t in _TIMES]
    pool += [f"What should {p} know about {a}?" for p in _PEOPLE for a in _ACTIVITIES]
    pool += [f"Explain, step by step, why {w}." for w in _WHY]
    pool += [f"List the main advantages and disadvantages of {t}." for t in _THINGS]
    pool += [f"Write a short speech for {p} about {a}." for p in _PEOPLE[::2] for a in _ACTIVITIES]
    pool = sorted(set(pool) - set(FREE_PROMPTS))
    if n > len(pool):
        raise ValueError(f"the templates make {len(pool)} distinct prompts; asked for {n}")
    random.Random(seed).shuffle(pool)
    return pool[:n]


def copy_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` copy-heavy ``(user, answer lead)`` pairs over the *train* split of the stdlib paragraphs, Spec-Bench's
    copy tasks in turn (:data:`mmaccel.data.prompts.COPY_TASKS`)."""
    from ...data.haystack import stdlib_paragraphs
    from ...data.prompts import COPY_TASKS, add_typos

    rng = random.Random(seed)
    paras = [p for p in stdlib_paragraphs("train") if 300 <= len(p) <= 900]
    out = []
    for i, para in enumerate(rng.sample(paras, min(n, len(paras)))):
        task, instruction, lead = COPY_TASKS[i % len(COPY_TASKS)]
        shown = add_typos(para, rng) if task == "edit" else para
        out.append((f"{instruction}\n\n{shown}", f"{lead} {' '.join(para.split()[:3])}"))
    return out


@torch.inference_mode()
def generate_examples(model, tokenizer, requests: list[tuple[str, str]], *, max_new_tokens: int = 96,
                      batch_size: int = 32, deadline: float | None = None,
                      temperature: float | None = None) -> list[dict]:
    """The target answers each request greedily (in its chat template when it has one; left-padded batches); its
    features are caught by a forward hook on its decoder.

    Parameters
    ----------
    requests : list of (user text, answer lead)
    deadline : float, optional
        ``time.perf_counter()`` value after which no new batch starts.
    temperature : float, optional
        Sample the answers at this temperature instead of answering greedily (more distinct answers per prompt).
        A sampled token is not the target's argmax, so such an example also stores ``greedy`` [n]: the argmax of
        the target's LM head over its features at every position (as :func:`text_examples` does).

    Returns
    -------
    list of dict
        Per request: ``tokens`` [n] int64 (prompt + answer up to and including EOS), ``features`` [n, H] float32 (the
        target's last hidden state after its final norm), ``answer_start`` (index of the first answer token).
    """
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    lm_head = model.get_output_embeddings()
    caught = []
    handle = _decoder(model).register_forward_hook(
        lambda m, a, out: caught.append((out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state).float()))
    examples = []
    try:
        for b0 in range(0, len(requests), batch_size):
            if deadline is not None and time.perf_counter() > deadline:
                logger.info("data deadline reached after %d requests", b0)
                break
            batch = requests[b0:b0 + batch_size]
            if getattr(tokenizer, "chat_template", None):
                texts = [tokenizer.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True,
                                                       tokenize=False) + (lead or "") for u, lead in batch]
            else:  # a base model (micro-lm): the layout of Spec-Bench's prompts without a template
                texts = [f"{u}\n\n{lead}" if lead else f"{u}\n" for u, lead in batch]
            enc = tokenizer(texts, return_tensors="pt", padding=True,
                            add_special_tokens=not getattr(tokenizer, "chat_template", None)).to(model.device)
            caught.clear()
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature \
                else {"do_sample": False}
            out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling)
            L = enc["input_ids"].shape[1]
            feats = torch.cat(caught, dim=1)  # [B, L + new - 1, H]: prompt, then one column per decoding step
            for i in range(len(batch)):
                n_pad = int((enc["attention_mask"][i] == 0).sum())
                toks = out[i, n_pad:].tolist()
                end = len(toks)
                for j in range(L - n_pad, len(toks)):
                    if toks[j] in eos:
                        end = j + 1
                        break
                f = feats[i, n_pad:n_pad + end]
                end = min(end, f.shape[0])  # the last token's feature is never computed (generation stopped there)
                ex = {"tokens": torch.tensor(toks[:end]), "features": f[:end].cpu().clone(), "answer_start": L - n_pad}
                if temperature:  # inference mode already (the decorator)
                    ex["greedy"] = lm_head(f[:end].to(lm_head.weight.dtype)).argmax(-1).cpu()
                examples.append(ex)
            logger.info("generated %d / %d", len(examples), len(requests))
    finally:
        handle.remove()
    return examples


def choose_vocab(examples: list[dict], size: int, vocab_size: int, always=()) -> list[int]:
    """FR-Spec: the ``size`` most frequent token ids of ``examples`` (answers counted twice), plus ``always``
    (e.g. EOS), most frequent first; ids never seen fill up by id order."""
    counts = Counter()
    for ex in examples:
        t = ex["tokens"].tolist()
        counts.update(t)
        counts.update(t[ex["answer_start"]:])
    ids = list(dict.fromkeys([*always, *(tok for tok, _ in counts.most_common())]))[:size]
    if len(ids) < size:
        seen = set(ids)
        ids += [i for i in range(vocab_size) if i not in seen][: size - len(ids)]
    return ids


def init_from_layer(head: EagleHead, target, layer: int = -1) -> None:
    """Copy the target's decoder layer ``layer`` and final norm into the head (same shapes); ``fc`` starts as
    ``[small random | identity]`` so the first input is about the feature itself."""
    src = _decoder(target).layers[layer]
    pairs = {"q_proj": src.self_attn.q_proj, "k_proj": src.self_attn.k_proj, "v_proj": src.self_attn.v_proj,
             "o_proj": src.self_attn.o_proj, "gate_proj": src.mlp.gate_proj, "up_proj": src.mlp.up_proj,
             "down_proj": src.mlp.down_proj, "input_norm": src.input_layernorm,
             "post_norm": src.post_attention_layernorm, "norm": _decoder(target).norm}
    with torch.no_grad():
        for name, mod in pairs.items():
            getattr(head, name).weight.copy_(mod.weight.float())
        H = head.config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, :H].normal_(0.0, 0.02)
        head.fc.weight[:, H:].copy_(torch.eye(H))


def greedy_next(example: dict) -> torch.Tensor:
    """[n] the target's greedy next token after each position of an example, ``-1`` where unknown: stored for
    teacher-forced text (:func:`text_examples`); for a greedy answer, the answer's own next token (prompt positions
    unknown)."""
    if "greedy" in example:
        return example["greedy"]
    toks = example["tokens"]
    out = torch.full_like(toks, -1)
    a = max(example["answer_start"] - 1, 0)
    out[a:-1] = toks[a + 1:]
    return out


def _batch(examples, vocab_index, max_len, device=None):
    """Right-padded batch for head column ``i`` (input ``(f_i, t_{i+1})``, target ``f_{i+1}``): tokens [B, n],
    features [B, n, H], labels [B, n] (sub-vocabulary index of the target's greedy token after ``t_{i+1}``, i.e.
    :func:`greedy_next` at ``i + 1``, or -100 where unknown or outside the sub-vocabulary), valid [B, n]; built on
    the CPU (where the examples are kept), then moved to ``device``."""
    n = min(max(len(ex["tokens"]) for ex in examples), max_len)
    B, H = len(examples), examples[0]["features"].shape[1]
    feats = torch.zeros(B, n, H)
    toks = torch.zeros(B, n, dtype=torch.long)
    greedy = torch.full((B, n), -1, dtype=torch.long)
    valid = torch.zeros(B, n, dtype=torch.bool)
    for b, ex in enumerate(examples):
        m = min(len(ex["tokens"]), n)
        feats[b, :m] = ex["features"][:m]
        toks[b, :m] = ex["tokens"][:m]
        greedy[b, :m] = greedy_next(ex)[:m]
        valid[b, : m - 1] = True
    labels = torch.full_like(toks, -100)
    known = greedy[:, 1:] >= 0
    labels[:, :-1] = torch.where(known, vocab_index[greedy[:, 1:].clamp_min(0)], torch.full_like(greedy[:, 1:], -100))
    labels[~valid] = -100
    if device is not None:
        return toks.to(device), feats.to(device), labels.to(device), valid.to(device)
    return toks, feats, labels, valid


@torch.inference_mode()
def text_examples(model, tokenizer, *, minutes: float, window: int = 256, batch_size: int = 16,
                  seed: int = 0) -> list[dict]:
    """Teacher-forced windows of the *train* split of the stdlib paragraphs: the target's features at every position
    and its greedy next token there (``greedy``, from its LM head), ``window`` tokens each, for ``minutes`` of
    wall-clock time. Three to four times cheaper per token than generating answers, and the labels are still the
    target's own argmax (EAGLE trains on fixed text too)."""
    from ...data.haystack import stdlib_paragraphs

    paras = list(stdlib_paragraphs("train"))
    random.Random(seed).shuffle(paras)
    ids = tokenizer("\n\n".join(paras[:4000]), add_special_tokens=False, return_tensors="pt").input_ids[0]
    windows = ids[: len(ids) // window * window].view(-1, window)
    lm = model.get_output_embeddings()
    deadline = time.perf_counter() + 60 * minutes
    out = []
    for b0 in range(0, windows.shape[0], batch_size):
        if time.perf_counter() > deadline:
            break
        chunk = windows[b0:b0 + batch_size].to(model.device)
        feats = _decoder(model)(input_ids=chunk).last_hidden_state
        greedy = lm(feats).argmax(-1)
        out += [{"tokens": chunk[i].cpu(), "features": feats[i].float().cpu(), "answer_start": 0,
                 "greedy": greedy[i].cpu()} for i in range(chunk.shape[0])]
    logger.info("text: %d windows of %d tokens", len(out), window)
    return out


def unrolled_loss(head: EagleHead, embed, lm_weight, toks, feats, labels, valid, *, steps: int, scale: float,
                  noise: float = 0.0, step_decay: float = 0.8):
    """The training loss over :meth:`EagleHead.unroll`'s ``steps`` drafting steps (training-time test, EAGLE-3,
    arXiv 2503.01840): per step, cross-entropy of the labelled next token over the sub-vocabulary plus a smooth-L1
    regression on the next feature (in units of ``scale``), weighted ``step_decay^(s-1)``.

    Parameters
    ----------
    toks, feats, labels, valid
        A batch from :func:`_batch`: [B, n], [B, n, H], [B, n], [B, n].
    noise : float
        Standard deviation of Gaussian noise on the step-1 input features, in units of ``scale`` (EAGLE-1's feature
        noise).

    Returns
    -------
    loss : torch.Tensor
        Scalar.
    stats : list of dict
        Per step: ``ce``, ``reg``, ``acc`` (top-1 over labelled columns), ``acc_chain`` (top-1 right at this and all
        earlier steps of the same draft chain), ``n`` (labelled columns).
    """
    B, n, _ = feats.shape
    m = n - 1
    emb = embed(toks[:, 1:]).float()  # t_{i+1} for columns 0..m-1
    f_in = feats[:, :m]
    if noise:
        f_in = f_in + noise * scale * torch.randn_like(f_in)
    target, lab, ok = feats[:, 1:], labels[:, :m], valid[:, :m]
    dev = feats.device
    idx = torch.arange(m, device=dev)
    chain = torch.ones(B, m, dtype=torch.bool, device=dev)
    loss = feats.new_zeros(())
    stats = []
    for s, out in enumerate(head.unroll(f_in, emb, steps), start=1):
        live = ok & (idx[None, :] >= s - 1)  # column i has a step-s chain when i >= s - 1
        reg = F.smooth_l1_loss(out[live] / scale, target[live] / scale) if live.any() else out.sum() * 0
        lab_s = torch.where(live, lab, torch.full_like(lab, -100))
        sel = lab_s >= 0
        right = torch.zeros(B, m, dtype=torch.bool, device=dev)
        if sel.any():
            logits = head.logits(out[sel], lm_weight)
            ce = F.cross_entropy(logits, lab_s[sel])
            right[sel] = logits.argmax(-1) == lab_s[sel]
        else:
            ce = out.sum() * 0
        # column i at step s continues the chain that column i - 1 carried at step s - 1
        before = chain if s == 1 else torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=dev), chain[:, :-1]], dim=1)
        chain = before & right
        loss = loss + step_decay ** (s - 1) * (ce + reg)
        n_sel = int(sel.sum())
        stats.append({"ce": float(ce.detach()), "reg": float(reg.detach()),
                      "acc": float(right[sel].float().mean()) if n_sel else None,
                      "acc_chain": float(chain[sel].float().mean()) if n_sel else None, "n": n_sel})
    return loss, stats


@torch.no_grad()
def evaluate(head, embed, lm_weight, examples, vocab_index, *, steps: int, scale: float, max_len: int = 512,
             batch: int = 8) -> dict:
    """Held-out draft quality: per step, top-1 accuracy and the chain accuracy (this and all earlier steps right),
    pooled over answer positions; ``mean_accepted_length`` = 1 + sum of chain accuracies (a chain of ``steps``
    drafts, greedy verification)."""
    head.eval()
    totals = [[0, 0, 0] for _ in range(steps)]  # right, chain right, n
    for b0 in range(0, len(examples), batch):
        toks, feats, labels, valid = _batch(examples[b0:b0 + batch], vocab_index, max_len, device=lm_weight.device)
        _, st = unrolled_loss(head, embed, lm_weight, toks, feats, labels, valid, steps=steps, scale=scale)
        for s, row in enumerate(st):
            if row["n"]:
                totals[s][0] += row["acc"] * row["n"]
                totals[s][1] += row["acc_chain"] * row["n"]
                totals[s][2] += row["n"]
    acc = [t[0] / t[2] if t[2] else None for t in totals]
    chain = [t[1] / t[2] if t[2] else None for t in totals]
    head.train()
    return {"acc": acc, "acc_chain": chain, "positions": totals[0][2],
            "mean_accepted_length": 1 + sum(c for c in chain if c is not None)}


def train(out_dir=None, *, device: str = "cpu", threads: int | None = None, target: str = TARGET,
          n_free: int = 1450, n_copy: int = 600, max_new_tokens: int = 96, gen_batch: int = 48,
          data_minutes: float = 25.0, train_minutes: float = 50.0, vocab: int = 8192, unroll: int = 3,
          lr: float = 1e-3, batch_size: int = 8, max_len: int = 384, noise: float = 0.05, holdout: float = 0.05,
          seed: int = 0, data_cache=None, init: str = "random", text_minutes: float = 8.0, text_cache=None,
          weight_decay: float = 0.0, eval_every: int = 150, n_sampled: int = 0, sample_minutes: float = 0.0,
          temperature: float = 0.8) -> dict:
    """Generate the data, train the head, evaluate it, write it with a card (see the module docstring).

    Parameters
    ----------
    out_dir : path, optional
        Default ``assets/models/smollm2-135m-eagle``.
    data_minutes, train_minutes : float
        Wall-clock budgets of the data and training phases, minutes (a phase stops at its budget).
    vocab : int
        Size of the FR-Spec sub-vocabulary.
    unroll : int
        Drafting steps trained at once (training-time test).
    data_cache : path, optional
        Where the generated data is saved, and read from when it exists (retraining without regenerating; the
        data's own generation time is kept in the summary).
    text_minutes : float
        Budget of the teacher-forced stdlib text (:func:`text_examples`), minutes; ``text_cache`` as ``data_cache``.
    eval_every : int
        Evaluate on the held-out answers every this many steps and keep the best head (early stopping).
    n_sampled, sample_minutes, temperature : int, float, float
        Also train on up to ``n_sampled`` answers sampled at ``temperature`` (labelled with the target's argmax),
        cycling over the requests of the *training* split, for at most ``sample_minutes``: more data than the
        templates' ~2,050 distinct requests give greedily. Default off; the committed head used
        ``n_sampled=4000, sample_minutes=30`` (its card has the call). Cheap on a GPU.
    init : {"last_layer", "random"}
        Start the head's layer from the target's last decoder layer, or from a random init.

    Returns
    -------
    dict
        The summary written to ``train_log.json``: recipe, data sizes, times (s), loss curve, held-out evaluation.

    Raises
    ------
    mmaccel.models.ModelLoadError
        If the target cannot be fetched.
    """
    from ...models import load
    from ...models.zoo import assets_dir

    if threads:
        torch.set_num_threads(int(threads))
    torch.manual_seed(seed)
    out = Path(out_dir) if out_dir else assets_dir() / NAME
    t_all = time.perf_counter()
    model, tok = load(target, device=device)
    model.eval()
    if data_cache is not None and Path(data_cache).is_file():
        saved = torch.load(data_cache, weights_only=True)
        examples, data_s = saved["examples"], float(saved["seconds"])
        logger.info("data: read %d examples from %s (made in %.0f s)", len(examples), data_cache, data_s)
    else:
        reqs = [(p, "") for p in training_prompts(n_free, seed)] + copy_prompts(n_copy, seed)
        random.Random(seed + 1).shuffle(reqs)
        t0 = time.perf_counter()
        examples = generate_examples(model, tok, reqs, max_new_tokens=max_new_tokens, batch_size=gen_batch,
                                     deadline=t0 + 60 * data_minutes)
        for ex, req in zip(examples, reqs):  # generate_examples answers the requests in order
            ex["request"] = list(req)
        data_s = time.perf_counter() - t0
        if data_cache is not None:
            torch.save({"examples": examples, "seconds": data_s}, data_cache)
    n_tokens = sum(len(e["tokens"]) for e in examples)
    n_answer = sum(len(e["tokens"]) - e["answer_start"] for e in examples)
    logger.info("data: %d examples, %d tokens (%d answer) in %.0f s", len(examples), n_tokens, n_answer, data_s)

    rng = random.Random(seed + 2)
    rng.shuffle(examples)
    n_eval = max(1, int(holdout * len(examples)))
    eval_set, train_set = examples[:n_eval], examples[n_eval:]
    text, text_s = [], 0.0
    if text_cache is not None and Path(text_cache).is_file():
        saved = torch.load(text_cache, weights_only=True)
        text, text_s = saved["examples"], float(saved["seconds"])
    elif text_minutes > 0:
        t0 = time.perf_counter()
        text = text_examples(model, tok, minutes=text_minutes, seed=seed)
        text_s = time.perf_counter() - t0
        if text_cache is not None:
            torch.save({"examples": text, "seconds": text_s}, text_cache)
    sampled, sampled_s = [], 0.0
    if n_sampled > 0:
        pool = [tuple(e["request"]) for e in train_set if "request" in e]
        if not pool:
            raise ValueError("n_sampled needs the requests of the training answers; this data_cache predates them: "
                             "regenerate it (give a new data_cache path)")
        reqs_s = [pool[i % len(pool)] for i in range(n_sampled)]
        t0 = time.perf_counter()
        sampled = generate_examples(model, tok, reqs_s, max_new_tokens=max_new_tokens, batch_size=gen_batch,
                                    deadline=t0 + 60 * sample_minutes, temperature=temperature)
        sampled_s = time.perf_counter() - t0
        logger.info("sampled: %d answers at temperature %.2f in %.0f s", len(sampled), temperature, sampled_s)
    train_set = train_set + sampled + text  # held-out greedy answers only in the evaluation
    V = int(model.config.vocab_size)
    eos = model.generation_config.eos_token_id
    vocab_ids = choose_vocab(train_set, vocab, V, always=eos if isinstance(eos, (list, tuple)) else [eos])
    vocab_index = torch.full((V,), -100, dtype=torch.long)
    vocab_index[torch.tensor(vocab_ids)] = torch.arange(len(vocab_ids))
    covered = sum(int((vocab_index[e["tokens"][e["answer_start"]:]] >= 0).sum()) for e in eval_set)
    coverage = covered / max(1, sum(len(e["tokens"]) - e["answer_start"] for e in eval_set))

    config = EagleHeadConfig.from_target(model, vocab_ids, target)
    head = EagleHead(config)
    if init == "last_layer":
        init_from_layer(head, model)
    elif init != "random":
        raise ValueError(f"init must be 'last_layer' or 'random', got {init!r}")
    embed = model.get_input_embeddings()
    for p in model.parameters():
        p.requires_grad_(False)
    head.to(model.device)
    lm_weight = model.get_output_embeddings().weight.detach()[torch.tensor(vocab_ids, device=model.device)]
    lm_weight = lm_weight.float().contiguous()
    scale = float(torch.cat([e["features"] for e in train_set[:64]]).std())

    before = evaluate(head, embed, lm_weight, eval_set, vocab_index, steps=unroll, scale=scale, max_len=max_len)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    head.train()
    t0 = time.perf_counter()
    budget = 60 * train_minutes
    curve, step, epoch = [], 0, 0
    evals, best = [], None
    # estimate the number of steps from the first ones (for the cosine schedule), then stop at the budget
    est_total = None
    order = list(range(len(train_set)))
    while time.perf_counter() - t0 < budget:
        rng.shuffle(order)
        # batches of similar length
        chunks = [order[i:i + 64 * batch_size] for i in range(0, len(order), 64 * batch_size)]
        batches = []
        for ch in chunks:
            ch = sorted(ch, key=lambda j: len(train_set[j]["tokens"]))
            batches += [ch[i:i + batch_size] for i in range(0, len(ch), batch_size)]
        rng.shuffle(batches)
        for idx in batches:
            if time.perf_counter() - t0 >= budget:
                break
            toks, feats, labels, valid = _batch([train_set[j] for j in idx], vocab_index, max_len,
                                                device=lm_weight.device)
            if est_total is None and step == 10:
                per = (time.perf_counter() - t0) / 10
                est_total = max(20, int(budget / per))
                logger.info("~%.2f s/step: about %d steps in %.0f min", per, est_total, train_minutes)
            lr_now = warmup_cosine(step, est_total or 10_000, lr, warmup=30)
            for g in opt.param_groups:
                g["lr"] = lr_now
            loss, st = unrolled_loss(head, embed, lm_weight, toks, feats, labels, valid, steps=unroll, scale=scale,
                                     noise=noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            if eval_every and step and step % eval_every == 0:
                score = evaluate(head, embed, lm_weight, eval_set, vocab_index, steps=unroll, scale=scale,
                                 max_len=max_len)["mean_accepted_length"]
                evals.append({"step": step, "mean_accepted_length": score})
                logger.info("held-out at step %d: mean accepted length %.3f", step, score)
                if best is None or score > best[0]:
                    best = (score, step, {k: v.detach().clone() for k, v in head.state_dict().items()})
            if step % 25 == 0:
                row = {"step": step, "epoch": epoch, "s": round(time.perf_counter() - t0, 1), "loss": float(loss),
                       "acc": [r["acc"] for r in st], "acc_chain": [r["acc_chain"] for r in st]}
                curve.append(row)
                logger.info("%s", row)
            step += 1
        epoch += 1
    train_s = time.perf_counter() - t0
    final = evaluate(head, embed, lm_weight, eval_set, vocab_index, steps=unroll, scale=scale,
                     max_len=max_len)["mean_accepted_length"]
    evals.append({"step": step, "mean_accepted_length": final})
    if best is not None and best[0] > final:
        head.load_state_dict(best[2])
        logger.info("keeping the head of step %d (%.3f > %.3f at the end)", best[1], best[0], final)
    kept_step = best[1] if best is not None and best[0] > final else step
    after = evaluate(head, embed, lm_weight, eval_set, vocab_index, steps=max(unroll, 5), scale=scale,
                     max_len=max_len)
    summary = {
        "name": NAME, "target": target, "format": config.format,
        "command": "mmaccel zoo train smollm2-135m-eagle",
        "recipe": {"n_free": n_free, "n_copy": n_copy, "max_new_tokens": max_new_tokens, "gen_batch": gen_batch,
                   "data_minutes": data_minutes, "train_minutes": train_minutes, "vocab": vocab, "unroll": unroll,
                   "lr": lr, "batch_size": batch_size, "max_len": max_len, "noise": noise, "seed": seed,
                   "text_minutes": text_minutes, "weight_decay": weight_decay, "eval_every": eval_every,
                   "n_sampled": n_sampled, "sample_minutes": sample_minutes, "temperature": temperature,
                   "init": ("random (PyTorch's default initialisation)" if init == "random" else
                            "the target's last decoder layer and final norm; fc = [N(0, 0.02) | identity]")},
        "data": {"examples": len(examples), "train_examples": len(train_set), "eval_examples": len(eval_set),
                 "tokens": n_tokens, "answer_tokens": n_answer, "seconds": round(data_s, 1),
                 "text_windows": len(text), "text_tokens": sum(len(e["tokens"]) for e in text),
                 "text_seconds": round(text_s, 1), "sampled_examples": len(sampled),
                 "sampled_seconds": round(sampled_s, 1)},
        "vocab_coverage_eval_answers": coverage,
        "head_parameters": head_parameters(head), "head_bytes_fp16": expected_head_bytes(head),
        "train": {"steps": step, "epochs": epoch, "seconds": round(train_s, 1), "curve": curve,
                  "held_out_curve": evals, "kept_step": kept_step},
        "eval_before": before, "eval_after": after,
        "wall_time_s": round(time.perf_counter() - t_all, 1), "threads": torch.get_num_threads(),
        "device": device,
    }
    config.train = {k: summary[k] for k in ("recipe", "data", "vocab_coverage_eval_answers")}
    config.train["eval_after"] = after
    save_head(head, out)
    summary["card"] = str(write_card(out, summary))
    (out / "train_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    logger.info("wrote %s (%.1f min)", out, summary["wall_time_s"] / 60)
    return summary


def _fmt(values) -> str:
    return " / ".join("-" if v is None else f"{v:.3f}" for v in values)


def write_card(folder, summary: dict) -> Path:
    """Write the head's model card ``README.md`` from a :func:`train` summary (command, data, recipe, curve, wall
    time, hardware, held-out draft quality); returns its path."""
    import platform

    r, d, t = summary["recipe"], summary["data"], summary["train"]
    before, after = summary["eval_before"], summary["eval_after"]
    curve = "\n".join(f"| {row['step']} | {row['s']:.0f} | {row['loss']:.3f} | {_fmt(row['acc'])} | "
                      f"{_fmt(row['acc_chain'])} |" for row in t["curve"][:: max(1, len(t["curve"]) // 12)])
    text_line = "" if not d.get("text_windows") else (
        f"\n- Teacher-forced text: {d['text_windows']:,} windows ({d['text_tokens']:,} tokens) of the *train* split of "
        f"the stdlib paragraphs,\n  read by the target in one forward each; the labels are its greedy next tokens there.")
    if d.get("sampled_examples"):
        text_line += (f"\n- Sampled answers: {d['sampled_examples']:,} more answers to requests of the training split, "
                      f"sampled at temperature {r['temperature']};\n  labelled with the target's argmax at every "
                      f"position.")
    text = f"""# {summary['name']}: an EAGLE draft head for `{summary['target']}`

A one-layer feature-level draft head (EAGLE, arXiv 2401.15077) for speculative decoding of `{summary['target']}`,
used as `eagle:head={summary['name']}` (`mmaccel.speculative.Eagle`). It reads the target's last hidden state and the
next token's embedding and predicts the next hidden state; the target's own LM head, restricted to the
{r['vocab']:,} most frequent tokens of its answers (FR-Spec, arXiv 2502.14856), turns that into a
draft token. Only the head's own weights are here ({summary['head_parameters']:,} parameters,
{summary['head_bytes_fp16'] / 2**20:.1f} MiB in fp16); the embedding and LM head are read from the fetched target.

## How it was made

- Command: `{summary['command']}` ({summary['threads']} threads, device `{summary['device']}`, {platform.machine()}).
  Time: {(d['seconds'] + d.get('text_seconds', 0) + d.get('sampled_seconds', 0) + t['seconds']) / 60:.1f} min =
  answers {d['seconds'] / 60:.1f} min + teacher-forced text {d.get('text_seconds', 0) / 60:.1f} min + sampled answers
  {d.get('sampled_seconds', 0) / 60:.1f} min + training {t['seconds'] / 60:.1f} min (evaluation and loading not
  counted).{(chr(10) + '- ' + summary['how']) if summary.get('how') else ''}
- Data (self-distillation, Medusa/EAGLE): the target answers {d['examples']:,} requests greedily in its chat template,
  {r['max_new_tokens']} new tokens at most -- templated chat requests (none of them a Spec-Bench prompt) and copy tasks
  on the *train* split of the stdlib paragraphs (Spec-Bench's copy prompts use the held-out split). {d['tokens']:,}
  tokens, {d['answer_tokens']:,} of them answers; {d['eval_examples']} answers held out for the evaluation below.
  Features are caught by a forward hook during generation.{text_line}
- Sub-vocabulary: {r['vocab']:,} tokens, covering {100 * summary['vocab_coverage_eval_answers']:.1f}% of the held-out
  answer tokens.
- Recipe: {r['init']}; training-time test over {r['unroll']} drafting steps (EAGLE-3, arXiv 2503.01840), loss per step
  = cross-entropy of the greedy next token + smooth-L1 feature regression, step s weighted 0.8^(s-1); AdamW lr
  {r['lr']}, warm-up 30 steps then cosine to 10%, batch {r['batch_size']} answers, feature noise {r['noise']};
  {t['steps']} steps ({t['epochs']} passes over the data) in the {r['train_minutes']}-minute budget.

## Held-out draft quality (greedy, per draft step)

"acc": top-1 = the target's greedy token given the true context; "chain": this and every earlier step of the same
chain right (what verification accepts). Mean accepted length = 1 + the sum of the chain accuracies, for a chain of
that many drafts (tokens per target forward, before any cost of drafting).

| | acc per step | chain per step | mean accepted length |
|---|---|---|---|
| at initialisation | {_fmt(before['acc'])} | {_fmt(before['acc_chain'])} | {before['mean_accepted_length']:.2f} |
| trained | {_fmt(after['acc'])} | {_fmt(after['acc_chain'])} | {after['mean_accepted_length']:.2f} |

## Training curve (training batches; every 25th step)

| step | s | loss | acc per step | chain per step |
|---|---|---|---|---|
{curve}

`train_log.json` holds the whole summary. License: the head is Apache-2.0, as its target.
"""
    path = Path(folder) / "README.md"
    path.write_text(text)
    return path


#: draft heads `mmaccel zoo train NAME` can train: name -> trainer (out_dir, *, device, threads) -> summary
HEADS = {NAME: train}
