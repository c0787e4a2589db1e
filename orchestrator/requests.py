"""What a generation request is and what its stream carries, on the orchestrator's side.

Plain dataclasses with no Ray, torch or gRPC in them: the thin client
(``orchestrator.client``) and the Ray driver (``orchestrator.orchestrator``) share them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a job is built where the loop is loaded; the client never builds one
    from presto_sd.loop.generate import GenerationParams


def _new_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class GenerateJob:
    """A request: its ``request_id`` is the caller's label, unique among the requests its
    principal runs; the engines know it only by ``session_id``, minted here (128 random
    bits, never the client's choice)."""

    prompt_ids: tuple[int, ...]
    params: GenerationParams
    request_id: str = field(default_factory=_new_id)
    principal: str = "anonymous"  # who sent it (presto_sd.rpc.principals)
    session_id: str = field(default_factory=_new_id)
    resume: tuple[int, ...] = ()  # output a client already received (a broken stream's)

    @property
    def key(self) -> str:
        """Its place among the running requests: request ids are per principal."""
        return f"{self.principal}/{self.request_id}"


@dataclass(frozen=True)
class ChunkStats:
    accepted: int  # draft tokens accepted this round (tau counts these + 1)
    tree_size: int  # draft nodes verified, root excluded
    draft_s: float  # drafter engine time in the round (draft + commit)
    verify_s: float  # verifier engine time of the batch the round was in
    queue_s: float  # waiting for the verifier replica to be free
    transfer_s: float  # the rest of the round's wall time: Ray / gRPC transport, routing
    fallback: bool = False  # a plain AR step: the drafter could not give a tree
    gated: bool = False  # a plain AR step: taps's draft gate was shut


@dataclass(frozen=True)
class StreamChunk:
    tokens: tuple[int, ...]
    text: str  # the text these tokens add ("" without a tokenizer)
    stats: ChunkStats | None  # None for the prefill's first token
    finish_reason: str | None = None  # on the last chunk: "eos" | "stop" | "length"
    tree: dict | None = None  # on the first chunk from a server: the request's tree parameters
