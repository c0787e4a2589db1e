"""``presto-sd serve drafter|verifier``, and the remote engines of ``presto-sd generate``.

    presto-sd serve verifier --port 50052 [--target T] [--drafter D]
    presto-sd serve drafter  --port 50051 [--target T] [--drafter D]
    presto-sd generate "PROMPT" --drafter-addr localhost:50051 --verifier-addr localhost:50052
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    from presto_sd.app.cli import DTYPE_CHOICES, DTYPE_HELP

    serve = sub.add_parser("serve", help="run the drafter, verifier or orchestrator as a gRPC service")
    ssub = serve.add_subparsers(dest="service", required=True)
    for name, what in (("drafter", "the DFlash drafter (needs the target's embeddings and lm_head)"),
                       ("verifier", "the target model, verifying draft trees")):
        p = ssub.add_parser(name, help=f"serve {what}", description=f"Serve {what} over gRPC "
                            "(presto.v1; health and reflection on). SIGTERM drains, then stops.")
        p.add_argument("--port", type=int, required=True, help="0 = any free port (logged)")
        p.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 or [::] to serve "
                       "other machines (default: %(default)s)")
        p.add_argument("--target", default=None, help="as for generate (default: SmolLM2-135M-Instruct)")
        p.add_argument("--drafter", default=None, help="DFlash drafter dir, or 'random' (the verifier "
                       "reads its target_layer_ids)")
        p.add_argument("--tls-cert", default=None, help="PEM server certificate (TLS on with --tls-key)")
        p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
        p.add_argument("--tls-client-ca", default=None, help="PEM CA: require client certs it signed (mTLS)")
        p.add_argument("--auth-token-file", default=None,
                       help="clients must send 'authorization: Bearer <the file's token>'")
        p.add_argument("--max-sessions", type=int, default=64, help="(default: %(default)s)")
        p.add_argument("--session-ttl-s", type=float, default=600.0,
                       help="close sessions idle this long (default: %(default)s)")
        p.add_argument("--max-message-mb", type=int, default=512, help="(default: %(default)s)")
        p.add_argument("--drain-s", type=float, default=5.0,
                       help="on SIGTERM: NOT_SERVING this long before stopping (default: %(default)s)")
        p.add_argument("--grace-s", type=float, default=10.0,
                       help="then in-flight calls get this long (default: %(default)s)")
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
        p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    from presto_sd.app import up as orchestrator_cli

    orchestrator_cli.register_serve(ssub)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import sys

    import torch

    from presto_sd.models.loading import parse_dtype
    from presto_sd.rpc.client import read_token
    from presto_sd.rpc.server import GrpcServer, ServerConfig, serve_until_signal

    if args.service == "orchestrator":
        from presto_sd.app import up as orchestrator_cli

        return orchestrator_cli.run_serve(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ServerConfig(
        host=args.host, port=args.port, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca, auth_token=read_token(args.auth_token_file),
        session_ttl_s=args.session_ttl_s, max_message_mb=args.max_message_mb,
        drain_s=args.drain_s, grace_s=args.grace_s,
    )
    if args.service == "verifier":
        from verifier_service import servicer as vs

        servicer: Any = vs.VerifierServicer()
        add, name = vs.add_to_server, vs.SERVICE_NAME

        def loader():
            return vs.load_verifier(args.target, args.drafter, args.max_sessions, parse_dtype(args.dtype))
    else:
        from drafter_service import servicer as ds

        servicer = ds.DrafterServicer()
        add, name = ds.add_to_server, ds.SERVICE_NAME

        def loader():
            engine, servicer.info_overrides = ds.load_drafter(
                args.target, args.drafter, args.max_sessions, parse_dtype(args.dtype))
            return engine

    asyncio.run(serve_until_signal(GrpcServer(config, servicer, add, name), loader))
    return 0


# -- the client side of `presto-sd generate` --------------------------------------------
def add_remote_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("remote engines (gRPC; default: embedded, in this process)")
    g.add_argument("--verifier-addr", default=None, help="HOST:PORT of a `presto-sd serve verifier`")
    g.add_argument("--drafter-addr", default=None, help="HOST:PORT of a `presto-sd serve drafter`")
    g.add_argument("--tls-ca", default=None, help="PEM CA of the servers' certs (TLS on when set)")
    g.add_argument("--tls-client-cert", default=None, help="PEM client cert, for servers that want mTLS")
    g.add_argument("--tls-client-key", default=None)
    g.add_argument("--tls-server-name", default=None, help="name to check the server certs against")
    g.add_argument("--auth-token-file", default=None, help="bearer token for the servers")
    from presto_sd.app import up as orchestrator_cli

    orchestrator_cli.add_client_args(g)


@dataclass
class RemoteStack:
    """What ``cmd_generate`` uses of an ``EmbeddedStack``, over gRPC."""

    verifier: Any  # RemoteVerifier
    drafter: Any  # RemoteDrafter | None
    tokenizer: Any
    drafter_spec: Any  # DrafterSpec, for the summary line
    presto_defaults: dict


def remote_stack(args: argparse.Namespace) -> RemoteStack:
    from pathlib import Path

    from drafter_service.remote import RemoteDrafter
    from presto_sd.models.loading import DrafterSpec, load_tokenizer
    from presto_sd.rpc.client import ClientConfig, read_token
    from verifier_service.remote import RemoteVerifier

    if not args.verifier_addr:
        raise SystemExit("presto-sd generate: --drafter-addr needs --verifier-addr")
    if args.method != "ar" and not args.drafter_addr:
        raise SystemExit(f"presto-sd generate: --method {args.method} needs --drafter-addr")
    config = ClientConfig(
        tls_ca=args.tls_ca, tls_cert=args.tls_client_cert, tls_key=args.tls_client_key,
        auth_token=read_token(args.auth_token_file), server_name=args.tls_server_name,
    )
    verifier = RemoteVerifier(args.verifier_addr, config)
    drafter = RemoteDrafter(args.drafter_addr, config) if args.drafter_addr else None
    spec, presto = DrafterSpec(None), {}
    if drafter is not None:
        info = drafter.info()
        spec = DrafterSpec(None if info.name in ("", "random") else Path(info.name))
        if info.default_rho:
            presto["rho"] = info.default_rho
        if info.default_lambdas:
            presto["lambdas"] = info.default_lambdas
        presto["rho_providers"] = info.rho_providers
    return RemoteStack(verifier, drafter, load_tokenizer(args.target), spec, presto)
