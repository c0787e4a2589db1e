"""``presto-sd train choose-lambda``: a rho's lambda chosen by the replay on held-out prompts.

``train acceptance`` fits lambda_d on traces of marginal trees, so it can fit a provider that
rescores the marginal's candidates (``ngram``, ``hphi``, ``prefix``), not one that proposes
its own (``prefix-ngram``: each node's children drawn from the prefix head's conditional
given the node's token; ``ngram-lookup``: the marginal's top-K mixed with the request's own
n-gram row). Those get their lambda the way a link gets its rho: one replay per
value of a grid on held-out prompts, ``CHOICE_METHOD`` tau averaged over the budgets. The
best goes into ``presto.json``'s ``lambdas_by_rho`` and, with ``make_default``, becomes the
drafter's default rho where it beats the default's own score; the digests are rewritten.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from presto_sd.app.errors import FlagError
from presto_sd.app.training.export import HEAD_RHOS
from presto_sd.app.training.held_out_replay import CHOICE_METHOD, choice_score, held_out_replay, pooled
from presto_sd.models.assets import DIGESTS_FILE, PRESTO_FILE, has_prefix_head, write_digests
from presto_sd.models.loading import sha256_of

GRID = (0.0, 0.1, 0.25, 0.5, 1.0)
# rho providers whose lambda only a replay can choose
PROPOSING_RHOS = ("prefix-ngram", "ngram-lookup", "prefix-lookup")
# replayed and reported by a link, never chosen: a prefix head's children cost tree building
# (~1 ms a round) that a replay does not see, and at the CLI's budget 4 on a 2-core CPU their
# tau did not pay for it (paired, docs/benchmarks.md); ngram-lookup's building costs ~0.1 ms
REPORTED_ONLY_RHOS = ("prefix-ngram", "prefix-lookup")


def choose_lambda(
    drafter: Path, prompts: Sequence[str], out: Path, rho: str = "prefix-ngram",
    grid: Sequence[float] = GRID, budgets: Sequence[int] = (4, 16), max_new_tokens: int = 128,
    target: str | None = None, make_default: bool = False,
) -> dict:
    """Replay ``drafter`` with ``rho`` at each lambda of ``grid`` on the prompts the bench
    flags ``prompts`` name, each replay kept under ``out`` (a rerun with the same drafter
    files and settings reuses them; other ones are refused); write the best into its
    ``presto.json``; return (and write, ``out/lambda_report.json``) what was measured.
    ``make_default`` judges by tau alone: a proposing rho's tree building is not in it."""
    drafter, out = Path(drafter), Path(out)
    presto_file = drafter / PRESTO_FILE
    if rho not in PROPOSING_RHOS:  # the others' per-depth lambdas are train acceptance's fit
        raise FlagError(f"rho {rho!r}: choose-lambda chooses {', '.join(PROPOSING_RHOS)}'s lambda "
                        "(`train acceptance` fits the others per depth)")
    if not presto_file.is_file():
        raise FileNotFoundError(f"{presto_file}: choose-lambda adds to a drafter's fitted presto.json "
                                "(`presto-sd train acceptance` writes it)")
    if rho in HEAD_RHOS and not has_prefix_head(drafter):
        raise FlagError(f"{drafter} has no prefix head: {rho} draws children from one "
                        "(`train add-head`)")
    if not grid or any(lam < 0 for lam in grid):
        raise FlagError(f"grid {list(grid)}: give one or more lambdas >= 0")
    # the replays kept in `out` are reused only for the same drafter files and settings
    weights = {f.name: sha256_of(f) for f in sorted(drafter.glob("*.safetensors"))}
    settings = {"rho": rho, "budgets": list(budgets), "prompts": list(prompts),
                "max_new_tokens": max_new_tokens, "target": target, "weights": weights}
    record = out / "lambda_settings.json"
    if record.is_file() and json.loads(record.read_text()) != settings:
        raise FlagError(f"{out} holds replays of another head or other settings: give a new --out")
    out.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(settings, indent=2) + "\n")
    presto = json.loads(presto_file.read_text())
    scores = {}
    for lam in grid:
        rows = held_out_replay(drafter, out / f"{rho}-{lam:g}", rho, CHOICE_METHOD, prompts, budgets,
                               max_new_tokens, target, lambdas=(lam,))
        scores[lam] = choice_score(pooled(rows), budgets)
    best = max(grid, key=lambda lam: scores[lam])  # of equals, the first in the grid
    default = presto.get("rho")
    default_score = None
    if make_default and default and default != rho:
        rows = held_out_replay(drafter, out / f"default-{default}", default, CHOICE_METHOD, prompts,
                               budgets, max_new_tokens, target)
        default_score = choice_score(pooled(rows), budgets)
    presto.setdefault("lambdas_by_rho", {})[rho] = [best]
    becomes_default = make_default and (default_score is None or scores[best] > default_score)
    if becomes_default:
        presto.update(rho=rho, lambdas=[best])
    presto_file.write_text(json.dumps(presto, indent=2))
    if (drafter / DIGESTS_FILE).is_file():  # a dir that ships keeps its guard true
        write_digests(drafter)
    report = {"drafter": str(drafter), "rho": rho, "budgets": list(budgets), "prompts": list(prompts),
              "score_by_lambda": {f"{lam:g}": round(s, 4) for lam, s in scores.items()},
              "lambda": best, "default_rho": default,
              "default_score": None if default_score is None else round(default_score, 4),
              "default_now": presto["rho"]}
    (out / "lambda_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
