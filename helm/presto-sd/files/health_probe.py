"""A grpc.health.v1 check over TLS, for Kubernetes exec probes.

Kubernetes' native `grpc:` probes speak plaintext only; with TLS on, the chart runs this
instead. Exit 0 when the server reports SERVING, 1 otherwise (loading, draining, down).

    python health_probe.py --port 50052 --tls-dir /etc/presto-sd/tls \
        --server-name '{hostname}.svc-name.ns.svc.cluster.local' [--client-cert]
"""

import argparse
import socket
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tls-dir", type=Path, required=True, help="holds ca.crt (and tls.crt, tls.key)")
    p.add_argument("--server-name", required=True, help="name to check the certificate against; "
                   "{hostname} is replaced by this pod's hostname")
    p.add_argument("--client-cert", action="store_true", help="present tls.crt/tls.key (mutual TLS)")
    p.add_argument("--service", default="", help="health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=4.0)
    args = p.parse_args()

    tls = args.tls_dir
    creds = grpc.ssl_channel_credentials(
        (tls / "ca.crt").read_bytes(),
        (tls / "tls.key").read_bytes() if args.client_cert else None,
        (tls / "tls.crt").read_bytes() if args.client_cert else None,
    )
    # dial localhost, but check the certificate against the name clients use
    name = args.server_name.replace("{hostname}", socket.gethostname())
    options = [("grpc.ssl_target_name_override", name), ("grpc.default_authority", name)]
    with grpc.secure_channel(f"localhost:{args.port}", creds, options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as e:
            print(f"health check failed: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
