"""RULER-style long-context tasks, generated offline and seeded: retrieval, tracing, aggregation and (from a local
file) question answering.

Follows the task design of RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", 2024, arXiv 2404.06654): each task is an instruction, a context of a given token length, a question and an
answer prefix that the model continues; the answer is scored by string match against every reference (``"all"``:
the fraction of references found in the output) or against any of them (``"part"``: 1 if one is found).

Tasks (:data:`TASKS`)
---------------------
``niah_single_1/2/3``
    One needle ("One special magic number for <key> is: <value>.") in noise sentences (1), in prose (2), or in prose
    with a UUID value (3).
``niah_multikey_1/2/3``
    The needle among distractors: three other needles in prose (1), a haystack made only of needles with random
    adjective-noun keys (2), or of needles with UUID keys and values (3).
``niah_multivalue``, ``niah_multiquery``
    Four values planted for one key, all asked; four keys planted, all asked in one question.
``vt``
    Variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (four hops) hidden in noise; the answer is
    every variable that holds the value. One worked example precedes the task at >= 1,024 tokens, as in RULER.
``cwe``
    Common words: a numbered list where ten words appear often (30 times at >= 4,096 tokens, else 6) and the others
    rarely (3, else 1; 3 and 1 below 1,024); the answer is the ten. One short worked example precedes the task at
    >= 1,024 tokens.
``fwe``
    Frequent words: coded six-letter words drawn with Zipf frequencies (alpha 2; the most frequent is ``...``, noise);
    the answer is the next three.
``qa_1``, ``qa_2``
    Question answering over documents from SQuAD (qa_1) or HotpotQA (qa_2): the gold documents among distractors up
    to the length. This machine cannot download them: pass the datasets' JSON (SQuAD v2 ``dev-v2.0.json``, HotpotQA
    ``hotpot_dev_distractor_v1.json``) to :func:`load_qa_file` (CLI ``--qa-file``); without it the QA tasks are not
    available.

Haystacks: ``"essay"`` is the built-in held-out prose (:func:`mmaccel.data.haystack.stdlib_paragraphs`, no digits)
or any text the caller passes; ``"noise"`` repeats "The grass is green. ..."; ``"needle"`` is distractor key-values.
Word lists (needle keys, common words) come from the ``wonderwords`` package, as RULER's do.

Prompts and query modes
-----------------------
A :class:`RulerSample` holds token ids in two parts: ``context_ids`` (chat-template head, task instruction, context)
and per question ``question_ids`` (the question, the chat template's assistant header, the answer prefix), so the
query-aware prompt is ``context_ids + question_ids`` and a query-agnostic run compresses ``context_ids`` before it
sees any question (:mod:`mmaccel.longctx.compress`). A sample's prompt is at most ``length`` tokens (the longest
question counted); the context is filled with as much haystack as fits (a binary search over haystack units).
Every choice is drawn from ``random.Random`` seeded by (task, seed, length): the same arguments and tokenizer give the
same sample.
"""
from __future__ import annotations

import json
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .haystack import chat_wrapper_ids, stdlib_paragraphs
from .words import word_list

__all__ = [
    "NOISE",
    "QA_TASKS",
    "SYNTHETIC_TASKS",
    "TASKS",
    "QAData",
    "RulerQuery",
    "RulerSample",
    "TaskSpec",
    "load_qa_file",
    "make_ruler_sample",
    "resolve_tasks",
    "score",
    "word_list",
]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""The noise haystack unit (the passkey filler of Mohtashami and Jaggi, 2023, that RULER repeats)."""

DEPTHS = [round(100 * i / 39) for i in range(40)]
"""Needle depths (percent of the context) drawn from, without replacement: 40 evenly spaced, as RULER does."""


@dataclass(frozen=True)
class TaskSpec:
    """What one task is: its kind, haystack, needle types and counts, metric and RULER's generation length.

    Attributes
    ----------
    name : str
    kind : {"niah", "vt", "cwe", "fwe", "qa"}
    haystack : {"essay", "noise", "needle", "words", "coded", "documents"}
    key_type, value_type : {"words", "numbers", "uuids"}
        NIAH needle keys and values.
    num_keys, num_values, num_queries : int
        NIAH needles: keys planted (>= queries), values per key, keys asked.
    metric : {"all", "part"}
        :func:`score`'s rule.
    max_new_tokens : int
        RULER's generation length for the task (tokens).
    dataset : str or None
        ``"squad"`` / ``"hotpotqa"`` for the QA tasks.
    """

    name: str
    kind: str
    haystack: str
    key_type: str = "words"
    value_type: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    metric: str = "all"
    max_new_tokens: int = 128
    dataset: str | None = None


def _niah(name, haystack, key="words", value="numbers", k=1, v=1, q=1) -> TaskSpec:
    return TaskSpec(name, "niah", haystack, key, value, max(k, q), v, q)


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    _niah("niah_single_1", "noise"),
    _niah("niah_single_2", "essay"),
    _niah("niah_single_3", "essay", value="uuids"),
    _niah("niah_multikey_1", "essay", k=4),
    _niah("niah_multikey_2", "needle"),
    _niah("niah_multikey_3", "needle", key="uuids", value="uuids"),
    _niah("niah_multivalue", "essay", v=4),
    _niah("niah_multiquery", "essay", q=4),
    TaskSpec("vt", "vt", "noise", max_new_tokens=30),
    TaskSpec("cwe", "cwe", "words", max_new_tokens=120),
    TaskSpec("fwe", "fwe", "coded", max_new_tokens=50),
    TaskSpec("qa_1", "qa", "documents", metric="part", max_new_tokens=32, dataset="squad"),
    TaskSpec("qa_2", "qa", "documents", metric="part", max_new_tokens=32, dataset="hotpotqa"),
)}
"""Every task by name."""

SYNTHETIC_TASKS = tuple(n for n, t in TASKS.items() if t.kind != "qa")
"""The eleven tasks generated without any data set (``--tasks all``)."""
QA_TASKS = ("qa_1", "qa_2")
"""The tasks that need a local SQuAD / HotpotQA file."""


def resolve_tasks(names: Sequence[str], *, qa_available: bool = False) -> list[str]:
    """Task names from a user's list: ``all`` is the eleven synthetic tasks (plus the QA tasks when a QA file is
    given), ``niah`` every NIAH task; duplicates dropped, order kept.

    Raises
    ------
    ValueError
        For an unknown name, or a QA task without a QA file (naming ``--qa-file``).
    """
    out: list[str] = []
    for name in names:
        if name == "all":
            out += list(SYNTHETIC_TASKS) + (list(QA_TASKS) if qa_available else [])
        elif name == "niah":
            out += [n for n in SYNTHETIC_TASKS if n.startswith("niah")]
        elif name in TASKS:
            if TASKS[name].kind == "qa" and not qa_available:
                raise ValueError(f"task {name} needs question-answering data this machine cannot download: pass the "
                                 f"{TASKS[name].dataset} JSON file with --qa-file")
            out.append(name)
        else:
            raise ValueError(f"unknown RULER task {name!r}; choose from all, niah, {', '.join(TASKS)}")
    return list(dict.fromkeys(out))


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(word_list('adjective'))}-{rng.choice(word_list('noun'))}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}; use numbers, words or uuids")


def _distinct(rng: random.Random, kind: str, n: int, avoid: set[str] = frozenset()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = _random_value(rng, kind)
        if v not in avoid and v not in out:
            out.append(v)
    return out


def _join(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


# ------------------------------------------------------------------------------------------------------ samples
@dataclass
class RulerQuery:
    """One question asked of a sample's context.

    Attributes
    ----------
    question : str
        The question text (after the context).
    answer_prefix : str
        The start of the answer the model continues.
    references : list of str
        What a correct answer contains (:func:`score`).
    question_ids : list of int
        The question, the chat template's end of turn and assistant header (if any) and the answer prefix, as tokens.
    """

    question: str
    answer_prefix: str
    references: list[str]
    question_ids: list[int] = field(default_factory=list)


@dataclass
class RulerSample:
    """One RULER prompt: a context and the questions asked of it.

    Attributes
    ----------
    task : str
    length : int
        The requested prompt length in tokens; every ``context_ids + question_ids`` is at most this.
    seed : int
    context_ids : list of int
        BOS or the chat template's head, the task instruction and the context.
    queries : list of RulerQuery
        One for the synthetic tasks.
    metric : {"all", "part"}
    max_new_tokens : int
        RULER's generation length for the task.
    chat_template : bool
    """

    task: str
    length: int
    seed: int
    context_ids: list[int]
    queries: list[RulerQuery]
    metric: str
    max_new_tokens: int
    chat_template: bool = False

    def input_ids(self, query: int = 0) -> list[int]:
        """The query-aware prompt of question ``query``: ``context_ids + question_ids``."""
        return self.context_ids + self.queries[query].question_ids

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the longest prompt (context and its longest question)."""
        return len(self.context_ids) + max(len(q.question_ids) for q in self.queries)


def score(prediction: str, references: Sequence[str], metric: str = "all") -> float:
    """RULER's string match, case-insensitive, on the output with control characters turned into newlines.

    Parameters
    ----------
    prediction : str
        The generated text.
    references : sequence of str
    metric : {"all", "part"}
        ``"all"``: the fraction of references contained in the prediction; ``"part"``: 1.0 if any is.

    Returns
    -------
    float
        In [0, 1].

    Raises
    ------
    ValueError
        For an unknown metric or no references.
    """
    if not references:
        raise ValueError("score needs at least one reference")
    pred = re.sub(r"[\x00-\x1f]", "\n", prediction).strip().lower()
    hits = [r.lower() in pred for r in references]
    if metric == "all":
        return sum(hits) / len(hits)
    if metric == "part":
        return float(any(hits))
    raise ValueError(f"unknown metric {metric!r}; use 'all' or 'part'")


@dataclass
class _Draft:
    """A task's text before tokenisation: the instruction and context, and each question with its answer prefix."""

    context: str
    queries: list[RulerQuery]


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def _insert_at_depths(rng: random.Random, units: list[str], needles: list[str]) -> list[str]:
    """``needles`` placed between ``units`` at depths drawn from :data:`DEPTHS` (in the needles' order)."""
    depths = sorted(rng.sample(DEPTHS, len(needles)) if len(needles) <= len(DEPTHS) else
                    [rng.choice(DEPTHS) for _ in needles])
    out, last = [], 0
    for d, needle in zip(depths, needles):
        pos = int(len(units) * d / 100)
        out += units[last:pos] + [needle]
        last = pos
    return out + units[last:]


def _insert_at_random(rng: random.Random, units: list[str], needles: list[str]) -> list[str]:
    out = list(units)
    for i, needle in sorted(zip(rng.sample(range(len(units) + 1), len(needles)) if len(needles) <= len(units) + 1
                                else [rng.randrange(len(units) + 1) for _ in needles], needles), reverse=True):
        out.insert(i, needle)
    return out


class _Essay:
    """Words of a prose text from a seeded offset (wrapping around), ``n`` at a time."""

    def __init__(self, text: str | None):
        self.words = (text if text is not None else " ".join(stdlib_paragraphs("eval"))).split()
        if not self.words:
            raise ValueError("the haystack text is empty; pass a file with prose in it")

    def take(self, start: int, n: int) -> str:
        w = self.words
        reps = (start + n) // len(w) + 1
        return " ".join((w * reps)[start:start + n]) if reps > 1 else " ".join(w[start:start + n])


_NIAH_NEEDLE = "One special magic {kind} for {key} is: {value}."


def _niah_draft(spec: TaskSpec, rng: random.Random, n: int, essay: _Essay) -> _Draft:
    """A NIAH context of ``n`` haystack units (words, noise paragraphs or distractor needles)."""
    kind = spec.value_type
    keys = _distinct(rng, spec.key_type, spec.num_keys)
    values = [_distinct(rng, kind, spec.num_values) for _ in keys]
    needles = [_NIAH_NEEDLE.format(kind=kind[:-1], key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = sorted(rng.sample(range(len(keys)), spec.num_queries))
    if spec.haystack == "essay":
        units = _sentences(essay.take(rng.randrange(len(essay.words)), n))
        body = _insert_at_depths(rng, units, needles)
    else:
        if spec.haystack == "noise":
            units = [NOISE] * n
        else:  # distractor needles with fresh keys and values
            other_keys = _distinct(rng, spec.key_type, n, avoid=set(keys))
            units = [_NIAH_NEEDLE.format(kind=kind[:-1], key=k, value=_random_value(rng, kind)) for k in other_keys]
        body = _insert_at_random(rng, units, needles)
    single = spec.num_queries * spec.num_values == 1
    noun = f"special magic {kind[:-1] if single else kind}"
    query = _join([keys[i] for i in asked])
    intro = (f"A {noun} is hidden in the text below. Memorize it: you will be asked for the {noun} afterwards."
             if single else f"Some {noun} are hidden in the text below. Memorize them: you will be asked for the "
                            f"{noun} afterwards.")
    question = (f"What is the {noun} for {query} in the text above?" if single else
                f"What are all the {noun} for {query} in the text above?")
    prefix = f"The {noun} for {query} in the text above {'is' if single else 'are'}"
    refs = [v for i in asked for v in values[i]]
    return _Draft(intro + "\n" + " ".join(body), [RulerQuery(question, prefix, refs)])


def _vt_chain(rng: random.Random, letters: int, hops: int, value: str) -> tuple[list[str], list[str]]:
    names: list[str] = []
    while len(names) < hops + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if v not in names:
            names.append(v)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[j + 1]} = VAR {names[j]}." for j in range(hops)]
    return names, chain


def _vt_text(rng: random.Random, n: int, chain: list[str]) -> str:
    return " ".join(_insert_at_random_ordered(rng, [NOISE] * n, chain))


def _insert_at_random_ordered(rng: random.Random, units: list[str], items: list[str]) -> list[str]:
    """``items`` between ``units`` at random places, keeping their order (a chain is read top to bottom)."""
    spots = sorted(rng.choices(range(len(units) + 1), k=len(items)))
    out, last = [], 0
    for pos, item in zip(spots, items):
        out += units[last:pos] + [item]
        last = pos
    return out + units[last:]


_VT_INTRO = "Memorize and track the chain of variable assignments hidden in the text below."
_VT_Q = "Question: Find all variables that are assigned the value {value} in the text above."
_VT_PREFIX = ("Answer: According to the chain of variable assignments in the text above, {k} variables are assigned "
              "the value {value}, they are:")


def _vt_draft(spec: TaskSpec, rng: random.Random, n: int, essay: _Essay, length: int) -> _Draft:
    hops = 4
    example = ""
    if length >= 1024:  # a worked example first, as RULER; a short prompt has no room for one
        ex_names, ex_chain = _vt_chain(rng, 3, hops, "12345")
        example = (f"{_VT_INTRO}\n\n{_vt_text(rng, 3, ex_chain)}\n{_VT_Q.format(value='12345')} "
                   f"{_VT_PREFIX.format(k=hops + 1, value='12345')} {' '.join(ex_names)}\n\n")
    value = str(rng.randint(10000, 99999))
    names, chain = _vt_chain(rng, 5, hops, value)
    context = f"{example}{_VT_INTRO}\n\n{_vt_text(rng, n, chain)}"
    return _Draft(context, [RulerQuery(_VT_Q.format(value=value), _VT_PREFIX.format(k=hops + 1, value=value),
                                       names)])


_CWE_INTRO = ("Below is a numbered list of words. Some of them appear more often than the others. Memorize the ones "
              "that appear most often.")
_CWE_Q = "Question: What are the 10 most common words in the list above?"
_CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"


def _cwe_list(rng: random.Random, n_words: int, common: int, rare: int) -> tuple[str, list[str]]:
    words = rng.sample(word_list(), n_words)
    top = words[:10]
    items = top * common + words[10:] * rare
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), top


def _cwe_draft(spec: TaskSpec, rng: random.Random, n: int, essay: _Essay, length: int) -> _Draft:
    common, rare = (30, 3) if length >= 4096 else (6, 1) if length >= 1024 else (3, 1)
    example = ""
    if length >= 1024:  # a worked example first, as RULER; a short prompt has no room for one
        ex_list, ex_top = _cwe_list(rng, 20, 3, 1)
        example = (f"{_CWE_INTRO}\n{ex_list}\n{_CWE_Q} {_CWE_PREFIX} "
                   + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_top)) + "\n\n")
    body, top = _cwe_list(rng, 10 + n, common, rare)
    return _Draft(f"{example}{_CWE_INTRO}\n{body}", [RulerQuery(_CWE_Q, _CWE_PREFIX, top)])


def _zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann zeta(alpha) for alpha > 1: a partial sum plus the Euler-Maclaurin tail."""
    head = sum(k ** -alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms ** -alpha


def _fwe_draft(spec: TaskSpec, rng: random.Random, n: int, essay: _Essay, length: int, alpha: float = 2.0) -> _Draft:
    vocab_size = max(length // 50, 10)
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        w = "".join(rng.choices(string.ascii_lowercase, k=6))
        if w not in vocab:
            vocab.append(w)
    vocab[0] = "..."  # the most frequent "word" is noise
    z = _zeta(alpha)
    words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(n * k ** -alpha / z))]
    rng.shuffle(words)
    intro = ("Read the coded text below and count how often each coded word appears. Find the three coded words that "
             "appear most often.")
    question = ("Question: Do not explain, and ignore the dots '....'. What are the three most frequent coded words in "
                "the text above?")
    prefix = "Answer: According to the coded text above, the three most frequent words are:"
    return _Draft(f"{intro} {' '.join(words)}", [RulerQuery(question, prefix, vocab[1:4])])


# ------------------------------------------------------------------------------------------------------------ QA
@dataclass
class QAData:
    """Question-answering data read by :func:`load_qa_file`.

    Attributes
    ----------
    dataset : {"squad", "hotpotqa"}
    docs : list of str
        Every distinct document (SQuAD paragraph; HotpotQA ``"title\\ntext"``), sorted.
    questions : list of dict
        ``{"question", "answers" (list of str), "docs" (gold document indices), "related" (indices of the same
        article's other paragraphs, SQuAD)}``; unanswerable SQuAD questions are left out.
    """

    dataset: str
    docs: list
    questions: list


def load_qa_file(path) -> QAData:
    """Read SQuAD (v1/v2 JSON: ``{"data": [{"paragraphs": [{"context", "qas"}]}]}``) or HotpotQA (a JSON list of
    ``{"question", "answer", "context": [[title, [sentences]]]}``) from a local file.

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    ValueError
        If it is not JSON in either layout, or holds no answerable question.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"QA file {str(path)!r} does not exist; pass SQuAD or HotpotQA JSON with --qa-file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"QA file {str(path)!r} is not JSON ({exc}); pass SQuAD or HotpotQA JSON") from exc
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        dataset = "squad"
        articles = [[p["context"] for p in a.get("paragraphs", [])] for a in data["data"]]
        docs = sorted({c for a in articles for c in a})
        index = {d: i for i, d in enumerate(docs)}
        questions = []
        for a in data["data"]:
            related = [index[p["context"]] for p in a.get("paragraphs", [])]
            for p in a.get("paragraphs", []):
                for qa in p.get("qas", []):
                    answers = [x["text"] for x in qa.get("answers", []) if x.get("text")]
                    if qa.get("is_impossible") or not answers:
                        continue
                    gold = index[p["context"]]
                    questions.append({"question": qa["question"], "answers": answers, "docs": [gold],
                                      "related": [i for i in related if i != gold]})
    elif isinstance(data, list) and all(isinstance(d, dict) and "context" in d and "question" in d for d in data):
        dataset = "hotpotqa"

        def text(title, sents):
            return f"{title}\n{''.join(sents)}"

        docs = sorted({text(t, s) for d in data for t, s in d["context"]})
        index = {d: i for i, d in enumerate(docs)}
        questions = [{"question": d["question"], "answers": [str(d["answer"])],
                      "docs": [index[text(t, s)] for t, s in d["context"]], "related": []} for d in data]
    else:
        raise ValueError(f"QA file {str(path)!r} is neither SQuAD ({{'data': [...]}}) nor HotpotQA (a list of "
                         "{'question', 'answer', 'context'}) JSON")
    if not questions:
        raise ValueError(f"QA file {str(path)!r} holds no answerable question")
    return QAData(dataset, docs, questions)


_QA_INSTR = "Answer the question from the documents below. Give only the answer, no other words."


def _qa_draft(spec: TaskSpec, rng: random.Random, n: int, qa: QAData) -> _Draft:
    item = qa.questions[rng.randrange(len(qa.questions))]
    gold, related = list(item["docs"]), list(item["related"])
    others = [i for i in range(len(qa.docs)) if i not in gold and i not in related]
    extra = max(0, n - len(gold))
    chosen = gold + related[:extra] + rng.sample(others, min(len(others), max(0, extra - len(related))))
    rng.shuffle(chosen)
    body = "\n\n".join(f"Document {i + 1}:\n{qa.docs[d]}" for i, d in enumerate(chosen))
    context = f"{_QA_INSTR}\n\nThe documents:\n\n{body}\n\n{_QA_INSTR}"
    return _Draft(context, [RulerQuery(f"Question: {item['question']}", "Answer:", list(item["answers"]))])


# ------------------------------------------------------------------------------------------------------- building
def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def make_ruler_sample(
    tokenizer,
    task: str,
    length: int,
    *,
    seed: int = 0,
    haystack: str | None = None,
    chat_template: bool = False,
    qa: QAData | None = None,
) -> RulerSample:
    """Build one RULER sample of at most ``length`` prompt tokens.

    Parameters
    ----------
    tokenizer : a Hugging Face tokenizer
    task : str
        A name of :data:`TASKS`.
    length : int
        The prompt budget in tokens (context and the longest question; generated tokens not counted).
    seed : int
        With ``task`` and ``length``, seeds every draw: the same arguments give the same sample.
    haystack : str, optional
        The text of the ``"essay"`` haystack (default: the built-in held-out prose).
    chat_template : bool
        Wrap the prompt in the tokenizer's chat template as one user turn; the answer prefix opens the assistant's
        turn (see :func:`mmaccel.data.haystack.resolve_chat_template`).
    qa : QAData, optional
        Required for ``qa_1`` / ``qa_2`` (:func:`load_qa_file`).

    Returns
    -------
    RulerSample

    Raises
    ------
    ValueError
        For an unknown task, a QA task without ``qa`` (or with the other data set), or a ``length`` too small for the
        task's fixed text (the message gives the smallest length that fits).
    """
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
    spec = TASKS[task]
    if spec.kind == "qa":
        if qa is None:
            raise ValueError(f"task {task} needs {spec.dataset} data: pass its JSON file with --qa-file")
        if qa.dataset != spec.dataset:
            raise ValueError(f"task {task} asks {spec.dataset} questions, but the QA file is {qa.dataset}; use "
                             f"{'qa_1' if qa.dataset == 'squad' else 'qa_2'}")
    essay = _Essay(haystack) if spec.haystack == "essay" else None

    def draft(n: int) -> _Draft:
        rng = random.Random(f"ruler:{task}:{seed}:{length}")
        if spec.kind == "niah":
            return _niah_draft(spec, rng, n, essay)
        if spec.kind == "vt":
            return _vt_draft(spec, rng, n, essay, length)
        if spec.kind == "cwe":
            return _cwe_draft(spec, rng, n, essay, length)
        if spec.kind == "fwe":
            return _fwe_draft(spec, rng, n, essay, length)
        return _qa_draft(spec, rng, n, qa)

    if chat_template:
        head, tail = chat_wrapper_ids(tokenizer)
    else:
        head, tail = ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []), []

    def build(n: int) -> RulerSample:
        d = draft(n)
        for q in d.queries:
            q.question_ids = _encode(tokenizer, "\n" + q.question) + tail + _encode(tokenizer, " " + q.answer_prefix
                                                                                    if not chat_template else
                                                                                    q.answer_prefix)
        return RulerSample(task, length, seed, head + _encode(tokenizer, d.context), d.queries, spec.metric,
                           spec.max_new_tokens, chat_template)

    lowest = {"niah": 1, "vt": 1, "cwe": 1, "fwe": 50, "qa": 0}[spec.kind]
    best = _largest_fitting(build, lowest, length)
    if best is None:
        raise ValueError(f"length {length} is too small for RULER task {task}: its smallest prompt is "
                         f"{build(lowest).prompt_tokens} tokens; use a length of at least that")
    return best


def _largest_fitting(build: Callable[[int], RulerSample], lowest: int, length: int) -> RulerSample | None:
    """The sample of the largest unit count ``n >= lowest`` whose prompt fits in ``length`` tokens (a doubling, then
    a binary search; prompt tokens grow with ``n``), or ``None`` when even ``lowest`` does not fit."""
    first = build(lowest)
    if first.prompt_tokens > length:
        return None
    good, n = first, max(lowest, 1)
    lo = lowest
    while True:
        n *= 2
        s = build(n)
        if s.prompt_tokens > length:
            hi = n
            break
        good, lo = s, n
        if n > 64 * length:  # the units stopped growing the prompt (e.g. QA ran out of documents)
            return good
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s = build(mid)
        if s.prompt_tokens <= length:
            good, lo = s, mid
        else:
            hi = mid
    return good
