"""Helpers for the orchestrator tests: engines built inside Ray actors, one Ray per module."""

from __future__ import annotations

import functools
import queue
import subprocess
from pathlib import Path

from orchestrator.actors import ReplicaSpec
from tests.rpc_util import spawn


def tiny_engine(kind: str):
    """The tiny target of ``conftest`` and its drafter, built in the actor's own process
    (same seeds, so the same weights as the ``tiny_target`` fixture)."""
    from tests.conftest import make_engines, tiny_llama

    verifier, drafter = make_engines(tiny_llama())
    return verifier if kind == "verifier" else drafter


def tiny_spec(kind: str, index: int = 0) -> ReplicaSpec:
    return ReplicaSpec(kind, f"tiny-{index}", functools.partial(tiny_engine, kind), threads=1)


def dir_engine(kind: str, target: str):
    """The engine ``presto-sd serve KIND --target DIR --drafter random --dtype float32`` loads."""
    import torch

    from presto_sd.embedded.stack import load_drafter, load_verifier

    load = load_verifier if kind == "verifier" else load_drafter
    return load(target, "random", dtype=torch.float32)


def dir_spec(kind: str, target: str) -> ReplicaSpec:
    return ReplicaSpec(kind, "dir-0", functools.partial(dir_engine, kind, target), threads=1)


# -- real server processes --------------------------------------------------------------
def spawn_server(kind: str, target: Path) -> tuple[subprocess.Popen, queue.Queue]:
    # fp32: these tests hold the output to transformers' own greedy generate
    return spawn(["serve", kind, "--port", "0", "--target", str(target), "--drafter", "random",
                  "--threads", "1", "--drain-s", "0", "--grace-s", "0", "--dtype", "float32"])


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out
