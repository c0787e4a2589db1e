"""The attention split (``attention_cost.py --split-grid``) wired into a real forward, on and off, paired.

The verifier's decode-row attention (``invariant.ATTENTION_KERNELS["sdpa"]``) is replaced,
for the "on" runs, by one that splits a call of at least ``--split-from`` units x keys in
two halves over two Python threads (each SDPA on one OpenMP thread: bitwise the same).
One embedded stack (the CLI default's: the shipped drafter, bf16 where native), one long
prompt (``--background N`` copies of a sentence before it, as ``round_profile.py``), then
for each method runs of ``generate`` with the split off and on, alternating, ``--pairs``
times: the median tokens/s of each and their ratio pair by pair, and whether the two give
the same tokens (they must: the split computes every unit as one call does).

    .venv/bin/python scripts/attention_split_ab.py --background 30          # ~650 keys
    .venv/bin/python scripts/attention_split_ab.py --background 0           # ~190 keys

Time it on a quiet machine (stop background jobs, and check `ps -o stat` shows `T`).
"""

from __future__ import annotations

import argparse
import statistics
import time

BACKGROUND = "Here is some background text about the history of painting and robots. "
PROMPT = "Now: write a short story about a robot who learns to paint, in five sentences."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--background", type=int, default=30)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="ar,presto-best-first")
    p.add_argument("--split-from", type=int, default=8000, help="units x keys (the grid's break-even)")
    args = p.parse_args()

    import torch
    from attention_cost import _split_rows

    from presto_sd.app.cli import build_parser
    from presto_sd.app.generate import encode_prompt
    from presto_sd.app.stack import engine_stack, generation_params
    from presto_sd.loop.generate import generate
    from presto_sd.models import invariant

    one_call = invariant.ATTENTION_KERNELS["sdpa"]

    def split_kernel(query, keys, values, visible, scaling):
        units, dim = query.shape[0] * query.shape[1], 0 if query.shape[0] >= query.shape[1] else 1
        if torch.get_num_threads() >= 2 and units >= 2 and units * keys.shape[-2] >= args.split_from:
            return _split_rows(query, keys, values, visible, scaling, dim)
        return one_call(query, keys, values, visible, scaling)

    cli = build_parser().parse_args(["generate", "x"])
    stack = engine_stack(cli)
    prompt = encode_prompt(stack.tokenizer, BACKGROUND * args.background + PROMPT, True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; prompt {len(prompt)} tokens, "
          f"{args.max_new_tokens} new; split from {args.split_from} units x keys")
    for method in args.methods.split(","):
        run_args = build_parser().parse_args(["generate", "x", "--method", method,
                                              "--max-new-tokens", str(args.max_new_tokens)])
        params = generation_params(run_args, stack.verifier.eos_token_ids, stack.drafter_info)
        drafter = None if method == "ar" else stack.drafter
        rates: dict[str, list[float]] = {"off": [], "on": []}
        tokens: dict[str, list[int]] = {}
        for _ in range(args.pairs + 1):  # the first pair warms up
            for name, kernel in (("off", one_call), ("on", split_kernel)):
                invariant.ATTENTION_KERNELS["sdpa"] = kernel
                t0 = time.perf_counter()
                res = generate(stack.verifier, drafter, prompt, params)
                rates[name].append(len(res.token_ids) / (time.perf_counter() - t0))
                assert tokens.setdefault(name, res.token_ids) == res.token_ids
        invariant.ATTENTION_KERNELS["sdpa"] = one_call
        off_s, on_s = rates["off"][1:], rates["on"][1:]
        ratio = statistics.median(b / a for a, b in zip(off_s, on_s))
        print(f"{method:18s} off {statistics.median(off_s):6.1f} tok/s, on {statistics.median(on_s):6.1f} "
              f"(on/off median of pairs {ratio:.3f}, range {min(b / a for a, b in zip(off_s, on_s)):.3f}-"
              f"{max(b / a for a, b in zip(off_s, on_s)):.3f}); same tokens: {tokens['off'] == tokens['on']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
