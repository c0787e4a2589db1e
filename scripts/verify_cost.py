"""What the engine's verify costs against the tree size: the row-invariant forward, timed.

    .venv/bin/python scripts/verify_cost.py [--dtype bfloat16] [--context 200] [--threads 2]
        [--sizes 1,2,4,8,16,32] [--reps 15] [--shape 4-ary|chain]
        [--self-draft DIR --chains 4 [--max-chains K]] [--weights dense|gguf-int4]

Opens one ``HFVerifier`` session on a ``--context``-token prompt and times ``verify`` (the
decoder, the walk's lm_head rows, the KV compaction: all an AR step or a tree costs the
verifier) on trees of each size, the sizes interleaved within every repetition so a
machine that drifts moves them all alike. Size 1 is a plain AR step. Prints per size the
median ms (the first 2 repetitions dropped) and its ratio to the AR step. The trees'
tokens are arbitrary (cost does not depend on them), so each round commits a token or
two and the context grows by ~``reps * len(sizes)`` over the run.

``--self-draft DIR --chains D``: the verifier carries that adapter and every tree of size
``n`` also carries mask chains of ``D`` rows after each node (or its first ``--max-chains``):
what a self-speculative round costs (docs/self_speculative.md); the ratio is still to the
plain AR step (size 1 without chains), timed in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from presto_sd.embedded.cost_calibration import calibration_tree
from presto_sd.embedded.stack import drafter_assets, verifier_engine, weights_dtype
from presto_sd.engine.verifier import MaskChains
from presto_sd.method.tree import TokenTree
from presto_sd.models.loading import load_target, parse_dtype
from presto_sd.models.quant import WEIGHTS
from presto_sd.models.self_draft import SelfDraftAdapter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes", default="1,2,4,8,16,32")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--shape", choices=("4-ary", "chain"), default="4-ary")
    p.add_argument("--self-draft", default=None, help="a self-draft adapter dir: time self rounds")
    p.add_argument("--chains", type=int, default=0, help="mask rows per chain (with --self-draft)")
    p.add_argument("--max-chains", type=int, default=0, help="chains after the first K nodes (0: every node)")
    p.add_argument("--weights", choices=WEIGHTS, default="dense", help="the verifier's linear weights")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = weights_dtype(args.weights, parse_dtype(args.dtype))
    model, tok = load_target(None, device=torch.device("cpu"), dtype=dtype)
    adapter = SelfDraftAdapter.load(Path(args.self_draft), model.dtype) if args.self_draft else None
    verifier = verifier_engine(model, tok, None, drafter_assets(None, None), adapter=adapter,
                               weights=args.weights)
    sizes = [int(x) for x in args.sizes.split(",")]
    if adapter is not None and args.chains:
        sizes = [1, *(-n for n in sizes)]  # -n: a tree of n nodes with its chains; 1: the AR step

    def chains(n: int) -> MaskChains | None:
        if n > 0:
            return None
        k = -n if not args.max_chains else min(-n, args.max_chains)
        return MaskChains(tuple(range(k)), args.chains)

    pre = verifier.prefill("cost", [1 + i % 40000 for i in range(args.context)])
    base, anchor = pre.base, pre.anchor
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(args.reps):
        for n in sizes:
            size = abs(n)
            if args.shape == "chain":
                tokens = [anchor, *(7 * i + 3 for i in range(1, size))]
                tree = TokenTree.from_lists(tokens, list(range(-1, size - 1)))
            else:
                tree = calibration_tree(anchor, size, verifier.vocab_size, 8)
            t0 = time.perf_counter()
            res = verifier.verify("cost", base, tree, chains=chains(n))
            times[n].append(1000 * (time.perf_counter() - t0))
            base, anchor = res.base, res.bonus
    med = {n: statistics.median(t[2:]) for n, t in times.items()}
    step = med.get(1)
    print(f"dtype={model.dtype} context={args.context} threads={args.threads} shape={args.shape} "
          f"weights={args.weights} row_invariant={getattr(verifier, 'row_invariant', None)}")
    for n in sizes:
        ratio = f"  {med[n] / step:.2f}x the AR step" if step else ""
        ch = chains(n)
        extra = f" + {ch.rows} mask rows" if ch is not None else ""
        print(f"  {abs(n):3d} nodes{extra}: {med[n]:6.1f} ms{ratio}")


if __name__ == "__main__":
    main()
