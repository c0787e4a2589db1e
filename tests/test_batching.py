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

    def call(self, method: str, calls: list, timeout_s: float | None = None) -> Outcome:
        assert method == "verify_batch"
        self.batches.append(list(calls))
        if len(self.batches) == 1:
            self.release.wait(10)
        return Outcome([f"done:{c.session_id}" for c in calls], None, 0.001)


def step(sid: str) -> VerifyCall:
    return VerifyCall(sid, 3, TokenTree.root_only(1))


def prompt(sid: str, n: int) -> PrefillCall:
    return PrefillCall(sid, tuple(range(n)))


def test_prompts_and_steps_share_a_batch_within_the_prompt_bound():
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
        # p1 would take the batch's prompts past 100 tokens: it and what queued after it wait
        batches = [[c.session_id for c in b] for b in replica.batches]
        assert batches == [["s0"], ["s1", "p0", "s2"], ["p1", "s3"]]
        assert [a[4] for a in seen] == [0, 1, 1]  # prompts per batch, for the metrics
        assert [a[2] for a in seen] == [1, 62, 61]  # new tokens per forward: a prompt's, a step's one
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
