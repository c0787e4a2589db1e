"""How many torch ops one verifier step dispatches: the Python overhead a token pays.

    .venv/bin/python scripts/op_count.py [--dtype auto] [--weights dense|gguf-int4] [--nodes 1,8]
        [--self-draft DIR --chains 4]

Counts every aten op (``TorchDispatchMode``) the engine's ``verify`` runs for an AR step
(a root-only tree) and for trees of ``--nodes``, after a warm-up, on a 200-token context,
and prints the total per step and the most frequent ops. Counts do not depend on the
machine's load (unlike times), so this runs beside anything; it is what each cut of the
per-token Python work (issue: the owned decoder) is measured by. ``--self-draft DIR --chains
D``: each tree also carries one self-draft chain of ``D`` mask rows after its root, counted
beside the same tree without it.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from presto_sd.embedded.cost_calibration import calibration_tree
from presto_sd.embedded.stack import drafter_assets, verifier_engine, weights_dtype
from presto_sd.engine.verifier import MaskChains
from presto_sd.models.loading import load_target, parse_dtype
from presto_sd.models.self_draft import SelfDraftAdapter


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weights", default="dense", choices=("dense", "gguf-int4"))
    p.add_argument("--nodes", default="1,8")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--self-draft", default=None, help="a self-draft adapter dir")
    p.add_argument("--chains", type=int, default=0, help="mask rows of a chain after the root")
    args = p.parse_args()
    model, tok = load_target(None, device=torch.device("cpu"),
                             dtype=weights_dtype(args.weights, parse_dtype(args.dtype)))
    adapter = SelfDraftAdapter.load(Path(args.self_draft), model.dtype) if args.self_draft else None
    verifier = verifier_engine(model, tok, None, drafter_assets(None, None), weights=args.weights,
                               adapter=adapter)
    variants = [None, MaskChains((0,), args.chains)] if adapter is not None and args.chains else [None]
    pre = verifier.prefill("ops", [1 + i % 40000 for i in range(200)])
    base, anchor = pre.base, pre.anchor
    print(f"dtype={model.dtype} weights={args.weights} decoder="
          f"{'owned' if verifier.runner.owned is not None else 'transformers'}")
    for n in (int(x) for x in args.nodes.split(",")):
        for chains in variants:
            for counting in (False, True):  # a warm-up step first: lazy inits are not a step's work
                tree = calibration_tree(anchor, n, verifier.vocab_size, 8)
                mode = _Count()
                if counting:
                    with mode:
                        res = verifier.verify("ops", base, tree, chains=chains)
                else:
                    res = verifier.verify("ops", base, tree, chains=chains)
                base, anchor = res.base, res.bonus
            total = sum(mode.ops.values())
            top = ", ".join(f"{k} {v}" for k, v in mode.ops.most_common(args.top))
            extra = f" + a chain of {chains.depth}" if chains is not None else ""
            per_layer = total / model.config.num_hidden_layers
            print(f"  {n:3d} nodes{extra}: {total} ops ({per_layer:.0f} a layer); {top}")


if __name__ == "__main__":
    main()
