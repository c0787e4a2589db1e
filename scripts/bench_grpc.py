"""Per-round overhead of the gRPC split against embedded mode, on loopback.

    .venv/bin/python scripts/bench_grpc.py [--method ar presto-beam] [--max-new-tokens 48]
        [--reps 3] [--threads 1] [--drafter random]

Starts ``presto-sd serve verifier`` and ``presto-sd serve drafter`` as two processes on
127.0.0.1, builds the same engines in this process, then runs each greedy request both
ways back to back (the order alternating per repetition, after one warm-up repetition).
Reports tokens/s, the per-round time and its paired difference (median over requests),
the protobuf bytes per round on the wire (requests + responses; HTTP/2 framing not
counted), the loopback round trip of a tiny call, and the transport's share per round:
client-side call time minus the handler time the servers log (prefill and close
amortised in). Outputs are checked equal.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import threading
import time

import torch

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
]


def spawn(kind: str, args: argparse.Namespace, prefix: tuple[str, ...] = (), host: str = "127.0.0.1",
          port: int = 0) -> tuple[subprocess.Popen, int, queue.Queue]:
    """``presto-sd serve KIND`` (under ``prefix``, e.g. ``ip netns exec NS``); once it serves:
    the process, its port and its log lines."""
    cmd = [*prefix, sys.executable, "-m", "presto_sd.app.cli", "serve", kind, "--host", host,
           "--port", str(port), "--drafter", args.drafter, "--threads", str(args.threads), "--drain-s", "0"]
    if getattr(args, "target", None):
        cmd += ["--target", args.target]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    port, end = None, time.monotonic() + 300
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        event = json.loads(line) if line.startswith("{") else {}
        port = event.get("port", port)
        if event.get("event") == "serving":
            return proc, port, lines
    proc.kill()
    raise TimeoutError(f"{kind} server did not come up")


def run(verifier, drafter, prompt_ids, params) -> dict:
    """One request; wall time, rounds and (remote engines only) bytes per round."""
    from presto_sd.loop.generate import stream_generate

    def wire_bytes() -> int:
        return sum(e.rpc.stats.bytes_sent + e.rpc.stats.bytes_received
                   for e in (verifier, drafter) if e is not None and hasattr(e, "rpc"))

    t0, tokens, rounds, after_prefill, last = time.perf_counter(), [], 0, 0, 0
    for chunk in stream_generate(verifier, drafter, prompt_ids, params):
        tokens.extend(chunk.tokens)
        if chunk.round is None:
            after_prefill = wire_bytes()
        else:
            rounds += 1
        last = wire_bytes()
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall": wall, "rounds": rounds,
            "bytes_per_round": (last - after_prefill) / max(1, rounds)}


def server_ms(lines: queue.Queue) -> float:
    """Handler time the server logged for the calls since the last look (its JSON lines)."""
    total = 0.0
    while not lines.empty():
        line = lines.get()
        if line.startswith("{"):
            total += json.loads(line).get("ms", 0.0) if '"call"' in line else 0.0
    return total


def time_calls(remote) -> None:
    """Add the client-side wall time of every call to ``remote.rpc.wall``."""
    rpc, inner = remote.rpc, remote.rpc.call
    rpc.wall = 0.0

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            rpc.wall += time.perf_counter() - t0

    rpc.call = call


def rpc_latency_ms(remote, n: int = 200) -> float:
    """Median round trip of a tiny call (Info, uncached): the transport's own cost."""
    from presto_pb.v1 import common_pb2

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        remote.rpc.call(remote.stub.Info, common_pb2.InfoRequest(), 10.0)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", nargs="+", default=["ar", "presto-beam"])
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--drafter", default="random")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from drafter_service.remote import RemoteDrafter
    from presto_sd.app.generate import encode_prompt
    from presto_sd.embedded.stack import build_embedded
    from presto_sd.loop.generate import GenerationParams
    from presto_sd.method.builders import TreeParams
    from presto_sd.method.methods import get_method
    from verifier_service.remote import RemoteVerifier

    servers = {kind: spawn(kind, args) for kind in ("verifier", "drafter")}
    try:
        stack = build_embedded(drafter=args.drafter, device=torch.device("cpu"))
        remote_v = RemoteVerifier(f"127.0.0.1:{servers['verifier'][1]}")
        remote_d = RemoteDrafter(f"127.0.0.1:{servers['drafter'][1]}")
        prompts = [encode_prompt(stack.tokenizer, text, chat=True) for text in PROMPTS]
        print(json.dumps({"rpc_latency_ms": round(rpc_latency_ms(remote_v), 3)}), flush=True)
        for remote in (remote_v, remote_d):
            time_calls(remote)
        modes = {"embedded": (stack.verifier, stack.drafter), "grpc": (remote_v, remote_d)}
        rows = []
        for method in args.method:
            m = get_method(method)
            params = GenerationParams(method, TreeParams(args.budget), args.max_new_tokens)
            pairs = []  # (embedded run, gRPC run) of the same request, back to back
            for _, _, lines in servers.values():
                server_ms(lines)
            remote_v.rpc.wall = remote_d.rpc.wall = 0.0
            grpc_rounds = 0
            for rep in range(args.reps + 1):  # rep 0 warms up
                for ids in prompts:
                    order = list(modes) if rep % 2 else list(modes)[::-1]
                    out = {mode: run(modes[mode][0], modes[mode][1] if m.needs_drafter else None, ids, params)
                           for mode in order}
                    assert out["grpc"]["tokens"] == out["embedded"]["tokens"]  # lossless both ways
                    grpc_rounds += out["grpc"]["rounds"]
                    if rep:
                        pairs.append((out["embedded"], out["grpc"]))

            time.sleep(0.5)  # the servers' last log lines
            handler_s = sum(server_ms(lines) for _, _, lines in servers.values()) / 1e3
            transport_s = remote_v.rpc.wall + remote_d.rpc.wall - handler_s

            def per_round(r: dict) -> float:
                return r["wall"] / r["rounds"]

            emb_tok_s = sum(len(e["tokens"]) for e, _ in pairs) / sum(e["wall"] for e, _ in pairs)
            rpc_tok_s = sum(len(g["tokens"]) for _, g in pairs) / sum(g["wall"] for _, g in pairs)
            row = {
                "method": method, "budget": args.budget if m.needs_drafter else None,
                "requests": len(pairs), "embedded_tok_s": emb_tok_s, "grpc_tok_s": rpc_tok_s,
                "ratio": rpc_tok_s / emb_tok_s,
                "paired_ratio_median": statistics.median(per_round(e) / per_round(g) for e, g in pairs),
                "embedded_ms_per_round": 1e3 * statistics.median(per_round(e) for e, _ in pairs),
                "grpc_ms_per_round": 1e3 * statistics.median(per_round(g) for _, g in pairs),
                "overhead_ms_per_round": 1e3 * statistics.median(
                    per_round(g) - per_round(e) for e, g in pairs),
                "bytes_per_round": statistics.median(g["bytes_per_round"] for _, g in pairs),
                "transport_ms_per_round": 1e3 * transport_s / grpc_rounds,
            }
            rows.append(row)
            rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            print(json.dumps(rounded), flush=True)
        print("\n| method | tok/s embedded | tok/s gRPC | ratio (paired median) | ms/round embedded "
              "| ms/round gRPC | overhead ms/round (paired median) | transport ms/round | bytes/round |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['method']} | {r['embedded_tok_s']:.2f} | {r['grpc_tok_s']:.2f} "
                  f"| {r['ratio']:.3f} ({r['paired_ratio_median']:.3f}) | {r['embedded_ms_per_round']:.1f} "
                  f"| {r['grpc_ms_per_round']:.1f} | {r['overhead_ms_per_round']:.1f} "
                  f"| {r['transport_ms_per_round']:.2f} | {r['bytes_per_round']:.0f} |")
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
