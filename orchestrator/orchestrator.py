"""The orchestrator: many concurrent requests over drafter and verifier replicas.

Each request runs the ordinary generation loop (``stream_generate``: the same rounds,
stop handling and fault links as embedded mode) on its own thread, over engines routed to
the replicas that hold its sessions (``routing.py``). Threads block in Ray calls with
the GIL released, so while one request waits for its verify batch another drafts: rounds
of different requests overlap on the drafter and verifier actors, and the verify calls
queued on a replica while it is busy go out together as one ``verify_batch``.

The output of every request is exactly its embedded output (greedy: the target's AR
output), because each round is the same engine calls on the same session state.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ray.exceptions import ActorDiedError

from orchestrator.actors import EngineStats, ReplicaSpec, engine_stats, start_engine
from orchestrator.batching import Batcher
from orchestrator.metrics import Metrics
from orchestrator.replicas import Replica, ReplicaPool, Timeouts
from orchestrator.requests import ChunkStats, GenerateJob, StreamChunk
from orchestrator.routing import Route, RoutedDrafter, RoutedVerifier
from presto_sd.engine.messages import AlreadyExistsError, EngineError, LimitExceededError
from presto_sd.loop.generate import TokenChunk, stream_generate
from presto_sd.method.methods import get_method

_END = object()  # the stream's end marker, after the last chunk or the error


@dataclass(frozen=True)
class OrchestratorConfig:
    max_requests: int = 256  # concurrent requests; one more is RESOURCE_EXHAUSTED
    max_batch: int = 64  # trees per verify_batch (an AR step is a one-node tree)
    max_batch_tokens: int = 1024  # tree nodes and prompt tokens per verify_batch: one forward's new tokens
    max_batch_prefill_tokens: int = 512  # prompt tokens per verify_batch (longer prompts go alone)
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.max_batch < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_requests, max_batch and max_batch_tokens must be >= 1")
        if self.max_batch_prefill_tokens < 0:
            raise ValueError("max_batch_prefill_tokens must be >= 0")
        from presto_sd.models.invariant import MAX_INVARIANT_ROWS

        if self.max_batch_tokens > MAX_INVARIANT_ROWS:  # past it a verifier refuses the batch's tail
            raise ValueError(f"max_batch_tokens {self.max_batch_tokens}: at most {MAX_INVARIANT_ROWS}, the "
                             "rows a verifier forward's kernels are probed row-invariant for")


class RequestStream:
    """One request on its own thread; chunks (then an error or the end) go to ``sink``."""

    def __init__(self, orch: Orchestrator, job: GenerateJob, sink: Callable[[object], None]) -> None:
        self.job, self.sink, self.orch = job, sink, orch
        self.route = Route(job.session_id)
        self.drafter = RoutedDrafter(orch.drafters, self.route, orch.metrics, orch.batchers)
        self.verifier = RoutedVerifier(orch.verifiers, self.route, orch.metrics, orch.batchers)
        self.tokens: list[int] = list(job.resume)  # committed output so far, resumed or not
        # the text a resumed stream's client has: its whole characters
        self._text = orch.detokenize(self.tokens).rstrip("\ufffd") if job.resume and orch.detokenize else ""
        self._cancelled = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"request-{job.session_id[:8]}")

    def cancel(self) -> None:
        """Stop after the round in flight; both sessions are closed."""
        self._cancelled.set()

    def _run(self) -> None:
        job, method = self.job, get_method(self.job.params.method)
        finish, error = "cancelled", None
        stream = stream_generate(self.verifier, self.drafter if method.needs_drafter else None,
                                 list(job.prompt_ids), job.params, self.orch.detokenize, job.session_id,
                                 resume=job.resume)
        try:
            t0 = time.perf_counter()
            for chunk in stream:
                now = time.perf_counter()
                self.sink(self._chunk(chunk, now - t0))
                t0 = now
                finish = chunk.finish_reason or finish
                if self._cancelled.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, as the loop raised it
            finish = f"error:{e.code}" if isinstance(e, EngineError) else "error:INTERNAL"
            error = e
        finally:
            stream.close()  # a loop stopped early closes both sessions in its finally
            self.orch._finished(self, finish)  # before the consumer hears of the end, error or not
            if error is not None:
                self.sink(error)
            self.sink(_END)

    def _chunk(self, chunk: TokenChunk, wall_s: float) -> StreamChunk:
        self.tokens.extend(chunk.tokens)
        text = ""
        if self.orch.detokenize is not None:
            full = self.orch.detokenize(self.tokens)
            if not full.endswith("\ufffd") and full.startswith(self._text):  # whole characters only
                text, self._text = full[len(self._text):], full
        draft_s, verify_s, queue_s = self.route.take_times()
        method = self.job.params.method
        if chunk.round is None:
            self.orch.metrics.first_token(method)
            return StreamChunk(chunk.tokens, text, None, chunk.finish_reason)
        r = chunk.round
        stats = ChunkStats(r.accepted, r.tree_size, draft_s, verify_s, queue_s,
                           max(0.0, wall_s - draft_s - verify_s - queue_s), r.fallback, r.gated)
        phases = {"draft": draft_s, "verify": verify_s, "queue": queue_s, "transfer": stats.transfer_s}
        self.orch.metrics.round(method, len(chunk.tokens), r.accepted, r.tree_size, phases, r.fallback,
                                r.gated)
        return StreamChunk(chunk.tokens, text, stats, chunk.finish_reason)


class Orchestrator:
    def __init__(
        self,
        drafters: Sequence[Replica],
        verifiers: Sequence[Replica],
        config: OrchestratorConfig = OrchestratorConfig(),
        metrics: Metrics | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.config, self.detokenize = config, detokenize
        self.metrics = metrics or Metrics()
        self.drafters, self.verifiers = ReplicaPool(drafters), ReplicaPool(verifiers)
        self.batchers = {r: Batcher(r, config.max_batch, self._on_batch, config.max_batch_tokens,
                                    config.max_batch_prefill_tokens)
                         for r in (*drafters, *verifiers)}
        self.requests: dict[str, RequestStream] = {}
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls,
        drafters: Sequence[ReplicaSpec],
        verifiers: Sequence[ReplicaSpec],
        config: OrchestratorConfig = OrchestratorConfig(),
        metrics: Metrics | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> Orchestrator:
        """Start every engine (in-process ones as actors on the connected Ray; remote ones'
        clients here) and wait until every one is up."""
        metrics = metrics or Metrics()
        replicas = [Replica(s, start_engine(s), config.timeouts, metrics) for s in (*drafters, *verifiers)]
        engine_stats([r.engine for r in replicas])  # the engines have loaded
        drafter_replicas = [r for r in replicas if r.kind == "drafter"]
        verifier_replicas = [r for r in replicas if r.kind == "verifier"]
        return cls(drafter_replicas, verifier_replicas, config, metrics, detokenize)

    # -- requests -----------------------------------------------------------------------
    def submit(self, job: GenerateJob, sink: Callable[[object], None]) -> RequestStream:
        with self._lock:
            if job.key in self.requests:  # request ids are per principal: another's never collides
                raise AlreadyExistsError(f"request_id {job.request_id!r}: a request with this id is running")
            if len(self.requests) >= self.config.max_requests:
                raise LimitExceededError(f"orchestrator: {self.config.max_requests} requests running (max)")
            stream = RequestStream(self, job, sink)
            self.requests[job.key] = stream
            self.metrics.active(len(self.requests))
        stream.thread.start()
        return stream

    def _finished(self, stream: RequestStream, finish: str) -> None:
        with self._lock:
            self.requests.pop(stream.job.key, None)
            self.metrics.active(len(self.requests))
        self.metrics.finished(stream.job.params.method, finish)
        if finish.startswith("error:"):
            self.metrics.error("request", finish.removeprefix("error:"))

    def stream(self, job: GenerateJob) -> Iterator[StreamChunk]:
        """The request's chunks; closing the iterator early cancels the request."""
        q: queue.Queue = queue.Queue()
        req = self.submit(job, q.put)
        try:
            while (item := q.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            req.cancel()

    async def astream(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        """``stream`` for an event loop (the gRPC servicer): cancelling the task cancels the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink(item: object) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the loop is gone (server stopped): nobody is listening
                pass

        req = self.submit(job, sink)
        try:
            while (item := await q.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            req.cancel()

    # -- operations ---------------------------------------------------------------------
    def _on_batch(self, replica: Replica, size: int, tokens: int, busy_s: float, prompts: int) -> None:
        if replica.kind == "verifier":
            self.metrics.batch(replica.name, size, tokens, busy_s, prompts)
        else:
            self.metrics.draft_batch(replica.name, size)

    def engine_stats(self) -> dict[str, EngineStats]:
        """Per live replica (``"drafter/<name>"``, ``"verifier/<name>"``): busy seconds, calls,
        sessions. A replica whose actor is gone is left out (and marked dead), not an error."""
        out = {}
        for r in [*self.drafters.replicas, *self.verifiers.replicas]:
            if r.dead:
                continue
            try:
                out[f"{r.kind}/{r.name}"] = engine_stats([r.engine])[0]
            except ActorDiedError:
                r.dead = True
        return out

    def close_idle(self, ttl_s: float) -> list[str]:
        """Nothing to reap: a request closes its own sessions however it ends (the engines
        reap sessions of a crashed orchestrator themselves)."""
        return []

    def shutdown(self, kill_actors: bool = True) -> None:
        for stream in list(self.requests.values()):
            stream.cancel()
        for b in self.batchers.values():
            b.stop()
        self.metrics.flush()
        if kill_actors:
            for r in [*self.drafters.replicas, *self.verifiers.replicas]:
                r.engine.kill()
