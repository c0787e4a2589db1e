"""The target's forward cost against the number of new tokens, on a fixed context.

    .venv/bin/python scripts/forward_cost.py [--dtype float32] [--context 200] [--threads 2]
        [--sizes 1,2,3,4,6,8,16,32] [--reps 25] [--tree-mask] [--onednn-linear]

Times the decoder plus one row of the lm_head (what a verify needs before its walk) for
``n`` new tokens after a prefilled context, the KV cache trimmed back after each forward;
prints the median over ``reps`` (the first 3 dropped) per size, in ms. ``--tree-mask``
passes a chain's tree-attention mask (``presto_sd.method.tree``) instead of none;
``--onednn-linear`` runs every ``nn.Linear`` through oneDNN (``torch.ops.mkldnn``, a
private op: an experiment, not an engine option). This is where docs/taps.md's and
docs/benchmarks.md's per-size forward times come from.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from presto_sd.method.tree import TokenTree, tree_attention_mask
from presto_sd.models.loading import load_target, parse_dtype


def _onednn_linear(model: torch.nn.Module) -> None:
    def forward(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = forward.__get__(m)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes", default="1,2,3,4,6,8,16,32")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--tree-mask", action="store_true")
    p.add_argument("--onednn-linear", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_target(None, dtype=parse_dtype(args.dtype))
    if args.onednn_linear:
        _onednn_linear(model)
    decoder = model.get_decoder()
    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    with torch.inference_mode():
        decoder(input_ids=torch.randint(0, 40000, (1, args.context), generator=gen), use_cache=True,
                past_key_values=cache)

    def forward_ms(n: int) -> float:
        times = []
        for _ in range(args.reps):
            tokens = torch.randint(0, 40000, (1, n), generator=gen)
            mask = None
            if args.tree_mask and n > 1:
                chain = TokenTree.from_lists(tokens[0].tolist(), [-1, *range(n - 1)])
                mask = tree_attention_mask(chain, args.context, dtype=model.dtype)
            positions = torch.arange(args.context, args.context + n)[None]
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = decoder(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                              past_key_values=cache)
                model.lm_head(out.last_hidden_state[:, :1])
            times.append(time.perf_counter() - t0)
            for layer in cache.layers:  # back to the prefilled context
                layer.keys = layer.keys[..., : args.context, :]
                layer.values = layer.values[..., : args.context, :]
        return 1000 * statistics.median(times[3:])

    print(f"dtype={args.dtype} context={args.context} threads={args.threads} tree_mask={args.tree_mask} "
          f"onednn_linear={args.onednn_linear}")
    print("  ".join(f"{n}:{forward_ms(n):.1f}" for n in (int(x) for x in args.sizes.split(","))), "ms")


if __name__ == "__main__":
    main()
