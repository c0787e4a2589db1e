"""The two services over real gRPC on loopback: losslessness, bad input, fuzz, limits."""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from drafter_service.remote import RemoteDrafter
from presto_pb.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from presto_sd.engine.messages import EngineError, FeatureDelta, InvalidArgumentError, session_tag
from presto_sd.loop.generate import GenerationParams, generate
from presto_sd.method.builders import TreeParams
from presto_sd.rpc import wire
from presto_sd.rpc.client import make_channel
from tests.conftest import hf_greedy, make_engines
from tests.rpc_util import LocalServer
from verifier_service.remote import RemoteVerifier

METHODS = ["linear", "marginal", "presto-beam", "presto-best-first"]
PROMPTS = [[0, 3, 5, 7], [0, 9]]
CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def stack(tiny_target):
    verifier, drafter = make_engines(tiny_target)
    vs, ds = LocalServer("verifier").start(verifier), LocalServer("drafter").start(drafter)
    remote_v, remote_d = RemoteVerifier(vs.address), RemoteDrafter(ds.address)
    yield verifier, drafter, remote_v, remote_d, vs, ds
    remote_v.shutdown()
    remote_d.shutdown()
    vs.stop()
    ds.stop()


def _params(method: str, n: int, **tree) -> GenerationParams:
    return GenerationParams(method=method, tree=TreeParams(**tree), max_new_tokens=n)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_over_grpc_equals_embedded_equals_ar(tiny_target, stack, method):
    verifier, drafter, remote_v, remote_d, _, _ = stack
    local_v, local_d = make_engines(tiny_target)
    before = set(verifier.sessions), set(drafter.sessions)  # other tests' sessions on the shared servers
    for prompt in PROMPTS:
        ar = hf_greedy(tiny_target, prompt, 24)
        over_grpc = generate(remote_v, remote_d, prompt, _params(method, 24, budget=16, depth=8))
        embedded = generate(local_v, local_d, prompt, _params(method, 24, budget=16, depth=8))
        assert over_grpc.token_ids == embedded.token_ids == ar, (method, prompt)
        assert [r.accepted for r in over_grpc.rounds] == [r.accepted for r in embedded.rounds]
        assert any(r.tree_size > 1 for r in over_grpc.rounds)
    assert (set(verifier.sessions), set(drafter.sessions)) == before  # closed over the wire when done


def test_ar_over_grpc(tiny_target, stack):
    _, _, remote_v, _, _, _ = stack
    res = generate(remote_v, None, PROMPTS[0], GenerationParams(method="ar", max_new_tokens=12))
    assert res.token_ids == hf_greedy(tiny_target, PROMPTS[0], 12)


def test_taps_over_grpc_carries_the_cost_model_and_is_lossless(tiny_target, stack):
    verifier, drafter, remote_v, remote_d, _, _ = stack
    fit = verifier.calibrate_cost()
    assert remote_v.cost_model() == verifier.cost_model() and fit.n_obs > 0
    for prompt in PROMPTS:
        res = generate(remote_v, remote_d, prompt, _params("taps", 24, budget=16, depth=8))
        assert res.token_ids == hf_greedy(tiny_target, prompt, 24)
    assert not verifier.sessions and not drafter.sessions  # calibration's sessions closed too


def test_taps_without_a_cost_model_is_invalid_argument(stack):
    _, _, remote_v, remote_d, _, _ = stack
    pre = remote_v.prefill("no-cost", PROMPTS[0])
    remote_d.prefill("no-cost", pre.delta)
    try:
        with pytest.raises(InvalidArgumentError, match="cost model"):
            remote_d.draft("no-cost", pre.anchor, pre.base, "taps", TreeParams())
    finally:
        remote_v.close("no-cost")
        remote_d.close("no-cost")


def test_info_over_grpc(stack):
    verifier, drafter, remote_v, remote_d, _, _ = stack
    assert remote_v.info(fresh=True) == verifier.info()
    assert remote_d.info() == drafter.info()


# -- bad input: its code and message, and the server goes on serving --------------------
def _call(method, request, code: CODE, needle: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        method(request, timeout=10)
    assert e.value.code() == code and needle in e.value.details(), (e.value.code(), e.value.details())


def _feats(n: int, width: int = 64, dtype=torch.float32) -> common_pb2.Tensor:
    return wire.tensor_to_pb(torch.zeros(n, width, dtype=dtype))


def test_bad_verifier_input_gets_its_code(tiny_target, stack):
    _, _, _, _, vs, _ = stack
    stub = verifier_pb2_grpc.VerifierServiceStub(make_channel(vs.address))
    ok = stub.Prefill(verifier_pb2.VerifierPrefillRequest(session_id="bad-v", token_ids=[0, 3]), timeout=10)
    ref = common_pb2.SessionRef(session_id="bad-v", base=ok.base)
    ar = hf_greedy(tiny_target, [0, 3], 2)
    bad = [
        (stub.Prefill, verifier_pb2.VerifierPrefillRequest(session_id="x"), CODE.INVALID_ARGUMENT,
         "prefill.token_ids: empty"),
        (stub.Prefill, verifier_pb2.VerifierPrefillRequest(session_id="x", token_ids=[99]),
         CODE.INVALID_ARGUMENT, "token 99 out of range"),
        (stub.Prefill, verifier_pb2.VerifierPrefillRequest(session_id="", token_ids=[1]),
         CODE.INVALID_ARGUMENT, "session_id"),
        (stub.Prefill, verifier_pb2.VerifierPrefillRequest(
            session_id="x", token_ids=[1], sampling=common_pb2.SamplingParams(top_p=0.0)),
         CODE.INVALID_ARGUMENT, "sampling.top_p"),
        (stub.Prefill, verifier_pb2.VerifierPrefillRequest(session_id="x", token_ids=[1] * 600),
         CODE.RESOURCE_EXHAUSTED, "max_context"),
        (stub.Step, verifier_pb2.StepRequest(session=common_pb2.SessionRef(session_id="nope", base=1)),
         CODE.NOT_FOUND, f"{session_tag('anonymous/nope')} not found"),  # a hash, never the id
        (stub.Step, verifier_pb2.StepRequest(session=common_pb2.SessionRef(session_id="bad-v", base=7),
                                             anchor=ok.anchor),
         CODE.FAILED_PRECONDITION, "stale base 7"),
        (stub.Verify, verifier_pb2.VerifyRequest(session=ref, tree=common_pb2.TokenTree(
            tokens=[ok.anchor, 1, 2], parents=[-1, 0, 5])), CODE.INVALID_ARGUMENT, "tree.parents[2] = 5"),
        (stub.Verify, verifier_pb2.VerifyRequest(session=ref, tree=common_pb2.TokenTree(
            tokens=[ok.anchor, 1], parents=[-1])), CODE.INVALID_ARGUMENT, "lengths differ"),
        (stub.Verify, verifier_pb2.VerifyRequest(session=ref, tree=common_pb2.TokenTree(
            tokens=[(ok.anchor + 1) % 16], parents=[-1])), CODE.INVALID_ARGUMENT, "tree.tokens[0]"),
        (stub.Verify, verifier_pb2.VerifyRequest(session=ref, tree=common_pb2.TokenTree(
            tokens=[ok.anchor, 77], parents=[-1, 0])), CODE.INVALID_ARGUMENT, "tree.tokens[1] = 77"),
        (stub.Verify, verifier_pb2.VerifyRequest(session=ref, tree=common_pb2.TokenTree(
            tokens=[ok.anchor, 1], parents=[-1, 0], depths=[0, 2])), CODE.INVALID_ARGUMENT, "tree.depths[1]"),
        (stub.Verify, verifier_pb2.VerifyRequest(session=ref, tree=common_pb2.TokenTree(
            tokens=[ok.anchor] + [1] * 1025, parents=[-1] + [0] * 1025)), CODE.RESOURCE_EXHAUSTED,
         "1025 draft nodes exceed the limit 1024"),
        (stub.Verify, verifier_pb2.VerifyRequest(session=ref, tree=common_pb2.TokenTree(
            tokens=[ok.anchor] + [1] * 65, parents=list(range(-1, 65)))), CODE.RESOURCE_EXHAUSTED,
         "depth 65 exceeds the limit 64"),
        (stub.Close, common_pb2.CloseRequest(session_id="nope"), CODE.NOT_FOUND, "not found"),
    ]
    assert ok.anchor == ar[0]
    for i, (method, request, code, needle) in enumerate(bad):
        _call(method, request, code, needle)
        # after each refused call the session it aimed at is intact: a correct Step from where
        # it was gives the AR token (then the session is opened again at that point)
        res = stub.Step(verifier_pb2.StepRequest(session=ref, anchor=ok.anchor), timeout=10)
        assert (res.bonus, res.base, res.delta.start) == (ar[1], ok.base + 1, ok.base), (i, needle)
        again = stub.Prefill(verifier_pb2.VerifierPrefillRequest(session_id="bad-v", token_ids=[0, 3],
                                                                 restart=True), timeout=10)
        assert (again.anchor, again.base) == (ok.anchor, ok.base)
    stub.Close(common_pb2.CloseRequest(session_id="bad-v"), timeout=10)


def test_bad_drafter_input_gets_its_code(stack):
    _, drafter, _, _, _, ds = stack
    stub = drafter_pb2_grpc.DrafterServiceStub(make_channel(ds.address))
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    delta = common_pb2.FeatureDelta(start=0, tokens=[0, 3, 5], features=_feats(3, width))
    stub.Prefill(drafter_pb2.DrafterPrefillRequest(session_id="bad-d", delta=delta), timeout=10)
    ref = common_pb2.SessionRef(session_id="bad-d", base=3)

    def commit(features, start=3, tokens=(7,)):
        return drafter_pb2.CommitRequest(session=ref, delta=common_pb2.FeatureDelta(
            start=start, tokens=tokens, features=features))

    def draft(**params):
        return drafter_pb2.DraftRequest(session=ref, anchor=7, params=common_pb2.TreeParams(**params))

    torn = common_pb2.Tensor(dtype="float32", shape=[1, width], data=b"\0" * 10)
    bad = [
        (stub.Commit, commit(torn), CODE.INVALID_ARGUMENT,
         f"delta.features.data: 10 bytes, expected {4 * width}"),
        (stub.Commit, commit(common_pb2.Tensor(dtype="float8", shape=[1, width])),
         CODE.INVALID_ARGUMENT, "delta.features.dtype"),
        (stub.Commit, commit(_feats(1, width, torch.int64)), CODE.INVALID_ARGUMENT, "floating-point"),
        (stub.Commit, commit(_feats(1, width + 1)), CODE.INVALID_ARGUMENT, "delta.features: width"),
        (stub.Commit, commit(_feats(2, width)), CODE.INVALID_ARGUMENT, "does not match 1 tokens"),
        (stub.Commit, commit(_feats(1, width), start=4), CODE.INVALID_ARGUMENT, "must equal session.base"),
        (stub.Commit, commit(_feats(1, width), tokens=(99,)), CODE.INVALID_ARGUMENT, "token 99"),
        (stub.Draft, draft(method="magic"), CODE.INVALID_ARGUMENT, "tree.method = 'magic'"),
        (stub.Draft, draft(budget=0), CODE.INVALID_ARGUMENT, "tree.budget = 0"),
        (stub.Draft, draft(budget=10**6), CODE.RESOURCE_EXHAUSTED, "tree.budget = 1000000"),
        (stub.Draft, draft(method="presto-beam", rho="oracle"), CODE.INVALID_ARGUMENT, "tree.rho"),
        (stub.Draft, drafter_pb2.DraftRequest(session=common_pb2.SessionRef(session_id="bad-d", base=9)),
         CODE.FAILED_PRECONDITION, "stale base 9"),
        (stub.Draft, drafter_pb2.DraftRequest(session=common_pb2.SessionRef(session_id="zz", base=3)),
         CODE.NOT_FOUND, f"{session_tag('anonymous/zz')} not found"),
        (stub.Prefill, drafter_pb2.DrafterPrefillRequest(session_id="p", delta=common_pb2.FeatureDelta(
            start=2, tokens=[1], features=_feats(1, width))), CODE.INVALID_ARGUMENT, "prefill.delta.start"),
    ]
    twin = drafter_pb2.DrafterPrefillRequest(session_id="twin-d", delta=delta)
    stub.Prefill(twin, timeout=10)  # untouched by the bad calls: what "intact" means
    stub.Commit(drafter_pb2.CommitRequest(session=common_pb2.SessionRef(session_id="twin-d", base=3),
                delta=common_pb2.FeatureDelta(start=3, tokens=(7,), features=_feats(1, width))), timeout=10)
    want = stub.Draft(drafter_pb2.DraftRequest(session=common_pb2.SessionRef(session_id="twin-d", base=4),
                      anchor=2, params=common_pb2.TreeParams(method="marginal", budget=8)), timeout=10)
    for i, (method, request, code, needle) in enumerate(bad):
        _call(method, request, code, needle)
        # after each refused call the session is intact: a correct commit and draft give the
        # twin's tree (then the session is opened again at that point)
        assert stub.Commit(commit(_feats(1, width)), timeout=10).base == 4, (i, needle)
        got = stub.Draft(drafter_pb2.DraftRequest(session=common_pb2.SessionRef(session_id="bad-d", base=4),
                         anchor=2, params=common_pb2.TreeParams(method="marginal", budget=8)), timeout=10)
        assert (list(got.tree.tokens), list(got.tree.parents)) == (list(want.tree.tokens),
                                                                   list(want.tree.parents)), (i, needle)
        stub.Prefill(drafter_pb2.DrafterPrefillRequest(session_id="bad-d", delta=delta, restart=True),
                     timeout=10)
    for sid in ("bad-d", "twin-d"):
        stub.Close(common_pb2.CloseRequest(session_id=sid), timeout=10)


def test_session_cap(tiny_target):
    from presto_sd.embedded.hf_verifier import HFVerifier
    from presto_sd.engine.verifier import VerifierLimits

    server = LocalServer("verifier").start(HFVerifier(tiny_target, (0, 2), VerifierLimits(max_sessions=2)))
    stub = verifier_pb2_grpc.VerifierServiceStub(make_channel(server.address))
    try:
        for sid in ("a", "b"):
            stub.Prefill(verifier_pb2.VerifierPrefillRequest(session_id=sid, token_ids=[1]), timeout=10)
        _call(stub.Prefill, verifier_pb2.VerifierPrefillRequest(session_id="c", token_ids=[1]),
              CODE.RESOURCE_EXHAUSTED, "2 sessions open")
        stub.Close(common_pb2.CloseRequest(session_id="a"), timeout=10)
        stub.Prefill(verifier_pb2.VerifierPrefillRequest(session_id="c", token_ids=[1]), timeout=10)
    finally:
        server.stop()


# -- fuzz: trees and tensors off the wire never crash a server --------------------------
ANY_OK = {CODE.OK, CODE.INVALID_ARGUMENT, CODE.RESOURCE_EXHAUSTED, CODE.FAILED_PRECONDITION}
WIDTH = 64  # the tiny drafter's feature width: 2 target layers x hidden 32
wild = st.one_of(st.integers(-3, 20), st.integers(-(2**31), 2**31 - 1))


@st.composite
def tree_msgs(draw) -> common_pb2.TokenTree:
    """Garbage, or a well-formed tree (root = the anchor) with at most one field broken."""
    if draw(st.booleans()):
        return common_pb2.TokenTree(tokens=draw(st.lists(wild, max_size=12)),
                                    parents=draw(st.lists(wild, max_size=12)),
                                    depths=draw(st.lists(wild, max_size=12)))
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [-1] + [draw(st.integers(0, 15)) for _ in range(1, n)]  # -1: the anchor, filled in later
    msg = common_pb2.TokenTree(tokens=tokens, parents=parents)
    field = draw(st.sampled_from(["", "tokens", "parents", "depths"]))
    if field == "depths":
        msg.depths.extend(draw(st.lists(wild, min_size=n, max_size=n)))
    elif field:
        getattr(msg, field)[draw(st.integers(0, n - 1))] = draw(wild)
    return msg


@st.composite
def feature_msgs(draw, rows: int) -> common_pb2.Tensor:
    """Garbage, or the right shape in a float dtype with arbitrary bytes (NaN, inf too)."""
    if draw(st.booleans()):
        return common_pb2.Tensor(
            dtype=draw(st.sampled_from([*wire.DTYPES, "float8", ""])),
            shape=draw(st.lists(st.one_of(st.integers(-2, 70), st.integers(-(2**62), 2**62)), max_size=4)),
            data=draw(st.binary(max_size=600)),
        )
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16", "float64"]))
    n = rows * WIDTH * wire.DTYPES[dtype].itemsize
    data = draw(st.one_of(st.binary(min_size=n, max_size=n), st.just(b"\0" * n)))
    return common_pb2.Tensor(dtype=dtype, shape=[rows, WIDTH], data=data)


@pytest.fixture(scope="module")
def stubs(stack):
    _, _, _, _, vs, ds = stack
    vchannel, dchannel = make_channel(vs.address), make_channel(ds.address)
    yield verifier_pb2_grpc.VerifierServiceStub(vchannel), drafter_pb2_grpc.DrafterServiceStub(dchannel)
    vchannel.close()
    dchannel.close()


@pytest.fixture(scope="module")
def fuzz_ar(tiny_target) -> list[int]:
    """AR's continuation of the fuzz session's prompt [0, 3] (a tree accepts at most 11)."""
    return hf_greedy(tiny_target, [0, 3], 16)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), tree=tree_msgs(), tokens=st.lists(st.integers(-1, 17), max_size=4))
def test_fuzzed_trees_and_tensors_never_crash_a_server(stubs, fuzz_ar, data, tree, tokens):
    vstub, dstub = stubs
    try:
        _fuzz_example(vstub, dstub, fuzz_ar, data, tree, tokens)
    finally:  # the servers are shared with the module's other tests: leave no session behind
        for stub, session_id in ((vstub, "fuzz"), (dstub, "fuzz"), (dstub, "fuzz2")):
            try:
                stub.Close(common_pb2.CloseRequest(session_id=session_id), timeout=10)
            except grpc.RpcError as e:  # the example's prefill was refused: nothing to close
                assert e.code() == CODE.NOT_FOUND, (e.code(), e.details())


def _fuzz_example(vstub, dstub, fuzz_ar: list[int], data, tree: common_pb2.TokenTree,
                  tokens: list[int]) -> None:
    pre = vstub.Prefill(verifier_pb2.VerifierPrefillRequest(
        session_id="fuzz", token_ids=[0, 3], restart=True), timeout=10)  # each example starts it anew
    dstub.Prefill(drafter_pb2.DrafterPrefillRequest(session_id="fuzz", delta=pre.delta, restart=True),
                  timeout=10)
    if tree.tokens and tree.tokens[0] == -1:
        tree.tokens[0] = pre.anchor
    ref = common_pb2.SessionRef(session_id="fuzz", base=2)
    features = data.draw(feature_msgs(len(tokens)))
    delta = common_pb2.FeatureDelta(start=2, tokens=tokens, features=features)
    calls = [
        (vstub.Verify, verifier_pb2.VerifyRequest(session=ref, tree=tree)),
        (dstub.Commit, drafter_pb2.CommitRequest(session=ref, delta=delta)),
        (dstub.Draft, drafter_pb2.DraftRequest(session=common_pb2.SessionRef(session_id="fuzz", base=2 + len(
            tokens)), anchor=3, params=common_pb2.TreeParams(method="presto-beam", budget=8))),
        (dstub.Prefill, drafter_pb2.DrafterPrefillRequest(session_id="fuzz2", delta=common_pb2.FeatureDelta(
            start=0, tokens=tokens, features=features), restart=True)),
    ]
    base = 2
    for method, request in calls:
        try:
            res = method(request, timeout=10)
            event(f"{method._method.decode()}: OK")
            if method is vstub.Verify:
                base = res.base  # a valid tree: the session moved on, losslessly
        except grpc.RpcError as e:
            event(f"{method._method.decode()}: {e.code().name}")
            assert e.code() in ANY_OK, (e.code(), e.details())
    # whatever was refused changed nothing: a Step from where the session is gives AR's token
    step = vstub.Step(verifier_pb2.StepRequest(session=common_pb2.SessionRef(session_id="fuzz", base=base),
                                               anchor=fuzz_ar[base - 2]), timeout=10)
    assert (step.bonus, step.base) == (fuzz_ar[base - 1], base + 1)
    # both servers still answer well-formed calls (and a whole generation, below)
    assert vstub.Info(common_pb2.InfoRequest(), timeout=10).vocab_size == 16
    assert dstub.Info(common_pb2.InfoRequest(), timeout=10).vocab_size == 16


def test_servers_serve_after_the_fuzz(tiny_target, stack):
    _, _, remote_v, remote_d, _, _ = stack
    res = generate(remote_v, remote_d, PROMPTS[1], _params("marginal", 16, budget=8))
    assert res.token_ids == hf_greedy(tiny_target, PROMPTS[1], 16)


def test_delta_features_travel_exactly(stack):
    _, drafter, _, remote_d, _, _ = stack
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    feats = torch.randn(3, width)
    assert remote_d.prefill("exact", FeatureDelta(0, (1, 2, 3), feats)) == 3
    kv = drafter.sessions["anonymous/exact"].kv  # keyed by principal
    k_remote = [kv.committed(layer)[0].clone() for layer in range(len(kv.keys))]
    drafter.prefill("exact-local", FeatureDelta(0, (1, 2, 3), feats))
    local = drafter.sessions["exact-local"].kv
    assert all(torch.equal(a, local.committed(layer)[0]) for layer, a in enumerate(k_remote))
    remote_d.close("exact")
    drafter.close("exact-local")


def test_a_round_commits_and_drafts_in_one_call(tiny_target, stack):
    """The loop's round sends the commit with the draft: ONE call to the drafter, the same
    tree as a Commit then a Draft, and a refused one (a budget over the limit, a stale
    start) applies nothing."""
    _, drafter, remote_v, remote_d, _, _ = stack
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    prompt, step = torch.randn(3, width), torch.randn(2, width)
    params = TreeParams(budget=8, depth=4)
    for sid in ("one-call", "two-calls"):
        remote_d.prefill(sid, FeatureDelta(0, (1, 2, 3), prompt))
    calls = remote_d.rpc.stats.calls
    one = remote_d.commit_and_draft("one-call", FeatureDelta(3, (4, 5), step), 6, 5, "presto-beam", params)
    assert remote_d.rpc.stats.calls == calls + 1
    remote_d.commit("two-calls", FeatureDelta(3, (4, 5), step))
    two = remote_d.draft("two-calls", 6, 5, "presto-beam", params)
    assert one.tree == two.tree and one.path_scores == pytest.approx(two.path_scores)
    session = drafter.sessions["anonymous/one-call"]
    assert session.base == 5
    over_limit = TreeParams(budget=10_000)
    refused = [(FeatureDelta(5, (6,), step[:1]), 6, over_limit),  # over the drafter's budget limit
               (FeatureDelta(4, (6,), step[:1]), 5, params),  # stale: the session is at 5
               (FeatureDelta(5, (6,), step[:1]), 9, params)]  # base is not the commit's end
    for delta, base, p in refused:
        with pytest.raises(EngineError):
            remote_d.commit_and_draft("one-call", delta, 7, base, "presto-beam", p)
        assert session.base == 5 and len(session.tokens) == 5  # nothing applied
    # the loop over gRPC sends its deltas this way: Commit is never called
    res = generate(remote_v, remote_d, PROMPTS[0], _params("presto-beam", 16, budget=8, depth=4))
    assert res.token_ids == hf_greedy(tiny_target, PROMPTS[0], 16)
    for sid in ("one-call", "two-calls"):
        remote_d.close(sid)


def test_clients_measure_the_link_beyond_the_servers_work(stack):
    """Each server reports its seconds in the call's trailers; a client's round_trip_s is
    the rest (loopback here: well under the engine's own time)."""
    _, _, remote_v, remote_d, _, _ = stack
    pre = remote_v.prefill("link", [1, 2, 3])
    remote_d.prefill("link", pre.delta)  # the drafter's own call: whatever ran before this test
    for _ in range(5):
        remote_v.info(fresh=True)
    assert remote_v.rpc.link.count >= 6
    assert 0.0 < remote_v.round_trip_s() < 0.05
    assert remote_d.rpc.link.count > 0 and remote_d.round_trip_s() < 0.05
    remote_v.close("link")
    remote_d.close("link")
