"""The prompt sets of the speculative-decoding bench (Spec-Bench-style, Xia et al., 2024, arXiv:2401.07851): free
prompts, where a drafter must predict text it has not seen, and copy-heavy tasks, where the answer repeats the
prompt. Shared by :mod:`mmaccel.eval.specbench` (evaluation) and :mod:`mmaccel.zoo.train.eagle` (which trains on
other prompts, never these).
"""
from __future__ import annotations

import random

#: the free prompts (one chat turn each)
FREE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works to someone who has just started programming.",
    "What are three good habits for writing maintainable code? Explain each briefly.",
    "Describe a walk through a city market on a rainy morning.",
    "Give some advice to a student preparing for their first job interview.",
    "Why does the sky look blue during the day and red at sunset?",
    "Write a friendly email inviting a colleague to a team lunch on Friday.",
    "Compare travelling by train and by plane for a 500 km trip.",
)

#: (task, instruction, answer lead) of the copy-heavy prompts
COPY_TASKS = (
    ("edit", "Correct the spelling mistakes in the following text. Reply with the corrected text only.",
     "Corrected text:"),
    ("repeat", "Repeat the following text exactly, then add one sentence that summarises it.", "Text:"),
    ("summarise", "Summarise the following text, quoting its most important sentence word for word.", "Summary:"),
)


def add_typos(text: str, rng: random.Random) -> str:
    """Swap two inner letters of about every sixth word of >= 5 letters (the errors an edit prompt fixes).

    Parameters
    ----------
    text : str
    rng : random.Random
        Seeded generator (the same seed gives the same typos).

    Returns
    -------
    str
        ``text`` with some words misspelt; words split on single spaces.
    """
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) >= 5 and w.isalpha() and rng.random() < 1 / 6:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)
