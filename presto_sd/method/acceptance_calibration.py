"""Online recalibration of TAPS's per-node acceptance ``a(u)`` against what the target accepts.

    logit a'(u) = alpha + beta * logit a(u) + per_depth * (depth(u) - 1)

A learned ``a(u)`` is calibrated on its training mix, not on this request's domain:
h_phi is under-confident on the high-acceptance nodes of some requests and
over-confident on the deep, low-reach nodes that big trees add (docs/taps.md). TAPS
*sums* reaches (products of ``a`` along paths), so those errors decide the budget. Platt
scaling with a depth term fixes both with three numbers, fitted per request from the
labels every verification gives for free: each node whose parent was accepted is a
trial, and it succeeds iff it was accepted (the same samples h_phi trains on).

A monotone map of each ``a(u)`` into ``(0, 1)`` keeps ``a' <= 1``, so reach still never
grows along a path and best-first trees stay prefix-closed. The fit needs each node's
raw ``a(u)``, before the map: the drafter returns it beside the tree
(``DraftResult.node_log_acceptance``). Pure code: no model here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from presto_sd.method.tree import TokenTree

_EPS = 1e-6  # a in [eps, 1 - eps]: logit stays finite for a = 1 (a clamped score)
_BOUNDS = ((-4.0, 4.0), (0.2, 5.0), (-1.0, 1.0))  # alpha, beta, per_depth


@dataclass(frozen=True)
class AcceptanceCalibration:
    """The map ``a -> a'``; the default is the identity."""

    alpha: float = 0.0
    beta: float = 1.0
    per_depth: float = 0.0

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) for v in (self.alpha, self.beta, self.per_depth)) or self.beta <= 0:
            raise ValueError(
                f"tree.calibration = ({self.alpha}, {self.beta}, {self.per_depth}): must be finite, beta > 0"
            )

    @property
    def is_identity(self) -> bool:
        return self == AcceptanceCalibration()

    def apply_log(self, log_a: torch.Tensor, depth: int) -> torch.Tensor:
        """``log a'`` for ``log a`` (any shape) at ``depth``."""
        if self.is_identity:
            return log_a
        a = log_a.exp().clamp(_EPS, 1 - _EPS)
        z = self.alpha + self.beta * torch.log(a / (1 - a)) + self.per_depth * (depth - 1)
        return torch.nn.functional.logsigmoid(z)


def node_trials(
    tree: TokenTree, log_a: Sequence[float], accepted: Sequence[int]
) -> list[tuple[float, int, bool]]:
    """``(log a, depth, accepted)`` for every node whose parent was accepted.

    ``log_a`` is per node (the root's is ignored); ``accepted`` the accepted draft tokens,
    which walk the tree from the root (siblings hold distinct tokens).
    """
    on_path, node = {0}, 0
    for tok in accepted:
        node = next((c for c in tree.children(node) if tree.tokens[c] == tok), -1)
        if node < 0:
            raise ValueError(f"accepted token {tok} is not a child on the tree's path")
        on_path.add(node)
    return [(log_a[u], tree.depths[u], u in on_path)
            for u in range(1, len(tree.tokens)) if tree.parents[u] in on_path]


class OnlineAcceptanceCalibrator:
    """Platt scaling with a depth term, refit by Newton steps over a sliding window.

    A Gaussian prior centred on the identity, worth about ``prior_trials`` trials,
    keeps the first rounds of a request from swinging the map; a full window overrules
    it. The coefficients are kept within fixed bounds.
    """

    def __init__(self, window: int = 512, prior_trials: float = 30.0, newton_steps: int = 4) -> None:
        self.trials: deque[tuple[float, int, bool]] = deque(maxlen=window)
        self.prior_trials, self.newton_steps = prior_trials, newton_steps
        self.calibration = AcceptanceCalibration()

    def observe(self, trials: Sequence[tuple[float, int, bool]]) -> None:
        """One verified tree's trials (``node_trials``), then a refit."""
        good = [t for t in trials if math.isfinite(t[0]) and t[0] <= 0 and t[1] >= 1]
        if not good:
            return
        self.trials.extend(good)
        self.calibration = self._fit()

    def _fit(self) -> AcceptanceCalibration:
        log_a, depth, label = (np.array(c, dtype=np.float64) for c in zip(*self.trials))
        a = np.clip(np.exp(log_a), _EPS, 1 - _EPS)
        x = np.stack([np.ones_like(a), np.log(a / (1 - a)), depth - 1], axis=1)
        prior = np.array([0.0, 1.0, 0.0])
        # the prior's precision: prior_trials trials' worth of information at p = 1/2, per coordinate
        precision = self.prior_trials * 0.25 * np.maximum((x**2).mean(axis=0), 1e-3)
        theta = np.array([self.calibration.alpha, self.calibration.beta, self.calibration.per_depth])
        for _ in range(self.newton_steps):
            p = 1 / (1 + np.exp(-(x @ theta)))
            grad = x.T @ (p - label) + precision * (theta - prior)
            hess = (x.T * (p * (1 - p))) @ x + np.diag(precision)
            theta = theta - np.linalg.solve(hess, grad)
            theta = np.array([np.clip(t, lo, hi) for t, (lo, hi) in zip(theta, _BOUNDS)])
        return AcceptanceCalibration(*(float(t) for t in theta))
