"""What a tree's decode rows cost in attention, and two ways around it that were measured.

The verifier attends every decode row as a batch unit of its own (``invariant.row_attention``:
torch's fused SDPA on one OpenMP thread, over the row's keys gathered into the AR step's
layout), so a tree of R rows costs R units over the whole context: on a CPU a tree's
forward grows with R x context. This times, at SmolLM2's shapes (3 KV heads, 3 query heads
each, head_dim 64), per layer:

- ``gather``: the tree's keys and values gathered (as ``packed._group_attention`` does);
- ``sdpa rows``: torch's SDPA over them (the engine's kernel where the C one is not built);
- ``native in place``: the C kernel (``native_rows.py``, the engine's bf16 kernel where it is
  built) reading the same keys in place, no gather, each row alone;
- ``native shared prefix``: the same with the rows over each KV head as one run
  (``native_rows.SharedRuns``: the committed prefix read once for them, as the verifier calls it);
- ``sdpa rows, 2 py threads``: the rows split over two Python threads, each call on one
  OpenMP thread (bitwise the same: checked);
- ``eager shared``: the alternative of reading the shared prefix once: every row's queries
  in ONE matmul against the prefix in place, the last partial block per row, one fp32
  softmax (as transformers' eager attention), each row split at a point only its position
  sets; with whether its rows agree between R rows sharing the prefix and AR steps
  (bf16 and fp32);
- ``one small op``: a masked_fill of the scores' size, the floor each eager op pays here.

    .venv/bin/python scripts/attention_cost.py          # on a quiet machine (kill -STOP your jobs)
    .venv/bin/python scripts/attention_cost.py --split-grid   # one SDPA call against two threads
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from presto_sd.models import native_rows
from presto_sd.models.invariant import KEY_BLOCK, _sdpa_rows, key_width

KV, GROUP, HD = 3, 3, 64


# the split's second thread (``_sdpa_rows`` has ATen's per-thread init done before its one-thread scope)
_POOL = ThreadPoolExecutor(1, thread_name_prefix="split")


def _split_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                scaling: float, dim: int) -> torch.Tensor:
    """The call's units in two halves along ``dim``, the second on the other thread."""
    half, n = query.shape[dim] // 2, query.shape[dim]

    def part(x: torch.Tensor, start: int, length: int) -> torch.Tensor:
        return x.narrow(dim, start, length) if x.shape[dim] > 1 else x  # visible may broadcast

    later = _POOL.submit(_sdpa_rows, *(part(x, half, n - half) for x in (query, keys, values, visible)),
                         scaling)
    first = _sdpa_rows(*(part(x, 0, half) for x in (query, keys, values, visible)), scaling)
    return torch.cat([first, later.result()], dim)


def timed(f, n: int = 300) -> float:
    """Microseconds a call, after a warm-up."""
    for _ in range(20):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def eager_shared(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, tail_k: torch.Tensor,
                 tail_v: torch.Tensor, shared: bool) -> torch.Tensor:
    """q [R, kv, g, hd]; the prefix [kv, P, hd] (shared) or [R, kv, P, hd]; tails [R, kv, 64, hd]."""
    rows, p = q.shape[0], prefix_k.shape[-2]
    if shared:
        stacked = q.transpose(0, 1).reshape(KV, rows * GROUP, HD)
        pre = torch.matmul(stacked, prefix_k.transpose(-1, -2)).view(KV, rows, GROUP, p).transpose(0, 1)
    else:
        pre = torch.matmul(q, prefix_k.transpose(-1, -2))
    scores = torch.cat([pre, torch.matmul(q, tail_k.transpose(-1, -2))], dim=-1) * HD**-0.5
    w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(w[..., p:], tail_v)
    if shared:
        wp = w[..., :p].transpose(0, 1).reshape(KV, rows * GROUP, p)
        return out + torch.matmul(wp, prefix_v).view(KV, rows, GROUP, HD).transpose(0, 1)
    return out + torch.matmul(w[..., :p], prefix_v)


def eager_rows_agree(dtype: torch.dtype, p: int, rows: int) -> bool:
    """A row among ``rows`` sharing the prefix equals the same row as an AR step (its own copy)."""
    g = torch.Generator().manual_seed(p + rows)
    shapes = ((rows, KV, GROUP, HD), (KV, p, HD), (KV, p, HD))
    q, pk, pv = (torch.randn(*s, generator=g).to(dtype) for s in shapes)
    tk, tv = (torch.randn(rows, KV, KEY_BLOCK, HD, generator=g).to(dtype) for _ in range(2))
    own_k, own_v = (x.expand(rows, -1, -1, -1).contiguous() for x in (pk, pv))
    alone = torch.cat([eager_shared(q[i : i + 1], own_k[i : i + 1], own_v[i : i + 1], tk[i : i + 1],
                                    tv[i : i + 1], False) for i in range(rows)])
    return torch.equal(eager_shared(q, pk, pv, tk, tv, True), alone)


def measure(context: int, rows: int, slot_k: torch.Tensor, slot_v: torch.Tensor) -> str:
    """One line of the table: a tree of ``rows`` rows at ``context`` keys."""
    width = key_width(context + 4)
    index = torch.arange(width).repeat(rows, 1).flatten()
    q = torch.randn(rows, KV, GROUP, HD, dtype=slot_k.dtype)
    visible = (torch.arange(width)[None] < context + 2).expand(rows, width)[:, None]

    def gather() -> tuple[torch.Tensor, ...]:  # as packed._group_attention, rows first
        return tuple(c.index_select(1, index).view(KV, rows, width, HD).transpose(0, 1)
                     for c in (slot_k, slot_v))

    k, v = gather()

    def two_threads() -> torch.Tensor:
        return _split_rows(q, k, v, visible, HD**-0.5, 0)

    def one_call() -> torch.Tensor:
        return _sdpa_rows(q, k, v, visible, HD**-0.5)

    assert rows == 1 or torch.equal(two_threads(), one_call())
    p = width - KEY_BLOCK
    tk, tv = (torch.randn(rows, KV, KEY_BLOCK, HD, dtype=slot_k.dtype) for _ in range(2))
    line = (f"context {context:5d}, rows {rows}: gather {timed(gather):5.0f}, "
            f"sdpa rows {timed(one_call):5.0f}, ")
    if native_rows.available() and slot_k.dtype == torch.bfloat16:  # the page read in place, no gather
        units = q.reshape(rows * KV, GROUP, HD).contiguous()
        runs = (torch.arange(KV) * slot_k.shape[1] * HD).repeat(rows)
        where = index.view(rows, width).contiguous()
        first, seen = torch.arange(rows).repeat_interleave(KV), torch.full((rows * KV,), context + 2)
        native = timed(lambda: native_rows.unit_attention(units, slot_k, slot_v, runs, where, first, seen,
                                                          HD**-0.5))
        line += f"native in place {native:5.0f}, "
        if rows > 1:  # the tree's rows over each KV head as one run: the prefix read once
            tree_runs = native_rows.SharedRuns.by_kv_head(rows, KV, context)
            native = timed(lambda: native_rows.unit_attention(units, slot_k, slot_v, runs, where, first, seen,
                                                              HD**-0.5, tree_runs))
            line += f"native shared prefix {native:5.0f}, "
    if rows > 1:
        line += f"sdpa rows, 2 py threads {timed(two_threads):5.0f}, "
    shared = timed(lambda: eager_shared(q, slot_k[:, :p], slot_v[:, :p], tk, tv, True))
    return line + f"eager shared {shared:5.0f}"


def main() -> None:
    dt = torch.bfloat16
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16; microseconds a layer")
    slot_k, slot_v = (torch.randn(KV, 2048, HD, dtype=dt) for _ in range(2))
    for context in (128, 576, 1024):
        for rows in (1, 5, 9):
            print(measure(context, rows, slot_k, slot_v))
    scores = torch.randn(5, KV, GROUP, 640, dtype=dt)
    mask = torch.zeros(5, 1, 1, 640, dtype=torch.bool)
    small = timed(lambda: scores.masked_fill(mask, 0.0))
    print(f"one small op (masked_fill of [5, 3, 3, 640] bf16): {small:.0f} us")
    for dtype in (torch.bfloat16, torch.float32):
        agree = all(eager_rows_agree(dtype, p, r) for p in (64, 576, 1024) for r in (2, 5, 9))
        print(f"eager shared: rows among R sharing the prefix = AR steps' rows, {dtype}: {agree}")


def split_grid() -> None:
    """The engine's one SDPA call (on one OpenMP thread) against its units split in two halves
    over two Python threads, each on one OpenMP thread (bitwise the same: checked), by rows
    and key width."""
    print(f"torch {torch.__version__}, bf16; microseconds a layer (3 KV heads x rows units)")
    torch.set_num_threads(2)
    for rows in (1, 2, 3, 5, 9, 17):
        for width in (64, 128, 256, 384, 576, 1024):
            q = torch.randn(KV, rows, GROUP, HD, dtype=torch.bfloat16)
            k, v = (torch.randn(KV, rows, width, HD, dtype=torch.bfloat16) for _ in range(2))
            visible = torch.ones(1, rows, width, dtype=torch.bool)
            dim = 0 if rows == 1 else 1  # KV heads, or rows

            def split(q=q, k=k, v=v, visible=visible, dim=dim) -> torch.Tensor:
                return _split_rows(q, k, v, visible, HD**-0.5, dim)

            def one_call(q=q, k=k, v=v, visible=visible) -> torch.Tensor:
                return _sdpa_rows(q, k, v, visible, HD**-0.5)

            assert torch.equal(split(), one_call())
            one, two = timed(one_call, 200), timed(split, 200)
            print(f"rows {rows:2d}, keys {width:4d}: one call {one:5.0f}, split {two:5.0f} "
                  f"({two / one:.2f}x)")


if __name__ == "__main__":
    split_grid() if "--split-grid" in sys.argv[1:] else main()
