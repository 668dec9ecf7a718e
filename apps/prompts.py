"""Text inputs of the text tabs: an uploaded document, a prompt built from a document and a question, a NIAH document.
"""
from __future__ import annotations

from collections.abc import Mapping

from .common import InputError, checked_upload


def read_upload(path: str | None, max_bytes: int) -> str | None:
    """The text of an uploaded file (Gradio keeps it in its temp folder), or ``None`` when there is none.

    Raises
    ------
    InputError
        A file over ``max_bytes``, a binary file (a NUL byte) or a file that is not UTF-8 text.
    """
    if not path:
        return None
    p = checked_upload(path, max_bytes)
    data = p.read_bytes()
    if b"\x00" in data:
        raise InputError(f"the uploaded file {p.name} is not a text file (it contains NUL bytes); upload UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"the uploaded file {p.name} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if not text.strip():
        raise InputError(f"the uploaded file {p.name} is empty")
    return text


def build_prompt(tokenizer, document: str, question: str, chat_template: str = "auto") -> list[int]:
    """Token ids of ``document`` followed by ``question``: one user turn of the chat template when the tokenizer has
    one (``"auto"``), else the plain text ``document + "\\n" + question`` after BOS (the micro-models' layout).

    Raises
    ------
    InputError
        Both the document and the question are empty.
    """
    from mmaccel.data.haystack import resolve_chat_template

    document, question = (document or "").strip(), (question or "").strip()
    if not document and not question:
        raise InputError("the document and the question are both empty: paste or upload a document, or generate one")
    text = f"{document}\n{question}".strip()
    if resolve_chat_template(tokenizer, chat_template):
        msgs = [{"role": "user", "content": f"{document}\n\n{question}".strip()}]
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out
        ids = list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)
    else:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
    return [int(i) for i in ids]


def niah_document(tokenizer, length: int, depth: float, seed: int, haystack=None) -> tuple[str, str, str]:
    """A NIAH document (held-out prose with one planted fact), its question and the expected answer.

    ``haystack`` is a :class:`~mmaccel.data.haystack.HaystackTokens` (default: the held-out standard-library prose).

    The document is the haystack with the needle, decoded to text; the question is the completion sentence for a
    tokenizer without a chat template and the plain question with one (see :mod:`mmaccel.data.haystack`).
    """
    from mmaccel.data.haystack import CHAT_QUESTION_TEMPLATE, QUESTION_TEMPLATE, make_niah_sample, resolve_chat_template

    sample = make_niah_sample(tokenizer, int(length), float(depth), seed=int(seed), chat_template=False,
                              haystack=haystack)
    needle = sample.needles[0]
    plain_q = needle.question(QUESTION_TEMPLATE)
    q_ids = tokenizer.encode("\n" + plain_q, add_special_tokens=False)
    start = 1 if tokenizer.bos_token_id is not None and sample.input_ids[0] == tokenizer.bos_token_id else 0
    document = tokenizer.decode(sample.input_ids[start: len(sample.input_ids) - len(q_ids)])
    use_chat = resolve_chat_template(tokenizer, "auto")
    question = needle.question(CHAT_QUESTION_TEMPLATE) if use_chat else plain_q
    return document.strip(), question, sample.answer
