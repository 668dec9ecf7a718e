"""mmaccel.eval: measured generation, the NIAH harness and side-by-side comparisons.

- :func:`generate_measured` -- the one generation path; returns a :class:`RunRecord` per run.
- :func:`measure_pipeline`, :func:`compare_pieces` -- a :class:`mmaccel.Pipeline` measured, whole or piece by piece.
- :func:`compare` -- several methods on one input -> :class:`Comparison` (table + JSON).
- :func:`run_niah` -- a length x depth NIAH sweep -> ``results.jsonl``, ``summary.json``, heatmaps.
"""
from ..data.haystack import (
    NEEDLE_TEMPLATE,
    QUESTION_TEMPLATE,
    HaystackTokens,
    NIAHSample,
    make_niah_sample,
    score_answer,
)
from .compare import Comparison, compare
from .generation import RunRecord, generate_measured, measure_pipeline
from .niah import NIAHResult, run_niah
from .pieces import compare_pieces

__all__ = [
    "NEEDLE_TEMPLATE",
    "QUESTION_TEMPLATE",
    "Comparison",
    "HaystackTokens",
    "NIAHResult",
    "NIAHSample",
    "RunRecord",
    "compare",
    "compare_pieces",
    "generate_measured",
    "make_niah_sample",
    "measure_pipeline",
    "run_niah",
    "score_answer",
]
