"""Word lists from a maintained package (``wonderwords``), shared by the RULER tasks and the calibration haystacks."""
from __future__ import annotations

import functools

__all__ = ["word_list"]


@functools.cache
def word_list(*categories: str) -> tuple[str, ...]:
    """Sorted lowercase alphabetic words of ``wonderwords``' default lists (``"noun"``, ``"adjective"``, ``"verb"``).

    Raises
    ------
    ModuleNotFoundError
        If ``wonderwords`` is not installed (a main dependency of mmaccel).
    """
    from wonderwords import RandomWord

    words = RandomWord().filter(include_categories=list(categories or ("noun", "adjective", "verb")),
                                exclude_with_spaces=True)
    return tuple(sorted({w for w in words if w.isalpha() and w.islower() and w.isascii()}))
