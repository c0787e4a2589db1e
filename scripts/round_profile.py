"""Where a round's time goes: `presto-sd generate` with timers around the engines' calls.

`bench` splits decode time into draft / build / verify / commit; this splits those further,
per call of the embedded engines: the verifier's target forward, its lm_head, the walk and
the commit; the drafter's forward (its marginals) and its KV commit. One prompt, the
embedded default stack, any `generate` flags after `--`:

    .venv/bin/python scripts/round_profile.py                      # presto-best-first@4
    .venv/bin/python scripts/round_profile.py -- --method ar       # the engine's AR, for the ratio
    .venv/bin/python scripts/round_profile.py --background 30      # a ~600-token context

Time it on a quiet machine (pause background jobs: `kill -STOP`). Timers add ~1 us a call.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time

PROMPT = "Write a short story about a robot who learns to paint, in five sentences."
# --background N puts N copies before the prompt (~14 tokens each): a long context
BACKGROUND = "Here is some background text about the history of painting and robots. "
VERIFIER_CALLS = {"runner.forward": "target forward", "runner.logits": "lm_head (fp32 logits)",
                  "_walk": "walk", "_commit": "commit", "verify_batch": "verify_batch (all of it)"}
DRAFTER_CALLS = {"_marginals": "drafter forward", "commit": "drafter KV commit",
                 "draft_batch": "draft_batch (all of it)"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--background", type=int, default=0,
                   help="copies of a background sentence before the prompt (30: ~450 more context tokens)")
    p.add_argument("generate_args", nargs="*", help="more `presto-sd generate` flags, after --")
    args = p.parse_args()

    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def timed(owner, name: str, label: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - t0
                calls[label] += 1

        setattr(owner, name, wrapper)

    from presto_sd.app import stack as app_stack
    from presto_sd.app.cli import build_parser

    engine_stack = app_stack.engine_stack

    def timed_stack(cli_args):
        stack = engine_stack(cli_args)
        for path, label in VERIFIER_CALLS.items():
            owner = stack.verifier
            *parents, name = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            timed(owner, name, label)
        for name, label in DRAFTER_CALLS.items():
            if hasattr(stack.drafter, name):
                timed(stack.drafter, name, label)
        return stack

    app_stack.engine_stack = timed_stack
    prompt = BACKGROUND * args.background + ("Now: " if args.background else "") + args.prompt
    cli = build_parser().parse_args(["generate", prompt, "--max-new-tokens", str(args.max_new_tokens),
                                     *args.generate_args])
    cli.run(cli)
    rounds = max(calls["verify_batch (all of it)"], 1)
    print(f"\nper round ({rounds} rounds), ms:", file=sys.stderr)
    for label in [*VERIFIER_CALLS.values(), *DRAFTER_CALLS.values()]:
        if calls[label]:
            per_round = seconds[label] / rounds * 1e3
            print(f"  {label:26s} {per_round:7.2f}   ({calls[label]} calls)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
