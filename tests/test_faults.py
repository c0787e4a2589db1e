"""The loop's fault handling without gRPC: engines that go away and come back on cue."""

from __future__ import annotations

import pytest

from presto_sd.engine.messages import DrafterUnavailableError, LimitExceededError, VerifierUnavailableError
from presto_sd.engine.verifier import PrefillCall
from presto_sd.loop.faults import FaultPolicy
from presto_sd.loop.generate import GenerationParams, stream_generate
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import TreeParams
from tests.conftest import hf_greedy, make_engines

PROMPT = [0, 3, 5, 7]
NOW = FaultPolicy(drafter_retry_s=0.0, drafter_retry_max_s=0.0, verifier_wait_s=5.0, verifier_retry_s=0.0)


class Flaky:
    """Proxy: while ``down`` (or for the next ``fail_next`` calls) calls raise ``error``."""

    def __init__(self, inner, error: type[Exception]) -> None:
        self.inner, self.error, self.down, self.fail_next = inner, error, False, 0
        self.calls: dict[str, list] = {}  # name -> the args of each call

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name in ("info", "anchor"):
            return attr

        def call(*args, **kwargs):
            self.calls.setdefault(name, []).append((args, kwargs))
            if name != "close" and (self.down or self.fail_next > 0):
                self.fail_next = max(0, self.fail_next - 1)
                raise self.error(f"{name}: down")
            return attr(*args, **kwargs)

        return call

    def restart(self) -> None:
        """Sessions lost, as in a new process."""
        self.inner.sessions.clear()


def _prefills(verifier: Flaky) -> list[PrefillCall]:
    """Every prefill the verifier was sent: alone, or as an item of a batch (the step's forward)."""
    out = [PrefillCall(a[0], tuple(a[1]), *a[2:], **kw) for a, kw in verifier.calls.get("prefill", [])]
    for (calls,), _ in verifier.calls.get("verify_batch", []):
        out.extend(c for c in calls if isinstance(c, PrefillCall))
    return out


def _params(n: int, **kw) -> GenerationParams:
    return GenerationParams(method="marginal", tree=TreeParams(budget=16, depth=8),
                            max_new_tokens=n, faults=NOW, **kw)


def _drive(verifier, drafter, n: int, events: dict, **kw):
    """Run the stream; ``events[i]()`` fires after chunk i. Tokens and tree sizes per round."""
    tokens, sizes = [], []
    for i, chunk in enumerate(stream_generate(verifier, drafter, PROMPT, _params(n, **kw))):
        tokens.extend(chunk.tokens)
        sizes.append(chunk.round.tree_size if chunk.round else None)
        if i in events:
            events[i]()
    return tokens, sizes


@pytest.mark.parametrize("restart", [False, True])
def test_drafter_away_then_back(tiny_target, restart):
    verifier, inner = make_engines(tiny_target)
    drafter = Flaky(inner, DrafterUnavailableError)

    def up():
        drafter.down = False
        if restart:
            drafter.restart()

    tokens, sizes = _drive(verifier, drafter, 40, {2: lambda: setattr(drafter, "down", True), 6: up})
    assert tokens == hf_greedy(tiny_target, PROMPT, 40)
    assert all(s == 0 for s in sizes[3:7]) and any(s > 0 for s in sizes[7:])
    # caught up by committing the missed deltas, or by one fresh prefill after a restart
    assert len(drafter.calls["prefill"]) == (2 if restart else 1)
    assert not inner.sessions and not verifier.sessions


def test_full_drafter_means_ar_steps(tiny_target):
    verifier, inner = make_engines(tiny_target)
    drafter = Flaky(inner, LimitExceededError)
    drafter.down = True
    tokens, sizes = _drive(verifier, drafter, 12, {})
    assert tokens == hf_greedy(tiny_target, PROMPT, 12) and all(s in (None, 0) for s in sizes)


@pytest.mark.parametrize("unavailable_calls", [0, 3])
def test_verifier_lost_is_re_prefilled(tiny_target, unavailable_calls):
    inner, drafter = make_engines(tiny_target)
    verifier = Flaky(inner, VerifierUnavailableError)

    def lose():  # a restart: unreachable for a few calls, then back without our session
        verifier.restart()
        verifier.fail_next = unavailable_calls

    tokens, _ = _drive(verifier, drafter, 40, {3: lose, 9: lose})
    assert tokens == hf_greedy(tiny_target, PROMPT, 40)
    re_prefills = _prefills(verifier)[1:]
    assert len(re_prefills) >= 2 and all(c.anchor is not None and c.restart for c in re_prefills)
    assert not inner.sessions


def test_verifier_away_too_long_gives_up(tiny_target):
    inner, drafter = make_engines(tiny_target)
    verifier = Flaky(inner, VerifierUnavailableError)
    policy = FaultPolicy(verifier_wait_s=0.2, verifier_retry_s=0.05)
    params = GenerationParams(method="marginal", max_new_tokens=20, faults=policy)
    stream = stream_generate(verifier, drafter, PROMPT, params)
    next(stream)
    verifier.down = True
    with pytest.raises(VerifierUnavailableError):
        list(stream)


def test_sampling_resumes_with_a_fresh_seed(tiny_target):
    inner, drafter = make_engines(tiny_target)
    verifier = Flaky(inner, VerifierUnavailableError)
    sampling = SamplingParams(temperature=1.0, seed=7)
    tokens, _ = _drive(verifier, drafter, 30, {4: verifier.restart}, sampling=sampling)
    assert len(tokens) == 30
    first, resumed = _prefills(verifier)
    assert first.sampling.seed == 7 and resumed.sampling.seed not in (None, 7)
