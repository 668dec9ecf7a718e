"""Moved to :mod:`mmaccel.data.haystack`, with the other synthetic tasks; this module re-exports it.

Import from :mod:`mmaccel.data.haystack` in new code. The names below are the same objects (not copies), so
``mmaccel.eval.haystack.make_niah_sample is mmaccel.data.haystack.make_niah_sample``.
"""
from mmaccel.data.haystack import *
from mmaccel.data.haystack import (  # noqa: F401
    ANSWER_PREFIX_TEMPLATE,
    CHAT_INSTRUCTION,
    CHAT_QUESTION_TEMPLATE,
    NEEDLE_TEMPLATE,
    QUESTION_TEMPLATE,
    HaystackTokens,
    Needle,
    NIAHSample,
    __all__,
    chat_wrapper_ids,
    is_memorable_number,
    make_niah_sample,
    prose_stream,
    random_needles,
    resolve_chat_template,
    score_answer,
    score_answer_contains,
    stdlib_paragraphs,
)
