"""The session table both engines keep: lookup, a cap, explicit close and a TTL reaper.

A dict (tests and tools read it as one) plus the bookkeeping every engine needs around
it; sessions only need a ``last_used`` monotonic timestamp.
"""

from __future__ import annotations

import threading
import time
from typing import Generic, Protocol, TypeVar

from presto_sd.engine.messages import LimitExceededError, SessionNotFoundError


class _Timed(Protocol):
    last_used: float


S = TypeVar("S", bound=_Timed)


class SessionTable(dict[str, S], Generic[S]):
    def __init__(self, kind: str, max_sessions: int) -> None:
        super().__init__()
        self.kind, self.max_sessions = kind, max_sessions
        self._lock = threading.Lock()  # the table only; forwards are per-session

    def touch(self, session_id: str) -> S:
        """The session, marked as used now; NOT_FOUND when it is not open."""
        s = self.get(session_id)
        if s is None:
            raise SessionNotFoundError(
                f"{self.kind} session {session_id!r} not found (closed, expired or never opened)"
            )
        s.last_used = time.monotonic()
        return s

    def check_room(self, session_id: str) -> None:
        """Refuse a new session over the cap (re-opening an existing id is always allowed)."""
        with self._lock:
            if session_id not in self and len(self) >= self.max_sessions:
                raise LimitExceededError(f"{self.kind}: {self.max_sessions} sessions open (max)")

    def open(self, session_id: str, session: S) -> None:
        with self._lock:
            self[session_id] = session

    def close(self, session_id: str) -> None:
        with self._lock:
            if self.pop(session_id, None) is None:
                raise SessionNotFoundError(f"{self.kind} session {session_id!r} not found")

    def close_idle(self, ttl_s: float) -> list[str]:
        """Close sessions idle for longer than ``ttl_s``; returns their ids."""
        now = time.monotonic()
        with self._lock:
            stale = [k for k, s in self.items() if now - s.last_used > ttl_s]
            for k in stale:
                del self[k]
        return stale
