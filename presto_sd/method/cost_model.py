"""The verifier's cost model: seconds of one tree forward against tree size and context.

    c(n, ctx) = a + s * [n > 1] + b * n + c * ctx + d * n * ctx / 1024    (n = tree tokens, root included)

On a CPU the forward grows with the tree (the ``b`` term: every node is a full token of
matmuls) and with the context (attention reads the KV cache: ``c`` for the queries
every forward has, ``d`` for each extra node). ``s`` is the step from one token to a
tree: BLAS runs a one-row matmul as a matrix-vector product, which streams the weights
once at memory speed, and two or more rows as a matrix product that costs more per
pass (SmolLM2 on this machine's 2 cores: 39 ms for 1 token, 58 ms for 2, 58 ms for 8;
docs/taps.md). On a GPU ``s``, ``b`` and ``d`` are near zero up to hundreds of nodes.
TAPS (``presto_sd.method.taps``) sizes trees with it.

``OnlineCostModel`` fits the five coefficients from measured forwards: a Huber-weighted,
non-negative least squares over a sliding window (robust to a noisy neighbour stealing a
core), pulled toward a warm start (a start-up calibration or the verifier's own fit) so
that a few observations at one tree size cannot swing the slope, while a full window of
them can. Pure numpy: no model in here.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

_CTX_SCALE = 1024.0  # the n * ctx term per 1k context tokens keeps coefficients O(1e-3)


@dataclass(frozen=True)
class CostFit:
    """The coefficients of ``c(n, ctx)`` in seconds, and how many forwards they rest on."""

    intercept_s: float
    per_node_s: float
    per_context_s: float
    per_node_context_s: float  # per node per 1024 context tokens
    tree_s: float = 0.0  # added once to every forward of more than one token
    n_obs: int = 0

    def __post_init__(self) -> None:
        if not all(math.isfinite(c) and c >= 0 for c in self.coeffs):
            raise ValueError(f"cost: coefficients {self.coeffs} must be finite and >= 0")

    @property
    def coeffs(self) -> tuple[float, float, float, float, float]:
        """In the order of the constructor (and of the fit's design columns)."""
        return (self.intercept_s, self.per_node_s, self.per_context_s, self.per_node_context_s, self.tree_s)

    def seconds(self, n_nodes: int | np.ndarray, context: int) -> float | np.ndarray:
        """Predicted forward time for trees of ``n_nodes`` tokens (root included)."""
        a, b, c, d, s = self.coeffs
        tree = np.asarray(n_nodes) > 1
        return a + s * tree + b * n_nodes + c * context + d * n_nodes * context / _CTX_SCALE

    def marginal_node_s(self, context: int) -> float:
        """Seconds one more node adds to a tree that has two or more already."""
        return self.per_node_s + self.per_node_context_s * context / _CTX_SCALE


def _design(n: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    return np.stack([np.ones_like(n), n, ctx, n * ctx / _CTX_SCALE, (n > 1).astype(n.dtype)], axis=1)


def fit_cost(
    n_nodes: np.ndarray,
    context: np.ndarray,
    seconds: np.ndarray,
    prior: CostFit | None = None,
    prior_weight: float = 4.0,
    huber_k: float = 1.5,
    iters: int = 8,
) -> CostFit:
    """Robust (Huber IRLS) non-negative least squares, pulled toward ``prior``.

    The prior counts as ``prior_weight`` pseudo-observations at the data's own points (a
    ridge ``(k / N) X'X`` toward it): it outweighs a handful of forwards and fades as the
    window fills; a faint ridge keeps the directions the data never spans (one tree size,
    one context) at the prior. Coefficients are fitted >= 0 exactly (a bigger tree or
    context is never cheaper): clipping after the solve would wreck collinear pairs such
    as the intercept and the context term when the context barely varies.
    """
    n = np.asarray(n_nodes, dtype=np.float64)
    ctx = np.asarray(context, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if len(y) == 0:
        if prior is None:
            raise ValueError("fit_cost: no observations and no prior")
        return prior
    x = _design(n, ctx)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-9)  # the ridge treats the terms alike
    xs = x / scale
    k = x.shape[1]
    theta0 = np.array(prior.coeffs) * scale if prior is not None else np.zeros(k)
    ridge = 1e-6 * np.eye(k)
    if prior is not None:
        ridge = ridge + (prior_weight / len(y)) * (xs.T @ xs)
    w = np.ones(len(y))
    theta = theta0
    for _ in range(iters):
        xtw = xs.T * w
        theta = _nonneg_quadratic_min(xtw @ xs + ridge, xtw @ y + ridge @ theta0)
        r = y - xs @ theta
        # MAD scale, floored at 2% of a forward: exact data must not make every point an outlier
        s = max(1.4826 * np.median(np.abs(r - np.median(r))), 0.02 * float(np.median(np.abs(y))), 1e-9)
        a = np.abs(r) / s
        w = np.where(a <= huber_k, 1.0, huber_k / np.maximum(a, 1e-12))
    coeffs = theta / scale
    return CostFit(*(float(c) for c in coeffs), n_obs=len(y) + (prior.n_obs if prior else 0))


def _nonneg_quadratic_min(h: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ``t'Ht - 2b't`` over ``t >= 0`` for a small positive-definite ``H``.

    The optimum solves the unconstrained problem on its free coordinates, so the best
    feasible solution over all 2^k free sets is exact.
    """
    k = len(b)
    full = np.linalg.solve(h, b)
    if np.all(full >= 0):  # the usual case: no constraint binds, one solve
        return full
    best, best_f = np.zeros(k), 0.0
    for mask in range(1, 2**k - 1):
        free = [i for i in range(k) if mask >> i & 1]
        t = np.zeros(k)
        t[free] = np.linalg.solve(h[np.ix_(free, free)], b[free])
        if np.all(t >= 0):
            f = t @ h @ t - 2 * b @ t
            if f < best_f:
                best, best_f = t, f
    return best


class OnlineCostModel:
    """A sliding window of measured forwards, refit every ``refit_every`` observations."""

    def __init__(self, prior: CostFit | None = None, window: int = 256, refit_every: int = 16) -> None:
        self.prior = prior
        self.obs: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.refit_every = refit_every
        self._since_fit = 0
        self._fit = prior

    def observe(self, n_nodes: int, context: int, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds > 0) or n_nodes < 1 or context < 0:
            return  # a clock glitch must not poison the window
        self.obs.append((n_nodes, context, seconds))
        self._since_fit += 1
        if self._fit is None or self._since_fit >= self.refit_every:
            self._refit()

    def _refit(self) -> None:
        n, ctx, s = (np.array(col) for col in zip(*self.obs))
        self._fit = fit_cost(n, ctx, s, self.prior)
        self._since_fit = 0

    @property
    def fit(self) -> CostFit | None:
        return self._fit


class MovingAverage:
    """An exponential moving average (a round's draft seconds, commit seconds, savings)."""

    def __init__(self, alpha: float = 0.2, initial: float | None = None) -> None:
        self.alpha, self.value = alpha, initial  # None: the first observation starts it

    def observe(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


class RollingMedian:
    """The median of the last ``window`` observations (0 before any): a link's round trip,
    which one GC pause or retransmit must not move. Read far more often than observed (every
    round of every request, every orchestrator call), so the median is kept, not recomputed."""

    def __init__(self, window: int = 31) -> None:
        self._obs: deque[float] = deque(maxlen=window)
        self.count = 0  # observations ever made
        self.value = 0.0

    def observe(self, x: float) -> None:
        if math.isfinite(x):
            self._obs.append(max(0.0, x))
            self.count += 1
            self.value = statistics.median(self._obs)
