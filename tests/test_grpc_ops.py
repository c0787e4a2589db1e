"""Operating the services: health and drain, deadlines, TLS and tokens, the TTL, and
faults mid-generation (a drafter killed or slow, a verifier restarted): output == AR."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.remote import RemoteDrafter
from presto_sd.embedded.dflash_drafter import DFlashDrafter
from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.engine.messages import (
    DrafterUnavailableError,
    FeatureDelta,
    SessionNotFoundError,
    UnauthenticatedError,
    VerifierUnavailableError,
    session_tag,
)
from presto_sd.loop.faults import FaultPolicy
from presto_sd.loop.generate import GenerationParams, stream_generate
from presto_sd.method.builders import TreeParams
from presto_sd.rpc.client import ClientConfig, make_channel
from presto_sd.rpc.server import NOT_SERVING, SERVING, ServerConfig
from tests.conftest import hf_greedy, make_engines, tiny_drafter_model
from tests.rpc_util import LocalServer, make_pki, run, spawn, submit, wait_for
from verifier_service.remote import RemoteVerifier

PROMPT = [0, 3, 5, 7]
FAST_RETRY = FaultPolicy(drafter_retry_s=0.02, drafter_retry_max_s=0.1, verifier_retry_s=0.05)


def _verifier(target) -> HFVerifier:
    return HFVerifier(target, (0, 2), name="tiny-llama")


def _drafter(target) -> DFlashDrafter:
    return make_engines(target, tiny_drafter_model(target))[1]  # same seed: same weights


def _health(address: str, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(make_channel(address))
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _until(condition, what: str, timeout_s: float = 20.0) -> None:
    """Wait for ``condition()`` (the event a test needs), not for a guessed number of seconds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


# -- health, reflection, drain ----------------------------------------------------------
def test_health_not_serving_before_load_and_while_draining(tiny_target):
    # a drain far longer than the test: "still answering while draining" cannot race its end;
    # the test ends the drain itself below
    server = LocalServer("verifier", ServerConfig(drain_s=600.0, grace_s=0.0)).start()  # no engine yet
    remote = RemoteVerifier(server.address, timeout_s=5)
    drained = False
    try:
        assert _health(server.address) == _health(server.address, "presto.v1.VerifierService") == NOT_SERVING
        with pytest.raises(VerifierUnavailableError, match="still loading"):
            remote.prefill("s", [1, 2])
        server.attach(_verifier(tiny_target))
        assert _health(server.address) == SERVING
        pre = remote.prefill("s", [1, 2])

        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase,
        )
        services = ProtoReflectionDescriptorDatabase(make_channel(server.address)).get_services()
        assert "presto.v1.VerifierService" in services and "grpc.health.v1.Health" in services

        draining = submit(server.server.drain())
        _until(lambda: _health(server.address) == NOT_SERVING, "NOT_SERVING once draining")
        assert remote.step("s", 2, pre.anchor).base == 3  # still answering while the balancers move away
        assert not draining.done()
        # end the drain now: the same drain, its wait cut to 0, stops the server
        draining.cancel()
        server.server.config = replace(server.server.config, drain_s=0.0)
        run(server.server.drain())
        drained = True
        with pytest.raises(VerifierUnavailableError):
            remote.step("s", 3, 0)
    finally:
        remote.shutdown()
        if not drained:
            server.stop()


def test_idle_sessions_expire(tiny_target):
    server = LocalServer("verifier", ServerConfig(session_ttl_s=0.2, drain_s=0, grace_s=0))
    engine = _verifier(tiny_target)
    server.start(engine)
    remote = RemoteVerifier(server.address, timeout_s=5)
    try:
        remote.prefill("idle", [1, 2])
        _until(lambda: "anonymous/idle" not in engine.sessions, "the reaper closes the idle session")
        with pytest.raises(SessionNotFoundError, match=session_tag("anonymous/idle")):
            remote.step("idle", 2, 0)
    finally:
        remote.shutdown()
        server.stop()


# -- deadlines --------------------------------------------------------------------------
class GatedDrafter:
    """Proxy: while ``gate`` is shut, a draft (alone or batched) waits for it on the engine
    thread (a slow drafter whose slowness the test controls); it counts drafts in flight and
    commits run."""

    def __init__(self, inner) -> None:
        self.inner, self.gate = inner, threading.Event()
        self.gate.set()
        self.in_flight, self.commits = 0, 0
        self._lock = threading.Lock()

    def _gated(self, method: str, *args):
        with self._lock:
            self.in_flight += 1
        try:
            self.gate.wait(timeout=60)
            return getattr(self.inner, method)(*args)
        finally:
            with self._lock:
                self.in_flight -= 1

    def draft(self, *args):
        return self._gated("draft", *args)

    def commit_and_draft(self, *args):
        return self._gated("commit_and_draft", *args)

    def draft_batch(self, *args):
        return self._gated("draft_batch", *args)

    def commit(self, *args):
        self.commits += 1
        return self.inner.commit(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_deadline_exceeded_is_reported_not_hung_and_not_run_late(tiny_target):
    inner = _drafter(tiny_target)
    slow = GatedDrafter(inner)
    server = LocalServer("drafter").start(slow)
    remote = RemoteDrafter(server.address, timeout_s=1.0)
    width = len(inner.config.target_layer_ids) * inner.config.hidden_size
    try:
        import torch

        remote.prefill("d", FeatureDelta(0, (1, 2), torch.zeros(2, width)))
        slow.gate.clear()  # the engine's next draft does not finish until the test says so
        with pytest.raises(DrafterUnavailableError, match="DEADLINE_EXCEEDED"):
            remote.draft("d", 3, 2, "linear", TreeParams())
        assert slow.in_flight == 1  # reported at the deadline, while the engine is still busy
        # a commit queued behind the slow draft misses its deadline: it must not run later
        remote.timeout_s = 0.2
        with pytest.raises(DrafterUnavailableError, match="DEADLINE_EXCEEDED"):
            remote.commit("d", FeatureDelta(2, (3,), torch.zeros(1, width)))
        slow.gate.set()
        remote.timeout_s = 10.0
        # queued behind both: when it answers, the expired commit has had its turn and skipped
        # it (had it run, the session would be at 3 and this commit at base 2 refused)
        assert remote.commit("d", FeatureDelta(2, (3,), torch.zeros(1, width))) == 3
        assert slow.commits == 1 and inner.sessions["anonymous/d"].base == 3  # keyed by principal
    finally:
        slow.gate.set()
        remote.shutdown()
        server.stop()


# -- TLS and tokens ---------------------------------------------------------------------
def test_tls_and_mutual_tls(tmp_path, tiny_target):
    pki = make_pki(tmp_path)
    engine = _verifier(tiny_target)
    tls = ServerConfig(tls_cert=pki["server.pem"], tls_key=pki["server.key"], drain_s=0, grace_s=0)
    server = LocalServer("verifier", tls).start(engine)
    try:
        assert RemoteVerifier(server.address, ClientConfig(tls_ca=pki["ca.pem"])).info().vocab_size == 16
        for wrong in (ClientConfig(tls_ca=pki["other_ca.pem"]), ClientConfig()):  # untrusted; plaintext
            with pytest.raises(VerifierUnavailableError):
                RemoteVerifier(server.address, wrong, timeout_s=5).info()
    finally:
        server.stop()
    mtls = LocalServer("verifier", ServerConfig(
        tls_cert=pki["server.pem"], tls_key=pki["server.key"], tls_client_ca=pki["ca.pem"], drain_s=0,
    )).start(engine)
    try:
        with_cert = ClientConfig(tls_ca=pki["ca.pem"], tls_cert=pki["client.pem"], tls_key=pki["client.key"])
        assert RemoteVerifier(mtls.address, with_cert).info().vocab_size == 16
        with pytest.raises(VerifierUnavailableError):
            RemoteVerifier(mtls.address, ClientConfig(tls_ca=pki["ca.pem"]), timeout_s=5).info()
    finally:
        mtls.stop()


def test_token_auth(tiny_target):
    config = ServerConfig(auth_token="s3cret-token", drain_s=0, grace_s=0)
    server = LocalServer("verifier", config).start(_verifier(tiny_target))
    try:
        assert RemoteVerifier(server.address, ClientConfig(auth_token="s3cret-token")).info().vocab_size == 16
        for wrong in (ClientConfig(auth_token="guess"), ClientConfig()):
            with pytest.raises(UnauthenticatedError, match="bearer token"):
                RemoteVerifier(server.address, wrong).info()
        assert _health(server.address) == SERVING  # probes need no token
    finally:
        server.stop()


# -- faults mid-generation --------------------------------------------------------------
def _servers(target, drafter_engine=None) -> tuple[LocalServer, LocalServer]:
    drafter_engine = drafter_engine or _drafter(target)
    return LocalServer("verifier").start(_verifier(target)), LocalServer("drafter").start(drafter_engine)


def _params(n: int) -> GenerationParams:
    return GenerationParams(method="marginal", tree=TreeParams(budget=16, depth=8),
                            max_new_tokens=n, faults=FAST_RETRY)


def test_drafter_killed_mid_generation_then_back(tiny_target):
    vs, ds = _servers(tiny_target)
    remote_v, remote_d = RemoteVerifier(vs.address), RemoteDrafter(ds.address, timeout_s=2)
    tokens, rounds, phase = [], {"up": [], "down": [], "back": []}, "up"
    try:
        for i, chunk in enumerate(stream_generate(remote_v, remote_d, PROMPT, _params(48))):
            tokens.extend(chunk.tokens)
            if chunk.round is not None:
                rounds[phase].append(chunk.round.tree_size)
            if i == 3:
                ds.stop()
                phase = "down"
            elif i == 9:
                ds.start(_drafter(tiny_target))  # a new process: our session is gone there
                grpc.channel_ready_future(remote_d.rpc.channel).result(timeout=10)
                phase = "back"
        assert tokens == hf_greedy(tiny_target, PROMPT, 48)
        assert all(s > 0 for s in rounds["up"]) and rounds["down"] and all(s == 0 for s in rounds["down"])
        assert any(s > 0 for s in rounds["back"])  # speculation resumed on the re-prefilled drafter
    finally:
        remote_v.shutdown()
        remote_d.shutdown()
        vs.stop()
        ds.stop()


def test_slow_drafter_falls_back_to_ar_steps(tiny_target):
    slow = GatedDrafter(_drafter(tiny_target))
    slow.gate.clear()  # every draft outlives its deadline until the gate opens
    vs, ds = _servers(tiny_target, slow)
    remote_v, remote_d = RemoteVerifier(vs.address), RemoteDrafter(ds.address, timeout_s=0.1)
    tokens, early, late = [], [], []
    try:
        for i, chunk in enumerate(stream_generate(remote_v, remote_d, PROMPT, _params(24))):
            tokens.extend(chunk.tokens)
            if chunk.round is not None:
                (late if i > 4 else early).append(chunk.round)
            if i == 4:  # the drafter is fast again: let the stuck drafts finish, give it time
                slow.gate.set()
                _until(lambda: slow.in_flight == 0, "the stuck drafts finish")
                remote_d.timeout_s = 10.0
        assert tokens == hf_greedy(tiny_target, PROMPT, 24)
        assert early and all(r.tree_size == 0 for r in early) and any(r.fallback for r in early)
        assert any(r.tree_size > 0 for r in late)
    finally:
        slow.gate.set()
        remote_v.shutdown()
        remote_d.shutdown()
        vs.stop()
        ds.stop()


def test_verifier_restarted_mid_generation(tiny_target):
    vs, ds = _servers(tiny_target)
    remote_v, remote_d = RemoteVerifier(vs.address, timeout_s=5), RemoteDrafter(ds.address)
    tokens, restarted = [], _verifier(tiny_target)
    try:
        for i, chunk in enumerate(stream_generate(remote_v, remote_d, PROMPT, _params(40))):
            tokens.extend(chunk.tokens)
            if i == 4:  # down for half a second, back without our session
                vs.stop()
                threading.Timer(0.5, lambda: vs.start(restarted)).start()
        assert tokens == hf_greedy(tiny_target, PROMPT, 40)
        assert not restarted.sessions  # the re-prefilled session was closed at the end
    finally:
        remote_v.shutdown()
        remote_d.shutdown()
        vs.stop()
        ds.stop()


# -- the real target, through the CLI, with real processes ------------------------------
def _spawn(kind: str) -> tuple[subprocess.Popen, queue.Queue]:
    return spawn(["serve", kind, "--port", "0", "--drafter", "random", "--threads", "1",
                  "--drain-s", "0.5", "--grace-s", "1", "--dtype", "float32"])  # held to HF's fp32 generate


@pytest.mark.smollm2
def test_smollm2_over_grpc_with_real_servers(capsys):
    import torch

    from presto_sd.app import cli, generate
    from presto_sd.models.loading import eos_token_ids, load_target

    servers = {kind: _spawn(kind) for kind in ("verifier", "drafter")}
    try:
        ports = {kind: wait_for(lines, "listening")["port"] for kind, (_, lines) in servers.items()}
        for _, lines in servers.values():
            wait_for(lines, "serving")
        model, tok = load_target(device=torch.device("cpu"), dtype=torch.float32)
        eos = set(eos_token_ids(model, tok))
        text = "Write a Python function that reverses a string."
        prompt = generate.encode_prompt(tok, text, chat=True)
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):]
        capsys.readouterr()
        cli.main(["generate", text, "--max-new-tokens", "32", "--json",
                  "--verifier-addr", f"127.0.0.1:{ports['verifier']}",
                  "--drafter-addr", f"127.0.0.1:{ports['drafter']}"])
        out = json.loads(capsys.readouterr().out)
        expected = ref.tolist()
        cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
        assert out["token_ids"] == expected[:cut] and out["drafter"] == "random"
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, lines in servers.values():
            assert proc.wait(timeout=30) == 0
            wait_for(lines, "stopped", timeout=5)


def test_an_engine_server_computes_on_one_thread():
    """The engine loads and runs on its own thread with the process's torch threads; every
    other thread computes single-threaded (one OpenMP pool: ``EngineHost.own_compute``),
    also after the engine's forwards (the decode rows' attention runs on one thread of its
    own, and must not move the process default). In a fresh process: it changes
    process-wide settings."""
    code = (
        "import asyncio, threading, torch\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from presto_sd.models.invariant import row_attention\n"
        "from presto_sd.rpc.server import EngineHost\n"
        "torch.set_num_threads(2)\n"
        "host = EngineHost('verifier')\n"
        "host.own_compute()\n"
        "def load():\n"
        "    q, k = torch.randn(4, 3, 3, 64), torch.randn(4, 3, 64, 64)\n"
        "    row_attention(q, k, k, torch.ones(4, 1, 64, dtype=torch.bool), 0.125, 'sdpa')\n"
        "    return threading.current_thread().name, torch.get_num_threads()\n"
        "name, engine_threads = asyncio.run(host.load(load))\n"
        "later = ThreadPoolExecutor(1).submit(torch.get_num_threads).result()\n"
        "print(name.split('_')[0], engine_threads, torch.get_num_threads(), later)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["verifier-engine", "2", "1", "1"]
