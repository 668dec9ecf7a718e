"""mmaccel.vision_tokens: visual-token pruning and merging for ViTs and vision-language models.

>>> method = build_method("fastv:keep_ratio=0.25:layer=2")
>>> with method.apply(model):
...     out = model.generate(**inputs, max_new_tokens=16, do_sample=False)

Stages: ``vision`` (inside the ViT: ToMe), ``pre-llm`` (between projector and LLM: pooling, VisionZip, PruMerge,
temporal ToMe for video, AIM's iterative merging),
``in-llm`` (inside the decoder: FastV, ATP's adaptive budget, Progressive multi-layer schedules over either).
``METHODS`` is the registry the CLI and the app list; adding a method is one file and one line here. Every method takes
``keep_ratio`` in (0, 1]; at 1.0 the model's outputs are unchanged (ATP: ``keep_ratio`` is a cap on its adaptive
budget, and only ``mass=1.0`` with it leaves the model unchanged).
"""
from __future__ import annotations

from ..models.parts import vit_layers
from .adapters import VLMParts
from .aim import AIM, iterative_merge_plan
from .atp import ATP, adaptive_keep, image_segments, mass_count
from .base import ImageGrid, UnsupportedModelError, VisionTokenMethod, check_keep_ratio, kept_count
from .batched_tower import BatchedTower, BatchedVisionEncoding
from .fastv import FastV
from .in_llm import LayerPruner
from .plan import TokenPlan
from .pooling import Pooling, pooled_grid, pooling_plan
from .pre_llm import ImageReducer, lift_to_sequence
from .progressive import Progressive, parse_numbers
from .prumerge import PruMerge, iqr_outliers, prumerge_plan
from .registry import METHODS, build_method
from .shared_encoding import SharedVisionEncoding, reads_tower_output_only
from .temporal import TemporalToMe, temporal_merge_plan
from .tome import ToMe, bipartite_soft_matching, parse_schedule
from .visionzip import VisionZip, visionzip_plan

METHODS.update({
    "pooling": Pooling,
    "tome": ToMe,
    "visionzip": VisionZip,
    "prumerge": PruMerge,
    "fastv": FastV,
    "temporal-tome": TemporalToMe,
    "aim": AIM,
    "atp": ATP,
    "progressive": Progressive,
})




__all__ = [
    "AIM",
    "ATP",
    "METHODS",
    "BatchedTower",
    "BatchedVisionEncoding",
    "FastV",
    "ImageGrid",
    "ImageReducer",
    "LayerPruner",
    "Pooling",
    "Progressive",
    "PruMerge",
    "SharedVisionEncoding",
    "TemporalToMe",
    "ToMe",
    "TokenPlan",
    "UnsupportedModelError",
    "VLMParts",
    "VisionTokenMethod",
    "VisionZip",
    "adaptive_keep",
    "bipartite_soft_matching",
    "build_method",
    "check_keep_ratio",
    "image_segments",
    "iqr_outliers",
    "iterative_merge_plan",
    "kept_count",
    "lift_to_sequence",
    "mass_count",
    "parse_numbers",
    "parse_schedule",
    "pooled_grid",
    "pooling_plan",
    "prumerge_plan",
    "reads_tower_output_only",
    "temporal_merge_plan",
    "visionzip_plan",
    "vit_layers",
]
