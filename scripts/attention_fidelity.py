"""Which bf16 decode-row attention kernel keeps the target's next-token law closer to fp32's.

    .venv/bin/presto-sd bench --dtype float32 --datasets gsm8k,mtbench --n 4 --methods ar --out runs/fp32-ar
    .venv/bin/python scripts/attention_fidelity.py --runs runs/fp32-ar [--kernels native,sdpa]

Teacher-forced on fp32 AR outputs (a bench run's ``runs.jsonl``): each output's first
``--prompt`` tokens are the prompt, and at every later position the engine's next-token
logits (``HFVerifier.next_token_logits``: what its AR computes there) are taken in fp32 and
in bf16 with each attention kernel. Prints, per kernel, how often bf16's argmax is fp32's and
the mean absolute difference of the log-probabilities. (Which bf16 run parts from fp32
first, token by token, is a coin toss at near ties: ``scripts/dtype_agreement.py``.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.models.loading import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", required=True, help="a `bench --dtype float32 --methods ar` output dir")
    p.add_argument("--kernels", default="native,sdpa")
    p.add_argument("--prompt", type=int, default=16, help="leading output tokens used as the prompt")
    p.add_argument("--positions", type=int, default=96, help="positions scored per output")
    args = p.parse_args()
    torch.set_num_threads(2)
    runs = [json.loads(line) for line in (Path(args.runs) / "runs.jsonl").read_text().splitlines()]
    runs = [r for r in runs if r["method"] == "ar"]
    layers = (1, 8, 14, 20, 27)  # target features are not read here; any valid ids
    fp32 = HFVerifier(load_target(None, device=torch.device("cpu"), dtype=torch.float32)[0], layers)
    bf16 = HFVerifier(load_target(None, device=torch.device("cpu"), dtype=torch.bfloat16)[0], layers)
    kernels = args.kernels.split(",")
    agree, total, diff = dict.fromkeys(kernels, 0), 0, dict.fromkeys(kernels, 0.0)
    with torch.inference_mode():
        for r in runs:
            ids = r["token_ids"]
            prompt, rest = ids[: args.prompt], ids[args.prompt : args.prompt + args.positions]
            conts = [rest[:i] for i in range(len(rest))]
            ref = fp32.next_token_logits(prompt, conts).log_softmax(-1)
            total += len(conts)
            for k in kernels:
                bf16.runner.attention_kernel = k
                got = bf16.next_token_logits(prompt, conts).log_softmax(-1)
                agree[k] += int((got.argmax(-1) == ref.argmax(-1)).sum())
                diff[k] += float((got - ref).abs().mean(-1).sum())
    print(f"{len(runs)} outputs, {total} positions; fp32 attention kernel {fp32.runner.attention_kernel!r}")
    for k in kernels:
        mean = diff[k] / total
        print(f"bf16 {k}: argmax = fp32's at {agree[k]}/{total}; mean |log p - log p_fp32| {mean:.5f}")


if __name__ == "__main__":
    main()
