"""The orchestrator: many concurrent requests over drafter and verifier replicas.

One step engine (``presto_sd.loop.engine``: the scheduler that owns every sequence, and
its ``step()``) runs on one thread, the step loop, over the replica pools as one drafter
and one verifier (``routing.py``): each step is one ``draft_batch`` and one
``verify_batch`` over every running request, split per home replica. Requests and
cancellations reach the loop through its inbox; each request's chunks go to its sink as
the step that made them ends. No thread per request, no batch formed by waiting: the
batch is the scheduler's decision.

The output of every request is exactly its embedded output (greedy: the target's AR
output): each round is the same engine calls on the same session state, and the engines
are row-invariant.
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
from orchestrator.metrics import Metrics
from orchestrator.replicas import Replica, ReplicaPool, Timeouts
from orchestrator.requests import ChunkStats, GenerateJob, StreamChunk
from orchestrator.routing import PooledDrafter, PooledVerifier, ReplicaMismatchError
from presto_sd.engine.messages import AlreadyExistsError, EngineError, LimitExceededError
from presto_sd.loop.engine import StepEngine
from presto_sd.loop.scheduler import SchedulerConfig
from presto_sd.loop.sequence import Sequence as Seq
from presto_sd.loop.sequence import TokenChunk

_END = object()  # the stream's end marker, after the last chunk or the error


@dataclass(frozen=True)
class OrchestratorConfig:
    max_requests: int = 256  # concurrent requests; one more is RESOURCE_EXHAUSTED
    max_batch: int = 64  # sequences decoding in one step (an AR step is a one-node tree)
    max_batch_tokens: int = 1024  # tree nodes and prompt tokens per step: one forward's new tokens
    max_batch_prefill_tokens: int = 512  # prompt tokens per step (a longer prompt goes by its own call)
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

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(max_seqs=self.max_batch, max_step_tokens=self.max_batch_tokens,
                               max_prefill_tokens=max(1, self.max_batch_prefill_tokens))


class RequestStream:
    """One request: its job, where its chunks go (``sink``), and the text sent so far."""

    def __init__(self, orch: Orchestrator, job: GenerateJob, sink: Callable[[object], None]) -> None:
        self.job, self.sink, self.orch = job, sink, orch
        self.tokens: list[int] = list(job.resume)  # committed output so far, resumed or not
        # the text a resumed stream's client has: its whole characters
        self._text = orch.detokenize(self.tokens).rstrip("\ufffd") if job.resume and orch.detokenize else ""
        self.seq: Seq | None = None  # the step engine's, once the loop took the request
        self.last_chunk_at = time.perf_counter()

    def cancel(self) -> None:
        """Stop after the step in flight; both sessions are closed."""
        self.orch._inbox.put(("cancel", self))

    def deliver(self, chunk: TokenChunk) -> None:
        now = time.perf_counter()
        self.sink(self._chunk(chunk, now - self.last_chunk_at))
        self.last_chunk_at = now

    def _chunk(self, chunk: TokenChunk, wall_s: float) -> StreamChunk:
        self.tokens.extend(chunk.tokens)
        text = ""
        if self.orch.detokenize is not None:
            full = self.orch.detokenize(self.tokens)
            if not full.endswith("\ufffd") and full.startswith(self._text):  # whole characters only
                text, self._text = full[len(self._text):], full
        sid = self.job.session_id
        draft_s, verify_s = self.orch.drafter.take_times(sid), self.orch.verifier.take_times(sid)
        method = self.job.params.method
        if chunk.round is None:
            self.orch.metrics.first_token(method)
            return StreamChunk(chunk.tokens, text, None, chunk.finish_reason)
        r = chunk.round
        # the round's wall time beyond its engines' work: waiting in the step (other
        # sequences' prompts, the loop) and the calls' transport (actor hop, network)
        calls_s = (r.draft_s if r.tree_size or r.fallback else 0.0) + r.verify_s
        transfer_s = max(0.0, calls_s - draft_s - verify_s)
        queue_s = max(0.0, wall_s - calls_s)
        stats = ChunkStats(r.accepted, r.tree_size, draft_s, verify_s, queue_s, transfer_s, r.fallback,
                           r.gated)
        phases = {"draft": draft_s, "verify": verify_s, "queue": queue_s, "transfer": transfer_s}
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
        self.drafter = PooledDrafter(self.drafters, self.metrics)
        self.verifier = PooledVerifier(self.verifiers, self.metrics)
        self.engine = StepEngine(self.verifier, self.drafter, config.scheduler)
        self.requests: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._loop = threading.Thread(target=self._run, daemon=True, name="presto-step-loop")
        self._loop.start()

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
        orch = cls(drafter_replicas, verifier_replicas, config, metrics, detokenize)
        try:
            orch.verifier.check_arithmetic()
        except ReplicaMismatchError:
            orch.shutdown()
            raise
        return orch

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
        self._inbox.put(("add", stream))
        return stream

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

    # -- the step loop --------------------------------------------------------------------
    def _run(self) -> None:
        """Take what the inbox holds, step, hand each request its chunks; wait when idle."""
        streams: dict[str, RequestStream] = {}  # by session id: the engine's sequence ids
        while True:
            item = self._next_item()
            while item is not None:
                if item == "stop":
                    for stream in list(streams.values()):
                        self._cancel(stream, streams)
                    return
                kind, stream = item
                (self._add if kind == "add" else self._cancel)(stream, streams)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            try:
                touched = self.engine.step()
            except BaseException as e:  # noqa: BLE001 - a bug: fail every request, keep serving
                touched = []
                for stream in list(streams.values()):
                    self._end(stream, streams, _error_finish(e), e)
            for seq in touched:
                stream = streams.get(seq.seq_id)
                if stream is not None:
                    self._forward(stream, streams)

    def _next_item(self) -> tuple | str | None:
        """The inbox's next item: waited for while nothing runs, and while every sequence
        waits out an engine's retry pause until the first is due; else only if there."""
        if not self.engine.has_unfinished():
            return self._inbox.get()
        wait = self.engine.idle_s()
        try:
            return self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _add(self, stream: RequestStream, streams: dict[str, RequestStream]) -> None:
        job = stream.job
        try:
            stream.seq = self.engine.add(job.prompt_ids, job.params, self.detokenize, job.session_id,
                                         job.resume)
        except Exception as e:  # noqa: BLE001 - a request the engine refuses: its error, to its consumer
            self._end(stream, streams, _error_finish(e), e)
            return
        streams[job.session_id] = stream
        self._forward(stream, streams)  # a resumed request that had it all ends at once

    def _forward(self, stream: RequestStream, streams: dict[str, RequestStream]) -> None:
        seq = stream.seq
        for chunk in seq.take_chunks():
            stream.deliver(chunk)
        if seq.error is not None:
            self._end(stream, streams, _error_finish(seq.error), seq.error)
        elif seq.finished:
            self._end(stream, streams, seq.finish_reason or "cancelled")

    def _cancel(self, stream: RequestStream, streams: dict[str, RequestStream]) -> None:
        if streams.get(stream.job.session_id) is stream:
            self.engine.cancel(stream.job.session_id)
            self._end(stream, streams, "cancelled")

    def _end(self, stream: RequestStream, streams: dict[str, RequestStream], finish: str,
             error: BaseException | None = None) -> None:
        """The request is over: counted, forgotten, then its consumer hears of the end."""
        streams.pop(stream.job.session_id, None)
        self.drafter.take_times(stream.job.session_id)  # what was not delivered: forgotten
        self.verifier.take_times(stream.job.session_id)
        with self._lock:
            if self.requests.get(stream.job.key) is stream:
                del self.requests[stream.job.key]
            self.metrics.active(len(self.requests))
        self.metrics.finished(stream.job.params.method, finish)
        if finish.startswith("error:"):
            self.metrics.error("request", finish.removeprefix("error:"))
        if error is not None:
            stream.sink(error)
        stream.sink(_END)

    # -- operations ---------------------------------------------------------------------
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
        self._inbox.put("stop")  # every running request is cancelled, its sessions closed
        self._loop.join(timeout=30)
        self.drafter.shutdown()
        self.verifier.shutdown()
        self.metrics.flush()
        if kill_actors:
            for r in [*self.drafters.replicas, *self.verifiers.replicas]:
                r.engine.kill()


def _error_finish(e: BaseException) -> str:
    """How a request that failed is counted: its engine error's code."""
    return f"error:{e.code}" if isinstance(e, EngineError) else "error:INTERNAL"
