"""What a verifier forward costs as a function of the batch it runs: load-aware TAPS.

Alone, TAPS picks the tree that maximises its request's tokens per second,
``(1 + E[T_B]) / (t_draft + c(B + 1))``. In a server the forward is shared: ``L`` other
rows ride in it and commit ``O`` tokens a step, and the forward takes ``C(L + n)`` with
``C(N)`` the seconds of a forward over ``N`` new tokens. The rate that matters is then
the forward's, ``(O + 1 + E[T_B]) / (t_draft + C(L + B + 1))``: the tree's tokens against
what its nodes slow everyone down. On a CPU ``C`` is nearly flat while the weights
stream once (a few rows: trees cost almost nothing, so TAPS grows them) and linear once
compute-bound (many rows: a node costs what an AR row costs, and with ``O`` large the
best tree shrinks to nothing, an AR step). Alone, ``L = O = 0``: TAPS as before.

``BatchCostCurve`` estimates ``C`` online from the batches a replica runs (new tokens,
engine seconds), in log-spaced bins; bins without data take a prior (the verifier's
single-session fit) scaled to the bins that have data, and the prior's per-node cost,
so scaled, is the least a node can cost. ``shared_fit`` hands TAPS ``n -> C(L + n)`` as
a ``CostFit``, so the builder's objective and early stop run unchanged. Pure numpy.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from presto_sd.method.cost_model import CostFit

_BINS = 2.0 ** np.arange(0, 13)  # 1 .. 4096 new tokens per forward
_LOG_BINS = np.log2(_BINS)
_REF = 16  # the linearisation's second point: the marginal cost of this many rows


@dataclass(frozen=True)
class SharedForward:
    """The forward a request's next tree joins: its seconds against the tree's tokens, and
    what the other rows commit per step (TAPS's ``RoundContext.shared_tokens``)."""

    cost: CostFit
    others_tokens: float


class BatchCostCurve:
    """``C(N)``: seconds of a forward over ``N`` new tokens, learnt from observed batches.

    Each log-spaced bin keeps a moving average of its batches' sizes and seconds; ``C``
    interpolates between those points (and the prior's, at bins with no data yet), and
    never decreases with ``N``. Every request reads it every round and the batcher writes
    it once a batch, so the curve is built on the first read after a change and kept.
    """

    def __init__(self, prior: CostFit | None = None, context: int = 256, alpha: float = 0.2) -> None:
        self.context, self.alpha = context, alpha
        self._points: list[tuple[float, float] | None] = [None] * len(_BINS)  # (tokens, seconds)
        self._lock = threading.Lock()
        self._built: _Curve | None = None  # the curve of the points and prior as they are now
        self._prior = prior

    @property
    def prior(self) -> CostFit | None:
        return self._prior

    @prior.setter
    def prior(self, fit: CostFit | None) -> None:
        with self._lock:
            self._prior, self._built = fit, None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        i = _bin(tokens)
        with self._lock:
            old, a = self._points[i], self.alpha
            self._points[i] = (tokens, seconds) if old is None else (
                (1 - a) * old[0] + a * tokens, (1 - a) * old[1] + a * seconds)
            self._built = None

    def _curve(self) -> _Curve | None:
        with self._lock:
            if self._built is None:
                self._built = _build(self._points, self._prior, self.context)
            return self._built if self._built.x.size else None

    def seconds(self, tokens: float) -> float:
        curve = self._curve()
        return float("nan") if curve is None else curve.seconds(tokens)

    def marginal(self, load: int, tokens: int) -> float:
        """Seconds ``tokens`` more rows add to a forward that carries ``load`` already."""
        if load <= 0:
            return self.seconds(tokens)
        return max(0.0, self.seconds(load + tokens) - self.seconds(load))

    def shared_fit(self, load: int) -> CostFit | None:
        """``n -> C(load + n)`` as TAPS's ``CostFit`` (linear in the tree's tokens, through
        ``n = 1`` and ``n = 16``); None until two batch sizes (or a prior) shape the curve.

        The slope is never below the prior's per-node cost at this load's level: noisy
        batches of nearly one size can flatten the curve between them, and a node that
        looks free makes every tree its largest."""
        curve = self._curve()
        if curve is None or np.unique(curve.x).size < 2:  # one point says nothing about slopes
            return None
        one = curve.seconds(load + 1)
        slope = max(0.0, (curve.seconds(load + _REF) - one) / (_REF - 1), curve.node_floor(load + 1))
        return CostFit(intercept_s=max(0.0, one - slope), per_node_s=slope, per_context_s=0.0,
                       per_node_context_s=0.0, tree_s=0.0)


def _bin(tokens: float) -> int:
    return int(np.argmin(np.abs(_LOG_BINS - math.log2(tokens))))


@dataclass(frozen=True)
class _Curve:
    """The curve's points, never falling; and the observed-over-prior level by log size."""

    x: np.ndarray
    y: np.ndarray
    level_x: np.ndarray  # log2 sizes seen (empty: none, or no prior)
    level: np.ndarray  # log(observed / prior seconds) there
    prior_node_s: float  # the prior's seconds per node (0 without a prior)

    def seconds(self, tokens: float) -> float:
        x, y = self.x, self.y
        if x.size == 1 or tokens <= x[-1]:
            return float(np.interp(tokens, x, y))
        slope = (y[-1] - y[-2]) / max(x[-1] - x[-2], 1e-9)  # past the last point: its last slope
        return float(y[-1] + slope * (tokens - x[-1]))

    def node_floor(self, tokens: float) -> float:
        """The least a node costs in a forward of ``tokens``: the prior's, at this level."""
        return self.prior_node_s * _level(self.level_x, self.level, tokens)


def _level(level_x: np.ndarray, level: np.ndarray, tokens: float) -> float:
    """Observed over prior seconds near ``tokens``: interpolated in log size between the
    sizes seen, held beyond them; 1 with nothing seen."""
    if not level_x.size:
        return 1.0
    return math.exp(float(np.interp(math.log2(max(tokens, 1.0)), level_x, level)))


def _build(points: list[tuple[float, float] | None], prior: CostFit | None, context: int) -> _Curve:
    seen = {i: p for i, p in enumerate(points) if p is not None}
    empty = np.zeros(0)
    if prior is None:
        xs = np.asarray([p[0] for p in seen.values()])
        ys = np.asarray([p[1] for p in seen.values()])
        return _Curve(xs, np.maximum.accumulate(ys) if ys.size else ys, empty, empty, 0.0)

    def prior_s(n: float) -> float:
        return max(float(prior.seconds(int(round(n)), context)), 1e-6)

    # sizes not seen follow the prior's shape at the level of the sizes seen: under load a
    # forward runs slower than the lone calibration, and a prior bin below its observed
    # neighbour would flatten the curve (a tree's nodes would look free)
    ordered = sorted(seen.values())
    level_x = np.asarray([math.log2(n) for n, _ in ordered])
    level = np.asarray([math.log(s / prior_s(n)) for n, s in ordered])
    xs = [seen[i][0] if i in seen else float(n) for i, n in enumerate(_BINS)]
    ys = [seen[i][1] if i in seen else prior_s(n) * _level(level_x, level, n) for i, n in enumerate(_BINS)]
    order = np.argsort(xs, kind="stable")
    x, y = np.asarray(xs)[order], np.maximum.accumulate(np.asarray(ys)[order])  # never falls
    return _Curve(x, y, level_x, level, prior.marginal_node_s(context))
