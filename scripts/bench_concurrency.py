"""Serving under load: concurrent streams through `presto-sd up`, against transformers' batched generate.

    .venv/bin/python scripts/bench_concurrency.py --levels 1,4,16,64 --methods ar,taps \\
        [--modes up,embedded] [--max-new-tokens 64] [--budget 16] [--threads 2] \\
        [--peer-dtypes float32] [--out runs/serving]

For each level C, C GSM8K prompts (chat template, greedy) are sent at once, every method
in turn, through each mode:
- ``up``: a real `presto-sd up` (verifier and drafter servers + the orchestrator on Ray,
  as an operator runs it), driven through the gRPC client (``orchestrator.client``);
- ``embedded``: the orchestrator in this process over in-process engines in Ray actors;
- ``engine``: the step engine in this process over both engines in this process too (the
  orchestrator's step loop on direct replicas): no Ray, no gRPC, no actor hop.
The peer is transformers' own ``generate`` on the same target, the same C prompts
left-padded into one batch, greedy, in each ``--peer-dtypes``. Per row: useful tokens/s
(new tokens up to each stream's end / wall), time to first token p50/p99, per-token
latency p50/p99 (a chunk's gap spread over its tokens), tau, the work behind them (rounds
that verified a tree, its nodes, the tokens accepted; in ``up``, each process's CPU
seconds: steadier than a speed on a shared machine), and whether every output
equals the AR output (the first method's output in ``ar``, or the peer's in fp32). Writes
``serving.json`` and ``serving.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default="1,4,16,64", help="concurrent streams, comma-separated")
    p.add_argument("--methods", default="ar,taps", help="comma-separated methods")
    p.add_argument("--modes", default="up", help="up,embedded,engine")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16, help="tree budget (taps: the most it may choose)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per engine (and the peer)")
    p.add_argument("--peer-dtypes", default="float32", help="comma-separated; '' skips the peer")
    p.add_argument("--up-args", default="", help="more flags for `presto-sd up`, e.g. "
                   "'--max-batch-prefill-tokens 2048' (one string)")
    p.add_argument("--out", default="runs/serving")
    return p.parse_args()


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def drive(generate, prompts: list, level: int) -> dict:
    """All ``prompts`` at once; per stream its tokens, first-token time and per-token gaps."""
    def one(prompt):
        t0 = time.perf_counter()
        last, tokens, gaps, ttft, rounds = t0, [], [], None, []
        for chunk in generate(prompt):
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            elif chunk.tokens:
                gaps += [(now - last) / len(chunk.tokens)] * len(chunk.tokens)
            if chunk.stats is not None:
                rounds.append(chunk.stats)
            tokens += chunk.tokens
            last = now
        return tokens, ttft, gaps, rounds

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=level) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    tokens = sum(len(t) for t, *_ in results)
    ttfts = [r[1] for r in results]
    gaps = [g for r in results for g in r[2]]
    rounds = [x for r in results for x in r[3]]
    drafted = [x for x in rounds if not (x.gated or x.fallback) and x.tree_size > 0]
    return {"streams": level, "wall_s": round(wall, 2), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_s": round(percentile(ttfts, 50), 3), "ttft_p99_s": round(percentile(ttfts, 99), 3),
            "token_p50_ms": round(1e3 * percentile(gaps, 50), 1),
            "token_p99_ms": round(1e3 * percentile(gaps, 99), 1),
            "tau": round(sum(x.accepted + 1 for x in rounds) / len(rounds), 3) if rounds else None,
            # the work behind the speed, steadier than it on a noisy machine: rounds that
            # verified a tree, the nodes verified, the draft tokens they got accepted
            "rounds": len(rounds), "tree_rounds": len(drafted),
            "tree_nodes": sum(x.tree_size for x in drafted), "accepted": sum(x.accepted for x in drafted),
            "outputs": [t for t, *_ in results]}


def process_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` and its descendants, by role (Linux ``/proc``; {}
    elsewhere): where a shared machine's cores went."""
    hz, out, todo = os.sysconf("SC_CLK_TCK"), {}, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().split("\0")
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
        role = next((f"serve {k}" for k in ("verifier", "drafter") if k in cmd[3:5]),
                    "up" if "up" in cmd[3:4] else "ray")
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / hz
    return out


class UpStack:
    """`presto-sd up` as a subprocess, and a client of its orchestrator."""

    def __init__(self, args: argparse.Namespace) -> None:
        from orchestrator.client import OrchestratorClient

        cmd = [sys.executable, "-m", "presto_sd.app.cli", "up", "--port", "0", "--threads", str(args.threads),
               "--max-new-tokens", str(args.max_new_tokens), "--budget", str(args.budget),
               *shlex.split(args.up_args)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        for line in self.proc.stdout:
            if line.startswith('{"event": "up"'):
                self.client = OrchestratorClient(json.loads(line)["orchestrator"])
                return
        raise SystemExit(f"presto-sd up exited ({self.proc.wait()}) before it was up")

    def cpu_s(self) -> dict[str, float]:
        return process_cpu_s(self.proc.pid)

    def generate(self, method: str, args: argparse.Namespace):
        return lambda prompt: self.client.generate(list(prompt), method=method, chat=False,
                                                   max_new_tokens=args.max_new_tokens)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(120)


class EmbeddedStack:
    """The orchestrator in this process over in-process engines in Ray actors."""

    def __init__(self, args: argparse.Namespace) -> None:
        import ray

        from orchestrator.actors import local_spec
        from orchestrator.orchestrator import Orchestrator
        from presto_sd.engine.calls import Info

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        self.orch = Orchestrator.start([local_spec("drafter", 0, None, None, args.threads)],
                                       [local_spec("verifier", 0, None, None, args.threads)])
        self.eos = self.orch.verifiers.replicas[0].call(Info()).value.eos_token_ids
        self.dinfo = self.orch.drafters.replicas[0].call(Info()).value

    def cpu_s(self) -> dict[str, float]:
        return {}  # the actors are Ray's workers, not this process's children

    def generate(self, method: str, args: argparse.Namespace):
        from orchestrator.requests import GenerateJob
        from presto_sd.app.flags import add_generation_args
        from presto_sd.app.stack import generation_params

        parser = argparse.ArgumentParser()
        add_generation_args(parser)  # the request defaults exactly as `serve orchestrator` makes them
        flags = parser.parse_args(["--method", method, "--budget", str(args.budget),
                                   "--max-new-tokens", str(args.max_new_tokens)])
        params = generation_params(flags, self.eos, self.dinfo)
        return lambda prompt: self.orch.stream(GenerateJob(tuple(prompt), params))

    def close(self) -> None:
        import ray

        self.orch.shutdown()
        ray.shutdown()


class EngineStack(EmbeddedStack):
    """The step engine in this process over both engines in this process: no Ray."""

    def __init__(self, args: argparse.Namespace) -> None:
        import dataclasses

        import torch

        from orchestrator.actors import local_spec
        from orchestrator.metrics import Metrics
        from orchestrator.orchestrator import Orchestrator
        from presto_sd.engine.calls import Info

        torch.set_num_threads(args.threads)  # one process: both engines share its pool
        specs = [dataclasses.replace(local_spec(kind, 0, None, None), direct=True)
                 for kind in ("drafter", "verifier")]
        self.orch = Orchestrator.start(specs[:1], specs[1:], metrics=Metrics(export=False))
        self.eos = self.orch.verifiers.replicas[0].call(Info()).value.eos_token_ids
        self.dinfo = self.orch.drafters.replicas[0].call(Info()).value

    def close(self) -> None:
        self.orch.shutdown()


STACKS = {"up": UpStack, "embedded": EmbeddedStack, "engine": EngineStack}


def peer_rows(prompts: list, levels: list[int], dtypes: list[str], args: argparse.Namespace) -> list[dict]:
    """transformers' batched generate: C prompts left-padded into one batch, greedy."""
    import torch

    from presto_sd.models.loading import eos_token_ids, load_target, parse_dtype

    torch.set_num_threads(args.threads)
    rows = []
    for dtype in dtypes:
        model, tok = load_target(None, dtype=parse_dtype(dtype))
        eos = set(eos_token_ids(model, tok))  # the stop ids the engines use
        model.generation_config.eos_token_id = sorted(eos)
        pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos))
        for level in levels:
            batch = prompts[:level]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                model.generate(ids[:1, -8:], max_new_tokens=2, do_sample=False)  # warm-up
                t0 = time.perf_counter()
                out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                     do_sample=False, pad_token_id=pad)
                wall = time.perf_counter() - t0
            outputs = []
            for row in out[:, width:].tolist():
                cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                outputs.append(row[:cut])
            tokens = sum(len(o) for o in outputs)
            rows.append({"mode": f"transformers generate ({dtype})", "method": "ar", "streams": level,
                         "wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
                         "outputs": outputs})
        del model
    return rows


def prefill_floor(prompts: list, levels: list[int], args: argparse.Namespace) -> dict[int, float]:
    """The TTFT floor of C prompts that arrive at once: the seconds to prefill all of them
    with nothing else running, in steps of at most 512 prompt tokens (the scheduler's
    ``max_prefill_tokens``) — the last one's first token cannot come sooner on this CPU."""
    import torch

    from presto_sd.embedded.stack import load_verifier
    from presto_sd.engine.verifier import PrefillCall

    torch.set_num_threads(args.threads)
    verifier = load_verifier(None, None)
    out = {}
    for level in levels:
        groups, group = [], []
        for i, p in enumerate(prompts[:level]):
            if group and sum(len(q) for _, q in group) + len(p) > 512:
                groups.append(group)
                group = []
            group.append((i, p))
        groups.append(group)
        t0 = time.perf_counter()
        for g in groups:
            verifier.verify_batch([PrefillCall(f"floor-{i}", tuple(p)) for i, p in g])
        out[level] = round(time.perf_counter() - t0, 2)
        for i in range(level):
            verifier.close(f"floor-{i}")
    return out


def main() -> None:
    from tqdm import tqdm

    from presto_sd.app.datasets import load_prompts
    from presto_sd.models.loading import encode_messages, load_tokenizer

    args = parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    methods = args.methods.split(",")
    tok = load_tokenizer(None)
    prompts = [tuple(encode_messages(tok, p.messages)) for p in load_prompts("gsm8k", n=max(levels))]
    rows: list[dict] = []
    modes = [m for m in args.modes.split(",") if m]
    bar = tqdm(total=len(modes) * len(methods) * len(levels), desc="levels", unit="level")
    for mode in modes:
        stack = STACKS[mode](args)
        try:
            for method in methods:
                gen = stack.generate(method, args)
                list(gen(prompts[0]))  # warm-up
                for level in levels:
                    before = stack.cpu_s()
                    row = {"mode": mode, "method": method, **drive(gen, prompts[:level], level)}
                    after = stack.cpu_s()
                    row["cpu_s"] = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()
                                    if v - before.get(k, 0.0) >= 0.05}
                    rows.append(row)
                    bar.update(1)
        finally:
            stack.close()
    bar.close()
    peer_dtypes = [d for d in args.peer_dtypes.split(",") if d]
    if peer_dtypes:
        rows += peer_rows(prompts, levels, peer_dtypes, args)
    floor = prefill_floor(prompts, levels, args)
    tokens = {level: sum(len(p) for p in prompts[:level]) for level in levels}
    report(rows, args, {"ttft_floor_s": floor, "prompt_tokens": tokens})
    print("TTFT floor, every prompt prefilled back to back with nothing else running: " + ", ".join(
        f"{level} streams {floor[level]} s ({tokens[level]} prompt tokens)" for level in levels))


def report(rows: list[dict], args: argparse.Namespace, extra: dict | None = None) -> None:
    ar = {r["streams"]: r["outputs"] for r in rows if r["method"] == "ar" and r["mode"] in STACKS}
    for r in rows:
        ref = ar.get(r["streams"])
        r["equal_to_ar"] = None if ref is None else r.pop("outputs") == ref
        r.pop("outputs", None)
    print(f"\nGSM8K prompts, {args.max_new_tokens} new tokens, greedy, budget {args.budget}, "
          f"{args.threads} threads per engine")
    print("| mode | method | streams | tokens/s | TTFT p50 / p99 s | per-token p50 / p99 ms | tau "
          "| tree rounds / rounds | nodes / accepted | CPU s | = AR |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        cpu = ", ".join(f"{k} {v}" for k, v in r.get("cpu_s", {}).items()) or "-"
        print(f"| {r['mode']} | {r['method']} | {r['streams']} | {r['tokens_per_s']} "
              f"| {r.get('ttft_p50_s', '-')} / {r.get('ttft_p99_s', '-')} "
              f"| {r.get('token_p50_ms', '-')} / {r.get('token_p99_ms', '-')} | {r.get('tau') or '-'} "
              f"| {r.get('tree_rounds', '-')} / {r.get('rounds', '-')} "
              f"| {r.get('tree_nodes', '-')} / {r.get('accepted', '-')} "
              f"| {cpu} | {r['equal_to_ar']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "rows": rows, **(extra or {})}
    (out / "serving.json").write_text(json.dumps(result, indent=2))
    plot(rows, out / "serving.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key in dict.fromkeys((r["mode"], r["method"]) for r in rows):
        pts = sorted((r["streams"], r["tokens_per_s"]) for r in rows if (r["mode"], r["method"]) == key)
        label = key[0] if key[0].startswith("transformers") else f"{key[0]} {key[1]}"
        ax.plot(*zip(*pts), marker="o", label=label, linestyle="--" if key[0].startswith("trans") else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens/s (all streams)")
    ax.set_title("Serving under load (greedy, SmolLM2-135M, CPU)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
