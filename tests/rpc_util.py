"""Real gRPC servers on loopback, in this process, for the service tests.

Every server runs on one shared background event loop (grpc.aio), the engines on their
own threads as in production; clients are the synchronous remote engines.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import queue
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from drafter_service import servicer as drafter_servicer
from presto_sd.rpc.server import GrpcServer, ServerConfig
from verifier_service import servicer as verifier_servicer

_LOOP: asyncio.AbstractEventLoop | None = None
_LOCK = threading.Lock()


def loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, daemon=True, name="grpc-test-loop").start()
    return _LOOP


def run(coro, timeout: float = 60.0):
    """Run a coroutine on the servers' loop and wait for it."""
    return asyncio.run_coroutine_threadsafe(coro, loop()).result(timeout)


def submit(coro):
    """Start a coroutine on the servers' loop; returns its concurrent future."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


class LocalServer:
    """One service on 127.0.0.1: start (with or without its engine), attach, stop, restart."""

    def __init__(self, kind: str, config: ServerConfig | None = None) -> None:
        self.module = verifier_servicer if kind == "verifier" else drafter_servicer
        self.config = config or ServerConfig(drain_s=0.0, grace_s=0.0)
        self.server: GrpcServer | None = None
        self.port = 0

    def start(self, engine=None) -> LocalServer:
        """Bind (the same port on a restart) and serve ``engine`` if given."""
        servicer = (
            self.module.VerifierServicer() if self.module is verifier_servicer
            else self.module.DrafterServicer()
        )
        config = replace(self.config, port=self.port)
        self.server = GrpcServer(config, servicer, self.module.add_to_server, self.module.SERVICE_NAME)
        self.port = run(self.server.start())
        if engine is not None:
            self.attach(engine)
        return self

    def attach(self, engine) -> None:
        run(self.server.attach(engine))

    def stop(self) -> None:
        if self.server is not None:
            run(self.server.stop(0))
            self.server = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


# -- certificates -----------------------------------------------------------------------
def make_pki(tmp: Path) -> dict[str, str]:
    """A CA, a server cert for localhost / 127.0.0.1 and a client cert, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool, sans=(), usage=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(label: str, c, key) -> None:
        (tmp / f"{label}.pem").write_bytes(c.public_bytes(serialization.Encoding.PEM))
        (tmp / f"{label}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    ca_key, other_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    write("ca", cert("presto test CA", ca_key, "presto test CA", ca_key, True), ca_key)
    write("other_ca", cert("another CA", other_key, "another CA", other_key, True), other_key)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    write("server", cert("localhost", server_key, "presto test CA", ca_key, False, sans,
                         ExtendedKeyUsageOID.SERVER_AUTH), server_key)
    write("client", cert("orchestrator", client_key, "presto test CA", ca_key, False, (),
                         ExtendedKeyUsageOID.CLIENT_AUTH), client_key)
    return {k: str(tmp / k) for k in [
        "ca.pem", "other_ca.pem", "server.pem", "server.key", "client.pem", "client.key"]}


# -- real server processes --------------------------------------------------------------
def spawn(args: list[str], stdout=subprocess.DEVNULL) -> tuple[subprocess.Popen, queue.Queue]:
    """``presto-sd ARGS`` as a process; its stderr lines arrive on the queue."""
    proc = subprocess.Popen([sys.executable, "-m", "presto_sd.app.cli", *args], stderr=subprocess.PIPE,
                            stdout=stdout, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    return proc, lines


def wait_for(lines: queue.Queue, event: str, timeout: float = 180.0) -> dict:
    """The first JSON log line of ``event`` (earlier lines are dropped)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line.startswith("{") and json.loads(line).get("event") == event:
            return json.loads(line)
    raise TimeoutError(f"no {event!r} event")
