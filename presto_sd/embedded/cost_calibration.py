"""A short start-up calibration of a verifier's cost model, through the engine interface.

It opens scratch sessions at a few context lengths and times ``verify`` on trees of a
few sizes (interleaved, after a warm-up forward), then fits ``c(n, ctx)`` robustly
(``presto_sd.method.cost_model.fit_cost``). It works on any ``Verifier``; ``HFVerifier`` runs
it at start-up and keeps refining the fit from its real forwards.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import numpy as np

from presto_sd.engine.verifier import Verifier
from presto_sd.method.cost_model import CostFit, fit_cost
from presto_sd.method.tree import TokenTree

# 1 and 2 pin the step to a tree; a CPU's trees stay small, and a 128-node point would
# pull the line away from them (SmolLM2 here: 2 to 8 nodes cost about the same)
DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)
GPU_SIZES = (128, 256, 512)  # where a GPU's flat cost bends: measured, not extrapolated
DEFAULT_CONTEXTS = (32, 256)


def calibration_tree(anchor: int, n_nodes: int, vocab_size: int, max_depth: int) -> TokenTree:
    """A 4-ary tree of ``n_nodes`` tokens (root included) no deeper than ``max_depth``.

    The tokens are arbitrary: the cost of a forward depends on the node count and the
    context, not on which tokens are verified.
    """
    branching = 4
    while True:  # a k-ary heap layout: node i hangs under (i - 1) // k
        parents = [-1] + [(i - 1) // branching for i in range(1, n_nodes)]
        depths = [0]
        for i in range(1, n_nodes):
            depths.append(depths[parents[i]] + 1)
        if max(depths) <= max_depth:
            break
        branching *= 2
    tokens = [anchor] + [(anchor + 7 * i) % vocab_size for i in range(1, n_nodes)]
    return TokenTree(tuple(tokens), tuple(parents), tuple(depths))


def calibrate_verify_cost(
    verifier: Verifier,
    sizes: Sequence[int] = DEFAULT_SIZES,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    repeats: int = 2,
) -> CostFit:
    """Time ``verify`` over ``sizes x contexts x repeats`` and fit the cost model."""
    info = verifier.info()
    lim = info.limits
    if info.device.startswith("cuda"):
        sizes = (*sizes, *GPU_SIZES)
    sizes = sorted({max(1, min(n, lim.tree.max_nodes)) for n in sizes})
    depth_cap = max(1, min(lim.tree.max_depth, 8))
    contexts = sorted({max(2, min(c, lim.max_context - depth_cap - 8 - repeats * len(sizes) * 9))
                       for c in contexts})
    obs: list[tuple[int, int, float]] = []
    for ctx in contexts:
        sid = f"calibrate-{uuid.uuid4().hex[:8]}"
        prompt = [1 + i % (info.vocab_size - 1) for i in range(ctx)]
        pre = verifier.prefill(sid, prompt)
        try:
            res = verifier.verify(sid, pre.base, TokenTree.root_only(pre.anchor))  # warm-up
            base, anchor = res.base, res.bonus
            for _ in range(repeats):
                for n in sizes:
                    tree = calibration_tree(anchor, n, info.vocab_size, depth_cap)
                    t0 = time.perf_counter()
                    res = verifier.verify(sid, base, tree)
                    obs.append((n, base, time.perf_counter() - t0))
                    base, anchor = res.base, res.bonus
        finally:
            verifier.close(sid)
    n, c, s = (np.array(col) for col in zip(*obs))
    return fit_cost(n, c, s)
