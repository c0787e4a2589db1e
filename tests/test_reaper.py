"""The reaper of ``up``: what a process started outlives it by a few seconds at most, however it
dies — detached (its own session, reparented to PID 1) and ignoring SIGTERM included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.orchestrator_util import alive

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")

# a parent that starts the reaper, then a grandchild in a session of its own that ignores
# SIGTERM and rewrites its environment's memory (as Ray's agents do), then waits
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    from presto_sd.app.reaper import start_reaper
    start_reaper(grace_s={grace})
    stubborn = '''
    import ctypes, os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(os.getpid(), flush=True)
    time.sleep({clobber_after})
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # fields[i] is field i + 3 of proc(5)
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end
    ctypes.memset(start, 0, end - start)  # what a process title rewrite leaves
    time.sleep(600)
    '''
    child = subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    print(child.stdout.readline().strip(), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("clobber_after", [0.0, 600.0], ids=["environ-wiped", "environ-kept"])
def test_a_killed_parent_takes_its_detached_stubborn_grandchild(clobber_after):
    code = PARENT.format(grace=0.5, clobber_after=clobber_after)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    grandchild = int(parent.stdout.readline())
    try:
        time.sleep(3)  # the watchdog has looked at least once (it looks every 2 s)
        assert alive({grandchild})
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while alive({grandchild}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive({grandchild})
    finally:
        if alive({grandchild}):
            os.kill(grandchild, signal.SIGKILL)
