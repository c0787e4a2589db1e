"""Two rho settings of one method, live, paired: what a rho's tau costs in tree building.

One embedded stack (the CLI default's: the shipped drafter, bf16 where native), the first
``--n`` held-out prompts of each ``--datasets`` set, then ``--pairs`` passes over them with
setting A and setting B in turn (which goes first alternates): each pass's tokens/s, their
medians, the B/A ratio pair by pair, and whether both give the same tokens (they must: the
tree changes, the output does not). The first pair warms up and is not counted.

    .venv/bin/python scripts/rho_ab.py --a prefix-ngram:0.25 --b ngram   # ngram at its fitted lambdas
    .venv/bin/python scripts/rho_ab.py --a prefix-ngram:0.25@6 --b ngram@4   # and a budget each

Time it on a quiet machine (stop background jobs, and check `ps -o stat` shows `T`).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", default="prefix-ngram:0.25",
                   help="RHO[:LAMBDAS][@BUDGET] (no lambdas: the drafter's fitted ones; no budget: "
                        "--budget) (default: %(default)s)")
    p.add_argument("--b", default="ngram", help="RHO[:LAMBDAS][@BUDGET] (default: %(default)s)")
    p.add_argument("--method", default="presto-best-first")
    p.add_argument("--budget", type=int, default=4)
    p.add_argument("--datasets", default="gsm8k,mtbench")
    p.add_argument("--n", type=int, default=4, help="prompts of each set")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()

    import torch

    from presto_sd.app.cli import build_parser
    from presto_sd.app.datasets import load_prompts
    from presto_sd.app.stack import engine_stack, generation_params
    from presto_sd.loop.generate import generate
    from presto_sd.models.loading import encode_messages

    stack = engine_stack(build_parser().parse_args(["generate", "x"]))
    prompts = [encode_messages(stack.tokenizer, q.messages, True)
               for ds in args.datasets.split(",") for q in load_prompts(ds, "heldout", args.n)]
    settings = {}
    for name, spec in (("A", args.a), ("B", args.b)):
        spec, _, budget = spec.partition("@")
        rho, _, lambdas = spec.partition(":")
        flags = ["generate", "x", "--method", args.method, "--budget", budget or str(args.budget),
                 "--rho", rho, *(["--lambda", lambdas] if lambdas else []),
                 "--max-new-tokens", str(args.max_new_tokens)]
        settings[name] = generation_params(build_parser().parse_args(flags), stack.verifier.eos_token_ids,
                                           stack.drafter_info)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(prompts)} prompts, "
          f"{args.max_new_tokens} new; {args.method} (budget {args.budget} unless named): "
          f"A {args.a}, B {args.b}")
    rates: dict[str, list[float]] = {"A": [], "B": []}
    rounds: dict[str, list] = {"A": [], "B": []}  # the counted passes' rounds: where a round's time goes
    outputs: dict[str, list[list[int]]] = {}
    for k in range(args.pairs + 1):  # the first pair warms up
        for name in ("A", "B") if k % 2 == 0 else ("B", "A"):
            t0, tokens, outs = time.perf_counter(), 0, []
            for prompt in prompts:
                res = generate(stack.verifier, stack.drafter, prompt, settings[name])
                tokens += len(res.token_ids)
                outs.append(res.token_ids)
                if k:
                    rounds[name].extend(res.rounds)
            rates[name].append(tokens / (time.perf_counter() - t0))
            assert outputs.setdefault(name, outs) == outs
    a, b = rates["A"][1:], rates["B"][1:]
    ratios = [y / x for x, y in zip(a, b)]
    print(f"A {statistics.median(a):6.1f} tok/s, B {statistics.median(b):6.1f} (B/A median of pairs "
          f"{statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}); "
          f"same tokens: {outputs['A'] == outputs['B']}")
    for name in ("A", "B"):
        rs = rounds[name]
        ms = {part: 1e3 * statistics.fmean(getattr(r, part) for r in rs)
              for part in ("draft_s", "build_s", "verify_s")}
        print(f"{name}: tau {sum(r.accepted + 1 for r in rs) / len(rs):.3f} over {len(rs)} rounds; a round's "
              f"draft {ms['draft_s']:.2f} ms (build {ms['build_s']:.2f}), verify {ms['verify_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
