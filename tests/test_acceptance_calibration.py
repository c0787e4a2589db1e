"""Online recalibration of TAPS's a(u): the map, its inverse, the trials, the fit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from presto_sd.method.acceptance_calibration import (
    AcceptanceCalibration,
    OnlineAcceptanceCalibrator,
    node_trials,
)
from presto_sd.method.tree import TokenTree


def test_identity_is_exact_and_a_map_is_monotone_into_0_1():
    log_a = torch.log(torch.tensor([0.05, 0.5, 0.97, 1.0]))
    assert AcceptanceCalibration().apply_log(log_a, 3) is log_a
    mapped = AcceptanceCalibration(-0.7, 1.6, -0.25).apply_log(log_a, 3)
    assert torch.all(mapped < 0) and torch.all(mapped[1:] >= mapped[:-1])  # monotone, a' < 1
    deeper = AcceptanceCalibration(-0.7, 1.6, -0.25).apply_log(log_a, 5)
    assert torch.all(deeper < mapped)  # a negative per-depth term marks deeper nodes down


@pytest.mark.parametrize("bad", [(0.0, 0.0, 0.0), (0.0, -1.0, 0.0), (float("nan"), 1.0, 0.0),
                                 (0.0, 1.0, float("inf"))])
def test_bad_maps_are_refused(bad):
    with pytest.raises(ValueError, match="tree.calibration"):
        AcceptanceCalibration(*bad)


def test_trials_are_the_children_of_accepted_nodes():
    #        0
    #      1   2        accepted path: 0 -> 2 -> 4
    #     3   4 5
    tree = TokenTree.from_lists([9, 10, 11, 12, 13, 14], [-1, 0, 0, 1, 2, 2])
    log_a = [0.0, -0.1, -0.2, -0.3, -0.4, -0.5]
    trials = node_trials(tree, log_a, accepted=(11, 13))
    assert trials == [(-0.1, 1, False), (-0.2, 1, True), (-0.4, 2, True), (-0.5, 2, False)]
    assert [t[0] for t in node_trials(tree, log_a, accepted=())] == [-0.1, -0.2]  # only the root's children
    with pytest.raises(ValueError, match="not a child"):
        node_trials(tree, log_a, accepted=(12,))


def synthetic_trials(truth: AcceptanceCalibration, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, d = float(rng.uniform(0.02, 0.98)), int(rng.integers(1, 8))
        p = math.exp(float(truth.apply_log(torch.tensor(math.log(a)), d)))
        out.append((math.log(a), d, bool(rng.random() < p)))
    return out


def test_a_full_window_recovers_the_distortion_and_a_few_trials_barely_move_it():
    truth = AcceptanceCalibration(-0.5, 1.5, -0.3)  # over-confident, more so with depth
    cal = OnlineAcceptanceCalibrator(window=512)
    trials = synthetic_trials(truth, 512)
    cal.observe(trials[:4])
    few = cal.calibration
    assert abs(few.alpha) < 0.5 and abs(few.beta - 1) < 0.5 and abs(few.per_depth) < 0.2
    for i in range(4, 512, 8):
        cal.observe(trials[i : i + 8])
    got = cal.calibration
    assert got.alpha == pytest.approx(truth.alpha, abs=0.35)
    assert got.beta == pytest.approx(truth.beta, abs=0.35)
    assert got.per_depth == pytest.approx(truth.per_depth, abs=0.1)


def test_a_calibrated_estimate_stays_put_and_junk_is_ignored():
    cal = OnlineAcceptanceCalibrator()
    for i in range(0, 512, 8):
        cal.observe(synthetic_trials(AcceptanceCalibration(), 8, seed=i))
    got = cal.calibration
    assert abs(got.alpha) < 0.3 and abs(got.beta - 1) < 0.25 and abs(got.per_depth) < 0.08
    n = len(cal.trials)
    cal.observe([(float("nan"), 1, True), (0.5, 1, True), (-0.1, 0, False)])
    assert len(cal.trials) == n and cal.calibration == got
