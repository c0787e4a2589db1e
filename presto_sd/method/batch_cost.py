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
single-session fit). ``shared_fit`` hands TAPS ``n -> C(L + n)`` as a ``CostFit``, so the
builder's objective and early stop run unchanged. Pure numpy.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from presto_sd.method.cost_model import CostFit

_BINS = 2.0 ** np.arange(0, 13)  # 1 .. 4096 new tokens per forward
_REF = 16  # the linearisation's second point: the marginal cost of this many rows


@dataclass(frozen=True)
class SharedForward:
    """The forward a request's next tree joins: its seconds against the tree's tokens, and
    what the other rows commit per step (TAPS's ``TreeParams.shared_tokens``)."""

    cost: CostFit
    others_tokens: float


class BatchCostCurve:
    """``C(N)``: seconds of a forward over ``N`` new tokens, learnt from observed batches.

    Each log-spaced bin keeps a moving average of its batches' sizes and seconds; ``C``
    interpolates between those points (and the prior's, at bins with no data yet), and
    never decreases with ``N``.
    """

    def __init__(self, prior: CostFit | None = None, context: int = 256, alpha: float = 0.2) -> None:
        self.prior, self.context, self.alpha = prior, context, alpha
        self._points: list[tuple[float, float] | None] = [None] * len(_BINS)  # (tokens, seconds)
        self._lock = threading.Lock()

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        i = int(np.argmin(np.abs(np.log2(_BINS) - math.log2(tokens))))
        with self._lock:
            old, a = self._points[i], self.alpha
            self._points[i] = (tokens, seconds) if old is None else (
                (1 - a) * old[0] + a * tokens, (1 - a) * old[1] + a * seconds)

    def _curve(self) -> tuple[np.ndarray, np.ndarray] | None:
        with self._lock:
            points = list(self._points)
        xs, ys = [], []
        for n, p in zip(_BINS, points):
            if p is not None:
                xs.append(p[0])
                ys.append(p[1])
            elif self.prior is not None:
                xs.append(float(n))
                ys.append(float(self.prior.seconds(int(n), self.context)))
        if not xs:
            return None
        order = np.argsort(xs, kind="stable")
        x, y = np.asarray(xs)[order], np.asarray(ys)[order]
        return x, np.maximum.accumulate(y)  # a bigger forward never costs less

    def seconds(self, tokens: float) -> float:
        curve = self._curve()
        if curve is None:
            return float("nan")
        x, y = curve
        if len(x) == 1 or tokens <= x[-1]:
            return float(np.interp(tokens, x, y))
        slope = (y[-1] - y[-2]) / max(x[-1] - x[-2], 1e-9)  # past the last point: its last slope
        return float(y[-1] + slope * (tokens - x[-1]))

    def marginal(self, load: int, tokens: int) -> float:
        """Seconds ``tokens`` more rows add to a forward that carries ``load`` already."""
        if load <= 0:
            return self.seconds(tokens)
        return max(0.0, self.seconds(load + tokens) - self.seconds(load))

    def shared_fit(self, load: int) -> CostFit | None:
        """``n -> C(load + n)`` as TAPS's ``CostFit`` (linear in the tree's tokens, through
        ``n = 1`` and ``n = 16``); None until two batch sizes (or a prior) shape the curve."""
        curve = self._curve()
        if curve is None or len(np.unique(curve[0])) < 2:  # one point says nothing about slopes
            return None
        one = self.seconds(load + 1)
        slope = max(0.0, (self.seconds(load + _REF) - one) / (_REF - 1))
        return CostFit(intercept_s=max(0.0, one - slope), per_node_s=slope, per_context_s=0.0,
                       per_node_context_s=0.0, tree_s=0.0)
