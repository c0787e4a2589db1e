"""Helpers for the orchestrator tests: engines built inside Ray actors, one Ray per module."""

from __future__ import annotations

import functools

from orchestrator.actors import ReplicaSpec


def tiny_engine(kind: str):
    """The tiny target of ``conftest`` and its drafter, built in the actor's own process
    (same seeds, so the same weights as the ``tiny_target`` fixture)."""
    from tests.conftest import make_engines, tiny_llama

    verifier, drafter = make_engines(tiny_llama())
    return verifier if kind == "verifier" else drafter


def tiny_spec(kind: str, index: int = 0) -> ReplicaSpec:
    return ReplicaSpec(kind, f"tiny-{index}", functools.partial(tiny_engine, kind), threads=1)
