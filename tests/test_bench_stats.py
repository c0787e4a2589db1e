"""Bench statistics on a hand-built log: tau, tokens/s, speedup, time split, lossless."""

from __future__ import annotations

import pytest

from presto_sd.app.bench.stats import RunLog, summarize, table_rows, tau, time_split
from presto_sd.loop.generate import RoundStats


def rnd(accepted, size=0, draft=0.0, build=0.0, verify=0.0, commit=0.0):
    return RoundStats(accepted, size, draft, build, verify, commit)


def log(ds, pid, method, tokens, rounds, prefill, decode, budget=None):
    return RunLog(ds, pid, method, budget, tokens, rounds, prefill, decode)


# ar: 4 tokens in 1 s each prompt (the prefill's token + 3 one-token rounds)
AR = [
    log("d", "p0", "ar", [1, 2, 3, 4], [rnd(0, verify=0.3)] * 3, 0.1, 0.9),
    log("d", "p1", "ar", [5, 6, 7, 8], [rnd(0, verify=0.3)] * 3, 0.1, 0.9),
]
# a tree method: p0 in rounds of 3 and 1 tokens (accepted 2 and 0), p1 one round of 3;
# each round: draft 0.08 s (of which build 0.02), verify 0.1, commit 0.01
R = dict(draft=0.08, build=0.02, verify=0.1, commit=0.01)
TREE = [
    log("d", "p0", "marginal", [1, 2, 3, 4], [rnd(2, 8, **R), rnd(0, 8, **R)], 0.1, 0.4, budget=8),
    log("d", "p1", "marginal", [5, 6, 7, 9], [rnd(2, 6, **R)], 0.1, 0.2, budget=8),  # last token differs
]


def test_tau_is_accepted_plus_one_over_rounds():
    rounds = [x for r in TREE for x in r.rounds]
    assert tau(rounds) == pytest.approx((3 + 1 + 3) / 3)
    assert tau([]) is None


def test_row_arithmetic():
    row = summarize(TREE, AR, greedy=True)
    assert row["method"] == "marginal" and row["budget"] == 8 and row["prompts"] == 2
    assert row["new_tokens"] == 8 and row["rounds"] == 3
    assert row["tau"] == pytest.approx(7 / 3)
    assert row["tokens_per_s"] == pytest.approx(8 / 0.8)  # total tokens / total time
    assert row["speedup"] == pytest.approx(10 / 4)
    assert row["mean_tree_size"] == pytest.approx(22 / 3)
    assert row["lossless"] is False  # p1's last token differs
    assert row["ar_equal"] == pytest.approx(0.5)  # ... and p0's are ar's
    assert summarize(TREE[:1], AR, greedy=True)["lossless"] is True
    assert summarize(TREE, AR, greedy=False)["lossless"] is None  # sampling: not checked
    assert summarize(TREE, AR, greedy=False)["ar_equal"] is None
    assert summarize(TREE, None, greedy=True)["speedup"] is None


def test_time_split_is_shares_of_decode_time():
    split = time_split(TREE)  # decode 0.6 s; 3 rounds
    assert split["draft"] == pytest.approx(3 * 0.06 / 0.6)  # the drafter forward: build excluded
    assert split["build"] == pytest.approx(3 * 0.02 / 0.6)
    assert split["verify"] == pytest.approx(3 * 0.1 / 0.6)
    assert split["commit"] == pytest.approx(3 * 0.01 / 0.6)
    assert split["other"] == pytest.approx(0.05)  # what the rounds do not account for
    assert sum(split.values()) == pytest.approx(1.0)
    assert time_split(AR)["verify"] == pytest.approx(1.8 / 1.8)


def test_table_rows_per_dataset_then_pooled():
    other = [log("e", "q0", "ar", [1, 2], [rnd(0, verify=0.5)], 0.5, 0.5),
             log("e", "q0", "marginal", [1, 2], [rnd(1, 4, verify=0.25)], 0.25, 0.25, budget=8)]
    rows = table_rows(AR + TREE + other, greedy=True)
    keys = [(r["dataset"], r["method"]) for r in rows]
    assert keys == [("d", "ar"), ("d", "marginal"), ("e", "ar"), ("e", "marginal"),
                    ("all", "ar"), ("all", "marginal")]
    e_tree = rows[3]
    assert e_tree["speedup"] == pytest.approx(2.0) and e_tree["lossless"] is True
    pooled = rows[5]
    assert pooled["tokens_per_s"] == pytest.approx(10 / 1.3)
    assert pooled["speedup"] == pytest.approx((10 / 1.3) / (10 / 3.0))
    assert pooled["tau"] == pytest.approx((3 + 1 + 3 + 2) / 4)
    assert pooled["lossless"] is False
