"""The grpc.aio server both services run in (docs/design.md §3).

- Health (``grpc.health.v1``): NOT_SERVING until the engine is loaded, SERVING once it is,
  NOT_SERVING again while draining (SIGTERM), then a graceful stop. At most
  ``max_health_watches`` Watch streams at once. Reflection: a flag, on by default unless a
  token is required (it would hand the whole API to unauthenticated peers).
- One interceptor: the caller's principal (``principals``: its bearer token, else its
  client certificate, else ``anonymous``; health and reflection stay open, for probes and
  tooling), exceptions -> status codes (``errors.status_of``), one JSON log line per call,
  which names a session by a short hash (``session_tag``), never by its id. It parses
  each request itself (``decoding.py``: grpc only hands it the bytes): a message that does
  not parse is INVALID_ARGUMENT, one over the wire budget RESOURCE_EXHAUSTED before it is
  parsed, and a big one is parsed, and its answer serialised, off the loop.
- Sessions are the principal's: a servicer keys each by ``<principal>/<session_id>``
  (``EngineHost.session_key``), so another principal's calls never find it (NOT_FOUND).
- Engines are synchronous: each runs its calls one at a time on its own thread (the
  per-engine lock); a call whose deadline passed while it queued is not run. A long
  prefill runs as several tasks (``run_steps``), so other calls run between its chunks.
- Message limits raised for feature deltas; a call whose response could pass them is
  refused before it runs (``EngineHost.check_response``), so it changes nothing. A
  session cap and a KV budget (the engine's) and a TTL reaper that frees idle sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from presto_sd.engine.messages import LimitExceededError, UnauthenticatedError, UnavailableError, session_tag
from presto_sd.rpc.decoding import RawRequest, deferred, off_loop, passing_bytes
from presto_sd.rpc.errors import DeadlineExpiredError, status_of
from presto_sd.rpc.principals import ANONYMOUS, DEFAULT, Principals

if TYPE_CHECKING:  # the thin clients import this module: no torch for them
    from presto_sd.engine.calls import EngineCall, Prefill

log = logging.getLogger("presto_sd.rpc")
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_PRINCIPAL: contextvars.ContextVar[str] = contextvars.ContextVar("presto_principal", default=ANONYMOUS)
# trailing metadata of every unary call: the seconds the server spent on it, from its bytes
# in to its answer's bytes out; what a client measures beyond this is the link's (rpc/client.py)
SERVER_SECONDS_KEY = "presto-server-s"


def current_principal() -> str:
    """The principal of the call being served (set by the interceptor)."""
    return _PRINCIPAL.get()


def message_options(max_message_mb: int) -> list[tuple[str, int]]:
    n = max_message_mb * (1 << 20)
    return [("grpc.max_send_message_length", n), ("grpc.max_receive_message_length", n)]


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (the bound one is logged and returned by start())
    tls_cert: str | None = None  # PEM files; cert + key turn TLS on
    tls_key: str | None = None
    tls_client_ca: str | None = None  # mutual TLS: clients must show a cert this CA signed
    auth_token: str | None = None  # clients must send "authorization: Bearer <token>" (principal "default")
    auth_tokens: tuple[tuple[str, str], ...] = ()  # (principal, token) pairs: a token file's lines
    session_ttl_s: float = 600.0  # idle sessions are closed after this
    max_message_mb: int = 512
    drain_s: float = 5.0  # NOT_SERVING but still answering, so load balancers move away
    grace_s: float = 10.0  # then in-flight calls get this long to finish
    reflection: bool | None = None  # None: on without an auth token, off with one
    max_health_watches: int = 64  # open health Watch streams (they need no token); more: RESOURCE_EXHAUSTED

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port}: out of range")
        if self.auth_token is not None:
            Principals(((DEFAULT, self.auth_token),))  # refuses an empty one
        if self.session_ttl_s <= 0 or not 1 <= self.max_message_mb < 2048:
            raise ValueError("session_ttl_s must be > 0 and max_message_mb in [1, 2047]")
        if self.drain_s < 0 or self.grace_s < 0:
            raise ValueError("drain_s and grace_s must be >= 0")
        if self.max_health_watches < 0:
            raise ValueError("max_health_watches must be >= 0")

    @property
    def reflection_on(self) -> bool:
        return self.reflection if self.reflection is not None else self.principals() is None

    def principals(self) -> Principals | None:
        """The principals known by token; None: no token needed."""
        tokens = (*(((DEFAULT, self.auth_token),) if self.auth_token else ()), *self.auth_tokens)
        return Principals(tokens) if tokens else None

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.tls_cert is None:
            return None
        pair = (Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())
        ca = Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


# -- the engine behind a servicer -------------------------------------------------------
def _run_before(deadline: float | None, fn: Callable, args: tuple) -> Any:
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlineExpiredError("the call's deadline passed while it waited for the engine")
    return fn(*args)


def _next_step(steps) -> tuple[bool, Any]:
    """One step of an engine generator: ``(done, its result)``."""
    try:
        next(steps)
    except StopIteration as stop:
        return True, stop.value
    return False, None


class EngineHost:
    """Base of the thin servicers: the engine (absent until loaded), run on its own thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.engine: Any = None
        self.max_response_bytes = 512 << 20  # the server's send limit (GrpcServer sets it)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-engine")

    @staticmethod
    def session_key(session_id: str) -> str:
        """The engine's key of the caller's session: its principal's, and no one else's."""
        return f"{current_principal()}/{session_id}"

    def check_response(self, bound: int, what: str) -> None:
        """Refuse, before anything runs, a call whose response may pass the send limit."""
        if bound > self.max_response_bytes:
            raise LimitExceededError(
                f"{what}: its response may take {bound} bytes, over the {self.max_response_bytes >> 20} MiB "
                "message limit (--max-message-mb); nothing was run"
            )

    async def load(self, loader: Callable[[], Any]) -> Any:
        """``loader()`` on the engine thread: the load's own forwards (kernel probes, cost
        calibration) must not give another thread an OpenMP pool (``own_compute``)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, loader)

    def own_compute(self) -> None:
        """Process-wide, for a server's entry point: the engine thread keeps the torch thread
        count set so far; every other thread of the process computes single-threaded.

        Each thread that runs a parallel torch op gets its own OpenMP (libgomp) thread pool,
        and with more pool threads than cores libgomp cuts its spin-waits short: every
        parallel region of a forward then waits on a futex wake-up. On 2 cores a batched
        verify of 64 AR steps took 280-410 ms instead of 145-235 once any second thread had
        run one parallel op (2026-12-02; ``docs/benchmarks.md``, "Serving under load").
        """
        import torch

        self._thread.submit(torch.get_num_threads).result()  # the engine thread fixes its count
        torch.set_num_threads(1)  # this thread, and every thread that starts from now on

    def ready(self) -> Any:
        if self.engine is None:
            raise UnavailableError(f"{self.name}: the model is still loading")
        return self.engine

    async def run(self, context: grpc.aio.ServicerContext | None, call: EngineCall) -> Any:
        """``call.run(engine)`` on the engine thread, unless the deadline passes first."""
        engine = self.ready()
        remaining = context.time_remaining() if context is not None else None
        deadline = None if remaining is None else time.monotonic() + remaining
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, _run_before, deadline, call.run, (engine,))

    async def run_steps(self, context: grpc.aio.ServicerContext | None, call: Prefill) -> Any:
        """``call.steps(engine)``, a generator, one step per engine-thread task: calls queued
        meanwhile run between its steps. A deadline or a cancel stops it between steps (the
        generator is closed on the engine thread, so what it reserved is given back)."""
        steps = call.steps(self.ready())
        remaining = context.time_remaining() if context is not None else None
        deadline = None if remaining is None else time.monotonic() + remaining
        loop, done = asyncio.get_running_loop(), False
        try:
            while not done:
                done, value = await loop.run_in_executor(
                    self._thread, _run_before, deadline, _next_step, (steps,))
            return value
        finally:
            if not done:
                with contextlib.suppress(RuntimeError):  # the engine thread is gone: so is the engine
                    self._thread.submit(steps.close)  # after the step in flight, if any

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


# -- auth, status codes and the log line: one interceptor -------------------------------
def _session_of(request: Any) -> str:
    if hasattr(request, "session_id"):
        return request.session_id
    return request.session.session_id if hasattr(request, "session") else ""


class CallInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, principals: Principals | None) -> None:
        self._principals = principals

    def _principal(self, metadata, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's principal; None when a token is needed and missing or wrong."""
        if self._principals is not None:
            return self._principals.who(dict(metadata or ()).get("authorization", ""))
        cn = (context.auth_context() or {}).get("x509_common_name")
        return f"cert:{cn[0].decode(errors='replace')}" if cn else ANONYMOUS

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method, metadata = details.method, details.invocation_metadata
        open_method = method.startswith(_OPEN_METHODS)  # no token, and no log line: probes poll

        def guard(context, raw: RawRequest | None):
            principal = ANONYMOUS if open_method else self._principal(metadata, context)
            return _guard(method, principal, context, raw, quiet=open_method)

        serialize = passing_bytes(handler.response_serializer)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def call(raw: RawRequest, context):
                t0 = time.perf_counter()
                async with guard(context, raw) as record:
                    record.request = await off_loop(len(raw.data), raw.message)
                    response = await inner(record.request, context)
                    record.bytes_out = response.ByteSize()
                    data = await off_loop(record.bytes_out, serialize, response)  # bytes
                    context.set_trailing_metadata(((SERVER_SECONDS_KEY, f"{time.perf_counter() - t0:.6f}"),))
                    return data

            wrap = grpc.unary_unary_rpc_method_handler
        elif handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner = handler.unary_stream  # server streaming (the orchestrator's Generate)

            async def call(raw: RawRequest, context):
                async with guard(context, raw) as record:
                    record.request = await off_loop(len(raw.data), raw.message)
                    async for response in inner(record.request, context):
                        record.bytes_out += response.ByteSize()
                        yield response

            wrap = grpc.unary_stream_rpc_method_handler
        elif handler.unary_stream is not None:  # streaming by context.write (health's Watch)
            inner = handler.unary_stream

            async def call(raw: RawRequest, context):
                async with guard(context, raw) as record:
                    record.request = raw.message()
                    await inner(record.request, context)

            wrap = grpc.unary_stream_rpc_method_handler
        elif handler.stream_stream is not None:  # reflection: small requests, parsed as they come
            inner = handler.stream_stream

            async def call(raws, context):
                async def requests():
                    async for raw in raws:
                        yield raw.message()

                async with guard(context, None):
                    async for response in inner(requests(), context):
                        yield response

            wrap = grpc.stream_stream_rpc_method_handler
        else:
            return handler
        return wrap(call, request_deserializer=deferred(handler.request_deserializer),
                    response_serializer=serialize)


@dataclass
class _CallRecord:
    request: Any = None  # the parsed request, once it parsed
    bytes_out: int = 0


@contextlib.asynccontextmanager
async def _guard(method: str, principal: str | None, context: grpc.aio.ServicerContext,
                 raw: RawRequest | None, quiet: bool = False):
    """One call's auth and principal, exception -> status, and its JSON log line (``quiet``: none)."""
    t0, code, message = time.perf_counter(), grpc.StatusCode.OK, ""
    record = _CallRecord()
    # read while the call is live: after a cancel the peer string may be freed with the
    # transport, and reading it then crashed the process (grpc/grpc#29069, a SIGSEGV seen
    # here on a cancelled Generate stream)
    peer = "" if quiet else context.peer()
    bound = _PRINCIPAL.set(principal or ANONYMOUS)
    try:
        if principal is None:
            raise UnauthenticatedError("missing or wrong bearer token (metadata 'authorization')")
        yield record
    except asyncio.CancelledError:  # the client left or its deadline passed
        code, message = grpc.StatusCode.CANCELLED, "cancelled"
        raise
    except grpc.aio.AbortError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes a status, never a crash
        code, message = status_of(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method)
        await context.abort(code, message)
    finally:
        if not quiet:
            sid = _session_of(record.request)
            log.info(json.dumps({
                "event": "call", "method": method, "code": code.name,
                "ms": round(1e3 * (time.perf_counter() - t0), 2), "principal": principal,
                "session": session_tag(f"{principal or ANONYMOUS}/{sid}") if sid else "",
                "peer": peer, "bytes_in": len(raw.data) if raw is not None else 0,
                "bytes_out": record.bytes_out, **({"error": message} if message else {}),
            }))
        with contextlib.suppress(ValueError):  # a stream's generator may end in another context
            _PRINCIPAL.reset(bound)


# -- the server -------------------------------------------------------------------------
class BoundedHealthServicer(health.aio.HealthServicer):
    """``grpc.health.v1`` with at most ``max_watches`` Watch streams open: they need no token,
    and each holds a call open for as long as its peer likes."""

    def __init__(self, max_watches: int) -> None:
        super().__init__()
        self.max_watches, self.watches = max_watches, 0

    async def Watch(self, request, context) -> None:
        if self.watches >= self.max_watches:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.max_watches} health Watch streams open (max); use Check")
        self.watches += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watches -= 1


class GrpcServer:
    """One service (its servicer is an ``EngineHost``) + health + reflection."""

    def __init__(
        self, config: ServerConfig, servicer: EngineHost, add_to_server: Callable, service_name: str
    ) -> None:
        self.config, self.servicer = config, servicer
        self.add_to_server, self.service_name = add_to_server, service_name
        self.port = 0
        self._reaper: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and serve, NOT_SERVING until ``attach``; returns the bound port."""
        c = self.config
        self.server = grpc.aio.server(
            interceptors=[CallInterceptor(c.principals())], options=message_options(c.max_message_mb)
        )
        self.servicer.max_response_bytes = c.max_message_mb << 20
        self.add_to_server(self.servicer, self.server)
        self.health = BoundedHealthServicer(c.max_health_watches)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if c.reflection_on:
            names = (self.service_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, self.server)
        address = f"{c.host}:{c.port}"
        creds = c.credentials()
        if creds is not None:
            port = self.server.add_secure_port(address, creds)
        else:
            port = self.server.add_insecure_port(address)
        if not port:
            raise OSError(f"cannot bind {address}")
        self.port = port
        await self.server.start()
        for name in ("", self.service_name):
            await self.health.set(name, NOT_SERVING)
        log.info(json.dumps({"event": "listening", "service": self.service_name, "host": c.host,
                             "port": port, "tls": creds is not None, "auth": c.principals() is not None,
                             "reflection": c.reflection_on}))
        return port

    async def attach(self, engine: Any) -> None:
        """The engine is loaded: serve it, SERVING, and start the idle-session reaper."""
        self.servicer.engine = engine
        for name in ("", self.service_name):
            await self.health.set(name, SERVING)
        self._reaper = asyncio.create_task(self._reap())
        sessions = getattr(engine, "sessions", None)
        memory = {"kv_budget_bytes": sessions.budget_bytes} if hasattr(sessions, "budget_bytes") else {}
        log.info(json.dumps({"event": "serving", "service": self.service_name, **memory}))

    async def load(self, loader: Callable[[], Any]) -> None:
        """Load the engine on the thread that will run its calls (``EngineHost.load``)."""
        await self.attach(await self.servicer.load(loader))

    async def _reap(self) -> None:
        from presto_sd.engine.calls import CloseIdle

        ttl = self.config.session_ttl_s
        while True:
            await asyncio.sleep(min(ttl / 2, 30.0))
            closed = await self.servicer.run(None, CloseIdle(ttl))
            if closed:
                tags = [session_tag(k) for k in closed]
                log.info(json.dumps({"event": "sessions_expired", "sessions": tags}))

    async def drain(self) -> None:
        """NOT_SERVING for ``drain_s`` (still answering), then stop with ``grace_s``."""
        await self.health.enter_graceful_shutdown()
        log.info(json.dumps({"event": "draining", "service": self.service_name}))
        await asyncio.sleep(self.config.drain_s)
        await self.stop(self.config.grace_s)

    async def stop(self, grace: float | None = None) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await self.server.stop(grace)
        self.servicer.shutdown()
        log.info(json.dumps({"event": "stopped", "service": self.service_name}))


async def serve_until_signal(server: GrpcServer, loader: Callable[[], Any]) -> None:
    """Start, load the engine, serve; on SIGTERM / SIGINT drain and stop gracefully."""
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loading = asyncio.create_task(server.load(loader))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        stopping.cancel()
        await server.stop(0)
        raise loading.exception()
    await stopping
    loading.cancel()
    await server.drain()
