"""Load-aware TAPS: the marginal cost of a tree in a shared forward, and the budgets it buys."""

from __future__ import annotations

import pytest

from presto_sd.method.batch_cost import BatchCostCurve
from presto_sd.method.cost_model import CostFit
from presto_sd.method.taps import choose_budget


def cpu_like(n: float) -> float:
    """A CPU's forward: ~flat while the weights stream once, then compute-bound (s per token)."""
    return 0.040 + 0.0005 * n + 0.004 * max(0.0, n - 16)


def curve_of(sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> BatchCostCurve:
    curve = BatchCostCurve()
    for n in sizes:
        for _ in range(3):
            curve.observe(n, cpu_like(n))
    return curve


def test_the_curve_interpolates_its_batches_and_never_falls():
    curve = curve_of()
    for n in (1, 3, 16, 48, 200):
        assert curve.seconds(n) == pytest.approx(cpu_like(n), rel=0.05)
    noisy = curve_of()
    noisy.observe(64, 0.001)  # one fast outlier cannot make 64 rows cheaper than 32
    assert noisy.seconds(64) >= noisy.seconds(32)
    assert curve.seconds(512) > curve.seconds(256)  # past the data: its last slope


def test_marginal_cost_grows_with_the_load():
    curve = curve_of()
    light, heavy = curve.marginal(1, 16), curve.marginal(128, 16)
    assert light == pytest.approx(cpu_like(17) - cpu_like(1), rel=0.1)
    assert heavy == pytest.approx(16 * 0.0045, rel=0.1) and heavy > 5 * light
    fit = curve.shared_fit(128)  # n -> C(128 + n), through n = 1 and n = 16
    assert fit.seconds(1, 0) == pytest.approx(curve.seconds(129), rel=1e-6)
    assert fit.seconds(16, 0) == pytest.approx(curve.seconds(144), rel=1e-6)


def test_no_data_or_one_size_gives_no_fit_and_a_prior_fills_the_sizes_not_seen():
    assert BatchCostCurve().shared_fit(8) is None
    one = BatchCostCurve()
    one.observe(16, 0.05)
    assert one.shared_fit(8) is None
    prior = CostFit(intercept_s=0.04, per_node_s=0.001, per_context_s=0.0, per_node_context_s=0.0)
    one.prior = prior
    level = 0.05 / prior.seconds(16, 256)  # the sizes not seen: the prior's shape at the data's level
    assert one.seconds(64) == pytest.approx(prior.seconds(64, 256) * level, rel=1e-6)
    assert one.shared_fit(8) is not None


def test_a_prior_below_the_data_does_not_make_nodes_free():
    """Under load every forward runs slower than the lone calibration. Seen: AR steps of 16
    rows only, at 3x the prior. The sizes past them keep the prior's slope at that level,
    and noisy batches of nearly one size cannot flatten it to nothing."""
    prior = CostFit(intercept_s=0.04, per_node_s=0.002, per_context_s=0.0, per_node_context_s=0.0)
    curve = BatchCostCurve(prior=prior, context=0)
    for _ in range(5):
        curve.observe(16, 3 * prior.seconds(16, 0))
    fit = curve.shared_fit(15)
    assert fit.per_node_s == pytest.approx(3 * 0.002, rel=0.05)
    noisy = BatchCostCurve(prior=prior, context=0)
    noisy.observe(16, 0.25)
    noisy.observe(23, 0.24)  # a tree of 7 more rows that happened to run faster
    level = 0.25 / prior.seconds(16, 0)
    assert noisy.shared_fit(15).per_node_s >= 0.002 * level * 0.99


def test_budgets_shrink_to_ar_steps_as_the_load_grows_and_grow_back():
    """The same drafter reaches in a forward shared with L AR rows (each commits a token a
    step): a good tree alone and at light load, none under heavy load, and back again."""
    curve, reaches, draft_s = curve_of(), [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.3, 0.2, 0.2], 0.004
    alone = CostFit(intercept_s=0.040, per_node_s=0.0005, per_context_s=0.0, per_node_context_s=0.0)
    budgets = [choose_budget(reaches, alone, 0, draft_s).budget]
    for load in (1, 4, 16, 64, 256):
        budgets.append(choose_budget(reaches, curve.shared_fit(load), 0, draft_s, shared_tokens=load).budget)
    assert budgets == sorted(budgets, reverse=True)
    assert budgets[0] >= 8 and budgets[1] >= 8 and budgets[-1] == 0
    again = choose_budget(reaches, curve.shared_fit(1), 0, draft_s, shared_tokens=1).budget
    assert again == budgets[1]
