"""``to_pb`` / ``from_pb`` for the orchestrator's own messages (``orchestrator.proto``).

Protobuf and the stream's dataclasses only, so the thin client loads neither Ray nor
torch. A request's conversion into a job (unset fields take the server's defaults) is the
service's (``orchestrator.service.job_from_pb``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrator.requests import ChunkStats, StreamChunk
from presto_pb.v1 import common_pb2
from presto_pb.v1 import orchestrator_pb2 as pb

Prompt = str | Sequence[dict] | Sequence[int]


def make_request(
    prompt: Prompt,
    method: str | None = None,
    tree: dict[str, Any] | None = None,
    sampling: dict[str, Any] | None = None,
    max_new_tokens: int | None = None,
    stop: Sequence[str] = (),
    chat: bool = True,
    request_id: str = "",
    resume_token_ids: Sequence[int] = (),
) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(
        method=method, tree=common_pb2.TreeParams(**(tree or {})),
        sampling=common_pb2.SamplingParams(**(sampling or {})), max_new_tokens=max_new_tokens,
        stop=list(stop), no_chat=not chat, request_id=request_id, resume_token_ids=list(resume_token_ids),
    )
    if isinstance(prompt, str):
        msg.text = prompt
    elif prompt and all(isinstance(m, dict) for m in prompt):
        msg.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in prompt]))
    else:
        msg.token_ids.CopyFrom(pb.TokenIds(ids=list(prompt)))
    return msg


def chunk_from_pb(msg: pb.GenerateChunk) -> StreamChunk:
    stats = None
    if msg.HasField("stats"):
        s = msg.stats
        stats = ChunkStats(s.accepted, s.tree_size, s.draft_s, s.verify_s, s.queue_s, s.transfer_s,
                           s.fallback, s.gated)
    tree = tree_from_pb(msg.tree) if msg.HasField("tree") else None
    return StreamChunk(tuple(msg.token_ids), msg.text, stats, msg.finish_reason or None, tree)


def tree_from_pb(msg: common_pb2.TreeParams) -> dict[str, Any]:
    """The tree parameters a request runs with, as ``generate --json`` reports them."""
    return {"method": msg.method, "budget": msg.budget, "depth": msg.depth, "branching": msg.branching,
            "beam": msg.beam, "rho": msg.rho, "lambdas": list(msg.lambdas)}


def chunk_to_pb(
    chunk: StreamChunk, request_id: str, tree: common_pb2.TreeParams | None = None
) -> pb.GenerateChunk:
    msg = pb.GenerateChunk(token_ids=chunk.tokens, text=chunk.text,
                           finish_reason=chunk.finish_reason or "", request_id=request_id, tree=tree)
    if chunk.stats is not None:
        s = chunk.stats
        msg.stats.CopyFrom(pb.ChunkStats(
            accepted=s.accepted, tree_size=s.tree_size, draft_s=s.draft_s, verify_s=s.verify_s,
            queue_s=s.queue_s, transfer_s=s.transfer_s, fallback=s.fallback, gated=s.gated))
    return msg
