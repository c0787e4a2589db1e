"""The orchestrator on a local Ray: engines in actors, served over gRPC on loopback.

One Ray and one stack for the module (2 drafter replicas, 1 verifier, the tiny target of
``conftest`` built inside each actor). What a test reads from earlier traffic comes from a
module fixture (``cancelled``, ``drafter_lost``), so each test also passes alone; the
verifier-lost test kills a verifier of a stack of its own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator import service
from orchestrator.actors import ActorEngine, ReplicaSpec
from orchestrator.client import OrchestratorClient
from orchestrator.metrics import prometheus_names
from orchestrator.orchestrator import Orchestrator
from presto_sd.engine.calls import Apply
from presto_sd.engine.messages import (
    InvalidArgumentError,
    LimitExceededError,
    UnauthenticatedError,
    UnavailableError,
)
from presto_sd.loop.faults import FaultPolicy
from presto_sd.loop.generate import GenerationParams
from presto_sd.method.builders import TreeParams
from presto_sd.rpc.client import ClientConfig
from presto_sd.rpc.server import GrpcServer, ServerConfig
from tests import rpc_util
from tests.conftest import hf_greedy
from tests.orchestrator_util import tiny_spec

FAST = FaultPolicy(drafter_retry_s=0.05, drafter_retry_max_s=0.2, verifier_wait_s=2.0, verifier_retry_s=0.05)
DEFAULTS = GenerationParams(method="marginal", tree=TreeParams(budget=16, depth=8),
                            max_new_tokens=16, faults=FAST)
METHODS = ["ar", "linear", "marginal", "presto-beam", "presto-best-first", "taps"]
DASHBOARD = Path(__file__).resolve().parent.parent / "helm" / "presto-sd" / "dashboards" / "presto-sd.json"


@pytest.fixture(scope="module")
def metrics_port(ray_runtime):
    return ray_runtime


@pytest.fixture(scope="module")
def exported_before(metrics_port) -> str:
    """The metrics endpoint before this module's traffic: Ray is the process's, so other
    modules' orchestrators exported to it too. Read once it stops moving (their last
    flushes land within a few report intervals)."""
    text, deadline = _scrape(metrics_port), time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(1.5)
        now = _scrape(metrics_port)
        if now == text:
            break
        text = now
    return text


@contextlib.contextmanager
def _served(drafters: int = 2):
    """An orchestrator over tiny engine actors, served over gRPC on loopback: (orch, client, port)."""
    orch = Orchestrator.start([tiny_spec("drafter", i) for i in range(drafters)], [tiny_spec("verifier", 0)])
    servicer = service.OrchestratorServicer()
    servicer.defaults = service.ServiceDefaults(DEFAULTS, "tiny-llama")
    server = GrpcServer(ServerConfig(drain_s=0.0, grace_s=0.0), servicer, service.add_to_server,
                        service.SERVICE_NAME)
    port = rpc_util.run(server.start())
    rpc_util.run(server.attach(orch))
    client = OrchestratorClient(f"127.0.0.1:{port}", timeout_s=120)
    try:
        yield orch, client, port
    finally:
        client.close()
        rpc_util.run(server.stop(0))
        orch.shutdown()


@pytest.fixture(scope="module")
def stack(metrics_port, exported_before):
    with _served() as served:
        yield served


def _tokens(client: OrchestratorClient, prompt: list[int], **options) -> tuple[list[int], list]:
    tokens, chunks = [], []
    for chunk in client.generate(prompt, **options):
        tokens.extend(chunk.tokens)
        chunks.append(chunk)
    return tokens, chunks


def _sessions(orch: Orchestrator) -> int:
    return sum(s.sessions or 0 for s in orch.engine_stats().values())


def test_concurrent_requests_equal_ar(tiny_target, stack):
    orch, client, _ = stack
    jobs = [(METHODS[i % len(METHODS)], [0, 1 + i % 15, 3, (5 * i) % 16], 8 + 3 * i) for i in range(18)]
    out: dict[int, tuple] = {}

    def run(i: int) -> None:
        method, prompt, n = jobs[i]
        out[i] = _tokens(client, prompt, method=method, max_new_tokens=n, tree={"budget": 8 + i})

    before = dict(orch.metrics.tallies)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, (method, prompt, n) in enumerate(jobs):
        tokens, chunks = out[i]
        assert tokens == hf_greedy(tiny_target, prompt, n), (method, prompt, n)
        assert chunks[0].stats is None and chunks[-1].finish_reason == "length"
        rounds = [c.stats for c in chunks[1:]]
        sizes = [r.tree_size for r in rounds]
        if method == "ar":
            assert max(sizes) == 0 and not any(r.gated for r in rounds), sizes
        elif method == "taps":
            # 18 streams on a loaded CPU: TAPS may rightly keep every round an AR step (its
            # gate shut, or B* = 0 against the measured shared forward); its choices under a
            # fixed cost are tests/test_taps.py's. Here: it never exceeds the request's budget.
            assert max(sizes) <= 8 + i, (method, sizes)
        else:
            assert max(sizes) > 0 and not any(r.gated for r in rounds), (method, sizes)
        assert all(r.verify_s > 0 and r.transfer_s >= 0 for r in rounds), rounds
    tallies = orch.metrics.tallies
    batches = tallies["verify_batches"] - before.get("verify_batches", 0)
    calls = tallies["verify_batched_calls"] - before.get("verify_batched_calls", 0)
    assert calls > batches  # some verify calls of different requests shared one batch
    # every (short) prompt was prefilled inside a batch, beside other requests' steps
    assert tallies["verify_batched_prompts"] - before.get("verify_batched_prompts", 0) == len(jobs)
    assert not orch.requests and _sessions(orch) == 0


def test_generate_batch_answers_in_order(tiny_target, stack):
    _, client, _ = stack
    prompts = [[0, 3, 5, 7], [0, 9], [0, 1, 2, 3, 4, 5]]
    results = client.generate_batch(prompts, method="presto-beam", max_new_tokens=12)
    assert [list(r.token_ids) for r in results] == [hf_greedy(tiny_target, p, 12) for p in prompts]
    assert all(r.finish_reason == "length" and r.rounds >= 1 and r.tau >= 1 for r in results)


@pytest.fixture(scope="module")
def cancelled(stack) -> tuple[tuple[int, int], tuple[int, int]]:
    """A stream cancelled after 3 chunks: (requests, sessions) held before and after.

    A fixture, not a test's side effect: the metrics test needs a cancelled request too,
    and gets one however it is run (alone or after the others).
    """
    orch, client, _ = stack
    stream = client.generate([0, 3, 5, 7], method="marginal", max_new_tokens=400)
    for _ in range(3):
        next(stream)
    before = (len(orch.requests), _sessions(orch))
    stream.close()  # cancels the RPC
    deadline = time.monotonic() + 20
    while (orch.requests or _sessions(orch)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return before, (len(orch.requests), _sessions(orch))


def test_cancel_frees_both_sessions(stack, cancelled):
    orch, _, _ = stack
    before, after = cancelled
    assert before[0] and before[1] == 2  # one drafter and one verifier session
    assert after == (0, 0)
    assert orch.metrics.tallies["finish:cancelled"] >= 1


def test_bad_requests_get_their_status(stack):
    _, client, port = stack
    bad = [
        ({"prompt": "text needs a tokenizer"}, "no tokenizer"),
        ({"prompt": [0, 3], "method": "beam-me-up"}, "method = 'beam-me-up'"),
        ({"prompt": [0, 3], "tree": {"budget": 0}}, "tree.budget = 0"),
        ({"prompt": [0, 3], "sampling": {"top_p": 0.0}}, "sampling.top_p"),
        ({"prompt": [0, 3], "stop": ["x"]}, "stop strings need a tokenizer"),
        ({"prompt": [0, 99]}, "token 99 out of range"),  # refused by the verifier, mid-stream
        ({"prompt": [0, 3], "max_new_tokens": 0}, "max_new_tokens = 0"),
    ]
    for options, needle in bad:
        prompt = options.pop("prompt")
        with pytest.raises(InvalidArgumentError, match=re.escape(needle)):
            _tokens(client, prompt, **options)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    status = health.Check(health_pb2.HealthCheckRequest(service=service.SERVICE_NAME), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    info = client.info()
    assert list(info.drafter_replicas) == ["tiny-0", "tiny-1"] and info.default_method == "marginal"
    # every replica's link: here the hop into its Ray actor, measured on the calls so far
    links = {(link.service, link.replica): link for link in info.links}
    assert set(links) == {("drafter", "tiny-0"), ("drafter", "tiny-1"), ("verifier", "tiny-0")}
    verifier_link = links["verifier", "tiny-0"]
    assert verifier_link.calls > 0 and 0.0 < verifier_link.round_trip_s < 1.0


def test_token_auth_guards_the_stream(tiny_target, stack):
    orch, _, _ = stack
    servicer = service.OrchestratorServicer()
    servicer.defaults = service.ServiceDefaults(DEFAULTS)
    config = ServerConfig(auth_token="s3cret", drain_s=0.0, grace_s=0.0)
    server = GrpcServer(config, servicer, service.add_to_server, service.SERVICE_NAME)
    address = f"127.0.0.1:{rpc_util.run(server.start())}"
    rpc_util.run(server.attach(orch))
    try:
        with pytest.raises(UnauthenticatedError):
            _tokens(OrchestratorClient(address), [0, 3, 5], max_new_tokens=4)
        good = OrchestratorClient(address, ClientConfig(auth_token="s3cret"))
        assert _tokens(good, [0, 3, 5], max_new_tokens=4)[0] == hf_greedy(tiny_target, [0, 3, 5], 4)
    finally:
        rpc_util.run(server.stop(0))


def test_request_ids_are_per_principal_and_never_the_engines_session_ids(tiny_target, stack):
    orch, _, _ = stack
    servicer = service.OrchestratorServicer()
    servicer.defaults = service.ServiceDefaults(DEFAULTS)
    config = ServerConfig(auth_tokens=(("alice", "a-token"), ("bob", "b-token")), drain_s=0.0, grace_s=0.0)
    server = GrpcServer(config, servicer, service.add_to_server, service.SERVICE_NAME)
    address = f"127.0.0.1:{rpc_util.run(server.start())}"
    rpc_util.run(server.attach(orch))
    alice, bob = (OrchestratorClient(address, ClientConfig(auth_token=t)) for t in ("a-token", "b-token"))
    try:
        first = alice.generate([0, 3, 5, 7], max_new_tokens=120, request_id="mine")
        tokens = list(next(first).tokens)  # alice's "mine" is running
        job = orch.requests["alice/mine"].job
        assert job.session_id != "mine" and len(job.session_id) == 32  # minted by the orchestrator
        # bob's "mine" is another request: it runs beside alice's, and both equal AR
        theirs, _ = _tokens(bob, [0, 9], max_new_tokens=8, request_id="mine")
        assert theirs == hf_greedy(tiny_target, [0, 9], 8)
        for chunk in first:
            tokens.extend(chunk.tokens)
        assert tokens == hf_greedy(tiny_target, [0, 3, 5, 7], 120)
    finally:
        alice.close()
        bob.close()
        rpc_util.run(server.stop(0))


def test_the_window_ends_a_stream_with_length(tiny_target, stack):
    _, client, _ = stack
    window = tiny_target.config.max_position_embeddings  # the verifier's max_context
    prompt = [0, *([3, 5, 7, 9] * 200)][: window - 7]
    tokens, chunks = _tokens(client, prompt, method="marginal", max_new_tokens=100)
    assert tokens == hf_greedy(tiny_target, prompt, 7)
    assert chunks[-1].finish_reason == "length" and not any(c.finish_reason for c in chunks[:-1])
    with pytest.raises(LimitExceededError, match="max_context"):  # a prompt that alone fills it
        _tokens(client, [0] * window, method="marginal")


def test_a_resumed_request_goes_on_from_the_tokens_received(tiny_target, stack):
    orch, client, _ = stack
    prompt, n = [0, 3, 5, 7], 24
    whole = hf_greedy(tiny_target, prompt, n)
    for method in ("ar", "marginal", "presto-beam"):
        for cut in (1, 10, n):
            tokens, chunks = _tokens(client, prompt, method=method, max_new_tokens=n,
                                     resume_token_ids=whole[:cut])
            assert tokens == whole[cut:] and chunks[-1].finish_reason == "length", (method, cut)
            assert all(c.tokens for c in chunks[:-1])  # the resumed prefill's empty chunk is not passed on
    bad = [(whole + [1], "more than max_new_tokens 24"), ([3, -1], "resume_token_ids[1] = -1"),
           ([3, 99], "token 99 out of range")]
    for resume, needle in bad:
        with pytest.raises(InvalidArgumentError, match=re.escape(needle)):
            _tokens(client, prompt, max_new_tokens=n, resume_token_ids=resume)
    assert not orch.requests


def test_the_client_resumes_a_broken_stream_on_the_next_orchestrator(tiny_target, stack):
    orch, _, port = stack
    servicer = service.OrchestratorServicer()
    servicer.defaults = service.ServiceDefaults(DEFAULTS)
    doomed = GrpcServer(ServerConfig(drain_s=0.0, grace_s=0.0), servicer, service.add_to_server,
                        service.SERVICE_NAME)
    address = f"127.0.0.1:{rpc_util.run(doomed.start())}"
    rpc_util.run(doomed.attach(orch))
    client = OrchestratorClient([address, f"127.0.0.1:{port}"], timeout_s=120)
    tokens = []
    try:
        for k, chunk in enumerate(client.generate([0, 3, 5, 7], method="ar", max_new_tokens=300)):
            tokens.extend(chunk.tokens)
            if k == 3:
                rpc_util.run(doomed.stop(0))  # the stream in flight is cut
    finally:
        client.close()
    assert client.resumes >= 1 and client.current == 1
    assert tokens == hf_greedy(tiny_target, [0, 3, 5, 7], 300)


@pytest.fixture(scope="module")
def drafter_lost(stack):
    """Drafter replica 0 killed under 4 streams: (prompts, outputs, its sessions when killed, it).

    A fixture for the same reason as ``cancelled``: the metrics test reads its fallbacks.
    """
    orch, client, _ = stack
    prompts = [[0, 3, 5, i] for i in range(4)]
    out: dict[int, list[int]] = {}
    started = threading.Barrier(len(prompts) + 1)

    def run(i: int) -> None:
        tokens = []
        for k, chunk in enumerate(client.generate(prompts[i], method="marginal", max_new_tokens=48)):
            tokens.extend(chunk.tokens)
            if k == 2:
                started.wait(timeout=60)
        out[i] = tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    lost = orch.drafters.replicas[0]
    held = set(lost.sessions)
    ray.kill(lost.actor, no_restart=True)
    for t in threads:
        t.join(timeout=120)
    return prompts, [out.get(i) for i in range(len(prompts))], held, lost


def test_drafter_replica_lost_falls_back_and_rehomes(tiny_target, stack, drafter_lost):
    orch, _, _ = stack
    prompts, out, held, lost = drafter_lost
    assert held  # least-loaded placement put some of the requests there
    assert out == [hf_greedy(tiny_target, p, 48) for p in prompts]
    tallies = orch.metrics.tallies
    assert tallies["fallback:ar_round"] >= 1 and tallies["fallback:drafter_rehome"] >= 1
    stats = orch.engine_stats()  # the lost replica is left out, not an error
    assert f"drafter/{lost.name}" not in stats and len(stats) == 2
    assert lost.dead and not lost.sessions


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _value(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_metrics_are_exported_and_the_dashboard_uses_their_names(stack, metrics_port, exported_before,
                                                                 cancelled, drafter_lost):
    """Reads what ``cancelled`` and ``drafter_lost`` exported (tokens, a cancel, a rehome): the
    endpoint's values less what it held before this module's traffic."""
    orch, _, _ = stack
    tallies = orch.metrics.tallies

    def added(text: str, name: str, **labels: str) -> float:
        return _value(text, name, **labels) - _value(exported_before, name, **labels)

    deadline, text = time.monotonic() + 30, ""
    while time.monotonic() < deadline:  # the driver reports every 0.5 s here (10 s by default)
        text = _scrape(metrics_port)
        if added(text, "ray_presto_tokens_committed_total") == tallies["tokens"]:
            break
        time.sleep(0.5)
    assert added(text, "ray_presto_tokens_committed_total") == tallies["tokens"] > 0
    assert added(text, "ray_presto_acceptance_length_count") == tallies["rounds"]
    assert added(text, "ray_presto_round_phase_seconds_count", phase="verify") == tallies["rounds"]
    assert added(text, "ray_presto_fallbacks_total", kind="drafter_rehome") >= 1
    assert added(text, "ray_presto_errors_total", service="drafter", code="UNAVAILABLE") >= 1
    assert added(text, "ray_presto_requests_total", finish="cancelled") >= 1
    assert re.search(r"^ray_presto_active_requests\{", text, re.M)
    assert added(text, "ray_presto_engine_busy_seconds_total", service="verifier") > 0
    # every name the Grafana dashboard queries is one Prometheus sees: ray_ + name + suffix
    exported = prometheus_names()
    queried = set(re.findall(r"ray_presto_[a-z_]+", DASHBOARD.read_text()))
    assert queried and queried <= exported, queried - exported
    json.loads(DASHBOARD.read_text())


def _dashboard_queries() -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` of every target of the shipped Grafana dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tiny_target, stack, metrics_port,
                                                                   cancelled, drafter_lost):
    """Debian's Prometheus scrapes the orchestrator's Ray metrics endpoint during a short load
    (every method, after a cancel and a lost drafter earlier in this module); every PromQL
    expression of the shipped Grafana dashboard must then return series carrying the labels
    it groups by. A panel that shows nothing is a defect."""
    from tests.prometheus_util import PROMETHEUS, Prometheus

    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    _, client, _ = stack
    prom = Prometheus([f"127.0.0.1:{metrics_port}"])
    try:
        deadline = time.monotonic() + 60
        while prom.scrapes() < 3 and time.monotonic() < deadline:
            for i, method in enumerate(METHODS):  # load while it scrapes: rates over the window move
                _tokens(client, [0, 1 + i, 3, 5], method=method, max_new_tokens=6)
            time.sleep(0.5)
        for i, method in enumerate(METHODS):
            _tokens(client, [0, 2 + i, 4], method=method, max_new_tokens=6)
        time.sleep(3)  # two more scrapes after the last request
        empty = []
        for title, expr in _dashboard_queries():
            result = prom.query(expr.replace("$__rate_interval", "1m"))
            grouped = re.search(r"by \(([^)]*)\)", expr)
            labels = {x.strip() for x in grouped[1].split(",")} - {"le"} if grouped else set()
            if not result or not all(labels <= set(r["metric"]) for r in result):
                empty.append((title, expr, result[:2]))
        assert not empty, empty
    finally:
        prom.close()


def test_a_drafter_actor_lets_idle_openmp_threads_sleep(metrics_port, monkeypatch):
    """Two engines share the machine's cores: the drafter's spinning OpenMP threads would
    take the verifier's (``engine_env``); the verifier keeps the default; a value the
    operator set is kept."""
    def policy_in_actor(kind: str) -> str:
        probe = ReplicaSpec(kind, "env-probe", functools.partial(os.getenv, "OMP_WAIT_POLICY", "unset"))
        engine = ActorEngine(probe)  # the "engine" is the actor process's value; ``call`` runs its methods
        try:
            return engine.call(Apply(str.lower), timeout_s=120).value
        finally:
            engine.kill()

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert policy_in_actor("drafter") == "passive" and policy_in_actor("verifier") == "unset"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert policy_in_actor("drafter") == "active"


def test_verifier_lost_fails_after_the_retry_budget(metrics_port):
    """Its own stack: killing the module stack's only verifier would break every test after it."""
    with _served(drafters=1) as (orch, client, _):
        ray.kill(orch.verifiers.replicas[0].actor, no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(UnavailableError, match="retry budget"):
            _tokens(client, [0, 3, 5], max_new_tokens=8)
        # the budget is FAST.verifier_wait_s = 2 s; the margin is for a loaded 2-core machine
        assert time.monotonic() - t0 < 20


def test_chunk_stats_carry_taps_gated_rounds_over_the_wire_and_into_metrics():
    from orchestrator.metrics import Metrics
    from orchestrator.pb import chunk_from_pb
    from orchestrator.requests import ChunkStats, StreamChunk

    chunk = StreamChunk((5,), "x", ChunkStats(0, 0, 0.0, 0.04, 0.0, 0.001, False, True), None)
    assert chunk_from_pb(service.chunk_to_pb(chunk, "r1")).stats == chunk.stats
    metrics = Metrics(export=False)
    metrics.round("taps", 1, 0, 0, {"verify": 0.04}, fallback=False, gated=True)
    assert metrics.tallies["gated"] == 1 and "fallback:ar_round" not in metrics.tallies
    assert "ray_presto_taps_gated_rounds_total" in prometheus_names()
