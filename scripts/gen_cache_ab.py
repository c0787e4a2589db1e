"""A/B of the generation batch's KV cache on the real target: answer one committed magpie shard
with the reserved cache (``gen_data.ReservedCache``) and with transformers' ``DynamicCache``,
timing each and checking that both give the shard's committed tokens.

    .venv/bin/python scripts/gen_cache_ab.py --shard 3     # pause background jobs first
"""

from __future__ import annotations

import argparse
import time

import torch

import presto_sd.app.training.gen_data as gen_data
from presto_sd.app.training.token_corpus import Corpus
from presto_sd.models.loading import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="corpus/smollm2-135m-magpie")
    ap.add_argument("--shard", type=int, default=3)
    ap.add_argument("--caches", default="reserved,dynamic", help="in this order")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="the corpus's own setting")
    args = ap.parse_args()

    model, tok = load_target(None, torch.device("cpu"), torch.bfloat16)
    shard = Corpus(args.corpus).read(args.shard)
    prompts = [list(p) for p in shard.prompts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = set(filter(None, [tok.eos_token_id])) | {2}  # as grow_corpus stops
    warm = gen_data.GenDataConfig(out="", max_new_tokens=4)
    gen_data._generate_batch(model, prompts[:4], warm, pad, eos, capture_features=False)
    cfg = gen_data.GenDataConfig(out="", max_new_tokens=args.max_new_tokens)
    for name in args.caches.split(","):
        t0 = time.perf_counter()
        responses = gen_data._generate_batch(model, prompts, cfg, pad, eos, capture_features=False,
                                             kv_cache=name)[0]
        seconds = time.perf_counter() - t0
        n = sum(map(len, responses))
        same = [tuple(r) for r in responses] == [tuple(r) for r in shard.responses]
        print(f"{name}: {n} tokens in {seconds:.1f} s, {n / seconds:.0f} tokens/s; "
              f"the committed shard's tokens: {same}", flush=True)


if __name__ == "__main__":
    main()
