"""The decode rows' attention kernel, A/B in one process: the engine's verify of an AR step
and of a 5-node tree, the verifier's kernel switched between alternating blocks.

    .venv/bin/python scripts/attention_kernel_ab.py [--kernels native,sdpa] [--contexts 150,500]
        [--blocks 6] [--reps 5]

Both kernels are row-invariant, so either gives a lossless engine; this only times them
(quiet machine: pause background jobs with ``kill -STOP``). Prints the median verify ms of
each kernel, rows and context, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from presto_sd.embedded.cost_calibration import calibration_tree
from presto_sd.embedded.stack import drafter_assets, verifier_engine
from presto_sd.models.loading import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default="native,sdpa", help="two of the verifier's attention kernels")
    p.add_argument("--contexts", default="150,500", help="prompt lengths, tokens")
    p.add_argument("--blocks", type=int, default=6, help="alternating blocks per kernel")
    p.add_argument("--reps", type=int, default=5, help="verifies of each size a block")
    args = p.parse_args()
    a, b = args.kernels.split(",")
    torch.set_num_threads(2)
    model, tok = load_target(None, device=torch.device("cpu"), dtype=torch.bfloat16)
    verifier = verifier_engine(model, tok, None, drafter_assets(None, None))
    runner = verifier.runner
    print(f"the verifier picked {runner.attention_kernel!r}; timing {a} against {b}, bf16, 2 threads")
    for context in (int(c) for c in args.contexts.split(",")):
        sid = f"ctx{context}"
        pre = verifier.prefill(sid, [1 + i % 40000 for i in range(context)])
        base, anchor = pre.base, pre.anchor
        times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in (a, b) for n in (1, 5)}
        for block in range(args.blocks):
            for kernel in (a, b) if block % 2 == 0 else (b, a):
                runner.attention_kernel = kernel
                for _ in range(args.reps):
                    for n in (1, 5):
                        tree = calibration_tree(anchor, n, verifier.vocab_size, 8)
                        t0 = time.perf_counter()
                        res = verifier.verify(sid, base, tree)
                        times[(kernel, n)].append(1000 * (time.perf_counter() - t0))
                        base, anchor = res.base, res.bonus
        for n in (1, 5):
            ta, tb = (statistics.median(times[(k, n)]) for k in (a, b))
            print(f"context ~{context}: {n}-row verify {a} {ta:.1f} ms, {b} {tb:.1f} ms ({ta / tb:.3f})")
        verifier.close(sid)


if __name__ == "__main__":
    main()
