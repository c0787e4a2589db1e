"""``presto-sd serve drafter|verifier|orchestrator``: each as a gRPC service.

    presto-sd serve verifier --port 50052 [--target T] [--drafter D]
    presto-sd serve drafter  --port 50051 [--target T] [--drafter D]
    presto-sd serve orchestrator --port 50050 --drafter-addr H:P[,H:P] --verifier-addr H:P[,H:P]
    presto-sd serve orchestrator --port 50050        # in-process engines inside Ray actors
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from presto_sd.app.flags import (
    add_client_args,
    add_drain_args,
    add_generation_args,
    add_model_args,
    add_reflection_arg,
    add_serving_args,
    server_config,
)


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the drafter, verifier or orchestrator as a gRPC service")
    ssub = serve.add_subparsers(dest="service", required=True)
    for name, what in (("drafter", "the DFlash drafter (needs the target's embeddings and lm_head)"),
                       ("verifier", "the target model, verifying draft trees")):
        p = ssub.add_parser(name, help=f"serve {what}", description=f"Serve {what} over gRPC "
                            "(presto.v1; health, and reflection unless a token is required). SIGTERM drains, "
                            "then stops.")
        p.add_argument("--port", type=int, required=True, help="0 = any free port (logged)")
        p.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 or [::] to serve "
                       "other machines (default: %(default)s)")
        add_model_args(p, "as for generate (default: SmolLM2-135M-Instruct)", "DFlash drafter dir, hub id "
                       "or 'random' (the verifier reads its target_layer_ids)", group=False,
                       decoder=name == "verifier")
        add_serving_args(p)
        add_reflection_arg(p)
        p.add_argument("--max-sessions", type=int, default=64, help="(default: %(default)s)")
        p.add_argument("--session-ttl-s", type=float, default=600.0,
                       help="close sessions idle this long (default: %(default)s)")
        p.add_argument("--max-message-mb", type=int, default=512, help="(default: %(default)s)")
        p.add_argument("--max-kv-gb", type=float, default=None,
                       help="the sessions' KV bytes, all together; a call past it is RESOURCE_EXHAUSTED "
                            "(default: 40%% of the memory free after loading, logged)")
        if name == "verifier":
            p.add_argument("--prefill-chunk", type=int, default=512,
                           help="tokens per prefill forward; other sessions' calls run between chunks "
                                "(default: %(default)s)")
        add_drain_args(p)
        p.set_defaults(run=run_engine)
    p = ssub.add_parser("orchestrator", help="serve generation over drafter/verifier replicas (Ray)",
                        description="OrchestratorService over gRPC: concurrent requests, pipelined "
                                    "rounds, batched verification, metrics. SIGTERM drains, then stops.")
    add_orchestrator_args(p, up=False)
    p.set_defaults(run=serve_orchestrator)


def add_orchestrator_args(p: argparse.ArgumentParser, up: bool) -> None:
    """The orchestrator's flags (``up``: those of the stack ``up`` starts, engines and TLS its own)."""
    p.add_argument("--port", type=int, default=50050 if up else None, required=not up,
                   help="the orchestrator's port; 0 = any free port (logged)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    add_reflection_arg(p)  # up: its servers' too
    if not up:
        e = p.add_argument_group("engines (default: one in-process drafter and verifier, each an actor)")
        e.add_argument("--drafter-addr", default=None, help="HOST:PORT[,HOST:PORT...] of drafter servers")
        e.add_argument("--verifier-addr", default=None, help="HOST:PORT[,HOST:PORT...] of verifier servers")
        e.add_argument("--local-drafters", type=int, default=1, help="in-process drafter replicas")
        e.add_argument("--local-verifiers", type=int, default=1, help="in-process verifier replicas")
        e.add_argument("--drafter-gpus", type=float, default=0.0, help="GPUs per in-process drafter actor")
        e.add_argument("--verifier-gpus", type=float, default=0.0, help="GPUs per in-process verifier actor")
        add_client_args(e, "engine-", "the engine servers")
    # up: the orchestrator's TLS and tokens; its engines then want a token only it holds
    add_serving_args(p.add_argument_group("serving (as presto-sd serve verifier)"))
    r = p.add_argument_group("ray and scheduling")
    if not up:
        r.add_argument("--ray-address", default=None,
                       help="an existing Ray cluster ('auto': the local one); default: start one")
    r.add_argument("--metrics-export-port", type=int, default=None,
                   help="a Ray started here exports Prometheus metrics on this port")
    r.add_argument("--ray-dashboard", action="store_true",
                   help="start the Ray dashboard (http://127.0.0.1:8265) with the Ray started here; off by "
                        "default: its processes take memory and CPU a small machine's engines need. The "
                        "engine replicas are actors named presto-<kind>-<replica>-<n> (local engines; "
                        "remote ones, as up's, are called from this process and are no actors)")
    r.add_argument("--max-requests", type=int, default=256, help="concurrent requests (default: %(default)s)")
    r.add_argument("--max-batch", type=int, default=64,
                   help="trees per verify batch; an AR step is a one-node tree (default: %(default)s)")
    r.add_argument("--max-batch-tokens", type=int, default=1024,
                   help="tree nodes and prompt tokens per verify batch: new tokens per target forward, "
                        "at most 1024 (the rows probed row-invariant) (default: %(default)s)")
    r.add_argument("--max-batch-prefill-tokens", type=int, default=512,
                   help="prompt tokens per verify batch: prompts up to this long ride in one target forward "
                        "with other sessions' steps; a longer one is prefilled alone, in chunks; 0: every "
                        "prompt alone (default: %(default)s)")
    add_drain_args(r)
    add_generation_args(p)  # the defaults of requests that leave a field unset


def run_engine(args: argparse.Namespace) -> int:
    """``serve drafter|verifier``: the engine loads while the server answers UNAVAILABLE."""
    import asyncio
    import functools
    import logging

    import torch

    from presto_sd.embedded.stack import load_drafter, load_verifier
    from presto_sd.models.loading import parse_dtype
    from presto_sd.rpc.server import GrpcServer, serve_until_signal

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.service == "verifier":
        from verifier_service import servicer as svc

        if args.prefill_chunk < 1:
            raise SystemExit(f"presto-sd serve verifier: --prefill-chunk {args.prefill_chunk}: must be >= 1")
        servicer: Any = svc.VerifierServicer()
        load = functools.partial(load_verifier, prefill_chunk=args.prefill_chunk, decoder=args.decoder,
                                 weights=args.weights)
    else:
        from drafter_service import servicer as svc

        servicer = svc.DrafterServicer()
        load = load_drafter
    if args.max_kv_gb is not None and args.max_kv_gb <= 0:
        raise SystemExit(f"presto-sd serve {args.service}: --max-kv-gb {args.max_kv_gb}: must be > 0")

    def loader():
        return load(args.target, args.drafter, args.max_sessions, parse_dtype(args.dtype), args.max_kv_gb)

    server = GrpcServer(server_config(args), servicer, svc.add_to_server, svc.SERVICE_NAME)
    servicer.own_compute()
    asyncio.run(serve_until_signal(server, loader))
    return 0


def serve_orchestrator(args: argparse.Namespace, announce: Callable[[int], None] | None = None) -> int:
    """The orchestrator's gRPC front over its Ray replicas (``announce``: told the bound port)."""
    import asyncio
    import logging

    import ray

    from orchestrator import service
    from presto_sd.app.stack import orchestrated
    from presto_sd.rpc.server import GrpcServer, serve_until_signal

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    class Server(GrpcServer):
        async def attach(self, engine: Any) -> None:
            await super().attach(engine)
            if announce is not None:
                announce(self.port)

    servicer = service.OrchestratorServicer()
    server = Server(server_config(args), servicer, service.add_to_server, service.SERVICE_NAME)
    if getattr(args, "ray_address", None):
        ray.init(address=args.ray_address)
    else:
        from presto_sd.app.reaper import start_reaper

        start_reaper()  # the Ray started here (its agents too) ends with this process, however it ends
        ray.init(include_dashboard=args.ray_dashboard, _metrics_export_port=args.metrics_export_port)
    started: list = []

    def loader():
        orch, servicer.defaults, servicer.tokenizer = orchestrated(args)
        started.append(orch)
        return orch

    try:
        asyncio.run(serve_until_signal(server, loader))
    finally:
        for orch in started:
            orch.shutdown()
        ray.shutdown()
    return 0
