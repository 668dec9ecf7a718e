"""EAGLE-2: the EAGLE head drafts a token tree grown by its own confidence; the target verifies it in one forward.

Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees", 2024, arXiv 2406.16858.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .base import Draft
from .eagle import Eagle
from .sampling import Sampler
from .tree import TreeDraft, ancestor_mask, best_children, check_tree_model, count_tree_step, grow_tree, tree_telemetry


class EagleTree(Eagle):
    """EAGLE-2's dynamic draft tree (Li et al., 2024, arXiv 2406.16858) from a trained EAGLE head (:class:`Eagle`).

    Each step the head catches up on the verified columns (as the chain drafter does), then grows a tree level by
    level: at every depth the ``width`` children of the whole level with the highest cumulative head probability
    (:func:`~mmaccel.speculative.tree.best_children`). A level costs one head forward over its nodes, each reading
    its parent's predicted feature and attending the committed columns, its ancestors and itself (a tree mask on the
    head's own cache). The target verifies the whole tree in one forward (:func:`~mmaccel.speculative.verify_tree`);
    the head keeps the true features of the pending token and the accepted path and drops its own predictions. A tree
    pays where verifying many nodes costs about what one token does (a GPU); on a 2-core CPU with prepacked linear
    layers, width 4 and depth 4 raise ``smollm2-135m``'s accepted length from 1.51 to 1.89 but a 17-token
    verification costs 1.3x a 4-token one and every level a head forward, so it ran at 1.01x against the chain's
    1.18x (``benchmarks/results/speculative/smollm2_eagle_tree/``). Spec: ``eagle_tree:width=4:depth=5`` (``head=``
    as for ``eagle``).

    Greedy and sampled decoding are exact: the children are the head's top-ranked tokens (deterministic given the
    context) and the target walks the tree with its own distribution (:func:`~mmaccel.speculative.walk_tree`).
    Batch size 1 only, as every tree drafter.

    Parameters
    ----------
    head : str, path or EagleHead
        A trained head (default ``"smollm2-135m-eagle"``).
    width : int
        Nodes per depth, ``>= 1`` (EAGLE-2 keeps the best 10 of a level; its default tree totals 60 nodes).
    depth : int
        Deepest level, ``>= 1`` (the harness's default draft length).
    threshold : float, optional
        Minimum path probability (product of the head's probabilities along the path) in ``(0, 1)``.

    Raises
    ------
    ValueError
        ``width`` or ``depth`` not an integer ``>= 1``, ``threshold`` outside ``(0, 1)``, an unknown head; at
        :meth:`begin`, batch size > 1, a target whose attention takes no custom mask, or a head made for another
        target.
    """

    name: ClassVar[str] = "eagle_tree"

    def __init__(self, head="smollm2-135m-eagle", width: int = 4, depth: int = 5, threshold: float | None = None):
        for key, value in (("width", width), ("depth", depth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"eagle_tree: {key} must be an integer >= 1, got {value!r}; e.g. "
                                 "eagle_tree:width=4:depth=5")
        if threshold is not None and not 0.0 < float(threshold) < 1.0:
            raise ValueError(f"eagle_tree: threshold must be in (0, 1) or None, got {threshold!r}")
        super().__init__(head)
        self.width, self.max_depth, self.threshold = width, depth, threshold
        self._stats = None

    @property
    def depth(self) -> int:
        """The deepest level grown."""
        return self.max_depth

    def describe(self) -> str:
        """``"eagle2(width=W, depth=D, threshold=T)"``."""
        return f"eagle2(width={self.width}, depth={self.max_depth}, threshold={self.threshold})"

    def begin(self, target, input_ids, attention_mask, sampler: Sampler) -> None:
        """As :meth:`Eagle.begin`, after checking batch size 1; then :func:`check_tree_model` on the target."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"token-tree drafting supports batch size 1 only, got {input_ids.shape[0]} rows; use the "
                             "chain drafter eagle:k=... for batches")
        super().begin(target, input_ids, attention_mask, sampler)
        check_tree_model(target)
        self._stats = {"steps": 0, "nodes": 0, "depth": 0, "accepted": 0}

    def _logq(self, features: torch.Tensor) -> torch.Tensor:
        """[F, H] predicted features -> [F, V] float32 log-probabilities over the target's vocabulary (``-inf``
        outside the head's sub-vocabulary)."""
        sub = self.head.logits(features, self._lm_weight).float().log_softmax(dim=-1)  # [F, V']
        full = sub.new_full((sub.shape[0], self.head.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.head.vocab_ids, sub)

    def propose(self, sequences, attention_mask, k, sampler, generator=None) -> Draft:
        """Draft a tree of depth ``<= k`` after ``sequences`` [1, T] (the last token pending); a plain empty
        :class:`~mmaccel.speculative.Draft` while the head has no target feature yet (a one-token prompt)."""
        head = self.head
        T = sequences.shape[1]
        P = self._cache.length
        if not self._feats:
            return Draft(tokens=sequences.new_zeros(1, 0))
        feats = torch.cat(self._feats, dim=1) if len(self._feats) > 1 else self._feats[0]
        self._feats = []
        if feats.shape[1] != T - 1 - P:
            raise RuntimeError(f"EAGLE head out of step: {feats.shape[1]} new target features for columns {P}..{T - 2}")
        emb = self._embed(sequences[:, P + 1:T])
        root = head(feats.to(emb.dtype), emb, self._positions(P, T - 1), self._cache)[0, -1]  # predicted f_{T-1}
        self._true_length = base = T - 1
        column = self._positions(T - 1, T)  # [1, 1] the column of a depth-1 node
        predicted = {0: root}  # node -> its predicted feature (which ranks its children)
        fed: list[int] = []
        forwards = 1

        def feed(level, parents, depths, tokens):
            nonlocal fed, forwards
            seen = fed + level
            cols = ancestor_mask(parents)[level][:, seen].to(root.device)
            allowed = torch.cat([torch.ones(len(level), base, dtype=torch.bool, device=root.device), cols], dim=1)
            x = torch.stack([predicted[parents[n]] for n in level])[None]
            tok = torch.tensor([[tokens[n] for n in level]], device=sequences.device)
            pos = column + torch.tensor([[depths[n] - 1 for n in level]], device=column.device)
            out = head(x, self._embed(tok), pos, self._cache, allowed[None, None])[0]
            predicted.update(zip(level, out))
            fed, forwards = seen, forwards + 1
            return self._logq(out)

        tree, tokens = grow_tree(self._logq(root[None]), int(sequences[0, -1]), min(k, self.max_depth),
                                 lambda d, level, logq, score: best_children(level, logq, score, self.width,
                                                                             self.threshold),
                                 lambda node: True, feed)
        self._forwards += forwards
        self._proposed += tree.size
        return TreeDraft(tokens=torch.tensor([tokens[1:]], dtype=torch.long, device=sequences.device), tree=tree,
                         forwards=forwards)

    def observe(self, target_logits, draft, kept: int) -> None:
        """Keep the true features of the pending token and the accepted path; drop the head's own predictions."""
        if not isinstance(draft, TreeDraft):  # an empty step (no feature yet), or a cascade's chain draft
            super().observe(target_logits, draft, kept)
            return
        self._cache.crop(self._true_length)
        if self._captured is not None:
            rows = torch.tensor([0, *draft.path], device=self._captured.device)
            self._feats.append(self._captured.index_select(1, rows))
            self._captured = None
        count_tree_step(self._stats, draft, kept)

    def end(self) -> dict:
        """:meth:`Eagle.end`'s telemetry plus the tree's (:func:`~mmaccel.speculative.tree.tree_telemetry`)."""
        telemetry = super().end()
        telemetry.update(tree=self.describe(), **tree_telemetry(self._stats))
        return telemetry
