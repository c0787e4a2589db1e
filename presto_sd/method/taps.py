"""TAPS: target-aware, cost-budgeted tree size (docs/design.md §1, "TAPS").

Each node ``u`` has a path-conditioned acceptance ``a(u)`` (a rho provider's estimate
that ``u`` is accepted once its parent is), a reach ``r(u) = prod_{v in path(u)} a(v)``
and a tree's expected accepted length is ``E[T] = sum_u r(u)``. Because ``a <= 1``,
reach never grows along a path, so popping nodes best-first by reach yields, for every
``B``, the top-``B`` prefix-closed tree ``T_B``, and ``E[T_B]`` is a running sum.
TAPS then keeps

    B* = argmax_B  (1 + E[T_B]) / (t_draft + t_link + c(B + 1, ctx) + node_penalty_s * B)

the expected tokens per second of the round, with ``c`` the verifier's measured cost
model (``presto_sd.method.cost_model``) and ``t_link`` what the round pays the network
beyond the engines' own work (the measured round trips to the drafter and the verifier
in a split deployment; 0 in one process): a slow link makes every round dearer, so it
buys bigger trees and fewer rounds. ``B = 0`` (a root-only tree: one AR step) is a
candidate too, so a steep cost shrinks the tree toward a plain step, and a flat one lets
it grow to the cap. Pure code: reaches in, a budget out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from presto_sd.method.cost_model import CostFit


@dataclass(frozen=True)
class BudgetChoice:
    budget: int  # B*: draft nodes kept, root excluded
    expected_accepted: float  # E[T_{B*}]
    expected_tokens_per_s: float  # the objective at B*
    objective: tuple[float, ...]  # the objective for B = 0..len(reaches), for reports/tests


def round_seconds(
    budget: int | np.ndarray, cost: CostFit, context: int, draft_s: float, node_penalty_s: float = 0.0,
    round_trip_s: float = 0.0,
) -> float | np.ndarray:
    """The objective's denominator: a round with ``budget`` draft nodes (root excluded)."""
    return draft_s + round_trip_s + np.asarray(cost.seconds(budget + 1, context)) + node_penalty_s * budget


def choose_budget(
    reaches: Sequence[float],
    cost: CostFit,
    context: int,
    draft_s: float,
    node_penalty_s: float = 0.0,
    shared_tokens: float = 0.0,
    round_trip_s: float = 0.0,
) -> BudgetChoice:
    """``B*`` over the prefixes of ``reaches`` (the pop order of a best-first tree).

    Ties go to the smaller tree: the same expected rate for less verifier work. Under load
    (``shared_tokens`` > 0: what the shared forward's other rows commit per step, and
    ``cost`` that forward's seconds with this tree in it) the rate is the forward's:
    ``(shared + 1 + E[T_B]) / seconds`` (``presto_sd.method.batch_cost``). ``round_trip_s``:
    the round's network time (``t_link``), paid whatever the tree's size.
    """
    r = np.asarray(reaches, dtype=np.float64)
    if np.any(r < 0) or np.any(r > 1 + 1e-9):
        raise ValueError("reaches must lie in [0, 1]")
    b = np.arange(len(r) + 1)
    expected = np.concatenate([[0.0], np.cumsum(r)])
    seconds = round_seconds(b, cost, context, draft_s, node_penalty_s, round_trip_s)
    objective = (shared_tokens + 1.0 + expected) / np.maximum(seconds, 1e-9)
    if not np.all(np.isfinite(objective)):
        raise ValueError(f"choose_budget: non-finite rates (draft_s {draft_s}, cost {cost})")
    # the first (near-)maximum: a gain below float noise never buys a bigger tree
    best = int(np.argmax(objective >= objective.max() * (1 - 1e-9)))
    return BudgetChoice(best, float(expected[best]), float(objective[best]), tuple(objective.tolist()))
