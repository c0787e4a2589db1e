"""Nothing ``presto-sd up`` starts outlives it, however it dies (docs/services.md, "up").

``up`` (and a ``serve orchestrator`` that starts its own Ray) calls ``start_reaper`` first.
It marks the environment with a fresh ``PRESTO_SD_FAMILY`` id, which every process
started from then on inherits — the engine servers, Ray's GCS and raylet, and what those
start (the dashboard and runtime-env agents, the actors' workers) — and starts this
module as a watchdog in a session of its own, holding the write end of its stdin.

The watchdog notes the family every ``SCAN_S``: the processes below the parent and the
marked ones, wherever they went (``setsid``, reparented to PID 1), each then followed by
its pid and start time (a process may overwrite its environment, as Ray's agents do
when they set their titles). When the parent is gone — it exited or was SIGKILLed, the
kernel closes the pipe either way — it ends every member: SIGTERM, then after
``grace_s`` SIGKILL (Ray's agents ignore SIGTERM), and exits. Only a process that leaves
the tree and wipes its environment between two looks escapes. Linux only (``/proc``);
elsewhere ``start_reaper`` does nothing and ``up``'s own shutdown is all there is.

    python -m presto_sd.app.reaper ID GRACE_S PARENT_PID   # what start_reaper runs; stdin: the pipe
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MARKER = "PRESTO_SD_FAMILY"
SCAN_S = 2.0  # how often the watchdog notes the family while the parent lives
_watchdogs: list[subprocess.Popen] = []  # held for the process's life: dropping one closes its pipe


def start_reaper(grace_s: float = 3.0) -> str | None:
    """Mark this process's future descendants and start their watchdog; the id, or None
    (not Linux, or already inside a marked family: the outer watchdog covers it)."""
    if not sys.platform.startswith("linux") or os.environ.get(MARKER):
        return None
    family = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != MARKER}  # the watchdog is not in the family
    _watchdogs.append(subprocess.Popen(
        [sys.executable, "-m", "presto_sd.app.reaper", family, str(grace_s), str(os.getpid())],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, start_new_session=True))
    os.environ[MARKER] = family
    return family


@dataclass(frozen=True)
class _Proc:
    ppid: int
    started: str  # start time (``/proc/PID/stat`` field 22): a reused pid is another process
    marked: bool  # its environment carries the family's id


def _processes(needle: bytes) -> dict[int, _Proc]:
    """Every live process this user may read (zombies left out)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if fields[0] not in ("Z", "X"):
            out[int(entry.name)] = _Proc(int(fields[1]), fields[19], needle in b"\0" + environ + b"\0")
    return out


class Family:
    """The processes of one family: marked, or below the parent or a member (by parent pid);
    once seen, followed by pid and start time."""

    def __init__(self, family: str, parent: int | None) -> None:
        self.needle = f"\0{MARKER}={family}\0".encode()
        self.parent = parent  # None once it is gone: its pid may be reused
        self.known: dict[int, str] = {}

    def alive(self) -> list[int]:
        procs = _processes(self.needle)
        me = os.getpid()
        self.known = {pid: t for pid, t in self.known.items() if pid in procs and procs[pid].started == t}
        roots = {*self.known, *([self.parent] if self.parent is not None else [])}
        for pid, p in procs.items():
            if p.marked and pid != me:
                self.known[pid] = p.started
        grew = True
        while grew:  # everything below a root or a member
            below = {pid: p.started for pid, p in procs.items()
                     if p.ppid in roots and pid not in roots and pid != me}
            grew = bool(below)
            roots |= set(below)
            self.known.update(below)
        return list(self.known)

    def end(self, grace_s: float) -> None:
        """SIGTERM every member, SIGKILL those left after ``grace_s``, until none is left."""
        self.parent = None
        _signal(self.alive(), signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(50):  # members may start others while they go: sweep until none is left
            left = self.alive()
            if not left:
                return
            _signal(left, signal.SIGKILL)
            time.sleep(0.1)


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:  # already gone
            pass


def main(argv: list[str]) -> int:
    family, grace_s = Family(argv[0], int(argv[2])), float(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for `up` must not take this first
    stdin = sys.stdin.buffer.fileno()
    family.alive()
    while True:  # nothing is written: the pipe reads b"" when the parent is gone
        if select.select([stdin], [], [], SCAN_S)[0]:
            if not os.read(stdin, 65536):
                break
        else:
            family.alive()
    family.end(grace_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
