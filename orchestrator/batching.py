"""Continuous batching: per engine replica, whatever calls are queued when the replica is
free go out as ONE batched call: ``verify_batch`` on a verifier (AR steps and trees of
many requests in one target forward, and new requests' prompts with them), ``draft_batch``
on a drafter (their blocks in one drafter forward). While a verifier runs one batch, the
requests of the last one draft theirs: the two engines overlap (docs/design.md §3).

A batch that is not yet as large as the replica's open sessions lingers a moment for the
rest: right after a batch returns, its requests' threads take a few milliseconds to queue
their next call, and without the wait each step would go out as a few small batches.
The wait is bounded (``linger_s``, and a tenth of the last batch's engine time), so a
request that is drafting elsewhere never holds the others up for long.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from orchestrator.replicas import Replica
from presto_sd.engine.drafter import DraftCall
from presto_sd.engine.messages import EngineError
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
        self._carry: tuple | None = None  # the call that did not fit the last batch: the next one's first
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"batcher-{replica.name}")
        self._thread.start()

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
        while True:
            batch = [self._carry if self._carry is not None else self._queue.get()]
            self._carry = None
            tokens, prompt_tokens = _tokens(batch[-1]), _prompt_tokens(batch[-1])
            deadline = time.monotonic() + min(self.linger_s, 0.1 * self._last_busy_s)
            while batch[-1] is not None and len(batch) < self.max_batch:
                wanted = min(self.max_batch, len(self.replica.sessions))
                wait = deadline - time.monotonic() if len(batch) < wanted else 0.0
                try:
                    item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None and (tokens + _tokens(item) > self.max_batch_tokens
                                         or prompt_tokens + _prompt_tokens(item) > self.max_prefill_tokens):
                    self._carry = item
                    break
                batch.append(item)
                tokens += _tokens(item)
                prompt_tokens += _prompt_tokens(item)
            stopping = batch[-1] is None
            batch = [b for b in batch if b is not None]
            if batch:
                self._send(batch)
            if stopping:
                if self._carry is not None:
                    self._send([self._carry])
                return

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
        for (_, fut, queued), res in zip(batch, out.value):
            if isinstance(res, EngineError):
                self.replica.metrics.error(self.replica.kind, res.code)
            fut.set_result((res, out.busy_s, start - queued))


def _tokens(item: tuple[VerifyCall | PrefillCall | DraftCall, Future, float] | None) -> int:
    """New tokens a call adds to the engine's forward: a tree's nodes, a prompt's tokens; a
    draft, one block."""
    if item is None:
        return 0
    if isinstance(item[0], VerifyCall):
        return len(item[0].tree.tokens)
    return _prompt_tokens(item) or 1


def _prompt_tokens(item: tuple | None) -> int:
    return len(item[0].token_ids) if item is not None and isinstance(item[0], PrefillCall) else 0


def _copy(e: EngineError) -> EngineError:
    """One exception object per waiting thread (a shared one would mix their tracebacks)."""
    try:
        return type(e)(*e.args)
    except TypeError:
        return e
