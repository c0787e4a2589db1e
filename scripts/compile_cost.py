"""What torch.compile buys the owned decoder's AR step: an in-process A/B, compiled vs eager.

    .venv/bin/python scripts/compile_cost.py [--weights dense|gguf-int4] [--dtype auto]
        [--threads 2] [--steps 40] [--blocks 4]

Loads the verifier with ``compile=True`` (``models/compiled.py``: the forward of AR steps as
one inductor graph, bitwise the eager one, checked on each shape's first call), then times
``verify`` of AR steps on a 200-token context in alternating blocks with the compiled graph
switched on and off, so a drifting machine moves both alike. Prints the load's compile time,
per block the median step (ms), the ratio compiled / eager, and whether both produced the same
tokens. (The CLI has no flag for it: docs/benchmarks.md, "torch.compile", says why.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from presto_sd.embedded.stack import drafter_assets, verifier_engine, weights_dtype
from presto_sd.method.tree import TokenTree
from presto_sd.models.loading import load_target, parse_dtype
from presto_sd.models.quant import WEIGHTS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", choices=WEIGHTS, default="gguf-int4")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="AR steps a block")
    p.add_argument("--blocks", type=int, default=4, help="blocks a side, alternating")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_target(None, device=torch.device("cpu"),
                             dtype=weights_dtype(args.weights, parse_dtype(args.dtype)))
    start = time.perf_counter()
    v = verifier_engine(model, tok, None, drafter_assets(None, None), weights=args.weights, compile=True)
    graph = v.runner.owned.compiled
    load_s = time.perf_counter() - start
    print(f"dtype={model.dtype} weights={args.weights}: load with compile {load_s:.1f} s")

    def block(compiled: bool, name: str) -> tuple[list[int], float]:
        v.runner.owned.compiled = graph if compiled else None
        pre = v.prefill(name, [1 + i % 40000 for i in range(200)])
        base, anchor, tokens, times = pre.base, pre.anchor, [], []
        for _ in range(args.steps):
            t = time.perf_counter()
            res = v.verify(name, base, TokenTree.root_only(anchor))
            times.append(time.perf_counter() - t)
            base, anchor = res.base, res.bonus
            tokens.append(anchor)
        v.close(name)
        return tokens, statistics.median(times[5:]) * 1e3

    eager, compiled, same = [], [], True
    for b in range(args.blocks):
        t_eager, ms = block(False, f"eager{b}")
        eager.append(ms)
        t_comp, ms = block(True, f"compiled{b}")
        compiled.append(ms)
        same &= t_eager == t_comp
    print(f"AR step ms, eager:    {' '.join(f'{x:.2f}' for x in eager)}")
    print(f"AR step ms, compiled: {' '.join(f'{x:.2f}' for x in compiled)}")
    print(f"compiled / eager: {statistics.median(compiled) / statistics.median(eager):.3f}; "
          f"same tokens: {same}; shapes checked bitwise: {graph.agreed}")


if __name__ == "__main__":
    main()
