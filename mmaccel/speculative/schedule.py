"""Draft length per step: fixed, or adapted to the running acceptance rate.

The adaptive rule estimates the per-token acceptance rate ``alpha`` from the steps seen so far (exponentially
decayed counts, as PEARL and SpecDec++ adapt the length to how well the draft is doing right now) and picks the draft
length ``k`` that maximises expected tokens per unit of cost, the criterion of Leviathan et al. (Section 3.5):

    E[tokens | k] = (1 - alpha^(k+1)) / (1 - alpha),      cost(k) = 1 + (draft_cost + verify_cost) * k,

where ``draft_cost`` is the cost of one draft token and ``verify_cost`` the extra cost of one more token in the
verification forward, both relative to a one-token target forward.

References
----------
Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding", 2023, arXiv 2211.17192.
Liu et al., "PEARL: Parallel Speculative Decoding with Adaptive Draft Length", 2024, arXiv 2408.11850.
Huang, Guo, Wang, "SpecDec++: Boosting Speculative Decoding via Adaptive Candidate Lengths", 2024, arXiv 2405.19715.
"""
from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass, field

import torch


@dataclass
class AdaptiveDraftLength:
    """Choose each step's draft length from the running acceptance rate (Leviathan et al., 2023, arXiv 2211.17192,
    Sec. 3.5 criterion; adaptive in the spirit of PEARL, arXiv 2408.11850, and SpecDec++, arXiv 2405.19715).

    Pass an instance as ``num_draft_tokens`` to :func:`mmaccel.speculative.speculative_generate`. It keeps state
    across the steps of one call; :meth:`reset` is called at the start of every call.

    Parameters
    ----------
    start : int
        Draft length of the first step, ``>= 1``.
    min_tokens, max_tokens : int
        Bounds of the draft length, ``1 <= min_tokens <= max_tokens``.
    draft_cost : float
        Cost of one draft token relative to one target forward, ``>= 0`` (0 for model-free drafters; about the
        parameter ratio for a draft model).
    verify_cost : float
        Extra cost of one more token in a verification forward relative to a one-token forward, ``>= 0``
        (about 0.05 on a CPU for small models: 8 tokens cost 1.4x one).
    decay : float
        Weight of the past in the acceptance counts per step, in ``(0, 1]`` (1 = plain running mean).

    Raises
    ------
    ValueError
        For bounds that are not ``1 <= min_tokens <= start <= max_tokens``, negative costs or a decay outside
        ``(0, 1]``.
    """

    start: int = 4
    min_tokens: int = 1
    max_tokens: int = 16
    draft_cost: float = 0.1
    verify_cost: float = 0.05
    decay: float = 0.8
    history: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not (isinstance(self.min_tokens, int) and isinstance(self.max_tokens, int) and isinstance(self.start, int)
                and 1 <= self.min_tokens <= self.start <= self.max_tokens):
            raise ValueError(
                f"adaptive draft length needs integers 1 <= min_tokens <= start <= max_tokens, got min_tokens="
                f"{self.min_tokens}, start={self.start}, max_tokens={self.max_tokens}"
            )
        if self.draft_cost < 0 or self.verify_cost < 0 or not 0 < self.decay <= 1:
            raise ValueError("draft_cost and verify_cost must be >= 0 and decay in (0, 1]")
        self.reset()

    def reset(self) -> None:
        """Forget the acceptance seen so far (start of a generation)."""
        self._accepts = 0.0
        self._rejects = 0.0
        self._k = self.start
        self.history = []

    @property
    def alpha(self) -> float:
        """Current estimate of the per-token acceptance probability (Laplace-smoothed), in ``(0, 1)``."""
        return (self._accepts + 1.0) / (self._accepts + self._rejects + 2.0)

    def next_length(self) -> int:
        """The draft length to use for the next step."""
        return self._k

    def update(self, proposed: int, accepted: int) -> None:
        """Record one step: ``accepted`` of ``proposed`` draft tokens were kept (a rejection if fewer).

        Parameters
        ----------
        proposed, accepted : int
            Draft tokens proposed and kept in the step, ``0 <= accepted <= proposed``.
        """
        if proposed <= 0:
            return
        self._accepts = self.decay * self._accepts + accepted
        self._rejects = self.decay * self._rejects + (1.0 if accepted < proposed else 0.0)
        self._k = best_draft_length(self.alpha, self.min_tokens, self.max_tokens, self.draft_cost,
                                    self.verify_cost)
        self.history.append(self._k)


def expected_rate(alpha: float, k: int, cost_per_token: float) -> float:
    """Expected tokens per unit of cost of one step that drafts ``k`` tokens (Leviathan et al., 2023,
    arXiv 2211.17192, Sec. 3.5): ``(1 - alpha^(k+1)) / (1 - alpha) / (1 + cost_per_token * k)``.

    Parameters
    ----------
    alpha : float
        Per-token acceptance probability, in ``[0, 1]`` (draft tokens accepted independently, each with ``alpha``).
    k : int
        Draft tokens, ``>= 0``; ``k = 0`` is a plain decoding step (rate 1).
    cost_per_token : float
        Cost of one more draft token (drafting it plus verifying it) relative to a one-token target forward.

    Returns
    -------
    float
        Committed tokens per one-token-forward of cost; above 1 the step beats autoregressive decoding.
    """
    alpha = min(max(float(alpha), 0.0), 1.0 - 1e-9)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha) / (1.0 + cost_per_token * k)


def best_draft_length(alpha: float, min_tokens: int, max_tokens: int, draft_cost: float = 0.0,
                      verify_cost: float = 0.05) -> int:
    """The draft length in ``min_tokens .. max_tokens`` with the most expected tokens per unit of cost
    (:func:`expected_rate`; Leviathan et al., 2023, arXiv 2211.17192, Sec. 3.5). With ``min_tokens = 0`` it answers
    0 when no draft pays for its verification (SmartSpec's per-request length ``0 .. k``, arXiv 2406.14066).

    Parameters
    ----------
    alpha : float
        Per-token acceptance probability, in ``[0, 1]``.
    min_tokens, max_tokens : int
        Bounds, ``0 <= min_tokens <= max_tokens``.
    draft_cost, verify_cost : float
        Cost of drafting / verifying one more token relative to a one-token target forward, ``>= 0``.

    Returns
    -------
    int
        The best length; the shortest one on ties.
    """
    cost = draft_cost + verify_cost
    best, best_rate = min_tokens, -1.0
    for k in range(min_tokens, max_tokens + 1):
        rate = expected_rate(alpha, k, cost)
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return best


def check_draft_length(num_draft_tokens) -> None:
    """Validate ``num_draft_tokens`` (the draft length gamma of Leviathan et al., 2023, arXiv 2211.17192): an int
    ``>= 1`` or an :class:`AdaptiveDraftLength`.

    Raises
    ------
    ValueError
        For a draft length ``<= 0`` or of another type; the message names the fix.
    """
    if isinstance(num_draft_tokens, AdaptiveDraftLength):
        return
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens <= 0:
        raise ValueError(
            f"num_draft_tokens must be an int >= 1 or an AdaptiveDraftLength, got {num_draft_tokens!r}; "
            "pass e.g. num_draft_tokens=4"
        )


def parse_costs(costs) -> list[float]:
    """A verification cost table from a list of numbers or a spec string ``"1.03,1.19,1.67"``: entry ``i`` is the
    cost of verifying ``i + 1`` draft tokens relative to a one-token target forward.

    Raises
    ------
    ValueError
        For anything but a non-empty list of positive numbers.
    """
    values = costs.replace(";", ",").split(",") if isinstance(costs, str) else costs
    try:
        table = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"verify_costs must be positive numbers such as '1.03,1.19,1.67', got {costs!r}") from None
    if not table or any(not v > 0 for v in table):
        raise ValueError(f"verify_costs must be a non-empty list of positive numbers, got {costs!r}")
    return table


@torch.inference_mode()
def _filled_cache(model, context: int, gen: torch.Generator):
    """A fresh cache holding ``context`` random tokens of ``model``: ``(cache, device, vocab)``."""
    from transformers import DynamicCache

    from ..kernels.hf import cache_kwarg

    device = next(model.parameters()).device
    vocab = int(model.config.get_text_config().vocab_size)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(0, vocab, (1, context), generator=gen).to(device), **cache_kwarg(model, cache),
          use_cache=True)
    return cache, device, vocab


def _timed_forward(model, filled, n: int, context: int, gen: torch.Generator, now) -> float:
    """Seconds (by the clock ``now``) of one forward of ``n`` random tokens after the ``context`` tokens of
    ``filled`` (:func:`_filled_cache`), synchronised on CUDA; the cache is cropped back after it."""
    from ..kernels._common import synchronize
    from ..kernels.hf import cache_kwarg

    cache, device, vocab = filled
    ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
    synchronize(device)
    t0 = now()
    model(input_ids=ids, position_ids=torch.arange(context, context + n, device=device)[None],
          **cache_kwarg(model, cache), use_cache=True)
    synchronize(device)
    spent = now() - t0
    cache.crop(-n)
    return spent


def measure_verify_costs(model, *, max_draft: int = 24, context: int = 256, repeats: int = 5,
                         clock: str = "wall", sparse: bool = False) -> list[float]:
    """Measure what verifying ``k`` draft tokens costs on this machine: the time of one target forward of ``k + 1``
    tokens over a cached context, over the time of a one-token forward (the ``cost(k)`` of Leviathan et al., 2023,
    arXiv 2211.17192, Sec. 3.5, measured instead of assumed linear).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The target (random token ids are fed; no output is used).
    max_draft : int
        Longest draft measured, ``>= 1``.
    context : int
        Cached tokens before the measured forwards, ``>= 1``.
    repeats : int
        Interleaved rounds over all lengths; the median per length is kept, ``>= 1``.
    clock : {"wall", "cpu"}
        ``"cpu"`` (process time) is steadier on a shared machine with one thread; ``"wall"`` is what a user waits.
    sparse : bool
        Measure only drafts of 1, 2, 4, 8, ... and ``max_draft`` tokens and interpolate linearly in between (about
        ``log2(max_draft)`` forwards per round instead of ``max_draft``).

    Returns
    -------
    list of float
        ``max_draft`` relative costs (entry ``k - 1`` for ``k`` draft tokens), for ``PromptLookup(verify_costs=...)``.

    Raises
    ------
    ValueError
        For arguments out of range.
    """
    if max_draft < 1 or context < 1 or repeats < 1 or clock not in ("wall", "cpu"):
        raise ValueError("need max_draft, context, repeats >= 1 and clock 'wall' or 'cpu'")
    now = time.perf_counter if clock == "wall" else time.process_time
    gen = torch.Generator().manual_seed(0)
    filled = _filled_cache(model, context, gen)
    drafts = sorted({2 ** i for i in range(max_draft.bit_length()) if 2 ** i <= max_draft} | {max_draft}) \
        if sparse else list(range(1, max_draft + 1))
    times: dict[int, list] = {n: [] for n in [1] + [k + 1 for k in drafts]}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for n, spent in times.items():
            spent.append(_timed_forward(model, filled, n, context, gen, now))
    base = statistics.median(times[1][1:])
    measured = {k: statistics.median(times[k + 1][1:]) / base for k in drafts}
    table = []
    for k in range(1, max_draft + 1):
        lo = max(d for d in drafts if d <= k)
        hi = min(d for d in drafts if d >= k)
        w = 0.0 if hi == lo else (k - lo) / (hi - lo)
        table.append(round((1 - w) * measured[lo] + w * measured[hi], 3))
    return table


_MEASURED_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_verify_costs(model, *, max_draft: int = 32, context: int = 256, repeats: int = 3) -> tuple[list, float]:
    """:func:`measure_verify_costs` of ``model`` (wall clock, ``sparse``: drafts of 1, 2, 4, ..., 32 tokens,
    interpolated), measured once per model object and kept while it lives: ``(table, seconds the measurement
    took)``; a table already held returns with ``0.0`` seconds.

    Raises
    ------
    ValueError
        For arguments out of range (:func:`measure_verify_costs`).
    """
    key = (max_draft, context, repeats)
    held = _MEASURED_COSTS.setdefault(model, {})
    if key in held:
        return held[key], 0.0
    start = time.perf_counter()
    held[key] = measure_verify_costs(model, max_draft=max_draft, context=context, repeats=repeats, clock="wall",
                                     sparse=True)
    return held[key], time.perf_counter() - start


_MEASURED_DRAFT_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def measure_draft_cost(draft, target, *, context: int = 256, repeats: int = 5) -> float:
    """What one draft token costs on this machine: the median wall time of a one-token forward of ``draft`` over a
    cached context, over the same for ``target`` (the ``c`` of Leviathan et al., 2023, arXiv 2211.17192, Sec. 3.5,
    measured instead of assumed). The two models' forwards alternate, so a slow spell hits both.

    Parameters
    ----------
    draft, target : transformers.PreTrainedModel
        Random token ids are fed to each; no output is used.
    context : int
        Cached tokens before the measured forwards, ``>= 1``.
    repeats : int
        Measured forwards per model after one warm-up, ``>= 1``.

    Returns
    -------
    float
        Draft seconds over target seconds per one-token forward (e.g. 0.13 for an int8 0.5B draft of a 1.5B).

    Raises
    ------
    ValueError
        For arguments out of range.
    """
    if context < 1 or repeats < 1:
        raise ValueError("need context, repeats >= 1")
    gen = torch.Generator().manual_seed(0)
    models = {"draft": draft, "target": target}
    filled = {name: _filled_cache(m, context, gen) for name, m in models.items()}
    times: dict[str, list] = {name: [] for name in models}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for name, m in models.items():
            times[name].append(_timed_forward(m, filled[name], 1, context, gen, time.perf_counter))
    return statistics.median(times["draft"][1:]) / statistics.median(times["target"][1:])


def cached_draft_cost(draft, target, **kw) -> tuple[float, float]:
    """:func:`measure_draft_cost` of the pair, measured once per (draft, target) objects and kept while the draft
    lives: ``(cost, seconds the measurement took)``; a cost already held returns with ``0.0`` seconds.

    Raises
    ------
    ValueError
        For arguments out of range.
    """
    held = _MEASURED_DRAFT_COSTS.setdefault(draft, {})
    key = (id(target), tuple(sorted(kw.items())))
    if key in held and held[key][0]() is target:
        return held[key][1], 0.0
    start = time.perf_counter()
    cost = measure_draft_cost(draft, target, **kw)
    held[key] = (weakref.ref(target), cost)
    return cost, time.perf_counter() - start


def confidence_stops(draft_cost: float, verify_costs, max_tokens: int) -> list[float]:
    """Cost-based stopping thresholds for a confidence-stopped draft (SpecDec++'s rule with measured costs: Huang,
    Guo, Wang, 2024, arXiv 2405.19715): after ``i`` drafted tokens whose top-1 draft probabilities multiply to
    ``conf``, drafting token ``i + 1`` is worth its cost only if ``conf`` (an upper bound on the chance that it is
    even reached by an accepted prefix) exceeds what it costs, one draft forward plus its share of the verification.

    Parameters
    ----------
    draft_cost : float
        One draft token over one one-token target forward (:func:`measure_draft_cost`), ``>= 0``.
    verify_costs : sequence of float
        Entry ``k - 1``: verifying ``k`` draft tokens over a one-token forward (:func:`measure_verify_costs`); the
        last entry's slope extends it.
    max_tokens : int
        Thresholds to return, ``>= 1``.

    Returns
    -------
    list of float
        Entry ``i - 1``: stop after ``i`` tokens when ``conf`` is below it; ``draft_cost + v(i + 1) - v(i)``.

    Raises
    ------
    ValueError
        ``draft_cost < 0``, ``max_tokens < 1`` or an empty cost table.
    """
    v = [float(c) for c in verify_costs]
    if draft_cost < 0 or max_tokens < 1 or not v:
        raise ValueError("need draft_cost >= 0, max_tokens >= 1 and a non-empty verify cost table")
    v = [1.0] + v  # v[k]: k draft tokens
    step = v[-1] - v[-2] if len(v) > 1 else 0.0
    while len(v) < max_tokens + 2:
        v.append(v[-1] + step)
    return [round(draft_cost + max(v[i + 1] - v[i], 0.0), 4) for i in range(1, max_tokens + 1)]
