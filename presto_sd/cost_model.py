"""The verifier's cost model: seconds of one tree forward against tree size and context.

    c(n, ctx) = a + b * n + c * ctx + d * n * ctx / 1024        (n = tree tokens, root included)

On a CPU the forward grows with the tree (the ``b`` term: every node is a full token of
matmuls) and with the context (attention reads the KV cache: ``c`` for the queries
every forward has, ``d`` for each extra node). On a GPU ``b`` and ``d`` are near zero up
to hundreds of nodes. TAPS (``presto_sd.taps``) sizes trees with it.

``OnlineCostModel`` fits the four coefficients from measured forwards: a Huber-weighted
least squares over a sliding window (robust to a noisy neighbour stealing a core), pulled
toward a warm start (a start-up calibration or the verifier's own fit) so that a few
observations at one tree size cannot swing the slope. Pure numpy: no model in here.
"""

from __future__ import annotations

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
    n_obs: int = 0

    @property
    def coeffs(self) -> tuple[float, float, float, float]:
        return (self.intercept_s, self.per_node_s, self.per_context_s, self.per_node_context_s)

    def seconds(self, n_nodes: int | np.ndarray, context: int) -> float | np.ndarray:
        """Predicted forward time for trees of ``n_nodes`` tokens (root included)."""
        a, b, c, d = self.coeffs
        return a + b * n_nodes + c * context + d * n_nodes * context / _CTX_SCALE


def _design(n: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    return np.stack([np.ones_like(n), n, ctx, n * ctx / _CTX_SCALE], axis=1)


def fit_cost(
    n_nodes: np.ndarray,
    context: np.ndarray,
    seconds: np.ndarray,
    prior: CostFit | None = None,
    prior_weight: float = 4.0,
    huber_k: float = 1.5,
    iters: int = 8,
) -> CostFit:
    """Robust (Huber IRLS) least squares, ridge-pulled toward ``prior``.

    ``prior_weight`` counts as that many pseudo-observations spread over the prior's
    range, so the prior dominates with few points and fades as the window fills.
    Coefficients that would make the cost shrink with the tree are clipped at zero.
    """
    n = np.asarray(n_nodes, dtype=np.float64)
    ctx = np.asarray(context, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    x = _design(n, ctx)
    # scale columns so the ridge treats the four terms alike
    scale = np.maximum(np.abs(x).max(axis=0), 1e-9) if len(y) else np.ones(4)
    xs = x / scale
    theta0 = np.array(prior.coeffs) * scale if prior is not None else np.zeros(4)
    ridge = (prior_weight if prior is not None else 1e-6) * np.eye(4)
    w = np.ones(len(y))
    theta = theta0.copy()
    for _ in range(iters):
        xtw = xs.T * w
        theta = np.linalg.solve(xtw @ xs + ridge, xtw @ y + ridge @ theta0)
        r = y - xs @ theta
        mad = np.median(np.abs(r - np.median(r))) if len(r) else 0.0
        s = max(1.4826 * mad, 1e-6)
        a = np.abs(r) / s
        w = np.where(a <= huber_k, 1.0, huber_k / np.maximum(a, 1e-12))
    coeffs = theta / scale
    coeffs[1:] = np.maximum(coeffs[1:], 0.0)  # never cheaper for a bigger tree or context
    coeffs[0] = max(coeffs[0], 0.0)
    return CostFit(*(float(c) for c in coeffs), n_obs=len(y) + (prior.n_obs if prior else 0))


class OnlineCostModel:
    """A sliding window of measured forwards, refit every ``refit_every`` observations."""

    def __init__(self, prior: CostFit | None = None, window: int = 256, refit_every: int = 8) -> None:
        self.prior = prior
        self.obs: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.refit_every = refit_every
        self._since_fit = 0
        self._fit = prior

    def observe(self, n_nodes: int, context: int, seconds: float) -> None:
        if seconds <= 0 or n_nodes < 1:
            return
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


class DraftTimer:
    """An exponential moving average of the drafter's seconds per round (``t_draft``)."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha, self.value = alpha, None

    def observe(self, seconds: float) -> None:
        self.value = seconds if self.value is None else (1 - self.alpha) * self.value + self.alpha * seconds
