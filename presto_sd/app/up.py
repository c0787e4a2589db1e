"""``presto-sd serve orchestrator``, ``presto-sd up``, and ``generate --orchestrator-addr``.

    presto-sd serve orchestrator --port 50050 --drafter-addr H:P[,H:P] --verifier-addr H:P[,H:P]
    presto-sd serve orchestrator --port 50050        # in-process engines inside Ray actors
    presto-sd up [--port 50050]                      # verifier + drafter servers + orchestrator
    presto-sd generate "PROMPT" --orchestrator-addr 127.0.0.1:50050 [--json]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def _add_orchestrator_args(p: argparse.ArgumentParser, up: bool) -> None:
    from presto_sd.app.cli import _add_generation_args

    p.add_argument("--port", type=int, default=50050 if up else None, required=not up,
                   help="the orchestrator's port; 0 = any free port (logged)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    if not up:
        e = p.add_argument_group("engines (default: one in-process drafter and verifier, each an actor)")
        e.add_argument("--drafter-addr", default=None, help="HOST:PORT[,HOST:PORT...] of drafter servers")
        e.add_argument("--verifier-addr", default=None, help="HOST:PORT[,HOST:PORT...] of verifier servers")
        e.add_argument("--local-drafters", type=int, default=1, help="in-process drafter replicas")
        e.add_argument("--local-verifiers", type=int, default=1, help="in-process verifier replicas")
        e.add_argument("--drafter-gpus", type=float, default=0.0, help="GPUs per in-process drafter actor")
        e.add_argument("--verifier-gpus", type=float, default=0.0, help="GPUs per in-process verifier actor")
        e.add_argument("--engine-tls-ca", default=None, help="PEM CA of the engine servers' certs")
        e.add_argument("--engine-tls-client-cert", default=None, help="for engine servers that want mTLS")
        e.add_argument("--engine-tls-client-key", default=None)
        e.add_argument("--engine-tls-server-name", default=None)
        e.add_argument("--engine-auth-token-file", default=None, help="bearer token for the engine servers")
        s = p.add_argument_group("serving (as presto-sd serve verifier)")
        s.add_argument("--tls-cert", default=None, help="PEM server certificate (TLS on with --tls-key)")
        s.add_argument("--tls-key", default=None)
        s.add_argument("--tls-client-ca", default=None, help="PEM CA: require client certs it signed")
        s.add_argument("--auth-token-file", default=None, help="clients must send this bearer token")
    r = p.add_argument_group("ray and scheduling")
    if not up:
        r.add_argument("--ray-address", default=None,
                       help="an existing Ray cluster ('auto': the local one); default: start one")
    r.add_argument("--metrics-export-port", type=int, default=None,
                   help="a Ray started here exports Prometheus metrics on this port")
    r.add_argument("--ray-dashboard", action="store_true", help="start the Ray dashboard with it")
    r.add_argument("--max-requests", type=int, default=256, help="concurrent requests (default: %(default)s)")
    r.add_argument("--max-batch", type=int, default=16, help="trees per verify batch (default: %(default)s)")
    r.add_argument("--drain-s", type=float, default=5.0, help="on SIGTERM: NOT_SERVING this long first")
    r.add_argument("--grace-s", type=float, default=10.0, help="then in-flight requests get this long")
    _add_generation_args(p)  # the defaults of requests that leave a field unset


def register_serve(ssub: argparse._SubParsersAction) -> None:
    p = ssub.add_parser("orchestrator", help="serve generation over drafter/verifier replicas (Ray)",
                        description="OrchestratorService over gRPC: concurrent requests, pipelined "
                                    "rounds, batched verification, metrics. SIGTERM drains, then stops.")
    _add_orchestrator_args(p, up=False)


def register_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="a complete local stack: verifier, drafter, orchestrator on Ray",
                       description="Start verifier and drafter servers (subprocesses) and the "
                                   "orchestrator on a local Ray; Ctrl-C / SIGTERM stops them all.")
    _add_orchestrator_args(p, up=True)


def add_client_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--orchestrator-addr", default=None,
                   help="HOST:PORT of a `presto-sd serve orchestrator` (or `up`): generate through it")


# -- the orchestrator -------------------------------------------------------------------
def _addrs(text: str | None) -> list[str]:
    return [a.strip() for a in (text or "").split(",") if a.strip()]


def _specs(args: argparse.Namespace) -> tuple[list, list]:
    from orchestrator.actors import local_spec, remote_spec
    from presto_sd.rpc.client import ClientConfig, read_token

    drafters, verifiers = _addrs(args.drafter_addr), _addrs(args.verifier_addr)
    if bool(drafters) != bool(verifiers):
        raise SystemExit("presto-sd serve orchestrator: give --drafter-addr and --verifier-addr, "
                         "or neither (in-process engines)")
    if verifiers:
        config = ClientConfig(
            tls_ca=args.engine_tls_ca, tls_cert=args.engine_tls_client_cert,
            tls_key=args.engine_tls_client_key, auth_token=read_token(args.engine_auth_token_file),
            server_name=args.engine_tls_server_name,
        )
        return ([remote_spec("drafter", a, config) for a in drafters],
                [remote_spec("verifier", a, config) for a in verifiers])
    return ([local_spec("drafter", i, args.target, args.drafter, args.threads, args.drafter_gpus)
             for i in range(args.local_drafters)],
            [local_spec("verifier", i, args.target, args.drafter, args.threads, args.verifier_gpus)
             for i in range(args.local_verifiers)])


def build(args: argparse.Namespace):
    """Start the replicas and work out the request defaults: (orchestrator, defaults, tokenizer)."""
    from orchestrator.orchestrator import Orchestrator, OrchestratorConfig
    from orchestrator.service import ServiceDefaults
    from presto_sd.app.cli import generation_params
    from presto_sd.models.loading import load_tokenizer, read_json, resolve_drafter

    drafters, verifiers = _specs(args)
    tok = load_tokenizer(args.target)
    orch = Orchestrator.start(drafters, verifiers, OrchestratorConfig(args.max_requests, args.max_batch),
                              detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True))
    vinfo = orch.verifiers.replicas[0].call("info").value
    if _addrs(args.drafter_addr):  # the drafter servers say what they run and its fitted settings
        dinfo = orch.drafters.replicas[0].call("info").value
        presto = {k: v for k, v in (("rho", dinfo.default_rho), ("lambdas", dinfo.default_lambdas)) if v}
        presto["rho_providers"] = dinfo.rho_providers  # taps takes h_phi where there is one
        drafter_name = dinfo.name or "random"
    else:
        spec = resolve_drafter(args.drafter, args.target)
        has = spec.path is not None and (spec.path / "presto.json").exists()
        presto = read_json(spec.path / "presto.json") if has else {}
        drafter_name = str(spec.path) if spec.path else "random"
    params = generation_params(args, vinfo.eos_token_ids, presto)
    return orch, ServiceDefaults(params, vinfo.model, drafter_name), tok


def _serve(args: argparse.Namespace, announce: Callable[[int], None] | None = None) -> int:
    import asyncio
    import logging

    import ray

    from orchestrator import service
    from presto_sd.rpc.client import read_token
    from presto_sd.rpc.server import GrpcServer, ServerConfig, serve_until_signal

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config = ServerConfig(
        host=args.host, port=args.port, tls_cert=getattr(args, "tls_cert", None),
        tls_key=getattr(args, "tls_key", None), tls_client_ca=getattr(args, "tls_client_ca", None),
        auth_token=read_token(getattr(args, "auth_token_file", None)),
        drain_s=args.drain_s, grace_s=args.grace_s,
    )

    class Server(GrpcServer):
        async def attach(self, engine: Any) -> None:
            await super().attach(engine)
            if announce is not None:
                announce(self.port)

    servicer = service.OrchestratorServicer()
    server = Server(config, servicer, service.add_to_server, service.SERVICE_NAME)
    if getattr(args, "ray_address", None):
        ray.init(address=args.ray_address)
    else:
        ray.init(include_dashboard=args.ray_dashboard, _metrics_export_port=args.metrics_export_port)
    started: list = []

    def loader():
        orch, servicer.defaults, servicer.tokenizer = build(args)
        started.append(orch)
        return orch

    try:
        asyncio.run(serve_until_signal(server, loader))
    finally:
        for orch in started:
            orch.shutdown()
        ray.shutdown()
    return 0


def run_serve(args: argparse.Namespace) -> int:
    return _serve(args)


# -- presto-sd up -----------------------------------------------------------------------
class _Child:
    """A server subprocess; its stderr is passed through, its JSON events are watched."""

    def __init__(self, kind: str, args: argparse.Namespace, echo: bool = True) -> None:
        cmd = [sys.executable, "-m", "presto_sd.app.cli", "serve", kind, "--port", "0",
               "--drain-s", str(args.drain_s), "--grace-s", str(args.grace_s)]
        passed = (("--target", args.target), ("--drafter", args.drafter), ("--threads", args.threads))
        for flag, value in passed:
            if value is not None:
                cmd += [flag, str(value)]
        self.kind, self.events, self.echo = kind, {}, echo
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     preexec_fn=_die_with_parent)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            if self.echo:
                sys.stderr.write(line)
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                with self._changed:
                    self.events[event.get("event")] = event
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, event: str, timeout_s: float) -> dict:
        end = time.monotonic() + timeout_s
        with self._changed:
            while event not in self.events:
                if self.proc.poll() is not None:
                    raise SystemExit(f"presto-sd up: the {self.kind} server exited ({self.proc.returncode})")
                if time.monotonic() > end:
                    raise SystemExit(f"presto-sd up: no {event!r} event from the {self.kind} server")
                self._changed.wait(timeout=1.0)
            return self.events[event]

    def stop(self, timeout_s: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _die_with_parent() -> None:
    """In the child: get SIGTERM if `up` dies without cleaning up (Linux prctl PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def run_up(args: argparse.Namespace) -> int:
    children = [_Child(kind, args) for kind in ("verifier", "drafter")]
    try:
        ports = {c.kind: c.wait_for("listening", 600)["port"] for c in children}
        for c in children:
            c.wait_for("serving", 600)
        args.verifier_addr, args.drafter_addr = (f"127.0.0.1:{ports[k]}" for k in ("verifier", "drafter"))
        args.engine_tls_ca = args.engine_tls_client_cert = args.engine_tls_client_key = None
        args.engine_tls_server_name = args.engine_auth_token_file = None

        def announce(port: int) -> None:
            print(json.dumps({"event": "up", "orchestrator": f"{args.host}:{port}",
                              "verifier": args.verifier_addr, "drafter": args.drafter_addr,
                              "pids": [c.proc.pid for c in children]}), flush=True)
            print(f"presto-sd up: orchestrator on {args.host}:{port} (Ctrl-C stops everything)",
                  file=sys.stderr, flush=True)

        return _serve(args, announce)
    finally:
        for c in children:
            c.stop(args.drain_s + args.grace_s + 10)


# -- presto-sd generate --orchestrator-addr ---------------------------------------------
def generate_via(args: argparse.Namespace) -> int:
    """``presto-sd generate`` through an orchestrator: the same output and ``--json``."""
    from orchestrator.client import OrchestratorClient
    from presto_sd.app.cli import generation_summary
    from presto_sd.loop.generate import GenerationResult, RoundStats
    from presto_sd.rpc.client import ClientConfig, read_token

    client = OrchestratorClient(args.orchestrator_addr, ClientConfig(
        tls_ca=args.tls_ca, tls_cert=args.tls_client_cert, tls_key=args.tls_client_key,
        auth_token=read_token(args.auth_token_file), server_name=args.tls_server_name,
    ))
    tree: dict[str, Any] = {"budget": args.budget, "depth": args.depth, "branching": args.branching,
                            "beam": args.beam}
    if args.rho:
        tree["rho"] = args.rho
    if args.lambdas is not None:
        tree["lambdas"] = [float(x) for x in str(args.lambdas).split(",")]
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
    t0 = time.perf_counter()
    tokens, rounds, text, prefill_s, finish = [], [], "", 0.0, "length"
    try:
        for chunk in client.generate(args.prompt, method=args.method, tree=tree, sampling=sampling,
                                     max_new_tokens=args.max_new_tokens, chat=not args.no_chat):
            if chunk.stats is None:
                prefill_s = time.perf_counter() - t0
            else:
                s = chunk.stats  # what the summary reads: accepted and tree size per round
                rounds.append(RoundStats(s.accepted, s.tree_size, s.draft_s, 0.0, s.verify_s, 0.0))
            tokens.extend(chunk.tokens)
            text += chunk.text
            finish = chunk.finish_reason or finish
            if not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        drafter = client.info().drafter
    finally:
        client.close()
    total = time.perf_counter() - t0
    res = GenerationResult(tokens, rounds, finish, prefill_s, total - prefill_s)
    summary = generation_summary(args, res, drafter)
    if args.json:
        print(json.dumps({"text": text, "token_ids": tokens, **summary}))
    else:
        print("\n" + " ".join(f"{k}={v}" for k, v in summary.items()), file=sys.stderr)
    return 0
