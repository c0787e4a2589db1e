"""``presto-sd``: the command line, one module per command group.

    presto-sd generate "PROMPT" [--method presto-best-first] [--budget 4] [--json]   (app/generate.py)
    presto-sd generate "PROMPT" --drafter-addr HOST:PORT --verifier-addr HOST:PORT
    presto-sd generate "PROMPT" --orchestrator-addr HOST:PORT
    presto-sd serve drafter|verifier|orchestrator --port P                        (app/serve.py)
    presto-sd up [--port P]                                                       (app/up.py)
    presto-sd models fetch                                                        (app/models.py)
    presto-sd train gen-data | drafter | acceptance                               (app/training/cli.py)
    presto-sd bench [--datasets gsm8k,humaneval,mtbench] [--methods ...] [--budgets 8,16,32] --out DIR
                                                                                  (app/bench/cli.py)
Shared flags live in ``app/flags.py``; the engines a command runs on are built by ``app/stack.py``.
A ``UsageError`` (``app/errors.py``: a bad value, a missing corpus, a work dir made otherwise, an
output dir that must be new) exits 1 with one line, ``presto-sd: <why>``; any other exception keeps
its traceback.
"""

from __future__ import annotations

import argparse

from presto_sd.app import generate, models, serve, up
from presto_sd.app.bench import cli as bench_cli
from presto_sd.app.errors import UsageError
from presto_sd.app.training import cli as train_cli
from presto_sd.models.assets import DrafterNotFoundError
from presto_sd.models.dflash_fields import UnsupportedDrafterConfig

COMMAND_GROUPS = (generate, models, train_cli, bench_cli, serve, up)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="presto-sd",
        description="Lossless speculative decoding with a diffusion drafter and PRESTO/TAPS token trees.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, DrafterNotFoundError, UnsupportedDrafterConfig) as e:  # what was asked, not a bug
        raise SystemExit(f"presto-sd: {e}") from None


if __name__ == "__main__":
    raise SystemExit(main())
