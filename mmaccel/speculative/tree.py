"""Token-tree speculative decoding: a draft model proposes a tree of continuations, the target verifies every branch
in one forward with a tree attention mask, and the cache keeps only the accepted path.

The plan of a step (computed once per tree shape, applied to the draft and to the target):

- **Tree.** Node 0 is the root, the pending token (the last committed token, whose K/V the target has not seen);
  nodes ``1 .. N`` are draft tokens in breadth-first order, every parent before its children. The static shape
  ``3,2,2`` gives the root 3 children, each of those 2 and each of those 2 (3 + 6 + 12 = 21 nodes); a child of rank
  ``r`` is the draft's ``r``-th most likely token after its parent (SpecInfer's and Medusa's static trees; Medusa's
  "choices" are :meth:`TokenTree.from_paths`). :class:`DynamicDraftTree` grows the tree by draft confidence.
- **Mask and positions.** Node ``i`` attends the whole committed prefix, its ancestors and itself
  (:func:`ancestor_mask`, turned into the ``[1, 1, N + 1, S + N + 1]`` mask of
  :func:`mmaccel.kernels.tree.tree_attention_mask`); its RoPE position is the root's position plus its depth. The mask
  goes to the model's forward as a custom 4-D ``attention_mask`` (transformers 5 passes a 4-D mask through as is:
  boolean for SDPA-style attention, additive float for eager; :func:`model_tree_mask`).
- **Acceptance.** Walking from the root, the target picks its token at the current node (greedy: the argmax); if a
  child carries that token the walk moves there, otherwise the picked token is the correction and the step ends; at
  a leaf it is the bonus token. The accepted path is the longest root-to-leaf path whose every token equals the
  target's choice at its parent. Siblings carry distinct tokens, so at most one child matches.
- **Cache compaction.** The verification forward appended ``N + 1`` slots; the slots of the root and of the accepted
  nodes are moved to the front of that block and the rest cropped (:func:`keep_cache_slots`), so the cache equals
  what sequential decoding of the committed tokens would have written. The draft model's cache is compacted the same
  way.

Sampling (``temperature > 0``) is exact too, by construction: at every node the walk draws the token from the
target's own (filtered) distribution and only moves down when a child matches it -- ancestral sampling from the
target, with the tree deciding how many draws one forward serves. The children are the draft's top-k (deterministic
given the context), so SpecInfer's multi-step speculative sampling reduces to this walk for one-hot ``q``; its
variant for children *sampled* from ``q``, which accepts more often, is not built.

Batch size 1 only (the drafters refuse more rows).

References
----------
Miao et al., "SpecInfer: Accelerating Generative Large Language Model Serving with Tree-based Speculative Inference
and Verification", 2023, arXiv 2305.09781.
Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads", 2024, arXiv 2401.10774.
Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", 2024, arXiv 2401.15077.
Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees", 2024, arXiv 2406.16858.
Xiong et al., "DySpec: Faster Speculative Decoding with Dynamic Token Tree Structure", 2024, arXiv 2410.11744.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

from ..kernels.hf import cache_kwarg
from ..kernels.tree import tree_attention_mask
from .base import Draft, crop_cache
from .draft_model import DraftModel
from .sampling import Sampler


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """Ancestor-or-self relation of a tree whose parents come before their children.

    Parameters
    ----------
    parents : sequence of int
        ``parents[i]`` for nodes ``0 .. n - 1``; ``parents[0] = -1`` (the root), ``0 <= parents[i] < i`` otherwise.

    Returns
    -------
    torch.Tensor
        bool [n, n]: ``[i, j]`` is True when node ``j`` is node ``i`` or one of its ancestors (who node ``i`` attends
        in SpecInfer's tree attention, Miao et al., 2023, arXiv 2305.09781).
    """
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


@dataclass(frozen=True)
class TokenTree:
    """The shape of a token tree: who is whose parent, and which of the draft's candidates each node takes.

    Static trees of SpecInfer (Miao et al., 2023, arXiv 2305.09781) and Medusa (Cai et al., 2024, arXiv 2401.10774);
    EAGLE's draft trees (Li et al., 2024, arXiv 2401.15077) have the same layout.

    Attributes
    ----------
    parents : tuple of int
        ``N + 1`` entries; node 0 is the root (the pending token, ``parents[0] = -1``), nodes ``1 .. N`` are draft
        tokens in breadth-first order (``parents[i] < i``, depths non-decreasing).
    ranks : tuple of int
        ``N + 1`` entries: node ``i`` is its parent's ``ranks[i]``-th most likely next token under the draft (0 = the
        argmax); distinct among siblings. ``ranks[0] = 0``.

    Raises
    ------
    ValueError
        Parents that do not precede their children, depths that decrease along the node order, ranks that are
        negative or repeat among siblings, or lengths that differ.
    """

    parents: tuple
    ranks: tuple

    def __post_init__(self):
        p, r = tuple(int(x) for x in self.parents), tuple(int(x) for x in self.ranks)
        object.__setattr__(self, "parents", p)
        object.__setattr__(self, "ranks", r)
        if len(p) != len(r) or not p or p[0] != -1:
            raise ValueError(f"a token tree needs parents[0] == -1 (the root) and one rank per node, got parents={p}, "
                             f"ranks={r}")
        seen = set()
        for i in range(1, len(p)):
            if not 0 <= p[i] < i or r[i] < 0 or (p[i], r[i]) in seen:
                raise ValueError(f"bad token tree at node {i}: parent {p[i]} must precede it and ranks must be >= 0 "
                                 f"and distinct among siblings (parents={p}, ranks={r})")
            seen.add((p[i], r[i]))
        if list(self.depths) != sorted(self.depths):
            raise ValueError(f"token tree nodes must be in breadth-first order (depths {self.depths})")

    @classmethod
    def from_shape(cls, shape) -> TokenTree:
        """The full tree with ``shape[d]`` children per node at depth ``d`` (top-k branching per depth).

        Parameters
        ----------
        shape : str or sequence of int
            E.g. ``"3,2,2"`` or ``(3, 2, 2)``: 3 root children, 2 children each, 2 each (21 nodes); ``"1,1,1,1"``
            is a chain of 4 (plain speculative decoding). Every entry ``>= 1``.

        Raises
        ------
        ValueError
            An empty shape or an entry that is not an integer ``>= 1``; the message shows the syntax.
        """
        widths = _parse_shape(shape)
        parents, ranks, level = [-1], [0], [0]
        for width in widths:
            nxt = []
            for parent in level:
                for rank in range(width):
                    nxt.append(len(parents))
                    parents.append(parent)
                    ranks.append(rank)
            level = nxt
        return cls(tuple(parents), tuple(ranks))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> TokenTree:
        """A sparse static tree from rank paths, Medusa's "choices" format (Cai et al., 2024, arXiv 2401.10774).

        Parameters
        ----------
        paths : sequence of sequences of int
            Each path lists ranks from the root, e.g. ``[[0], [1], [0, 0], [0, 1], [1, 0]]``; every prefix of a path
            must be a path too.

        Raises
        ------
        ValueError
            A missing prefix, a negative rank or an empty path.
        """
        keys = sorted({tuple(int(r) for r in path) for path in paths}, key=lambda t: (len(t), t))
        index = {(): 0}
        parents, ranks = [-1], [0]
        for key in keys:
            if not key or key[:-1] not in index:
                raise ValueError(f"token tree path {list(key)} is empty or its prefix {list(key[:-1])} is missing; "
                                 "every prefix of a path must be listed (Medusa choices)")
            index[key] = len(parents)
            parents.append(index[key[:-1]])
            ranks.append(key[-1])
        return cls(tuple(parents), tuple(ranks))

    @property
    def size(self) -> int:
        """Draft tokens ``N`` (nodes without the root)."""
        return len(self.parents) - 1

    @cached_property
    def depths(self) -> tuple:
        """Depth of every node, root 0, ``N + 1`` entries."""
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def depth(self) -> int:
        """Longest root-to-leaf path in draft tokens (0 for a root alone)."""
        return self.depths[-1]

    @cached_property
    def children(self) -> tuple:
        """``children[i]``: the node ids whose parent is ``i``, in order."""
        kids = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def mask(self) -> torch.Tensor:
        """bool [N + 1, N + 1] ancestor-or-self mask (:func:`ancestor_mask`), the root included."""
        return ancestor_mask(self.parents)

    def truncate(self, depth: int) -> TokenTree:
        """The nodes of depth ``<= depth`` (a prefix of the node order)."""
        n = sum(1 for d in self.depths if d <= depth)
        return TokenTree(self.parents[:n], self.ranks[:n])

    def describe(self) -> str:
        """``"3,2,2"`` for a full tree (:meth:`from_shape`), else ``"paths:N"``."""
        widths = [len(self.children[0])]
        for d in range(1, self.depth):
            widths.append(len(self.children[self.depths.index(d)]))
        return ",".join(map(str, widths)) if self.size and self == TokenTree.from_shape(widths) else f"paths:{self.size}"


def _parse_shape(shape) -> list[int]:
    parts = str(shape).split(",") if isinstance(shape, (str, int)) else list(shape)
    try:
        widths = [int(str(p).strip()) for p in parts]
    except ValueError:
        widths = []
    if not widths or any(w < 1 for w in widths):
        raise ValueError(f"a tree shape is the branching per depth, integers >= 1 separated by commas, e.g. "
                         f"'3,2,2' (spec tree:shape=3,2,2); got {shape!r}")
    return widths


@dataclass
class TreeDraft(Draft):
    """A token tree proposed for one step (batch 1).

    Attributes
    ----------
    tokens : torch.LongTensor
        [1, N] the draft tokens of nodes ``1 .. N`` (node order of ``tree``).
    tree : TokenTree
        The tree's shape (for a dynamic drafter, the shape grown this step).
    path : tuple of int
        Filled by the engine after verification: the accepted node ids, root excluded, in depth order.
    forwards : int
        Draft-model forward passes spent on the proposal.
    """

    tree: TokenTree | None = None
    path: tuple = ()

    def __post_init__(self):
        if self.tree is None or tuple(self.tokens.shape) != (1, self.tree.size):
            raise ValueError(f"a TreeDraft needs tokens [1, N] matching its tree (N = "
                             f"{None if self.tree is None else self.tree.size}), got {tuple(self.tokens.shape)}")

    @property
    def depth(self) -> int:
        """Tree depth: the most draft tokens one step can accept."""
        return self.tree.depth


def model_tree_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """The custom 4-D ``attention_mask`` the model's attention takes for a boolean "may attend" pattern.

    transformers 5 passes a 4-D mask through unchanged; SDPA-style attention implementations (mask function
    ``sdpa_mask``, e.g. ``"sdpa"`` and mmaccel's ``"mmaccel"``) read it as boolean, ``"eager"`` adds it to the scores.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Its (text) config's ``_attn_implementation`` decides the form.
    allowed : torch.Tensor
        bool [B, 1, q, kv]: True where query ``i`` may attend key ``j``.

    Returns
    -------
    torch.Tensor
        ``allowed`` itself, or float [B, 1, q, kv] in the model's dtype: 0 where allowed, the dtype's minimum
        elsewhere.

    Raises
    ------
    ValueError
        For an attention implementation that takes no custom mask (flash attention, flex attention); the message
        says to load the model with ``attn_implementation="sdpa"`` or ``"eager"``.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS.get(impl)
    if mask_fn is sdpa_mask:
        return allowed
    if mask_fn is eager_mask:
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                           torch.finfo(dtype).min)
    raise ValueError(f"token-tree verification passes a custom 4-D attention mask, which the {impl!r} attention "
                     "implementation does not take; load the model with attn_implementation='sdpa' or 'eager'")


def check_tree_model(model) -> None:
    """Refuse, before any forward, a model that token-tree decoding cannot drive: an attention implementation
    without custom 4-D masks (:func:`model_tree_mask`), or sliding-window layers (a tree's cache compaction needs
    every layer to keep all its slots).

    Raises
    ------
    ValueError
        Naming the reason and the fix.
    """
    model_tree_mask(model, torch.ones(1, 1, 1, 1, dtype=torch.bool))
    _layers(DynamicCache(config=model.config))


def _layers(cache) -> list:
    """The cache's layers, checked: plain ``DynamicLayer`` objects holding the same number of slots."""
    layers = list(getattr(cache, "layers", []))
    odd = [type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer]
    if any(getattr(layer, "is_sliding", False) for layer in layers):
        raise ValueError("token-tree verification needs every layer to keep all its K/V slots, and this model has "
                         "sliding-window layers (DynamicSlidingWindowLayer, not a plain DynamicLayer: "
                         "config.sliding_window / layer_types), which keep only their window; "
                         "use a chain drafter (draft, eagle, prompt_lookup, layer_skip) with this model")
    if odd:
        raise ValueError(f"token-tree verification moves the accepted path's K/V slots inside each cache layer, which "
                         f"needs plain DynamicLayer layers; this cache has {odd[0]} (use a DynamicCache, the 'full' "
                         "KV method)")
    lengths = {int(layer.keys.shape[-2]) for layer in layers if layer.is_initialized}
    if len(lengths) > 1:
        raise ValueError(f"token-tree verification needs every cache layer to hold the same tokens (one tree mask for "
                         f"all layers); the layers hold {sorted(lengths)} slots (a per-layer token reduction?)")
    return layers


def keep_cache_slots(cache, start: int, offsets: Sequence[int]) -> None:
    """Keep, of the cache slots from ``start`` on, only those at ``start + offsets``, moved to ``start, start + 1,
    ...``, and drop the rest: the cache compaction after a token-tree step (SpecInfer, Miao et al., 2023,
    arXiv 2305.09781).

    Parameters
    ----------
    cache : transformers.DynamicCache
        Plain ``DynamicLayer`` layers of equal length ``S``; edited in place.
    start : int
        First slot of the step's block, ``0 <= start <= S``.
    offsets : sequence of int
        Increasing offsets into the block, ``offsets[i] >= i`` (the root ``0`` and the accepted node ids).

    Raises
    ------
    ValueError
        Another layer type, layers of different lengths, or offsets that are not increasing.
    """
    offsets = [int(o) for o in offsets]
    if any(b <= a for a, b in itertools.pairwise(offsets)) or (offsets and offsets[0] < 0):
        raise ValueError(f"cache slot offsets must be increasing and >= 0, got {offsets}")
    for layer in _layers(cache):
        if not layer.is_initialized or not offsets:
            continue
        idx = torch.tensor(offsets, device=layer.keys.device) + start
        j = len(offsets)
        layer.keys[..., start:start + j, :] = layer.keys.index_select(-2, idx)
        layer.values[..., start:start + j, :] = layer.values.index_select(-2, idx)
    crop_cache(cache, start + len(offsets))


@dataclass
class TreeVerification:
    """What one token-tree verification forward decided (batch 1).

    Attributes
    ----------
    path : tuple of int
        Accepted node ids, root excluded, in depth order (``m`` of them).
    tokens : torch.LongTensor
        [1, m] the accepted draft tokens.
    next_token : torch.LongTensor
        [1] the target's token after the path: the correction, or the bonus token at a leaf.
    logits : torch.Tensor
        [1, m + 1, V] the target's logits at the root and at each accepted node.
    """

    path: tuple
    tokens: torch.Tensor
    next_token: torch.Tensor
    logits: torch.Tensor


def walk_tree(logits: torch.Tensor, tokens: Sequence[int], tree: TokenTree, sampler: Sampler,
              generator: torch.Generator | None = None) -> tuple[list, int]:
    """Accept the longest path of the tree that the target would have decoded itself.

    From the root, the target picks its token at the current node (greedy: the argmax; sampling: a draw from
    ``sampler.probs``); the walk moves to the child carrying that token, and stops at the first node where no child
    does (the picked token is the correction) or at a leaf (the bonus token). Greedy, this is SpecInfer's verification
    (Miao et al., 2023, arXiv 2305.09781); sampled, every token is a draw from the target's own distribution given
    the accepted context, so the output is distributed exactly as plain sampling.

    Parameters
    ----------
    logits : torch.Tensor
        [N + 1, V] target logits at the root and at nodes ``1 .. N``.
    tokens : sequence of int
        ``N`` draft tokens of nodes ``1 .. N``.
    tree : TokenTree
        The tree's shape.
    sampler : Sampler
        Greedy or filtered sampling, as in plain decoding.
    generator : torch.Generator, optional
        Randomness for sampling, one draw per visited node.

    Returns
    -------
    path : list of int
        Accepted node ids (root excluded).
    next_token : int
        The target's token after the path.
    """
    greedy = logits.argmax(dim=-1).tolist() if sampler.greedy else None
    node, path = 0, []
    while True:
        pick = greedy[node] if greedy is not None else int(sampler.choose(logits[node:node + 1], generator)[0][0])
        child = next((c for c in tree.children[node] if tokens[c - 1] == pick), None)
        if child is None:
            return path, pick
        path.append(child)
        node = child


def verify_tree(model, cache, pending: torch.Tensor, draft: TreeDraft, start: torch.Tensor, sampler: Sampler,
                generator: torch.Generator | None = None,
                positions: Callable[[torch.Tensor], torch.Tensor] | None = None) -> TreeVerification:
    """Verify a token tree with one target forward and compact the cache to the accepted path.

    Feeds ``[pending, t_1 .. t_N]`` with the tree mask (every node attends the cached prefix, its ancestors and
    itself) and depth-based positions ``start + depth``, accepts the longest matching path (:func:`walk_tree`), then
    keeps the K/V slots of the pending token and the accepted nodes (:func:`keep_cache_slots`). SpecInfer (Miao et
    al., 2023, arXiv 2305.09781), Medusa (Cai et al., 2024, arXiv 2401.10774), EAGLE (Li et al., 2024,
    arXiv 2401.15077).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The target; SDPA-style or eager attention (see :func:`model_tree_mask`).
    cache : transformers.DynamicCache
        The target's cache of ``S`` committed tokens (all but the pending one); edited in place to ``S + 1 + m``.
    pending : torch.LongTensor
        [1, 1] the pending token (the root).
    draft : TreeDraft
        The tree and its tokens [1, N].
    start : torch.LongTensor
        [1, 1] RoPE position of the pending token.
    sampler : Sampler
        Greedy, or the filtered distribution to sample from.
    generator : torch.Generator, optional
        Randomness for sampling.
    positions : callable, optional
        Maps text positions [1, q] to the model's ``position_ids`` (e.g. M-RoPE rows); default identity.

    Returns
    -------
    TreeVerification
        The accepted path, its tokens, the next token and the target's logits along the path.

    Raises
    ------
    ValueError
        Batch size other than 1, a cache that is not plain ``DynamicLayer`` layers of equal length, or an attention
        implementation that takes no custom mask.
    """
    if pending.shape[0] != 1:
        raise ValueError(f"token-tree verification supports batch size 1 only, got {pending.shape[0]} rows; use a "
                         "chain drafter (e.g. draft:model=micro-draft) for batches")
    tree, device = draft.tree, pending.device
    held = cache.get_seq_length()
    _layers(cache)
    step_in = torch.cat([pending, draft.tokens.to(device)], dim=1)  # [1, N + 1]
    allowed = tree_attention_mask(tree.mask.to(device), held, 1)  # [1, 1, N + 1, held + N + 1]
    pos = start + torch.tensor(tree.depths, device=device)[None]
    logits = model(input_ids=step_in, attention_mask=model_tree_mask(model, allowed),
                   position_ids=positions(pos) if positions is not None else pos, **cache_kwarg(model, cache),
                   use_cache=True).logits[0, -(tree.size + 1):]
    tokens = draft.tokens[0].tolist()
    path, nxt = walk_tree(logits, tokens, tree, sampler, generator)
    keep_cache_slots(cache, held, [0] + path)
    rows = torch.tensor([0] + path, device=logits.device)
    return TreeVerification(
        path=tuple(path),
        tokens=torch.tensor([[tokens[i - 1] for i in path]], dtype=torch.long, device=device),
        next_token=torch.tensor([nxt], dtype=torch.long, device=device),
        logits=logits.index_select(0, rows)[None],
    )


def grow_tree(first_logq: torch.Tensor, root_token: int, depth: int, grow, expands, feed):
    """Grow a token tree level by level: the loop every tree drafter shares (SpecInfer, Miao et al., 2023,
    arXiv 2305.09781; EAGLE-2, Li et al., 2024, arXiv 2406.16858).

    Parameters
    ----------
    first_logq : torch.Tensor
        [1, V] float32 draft log-probabilities of the token after the root (the pending token).
    root_token : int
        The pending token (node 0).
    depth : int
        Deepest level, ``>= 1``.
    grow : callable
        ``grow(depth, level, logq, score)`` -> children, as :meth:`TreeDrafter.grow`.
    expands : callable
        ``expands(node)`` -> whether ``node`` may get children.
    feed : callable
        ``feed(level, parents, depths, tokens)`` -> [len(level), V] log-probabilities after each node of ``level``
        (one draft forward over the level with the tree mask).

    Returns
    -------
    (TokenTree, list of int)
        The tree and the tokens of all its nodes (root first).
    """
    parents, ranks, depths, tokens, score = [-1], [0], [0], [int(root_token)], [0.0]
    level, logq = [0], first_logq
    for d in range(1, depth + 1):
        new = []
        for parent, token, rank, s in grow(d, level, logq, score):
            new.append(len(parents))
            parents.append(parent)
            ranks.append(rank)
            depths.append(d)
            tokens.append(token)
            score.append(s)
        level = [n for n in new if d < depth and expands(n)]
        if not level:
            break
        logq = feed(level, parents, depths, tokens)
    return TokenTree(tuple(parents), tuple(ranks)), tokens


def best_children(level: list, logq: torch.Tensor, score: list, width: int, threshold: float | None = None) -> list:
    """EAGLE-2's expansion: the ``width`` children of the whole level with the highest cumulative draft
    log-probability (Li et al., 2024, arXiv 2406.16858), those whose path probability is below ``threshold`` dropped
    (DySpec, Xiong et al., 2024, arXiv 2410.11744).

    Parameters
    ----------
    level, logq, score
        As for :meth:`TreeDrafter.grow`: node ids, [len(level), V] log-probabilities, cumulative scores by node id.
    width : int
        Children kept, ``>= 1``.
    threshold : float, optional
        Minimum path probability in ``(0, 1)``.

    Returns
    -------
    list of (int, int, int, float)
        ``(parent, token, rank, score)``, parents in ``level`` order, siblings by rank.
    """
    top_v, top_i = logq.topk(min(width, logq.shape[-1]), dim=-1)  # [F, W]
    total = top_v + torch.tensor([score[n] for n in level], device=top_v.device)[:, None]
    best = total.flatten().topk(min(width, total.numel())).indices.sort().values  # parent order, then rank
    floor = math.log(threshold) if threshold is not None else -math.inf
    out = []
    for flat in best.tolist():
        r, rank = divmod(flat, top_v.shape[1])
        if float(total[r, rank]) >= floor:
            out.append((level[r], int(top_i[r, rank]), rank, float(total[r, rank])))
    return out


def tree_telemetry(stats: dict | None) -> dict:
    """Mean tree nodes and depth per step and ``path_acceptance_rate`` (accepted draft tokens / depth offered) from
    ``{"steps", "nodes", "depth", "accepted"}`` counts."""
    s = stats or {"steps": 0}
    steps = s["steps"]
    return {"tree_nodes_mean": s["nodes"] / steps if steps else None,
            "tree_depth_mean": s["depth"] / steps if steps else None,
            "path_acceptance_rate": s["accepted"] / s["depth"] if steps and s["depth"] else None}


def count_tree_step(stats: dict, draft: TreeDraft, kept: int) -> None:
    """Add one verified tree step to ``stats`` (see :func:`tree_telemetry`)."""
    stats["steps"] += 1
    stats["nodes"] += draft.tree.size
    stats["depth"] += draft.tree.depth
    stats["accepted"] += kept


class TreeDrafter(DraftModel):
    """Base of the draft-model tree drafters: a draft LM grows a token tree level by level; subclasses say only which
    children each level gets (:meth:`grow`). SpecInfer (Miao et al., 2023, arXiv 2305.09781); EAGLE's tree drafting
    (Li et al., 2024, arXiv 2401.15077), here with a separate draft LM instead of a feature head.

    A proposal costs one draft forward per depth, like a chain of the same depth: the first catches the draft cache
    up to the committed tokens, each next one feeds a whole level of the tree with the tree mask and depth-based
    positions. After verification the draft cache keeps the accepted nodes it has seen and drops the other branches
    (:func:`keep_cache_slots`). The engine's ``num_draft_tokens`` caps the depth; the harness sets it to
    :attr:`depth`.

    Raises
    ------
    ValueError
        At :meth:`begin`: batch size > 1, a vocabulary different from the target's or smaller than :attr:`widest`,
        or an attention implementation that takes no custom mask (:func:`model_tree_mask`).
    """

    name: ClassVar[str] = ""
    observes_any_draft: ClassVar[bool] = False  # its cache keeps the tree nodes of its own last proposal

    @property
    def depth(self) -> int:
        """The deepest path this drafter proposes (the harness's default ``num_draft_tokens``)."""
        raise NotImplementedError

    @property
    def widest(self) -> int:
        """Most candidates one node may need from the draft's distribution."""
        raise NotImplementedError

    def describe(self) -> str:
        """The tree for telemetry."""
        raise NotImplementedError

    def grow(self, depth: int, level: list, logq: torch.Tensor, score: list) -> list:
        """Children of the nodes of one level.

        Parameters
        ----------
        depth : int
            Depth of the children, ``>= 1``.
        level : list of int
            Node ids at ``depth - 1`` that the draft has seen (rows of ``logq``), in node order.
        logq : torch.Tensor
            [len(level), V] float32 draft log-probabilities after each of them.
        score : list of float
            Cumulative draft log-probability of every node so far, indexed by node id (root 0.0).

        Returns
        -------
        list of (int, int, int, float)
            ``(parent node, token, rank, score)`` per child, parents in ``level`` order, siblings by rank.
        """
        raise NotImplementedError

    def expands(self, node: int) -> bool:
        """Whether ``node`` may get children (then the draft must see it); True by default."""
        return True

    def begin(self, target, input_ids, attention_mask, sampler: Sampler) -> None:
        """As :meth:`DraftModel.begin`, after checking batch size 1; then checks that target and draft take a tree
        mask and that the vocabulary has :attr:`widest` tokens.

        Raises
        ------
        ValueError
            Batch size > 1, an attention implementation without custom masks, a too small vocabulary; see also
            :meth:`DraftModel.begin`.
        """
        if input_ids.shape[0] != 1:
            raise ValueError(f"token-tree drafting supports batch size 1 only, got {input_ids.shape[0]} rows; use the "
                             "chain drafter draft:model=... for batches")
        super().begin(target, input_ids, attention_mask, sampler)
        check_tree_model(target)
        check_tree_model(self.model)
        if self.widest > self.model.config.vocab_size:
            raise ValueError(f"the tree branches into {self.widest} tokens but the vocabulary has "
                             f"{self.model.config.vocab_size}")
        self._stats = {"steps": 0, "nodes": 0, "depth": 0, "accepted": 0}

    def _feed(self, nodes: list, parents: list, depths: list, tokens: list, root_pos: torch.Tensor) -> torch.Tensor:
        """One draft forward over ``nodes`` with the tree mask; returns their float32 log-probs [F, V]."""
        device = root_pos.device
        seen = self._fed + nodes
        cols = ancestor_mask(parents)[nodes][:, seen].to(device)
        allowed = torch.cat([torch.ones(len(nodes), self._base, dtype=torch.bool, device=device), cols], dim=1)
        logits = self.model(input_ids=torch.tensor([[tokens[n] for n in nodes]], device=device),
                            attention_mask=model_tree_mask(self.model, allowed[None, None]),
                            position_ids=root_pos + torch.tensor([[depths[n] for n in nodes]], device=device),
                            **cache_kwarg(self.model, self._cache), use_cache=True).logits[0]
        self._forwards += 1
        self._fed = seen
        return logits.float().log_softmax(dim=-1)

    def propose(self, sequences, attention_mask, k, sampler, generator=None) -> TreeDraft:
        """Draft a tree of depth ``<= k`` after ``sequences`` [1, T] (the last token pending).

        Returns
        -------
        TreeDraft
            Tokens [1, N] and the tree grown this step; ``probs`` is ``None`` (the children are chosen from the
            draft's ranking, deterministic given the context).
        """
        device = next(self.model.parameters()).device
        seq, mask = sequences.to(device), attention_mask.to(device)
        forwards0 = self._forwards
        held = self._cache.get_seq_length()
        T = seq.shape[1]
        logq = self._forward(seq[:, held:], T, mask)[:, -1].float().log_softmax(dim=-1)  # [1, V] after the pending
        self._base, self._fed = self._cache.get_seq_length(), []
        root_pos = self._positions(T - 1, T)
        tree, tokens = grow_tree(logq, int(seq[0, -1]), min(k, self.depth), self.grow, self.expands,
                                 lambda level, parents, depths, tokens: self._feed(level, parents, depths, tokens,
                                                                                   root_pos))
        self._proposed += tree.size
        return TreeDraft(tokens=torch.tensor([tokens[1:]], dtype=torch.long, device=device), tree=tree,
                         forwards=self._forwards - forwards0)

    def observe(self, target_logits, draft, kept: int) -> None:
        """Keep in the draft cache the committed tokens and the accepted nodes it has seen; drop other branches."""
        if not isinstance(draft, TreeDraft):  # a step the engine ran without drafting (the last token)
            super().observe(target_logits, draft, kept)
            return
        slot = {node: i for i, node in enumerate(self._fed)}
        keep_cache_slots(self._cache, self._base, [slot[n] for n in draft.path if n in slot])
        count_tree_step(self._stats, draft, kept)

    def end(self) -> dict:
        """Draft telemetry plus the tree: its description, mean nodes and depth per step, and
        ``path_acceptance_rate`` (accepted draft tokens / depth offered)."""
        telemetry = super().end()
        telemetry.update(tree=self.describe(), **tree_telemetry(getattr(self, "_stats", None)))
        return telemetry


class DraftTree(TreeDrafter):
    """A static token tree from a draft model: each node branches into the draft's top-k tokens, ``k`` set per depth
    by the shape (SpecInfer, Miao et al., 2023, arXiv 2305.09781; Medusa's static trees, Cai et al., 2024,
    arXiv 2401.10774; EAGLE, Li et al., 2024, arXiv 2401.15077). Spec: ``tree:model=micro-draft:shape=3,2,2``.

    Parameters
    ----------
    model : str or transformers.PreTrainedModel
        The draft LM (see :class:`DraftModel`).
    shape : str, sequence of int or TokenTree
        Branching per depth (``"3,2,2"``, :meth:`TokenTree.from_shape`; ``"1,1,1"`` is a chain of 3) or a tree of
        rank paths (:meth:`TokenTree.from_paths`).
    tokenizer, target_tokenizer : tokenizer, optional
        As for :class:`DraftModel`.

    Raises
    ------
    ValueError
        A malformed or empty shape; see also :meth:`TreeDrafter.begin`.
    """

    name: ClassVar[str] = "tree"

    def __init__(self, model="micro-draft", shape="3,2,2", tokenizer=None, target_tokenizer=None):
        super().__init__(model, tokenizer=tokenizer, target_tokenizer=target_tokenizer)
        self.tree = shape if isinstance(shape, TokenTree) else TokenTree.from_shape(shape)
        if self.tree.size == 0:
            raise ValueError("a token tree needs at least one draft token")

    @property
    def depth(self) -> int:
        """The tree's depth."""
        return self.tree.depth

    @property
    def widest(self) -> int:
        """One more than the largest rank in the tree."""
        return max(self.tree.ranks) + 1

    def describe(self) -> str:
        """``"3,2,2"`` or ``"paths:N"``."""
        return self.tree.describe()

    def grow(self, depth, level, logq, score) -> list:
        """The shape's nodes at ``depth``, each the ``rank``-th draft token after its parent (see
        :meth:`TreeDrafter.grow`)."""
        tree = self.tree
        kids = [i for i, d in enumerate(tree.depths) if d == depth]
        top_v, top_i = logq.topk(max(tree.ranks[i] for i in kids) + 1, dim=-1)
        row = {node: r for r, node in enumerate(level)}
        out = []
        for i in kids:
            parent, rank = tree.parents[i], tree.ranks[i]
            out.append((parent, int(top_i[row[parent], rank]), rank, score[parent] + float(top_v[row[parent], rank])))
        return out

    def expands(self, node) -> bool:
        """Whether the shape gives ``node`` children (node ids follow the shape's order)."""
        return bool(self.tree.children[node])


class DynamicDraftTree(TreeDrafter):
    """A draft tree grown by draft confidence each step: at every depth the ``width`` children with the highest
    cumulative draft probability among all children of the previous level (EAGLE-2's expansion, Li et al., 2024,
    arXiv 2406.16858), optionally only those whose path probability reaches ``threshold`` (DySpec's expansion by
    confidence, Xiong et al., 2024, arXiv 2410.11744): confident contexts get deep narrow trees, uncertain ones
    shallow wide ones. Spec: ``dytree:model=micro-draft:width=4:depth=5``.

    Parameters
    ----------
    model : str or transformers.PreTrainedModel
        The draft LM.
    width : int
        Nodes per depth, ``>= 1``.
    depth : int
        Deepest level, ``>= 1``.
    threshold : float, optional
        Minimum path probability (product of the draft's probabilities along the path) of a node, in ``(0, 1)``;
        growth stops at a depth where no candidate reaches it.
    tokenizer, target_tokenizer : tokenizer, optional
        As for :class:`DraftModel`.

    Raises
    ------
    ValueError
        ``width`` or ``depth`` not an integer ``>= 1``, ``threshold`` outside ``(0, 1)``; see also
        :meth:`TreeDrafter.begin`.
    """

    name: ClassVar[str] = "dytree"

    def __init__(self, model="micro-draft", width: int = 4, depth: int = 5, threshold: float | None = None,
                 tokenizer=None, target_tokenizer=None):
        for key, value in (("width", width), ("depth", depth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dytree: {key} must be an integer >= 1, got {value!r}; e.g. dytree:width=4:depth=5")
        if threshold is not None and not 0.0 < float(threshold) < 1.0:
            raise ValueError(f"dytree: threshold must be in (0, 1) or None, got {threshold!r}")
        super().__init__(model, tokenizer=tokenizer, target_tokenizer=target_tokenizer)
        self.width, self.max_depth, self.threshold = width, depth, threshold

    @property
    def depth(self) -> int:
        """The deepest level grown."""
        return self.max_depth

    @property
    def widest(self) -> int:
        """``width``: one node may give all of a level's children."""
        return self.width

    def describe(self) -> str:
        """``"dynamic(width=W, depth=D, threshold=T)"``."""
        return f"dynamic(width={self.width}, depth={self.max_depth}, threshold={self.threshold})"

    def grow(self, depth, level, logq, score) -> list:
        """The ``width`` best children of the whole level by cumulative draft log-probability, those below
        ``threshold`` dropped (see :meth:`TreeDrafter.grow`)."""
        return best_children(level, logq, score, self.width, self.threshold)
