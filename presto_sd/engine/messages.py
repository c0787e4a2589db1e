"""What crosses the drafter / verifier / orchestrator boundaries, and its named errors.

Every engine call carries ``base``: the number of tokens the target has processed for the
session (its KV length). The pending anchor — the last committed token — sits at
position ``base``. A call built on another base is refused (``StaleBaseError``), never
silently applied. The errors map one-to-one onto gRPC status codes (docs/design.md §3).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the thin clients import these errors without loading torch
    import torch

    from presto_sd.method.scores import DraftMarginals


class EngineError(Exception):
    """Base of the errors an engine raises on a request it refuses."""

    code = "INTERNAL"


class InvalidArgumentError(EngineError, ValueError):
    code = "INVALID_ARGUMENT"


class SessionNotFoundError(EngineError, KeyError):
    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown session"


class StaleBaseError(EngineError):
    code = "FAILED_PRECONDITION"


class LimitExceededError(EngineError):
    code = "RESOURCE_EXHAUSTED"


class AlreadyExistsError(EngineError):
    """A Prefill on an id that is open, without ``restart``; a request id already running."""

    code = "ALREADY_EXISTS"


class UnauthenticatedError(EngineError):
    code = "UNAUTHENTICATED"


class UnavailableError(EngineError):
    """The engine cannot answer now: loading, unreachable, or past the call's deadline."""

    code = "UNAVAILABLE"


class DrafterUnavailableError(UnavailableError):
    """The drafter is down or timed out: the loop goes on with plain AR steps."""


class VerifierUnavailableError(UnavailableError):
    """The verifier is down or timed out: the loop waits for it and re-prefills."""


@dataclass(frozen=True)
class FeatureDelta:
    """Target features of newly committed tokens, for the drafter's context cache.

    ``tokens[i]`` sits at position ``start + i``; ``features[i]`` is the concatenation of
    the target hidden states at the drafter's ``target_layer_ids`` for that token.
    """

    start: int
    tokens: tuple[int, ...]
    features: torch.Tensor  # [len(tokens), num_layers * hidden]
    # self-speculative mode: the marginals of the block after this round's bonus, drafted by
    # the verify forward's mask rows (``MaskChains``); None: none drafted
    next_block: DraftMarginals | None = None

    def __post_init__(self) -> None:
        if self.features.ndim != 2 or self.features.shape[0] != len(self.tokens):
            raise InvalidArgumentError(
                f"delta.features: shape {tuple(self.features.shape)} does not match "
                f"{len(self.tokens)} tokens"
            )

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def answer_of(error: EngineError) -> EngineError:
    """A refusal as a batched call's answer for one item: without its traceback, which
    would hold the raising frame (and every session it touched) in a reference cycle, so
    a finished session's KV would wait for the garbage collector to come back."""
    return error.with_traceback(None)


def copy_error(error: EngineError) -> EngineError:
    """The same refusal as a new exception object: one per item of a batch that failed as a
    whole (a shared one would mix the tracebacks of everyone who raises it)."""
    try:
        return type(error)(*error.args)
    except TypeError:
        return error


def session_tag(session_id: str) -> str:
    """How logs and error messages name a session: a short hash of its id, never the id
    (whoever knows an id may act on that session, within its principal)."""
    return "#" + hashlib.sha256(session_id.encode()).hexdigest()[:12]


def check_once_per_batch(seen: set[str], session_id: str, where: str) -> None:
    """A batch carries each session once (its calls would race on one KV and generator):
    INVALID_ARGUMENT for a later call naming a session ``seen`` already holds."""
    if session_id in seen:
        raise InvalidArgumentError(f"{where}: session {session_tag(session_id)} is already in this batch")
    seen.add(session_id)


def check_base(session_id: str, expected: int, got: int) -> None:
    if got != expected:
        raise StaleBaseError(
            f"session {session_tag(session_id)}: stale base {got}, the session is at base {expected}"
        )
