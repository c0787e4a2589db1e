"""The wire fuzz of issue 18, over all three services at once, and the orchestrator's share
of "every bad input a named answer" (GenerateBatch per item, ALREADY_EXISTS, sampling).

A tiny verifier and drafter served over gRPC in this process; an orchestrator on a local
Ray whose replicas are clients of those same servers (so its traffic and the fuzz's mix).
The fuzz sends random bytes, byte-mutated valid messages and valid messages with hostile
field values (``tests/fuzz_util.py``) to every method, each call with a deadline, and
requires: no UNKNOWN or INTERNAL, no deadline passed (a hang), every server still healthy,
and a greedy generation equal to AR afterwards, directly and through the orchestrator.
The short run is in the default set; ``-m slow`` runs 10,000 calls.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.remote import RemoteDrafter
from orchestrator import service
from orchestrator.actors import remote_spec
from orchestrator.client import OrchestratorClient
from orchestrator.orchestrator import Orchestrator
from orchestrator.pb import make_request
from presto_pb.v1 import (
    common_pb2,
    drafter_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from presto_sd.engine.calls import CloseIdle
from presto_sd.engine.messages import AlreadyExistsError, InvalidArgumentError, LimitExceededError
from presto_sd.loop.faults import FaultPolicy
from presto_sd.loop.generate import GenerationParams, generate
from presto_sd.method.builders import TreeParams
from presto_sd.rpc import wire
from presto_sd.rpc.client import make_channel
from presto_sd.rpc.server import GrpcServer, ServerConfig
from tests import rpc_util
from tests.conftest import hf_greedy, make_engines
from tests.fuzz_util import Tally, mutate, mutate_bytes, send
from verifier_service.remote import RemoteVerifier

FAST = FaultPolicy(drafter_retry_s=0.05, drafter_retry_max_s=0.2, verifier_wait_s=2.0, verifier_retry_s=0.05)
DEFAULTS = GenerationParams(method="marginal", tree=TreeParams(budget=16, depth=8),
                            max_new_tokens=16, faults=FAST)
PROMPT = [0, 3, 5, 7]
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def stack(tiny_target, ray_runtime):
    verifier, drafter = make_engines(tiny_target)
    vs, ds = rpc_util.LocalServer("verifier").start(verifier), rpc_util.LocalServer("drafter").start(drafter)
    orch = Orchestrator.start([remote_spec("drafter", ds.address)], [remote_spec("verifier", vs.address)])
    servicer = service.OrchestratorServicer()
    servicer.defaults = service.ServiceDefaults(DEFAULTS, "tiny-llama")
    front = GrpcServer(ServerConfig(drain_s=0.0, grace_s=0.0), servicer, service.add_to_server,
                       service.SERVICE_NAME)
    address = f"127.0.0.1:{rpc_util.run(front.start())}"
    rpc_util.run(front.attach(orch))
    client = OrchestratorClient(address, timeout_s=60)
    yield {"verifier": vs, "drafter": ds, "orchestrator": address, "orch": orch, "client": client}
    client.close()
    rpc_util.run(front.stop(0))
    orch.shutdown()
    vs.stop()
    ds.stop()


# -- the orchestrator: each bad input its own named answer --------------------------------
def test_generate_batch_answers_each_item_in_its_slot(tiny_target, stack):
    client: OrchestratorClient = stack["client"]
    prompts = [PROMPT, [0, 99], [0, 9]]  # token 99: refused by the verifier, mid-run
    results = client.generate_batch(prompts, max_new_tokens=8)
    assert list(results[0].token_ids) == hf_greedy(tiny_target, PROMPT, 8)
    assert list(results[2].token_ids) == hf_greedy(tiny_target, [0, 9], 8)
    assert isinstance(results[1], InvalidArgumentError) and "token 99 out of range" in str(results[1])
    request = orchestrator_pb2.GenerateBatchRequest(requests=[
        make_request(PROMPT, max_new_tokens=4), make_request(PROMPT, method="nope"),
        make_request(PROMPT, sampling={"temperature": float("nan")}),
        make_request([0, 3], tree={"top_k": 999})])
    stub = orchestrator_pb2_grpc.OrchestratorServiceStub(make_channel(stack["orchestrator"]))
    items = stub.GenerateBatch(request, timeout=60).results
    assert [r.error.code for r in items] == ["", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "INVALID_ARGUMENT"]
    assert list(items[0].token_ids) == hf_greedy(tiny_target, PROMPT, 4) and not items[0].HasField("error")
    assert "method = 'nope'" in items[1].error.message and "sampling.temperature" in items[2].error.message
    too_many = orchestrator_pb2.GenerateBatchRequest(requests=[make_request(PROMPT)] * 257)
    with pytest.raises(grpc.RpcError) as e:
        stub.GenerateBatch(too_many, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-requests 256" in e.value.details()


def test_a_running_request_id_is_already_exists(tiny_target, stack):
    client: OrchestratorClient = stack["client"]
    first = client.generate(PROMPT, max_new_tokens=400, request_id="dup")
    next(first)  # running now
    try:
        with pytest.raises(AlreadyExistsError, match="request_id 'dup'"):
            list(client.generate([0, 9], max_new_tokens=4, request_id="dup"))
        [failed] = client.generate_batch([[0, 9]], max_new_tokens=4, request_id="dup")
        assert isinstance(failed, AlreadyExistsError)
    finally:
        first.close()
    deadline = time.monotonic() + 20
    while stack["orch"].requests and time.monotonic() < deadline:
        time.sleep(0.05)
    tokens = [t for c in client.generate([0, 9], max_new_tokens=4, request_id="dup") for t in c.tokens]
    assert tokens == hf_greedy(tiny_target, [0, 9], 4)  # the id is free again once the first ended


def test_tiny_and_non_finite_sampling_through_the_orchestrator(tiny_target, stack):
    client: OrchestratorClient = stack["client"]
    ar = hf_greedy(tiny_target, PROMPT, 8)
    for sampling in ({"temperature": 1e-300, "seed": 1}, {"temperature": 5e-324}, {"temperature": 1e-45}):
        chunks = client.generate(PROMPT, max_new_tokens=8, sampling=sampling)
        assert [t for c in chunks for t in c.tokens] == ar
    for sampling in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")}):
        with pytest.raises(InvalidArgumentError, match="sampling."):
            list(client.generate(PROMPT, max_new_tokens=4, sampling=sampling))
    with pytest.raises(InvalidArgumentError, match="tree.top_k = 49152"):
        list(client.generate(PROMPT, max_new_tokens=4, tree={"budget": 1024, "top_k": 49152}))
    with pytest.raises(LimitExceededError, match="token_ids.ids"):
        list(client.generate([1] * (wire.MAX_TOKENS + 1), max_new_tokens=4))


def test_undecodable_orchestrator_requests_are_invalid_argument(stack):
    channel = make_channel(stack["orchestrator"])
    prefix = "/presto.v1.OrchestratorService/"
    for name, streaming in (("Generate", True), ("GenerateBatch", False), ("Info", False)):
        for payload in (b"\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05ab"):
            code, details = send(channel, prefix + name, payload, streaming, 10)
            assert code == "INVALID_ARGUMENT" and "parsing" in details, (name, payload, code, details)
    channel.close()


# -- the fuzz -------------------------------------------------------------------------------
def _live(stack) -> dict:
    """A session open on both engines, and a valid request for every method around it."""
    vs, ds = stack["verifier"], stack["drafter"]
    vstub = verifier_pb2_grpc.VerifierServiceStub(make_channel(vs.address))
    pre = vstub.Prefill(verifier_pb2.VerifierPrefillRequest(session_id="fz-live", token_ids=PROMPT,
                                                             restart=True), timeout=10)  # the fuzz reopens it
    delta = pre.delta
    dchannel = make_channel(ds.address)
    dchannel.unary_unary("/presto.v1.DrafterService/Prefill")(
        drafter_pb2.DrafterPrefillRequest(session_id="fz-live", delta=delta, restart=True)
        .SerializeToString(), timeout=10)
    dchannel.close()
    ref = common_pb2.SessionRef(session_id="fz-live", base=pre.base)
    tree = common_pb2.TokenTree(tokens=[pre.anchor, 1, 2], parents=[-1, 0, 1])
    verify = verifier_pb2.VerifyRequest(session=ref, tree=tree)
    commit_delta = common_pb2.FeatureDelta(start=pre.base, tokens=[pre.anchor],
                                           features=common_pb2.Tensor(dtype="float32", shape=[1, 64],
                                                                      data=b"\0" * 256))
    generate_request = make_request(PROMPT, method="marginal", max_new_tokens=4)
    draft_params = common_pb2.TreeParams(method="marginal", budget=8, depth=4)
    return {
        ("verifier", "Prefill"): verifier_pb2.VerifierPrefillRequest(session_id="fz-p", token_ids=PROMPT,
                                                                      restart=True),
        ("verifier", "Verify"): verify,
        ("verifier", "VerifyBatch"): verifier_pb2.VerifyBatchRequest(items=[verify]),
        ("verifier", "Step"): verifier_pb2.StepRequest(session=ref, anchor=pre.anchor),
        ("verifier", "Close"): common_pb2.CloseRequest(session_id="fz-p"),
        ("verifier", "Info"): common_pb2.InfoRequest(),
        ("drafter", "Prefill"): drafter_pb2.DrafterPrefillRequest(session_id="fz-p", delta=delta,
                                                                  restart=True),
        ("drafter", "Draft"): drafter_pb2.DraftRequest(session=ref, anchor=pre.anchor, params=draft_params),
        ("drafter", "Commit"): drafter_pb2.CommitRequest(session=ref, delta=commit_delta),
        ("drafter", "Close"): common_pb2.CloseRequest(session_id="fz-p"),
        ("drafter", "Info"): common_pb2.InfoRequest(),
        ("orchestrator", "Generate"): generate_request,
        ("orchestrator", "GenerateBatch"): orchestrator_pb2.GenerateBatchRequest(
            requests=[generate_request, make_request([0, 9], max_new_tokens=3)]),
        ("orchestrator", "Info"): common_pb2.InfoRequest(),
        ("health", "Check"): health_pb2.HealthCheckRequest(),
    }


PATHS = {"verifier": "/presto.v1.VerifierService/", "drafter": "/presto.v1.DrafterService/",
         "orchestrator": "/presto.v1.OrchestratorService/", "health": "/grpc.health.v1.Health/"}
WEIGHTS = {"verifier": 0.42, "drafter": 0.38, "orchestrator": 0.12, "health": 0.08}


def _bounded(msg) -> None:
    """Keep a mutated GenerateBatch quick: a few items, short generations (a batch is read whole)."""
    if isinstance(msg, orchestrator_pb2.GenerateBatchRequest):
        if 4 < len(msg.requests) <= 256:
            del msg.requests[4:]
        for r in msg.requests:
            if not 0 < r.max_new_tokens <= 16:
                r.max_new_tokens = 8


# the order of the valid round: each template is sent as it is, on a freshly opened live
# session, so every one must be OK (a Prefill before the Close of its session)
VALID_ORDER = [("verifier", "Info"), ("verifier", "Prefill"), ("verifier", "Close"), ("verifier", "Verify"),
               ("verifier", "Step"), ("verifier", "VerifyBatch"), ("drafter", "Info"), ("drafter", "Prefill"),
               ("drafter", "Close"), ("drafter", "Draft"), ("drafter", "Commit"), ("orchestrator", "Info"),
               ("orchestrator", "Generate"), ("orchestrator", "GenerateBatch"), ("health", "Check")]


def valid_round(stack, channels: dict, deadline_s: float) -> Tally:
    """Every method's template, unmutated: what the fuzz mutates is known to be a valid call."""
    tally = Tally()
    for service_name, method in VALID_ORDER:
        template = _live(stack)[(service_name, method)]
        streaming = (service_name, method) == ("orchestrator", "Generate")
        code, details = send(channels[service_name], PATHS[service_name] + method,
                             template.SerializeToString(), streaming, deadline_s)
        tally.add(service_name, method, code, details, b"")
    return tally


def run_fuzz(stack, calls: int, seed: int, deadline_s: float = 30.0) -> tuple[Tally, float]:
    rng = random.Random(seed)
    channels = {k: make_channel(stack[k].address if k in ("verifier", "drafter") else stack["orchestrator"])
                for k in ("verifier", "drafter", "orchestrator")}
    channels["health"] = make_channel(stack["verifier"].address)
    t0 = time.perf_counter()
    valid = valid_round(stack, channels, deadline_s)
    not_ok = sorted((m, c) for (sv, m, c), n in valid.by_method.items() if c != "OK")
    assert not not_ok and set(VALID_ORDER) == set(_live(stack)), not_ok  # the templates are calls that work
    tally = valid
    templates = _live(stack)
    by_service = {s: [k for k in templates if k[0] == s] for s in PATHS}
    for i in range(calls):
        if i and i % 50 == 0:
            templates = _live(stack)  # the live session moved on (or was closed): open it again
        service_name = rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
        key = rng.choice(by_service[service_name])
        template, roll = templates[key], rng.random()
        if roll < 0.2:
            payload = rng.randbytes(rng.randint(0, 200))
        elif roll < 0.4:
            payload = mutate_bytes(template.SerializeToString(), rng)
        else:
            msg = type(template)()
            msg.CopyFrom(template)
            if roll < 0.95:
                try:
                    mutate(msg, rng)
                except (ValueError, TypeError, OverflowError):
                    pass  # a value protobuf itself refuses to hold: the message as far as it got
            _bounded(msg)
            payload = msg.SerializeToString()
        streaming = key == ("orchestrator", "Generate")
        path = PATHS[service_name] + key[1]
        code, details = send(channels[service_name], path, payload, streaming, deadline_s)
        tally.add(service_name, key[1], code, details, payload)
    for c in channels.values():
        c.close()
    return tally, time.perf_counter() - t0


def _after_the_fuzz(tiny_target, stack) -> None:
    """Every server healthy; no request left; greedy output equal to AR, directly and through
    the orchestrator (the fuzz's sessions closed first: they may fill the session caps)."""
    for address in (stack["verifier"].address, stack["drafter"].address, stack["orchestrator"]):
        stub = health_pb2_grpc.HealthStub(make_channel(address))
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
    orch, deadline = stack["orch"], time.monotonic() + 30
    while orch.requests and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not orch.requests
    for kind in ("verifier", "drafter"):
        rpc_util.run(stack[kind].server.servicer.run(None, CloseIdle(0.0)))
    ar = hf_greedy(tiny_target, PROMPT, 16)
    assert [t for c in stack["client"].generate(PROMPT, max_new_tokens=16) for t in c.tokens] == ar
    remote_v, remote_d = RemoteVerifier(stack["verifier"].address), RemoteDrafter(stack["drafter"].address)
    params = GenerationParams(method="presto-beam", tree=TreeParams(budget=16, depth=8),
                              max_new_tokens=16)
    assert generate(remote_v, remote_d, PROMPT, params).token_ids == ar
    remote_v.shutdown()
    remote_d.shutdown()


def _report(name: str, tally: Tally, wall_s: float) -> None:
    summary = {"fuzz": name, "calls": tally.calls, "wall_s": round(wall_s, 1),
               "codes": dict(sorted(tally.codes.items()))}
    print(json.dumps(summary))
    out = os.environ.get("PRESTO_FUZZ_REPORT")  # a file to keep the numbers in
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(summary) + "\n")


def _assert_fuzz_rule(tally: Tally) -> None:
    """No code outside the named ones, and every method answered OK past the valid round:
    a fuzz whose calls all failed to parse would pass the first rule alone."""
    assert not tally.bad, tally.bad[:5]
    silent = [key for key in VALID_ORDER if tally.ok(*key) < 2]
    assert not silent, (silent, dict(tally.by_method))


def test_short_fuzz_of_all_three_services(tiny_target, stack):
    tally, wall_s = run_fuzz(stack, calls=600, seed=18)
    _report("short", tally, wall_s)
    _assert_fuzz_rule(tally)
    _after_the_fuzz(tiny_target, stack)


@pytest.mark.slow
def test_fuzz_of_ten_thousand_calls(tiny_target, stack):
    tally, wall_s = run_fuzz(stack, calls=10_000, seed=1018)
    _report("slow", tally, wall_s)
    _assert_fuzz_rule(tally)
    _after_the_fuzz(tiny_target, stack)


def test_health_answers_while_the_fuzz_runs(stack):
    """A second client fuzzes while health checks are timed: none waits a second."""
    done = threading.Event()
    worst: list[float] = []
    failures: list[BaseException | str] = []  # a thread's assert only warns: carried out here

    def probe() -> None:
        stub = health_pb2_grpc.HealthStub(make_channel(stack["verifier"].address))
        while not done.is_set():
            t0 = time.perf_counter()
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            except grpc.RpcError as e:
                failures.append(e)
                return
            if status != SERVING:
                failures.append(f"health status {status}")
                return
            worst.append(time.perf_counter() - t0)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        tally, _ = run_fuzz(stack, calls=100, seed=7)
    finally:
        done.set()
        prober.join()
    assert not failures, failures
    assert not tally.bad, tally.bad[:5]
    assert worst and max(worst) < 1.0, max(worst)
