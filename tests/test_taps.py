"""TAPS without a model: the cost fit, the budget objective, and the tree it keeps."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from presto_sd.method.acceptance_calibration import AcceptanceCalibration
from presto_sd.method.builders import (
    AcceptanceScorer,
    RoundContext,
    TreeParams,
    _best_first,
    build_taps_tree,
    build_tree,
)
from presto_sd.method.cost_model import CostFit, OnlineCostModel, fit_cost
from presto_sd.method.scores import ConstantRho, LookupProposalRho, NGramRho
from presto_sd.method.taps import choose_budget
from tests.test_builders import assert_well_formed, ctx_for, random_marginals

FLAT = CostFit(0.05, 0.0, 0.0, 0.0)
# ~ SmolLM2 fp32 on 2 cores at a context of ~300: 38 ms for one token, 57 for two (docs/taps.md)
CPU_LIKE = CostFit(0.030, 0.0015, 2e-5, 0.002, tree_s=0.017)
STEEP = CostFit(0.010, 0.5, 0.0, 0.0)  # every node costs 50x a whole AR step


def brute_force_budget(reaches, cost, ctx, draft_s, node_penalty_s=0.0):
    best, best_val = 0, -1.0
    for b in range(len(reaches) + 1):
        seconds = draft_s + cost.seconds(b + 1, ctx) + node_penalty_s * b
        val = (1 + sum(reaches[:b])) / seconds
        if val > best_val * (1 + 1e-9):
            best, best_val = b, val
    return best


@pytest.mark.parametrize("cost", [FLAT, CPU_LIKE, STEEP])
@pytest.mark.parametrize("draft_s", [0.0, 0.01, 0.2])
def test_budget_is_the_argmax_of_expected_tokens_per_second(cost, draft_s):
    reaches = [0.9, 0.7, 0.6, 0.3, 0.3, 0.2, 0.1, 0.05, 0.01, 0.01]
    choice = choose_budget(reaches, cost, context=300, draft_s=draft_s)
    assert choice.budget == brute_force_budget(reaches, cost, 300, draft_s)
    assert choice.expected_tokens_per_s == pytest.approx(max(choice.objective))
    assert choice.expected_accepted == pytest.approx(sum(reaches[: choice.budget]))


def test_hand_built_case():
    # draft 10 ms; verify 10 ms + 10 ms per tree token (the root too): B=0 gives
    # 1/0.03 = 33 tok/s, B=1 1.8/0.04 = 45, B=2 2.3/0.05 = 46, B=3 2.4/0.06 = 40
    cost = CostFit(0.010, 0.010, 0.0, 0.0)
    choice = choose_budget([0.8, 0.5, 0.1], cost, context=0, draft_s=0.010)
    assert choice.budget == 2
    assert choice.objective == pytest.approx((1 / 0.03, 1.8 / 0.04, 2.3 / 0.05, 2.4 / 0.06))


def test_flat_cost_takes_the_cap_and_steep_cost_shrinks_to_a_step():
    reaches = [0.8, 0.6, 0.5, 0.2, 0.1]
    assert choose_budget(reaches, FLAT, 100, 0.01).budget == len(reaches)
    assert choose_budget(reaches, STEEP, 100, 0.01).budget == 0
    assert choose_budget(reaches, FLAT, 100, 0.01, node_penalty_s=1.0).budget == 0


@settings(max_examples=60, deadline=None)
@given(
    reaches=st.lists(st.floats(0.0, 1.0), min_size=0, max_size=40),
    coeffs=st.tuples(*[st.floats(0.0, 0.1)] * 5),
    draft_s=st.floats(0.001, 0.5),
    ctx=st.integers(0, 4000),
)
def test_budget_matches_brute_force(reaches, coeffs, draft_s, ctx):
    cost = CostFit(*coeffs)
    choice = choose_budget(reaches, cost, ctx, draft_s)
    want = brute_force_budget(reaches, cost, ctx, draft_s)
    # the same budget, or one whose rate differs only by float noise
    assert choice.objective[choice.budget] == pytest.approx(choice.objective[want], rel=1e-8)
    assert choice.budget <= want or choice.objective[choice.budget] > choice.objective[want]


def test_a_slower_link_buys_a_bigger_tree():
    """Every round pays the link whatever its tree: a dearer round favours more tokens per
    round. At 0 ms this CPU-like cost keeps 5 nodes; at 10 ms 6, at 200 ms 9 (the budget
    never shrinks as the RTT grows)."""
    reaches = [0.4, 0.2, 0.12, 0.08, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01]
    budgets = [choose_budget(reaches, CPU_LIKE, 300, 0.004, round_trip_s=rtt).budget
               for rtt in (0.0, 0.002, 0.01, 0.05, 0.2)]
    assert budgets == [5, 5, 6, 7, 9], budgets
    seconds = choose_budget(reaches, CPU_LIKE, 300, 0.004, round_trip_s=0.01)
    at_zero = choose_budget(reaches, CPU_LIKE, 300, 0.014)  # the link is a fixed cost, like drafting
    assert seconds.objective == pytest.approx(at_zero.objective)


@settings(max_examples=60, deadline=None)
@given(
    reaches=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30),
    coeffs=st.tuples(*[st.floats(0.0, 0.1)] * 5),
    rtts=st.lists(st.floats(0.0, 0.5), min_size=2, max_size=5),
)
def test_the_budget_never_shrinks_as_the_round_trip_grows(reaches, coeffs, rtts):
    reaches = sorted(reaches, reverse=True)  # pop order: reach never grows
    cost = CostFit(*coeffs)
    choices = [choose_budget(reaches, cost, 200, 0.005, round_trip_s=r) for r in sorted(rtts)]
    for a, b in zip(choices, choices[1:]):  # up to ties within float noise
        assert b.budget >= a.budget or b.objective[a.budget] == pytest.approx(b.objective[b.budget], rel=1e-8)


def test_step_to_a_tree_beats_both_a_plain_step_and_a_small_tree():
    # 38 ms for one token, 57 ms for 2 and ~57 for 5 (SmolLM2 fp32 here): one cheap node
    # does not pay for the step, four do. A linear c(n) could not say both.
    cost = CostFit(0.038, 0.0005, 0.0, 0.0, tree_s=0.019)
    choice = choose_budget([0.3, 0.3, 0.3, 0.3], cost, context=0, draft_s=0.005)
    assert choice.objective[1] < choice.objective[0] < choice.objective[4]
    assert choice.budget == 4


def test_cost_fit_recovers_coefficients_despite_outliers():
    rng = np.random.default_rng(0)
    truth = CostFit(0.03, 0.002, 3e-5, 0.004, tree_s=0.015)
    n = rng.choice([1, 2, 4, 8, 16, 32, 64], 300)  # the calibration's sizes
    ctx = rng.integers(16, 1500, 300)
    y = np.asarray(truth.seconds(n, ctx)) * rng.normal(1, 0.03, 300)
    y[::15] *= 5  # a neighbour stole the core on one forward in fifteen
    fit = fit_cost(n, ctx, y)
    for got, want in zip(fit.coeffs, truth.coeffs):
        assert got == pytest.approx(want, rel=0.15, abs=2e-4)


def test_online_model_stays_near_its_prior_with_few_points_and_then_follows_the_data():
    prior = CostFit(0.03, 0.002, 0.0, 0.0)
    model = OnlineCostModel(prior=prior, refit_every=1)
    model.observe(8, 100, 0.5)  # one wild forward
    assert model.fit.seconds(33, 100) < 0.5  # the prior holds the slope
    for _ in range(200):  # the machine really got 3x slower
        for n in (1, 16, 32, 64):
            model.observe(n, 100, 3 * prior.seconds(n, 100))
    assert model.fit.seconds(32, 100) == pytest.approx(3 * prior.seconds(32, 100), rel=0.1)


@pytest.mark.parametrize("prior", [CostFit(0.03, 0.01, 0.0, 0.0), CostFit(0.03, 0.0004, 0.0, 0.0),
                                   CostFit(0.008, 0.0, 0.0, 0.0)])
def test_a_full_window_overrules_a_wrong_prior(prior):
    truth = CostFit(0.03, 0.002, 1e-5, 0.001)
    model = OnlineCostModel(prior=prior, window=256, refit_every=16)
    rng = np.random.default_rng(1)
    for _ in range(256):
        n, ctx = int(rng.integers(1, 65)), int(rng.integers(50, 400))
        model.observe(n, ctx, float(truth.seconds(n, ctx)))
    for n in (1, 17, 33, 65):
        assert model.fit.seconds(n, 200) == pytest.approx(truth.seconds(n, 200), rel=0.1)


def test_flat_forwards_at_one_context_fit_flat_without_breaking_the_intercept():
    # a GPU: ~8 ms whatever the tree, one request (the context barely moves); the prior
    # (a calibration on a busier day) is 3x off at 64 nodes
    prior = CostFit(0.01, 0.0002, 1e-6, 0.0)
    n = np.tile([1, 8, 16, 32, 64], 40)  # 200 forwards: the prior weighs 4 of them
    ctx = 300 + np.arange(len(n)) // 20
    fit = fit_cost(n, ctx, np.full(len(n), 0.008), prior)
    for size in (1, 32, 64):
        assert fit.seconds(size, 305) == pytest.approx(0.008, rel=0.1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_bad_timings_are_ignored_and_bad_coefficients_refused(bad):
    model = OnlineCostModel(prior=CPU_LIKE, refit_every=1)
    model.observe(8, 100, bad)
    assert model.fit == CPU_LIKE and not model.obs
    with pytest.raises(ValueError, match="finite"):
        CostFit(0.01, bad if bad != 0.0 else -0.5, 0.0, 0.0)


def test_fit_needs_data_or_a_prior():
    with pytest.raises(ValueError, match="no observations"):
        fit_cost(np.array([]), np.array([]), np.array([]))
    assert fit_cost(np.array([]), np.array([]), np.array([]), CPU_LIKE) == CPU_LIKE


def pop_order_tree(m, params, rho):
    ctx = ctx_for(m)
    depth = min(params.depth, m.depth)
    return _best_first(ctx.context_tokens[-1], depth, params.budget, AcceptanceScorer(ctx, rho))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    cap=st.integers(1, 64),
    depth=st.integers(1, 8),
    k=st.integers(1, 6),
    coeffs=st.tuples(st.floats(0.0, 0.05), st.floats(0.0, 0.02), st.floats(0.0, 1e-4),
                      st.floats(0.0, 0.01), st.floats(0.0, 0.05)),
    context=st.lists(st.integers(0, 49), min_size=1, max_size=300),
    node_penalty_s=st.sampled_from([0.0, 0.001, 0.01]),
    calibration=st.sampled_from([AcceptanceCalibration(), AcceptanceCalibration(-0.5, 1.7, -0.3),
                                 AcceptanceCalibration(1.0, 0.5, 0.2)]),
    rho=st.sampled_from(["constant", "ngram", "ngram-lookup", "marginal"]),
)
def test_taps_tree_is_the_best_first_prefix_of_its_budget(
    seed, cap, depth, k, coeffs, context, node_penalty_s, calibration, rho
):
    m = random_marginals(depth, k, seed=seed)
    params = TreeParams(budget=cap, depth=depth, node_penalty_s=node_penalty_s)
    measured = RoundContext(cost=CostFit(*coeffs), draft_s=0.01, calibration=calibration)
    provider = {"constant": ConstantRho(0.7), "ngram": NGramRho(),
                "ngram-lookup": LookupProposalRho(NGramRho()), "marginal": None}[rho]
    ctx = ctx_for(m, context)
    built = build_taps_tree(context[-1], ctx, provider, params, measured)
    assert_well_formed(built.tree, cap, depth)
    scorer = AcceptanceScorer(ctx_for(m, context), provider, calibration=calibration)
    full = _best_first(context[-1], min(depth, m.depth), cap, scorer)
    keep = len(built.tree.tokens)
    assert built.tree.tokens == full.tree.tokens[:keep] and built.tree.parents == full.tree.parents[:keep]
    # the early stop is exact: B* over the whole pop order is the budget kept
    reaches = [math.exp(x) for x in full.path_scores[1:]]
    want = choose_budget(reaches, measured.cost, len(context) - 1, measured.draft_s, node_penalty_s)
    assert keep - 1 == want.budget
    # reach never grows along a path: path scores are log-reaches, so each child <= parent
    for node in range(1, keep):
        assert built.path_scores[node] <= built.path_scores[built.tree.parents[node]] + 1e-9


def test_taps_with_marginal_acceptance_ranks_like_ddtree():
    m = random_marginals(6, 4, seed=3)
    params = TreeParams(budget=20, depth=6)
    # a(u) = q: the DDTree order
    taps = build_tree("taps", 4, ctx_for(m), params, rho=None, round_=RoundContext(cost=FLAT))
    ddtree = build_tree("marginal", 4, ctx_for(m), TreeParams(budget=20, depth=6))
    assert taps.tree == ddtree.tree
    assert taps.path_scores == pytest.approx(ddtree.path_scores)


def test_taps_without_a_cost_model_is_refused():
    m = random_marginals(4, 3)
    with pytest.raises(ValueError, match="cost model"):
        build_tree("taps", 4, ctx_for(m), TreeParams(), rho=ConstantRho())


def test_depth_penalty_favours_shallow_trees():
    m = random_marginals(8, 4, seed=1)
    base = TreeParams(budget=24, depth=8)
    plain = build_taps_tree(4, ctx_for(m), None, base, RoundContext(cost=FLAT)).tree
    shallow = build_taps_tree(4, ctx_for(m), None, replace(base, depth_penalty=2.0),
                              RoundContext(cost=FLAT)).tree
    assert len(shallow.tokens) == len(plain.tokens)  # a flat cost: both take the cap
    assert sum(shallow.depths) < sum(plain.depths)


def peaked_marginals(depth: int, k: int, top: float = 0.85):
    """Top-1 far ahead at every position: the best small trees are chains."""
    import torch

    from presto_sd.method.scores import DraftMarginals

    probs = torch.tensor([top] + [(1 - top) / (k + 1)] * (k - 1))
    ids = torch.arange(depth * k).reshape(depth, k) % 50
    return DraftMarginals(ids, probs.log().expand(depth, k).clone(), torch.ones(depth))


def test_flat_cost_fills_the_cap_and_a_steep_one_shrinks_toward_the_linear_chain():
    m = peaked_marginals(8, 4)
    params = TreeParams(budget=24, depth=8)
    flat = build_tree("taps", 4, ctx_for(m), params, rho=None, round_=RoundContext(cost=FLAT))
    assert flat.tree.size == 24
    steep_cost = CostFit(0.03, 0.01, 0.0, 0.0)  # a node costs a third of a step
    steep = build_tree("taps", 4, ctx_for(m), params, rho=None,
                       round_=RoundContext(cost=steep_cost, draft_s=0.01))
    assert 1 <= steep.tree.size < 24
    assert steep.tree.parents == tuple(range(-1, steep.tree.size))  # a chain: DFlash's shape
    assert build_tree("taps", 4, ctx_for(m), params, rho=None, round_=RoundContext(cost=STEEP)).tree.size == 0


class _CalibratedVerifier:
    shared = None  # SharedForward: the load a step engine would report (``load=``)
    link_s = 0.0  # its client's measured round trip

    def cost_model(self):
        return CPU_LIKE

    def round_trip_s(self):
        return self.link_s


class _LinkedDrafter:
    def __init__(self, link_s: float) -> None:
        self.link_s = link_s

    def round_trip_s(self):
        return self.link_s


def test_taps_feedback_prices_the_links_once():
    """A split deployment: 5 ms to the verifier and 3 to the drafter. The round's price
    carries both (``round_trip_s``); the cost fit and t_draft learn the engines' work
    alone, so the network is not counted twice; an AR step pays the verifier's link."""
    from presto_sd.loop.taps_feedback import TapsFeedback
    from presto_sd.method.tree import TokenTree

    verifier = _CalibratedVerifier()
    verifier.link_s = 0.005
    fb = TapsFeedback(verifier, _LinkedDrafter(0.003))
    assert fb.round_context().round_trip_s == pytest.approx(0.008)
    chain = TokenTree.from_lists([1, 2, 3], [-1, 0, 1])
    fb.observe(chain, (), base=100, accepted=(2,), draft_s=0.007, verify_s=0.065, commit_s=0.001)
    assert fb.verify.obs[-1] == (3, 100, pytest.approx(0.060))
    assert fb.draft.value == pytest.approx(0.005)  # 4 ms of drafting + 1 of commit, the link apart
    # an AR step here costs c(1) + 5 ms + 1 ms: the saving counts the link on both sides
    ar_step = float(fb.verify.fit.seconds(1, 100)) + 0.005 + 0.001
    assert fb.saving.value == pytest.approx(0.1 * (2 * ar_step - 0.073))
    alone = TapsFeedback(_CalibratedVerifier())  # in process: no link, nothing changes
    assert alone.round_context().round_trip_s == 0.0


def test_taps_feedback_under_load_prices_the_shared_forward_and_closes_the_gate():
    """64 AR rows share the forward, compute-bound: a tree that gets 2 of 8 nodes accepted
    slows 64 streams for 2 tokens, so the gate shuts; alone, the same round pays."""
    from presto_sd.loop.taps_feedback import TapsFeedback
    from presto_sd.method.batch_cost import SharedForward
    from presto_sd.method.tree import TokenTree

    loaded = _CalibratedVerifier()
    loaded.shared = SharedForward(CostFit(0.3, 0.004, 0.0, 0.0), others_tokens=64.0)
    tree = TokenTree.from_lists([1] * 9, [-1, 0, 1, 2, 3, 4, 5, 6, 7])
    for verifier, shuts in ((loaded, True), (_CalibratedVerifier(), False)):
        fb = TapsFeedback(verifier, load=lambda rows, v=verifier: v.shared)
        params = fb.round_context()
        assert params.shared_tokens == (64.0 if shuts else 0.0)
        assert params.cost == (loaded.shared.cost if shuts else CPU_LIKE)
        fb.observe(tree, (), 100, (1, 1), 0.01, float(CPU_LIKE.seconds(9, 100)), 0.001)
        assert fb.should_draft() is not shuts


def test_under_load_the_gate_probes_less_often():
    """In a shared forward a losing probe slows every stream: with 15 others the backoff
    starts at 16 and grows to the loaded cap (32), each skip drawn from [b, 2b) so that
    streams that started together spread their probes; alone it goes 1, 2, 4 and stops at
    8, with no draw."""
    from presto_sd.loop.taps_feedback import TapsFeedback
    from presto_sd.method.batch_cost import SharedForward
    from presto_sd.method.tree import TokenTree

    loaded = _CalibratedVerifier()
    loaded.shared = SharedForward(CostFit(0.3, 0.004, 0.0, 0.0), others_tokens=15.0)
    root = TokenTree.root_only(7)
    backoffs = [16, 32, 32, 32, 32, 32, 32]
    skips = []
    for seed in ("request-a", "request-b"):
        fb = TapsFeedback(loaded, seed=seed, load=lambda rows: loaded.shared)
        fb._joined = True  # (its first probe's wait: the next test)
        skips.append([skipped_after(fb, root, (0.0,), (), 0.034) for _ in range(7)])
        assert all(b <= s < 2 * b for s, b in zip(skips[-1], backoffs)), skips[-1]
    assert skips[0] != skips[1]  # two requests probe in different forwards
    fb = TapsFeedback(_CalibratedVerifier(), seed="request-a")
    assert [skipped_after(fb, root, (0.0,), (), 0.034) for _ in range(7)] == [1, 2, 4, 8, 8, 8, 8]


def test_a_stream_joining_a_loaded_forward_spreads_its_first_probe():
    """With 63 others in the forward, newcomers wait [0, 64) rounds before their first
    probe, each its own draw; alone the first round drafts."""
    from presto_sd.loop.taps_feedback import TapsFeedback
    from presto_sd.method.batch_cost import SharedForward

    loaded = _CalibratedVerifier()
    loaded.shared = SharedForward(CostFit(0.3, 0.004, 0.0, 0.0), others_tokens=63.0)
    waits = []
    for seed in range(20):
        fb = TapsFeedback(loaded, seed=seed, load=lambda rows: loaded.shared)
        waits.append(next(i for i in range(100) if fb.should_draft()))
    assert all(0 <= w < 64 for w in waits) and len(set(waits)) > 10
    assert TapsFeedback(_CalibratedVerifier()).should_draft()


def test_taps_feedback_hands_the_loop_what_it_learned():
    from presto_sd.loop.taps_feedback import TapsFeedback
    from presto_sd.method.tree import TokenTree

    fb = TapsFeedback(_CalibratedVerifier())
    first = fb.round_context()
    assert first.cost == CPU_LIKE and first.draft_s == 0.0 and first.calibration.is_identity
    # a chain whose raw estimate is a = 0.9 at every node; the target takes the first only
    chain = TokenTree.from_lists([1, 2, 3, 4], [-1, 0, 1, 2])
    raw = (0.0, *[math.log(0.9)] * 3)
    for _ in range(60):
        fb.observe(chain, raw, base=100, accepted=(2,), draft_s=0.004, verify_s=0.06, commit_s=0.001)
    cal = fb.round_context().calibration
    a1, a2 = (math.exp(float(cal.apply_log(torch.tensor(math.log(0.9)), d))) for d in (1, 2))
    assert a1 > 0.8 and a2 < 0.7  # depth 1 kept near its 0.9, depth 2 marked down
    assert fb.draft.value == pytest.approx(0.005)  # drafting + committing
    before = fb.acceptance.calibration
    fb.observe(chain, (), base=110, accepted=(2,), draft_s=0.004, verify_s=0.06, commit_s=0.001)
    assert fb.acceptance.calibration == before  # a drafter that sends no raw estimates: no fit
    twins = TokenTree.from_lists([1, 2, 2, 3], [-1, 0, 0, 2])  # the walk went down the second 2
    fb.observe(twins, (0.0, -0.1, -0.1, -0.1), base=120, accepted=(2, 3), draft_s=0.004, verify_s=0.06,
               commit_s=0.001)
    assert fb.acceptance.calibration == before  # no fit from a path it cannot follow, no crash
    fb.observe(None, (), base=140, accepted=(), draft_s=0.0, verify_s=0.04, commit_s=0.001)  # no draft
    assert fb.verify.obs[-1] == (1, 140, 0.04)


def skipped_after(fb, tree, raw, accepted, verify_s):
    """Observe one drafted round, then count the rounds the gate skips."""
    assert fb.should_draft()
    fb.observe(tree, raw, base=50, accepted=accepted, draft_s=0.005, verify_s=verify_s, commit_s=0.001)
    skipped = 0
    while not fb.should_draft():
        skipped += 1
    return skipped


def test_the_draft_gate_backs_off_while_drafting_loses_to_ar_steps():
    from presto_sd.loop.taps_feedback import TapsFeedback
    from presto_sd.method.tree import TokenTree

    fb = TapsFeedback(_CalibratedVerifier(), max_backoff=4)  # an AR step: ~33 ms + 1 ms commit
    root = TokenTree.root_only(7)
    # TAPS chose B* = 0 each time it drafted: an AR step plus the drafting, 4 times
    assert [skipped_after(fb, root, (0.0,), (), 0.034) for _ in range(4)] == [1, 2, 4, 4]
    chain = TokenTree.from_lists([7, 8, 9, 10, 11, 12], [-1, 0, 1, 2, 3, 4])
    raw = (0.0, *[math.log(0.9)] * 5)
    # all 5 accepted in one 50 ms round: 6 tokens for the time of 1.5 AR steps: open again
    assert skipped_after(fb, chain, raw, (8, 9, 10, 11, 12), 0.050) == 0
    assert skipped_after(fb, chain, raw, (8, 9, 10, 11, 12), 0.050) == 0
    # a tree that gets nothing costs more than the AR step it replaces: the average drops
    for _ in range(6):
        skipped_after(fb, chain, raw, (), 0.060)
    assert fb.saving.value < 0 and skipped_after(fb, chain, raw, (), 0.060) > 0


def test_siblings_never_promise_more_than_one_accepted_child():
    m = random_marginals(3, 4, seed=2)
    ctx = ctx_for(m)
    _, log_a = AcceptanceScorer(ctx, ConstantRho(0.7)).child_scores(1, [[]])
    assert log_a.exp().sum().item() == pytest.approx(1.0)  # 4 x 0.7 scaled down to 4 x 0.25
    inflating = AcceptanceCalibration(1.0, 0.5, 0.2)  # lifts 0.25 to 0.66: the scaling comes after
    _, log_a = AcceptanceScorer(ctx, ConstantRho(0.25), calibration=inflating).child_scores(3, [[1, 2]])
    assert log_a.exp().sum().item() == pytest.approx(1.0)
    _, log_q = AcceptanceScorer(ctx, None).child_scores(1, [[]])
    assert torch.allclose(log_q, m.log_probs[0].float())  # top-K of q already sums to <= 1


def test_taps_tree_carries_the_raw_estimates_the_calibration_is_fitted_on():
    m = random_marginals(5, 4, seed=4)
    params = TreeParams(budget=12, depth=5)
    measured = RoundContext(cost=FLAT, calibration=AcceptanceCalibration(-0.5, 1.5, -0.2))
    built = build_taps_tree(4, ctx_for(m), ConstantRho(0.1), params, measured)
    raw = built.node_log_acceptance
    assert len(raw) == len(built.tree.tokens) and raw[0] == 0.0
    assert raw[1:] == pytest.approx([math.log(0.1)] * (len(raw) - 1))  # before the map and scaling



def test_the_link_estimate_ignores_spikes():
    from presto_sd.method.cost_model import RollingMedian

    link = RollingMedian(window=31)
    assert link.value == 0.0  # before any call: no link to price
    for i in range(40):
        link.observe(0.5 if i % 10 == 9 else 0.002)  # a retransmit or a GC pause, one call in ten
    assert link.value == pytest.approx(0.002) and link.count == 40
    link.observe(float("nan"))
    link.observe(-0.001)  # the server's clock ran past the client's: no negative link
    assert link.count == 41 and link.value == pytest.approx(0.002)


def test_a_taps_request_on_a_verifier_without_a_cost_model_is_a_named_refusal(tiny_target):
    """An engine built by hand has no cost fit until ``calibrate_cost()``: a 'taps' request
    on it is refused with INVALID_ARGUMENT (found by the fuzz as an INTERNAL), and its
    sessions are closed."""
    from presto_sd.engine.messages import InvalidArgumentError
    from presto_sd.loop.generate import GenerationParams, generate
    from tests.conftest import make_engines

    verifier, drafter = make_engines(tiny_target)
    verifier.cost_model = verifier.calibrate_cost = lambda: None  # as a remote one never calibrated
    with pytest.raises(InvalidArgumentError, match="needs the verifier's cost model"):
        generate(verifier, drafter, [0, 3, 5, 7], GenerationParams(method="taps", max_new_tokens=8))
    assert len(verifier.sessions) == 0 and len(drafter.sessions) == 0
