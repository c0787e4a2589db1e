"""How long bf16 greedy output agrees with fp32's, on the bench prompts.

    .venv/bin/python scripts/dtype_agreement.py [--datasets gsm8k,humaneval,mtbench] [--n 8]
        [--max-new-tokens 128] [--threads 2]

bf16 speculative output is held to the engine's own bf16 AR, bitwise (tests/test_invariance.py);
it is not fp32's output, since bf16 rounds the target's arithmetic differently. This runs
the engine's plain AR in both dtypes on the same prompts (the bench's, chat-templated) and
prints, per prompt, the index of the first output token where they part (``-`` where
they agree to the end, which ends at the first EOS of either), then the median over the
prompts that part and how many agree throughout.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from tqdm import tqdm

from presto_sd.app.datasets import load_prompts
from presto_sd.embedded.stack import build_embedded
from presto_sd.loop.generate import GenerationParams, generate
from presto_sd.models.loading import encode_messages


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where they differ (one ending first counts), None if equal."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return at if at is not None or len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", default="gsm8k,humaneval,mtbench")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    stacks = {dt: build_embedded(dtype=dt, device=cpu) for dt in (torch.float32, torch.bfloat16)}
    tok = stacks[torch.float32].tokenizer
    prompts = [q for ds in args.datasets.split(",") for q in load_prompts(ds, "heldout", args.n)]
    parts: list[int | None] = []
    for q in tqdm(prompts, desc="prompts"):
        ids = encode_messages(tok, q.messages, True)
        out = {}
        for dt, stack in stacks.items():
            params = GenerationParams(method="ar", max_new_tokens=args.max_new_tokens,
                                      stop_token_ids=stack.verifier.eos_token_ids)
            out[dt] = generate(stack.verifier, stack.drafter, ids, params).token_ids
        at = first_difference(out[torch.float32], out[torch.bfloat16])
        parts.append(at)
        tqdm.write(f"{q.dataset:10s} {q.id:24s} first difference at token {'-' if at is None else at}")
    parted = [x for x in parts if x is not None]
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens: {len(prompts) - len(parted)} agree "
          f"throughout; the others part at token {sorted(parted)} (median "
          f"{statistics.median(parted) if parted else '-'})")


if __name__ == "__main__":
    main()
