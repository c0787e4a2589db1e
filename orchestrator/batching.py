"""Continuous batching: per engine replica, whatever calls are queued when the replica is
free go out as ONE batched call: ``verify_batch`` on a verifier (AR steps and trees of
many requests in one target forward, and new requests' prompts with them), ``draft_batch``
on a drafter (their blocks in one drafter forward). While a verifier runs one batch, the
requests of the last one draft theirs: the two engines overlap (docs/design.md §3).

A batch that is not yet as large as the replica's open sessions lingers for the rest:
right after a batch returns, its requests' threads queue their next calls one after
another, and without the wait each step would go out as a few small batches (which then
stay split: two half batches alternating). The wait ends when every session has a call
queued, or ``linger_s`` after the last arrival, and never lasts past a quarter of the
last batch's engine time, so a request that is drafting elsewhere never holds the others
up for long. Steps and trees go out before new prompts, which fill what the bounds leave.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from orchestrator.replicas import Replica
from presto_sd.engine.drafter import DraftCall
from presto_sd.engine.messages import EngineError, UnavailableError
from presto_sd.engine.verifier import PrefillCall, VerifyCall
from presto_sd.method.batch_cost import BatchCostCurve

BATCH_METHODS = {"verifier": "verify_batch", "drafter": "draft_batch"}


class Batcher:
    """Continuous batching for one replica, on its own thread."""

    def __init__(self, replica: Replica, max_batch: int,
                 on_batch: Callable[[Replica, int, int, float, int], None],
                 max_batch_tokens: int = 1024, max_prefill_tokens: int = 512,
                 linger_s: float = 0.005) -> None:
        self.replica, self.max_batch, self.on_batch = replica, max_batch, on_batch
        self.method = BATCH_METHODS[replica.kind]
        self.max_batch_tokens, self.linger_s = max_batch_tokens, linger_s
        # prompts up to this long join a batch (``PrefillCall``); longer ones are prefilled alone
        self.max_prefill_tokens = max_prefill_tokens if replica.kind == "verifier" else 0
        self._last_busy_s = 0.0
        self.last_tokens = 0  # new tokens of the last batch: the load a request's tree joins
        self.last_calls = 0
        self.cost_curve = BatchCostCurve()  # seconds vs new tokens per forward (load-aware taps)
        self._pending: list[tuple] = []  # calls that arrived and did not go out yet, in arrival order
        self._away: set[str] = set()  # sessions whose requests are busy elsewhere (drafting)
        self._away_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"batcher-{replica.name}")
        self._thread.start()

    def away(self, session_id: str, away: bool) -> None:
        """Mark a session as busy elsewhere (its request is at the drafter): a batch does not
        linger for it, it joins the next one."""
        with self._away_lock:
            if away:
                self._away.add(session_id)
            else:
                self._away.discard(session_id)

    def takes_prompt(self, tokens: int) -> bool:
        """Whether a prompt of ``tokens`` is prefilled in a batch (else alone, in chunks)."""
        return tokens <= self.max_prefill_tokens

    def submit(self, call: VerifyCall | PrefillCall | DraftCall) -> Future:
        """A future of ``(result | EngineError, batch engine seconds, queued seconds)``."""
        fut: Future = Future()
        self._queue.put((call, fut, time.monotonic()))
        return fut

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        stopping = False
        while not stopping or self._pending:
            if not self._pending:
                stopping = self._arrive(self._queue.get())
            stopping = self._linger() or stopping
            batch = self._take()
            if batch:
                self._send(batch)

    def _arrive(self, item: tuple | None) -> bool:
        """Queue ``item``; True for the stop marker."""
        if item is None:
            return True
        self._pending.append(item)
        return False

    def _linger(self) -> bool:
        """Gather what arrives while the replica's other sessions are still coming.

        Right after a batch its requests' threads queue their next calls one after another;
        with many requests that takes longer than any fixed wait. So each arrival extends
        the wait by ``linger_s``, up to a quarter of the last batch's engine time, and it
        ends at once when every session not busy elsewhere (``away``: drafting) has a call
        queued. True if the stop marker came.
        """
        start = time.monotonic()
        cap = start + max(self.linger_s, 0.25 * self._last_busy_s)
        deadline = min(cap, start + self.linger_s)
        while len(self._pending) < min(self.max_batch, len(self.replica.sessions) - len(self._away)):
            wait = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if self._arrive(item):
                return True
            deadline = min(cap, time.monotonic() + self.linger_s)
        while True:  # whatever else is already queued
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False
            if self._arrive(item):
                return True

    def _take(self) -> list[tuple]:
        """The next batch from the pending calls: every step and tree first (in arrival
        order, within the bounds), then prompts in arrival order while they fit, so a queue
        of new prompts never holds running requests back. The rest stay pending."""
        steps = [c for c in self._pending if not isinstance(c[0], PrefillCall)]
        prompts = [c for c in self._pending if isinstance(c[0], PrefillCall)]
        batch, tokens, prompt_tokens = [], 0, 0
        for c in steps:
            if len(batch) == self.max_batch or (batch and tokens + _tokens(c) > self.max_batch_tokens):
                break
            batch.append(c)
            tokens += _tokens(c)
        for c in prompts:
            n = _prompt_tokens(c)
            fits = tokens + n <= self.max_batch_tokens and prompt_tokens + n <= self.max_prefill_tokens
            if len(batch) == self.max_batch or (batch and not fits):
                break
            batch.append(c)
            tokens, prompt_tokens = tokens + n, prompt_tokens + n
        taken = {id(c) for c in batch}
        self._pending = [c for c in self._pending if id(c) not in taken]
        return batch

    def _send(self, batch: list[tuple[VerifyCall | PrefillCall | DraftCall, Future, float]]) -> None:
        start = time.monotonic()
        try:
            out = self.replica.call(self.method, [c for c, _, _ in batch])
        except EngineError as e:  # the whole call failed (replica away): every request sees it
            for _, fut, _ in batch:
                fut.set_exception(_copy(e))
            return
        except BaseException as e:  # noqa: BLE001 - a bug: fail the requests, keep the batcher
            for _, fut, _ in batch:
                fut.set_exception(e)
            return
        self._last_busy_s = out.busy_s
        self.last_tokens, self.last_calls = sum(_tokens(b) for b in batch), len(batch)
        self.cost_curve.observe(self.last_tokens, out.busy_s)
        prompts = sum(1 for b in batch if isinstance(b[0], PrefillCall))
        self.on_batch(self.replica, len(batch), self.last_tokens, out.busy_s, prompts)
        away = next((r for r in out.value if isinstance(r, UnavailableError)), None)
        if away is not None:  # a remote engine that did not answer: its calls re-home from now on
            self.replica.failed(away.code)
        for (_, fut, queued), res in zip(batch, out.value):
            if isinstance(res, EngineError) and res is not away:
                self.replica.metrics.error(self.replica.kind, res.code)
            fut.set_result((res, out.busy_s, start - queued))


def _tokens(item: tuple[VerifyCall | PrefillCall | DraftCall, Future, float]) -> int:
    """New tokens a call adds to the engine's forward: a tree's nodes, a prompt's tokens; a
    draft, one block."""
    if isinstance(item[0], VerifyCall):
        return len(item[0].tree.tokens)
    return _prompt_tokens(item) or 1


def _prompt_tokens(item: tuple) -> int:
    return len(item[0].token_ids) if isinstance(item[0], PrefillCall) else 0


def _copy(e: EngineError) -> EngineError:
    """One exception object per waiting thread (a shared one would mix their tracebacks)."""
    try:
        return type(e)(*e.args)
    except TypeError:
        return e
