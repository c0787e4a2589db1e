"""Sessions are owned (issue 18, defect 8): a principal per token, and another principal's
calls never find, alter or close a session (NOT_FOUND, as for one that does not exist)."""

from __future__ import annotations

import logging

import pytest

from drafter_service.remote import RemoteDrafter
from presto_sd.engine.messages import (
    AlreadyExistsError,
    FeatureDelta,
    SessionNotFoundError,
    UnauthenticatedError,
    session_tag,
)
from presto_sd.engine.verifier import VerifyCall
from presto_sd.loop.generate import GenerationParams, stream_generate
from presto_sd.method.builders import TreeParams
from presto_sd.method.tree import TokenTree
from presto_sd.rpc.client import ClientConfig, read_token
from presto_sd.rpc.principals import Principals, parse_tokens
from presto_sd.rpc.server import ServerConfig
from tests.conftest import hf_greedy, make_engines
from tests.rpc_util import LocalServer
from verifier_service.remote import RemoteVerifier

TOKENS = (("alice", "a-token-1"), ("bob", "b-token-2"))
PROMPT = [0, 3, 5, 7, 2, 9, 4]


def test_the_token_file_format(tmp_path):
    assert parse_tokens("# ops\nalice: a-token-1\n\nbob:b-token-2\n") == TOKENS
    assert parse_tokens("just-one-token\n") == (("default", "just-one-token"),)  # the old format
    for bad, needle in (("", "no token"), ("a:x\nbare\n", "line 2"), ("a b:x", "principal name"),
                        ("a:", "empty token"), ("a:x\na:y", "twice"), ("a:x\nb:x", "twice")):
        with pytest.raises(ValueError, match=needle):
            parse_tokens(bad)
    (tmp_path / "client").write_text("alice:a-token-1\n")
    (tmp_path / "bare").write_text("a-token-1\n")
    (tmp_path / "server").write_text("alice:a-token-1\nbob:b-token-2\n")
    assert read_token(str(tmp_path / "client")) == read_token(str(tmp_path / "bare")) == "a-token-1"
    with pytest.raises(ValueError, match="one token"):
        read_token(str(tmp_path / "server"))
    p = Principals(TOKENS)
    assert (p.who("Bearer a-token-1"), p.who("Bearer b-token-2"), p.who("Bearer nope"), p.who("")) == (
        "alice", "bob", None, None)


@pytest.fixture()
def owned(tiny_target):
    verifier, drafter = make_engines(tiny_target)
    config = ServerConfig(auth_tokens=TOKENS, drain_s=0, grace_s=0)
    vs, ds = LocalServer("verifier", config).start(verifier), LocalServer("drafter", config).start(drafter)
    clients = {name: (RemoteVerifier(vs.address, ClientConfig(auth_token=token)),
                      RemoteDrafter(ds.address, ClientConfig(auth_token=token)))
               for name, token in TOKENS}
    yield clients, vs, ds
    for v, d in clients.values():
        v.shutdown()
        d.shutdown()
    vs.stop()
    ds.stop()


def test_another_principal_cannot_read_alter_or_close_a_session(tiny_target, owned, caplog):
    clients, vs, ds = owned
    (av, ad), (bv, bd) = clients["alice"], clients["bob"]
    caplog.set_level(logging.INFO, logger="presto_sd.rpc")
    pre = av.prefill("sess-secret-id", PROMPT)
    ad.prefill("sess-secret-id", pre.delta)
    params = TreeParams(budget=8)
    alice_draft = ad.draft("sess-secret-id", pre.anchor, pre.base, "marginal", params).tree
    root, row = TokenTree.root_only(pre.anchor), FeatureDelta(pre.base, (pre.anchor,), pre.delta.features[:1])
    # bob: the id names nothing of his, whatever he does with it
    for call in (lambda: bv.step("sess-secret-id", pre.base, pre.anchor),
                 lambda: bv.verify("sess-secret-id", pre.base, root),
                 lambda: bv.close("sess-secret-id"),
                 lambda: bd.draft("sess-secret-id", pre.anchor, pre.base, "linear", TreeParams(budget=4)),
                 lambda: bd.commit("sess-secret-id", row),
                 lambda: bd.close("sess-secret-id")):
        with pytest.raises(SessionNotFoundError, match="not found"):
            call()
    batch = bv.verify_batch([VerifyCall("sess-secret-id", pre.base, root)])
    assert isinstance(batch[0], SessionNotFoundError)
    # a same-length prefill of that id by bob opens bob's own session: alice's is untouched
    other = [1, 1, 1, 1, 1, 1, 1]
    bob_pre = bv.prefill("sess-secret-id", other)
    assert bob_pre.anchor == hf_greedy(tiny_target, other, 1)[0]
    bd.prefill("sess-secret-id", bob_pre.delta)
    # alice's session goes on exactly as AR
    out, base, anchor = [pre.anchor], pre.base, pre.anchor
    while len(out) < 8:
        res = av.step("sess-secret-id", base, anchor)
        out.append(res.bonus)
        base, anchor = res.base, res.bonus
    assert out == hf_greedy(tiny_target, PROMPT, 8)
    for server in (vs, ds):  # each engine keeps the two principals' sessions apart
        assert set(server.server.servicer.engine.sessions) == {"alice/sess-secret-id", "bob/sess-secret-id"}
    # alice's drafter session too: her draft is what it was before bob's calls
    again = ad.draft("sess-secret-id", pre.anchor, pre.base, "marginal", params).tree
    assert (again.tokens, again.parents) == (alice_draft.tokens, alice_draft.parents)
    bob_draft = bd.draft("sess-secret-id", bob_pre.anchor, bob_pre.base, "marginal", params).tree
    assert bob_draft.tokens[0] == bob_pre.anchor  # bob's own session, at his own base
    for v, d in ((av, ad), (bv, bd)):
        v.close("sess-secret-id")
        d.close("sess-secret-id")
    assert not ds.server.servicer.engine.sessions
    # the logs name sessions by a hash of their key, never by the id
    lines = [r.getMessage() for r in caplog.records if '"event": "call"' in r.getMessage()]
    assert lines and not any("sess-secret-id" in line for line in lines)
    assert any(session_tag("alice/sess-secret-id") in line for line in lines)


def test_reprefill_of_an_open_session_is_explicit(tiny_target, owned):
    clients, _, _ = owned
    av, ad = clients["alice"]
    pre = av.prefill("s", PROMPT)
    with pytest.raises(AlreadyExistsError, match="already open"):
        av.prefill("s", [1, 1, 1])
    res = av.step("s", pre.base, pre.anchor)  # untouched by the refusal
    assert res.bonus == hf_greedy(tiny_target, PROMPT, 2)[1]
    again = av.prefill("s", [1, 1, 1], restart=True)
    assert again.base == 3 and av.step("s", 3, again.anchor).base == 4
    ad.prefill("s", pre.delta)
    with pytest.raises(AlreadyExistsError):
        ad.prefill("s", pre.delta)
    assert ad.prefill("s", pre.delta, restart=True) == pre.base
    av.close("s")
    ad.close("s")


def test_generation_of_two_principals_with_the_same_ids(tiny_target, owned):
    """Both generate with one session id at once (interleaved): each gets the AR output."""
    clients, _, _ = owned
    params = GenerationParams("marginal", TreeParams(budget=8, depth=6), max_new_tokens=16)
    prompts = {"alice": PROMPT, "bob": [0, 9, 1]}
    streams = {name: stream_generate(*clients[name], prompts[name], params, session_id="shared")
               for name in prompts}
    out = {name: [] for name in prompts}
    live = dict(streams)
    while live:
        for name, stream in list(live.items()):
            chunk = next(stream, None)
            if chunk is None:
                del live[name]
            else:
                out[name].extend(chunk.tokens)
    for name, prompt in prompts.items():
        assert out[name] == hf_greedy(tiny_target, prompt, 16)


def test_a_missing_or_wrong_token_is_unauthenticated(owned):
    _, vs, ds = owned
    for config in (ClientConfig(), ClientConfig(auth_token="guess")):
        with pytest.raises(UnauthenticatedError):
            RemoteVerifier(vs.address, config).info()
        with pytest.raises(UnauthenticatedError):
            RemoteDrafter(ds.address, config).info()


def test_without_tokens_a_client_certificate_is_the_principal(tmp_path, tiny_target):
    from tests.rpc_util import make_pki

    pki = make_pki(tmp_path)
    verifier, _ = make_engines(tiny_target)
    config = ServerConfig(tls_cert=pki["server.pem"], tls_key=pki["server.key"], tls_client_ca=pki["ca.pem"],
                          drain_s=0, grace_s=0)
    server = LocalServer("verifier", config).start(verifier)
    client = RemoteVerifier(server.address, ClientConfig(tls_ca=pki["ca.pem"], tls_cert=pki["client.pem"],
                                                         tls_key=pki["client.key"]))
    try:
        client.prefill("s", PROMPT)
        assert list(verifier.sessions) == ["cert:orchestrator/s"]  # the client cert's CN
    finally:
        client.shutdown()
        server.stop()

