"""Benchmark statistics: pure arithmetic over generation logs (no torch, no models).

A ``RunLog`` is one generation of one prompt by one (method, budget); its rounds are any
objects with ``accepted, tree_size, draft_s, build_s, verify_s, commit_s`` (the loop's
``RoundStats``). Conventions, as in DFlash / DDTree / PRESTO tables:

- ``tau`` = mean over rounds of (accepted draft tokens + 1 bonus); the prefill's first
  token is not a round.
- tokens/s = total new tokens / total wall time (prefill + decode) of the row's runs.
- speedup = the row's tokens/s / the ``ar`` row's tokens/s (same dataset, same run).
- time split = fractions of the decode wall time: ``draft`` (drafter forward, tree
  building excluded), ``build`` (tree building + scoring), ``verify``, ``commit`` and
  ``other`` (the loop's own overhead: what the rounds do not account for).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

SPLIT_KEYS = ("draft", "build", "verify", "commit", "other")


class Round(Protocol):
    accepted: int
    tree_size: int
    draft_s: float
    build_s: float
    verify_s: float
    commit_s: float


@dataclass
class RunLog:
    dataset: str
    prompt_id: str
    method: str
    budget: int | None
    token_ids: list[int]
    rounds: Sequence[Round]
    prefill_s: float
    decode_s: float
    finish_reason: str = "length"
    params: dict[str, Any] = field(default_factory=dict)  # method-specific settings

    @property
    def elapsed_s(self) -> float:
        return self.prefill_s + self.decode_s


def tau(rounds: Iterable[Round]) -> float | None:
    """Mean tokens committed per round (accepted + 1); None without rounds."""
    rounds = list(rounds)
    if not rounds:
        return None
    return sum(r.accepted + 1 for r in rounds) / len(rounds)


def tokens_per_s(runs: Sequence[RunLog]) -> float:
    return sum(len(r.token_ids) for r in runs) / max(1e-9, sum(r.elapsed_s for r in runs))


def speedup(tps: float, ar_tps: float | None) -> float | None:
    return tps / ar_tps if ar_tps else None


def time_split(runs: Sequence[RunLog]) -> dict[str, float]:
    """Fractions of the total decode wall time (they sum to 1; ``other`` is the rest)."""
    decode = sum(r.decode_s for r in runs)
    rounds = [x for r in runs for x in r.rounds]
    if decode <= 0:
        return dict.fromkeys(SPLIT_KEYS, 0.0)
    split = {
        "draft": sum(x.draft_s - x.build_s for x in rounds) / decode,
        "build": sum(x.build_s for x in rounds) / decode,
        "verify": sum(x.verify_s for x in rounds) / decode,
        "commit": sum(x.commit_s for x in rounds) / decode,
    }
    split["other"] = 1.0 - sum(split.values())
    return split


def ar_equal(runs: Sequence[RunLog], reference: dict[str, list[int]] | None) -> float | None:
    """The share of prompts whose tokens equal the reference (``ar``) tokens; None when
    there is no reference to compare with (sampling, or no ``ar`` in the run). 1 for every
    method of ours (``lossless``); a peer with its own arithmetic may differ."""
    if reference is None:
        return None
    return sum(r.token_ids == reference.get(_key(r)) for r in runs) / len(runs)


def lossless(share_equal: float | None) -> bool | None:
    """Every run's tokens are the reference's (``ar_equal`` is 1); None without a reference."""
    return None if share_equal is None else share_equal == 1


def _key(run: RunLog) -> str:
    return f"{run.dataset}\x00{run.prompt_id}"


def reference_tokens(ar_runs: Sequence[RunLog]) -> dict[str, list[int]]:
    return {_key(r): r.token_ids for r in ar_runs}


def summarize(
    runs: Sequence[RunLog], ar_runs: Sequence[RunLog] | None, greedy: bool, dataset: str | None = None
) -> dict[str, Any]:
    """One table row for the runs of one (dataset, method, budget)."""
    if not runs:
        raise ValueError("summarize: no runs")
    rounds = [x for r in runs for x in r.rounds]
    tps = tokens_per_s(runs)
    ar_tps = tokens_per_s(ar_runs) if ar_runs else None
    ref = reference_tokens(ar_runs) if ar_runs and greedy else None
    equal = ar_equal(runs, ref)
    first = runs[0]
    return {
        "dataset": dataset or first.dataset,
        "method": first.method,
        "budget": first.budget,
        "params": first.params,
        "prompts": len(runs),
        "new_tokens": sum(len(r.token_ids) for r in runs),
        "rounds": len(rounds),
        "tau": tau(rounds),
        "tokens_per_s": tps,
        "speedup": speedup(tps, ar_tps),
        "mean_tree_size": sum(x.tree_size for x in rounds) / len(rounds) if rounds else None,
        "time_split": time_split(runs),
        "prefill_s": sum(r.prefill_s for r in runs),
        "decode_s": sum(r.decode_s for r in runs),
        "lossless": lossless(equal),
        "ar_equal": equal,
    }


def table_rows(runs: Sequence[RunLog], greedy: bool, pooled: bool = True) -> list[dict[str, Any]]:
    """Rows per (dataset, method, budget), dataset by dataset in first-seen order, then
    pooled ``all`` rows when there is more than one dataset. Each row's speedup is against ``ar`` on the same
    prompts."""
    groups: dict[tuple[str, str, int | None], list[RunLog]] = {}
    for r in runs:
        groups.setdefault((r.dataset, r.method, r.budget), []).append(r)
    datasets = list(dict.fromkeys(r.dataset for r in runs))
    rows = []
    for (ds, _, _), group in sorted(groups.items(), key=lambda kv: datasets.index(kv[0][0])):
        ar = [r for r in runs if r.dataset == ds and r.method == "ar"]
        rows.append(summarize(group, ar or None, greedy))
    if pooled and len(datasets) > 1:
        ar = [r for r in runs if r.method == "ar"]
        pooled_groups: dict[tuple[str, int | None], list[RunLog]] = {}
        for r in runs:
            pooled_groups.setdefault((r.method, r.budget), []).append(r)
        for group in pooled_groups.values():
            rows.append(summarize(group, ar or None, greedy, dataset="all"))
    return rows
