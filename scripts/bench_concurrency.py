"""Aggregate throughput of the orchestrator with 1, 4, 16 concurrent requests.

    .venv/bin/python scripts/bench_concurrency.py --modes embedded,distributed \\
        --concurrency 1,4,16 --n 16 --max-new-tokens 64 [--method presto-beam --budget 16] \\
        [--threads 1] [--plain] [--out runs/concurrency.json]

The same N GSM8K prompts (chat template, greedy) run through the orchestrator with at most
C requests in flight, for each C: C = 1 is "one after another". Modes: ``embedded`` —
in-process engines inside Ray actors (one drafter, one verifier); ``distributed`` — the
engines as ``presto-sd serve`` processes on loopback, driven through actors holding the
gRPC clients; ``--plain`` adds the embedded loop with no Ray at all, one request after
another, as a reference. Reports aggregate tokens/s (all new tokens / wall time), the
speedup over C = 1, mean tau, mean trees per verify call, and each engine's idle share
(1 - its busy seconds / wall; busy = time inside its calls as the actor measures them, so
in distributed mode it includes the gRPC hop). Outputs are checked equal across C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args() -> argparse.Namespace:
    from presto_sd.app.flags import add_generation_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="embedded,distributed", help="embedded,distributed")
    p.add_argument("--concurrency", default="1,4,16", help="requests in flight, comma-separated")
    p.add_argument("--n", type=int, default=16, help="GSM8K prompts (the first N)")
    p.add_argument("--plain", action="store_true", help="also the embedded loop without Ray, sequential")
    p.add_argument("--plain-threads", type=int, default=1, help="torch threads of --plain (default: 1)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    add_generation_args(p)
    args = p.parse_args()
    args.threads = args.threads or 1
    return args


def prompts(args: argparse.Namespace, tok) -> list[tuple[int, ...]]:
    from presto_sd.app.datasets import load_prompts
    from presto_sd.models.loading import encode_messages

    return [tuple(encode_messages(tok, p.messages)) for p in load_prompts("gsm8k", n=args.n)]


def run_level(orch, jobs, level: int, bar) -> dict:
    """Every job with at most ``level`` in flight: wall, tokens, per-job outputs, engine busy."""
    before_stats, before = orch.engine_stats(), dict(orch.metrics.tallies)

    def one(job) -> tuple[list[int], list]:
        tokens, rounds = [], []
        for chunk in orch.stream(job):
            tokens.extend(chunk.tokens)
            if chunk.stats is not None:
                rounds.append(chunk.stats)
        bar.update(1)
        return tokens, rounds

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=level) as pool:
        results = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    after = orch.engine_stats()
    tallies = orch.metrics.tallies
    rounds = [r for _, rs in results for r in rs]
    batches = tallies["verify_batches"] - before.get("verify_batches", 0)
    return {
        "concurrency": level, "wall_s": round(wall, 2),
        "tokens": sum(len(t) for t, _ in results),
        "tokens_per_s": round(sum(len(t) for t, _ in results) / wall, 2),
        "tau": round(sum(r.accepted + 1 for r in rounds) / max(1, len(rounds)), 3),
        "trees_per_verify_call": round(
            (tallies["verify_batched_calls"] - before.get("verify_batched_calls", 0)) / max(1, batches), 2),
        "idle_share": {name: round(1 - (after[name].busy_s - before_stats[name].busy_s) / wall, 3)
                       for name in after},
        "outputs": [t for t, _ in results],
    }


def start_mode(mode: str, args: argparse.Namespace, children: list):
    """The orchestrator of ``mode``; server processes it starts go into ``children``."""
    from orchestrator.actors import local_spec, remote_spec
    from orchestrator.orchestrator import Orchestrator
    from presto_sd.app.up import _Child

    if mode == "embedded":
        return Orchestrator.start([local_spec("drafter", 0, args.target, args.drafter, args.threads)],
                                  [local_spec("verifier", 0, args.target, args.drafter, args.threads)])
    server_args = argparse.Namespace(drain_s=0.0, grace_s=1.0, target=args.target, drafter=args.drafter,
                                     threads=args.threads)
    addrs = {}
    for kind in ("verifier", "drafter"):
        child = _Child(kind, server_args, echo=False)
        children.append(child)
        addrs[kind] = f"127.0.0.1:{child.wait_for('listening', 600)['port']}"
        child.wait_for("serving", 600)
    return Orchestrator.start([remote_spec("drafter", addrs["drafter"])],
                              [remote_spec("verifier", addrs["verifier"])])


def plain_rows(args: argparse.Namespace, encoded) -> dict:
    import torch

    from presto_sd.app.stack import generation_params
    from presto_sd.embedded.stack import build_embedded
    from presto_sd.loop.generate import generate
    from presto_sd.method.methods import get_method

    torch.set_num_threads(args.plain_threads)
    stack = build_embedded(args.target, args.drafter)
    params = generation_params(args, stack.verifier.eos_token_ids, stack.drafter.info())
    drafter = stack.drafter if get_method(args.method).needs_drafter else None
    generate(stack.verifier, drafter, list(encoded[0]), params)  # warm-up
    t0 = time.perf_counter()
    outs = [generate(stack.verifier, drafter, list(p), params) for p in encoded]
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"mode": f"plain ({args.plain_threads} threads, no Ray)", "concurrency": 1,
            "wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
            "outputs": [o.token_ids for o in outs]}


def main() -> None:
    import ray
    from tqdm import tqdm

    from orchestrator.requests import GenerateJob
    from presto_sd.app.stack import generation_params
    from presto_sd.models.loading import load_tokenizer

    args = parse_args()
    modes = [m for m in args.modes.split(",") if m]
    levels = [int(c) for c in args.concurrency.split(",")]
    tok = load_tokenizer(args.target)
    encoded = prompts(args, tok)
    rows = []
    if args.plain:
        rows.append(plain_rows(args, encoded))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    bar = tqdm(total=len(modes) * len(levels) * len(encoded), desc="requests", unit="req")
    for mode in modes:
        children: list = []
        orch = start_mode(mode, args, children)
        try:  # the request defaults as `serve orchestrator` makes them (the verifier's EOS)
            eos = orch.verifiers.replicas[0].call("info").value.eos_token_ids
            params = generation_params(args, eos, orch.drafters.replicas[0].call("info").value)
            list(orch.stream(GenerateJob(encoded[0], params)))  # warm-up
            for level in levels:
                jobs = [GenerateJob(p, params) for p in encoded]
                rows.append({"mode": mode, **run_level(orch, jobs, level, bar)})
        finally:
            orch.shutdown()
            for child in children:
                child.stop(60)
    bar.close()
    ray.shutdown()
    reference = rows[0]["outputs"]
    for row in rows:
        row["equal_outputs"] = row.pop("outputs") == reference
    report(rows, args)


def report(rows: list[dict], args: argparse.Namespace) -> None:
    base = {r["mode"]: r["tokens_per_s"] for r in rows if r["concurrency"] == 1}
    print(f"\nmethod {args.method}, budget {args.budget}, {args.n} GSM8K prompts x {args.max_new_tokens} "
          f"new tokens, greedy, engine threads {args.threads}")
    print("| mode | concurrent | wall s | tokens | tokens/s | vs 1 | tau | trees/verify call | idle share "
          "| outputs = first row |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        idle = ", ".join(f"{k.split('/')[0]} {v:.0%}" for k, v in r.get("idle_share", {}).items()) or "-"
        print(f"| {r['mode']} | {r['concurrency']} | {r['wall_s']} | {r['tokens']} | {r['tokens_per_s']} "
              f"| {r['tokens_per_s'] / base[r['mode']]:.2f}x | {r.get('tau', '-')} "
              f"| {r.get('trees_per_verify_call', '-')} | {idle} | {r['equal_outputs']} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
