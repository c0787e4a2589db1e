"""The session table both engines keep: lookup, caps, explicit close and a TTL reaper.

A dict (tests and tools read it as one) plus the bookkeeping every engine needs around
it. Two caps: the number of sessions, and the bytes of KV they hold (``KVMemory``). The
bytes held are the engine's own count of what its KV buffers really take (``held_bytes``:
slots, growth room and page slack included), not positions times a cost; a call is
admitted by the bytes it would allocate, and one that would pass either cap is refused
before anything is allocated. A Prefill takes its place (a seat) before it builds the
session, so that calls run between the chunks of a long prefill cannot take the room it
was admitted to.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from presto_sd.engine.messages import (
    AlreadyExistsError,
    LimitExceededError,
    SessionNotFoundError,
    session_tag,
)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


class _Held(Protocol):
    last_used: float

    @property
    def positions(self) -> int: ...  # KV positions the session holds


S = TypeVar("S", bound=_Held)


@dataclass(frozen=True)
class KVMemory:
    """An engine's KV bytes: the cost of a position, the budget (None: none) and the use."""

    bytes_per_token: int = 0
    budget_bytes: int | None = None
    in_use_bytes: int = 0


@dataclass(frozen=True)
class Seat:
    """A prefill's reserved place: one session (if its id is new) and its prompt's bytes."""

    number: int
    session_id: str
    nbytes: int


class SessionTable(dict[str, S], Generic[S]):
    def __init__(
        self, kind: str, max_sessions: int, bytes_per_token: int = 0, budget_bytes: int | None = None,
        held_bytes: Callable[[], int] | None = None,
    ) -> None:
        """``held_bytes``: the bytes the engine's KV buffers hold now (None: the sessions'
        ``positions`` times ``bytes_per_token``, for engines whose KV is exactly that)."""
        super().__init__()
        self._held_bytes = held_bytes
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"{kind}: the KV budget must be > 0 bytes (got {budget_bytes})")
        self.kind, self.max_sessions = kind, max_sessions
        self.bytes_per_token, self.budget_bytes = bytes_per_token, budget_bytes
        self._seats: dict[int, Seat] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()  # the table only; forwards are per-session

    # -- memory -------------------------------------------------------------------------
    def in_use_bytes(self) -> int:
        """KV the open sessions hold, plus what prefills in progress reserved."""
        with self._lock:
            return self._in_use()

    def _in_use(self) -> int:
        if self._held_bytes is not None:
            held = self._held_bytes()
        else:
            held = sum(s.positions for s in self.values()) * self.bytes_per_token
        return held + sum(seat.nbytes for seat in self._seats.values())

    def memory(self) -> KVMemory:
        return KVMemory(self.bytes_per_token, self.budget_bytes, self.in_use_bytes())

    def admit(self, nbytes: int, what: str) -> None:
        """Refuse a call that would allocate ``nbytes`` more KV than the budget has left."""
        with self._lock:
            self._admit(nbytes, what)

    def _admit(self, nbytes: int, what: str) -> None:
        if self.budget_bytes is None:
            return
        in_use = self._in_use()
        if in_use + nbytes > self.budget_bytes:
            raise LimitExceededError(
                f"{self.kind}: {what} needs {_size(nbytes)} of KV; {_size(in_use)} of the "
                f"{_size(self.budget_bytes)} budget is in use (--max-kv-gb)"
            )

    # -- sessions -----------------------------------------------------------------------
    def touch(self, session_id: str) -> S:
        """The session, marked as used now; NOT_FOUND when it is not open."""
        s = self.get(session_id)
        if s is None:
            raise SessionNotFoundError(
                f"{self.kind} session {session_tag(session_id)} not found (closed, expired or never opened)"
            )
        s.last_used = time.monotonic()
        return s

    def seat(self, session_id: str, nbytes: int, restart: bool = False, what: str = "a prefill") -> Seat:
        """Reserve a new session's place, or refuse: ALREADY_EXISTS for an open id without
        ``restart``, RESOURCE_EXHAUSTED over the session cap or the KV budget.

        ``nbytes``: what the new session's KV will allocate. A restart replaces the open
        session once the new one is built; until then both are held, so it needs room for
        the new one beside the old.
        """
        with self._lock:
            taken = session_id in self or any(s.session_id == session_id for s in self._seats.values())
            if taken and not restart:
                raise AlreadyExistsError(
                    f"{self.kind} session {session_tag(session_id)} is already open "
                    "(Prefill with restart to replace it, or Close it first)"
                )
            if session_id not in self and len(self) + len(self._seats) >= self.max_sessions:
                raise LimitExceededError(f"{self.kind}: {self.max_sessions} sessions open (max)")
            self._admit(nbytes, what)
            seat = Seat(next(self._numbers), session_id, nbytes)
            self._seats[seat.number] = seat
            return seat

    def open(self, seat: Seat, session: S) -> None:
        """The seated prefill is built: its session replaces whatever held the id."""
        with self._lock:
            self._seats.pop(seat.number, None)
            self[seat.session_id] = session

    def release(self, seat: Seat) -> None:
        """A seated prefill that did not finish: its place is free again (no-op once opened)."""
        with self._lock:
            self._seats.pop(seat.number, None)

    def close(self, session_id: str) -> None:
        with self._lock:
            if self.pop(session_id, None) is None:
                raise SessionNotFoundError(f"{self.kind} session {session_tag(session_id)} not found")

    def close_idle(self, ttl_s: float) -> list[str]:
        """Close sessions idle for longer than ``ttl_s``; returns their ids."""
        now = time.monotonic()
        with self._lock:
            stale = [k for k, s in self.items() if now - s.last_used > ttl_s]
            for k in stale:
                del self[k]
        return stale
