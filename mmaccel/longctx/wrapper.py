"""The shared part of the scorer wrappers (:class:`~mmaccel.longctx.adakv.AdaKV`,
:class:`~mmaccel.longctx.chunkkv.ChunkKV`): the wrapped scorer decides what a slot is worth and how many a layer
keeps; the wrapper decides which slots that buys.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .base import KVScorer, LayerStep
from .chunked import resolve_inner


@dataclass(init=False)
class ScorerWrapper(KVScorer):
    """Base of the wrappers over a :class:`~mmaccel.longctx.base.KVScorer` given as an object or a nested spec.

    The wrapped scorer's budget, ratio, layer budgets (PyramidKV), decode-time eviction (H2O), per-step state
    (:meth:`observe`) and minimum budget are used unchanged; a subclass writes :meth:`score` (and, if it stores the
    K/V differently, ``make_layer``/``make_cache``/``compress``) and calls :meth:`resolve` from ``__post_init__``.

    Parameters
    ----------
    method : KVScorer or str
        The wrapped scorer or its spec with commas for colons (``"snapkv,budget=256"``).
    budget, ratio
        Taken from the wrapped scorer. Given on a wrapper whose method is a spec naming neither
        (``adakv:ratio=0.25``, ``chunkkv:method=snapkv:budget=64``), they are passed to the method; otherwise they must
        equal its own.

    Raises
    ------
    ValueError
        From :meth:`resolve`: the method is not a scorer, or is itself a wrapper (AdaKV, ChunkKV), or budget/ratio
        disagree with the scorer's.
    """

    method: object = "snapkv"

    def resolve(self) -> None:
        """Build the wrapped scorer from ``method`` and take its budget and ratio (see the class for the errors)."""
        inner = resolve_inner(self.method, self.method_name)
        if not isinstance(inner, KVScorer) or isinstance(inner, ScorerWrapper):
            # a wrapper over a wrapper would run one of them silently wrong: ChunkKV over AdaKV drops AdaKV's
            # per-head storage; AdaKV over ChunkKV allocates by ranks, which are not comparable across heads
            raise ValueError(  # noqa: TRY004 - a bad spec value, reported like every other one
                f"{self.method_name} wraps a scored method (snapkv, pyramidkv, h2o, tova, knorm, streaming), "
                f"got {inner.name}")
        given = {name: getattr(self, name) for name in ("budget", "ratio") if getattr(self, name) is not None}
        if given and isinstance(self.method, str) and not any(f"{n}=" in self.method for n in ("budget", "ratio")):
            # adakv:ratio=0.25 (the wrapped method named without its own budget): the wrapper's budget is the method's
            inner = dataclasses.replace(inner, budget=given.get("budget"), ratio=given.get("ratio"))
        for name in ("budget", "ratio"):
            mine = getattr(self, name)
            if mine is not None and mine != getattr(inner, name):
                raise ValueError(
                    f"{self.method_name}: {name}={mine} differs from the wrapped method's ({getattr(inner, name)}); "
                    f"set it on the method, e.g. {self.method_name}:method={inner.name},{name}={mine}")
        self.method = inner
        self.budget, self.ratio = inner.budget, inner.ratio

    def own_spec(self) -> str:
        """The wrapper's own arguments as ``":key=value..."`` (the spec adds them after the nested method)."""
        return ""

    @property
    def spec(self) -> str:
        return f"{self.method_name}:method={self.method.spec.replace(':', ',')}{self.own_spec()}"

    @property
    def evicts_on_decode(self) -> bool:
        return self.method.evicts_on_decode

    @property
    def prefill_is_full(self) -> bool:
        """The wrapped scorer's: a wrapper only changes which slots are kept."""
        return self.method.prefill_is_full

    # the wrapped scorer decides what and how much
    def observe(self, step: LayerStep) -> None:
        self.method.observe(step)

    def min_budget(self, step: LayerStep) -> int:
        return self.method.min_budget(step)

    def layer_budget(self, step: LayerStep) -> int:
        return self.method.layer_budget(step)
