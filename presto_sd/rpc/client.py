"""Channels for the remote engines: TLS, the bearer token, deadlines, errors, bytes counted.

Calls fail fast while a server is away (no wait-for-ready) and the channel re-dials within
about a second once it is back, so the loop can fall back to AR steps and return.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from presto_sd.engine.messages import UnavailableError
from presto_sd.method.cost_model import RollingMedian
from presto_sd.rpc.errors import error_from_rpc
from presto_sd.rpc.principals import client_token
from presto_sd.rpc.server import SERVER_SECONDS_KEY, message_options

_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(frozen=True)
class ClientConfig:
    tls_ca: str | None = None  # PEM of the CA that signed the server's cert: TLS on when set
    tls_cert: str | None = None  # client cert + key, for servers that require mutual TLS
    tls_key: str | None = None
    auth_token: str | None = None
    server_name: str | None = None  # the name to check the server cert against, if not the host
    max_message_mb: int = 512

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("a client cert and its key go together")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("a client cert needs TLS (tls_ca)")


def read_token(path: str | None) -> str | None:
    """The token a client sends: the file's one line, bare or ``name:token`` (``principals``)."""
    return client_token(path) if path else None


def make_channel(address: str, config: ClientConfig = ClientConfig()) -> grpc.Channel:
    options: list[tuple[str, Any]] = [*message_options(config.max_message_mb), *_RECONNECT]
    if config.tls_ca is None:
        return grpc.insecure_channel(address, options=options)
    if config.server_name:
        options.append(("grpc.ssl_target_name_override", config.server_name))
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(config.tls_ca).read_bytes(),
        private_key=Path(config.tls_key).read_bytes() if config.tls_key else None,
        certificate_chain=Path(config.tls_cert).read_bytes() if config.tls_cert else None,
    )
    return grpc.secure_channel(address, creds, options=options)


@dataclass
class WireStats:
    calls: int = 0
    bytes_sent: int = 0  # serialized request messages (gRPC/HTTP2 framing not counted)
    bytes_received: int = 0
    link_s: float = 0.0  # the calls' seconds beyond the server's own (it reports them in its trailers)


class RpcClient:
    """One channel; every call has a deadline; failures raise the named engine errors."""

    def __init__(self, address: str, config: ClientConfig, unavailable: type[UnavailableError]) -> None:
        self.address = address
        self.channel = make_channel(address, config)
        self.unavailable = unavailable
        self.metadata = (("authorization", f"Bearer {config.auth_token}"),) if config.auth_token else None
        self.stats = WireStats()
        self.link = RollingMedian()  # seconds a call spends beyond the server's own work

    @property
    def round_trip_s(self) -> float:
        """The link's cost of one call: round trip, transfer and (de)serialisation, the
        median of the last calls (0 before any, or against a server that reports no time)."""
        return self.link.value

    def call(self, method: grpc.UnaryUnaryMultiCallable, request: Any, timeout_s: float) -> Any:
        t0 = time.perf_counter()
        try:
            response, call = method.with_call(request, timeout=timeout_s, metadata=self.metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err, self.unavailable) from None
        wall_s = time.perf_counter() - t0
        server_s = _server_seconds(call.trailing_metadata())
        if server_s is not None:
            self.link.observe(wall_s - server_s)
            self.stats.link_s += max(0.0, wall_s - server_s)
        self.stats.calls += 1
        self.stats.bytes_sent += request.ByteSize()
        self.stats.bytes_received += response.ByteSize()
        return response

    def close(self) -> None:
        self.channel.close()


def _server_seconds(trailers: Any) -> float | None:
    for key, value in trailers or ():
        if key == SERVER_SECONDS_KEY:
            try:
                return float(value)
            except ValueError:
                return None
    return None
