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

from dataclasses import dataclass, field


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
        alpha = min(self.alpha, 1.0 - 1e-6)
        best, best_rate = self.min_tokens, -1.0
        for k in range(self.min_tokens, self.max_tokens + 1):
            rate = (1.0 - alpha ** (k + 1)) / (1.0 - alpha) / (1.0 + (self.draft_cost + self.verify_cost) * k)
            if rate > best_rate + 1e-12:
                best, best_rate = k, rate
        self._k = best
        self.history.append(best)


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
