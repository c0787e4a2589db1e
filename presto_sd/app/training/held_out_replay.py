"""The replay a training choice reads: ``bench --replay`` of a drafter on held-out prompts.

A link chooses its rho and its verdict with it (``link.py``); ``choose_lambda.py`` a
proposing provider's lambda. Both score a drafter the same way: ``CHOICE_METHOD`` tau
over every prompt, averaged over the budgets.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

CHOICE_METHOD = "presto-best-first"  # the CLI default's builder: what a rho is chosen for


def held_out_replay(
    drafter: Path, out: Path, rho: str, methods: str, prompts: Sequence[str], budgets: Sequence[int],
    max_new_tokens: int, target: str | None = None, lambdas: Sequence[float] | None = None,
) -> list[dict]:
    """``bench --replay`` of ``drafter`` with ``rho`` (at ``lambdas``, else its fitted ones) on
    ``prompts`` (bench flags), its output kept in ``out`` and reused when there: its rows (a
    method, budget and prompt set each)."""
    if not (out / "replay.json").is_file():
        import argparse

        from presto_sd.app.bench.cli import register

        argv = ["bench", "--replay", "--drafter", str(drafter), "--methods", methods,
                "--budgets", ",".join(map(str, budgets)), *prompts,
                "--max-new-tokens", str(max_new_tokens), "--rho", rho, "--positions-top-k", "0",
                "--no-progress", "--out", str(out),
                *(["--lambda", ",".join(map(str, lambdas))] if lambdas is not None else []),
                *(["--target", target] if target else [])]
        parser = argparse.ArgumentParser(prog="presto-sd")
        register(parser.add_subparsers())
        args = parser.parse_args(argv)
        args.run(args)
    return json.loads((out / "replay.json").read_text())["rows"]


def pooled(rows: list[dict]) -> dict[str, float]:
    """Tau per method and budget over every prompt (one set: its own rows)."""
    return taus([r for r in rows if r["dataset"] == "all"] or rows)


def taus(rows: list[dict]) -> dict[str, float]:
    return {r["method"] + (f"@{r['budget']}" if r["budget"] else ""): round(r["tau"], 4) for r in rows}


def by_set(rows: list[dict]) -> dict[str, dict[str, float]]:
    """A replay's ``CHOICE_METHOD`` taus per prompt set (the mix's three; one set reads as itself)."""
    rows = [r for r in rows if r["method"] == CHOICE_METHOD]
    return {ds: taus([r for r in rows if r["dataset"] == ds])
            for ds in dict.fromkeys(r["dataset"] for r in rows) if ds != "all"}


def choice_score(pooled_taus: dict[str, float], budgets: Sequence[int]) -> float:
    """``CHOICE_METHOD`` tau averaged over ``budgets``: what every choice maximises."""
    return sum(pooled_taus[f"{CHOICE_METHOD}@{b}"] for b in budgets) / len(budgets)
