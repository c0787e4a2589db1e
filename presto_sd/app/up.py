"""``presto-sd up``: a complete local stack, verifier and drafter servers and the orchestrator.

    presto-sd up [--port 50050]                      # verifier + drafter servers + orchestrator
    presto-sd generate "PROMPT" --orchestrator-addr 127.0.0.1:50050 [--json]

With ``--auth-token-file`` the engine servers want a token too: a fresh one, that only
this ``up``'s orchestrator holds (a 0600 file in a private temp dir, removed on exit).
Ctrl-C or SIGTERM drains and stops everything; whatever else ends `up` (SIGKILL, a crash),
its watchdog (``reaper.py``) ends every process it started within a few seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from orchestrator.actors import engine_env
from presto_sd.app.reaper import start_reaper
from presto_sd.app.serve import add_orchestrator_args, serve_orchestrator


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="a complete local stack: verifier, drafter, orchestrator on Ray",
                       description="Start verifier and drafter servers (subprocesses) and the "
                                   "orchestrator on a local Ray; Ctrl-C / SIGTERM stops them all.")
    add_orchestrator_args(p, up=True)
    p.set_defaults(run=run_up)


# -- presto-sd up -----------------------------------------------------------------------
def child_command(kind: str, args: argparse.Namespace, token_file: str | None = None) -> list[str]:
    """``presto-sd serve KIND`` as ``up`` starts it, with the flags of ``up`` it shares."""
    cmd = [sys.executable, "-m", "presto_sd.app.cli", "serve", kind, "--port", "0",
           "--drain-s", str(args.drain_s), "--grace-s", str(args.grace_s)]
    passed = (("--target", args.target), ("--drafter", args.drafter), ("--threads", args.threads),
              ("--auth-token-file", token_file))
    for flag, value in passed:
        if value is not None:
            cmd += [flag, str(value)]
    if args.reflection is not None:
        cmd.append("--reflection" if args.reflection else "--no-reflection")
    return cmd


def child_env(kind: str) -> dict[str, str]:
    """A server's environment: ours, with the drafter's idle OpenMP threads sleeping
    (unless set): `up` runs both engines on one machine (``engine_env``)."""
    return {**os.environ, **engine_env(kind)}


class _Child:
    """A server subprocess; its stderr is passed through, its JSON events are watched."""

    def __init__(self, kind: str, args: argparse.Namespace, token_file: str | None = None,
                 echo: bool = True) -> None:
        cmd = child_command(kind, args, token_file)
        self.kind, self.events, self.echo = kind, {}, echo
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     preexec_fn=_die_with_parent, env=child_env(kind))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            if self.echo:
                sys.stderr.write(line)
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                with self._changed:
                    self.events[event.get("event")] = event
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, event: str, timeout_s: float) -> dict:
        end = time.monotonic() + timeout_s
        with self._changed:
            while event not in self.events:
                if self.proc.poll() is not None:
                    raise SystemExit(f"presto-sd up: the {self.kind} server exited ({self.proc.returncode})")
                if time.monotonic() > end:
                    raise SystemExit(f"presto-sd up: no {event!r} event from the {self.kind} server")
                self._changed.wait(timeout=1.0)
            return self.events[event]

    def stop(self, timeout_s: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _die_with_parent() -> None:
    """In the child: get SIGTERM at once if `up` dies without cleaning up (Linux prctl
    PDEATHSIG); the reaper's sweep follows for whatever the child started or ignores it."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _engine_token_file(folder: Path) -> str:
    """A token for the engines `up` starts, known only to its orchestrator (principal ``orchestrator``)."""
    path = folder / "engines.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"orchestrator:{secrets.token_urlsafe(32)}\n")
    return str(path)


def run_up(args: argparse.Namespace) -> int:
    start_reaper()  # first: everything started from here on carries the family's mark
    folder = tempfile.mkdtemp(prefix="presto-sd-up-")  # mode 0700
    engine_token = _engine_token_file(Path(folder)) if args.auth_token_file else None
    children = [_Child(kind, args, engine_token) for kind in ("verifier", "drafter")]
    try:
        ports = {c.kind: c.wait_for("listening", 600)["port"] for c in children}
        for c in children:
            c.wait_for("serving", 600)
        args.verifier_addr, args.drafter_addr = (f"127.0.0.1:{ports[k]}" for k in ("verifier", "drafter"))
        args.engine_tls_ca = args.engine_tls_client_cert = args.engine_tls_client_key = None
        args.engine_tls_server_name = None
        args.engine_auth_token_file = engine_token

        def announce(port: int) -> None:
            print(json.dumps({"event": "up", "orchestrator": f"{args.host}:{port}",
                              "verifier": args.verifier_addr, "drafter": args.drafter_addr,
                              "pids": [c.proc.pid for c in children]}), flush=True)
            print(f"presto-sd up: orchestrator on {args.host}:{port} (Ctrl-C stops everything)",
                  file=sys.stderr, flush=True)

        return serve_orchestrator(args, announce)
    finally:
        for c in children:
            c.stop(args.drain_s + args.grace_s + 10)
        shutil.rmtree(folder, ignore_errors=True)
