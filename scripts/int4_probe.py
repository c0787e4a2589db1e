"""Can the GGUF's own Q4_1 weights run the verifier's linears exactly? A probe, per shape.

    .venv/bin/python scripts/int4_probe.py [--threads 2] [--reps 50] [--layers 1]

Q4_1 stores 32 weights as 4-bit q with an fp16 scale d and minimum m: w = d * q + m. torch's
CPU int4 weight-only kernel (``_weight_int4pack_mm_for_cpu``) computes with
w = (q - 8) * scale + zero per group, so scale = d and zero = m + 8 d express Q4_1 exactly
where m + 8 d is exact in the scales' dtype. For each Q4_1 linear shape of the first
``--layers`` blocks this reports: our block decode equal to gguf's own ``dequantize``
(bitwise, fp32); the kernel's dequantized weights (an identity input) equal to today's
weights in fp32 and in bf16 (the fp32 dequant rounded to bf16, as the loader does); rows
invariant over call sizes 1..64; and the median time of 1 and 8 rows against the dense
``invariant_linear`` the verifier runs today. Nothing is asserted: it reports what this
machine's kernels do (issue 29, item 2).
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import time

import numpy as np
import torch

from presto_sd.models.invariant import invariant_linear, pick_linear_kernel
from presto_sd.models.quant import GROUP, Q4Blocks

ROWS = (1, 2, 3, 4, 5, 8, 16, 33, 64)


def median_s(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def probe(name: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, reference: torch.Tensor,
          reps: int) -> dict:
    n, k = q.shape
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    out: dict = {"tensor": name, "shape": [k, n]}
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        scales = torch.stack([d.t(), (m + 8 * d).t()], -1).contiguous().to(dtype)  # [k/32, n, 2]
        today = reference.to(dtype)  # the dequantized weight the loader hands the model
        with torch.inference_mode():
            kernel_w = torch._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=dtype), packed, GROUP, scales).t()
            x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(0)).to(dtype)

            def int4(rows: torch.Tensor, scales: torch.Tensor = scales) -> torch.Tensor:
                return torch._weight_int4pack_mm_for_cpu(rows, packed, GROUP, scales)

            full = int4(x)
            invariant = all(torch.equal(int4(x[:r]), full[:r]) for r in ROWS)
            dense = pick_linear_kernel(k, n, dtype)
            row = {"dequant_equal_today": torch.equal(kernel_w, today),
                   "dequant_max_abs_diff": float((kernel_w.float() - today.float()).abs().max()),
                   "rows_invariant": invariant, "dense_kernel": dense}
            for r in (1, 8):
                rows = x[:r]
                row[f"int4_ms_{r}"] = round(1e3 * median_s(lambda f=int4, a=rows: f(a), reps), 3)
                if dense is not None:
                    row[f"dense_ms_{r}"] = round(1e3 * median_s(
                        lambda a=rows, w=today, kern=dense: invariant_linear(a, w, kernel=kern), reps), 3)
        out[tag] = row
    return out


def main() -> None:
    import gguf

    from presto_sd.models.cache import cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="the .gguf file (default: the cached SmolLM2 Q4_1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--layers", type=int, default=1, help="blocks probed (every Q4_1 tensor in them)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = args.gguf or glob.glob(str(cache_dir("gguf") / "*" / "*.gguf"))[0]
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        if int(t.name.split(".")[1]) >= args.layers:
            continue
        k, n = (int(s) for s in t.shape)  # gguf lists [in, out]
        b = Q4Blocks.from_gguf(np.asarray(t.data), n, k)
        q, d, m = b.q, b.d, b.m
        reference = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        reference = torch.from_numpy(reference).reshape(n, k)
        ours = b.dequantize()
        row = probe(t.name, q, d, m, reference, args.reps)
        row["block_decode_equal_gguf"] = torch.equal(ours, reference)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
