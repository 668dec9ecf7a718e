"""Progressive in-LLM pruning: one in-LLM method applied at several decoder layers, each stage pruning among the
tokens the earlier ones kept (the multi-stage schedules of MustDrop and AIM)."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from .adapters import VLMParts, _attach_outer, _RunState
from .base import VisionTokenMethod, _hook, check_keep_ratio, kept_count
from .in_llm import LayerPruner

__all__ = ["Progressive", "parse_numbers"]


def parse_numbers(value: Any, cast: type, name: str, example: str) -> list:
    """A list of numbers from a list / tuple or a comma-separated string (``"2,8"``, ``"0.5,0.25"``).

    Raises
    ------
    ValueError
        If ``value`` is empty or an entry is not a number of type ``cast`` (the message shows ``example``).
    """
    items = value
    if isinstance(value, str):
        items = [p for p in value.replace(" ", "").split(",") if p]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        items = [value]
    try:
        if not isinstance(items, (list, tuple)) or not items or any(isinstance(v, bool) for v in items):
            raise ValueError
        out = [cast(v) for v in items]
        if cast is int and any(float(v) != o for v, o in zip(items, out)):
            raise ValueError
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        raise ValueError(f"{name} must be a non-empty list of {cast.__name__}s such as {example!r}, "
                         f"got {value!r}") from None
    return out


def resolve_pruner(method: Any) -> LayerPruner:
    """The wrapped in-LLM method: an instance, a registry name, or a nested spec with commas for colons
    (``"fastv,window=4"``, the nesting syntax of :mod:`mmaccel.specs` / ``longctx.Chunked``).

    Raises
    ------
    ValueError
        If it is not an in-LLM method (:class:`~.in_llm.LayerPruner`): the message lists the ones that are.
    """
    from .registry import METHODS, build_method

    if isinstance(method, str):
        method = build_method(method.replace(",", ":"))
    if not isinstance(method, LayerPruner):
        choices = ", ".join(n for n, cls in METHODS.items() if issubclass(cls, LayerPruner))
        raise ValueError(  # noqa: TRY004 - a bad spec value, reported like every other one
            f"progressive: method must be an in-LLM method (one of: {choices}), got {method!r}")
    return method


@dataclass(init=False)
class Progressive(VisionTokenMethod):
    """Multi-stage in-LLM pruning: ``Progressive(FastV(), layers=[2, 8], keep_ratios=[0.5, 0.25])``.

    The wrapped in-LLM method runs once per stage: at decoder layer ``layers[i]`` it keeps ``keep_ratios[i]`` of
    the *original* visual tokens, choosing among those the earlier stages kept (a token removed at one stage stays
    removed), scored at layer ``layers[i] - 1`` of the reduced sequence. Kept tokens keep their original positions
    (1-D or Qwen2-VL's 3-D M-RoPE ids); each stage's layers hold only its kept tokens in the KV cache, through
    decoding. This is the progressive schedule of MustDrop (Liu et al., "Multi-Stage Vision Token Dropping: Towards
    Efficient Multimodal Large Language Model", 2024, arXiv 2411.10803) and of AIM's in-LLM pruning (Zhong et al.,
    "AIM: Adaptive Inference of Multi-Modal LLMs via Token Merging and Pruning", 2024, arXiv 2412.03248), here as a
    wrapper over any scorer (FastV's attention, ATP's adaptive mass rule).

    Spec form: ``progressive:method=fastv,window=4:layers=2,8:keep_ratio=0.25`` (the nested method with commas for
    colons; ``keep_ratio`` the final ratio, spread geometrically: 0.5 at layer 2, 0.25 at layer 8).

    Parameters
    ----------
    method : LayerPruner or str
        The in-LLM method of every stage (default ``"fastv"``), or its spec with commas for colons. Its ``layer``
        and ``keep_ratio`` are replaced per stage; its other fields (``window``, ATP's ``mass``) are kept.
    layers : str or list of int
        Strictly increasing decoder layers ``K_1 < K_2 < ...``, each >= 1 and below the model's depth (default
        ``"2,8"``).
    keep_ratios : str or list of float, optional
        Fraction of the original visual tokens left after each stage, in (0, 1], non-increasing, one per layer.
        Default: the geometric schedule ``keep_ratio ** (i / n)`` for stage ``i`` of ``n``.
    keep_ratio : float, optional
        Fraction of the visual tokens left after the last stage, in (0, 1] (default ``keep_ratios[-1]``, else 1.0).
        At 1.0 the model's outputs are unchanged (for a wrapped ATP only with ``mass=1.0``: its budget is
        adaptive, and ``keep_ratio`` is then each stage's cap).

    Attributes
    ----------
    stages : list of LayerPruner
        One copy of ``method`` per layer; ``stages[i].telemetry`` is what stage ``i`` did in the last prefill.
    telemetry : dict
        ``layers``, ``keep_ratios``, ``image_tokens_before``, ``image_tokens_per_stage`` (after each stage, per
        row), ``image_tokens_after``, ``sequence_before`` / ``sequence_after`` (tokens the LLM got / the last
        stage's layers hold), ``kept_positions`` [B, K] (indices into the sequence the LLM got), ``stages`` (the
        stage telemetries). A new dict after each stage of a prefill (a record taken earlier is never changed).
    on_telemetry : callable or None
        Called with ``telemetry`` after each stage (how :class:`~.aim.AIM` files it under ``telemetry["in_llm"]``).

    Raises
    ------
    ValueError
        If ``layers`` is not a strictly increasing list of ints >= 1, ``keep_ratios`` / ``keep_ratio`` is outside
        (0, 1], increasing, of the wrong length or contradicts ``keep_ratio``, or ``method`` is not an in-LLM method.
    UnsupportedModelError
        From ``apply``, if a stage's layer is outside the model or the model is not LLaVA-style / Qwen2-VL.

    Notes
    -----
    Stage ``i``'s budget is set at run time to ``kept_count(n, keep_ratios[i])`` of the ``n`` original visual
    tokens, as a ratio of what stage ``i - 1`` kept, so the counts are exact whatever the rounding (and capped at
    what is left when an adaptive stage kept fewer). Composes with a pre-LLM method like any in-LLM one (it then
    prunes among the tokens the pre-LLM method kept).
    """

    method: Any = "fastv"
    layers: Any = "2,8"
    keep_ratios: Any = None
    stages: list = field(default_factory=list, init=False, repr=False, compare=False)
    on_telemetry: Any = field(default=None, init=False, repr=False, compare=False)

    name: ClassVar[str] = "progressive"
    stage: ClassVar[str] = "in-llm"
    paper: ClassVar[str] = "MustDrop (Liu et al., 2024, arXiv 2411.10803) / AIM (Zhong et al., 2024, arXiv 2412.03248)"

    def __init__(self, method: object = "fastv", layers: str | list = "2,8", keep_ratios: str | list | None = None,
                 keep_ratio: float | None = None) -> None:
        self.method, self.layers, self.keep_ratios, self.keep_ratio = method, layers, keep_ratios, keep_ratio
        self.telemetry, self._image_plans, self.stages, self.on_telemetry = {}, [], [], None
        self.__post_init__()

    def __post_init__(self) -> None:
        layers = parse_numbers(self.layers, int, "layers", "2,8")
        if layers[0] < 1 or any(b <= a for a, b in itertools.pairwise(layers)):
            raise ValueError(f"layers must be strictly increasing decoder layers >= 1, e.g. '2,8'; got {self.layers!r}")
        if self.keep_ratios is not None:
            ratios = [check_keep_ratio(r, "keep_ratios entry")
                      for r in parse_numbers(self.keep_ratios, float, "keep_ratios", "0.5,0.25")]
            if len(ratios) != len(layers) or any(b > a for a, b in itertools.pairwise(ratios)):
                raise ValueError(f"keep_ratios must give one non-increasing ratio per layer ({len(layers)}), "
                                 f"got {self.keep_ratios!r}")
            if self.keep_ratio is not None and check_keep_ratio(self.keep_ratio) != ratios[-1]:
                raise ValueError(f"keep_ratio={self.keep_ratio!r} contradicts keep_ratios={self.keep_ratios!r}: "
                                 "give one of them, or keep_ratio equal to the last keep_ratios entry")
        else:
            final = check_keep_ratio(1.0 if self.keep_ratio is None else self.keep_ratio)
            ratios = [final ** ((i + 1) / len(layers)) for i in range(len(layers))]
            ratios[-1] = final
        inner = resolve_pruner(self.method)
        self.method, self.layers, self.keep_ratios, self.keep_ratio = inner, layers, ratios, ratios[-1]
        self.stages = [dataclasses.replace(inner, layer=k, keep_ratio=ratios[0] if i == 0 else 1.0)
                       for i, k in enumerate(layers)]

    def supports(self, model: nn.Module) -> str | None:
        for stage in self.stages:
            reason = stage.supports(model)
            if reason is not None:
                return f"the stage at layer {stage.layer}: {reason}"
        return None

    def _attach(self, model: nn.Module, undo: list) -> None:
        parts = VLMParts.find(model)
        state = _RunState()
        _attach_outer(parts, state, undo)  # this prefill's visual-token mask, before any pruning
        run: dict = {"seen": [None] * len(self.stages)}
        for i, stage in enumerate(self.stages):
            stage._attach(model, undo)
            # runs after stage i built its plan at its layer, before stage i + 1 scores
            _hook(undo, parts.lm.layers[stage.layer], self._after_stage(i, parts.lm, state, run), pre=True)

        def forget():
            if hasattr(parts.lm, "_mmaccel_visual_mask"):
                del parts.lm._mmaccel_visual_mask

        undo.append(forget)

    def _after_stage(self, i: int, lm: nn.Module, state: _RunState, run: dict):
        """The bookkeeping after stage ``i``'s plan: which of its kept tokens are visual (for stage ``i + 1``, through
        the language model's ``_mmaccel_visual_mask``, the base's record for composed methods), stage ``i + 1``'s
        budget, and the telemetry."""
        stage = self.stages[i]

        def pre(module, args, kwargs):
            t = stage.telemetry
            if t is run["seen"][i] or "kept_positions" not in t:  # a decode step or an image-free forward
                return
            run["seen"][i] = t
            index = torch.tensor(t["kept_positions"], device=next(lm.parameters()).device)
            if i == 0:
                visual = state.pending["image_mask"]
                if visual.shape[1] != t["sequence_before"]:  # a pre-LLM method ran first: its record (as the base)
                    visual = lm._mmaccel_visual_mask
                run.update(visual=visual.to(index.device), kept=index, counts=[], first=t)
            else:
                run["kept"] = run["kept"].gather(1, index)
            run["visual"] = run["visual"].gather(1, index)
            lm._mmaccel_visual_mask = run["visual"]
            run["counts"] = run["counts"][:i] + [t["image_tokens_after"]]
            n0 = run["first"]["image_tokens_before"]
            if i + 1 < len(self.stages):
                self.stages[i + 1].keep_ratio = self._next_ratio(i, n0, t["image_tokens_after"])
            self.telemetry = {
                "method": self.name, "stage": self.stage, "inner": self.method.name, "layers": list(self.layers),
                "keep_ratios": list(self.keep_ratios), "image_tokens_before": n0,
                "image_tokens_per_stage": list(run["counts"]), "image_tokens_after": t["image_tokens_after"],
                "sequence_before": run["first"]["sequence_before"], "sequence_after": t["sequence_after"],
                "kept_positions": run["kept"].tolist(), "stages": [s.telemetry for s in self.stages[: i + 1]]}
            if self.on_telemetry is not None:
                self.on_telemetry(self.telemetry)

        return pre

    def _next_ratio(self, i: int, n0: int | list, left: int | list) -> float:
        """Stage ``i + 1``'s keep_ratio over the ``left`` tokens stage ``i`` kept, so that it keeps
        ``kept_count(n0, keep_ratios[i + 1])`` of the ``n0`` original ones. Per-row counts (rows with different
        numbers of visual tokens) fall back to the ratio of the two stages' ratios."""
        if isinstance(n0, list) or isinstance(left, list):
            return min(1.0, self.keep_ratios[i + 1] / self.keep_ratios[i])
        if not left:
            return 1.0
        return min(1.0, kept_count(n0, self.keep_ratios[i + 1]) / left)
