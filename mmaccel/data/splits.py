"""Fixed train/test splits for the seeded generators: disjoint ranges of generator seeds.

Every scene and clip is a pure function of one integer seed. A split owns a range of seeds, so a held-out item can
never be drawn for training, whatever ``seed`` and ``n`` the caller passes.
"""
from __future__ import annotations

#: Items one (split, seed) pair can hold: item ``i`` of split ``s`` and seed ``k`` uses the generator seed
#: ``SPLIT_OFFSETS[s] + k * MAX_ITEMS + i``.
MAX_ITEMS = 1 << 20
#: Seeds a split can take: ``0 <= seed < MAX_SEEDS``.
MAX_SEEDS = 1 << 20
#: First generator seed of each split; each split spans ``MAX_SEEDS * MAX_ITEMS`` (2**40) seeds.
SPLIT_OFFSETS = {"train": 0, "test": MAX_SEEDS * MAX_ITEMS}


def split_seed(split: str, seed: int, index: int) -> int:
    """The generator seed of item ``index`` of ``split`` drawn with ``seed``.

    Parameters
    ----------
    split : {"train", "test"}
    seed : int
        Which draw of the split, ``0 <= seed < MAX_SEEDS``; draws with different seeds may share items only within a
        split (never across).
    index : int
        Item number, ``0 <= index < MAX_ITEMS``.

    Returns
    -------
    int
        A seed for :func:`mmaccel.data.scenes.make_scene` or :func:`mmaccel.data.clips.make_clip`; the ranges of
        ``"train"`` and ``"test"`` are disjoint.

    Raises
    ------
    ValueError
        For an unknown split, or ``seed`` / ``index`` out of range.
    """
    if split not in SPLIT_OFFSETS:
        raise ValueError(f"unknown split {split!r}; use one of {sorted(SPLIT_OFFSETS)}")
    if not 0 <= seed < MAX_SEEDS:
        raise ValueError(f"seed must be in [0, {MAX_SEEDS}), got {seed}")
    if not 0 <= index < MAX_ITEMS:
        raise ValueError(f"at most {MAX_ITEMS} items per split and seed; item {index} is out of range")
    return SPLIT_OFFSETS[split] + seed * MAX_ITEMS + index


def split_of(generator_seed: int) -> str:
    """The split whose range holds ``generator_seed`` (the inverse of :func:`split_seed`).

    Raises
    ------
    ValueError
        If the seed is in no split's range (negative, or past the last split).
    """
    span = MAX_SEEDS * MAX_ITEMS
    for name, offset in SPLIT_OFFSETS.items():
        if offset <= generator_seed < offset + span:
            return name
    raise ValueError(f"generator seed {generator_seed} belongs to no split")
