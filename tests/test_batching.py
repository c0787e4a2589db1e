"""The orchestrator's Batcher, over a fake replica: what goes out together, and what waits."""

from __future__ import annotations

import threading

from orchestrator.actors import Outcome
from orchestrator.batching import Batcher
from orchestrator.metrics import Metrics
from presto_sd.engine.verifier import PrefillCall, VerifyCall
from presto_sd.method.tree import TokenTree


class FakeReplica:
    """Records each batch; the first call blocks until released, so later ones queue up."""

    kind, name = "verifier", "fake"

    def __init__(self) -> None:
        self.sessions = {f"s{i}" for i in range(8)}
        self.metrics = Metrics()
        self.batches: list[list] = []
        self.release = threading.Event()
        self.busy_s = 0.001  # the engine time each batch reports

    def call(self, method: str, calls: list, timeout_s: float | None = None) -> Outcome:
        assert method == "verify_batch"
        self.batches.append(list(calls))
        if len(self.batches) == 1:
            self.release.wait(10)
        return Outcome([f"done:{c.session_id}" for c in calls], None, self.busy_s)


def step(sid: str) -> VerifyCall:
    return VerifyCall(sid, 3, TokenTree.root_only(1))


def prompt(sid: str, n: int) -> PrefillCall:
    return PrefillCall(sid, tuple(range(n)))


def test_steps_go_first_and_prompts_fill_the_prompt_bound():
    replica, seen = FakeReplica(), []
    batcher = Batcher(replica, max_batch=64, on_batch=lambda *a: seen.append(a), max_batch_tokens=1024,
                      max_prefill_tokens=100)
    try:
        assert batcher.takes_prompt(100) and not batcher.takes_prompt(101)
        first = batcher.submit(step("s0"))  # goes out alone and blocks the replica
        while not replica.batches:
            pass
        queued = [batcher.submit(c) for c in (step("s1"), prompt("p0", 60), step("s2"), prompt("p1", 60),
                                              step("s3"))]
        replica.release.set()
        answers = [f.result(10)[0] for f in [first, *queued]]
        assert answers == ["done:s0", "done:s1", "done:p0", "done:s2", "done:p1", "done:s3"]
        # every step goes out, then prompts while they fit: p1 would pass 100 prompt tokens
        batches = [[c.session_id for c in b] for b in replica.batches]
        assert batches == [["s0"], ["s1", "s2", "s3", "p0"], ["p1"]]
        assert [a[4] for a in seen] == [0, 1, 1]  # prompts per batch, for the metrics
        assert [a[2] for a in seen] == [1, 63, 60]  # new tokens per forward: a prompt's, a step's one
    finally:
        batcher.stop()


def test_prompts_never_join_a_drafter_batch():
    replica = FakeReplica()
    replica.kind = "drafter"
    batcher = Batcher(replica, max_batch=8, on_batch=lambda *a: None, max_prefill_tokens=512)
    try:
        assert not batcher.takes_prompt(1)
    finally:
        batcher.stop()


def test_a_stream_of_arrivals_keeps_the_batch_open():
    """Calls that keep arriving (each well within linger_s of the last) join one batch, even
    when all of them together take far longer than linger_s: many requests' threads
    resubmitting after a batch must not split into two alternating half batches."""
    replica = FakeReplica()
    replica.busy_s = 4.0  # a quarter of it bounds the wait
    batcher = Batcher(replica, max_batch=64, on_batch=lambda *a: None, linger_s=0.2)
    try:
        first = batcher.submit(step("s0"))
        replica.release.set()
        first.result(10)  # the last batch took 4 s (as reported): the wait may last up to 1 s
        futures = []
        for i in range(1, 7):  # 6 calls 20 ms apart: 100 ms in all, below 0.2 s after each one
            futures.append(batcher.submit(step(f"s{i}")))
            threading.Event().wait(0.02)
        for f in futures:
            f.result(10)
        assert [len(b) for b in replica.batches] == [1, 6]
    finally:
        batcher.stop()
