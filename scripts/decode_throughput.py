"""Tokens/s of the target's batched prefill and decode steps, as gen-data runs them.

    .venv/bin/python scripts/decode_throughput.py [--batches 16,64] [--context 100] [--threads 2]

transformers forwards with a DynamicCache and every hidden state returned (the features a
data shard stores); run it on a quiet machine (pause background jobs with kill -STOP).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from presto_sd.models.loading import cache_kwarg, load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--context", type=int, default=100, help="prompt tokens per row")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_target(None, torch.device("cpu"), getattr(torch, args.dtype))
    for b in (int(x) for x in args.batches.split(",")):
        t = args.context
        ids = torch.randint(100, 1000, (b, t))
        attn = torch.ones(b, t, dtype=torch.long)
        kv = {cache_kwarg(model): DynamicCache()}
        with torch.inference_mode():
            t0 = time.perf_counter()
            model(input_ids=ids, attention_mask=attn, use_cache=True, logits_to_keep=1,
                  output_hidden_states=True, **kv)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                attn = torch.cat([attn, torch.ones(b, 1, dtype=torch.long)], 1)
                pos = torch.full((b, 1), attn.shape[1] - 1)
                model(input_ids=ids[:, :1], attention_mask=attn, position_ids=pos, use_cache=True,
                      output_hidden_states=True, **kv)
            step = (time.perf_counter() - t0) / args.steps
        print(f"batch {b}: prefill {b * t} tokens in {prefill:.2f} s = {b * t / prefill:.0f} tok/s; "
              f"decode step {step * 1e3:.0f} ms = {b / step:.0f} tok/s")


if __name__ == "__main__":
    main()
