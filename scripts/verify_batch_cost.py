"""The verifier engine's batched step against transformers' own batched decode step.

    .venv/bin/python scripts/verify_batch_cost.py [--sessions 1,4,16,64] [--context 200]
        [--nodes 1] [--reps 7] [--threads 2] [--dtype float32]

For S sessions at ``--context`` tokens each, times one ``HFVerifier.verify_batch`` of S
trees of ``--nodes`` nodes (1: a plain AR step for every session; a chain otherwise), the
sessions trimmed back after each call so every rep sees the same context; and, as the
peer, one decoder forward of S rows x 1 token over a batched ``DynamicCache`` (what
transformers' batched ``generate`` runs per token). Median ms over ``--reps`` after a
warm-up, and the tokens/s an AR step of that many sessions implies.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.engine.verifier import VerifyCall
from presto_sd.method.tree import TokenTree
from presto_sd.models.loading import cache_kwarg, load_target, parse_dtype


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def engine_ms(verifier: HFVerifier, sessions: int, context: int, nodes: int, reps: int) -> float:
    g = torch.Generator().manual_seed(0)
    ids = [f"s{i}" for i in range(sessions)]
    for sid in ids:
        prompt = torch.randint(0, verifier.vocab_size, (context,), generator=g).tolist()
        verifier.prefill(sid, prompt)

    def step() -> None:
        calls = []
        for sid in ids:
            s = verifier.sessions[sid]
            tokens = [s.tokens[-1], *[1] * (nodes - 1)]
            calls.append(VerifyCall(sid, s.base, TokenTree.from_lists(tokens, list(range(-1, nodes - 1)))))
        for r in verifier.verify_batch(calls):
            assert not isinstance(r, Exception), r
        for sid in ids:  # back to the same context
            s = verifier.sessions[sid]
            del s.tokens[context + 1 :]
            s.kv.truncate(context) if hasattr(s, "kv") else _truncate_dynamic(s.cache, context)

    ms = _median_ms(step, reps)
    for sid in ids:
        verifier.close(sid)
    return ms


def _truncate_dynamic(cache: DynamicCache, n: int) -> None:  # the DynamicCache engine before in-place KV
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]


@torch.inference_mode()
def transformers_ms(model, sessions: int, context: int, reps: int) -> float:
    decoder = model.get_decoder()
    kwarg = cache_kwarg(decoder)
    cache = DynamicCache()
    prompt = torch.randint(0, model.config.vocab_size, (sessions, context))
    decoder(input_ids=prompt, use_cache=True, **{kwarg: cache})
    token = torch.ones(sessions, 1, dtype=torch.long)

    def step() -> None:
        out = decoder(input_ids=token, use_cache=True, **{kwarg: cache})
        model.lm_head(out.last_hidden_state[:, -1])
        _truncate_dynamic(cache, context)

    return _median_ms(step, reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", default="1,4,16,64")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--target", default=None, help="default: smollm2")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_target(args.target, dtype=parse_dtype(args.dtype))
    verifier = HFVerifier(model, (1, 15, 28))
    print(f"context {args.context}, {args.nodes} node(s) per session, {args.dtype}, {args.threads} threads")
    print("| sessions | engine verify_batch ms | tok/s | transformers batched step ms | tok/s |")
    print("|---:|---:|---:|---:|---:|")
    for s in [int(x) for x in args.sessions.split(",")]:
        ours = engine_ms(verifier, s, args.context, args.nodes, args.reps)
        peer = transformers_ms(model, s, args.context, args.reps)
        print(f"| {s} | {ours:.1f} | {1e3 * s / ours:.0f} | {peer:.1f} | {1e3 * s / peer:.0f} |", flush=True)


if __name__ == "__main__":
    main()
