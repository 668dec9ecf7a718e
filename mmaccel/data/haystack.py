"""Offline prose and planted needles: the text both the micro-model training and NIAH use.

It lives in :mod:`mmaccel.data` with the other synthetic tasks, so that the zoo's trainers and the long-context
methods read it without importing :mod:`mmaccel.eval`.

Real prose that every machine has offline is harvested from the docstrings of Python's standard library
(parsed with :mod:`ast`, never imported), with digits removed. Paragraphs are split deterministically into a training split and a
held-out split (by a stable hash), so NIAH haystacks are prose the micro-models did not see verbatim.

The needle task follows Needle-in-a-Haystack (Kamradt, 2023) and RULER (Hsieh et al., 2024, arXiv 2404.06654):
a key-value fact is planted at a relative depth in a long document, and a question at the end asks for the value.
Scoring is exact match on the value.
"""
from __future__ import annotations

import ast
import codecs
import functools
import hashlib
import random
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from .words import word_list

__all__ = [
    "ANSWER_PREFIX_TEMPLATE",
    "CALIBRATION_SOURCES",
    "CHAT_INSTRUCTION",
    "CHAT_QUESTION_TEMPLATE",
    "HAYSTACK_CHARS_PER_TOKEN",
    "MAX_HAYSTACK_BYTES",
    "NEEDLE_TEMPLATE",
    "QUESTION_TEMPLATE",
    "HaystackTokens",
    "NIAHLengthError",
    "NIAHSample",
    "Needle",
    "calibration_haystacks",
    "chat_wrapper_ids",
    "check_haystack_file",
    "haystack_mix",
    "is_memorable_number",
    "make_niah_sample",
    "min_niah_length",
    "prose_stream",
    "random_needles",
    "read_haystack_text",
    "resolve_chat_template",
    "score_answer",
    "score_answer_contains",
    "stdlib_paragraphs",
    "word_haystack_text",
]

NEEDLE_TEMPLATE = "The secret number of the {key} is {value}."
QUESTION_TEMPLATE = "What is the secret number of the {key}? The secret number of the {key} is"
# With a chat template the question ends the user's turn and the assistant's turn starts with an answer prefix
# (RULER's layout, Hsieh et al., 2024), so the model answers rather than chats.
CHAT_QUESTION_TEMPLATE = "What is the secret number of the {key}?"
ANSWER_PREFIX_TEMPLATE = "The secret number of the {key} is"
# RULER also opens the user's turn with the task, before the document.
CHAT_INSTRUCTION = "A secret number is hidden in the following text. Read it carefully: you will be asked for it.\n\n"

# Digit strings a language model knows by heart: a needle must not be (a prefix, rounding or piece of) one of them,
# or a model can "answer" it without reading the document (SnapKV once answered 314159265 for 31416).
_FAMOUS_DIGITS = (
    "314159265358979323846",  # pi
    "271828182845904523536",  # e
    "141421356237309504880",  # sqrt 2
    "173205080756887729352",  # sqrt 3
    "161803398874989484820",  # golden ratio
    "693147180559945309417",  # ln 2
    "230258509299404568401",  # ln 10
    "299792458",  # speed of light
    "602214076",  # Avogadro
    "662607015",  # Planck
    "1234567890",
    "9876543210",
)

_ADJECTIVES = (
    "red blue green black white silver golden purple orange yellow brown gray quiet loud rapid slow bright dark "
    "brave calm eager gentle happy proud clever lucky noble wild frozen hidden ancient modern tiny giant "
    "northern southern eastern western"
).split()
_NOUNS = (
    "river mountain forest castle garden harbor island valley desert bridge tower market village temple "
    "lantern compass anchor falcon tiger rabbit dragon wizard pirate sailor farmer doctor teacher painter "
    "engine rocket violin piano mirror window"
).split()


@dataclass
class Needle:
    """A key-value fact to plant.

    Attributes
    ----------
    key : str
        What the question names, e.g. ``"silver falcon"``.
    value : str
        The expected answer, a string of digits, e.g. ``"40817"``.
    """

    key: str
    value: str

    def text(self, template: str = NEEDLE_TEMPLATE) -> str:
        """The sentence planted in the haystack: ``template`` formatted with ``{key}`` and ``{value}``."""
        return template.format(key=self.key, value=self.value)

    def question(self, template: str = QUESTION_TEMPLATE) -> str:
        """The question asked after the haystack: ``template`` formatted with ``{key}`` and ``{value}``."""
        return template.format(key=self.key, value=self.value)


def is_memorable_number(value: str) -> bool:
    """Whether a digit string is one a model may know without reading: a famous constant or a visible pattern.

    True for a piece or a rounded prefix of a famous constant (pi, e, sqrt 2, ...; ``31416``, ``14159``), three equal
    digits in a row (``40007``), four consecutive ascending or descending digits (``23456``), or a round number
    (ending in ``000``).
    """
    if not value.isdigit():
        return False
    for famous in _FAMOUS_DIGITS:
        if value in famous:
            return True
        if len(famous) > len(value):
            rounded = str(int(famous[: len(value)]) + (famous[len(value)] >= "5"))
            if rounded == value:
                return True
    if any(value[i] == value[i + 1] == value[i + 2] for i in range(len(value) - 2)):
        return True
    for step in (1, -1):
        if any(all(int(value[i + j + 1]) - int(value[i + j]) == step for j in range(3)) for i in range(len(value) - 3)):
            return True
    return value.endswith("000")


def random_needles(rng: random.Random, n: int = 1, digits: int = 5) -> list[Needle]:
    """Draw ``n`` needles with distinct keys and random ``digits``-digit values.

    Values have a non-zero first digit and are never memorable (:func:`is_memorable_number`): such a draw is redrawn.
    """
    keys: set[str] = set()
    while len(keys) < n:
        keys.add(f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}")
    out = []
    for key in sorted(keys, key=lambda k: rng.random()):
        value = "0"
        while value.startswith("0") or is_memorable_number(value):
            value = str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(digits - 1))
        out.append(Needle(key=key, value=value))
    return out


def _clean(doc: str) -> str | None:
    lines = [ln.strip() for ln in doc.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith((">>>", "...", "$", "%"))]
    # Digits are removed so that, in the generated haystack, the needle's value is the only number: a 2 M-parameter
    # model then learns retrieval within the CPU training budget (see assets/models/micro-lm/README.md).
    text = re.sub(r"\d", "", " ".join(lines))
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) < 80 or not text.isascii():
        return None
    return text


def _split(text: str) -> str:
    return "eval" if int(hashlib.sha1(text.encode()).hexdigest(), 16) % 10 == 0 else "train"


def stdlib_paragraphs(split: str = "train") -> tuple[str, ...]:
    """Docstring paragraphs of the running Python's standard library, in a stable order.

    Parameters
    ----------
    split : {"train", "eval", "all"}
        ``"eval"`` is a deterministic ~10% hold-out (by SHA-1 of the paragraph).

    Returns
    -------
    tuple of str
        Whitespace-normalised ASCII paragraphs of at least 80 characters, de-duplicated.

    Raises
    ------
    ValueError
        For an unknown split.
    FileNotFoundError
        If the standard library sources cannot be found (a stripped Python install).
    """
    if split not in ("train", "eval", "all"):
        raise ValueError(f"unknown split {split!r}; use 'train', 'eval' or 'all'")
    paras = _all_paragraphs()
    return paras if split == "all" else tuple(p for p in paras if _split(p) == split)


@functools.lru_cache(maxsize=1)
def _all_paragraphs() -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    if not files:
        raise FileNotFoundError(f"no standard-library sources under {root}; pass a haystack text file instead")
    seen: set[str] = set()
    out: list[str] = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if not doc:
                    continue
                for para in re.split(r"\n\s*\n", doc):
                    text = _clean(para)
                    if text and text not in seen:
                        seen.add(text)
                        out.append(text)
    return tuple(out)


def prose_stream(rng: random.Random, split: str = "train"):
    """Yield paragraphs forever, in a shuffled order drawn from ``rng``."""
    paras = list(stdlib_paragraphs(split))
    while True:
        rng.shuffle(paras)
        yield from paras


#: Largest haystack file accepted: 64 MiB (a few million tokens, more than any sweep reads).
MAX_HAYSTACK_BYTES = 64 * 2**20
#: Characters of a haystack file read per token a prompt needs, before the prefix is tokenized (English prose is about
#: 4 characters a token); when the prefix holds too few tokens, twice as much is read, up to the whole file.
HAYSTACK_CHARS_PER_TOKEN = 8


def check_haystack_file(path, max_bytes: int = MAX_HAYSTACK_BYTES) -> Path:
    """The haystack file as a ``Path``, after checks that read nothing but its metadata.

    Parameters
    ----------
    path : str or os.PathLike
    max_bytes : int
        Largest file accepted, in bytes (default :data:`MAX_HAYSTACK_BYTES`, 64 MiB).

    Raises
    ------
    FileNotFoundError
        If nothing is at ``path``.
    IsADirectoryError
        If ``path`` is a directory.
    ValueError
        If it is not a regular file (a device, a pipe) or is larger than ``max_bytes``.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise IsADirectoryError(f"haystack {str(path)!r} is a directory; pass one UTF-8 text file with --haystack")
    if not path.exists():
        raise FileNotFoundError(f"haystack file {str(path)!r} does not exist; pass a text file with --haystack")
    if not path.is_file():
        raise ValueError(f"haystack {str(path)!r} is not a regular file (a device, pipe or socket); pass a UTF-8 "
                         "text file with --haystack")
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"haystack file {str(path)!r} is {size / 2**20:.1f} MiB, over the {max_bytes / 2**20:g} MiB "
                         f"limit; pass a shorter text (a sweep reads about {HAYSTACK_CHARS_PER_TOKEN} characters per "
                         "token of its longest prompt)")
    return path


def read_haystack_text(path, max_chars: int | None = None, *, max_bytes: int = MAX_HAYSTACK_BYTES) -> str:
    """Read a haystack file, or only its first ``max_chars`` characters, as UTF-8 text; a binary file is refused.

    Parameters
    ----------
    path : str or os.PathLike
    max_chars : int, optional
        Read at most this many characters (at most ``4 * max_chars`` bytes); default: the whole file.
    max_bytes : int
        Largest file accepted (:func:`check_haystack_file`).

    Returns
    -------
    str
        The text, without a UTF-8 byte-order mark.

    Raises
    ------
    FileNotFoundError, IsADirectoryError
        As :func:`check_haystack_file`.
    ValueError
        For a file :func:`check_haystack_file` refuses, or bytes read that hold a NUL byte or are not valid UTF-8
        (a binary file, or text in another encoding: the message names the byte offset and how to convert it).
    """
    path = check_haystack_file(path, max_bytes)
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    limit = max_bytes if max_chars is None else min(max_bytes, 4 * max_chars)  # a UTF-8 character is 1 to 4 bytes
    with path.open("rb") as f:
        data = f.read(limit + 1)
    cut = len(data) > limit
    data = data[:limit]
    nul = data.find(b"\x00")
    if nul >= 0:
        raise ValueError(f"haystack file {str(path)!r} is binary (a NUL byte at offset {nul}); pass a UTF-8 text file")
    try:
        text = codecs.getincrementaldecoder("utf-8-sig")().decode(data, final=not cut)  # a cut may split a character
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"haystack file {str(path)!r} is not UTF-8 text (byte offset {exc.start}: {exc.reason}); pass a UTF-8 "
            f"text file, e.g. converted with: iconv -f LATIN1 -t UTF-8 {path} > haystack.txt"
        ) from None
    return text if max_chars is None else text[:max_chars]


class HaystackTokens:
    """Token ids of a long haystack text, cached per tokenizer, with sentence-boundary lookup.

    Parameters
    ----------
    tokenizer : a Hugging Face tokenizer
    text : str, optional
        The haystack. Default: the held-out split of the standard-library docstrings, joined with spaces.
    name : str, optional
        What the text is, kept in the records of anything fitted on it (``.name``; default
        ``"stdlib docstrings, eval split"`` for the default text, else ``"custom text"``).

    Raises
    ------
    ValueError
        If the text is empty.
    """

    def __init__(self, tokenizer, text: str | None = None, *, name: str | None = None):
        self.name = name or ("stdlib docstrings, eval split" if text is None else "custom text")
        if text is None:
            text = " ".join(stdlib_paragraphs("eval"))
        if not text.strip():
            raise ValueError("the haystack text is empty; pass a file with prose in it")
        self.ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
        vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.period_ids = {i for i, t in enumerate(vocab) if t is not None and t.rstrip().endswith(".")}

    @classmethod
    def from_file(cls, tokenizer, path, min_tokens: int | None = None, *,
                  max_bytes: int = MAX_HAYSTACK_BYTES) -> HaystackTokens:
        """The haystack of a UTF-8 text file, reading and tokenizing only as much of it as a prompt needs.

        Parameters
        ----------
        tokenizer : a Hugging Face tokenizer
        path : str or os.PathLike
        min_tokens : int, optional
            The prompt needs more than this many haystack tokens: the first ``min_tokens *``
            :data:`HAYSTACK_CHARS_PER_TOKEN` characters are read and tokenized, twice as many while they hold too
            few tokens, up to the whole file (a shorter file is repeated by :meth:`span`). Default: the whole file.
            Prompts are then drawn from that prefix.
        max_bytes : int
            Largest file accepted (:func:`check_haystack_file`).

        Raises
        ------
        FileNotFoundError, IsADirectoryError, ValueError
            As :func:`read_haystack_text`; ``ValueError`` also if the text is empty.
        """
        if min_tokens is None:
            return cls(tokenizer, read_haystack_text(path, max_bytes=max_bytes), name=f"file {Path(path).name}")
        chars = max(1, int(min_tokens)) * HAYSTACK_CHARS_PER_TOKEN
        while True:
            text = read_haystack_text(path, chars, max_bytes=max_bytes)
            hay = cls(tokenizer, text, name=f"file {Path(path).name}")
            if len(hay.ids) > min_tokens or len(text) < chars:
                return hay
            chars *= 2

    def span(self, n: int, rng: random.Random) -> list[int]:
        """``n`` consecutive ids from a random offset; the text is repeated when it is shorter than ``n``."""
        ids = self.ids
        while len(ids) < n + 1:
            ids = ids + ids
        start = rng.randrange(0, len(ids) - n)
        return ids[start : start + n]

    def boundary(self, ids: list[int], pos: int, lookback: int = 48) -> int:
        """The closest index ``<= pos`` that follows a sentence end, or ``pos`` if none within ``lookback``."""
        for i in range(pos, max(pos - lookback, 0) - 1, -1):
            if i == 0 or ids[i - 1] in self.period_ids:
                return i
        return pos


@dataclass
class NIAHSample:
    """One needle-in-a-haystack prompt.

    Attributes
    ----------
    input_ids : list of int
        The whole prompt, ``length`` tokens: BOS first when the tokenizer has one (plain prompts), or the chat
        template's system/user prefix and assistant header around the document and question (chat prompts).
    answer : str
        The needle's value; scoring is exact match of the first number generated (:func:`score_answer`).
    needle_position : int
        Token index where the needle starts.
    chat_template : bool
        Whether the prompt went through the tokenizer's chat template.
    """

    input_ids: list[int]
    answer: str
    key: str
    length: int
    depth: float
    needle_position: int
    needles: list[Needle] = field(default_factory=list)
    chat_template: bool = False


def resolve_chat_template(tokenizer, mode: str | bool = "auto") -> bool:
    """Decide whether prompts go through the tokenizer's chat template.

    Parameters
    ----------
    mode : {"auto", "on", "off"} or bool
        ``"auto"``: when the tokenizer has a chat template (instruct models); ``"on"``: always; ``"off"``: never.

    Raises
    ------
    ValueError
        For ``"on"`` with a tokenizer that has no chat template, or an unknown mode.
    """
    if isinstance(mode, bool):
        mode = "on" if mode else "off"
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "auto":
        return has
    if mode == "on":
        if not has:
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ValueError(
                f"--chat-template on, but the tokenizer of {name!r} has no chat template: use --chat-template off "
                "(or auto, which uses a template only when there is one)"
            )
        return True
    if mode == "off":
        return False
    raise ValueError(f"unknown chat-template mode {mode!r}; use auto, on or off")


_SLOT = "\u2063MMACCEL_DOCUMENT\u2063"


def chat_wrapper_ids(tokenizer) -> tuple[list[int], list[int]]:
    """Token ids the chat template puts before and after one user message (with the assistant header after it).

    Returns
    -------
    (prefix_ids, suffix_ids)
        E.g. for ChatML: ``<|im_start|>system ... <|im_end|> <|im_start|>user`` and ``<|im_end|> <|im_start|>assistant``.
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SLOT}], add_generation_prompt=True,
                                         tokenize=False)
    before, sep, after = text.partition(_SLOT)
    if not sep:
        raise ValueError("the chat template does not render the user message verbatim; use --chat-template off")
    encode = lambda t: tokenizer.encode(t, add_special_tokens=False) if t else []
    return encode(before), encode(after)


def make_niah_sample(
    tokenizer,
    length: int,
    depth: float,
    *,
    seed: int = 0,
    haystack: HaystackTokens | None = None,
    needle_template: str = NEEDLE_TEMPLATE,
    question_template: str | None = None,
    digits: int = 5,
    chat_template: bool = False,
    answer_prefix: str | None = ANSWER_PREFIX_TEMPLATE,
    instruction: str | None = CHAT_INSTRUCTION,
) -> NIAHSample:
    """Build one NIAH prompt of exactly ``length`` tokens with the needle at relative ``depth``.

    Parameters
    ----------
    tokenizer : a Hugging Face tokenizer
    length : int
        Prompt length in tokens (BOS or chat-template tokens, haystack, needle and question together).
    depth : float
        Relative position of the needle in the haystack, 0.0 (start) to 1.0 (just before the question).
    seed : int
        The same seed, tokenizer and haystack give the same sample.
    haystack : HaystackTokens, optional
        Default: the held-out standard-library prose.
    needle_template, question_template : str
        Format strings with ``{key}`` and ``{value}``. Default question: :data:`QUESTION_TEMPLATE` (a sentence for the
        model to complete) for plain prompts, :data:`CHAT_QUESTION_TEMPLATE` with a chat template.
    chat_template : bool
        Wrap document and question in the tokenizer's chat template as one user message, ending with the assistant
        header (see :func:`resolve_chat_template`).
    answer_prefix : str or None
        With a chat template: the start of the assistant's answer, a format string with ``{key}`` (default
        :data:`ANSWER_PREFIX_TEMPLATE`, as RULER does); ``None`` lets the assistant answer freely.
    instruction : str or None
        With a chat template: text that opens the user's turn before the document (default
        :data:`CHAT_INSTRUCTION`, as RULER does); ``None`` for none.

    Raises
    ------
    ValueError
        If ``depth`` is outside [0, 1], or ``length`` cannot hold the needle and question (the message gives the
        minimum length).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    layout = _NeedleLayout(tokenizer, needle_template, question_template, digits, chat_template, answer_prefix,
                           instruction)
    rng, needle, head, needle_ids, question_ids, tail = layout.draw(length, depth, seed)
    fixed = len(head) + len(needle_ids) + len(question_ids) + len(tail)
    n_hay = length - fixed
    if n_hay < MIN_HAYSTACK_TOKENS:
        raise NIAHLengthError(length, fixed, layout.min_length([depth], [seed], start=length + 1))
    hay = haystack if haystack is not None else _default_haystack(tokenizer)  # after the check: it takes seconds
    body = hay.span(n_hay, rng)
    pos = hay.boundary(body, round(depth * n_hay))
    ids = head + body[:pos] + needle_ids + body[pos:] + question_ids + tail
    return NIAHSample(
        input_ids=ids,
        answer=needle.value,
        key=needle.key,
        length=length,
        depth=depth,
        needle_position=len(head) + pos,
        needles=[needle],
        chat_template=chat_template,
    )


#: The fewest haystack tokens a NIAH prompt holds besides the needle, the question and the template.
MIN_HAYSTACK_TOKENS = 16


class NIAHLengthError(ValueError):
    """A NIAH length too small for the needle, the question and the prompt template.

    Attributes
    ----------
    length : int
        The length asked for, in tokens.
    fixed : int
        Tokens the needle, question and template take in that prompt.
    minimum : int
        The advised length: every length from ``minimum`` to ``minimum + 63`` holds its prompts
        (:func:`min_niah_length`).
    """

    def __init__(self, length: int, fixed: int, minimum: int):
        self.length, self.fixed, self.minimum = length, fixed, minimum
        super().__init__(f"length {length} is smaller than the needle and question need ({fixed} tokens with the "
                         f"prompt template, plus at least {MIN_HAYSTACK_TOKENS} of haystack): use a length of at "
                         f"least {minimum} tokens")


class _NeedleLayout:
    """The length-independent parts of a NIAH prompt (template head and tail) and the needle each (length, depth,
    seed) draws, with the token ids of the needle sentences cached."""

    def __init__(self, tokenizer, needle_template, question_template, digits, chat_template, answer_prefix,
                 instruction):
        self.tokenizer, self.needle_template, self.digits = tokenizer, needle_template, digits
        if question_template is None:
            question_template = CHAT_QUESTION_TEMPLATE if chat_template else QUESTION_TEMPLATE
        self.question_template = question_template
        self.chat_template, self.answer_prefix, self.instruction = chat_template, answer_prefix, instruction
        self._encoded: dict[str, list[int]] = {}
        if chat_template:
            self.head, self.tail = chat_wrapper_ids(tokenizer)
            if instruction:
                self.head = self.head + self._encode(instruction)
        else:
            self.head, self.tail = ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []), []

    def _encode(self, text: str) -> list[int]:
        if text not in self._encoded:
            self._encoded[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return self._encoded[text]

    def draw(self, length: int, depth: float, seed: int):
        """(rng, needle, head, needle_ids, question_ids, tail) of the prompt at (length, depth, seed)."""
        rng = random.Random(f"niah:{seed}:{length}:{depth}")
        (needle,) = random_needles(rng, 1, self.digits)
        tail = self.tail
        if self.chat_template and self.answer_prefix:
            tail = tail + self._encode(self.answer_prefix.format(key=needle.key))
        return (rng, needle, self.head, self._encode(" " + needle.text(self.needle_template)),
                self._encode("\n" + needle.question(self.question_template)), tail)

    def fixed(self, length: int, depth: float, seed: int) -> int:
        _, _, head, needle_ids, question_ids, tail = self.draw(length, depth, seed)
        return len(head) + len(needle_ids) + len(question_ids) + len(tail)

    def min_length(self, depths, seeds, *, start: int = 1, window: int = 64) -> int:
        """The least length >= ``start`` from which ``window`` consecutive lengths all hold their prompts."""
        length = max(1, int(start))
        for _ in range(10_000):
            short = [n for n in range(length, length + window) for d in depths for s in seeds
                     if n - self.fixed(n, d, s) < MIN_HAYSTACK_TOKENS]
            if not short:
                return length
            length = max(short) + 1
        raise ValueError("no NIAH length holds the needle and question; check the templates")  # pragma: no cover


def min_niah_length(tokenizer, depths=(0.5,), seeds=(0,), *, start: int = 1, needle_template: str = NEEDLE_TEMPLATE,
                    question_template: str | None = None, digits: int = 5, chat_template: bool = False,
                    answer_prefix: str | None = ANSWER_PREFIX_TEMPLATE,
                    instruction: str | None = CHAT_INSTRUCTION) -> int:
    """The shortest NIAH length that holds the needle, question and prompt template at every depth and seed given.

    The needle drawn depends on the length, so the tokens it takes vary a little with it: the length returned is the
    least one ``>= start`` such that it and the 63 lengths after it all build (checked by tokenizing the needles,
    not the haystack). It is the advice of :class:`NIAHLengthError`.

    Parameters
    ----------
    tokenizer : a Hugging Face tokenizer
    depths, seeds : sequences
        The depths in [0, 1] and the sample seeds of the prompts (a sweep's trial ``t`` uses ``seed + t``).
    start : int
        The least length considered.
    needle_template, question_template, digits, chat_template, answer_prefix, instruction
        As :func:`make_niah_sample`.

    Returns
    -------
    int
        A length in tokens.

    Raises
    ------
    ValueError
        From the chat template (see :func:`chat_wrapper_ids`).
    """
    layout = _NeedleLayout(tokenizer, needle_template, question_template, digits, chat_template, answer_prefix,
                           instruction)
    return layout.min_length(list(depths), list(seeds), start=start)


_HAYSTACK_CACHE: dict[tuple, HaystackTokens] = {}


def _cached_haystack(tokenizer, name: str | None = None, text=None) -> HaystackTokens:
    """The :class:`HaystackTokens` of a built-in text, tokenized once per tokenizer and name (``text``: a callable
    giving the text; ``None``: the default haystack)."""
    key = (getattr(tokenizer, "name_or_path", ""), len(tokenizer), type(tokenizer).__name__, name)
    if key not in _HAYSTACK_CACHE:
        _HAYSTACK_CACHE[key] = HaystackTokens(tokenizer, None if text is None else text(), name=name)
    return _HAYSTACK_CACHE[key]


def _default_haystack(tokenizer) -> HaystackTokens:
    return _cached_haystack(tokenizer)


def word_haystack_text(n_words: int = 60_000, seed: int = 0) -> str:
    """Seeded sentences of random dictionary words (``wonderwords``' nouns, adjectives and verbs, 6-14 words each,
    capitalised and ending in a period): a haystack with no syntax, no digits and no prose the models were fitted
    on.

    Raises
    ------
    ValueError
        If ``n_words < 1``.
    """
    if n_words < 1:
        raise ValueError(f"n_words must be >= 1, got {n_words}")
    rng, words, out = random.Random(f"word-haystack:{seed}"), word_list(), []
    while n_words > 0:
        k = min(n_words, rng.randint(6, 14))
        sentence = [rng.choice(words) for _ in range(k)]
        out.append(" ".join(sentence).capitalize() + ".")
        n_words -= k
    return " ".join(out)


CALIBRATION_SOURCES = ("stdlib docstrings, train split", "random dictionary words")
"""The haystacks everything fitted on data is fitted on (:func:`calibration_haystacks`): neither is a haystack the
evaluations use by default (the eval split of the docstrings; RULER's essay, noise and needle haystacks)."""


def calibration_haystacks(tokenizer) -> list[HaystackTokens]:
    """The fitting mix of :data:`CALIBRATION_SOURCES` for ``tokenizer``, in that order: the training split of the
    standard-library docstrings and seeded sentences of random words (:func:`word_haystack_text`), each tokenized
    once per tokenizer in a process.

    The head finders (:func:`mmaccel.longctx.head_finder.find_retrieval_heads`,
    :func:`mmaccel.longctx.duo_gates.find_retrieval_heads_by_gates`) draw their documents from these in turn, so a
    pattern is validated on sources it never saw: the eval split (the default NIAH haystack) and RULER's haystacks.
    """
    return [_cached_haystack(tokenizer, CALIBRATION_SOURCES[0], lambda: " ".join(stdlib_paragraphs("train"))),
            _cached_haystack(tokenizer, CALIBRATION_SOURCES[1], word_haystack_text)]


def haystack_mix(tokenizer, haystack) -> list[HaystackTokens]:
    """``haystack`` as a non-empty list: ``None`` is :func:`calibration_haystacks`, one :class:`HaystackTokens` a
    list of one, a sequence kept as given.

    Raises
    ------
    ValueError
        If the sequence is empty.
    """
    if haystack is None:
        return calibration_haystacks(tokenizer)
    mix = [haystack] if isinstance(haystack, HaystackTokens) else list(haystack)
    if not mix:
        raise ValueError("haystack: pass a HaystackTokens, a non-empty sequence of them, or None for the mix")
    return mix


def score_answer(generated: str, answer: str) -> bool:
    """Strict exact match (the headline score): the first number in ``generated`` equals ``answer``.

    Digits separated by ``,`` or ``_`` count as one number (``84,426`` is 84426).
    """
    match = re.search(r"\d[\d,_]*", generated)
    return bool(match) and re.sub(r"[,_]", "", match.group(0)) == answer


def score_answer_contains(generated: str, answer: str) -> bool:
    """Lenient match (kvpress's rule): ``answer`` appears anywhere in ``generated``."""
    return answer in generated
