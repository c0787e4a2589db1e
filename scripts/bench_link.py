"""The split deployment against the round trip between the services: tokens/s and taps' budgets vs RTT.

    .venv/bin/python scripts/bench_link.py [--rtt-ms 0,0.5,2,5,10] [--max-new-tokens 48]
        [--methods ar,presto-best-first@4,presto-best-first@16,taps] [--threads 1] [--out runs/link]
        [--netns] [--target DIR --drafter DIR]

Starts ``presto-sd serve verifier`` and ``presto-sd serve drafter`` (the shipped drafter)
and drives both through their gRPC clients from a loop in this process. For each RTT and
method (``method@budget`` for a fixed budget) the same chat prompts run one after another,
greedy; per row: tokens/s, tau, the mean tree size (for ``taps``: the budgets it chose),
the link round trip the clients measured, and whether every output equals ``ar``'s at
the first RTT. Then one ``taps`` request whose drafter link and then verifier link are
cut for a second each mid-stream (``--cut-at``): its output must equal AR's too (the
loop falls back to AR steps, then recovers). Writes ``link.json`` and ``link.png`` under
``--out``.

The link: on loopback by default, with an emulated delay (``DelayLink``, in a process of its
own: every byte held RTT/2 each way). With ``--netns`` (root) each server runs in a network namespace of its
own and the loop in a third, joined by veth pairs (``presto_sd.app.bench.netns``): the
servers' addresses exist only there, and the delay is ``tc netem`` on the veths where the
kernel has it, else the same user-space relay inside the loop's namespace. Everything it
made is removed when it ends (``--timeout-s`` bounds the run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
]
SHIPPED = str(ROOT / "presto_sd/assets/drafters/smollm2-135m")
NETNS_PORT = 50051  # each server's own namespace: no other listener there


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rtt-ms", default="0,0.5,2,5,10", help="round trips to emulate, comma-separated")
    p.add_argument("--methods", default="ar,presto-best-first@4,presto-best-first@16,taps",
                   help="comma-separated; METHOD@BUDGET for a fixed budget (taps: its cap, default 16)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1, help="torch threads per server")
    p.add_argument("--target", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=SHIPPED, help="the drafter (default: the shipped one)")
    p.add_argument("--cut-at", default="5,15", help="rounds at which the drafter's, then the verifier's "
                   "link is cut for a second")
    p.add_argument("--netns", action="store_true", help="servers and loop in network namespaces (root)")
    p.add_argument("--timeout-s", type=float, default=1800, help="--netns: the whole run's bound")
    p.add_argument("--out", default="runs/link")
    # how the --netns run calls itself inside the loop's namespace
    p.add_argument("--inner", default=None, help=argparse.SUPPRESS)  # JSON: addresses, netem, tag
    return p.parse_args(argv)


class NetemLinks:
    """The kernel delays: netem on the veths of a ``Topology`` (its hub is this process's namespace)."""

    def __init__(self, tag: str, addresses: dict[str, str]) -> None:
        from presto_sd.app.bench.netns import Topology

        self.net, self.addresses = Topology(tag=tag), addresses
        self.net.netem = True

    def set_rtt(self, rtt_s: float) -> None:
        self.net.set_rtt(rtt_s)

    def cut(self, kind: str) -> None:
        self.net.cut(kind)

    def restore(self, kind: str) -> None:
        self.net.restore(kind)

    def close(self) -> None:
        self.net.set_rtt(0.0)


def run(verifier, drafter, ids: list[int], params, on_round=None) -> dict:
    from presto_sd.loop.generate import stream_generate

    t0, tokens, rounds = time.perf_counter(), [], []
    for chunk in stream_generate(verifier, drafter, ids, params):
        tokens.extend(chunk.tokens)
        if chunk.round is not None:
            rounds.append(chunk.round)
            if on_round is not None:
                on_round(len(rounds))
    return {"tokens": tokens, "wall": time.perf_counter() - t0, "rounds": rounds}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == label]
        ax.plot([r["rtt_ms"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=label)
    taps = [r for r in rows if r["method"].startswith("taps")]
    bx.plot([r["rtt_ms"] for r in taps], [r["mean_tree_size"] for r in taps], marker="o", color="tab:red")
    ax.set(xlabel="round trip between the services (ms)", ylabel="tokens/s (one request at a time)",
           title="Split deployment vs link RTT")
    bx.set(xlabel="round trip (ms)", ylabel="mean draft nodes per round", title="taps: the trees it chose")
    ax.legend(fontsize=8)
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from presto_sd.app.bench.link import RelayProcess

    args = parse_args()
    if args.netns and args.inner is None:
        return in_namespaces(args)
    if args.inner is not None:  # in the loop's namespace: the servers are across the veths
        where = json.loads(args.inner)
        targets = {k: _host_port(a) for k, a in where["addresses"].items()}
        links = NetemLinks(where["tag"], where["addresses"]) if where["netem"] else RelayProcess(targets)
        return bench(args, links, delay="netem" if where["netem"] else "relay (no netem in this kernel)")
    serve = argparse.Namespace(drafter=args.drafter, threads=args.threads, target=args.target)
    from bench_grpc import spawn

    servers = {kind: spawn(kind, serve) for kind in ("verifier", "drafter")}
    try:
        links = RelayProcess({kind: ("127.0.0.1", port) for kind, (_, port, _) in servers.items()})
        bench(args, links, delay="relay on loopback")
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)


def in_namespaces(args: argparse.Namespace) -> None:
    """The servers in their namespaces, then this script again inside the hub's."""
    from bench_grpc import spawn

    from presto_sd.app.bench.netns import HOSTS, Topology, unavailable

    why = unavailable()
    if why:
        sys.exit(f"--netns: {why}")
    with Topology() as net:
        serve = argparse.Namespace(drafter=args.drafter, threads=args.threads, target=args.target)
        servers = [spawn(kind, serve, prefix=tuple(net.run_in(kind, [])), host=net.address(kind),
                         port=NETNS_PORT) for kind in HOSTS]
        inner = {"addresses": {k: f"{net.address(k)}:{NETNS_PORT}" for k in HOSTS}, "netem": net.netem,
                 "tag": net.tag}
        argv = [a for a in sys.argv[1:] if a != "--netns"] + ["--inner", json.dumps(inner)]
        print(json.dumps({"topology": net.tag, **inner}), flush=True)
        try:
            subprocess.run(net.run_in(None, [sys.executable, __file__, *argv]), check=True,
                           timeout=args.timeout_s)
        finally:
            for proc, _, _ in servers:
                proc.terminate()
                proc.wait(timeout=30)


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def bench(args: argparse.Namespace, links, delay: str) -> None:
    import torch

    from drafter_service.remote import RemoteDrafter
    from presto_sd.app.generate import encode_prompt
    from presto_sd.app.stack import tree_settings
    from presto_sd.loop.generate import GenerationParams
    from presto_sd.method.builders import TreeParams
    from presto_sd.method.methods import get_method
    from presto_sd.models.loading import load_tokenizer
    from verifier_service.remote import RemoteVerifier

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        verifier = RemoteVerifier(links.addresses["verifier"], timeout_s=30)
        drafter = RemoteDrafter(links.addresses["drafter"])
        tok = load_tokenizer(args.target)
        prompts = [encode_prompt(tok, text, chat=True) for text in PROMPTS]
        eos = verifier.info().eos_token_ids
        dinfo = drafter.info()

        def params(spec: str) -> GenerationParams:
            method, _, budget = spec.partition("@")
            rho, lambdas = tree_settings(method, None, None, dinfo)
            tree = TreeParams(int(budget or 16), rho=rho, lambdas=lambdas)
            return GenerationParams(method, tree, args.max_new_tokens, stop_token_ids=eos)

        methods = args.methods.split(",")
        run(verifier, drafter, prompts[0][:8], params("taps"))  # warm-up: both servers, every path
        reference: dict[int, list[int]] = {}
        rows = []
        for rtt_ms in [float(x) for x in args.rtt_ms.split(",")]:
            links.set_rtt(rtt_ms / 1e3)
            for spec in methods:
                needs = get_method(spec.partition("@")[0]).needs_drafter
                runs = [run(verifier, drafter if needs else None, ids, params(spec)) for ids in prompts]
                for i, r in enumerate(runs):
                    reference.setdefault(i, r["tokens"])
                rounds = [x for r in runs for x in r["rounds"]]
                tokens = sum(len(r["tokens"]) for r in runs)
                row = {"rtt_ms": rtt_ms, "method": spec,
                       "tokens_per_s": round(tokens / sum(r["wall"] for r in runs), 3),
                       "tau": round(sum(x.accepted + 1 for x in rounds) / len(rounds), 3),
                       "mean_tree_size": round(sum(x.tree_size for x in rounds) / len(rounds), 2),
                       "verifier_link_ms": round(1e3 * verifier.round_trip_s(), 3),
                       "drafter_link_ms": round(1e3 * drafter.round_trip_s(), 3) if needs else None,
                       "equals_ar": all(r["tokens"] == reference[i] for i, r in enumerate(runs))}
                rows.append(row)
                print(json.dumps(row), flush=True)
        # a cut mid-stream: the drafter's link for a second, then the verifier's
        links.set_rtt(2e-3)
        cut_rounds = dict(zip([int(x) for x in args.cut_at.split(",")], ("drafter", "verifier")))

        def cut_at(n: int) -> None:
            if n in cut_rounds:
                links.cut(cut_rounds[n])
                threading.Timer(1.0, links.restore, args=(cut_rounds[n],)).start()

        cut = run(verifier, drafter, prompts[0], params("taps"), on_round=cut_at)
        cut_row = {"cut": f"drafter at round {args.cut_at.split(',')[0]}, verifier at round "
                          f"{args.cut_at.split(',')[1]}, 1 s each, RTT 2 ms",
                   "equals_ar": cut["tokens"] == reference[0],
                   "fallback_rounds": sum(1 for x in cut["rounds"] if x.fallback)}
        print(json.dumps(cut_row), flush=True)
        (out / "link.json").write_text(json.dumps({"delay": delay, "rows": rows, "cut": cut_row}, indent=1))
        plot(rows, out / "link.png")
        print(f"\ndelay: {delay}\n")
        print("| RTT ms | method | tokens/s | tau | mean draft nodes | link ms (v / d) | = AR |")
        print("|---:|---|---:|---:|---:|---|---|")
        for r in rows:
            d = "" if r["drafter_link_ms"] is None else f" / {r['drafter_link_ms']:.2f}"
            print(f"| {r['rtt_ms']:g} | {r['method']} | {r['tokens_per_s']:.2f} | {r['tau']:.2f} "
                  f"| {r['mean_tree_size']:.1f} | {r['verifier_link_ms']:.2f}{d} | {r['equals_ar']} |")
    finally:
        links.close()


if __name__ == "__main__":
    main()
