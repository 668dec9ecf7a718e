"""mmaccel.speculative: one draft-and-verify engine with plug-in drafters, lossless where it says so.

>>> from mmaccel.speculative import build_drafter, speculative_generate
>>> out = speculative_generate(model, input_ids, build_drafter("draft:model=micro-draft"), max_new_tokens=64)
>>> out.sequences, out.mean_accepted_length, out.target_forwards

Verification (exact greedy, or lossless speculative sampling -- Leviathan et al., 2023, arXiv 2211.17192; Chen et
al., 2023, arXiv 2302.01318), KV rollback with ``DynamicCache.crop`` and the telemetry live once in
:func:`speculative_generate`; a drafter (:class:`Drafter`) only proposes tokens. Tree drafters (``tree``, ``dytree``:
:mod:`mmaccel.speculative.tree`) propose a token tree that the target verifies in one forward with a tree attention
mask (SpecInfer, Miao et al., 2023, arXiv 2305.09781; Medusa, arXiv 2401.10774; EAGLE, arXiv 2401.15077), batch 1.
``eagle`` drafts with a trained one-layer head over the target's own last hidden states (EAGLE, arXiv
2401.15077; :mod:`mmaccel.speculative.eagle`, trained by ``mmaccel zoo train smollm2-135m-eagle``).
``cascade`` asks drafters in turn (prompt lookup when a copy pays, else EAGLE).
``layer_skip`` drafts with the target itself minus a searched set of decoder layers (Draft & Verify, arXiv
2309.08168; SWIFT, arXiv 2410.06916; :mod:`mmaccel.speculative.layer_skip`); ``prompt_lookup`` copies from the context
and drafts nothing where a copy would not pay for its verification.
``METHODS`` is the registry the CLI and the app list; adding a drafter is one file and one line here. :data:`PEERS`
holds transformers' own speculative paths (``hf_assisted``, ``hf_prompt_lookup``, ``hf_early_exit``);
:func:`build_speculative_method` turns a drafter or peer spec into what
:func:`mmaccel.eval.generation.generate_measured` runs (see :mod:`mmaccel.speculative.harness`).
"""
from __future__ import annotations

from .base import Draft, Drafter, column_positions, crop_cache, left_padding, positions_from_mask
from .cascade import Cascade
from .draft_model import DraftModel, check_same_vocabulary
from .eagle import Eagle, EagleHead, EagleHeadConfig, load_head, save_head
from .eagle_tree import EagleTree
from .engine import SpeculativeOutput, speculative_generate
from .harness import (
    PEERS,
    HFAssisted,
    HFEarlyExit,
    HFPromptLookup,
    SpeculativeMethod,
    TransformersPeer,
    build_speculative_method,
    draft_holders,
    is_speculative_spec,
    share_draft_models,
    speculative_method_names,
)
from .jacobi import Jacobi
from .layer_skip import LayerSkip, SkipSet, available_skip_sets, load_skip_set, search_skip_layers, skipping_layers
from .prompt_lookup import LookupMatch, PromptLookup
from .registry import METHODS, build_drafter
from .sampling import Sampler
from .schedule import AdaptiveDraftLength
from .tree import (
    DraftTree,
    DynamicDraftTree,
    TokenTree,
    TreeDraft,
    TreeDrafter,
    ancestor_mask,
    keep_cache_slots,
    model_tree_mask,
    verify_tree,
    walk_tree,
)
from .verify import residual_distribution, verify_greedy, verify_sampled

METHODS.update({
    "draft": DraftModel,
    "prompt_lookup": PromptLookup,
    "pld": PromptLookup,
    "jacobi": Jacobi,
    "layer_skip": LayerSkip,
    "tree": DraftTree,
    "dytree": DynamicDraftTree,
    "eagle": Eagle,
    "eagle_tree": EagleTree,
    "cascade": Cascade,
})




__all__ = [
    "METHODS",
    "PEERS",
    "AdaptiveDraftLength",
    "Cascade",
    "Draft",
    "DraftModel",
    "DraftTree",
    "Drafter",
    "DynamicDraftTree",
    "Eagle",
    "EagleHead",
    "EagleHeadConfig",
    "EagleTree",
    "HFAssisted",
    "HFEarlyExit",
    "HFPromptLookup",
    "Jacobi",
    "LayerSkip",
    "LookupMatch",
    "PromptLookup",
    "Sampler",
    "SkipSet",
    "SpeculativeMethod",
    "SpeculativeOutput",
    "TokenTree",
    "TransformersPeer",
    "TreeDraft",
    "TreeDrafter",
    "ancestor_mask",
    "available_skip_sets",
    "build_drafter",
    "build_speculative_method",
    "check_same_vocabulary",
    "column_positions",
    "crop_cache",
    "draft_holders",
    "is_speculative_spec",
    "keep_cache_slots",
    "left_padding",
    "load_head",
    "load_skip_set",
    "model_tree_mask",
    "positions_from_mask",
    "residual_distribution",
    "save_head",
    "search_skip_layers",
    "share_draft_models",
    "skipping_layers",
    "speculative_generate",
    "speculative_method_names",
    "verify_greedy",
    "verify_sampled",
    "verify_tree",
    "walk_tree",
]
