"""How streams end and go on: the context window (finish "length", never an error) and a
stream resumed from the tokens a client already has. Embedded and over gRPC, on a tiny
target whose window is 48 positions so that reaching it takes a few rounds."""

from __future__ import annotations

import pytest

from drafter_service.remote import RemoteDrafter
from presto_sd.engine.messages import InvalidArgumentError, LimitExceededError
from presto_sd.loop.generate import GenerationParams, generate, stream_generate
from presto_sd.method.builders import TreeParams
from tests.conftest import hf_greedy, make_engines, tiny_llama
from tests.rpc_util import LocalServer
from verifier_service.remote import RemoteVerifier

WINDOW = 48
METHODS = ["ar", "marginal", "presto-beam", "taps"]
PROMPT = [0, *range(1, 16), *range(15, 0, -1), 3, 5]  # 33 tokens: 15 to go


@pytest.fixture(scope="module")
def small_window():
    model = tiny_llama()
    model.config.max_position_embeddings = WINDOW  # the verifier's max_context follows it
    return model


@pytest.fixture(scope="module")
def served(small_window):
    verifier, drafter = make_engines(small_window)
    verifier.calibrate_cost()  # taps over gRPC takes the server's cost model
    vs, ds = LocalServer("verifier").start(verifier), LocalServer("drafter").start(drafter)
    remote = RemoteVerifier(vs.address), RemoteDrafter(ds.address)
    yield verifier, drafter, remote
    for engine in remote:
        engine.shutdown()
    vs.stop()
    ds.stop()


def _params(method: str, n: int = 200) -> GenerationParams:
    return GenerationParams(method=method, tree=TreeParams(budget=16, depth=8), max_new_tokens=n)


def _engines(model, mode: str, served):
    """The engines a run calls, and the in-process engines holding its sessions (the
    embedded ones themselves, or the servers' behind the remote clients)."""
    if mode == "embedded":
        verifier, drafter = make_engines(model)
        return verifier, drafter, (verifier, drafter)
    return (*served[2], served[:2])


def _no_session_left(held) -> None:
    verifier, drafter = held
    assert not verifier.sessions and not drafter.sessions, (list(verifier.sessions), list(drafter.sessions))


@pytest.mark.parametrize("mode", ["embedded", "grpc"])
@pytest.mark.parametrize("method", METHODS)
def test_the_window_ends_the_stream_with_length_and_ar_output(small_window, served, mode, method):
    verifier, drafter, held = _engines(small_window, mode, served)
    for k, prompt in enumerate([PROMPT, *(PROMPT + [1] * (WINDOW - m - len(PROMPT)) for m in (2, 1))]):
        chunks = list(stream_generate(verifier, drafter, prompt, _params(method)))
        tokens = [t for c in chunks for t in c.tokens]
        assert len(prompt) + len(tokens) == WINDOW, (method, len(prompt))
        assert tokens == hf_greedy(small_window, prompt, WINDOW - len(prompt)), (method, len(prompt))
        assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
        if k == 0 and method != "ar":  # speculation ran until the window made it stop
            assert any(c.round is not None and c.round.tree_size > 0 for c in chunks)
    _no_session_left(held)


@pytest.mark.parametrize("mode", ["embedded", "grpc"])
def test_a_prompt_that_fills_the_window_is_refused(small_window, served, mode):
    verifier, drafter, held = _engines(small_window, mode, served)
    with pytest.raises(LimitExceededError, match="max_context"):
        generate(verifier, drafter, [1] * WINDOW, _params("marginal"))
    _no_session_left(held)


@pytest.mark.parametrize("mode", ["embedded", "grpc"])
@pytest.mark.parametrize("method", ["ar", "marginal", "taps"])
def test_a_resumed_stream_is_the_rest_of_the_unbroken_one(small_window, served, mode, method):
    verifier, drafter, held = _engines(small_window, mode, served)
    prompt, n = PROMPT[:10], 30
    whole = generate(verifier, drafter, prompt, _params(method, n))
    assert whole.token_ids == hf_greedy(small_window, prompt, n)
    for cut in (1, 7, n - 1):
        chunks = list(stream_generate(verifier, drafter, prompt, _params(method, n),
                                      resume=whole.token_ids[:cut]))
        assert chunks[0].tokens == () and chunks[0].round is None
        assert [t for c in chunks for t in c.tokens] == whole.token_ids[cut:], (method, cut)
        assert chunks[-1].finish_reason == "length"
    _no_session_left(held)


def test_a_resume_at_the_end_or_past_it(small_window):
    verifier, drafter = make_engines(small_window)
    prompt, n = PROMPT[:10], 12
    whole = generate(verifier, drafter, prompt, _params("marginal", n)).token_ids
    done = list(stream_generate(verifier, drafter, prompt, _params("marginal", n), resume=whole))
    assert [(c.tokens, c.finish_reason) for c in done] == [((), "length")]  # no engine call
    eos = GenerationParams(method="marginal", max_new_tokens=n, stop_token_ids=(whole[3],))
    with pytest.raises(InvalidArgumentError, match="resume_token_ids: 12 tokens"):
        list(stream_generate(verifier, drafter, prompt, eos, resume=whole))
    with pytest.raises(InvalidArgumentError, match="resume_token_ids"):
        list(stream_generate(verifier, drafter, prompt, _params("marginal", n - 1), resume=whole))
    # the whole window already sent: it ends there
    full = hf_greedy(small_window, PROMPT, WINDOW - len(PROMPT))
    at_window = list(stream_generate(verifier, drafter, PROMPT, _params("marginal"), resume=full))
    assert [(c.tokens, c.finish_reason) for c in at_window] == [((), "length")]
    assert not verifier.sessions and not drafter.sessions
