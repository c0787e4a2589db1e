"""The engines the orchestrator calls: a drafter or a verifier replica each (docs/design.md §3).

An in-process engine (``load_local``: the models loaded there) lives in a Ray actor, in
its own process, built from a picklable factory; the actor runs one call at a time (the
engines are not thread-safe). A remote engine (``connect_remote``: a gRPC client of a
server) is called directly from the orchestrator's process (``DirectEngine``): a hop
through an actor would only pickle every feature delta once more on its way to the
server, and the server queues calls itself. Both time each call and hand refusals back as
values (``Outcome.error``) so the driver re-raises the engine's own named error.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from presto_sd.engine.calls import BATCHED, EngineCall
from presto_sd.engine.messages import EngineError
from presto_sd.method.cost_model import RollingMedian
from presto_sd.rpc.client import ClientConfig
from presto_sd.rpc.errors import RemoteError

KINDS = ("drafter", "verifier")


@dataclass(frozen=True)
class Outcome:
    value: Any  # the engine method's return value (None on error)
    error: EngineError | None  # the refusal, as the engine raised it
    busy_s: float  # seconds the engine spent on the call


@dataclass(frozen=True)
class EngineStats:
    busy_s: float  # total seconds inside engine calls since the actor started
    calls: int
    uptime_s: float
    sessions: int | None  # open sessions (in-process engines only)


class EngineActor:
    """One engine, and ``call`` to run an engine call on it (``presto_sd.engine.calls``): in
    a Ray actor process, or (``portable=False``) in this one."""

    def __init__(self, factory: Callable[[], Any], threads: int | None = None, portable: bool = True) -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)  # speed switch at the entry point, per process
        self.engine = factory()
        self.portable = portable  # refusals cross a process boundary: make them picklable
        self.busy_s, self.calls, self.started = 0.0, 0, time.monotonic()

    def call(self, call: EngineCall) -> Outcome:
        keep = _portable if self.portable else _same
        t0 = time.perf_counter()
        try:
            value, error = call.run(self.engine), None
            if isinstance(call, BATCHED):  # per-item refusals travel inside the list
                value = [keep(v) if isinstance(v, EngineError) else v for v in value]
        except EngineError as e:
            value, error = None, keep(e)
        busy = time.perf_counter() - t0
        self.busy_s += busy
        self.calls += 1
        return Outcome(value, error, busy)

    def stats(self) -> EngineStats:
        sessions = getattr(self.engine, "sessions", None)
        return EngineStats(self.busy_s, self.calls, time.monotonic() - self.started,
                           None if sessions is None else len(sessions))


def _same(e: EngineError) -> EngineError:
    return e


def _portable(e: EngineError) -> EngineError:
    """RemoteError's (code, message) constructor does not survive pickling: send its text."""
    if isinstance(e, RemoteError):
        return EngineError(str(e))
    return e


# -- what an actor builds ----------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaSpec:
    kind: str  # "drafter" | "verifier"
    name: str  # the label in metrics and logs: the server address, or "local-<i>"
    factory: Callable[[], Any]  # picklable; runs in the actor's process
    threads: int | None = None  # torch threads in the actor
    num_cpus: float = 0.0  # Ray resources; 0 so that a 2-CPU node still places every actor
    num_gpus: float = 0.0
    max_restarts: int = 0  # Ray restarts a crashed actor this often (its sessions are lost)
    direct: bool = False  # called from the orchestrator's process (a remote engine's client), not an actor

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"replica kind {self.kind!r}: one of {KINDS}")


def _load_local(kind: str, target: str | None, drafter: str | None, dtype: str = "auto",
                decoder: str = "auto", weights: str = "dense") -> Any:
    """The in-process engine, as ``presto-sd serve`` loads it (``dtype``: a ``--dtype`` choice)."""
    from presto_sd.embedded.stack import load_drafter, load_verifier
    from presto_sd.models.loading import parse_dtype

    if kind == "verifier":
        return load_verifier(target, drafter, dtype=parse_dtype(dtype), decoder=decoder, weights=weights)
    return load_drafter(target, drafter, dtype=parse_dtype(dtype))


def _connect_remote(kind: str, address: str, config: ClientConfig) -> Any:
    if kind == "verifier":
        from verifier_service.remote import RemoteVerifier

        return RemoteVerifier(address, config)
    from drafter_service.remote import RemoteDrafter

    return RemoteDrafter(address, config)


def local_spec(kind: str, index: int, target: str | None, drafter: str | None,
               threads: int | None = None, num_gpus: float = 0.0, dtype: str = "auto",
               decoder: str = "auto", weights: str = "dense") -> ReplicaSpec:
    load = functools.partial(_load_local, kind, target, drafter, dtype, decoder, weights)
    return ReplicaSpec(kind, f"local-{index}", load, threads, num_gpus=num_gpus, max_restarts=3)


def remote_spec(kind: str, address: str, config: ClientConfig | None = None) -> ReplicaSpec:
    factory = functools.partial(_connect_remote, kind, address, config or ClientConfig())
    return ReplicaSpec(kind, address, factory, direct=True)


def engine_env(kind: str) -> dict[str, str]:
    """What an engine's process adds to its environment where engines share a machine: the
    drafter's idle OpenMP threads sleep (unless the operator set a policy).

    Each engine has its own OpenMP pool. The drafter runs now and then; its threads
    spinning between calls took the cores the verifier computes on. The verifier runs
    nearly all the time, and sleeping between its forwards' parallel regions made AR
    slower (embedded, 16 streams, 2026-12-01: `ar` 58-61 tokens/s with both sleeping,
    66-72 with only the drafter's; `taps` the same either way; docs/benchmarks.md).
    """
    if kind == "drafter" or "OMP_WAIT_POLICY" in os.environ:
        return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    return {}


class VerifierReplica(EngineActor):
    """A verifier replica's actor: the class name the Ray dashboard lists it under."""


class DrafterReplica(EngineActor):
    """A drafter replica's actor: the class name the Ray dashboard lists it under."""


_ACTOR_CLASSES = {"verifier": VerifierReplica, "drafter": DrafterReplica}
_started = itertools.count()


def actor_name(spec: ReplicaSpec, number: int) -> str:
    """What the Ray dashboard's actors page calls it: kind, replica label, and the how-many-th
    actor this process started (a replaced replica gets a new name; names must be unique)."""
    return f"presto-{spec.kind}-{spec.name}-{number}"


def start_actor(spec: ReplicaSpec) -> ray.actor.ActorHandle:
    """Start the actor (the engine loads in the background; the first call waits for it)."""
    cls = ray.remote(_ACTOR_CLASSES[spec.kind]).options(
        num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_restarts=spec.max_restarts,
        max_concurrency=1, name=actor_name(spec, next(_started)),
        runtime_env={"env_vars": engine_env(spec.kind)},
    )
    return cls.remote(spec.factory, spec.threads)


# -- the two ways the driver calls an engine: the same three methods ---------------------
class ActorEngine:
    """An engine in a Ray actor."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.actor = start_actor(spec)
        self.link = RollingMedian()  # the hop into the actor and back, beyond the engine's work

    def call(self, call: EngineCall, timeout_s: float) -> Outcome:
        t0 = time.perf_counter()
        out: Outcome = ray.get(self.actor.call.remote(call), timeout=timeout_s)
        self.link.observe(time.perf_counter() - t0 - out.busy_s)
        return out

    def stats(self) -> ray.ObjectRef:
        """A reference: the driver gets every replica's at once."""
        return self.actor.stats.remote()

    def kill(self) -> None:
        ray.kill(self.actor)


class DirectEngine:
    """A remote engine's gRPC client, called from this process (its own deadlines bound
    each call; the server queues concurrent ones)."""

    actor = None

    def __init__(self, spec: ReplicaSpec) -> None:
        self.local = EngineActor(spec.factory, portable=False)
        rpc = getattr(self.local.engine, "rpc", None)  # a remote engine's client measures its link
        self.link: RollingMedian = rpc.link if rpc is not None else RollingMedian()

    def call(self, call: EngineCall, timeout_s: float) -> Outcome:
        return self.local.call(call)

    def stats(self) -> EngineStats:
        return self.local.stats()

    def kill(self) -> None:
        shutdown = getattr(self.local.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()  # closes the channel; the server's sessions expire or are closed


def start_engine(spec: ReplicaSpec) -> ActorEngine | DirectEngine:
    return DirectEngine(spec) if spec.direct else ActorEngine(spec)


def engine_stats(engines: list[ActorEngine | DirectEngine]) -> list[EngineStats]:
    stats = [e.stats() for e in engines]
    refs = [s for s in stats if isinstance(s, ray.ObjectRef)]
    got = iter(ray.get(refs))
    return [next(got) if isinstance(s, ray.ObjectRef) else s for s in stats]
