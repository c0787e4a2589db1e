"""A presto-sd process that has used gRPC can still start children (Ray does, at ray.init).

gRPC's fork handlers, on by default, restart its threads around every fork; with a process
that has served and called gRPC they abort children before their exec (~1 in 5 here).
presto-sd turns them off (``presto_sd/__init__.py``); every child it starts execs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# In a fresh interpreter: serve and call gRPC, then start children the way Ray starts its
# services (subprocess with a preexec_fn: a real fork, not vfork). Each child must exec.
FORKS_AFTER_GRPC = textwrap.dedent("""
    import subprocess
    from concurrent import futures

    import {package}  # the entry point's own package, first
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{{port}}"))
    died = 0
    for _ in range(200):
        stub.Check(health_pb2.HealthCheckRequest())
        died += subprocess.Popen(["true"], preexec_fn=lambda: None).wait() != 0
    print(died)
""")


def _fresh_env() -> dict[str, str]:
    """This process's environment without the variable (the suite's own import set it)."""
    return {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}


@pytest.mark.parametrize("package", ["presto_sd", "orchestrator", "verifier_service", "drafter_service"])
def test_children_forked_after_grpc_use_all_exec(package):
    out = subprocess.run([sys.executable, "-c", FORKS_AFTER_GRPC.format(package=package)],
                         capture_output=True, text=True, timeout=300, env=_fresh_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) == 0, f"children died before exec: {out.stderr[-2000:]}"


def test_a_user_setting_wins():
    code = "import os, presto_sd; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**_fresh_env(), "GRPC_ENABLE_FORK_SUPPORT": "1"})
    assert out.stdout.strip() == "1", out.stderr[-1000:]
