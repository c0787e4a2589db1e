"""The owned decoder's AR steps through torch.compile, used where bitwise the eager forward.

An experiment, reached through ``HFVerifier(compile=True)`` / ``verifier_engine(compile=True)``
and ``scripts/compile_cost.py``, not a CLI flag: in-process it takes ~12 % off an int4 AR step
on a 2-vCPU EPYC, but in ``bench`` it is level with eager (within run-to-run noise) and the
load pays 30-150 s of compiling; docs/benchmarks.md ("torch.compile") has the figures.

Why the whole forward: a SmolLM2 AR step dispatches ~2,000 torch ops, ~1.5-3 µs each; in the
int4 mode that is as much time as the matmuls. Compiling pieces of a layer does not pay (a
compiled graph's call costs ~20-40 µs of guards and wrappers, what a layer's pointwise ops
cost eager); ``LlamaDecoder.layers_forward`` as one graph does. ``CompiledForward`` compiles
it for AR steps at one key width (one row group); trees and mixed widths run eager: each
count of row groups, a row group of one row, a width that fills its page and a page of one
slot are graphs of their own (~30 s cold on 2 cores, a few seconds from inductor's disk
cache); ``HFVerifier.warm_compiled`` compiles every AR one at load.

Nothing of the engine's arithmetic changes, by construction, and each graph proves it: the
linears, the rows' mean square (RMSNorm's statistic: inductor sums in its own order) and the
decode rows' attention (the eager kernel's softmax; SDPA's one-thread scope) are opaque ops in
the graph (``invariant._linear_op``, ``quant._int4_mm_op``, ``llama._mean_square_op``,
``invariant._row_attention_op``); RoPE's cos/sin come from eager (inductor's vectorized cos rounds its
own way); inductor rounds every intermediate to its dtype where eager does
(``emulate_precision_casts``); and the first call of every plan shape runs both, compiled
then eager (so the KV entries end as eager wrote them), and keeps the graph for that shape
only where every output is bitwise eager's. So AR stays bitwise the eager decoder's, and
through it transformers' in fp32.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

COMPILE_MAX_ROWS = 64  # forwards of more rows (prefills, big batches) run eager: matmul-bound
# inductor's options: bf16 intermediates rounded where eager rounds them
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}

Forward = Callable[..., tuple[torch.Tensor, list[torch.Tensor]]]  # (h, cos, sin, plan, keep)


def _shape(h: torch.Tensor, plan) -> tuple:
    """What a compiled graph's code depends on beyond the key widths (symbolic)."""
    return (h.shape[0], tuple(len(w.rows) for w in plan.writes),
            # (a width that fills its page is a view the size of the page, a page of one slot
            # a size of 1: other graphs)
            tuple((g.positions is None, len(g.rows), g.width == g.page.capacity, g.page.slots == 1)
                  for g in plan.groups))


def _mark_dynamic(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan,
                  marked: weakref.WeakKeyDictionary) -> None:
    """Rows, key widths and the KV pages' slots and capacities symbolic from the first call:
    one graph for every context length, batch and page (dynamo specializes a size of 1
    still: one session's step has a graph of its own). A page's tensors (two a layer) are
    marked once for each slot count (``marked``: page -> slots): growing replaces them."""
    mark = torch._dynamo.maybe_mark_dynamic
    mark(h, 0), mark(cos, 2), mark(sin, 2)
    for w in plan.writes:
        for t in (w.rows, w.slots, w.positions):
            mark(t, 0)
        if marked.get(w.page) != w.page.slots:
            for t in (*w.page.keys, *w.page.values):
                mark(t, 0), mark(t, 2)
            marked[w.page] = w.page.slots
    for g in plan.groups:
        for t in (g.rows, g.visible, g.positions, g.slots):
            if t is not None:
                for dim in range(t.dim()):
                    mark(t, dim)


class CompiledForward:
    """``forward`` compiled, for plans of AR steps, each plan shape checked once against
    ``forward`` itself (bitwise) before its graph is trusted."""

    def __init__(self, forward: Forward, max_rows: int = COMPILE_MAX_ROWS) -> None:
        self.forward, self.max_rows = forward, max_rows
        self.graph = torch.compile(forward, options=INDUCTOR_OPTIONS)
        self.agreed: dict[tuple, bool] = {}  # plan shape -> its graph's first call was bitwise eager
        self.failed: str | None = None  # why compiling failed (no C++ compiler...): eager from then on
        self.marked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KV page -> slots marked

    def takes(self, h: torch.Tensor, plan) -> bool:
        """AR steps at one key width (one row group: no prompt chunks, no tree nodes), at most
        ``max_rows``, of a shape not found to differ. (Each count of row groups would be a
        graph of its own: trees and mixed widths run eager.)"""
        return (self.failed is None and not plan.chunks and h.shape[0] <= self.max_rows
                and len(plan.groups) == 1 and plan.groups[0].positions is None
                and self.agreed.get(_shape(h, plan), True))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan,
                 keep_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        _mark_dynamic(h, cos, sin, plan, self.marked)
        try:
            out, kept = self.graph(h, cos, sin, plan, keep_layers)
        except Exception as e:  # inductor needs a working C++ toolchain, among others
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("torch.compile failed (%s): the decoder runs eager", self.failed.splitlines()[0])
            return self.forward(h, cos, sin, plan, keep_layers)
        shape = _shape(h, plan)
        if shape in self.agreed:
            return out, kept
        # first call of this shape: eager on the same inputs (its KV writes land last)
        ref, ref_kept = self.forward(h, cos, sin, plan, keep_layers)
        same = torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(kept, ref_kept))
        self.agreed[shape] = same
        if not same:
            log.warning("the compiled forward differs from eager for plan shape %s: it runs eager", shape)
        return ref, ref_kept
