"""Is a row's result independent of how many rows share the call? Per op, on SmolLM2's shapes.

    .venv/bin/python scripts/shape_invariance.py [--dtypes float32,bfloat16] [--threads 2]

Greedy speculative output equals AR token for token only as far as the verifier's
numerics let it: a row computed inside an M-row tree forward should equal the same row
computed alone (issue 15). For each op and shape this prints, for M in 1..64, which M
give row 0 bitwise equal to M = 1 (``=1``) and to M = 2 (``=2``), and for the row-chunked
linear (every call padded to ``--chunk`` rows) whether every row of every M equals the
same row computed alone; then what the chunking costs against the plain call at M = 1
and M = 8. Nothing is fitted or asserted: it reports what this machine's kernels do.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocab 49,152
LINEAR_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
ROWS = [1, 2, 3, 4, 5, 8, 16, 32, 64]


def chunked_linear(x: torch.Tensor, w: torch.Tensor, chunk: int) -> torch.Tensor:
    """``x @ w.T`` with every call exactly ``chunk`` rows (the last one zero-padded)."""
    m = x.shape[0]
    pad = (-m) % chunk
    xp = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
    return torch.cat([F.linear(xp[i : i + chunk], w) for i in range(0, m + pad, chunk)])[:m]


def classes(fn, x: torch.Tensor) -> tuple[list[int], list[int]]:
    """The M whose row 0 equals row 0 at M = 1, and at M = 2."""
    one, two = fn(x[:1])[0], fn(x[:2])[0]
    same1 = [m for m in ROWS if torch.equal(fn(x[:m])[0], one)]
    same2 = [m for m in ROWS if torch.equal(fn(x[:m])[0], two)]
    return same1, same2


def every_row_alone(fn, x: torch.Tensor) -> bool:
    alone = torch.cat([fn(x[i : i + 1]) for i in range(max(ROWS))])
    return all(torch.equal(fn(x[:m]), alone[:m]) for m in ROWS)


def seconds(fn, reps: int = 20) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def sdpa_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plain: bool) -> list[int]:
    """Query rows attending to the same keys (no mask): M whose row 0 equals M = 1's."""
    def attend(m: int) -> torch.Tensor:
        if plain:  # q.k^T, softmax in fp32, .v: the path the issue found invariant in bf16
            w = torch.softmax((q[:, :, :m] @ k.transpose(-1, -2)).float() / 8.0, dim=-1).to(q.dtype)
            return (w @ v)[0, :, 0]
        return F.scaled_dot_product_attention(q[:, :, :m], k, v)[0, :, 0]
    one = attend(1)
    return [m for m in ROWS if torch.equal(attend(m), one)]


def linear_row(k: int, n: int, dtype: torch.dtype, chunk: int) -> str:
    """One table row: ``F.linear`` from ``k`` to ``n`` features."""
    w = torch.randn(n, k, dtype=dtype) / k**0.5
    x = torch.randn(max(ROWS), k, dtype=dtype)

    def plain(a: torch.Tensor) -> torch.Tensor:
        return F.linear(a, w)

    def chunked(a: torch.Tensor) -> torch.Tensor:
        return chunked_linear(a, w, chunk)

    same1, same2 = classes(plain, x)
    t = [1e3 * seconds(lambda m=m: plain(x[:m])) for m in (1, 8)]
    tc = [1e3 * seconds(lambda m=m: chunked(x[:m])) for m in (1, 8)]
    return (f"| linear | {k} -> {n} | {same1} | {same2} | {every_row_alone(chunked, x)} "
            f"| {t[0]:.2f} / {t[1]:.2f} | {tc[0]:.2f} / {tc[1]:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=8, help="rows per call of the chunked linear")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        print(f"\n## {str(dtype).removeprefix('torch.')}\n")
        print(f"| op | in -> out | M with row 0 = M 1's | = M 2's | chunk {args.chunk}: every row = alone "
              f"| plain M 1 / 8 ms | chunked M 1 / 8 ms |")
        print("|---|---|---|---|---|---|---|")
        for k, n in LINEAR_SHAPES:
            print(linear_row(k, n, dtype, args.chunk))
        for ctx in (64, 256, 1024):
            q = torch.randn(1, 9, max(ROWS), 64, dtype=dtype)
            kv = torch.randn(1, 9, ctx, 64, dtype=dtype), torch.randn(1, 9, ctx, 64, dtype=dtype)
            print(f"| sdpa, {ctx} keys | | {sdpa_rows(q, *kv, plain=False)} | | | | |")
            print(f"| q.k, softmax fp32, .v, {ctx} keys | | {sdpa_rows(q, *kv, plain=True)} | | | | |")


if __name__ == "__main__":
    main()
