"""The Ray dashboard as its users see it: a real orchestrator process with its engines as
actors, a few requests through it, and the dashboard's actors page in headless Chromium.

Skipped, with the reason, where Debian's ``chromium`` is not installed (``scripts/test.sh``
installs it where it can). ``PRESTO_DOCS_SCREENSHOTS=1`` writes the screenshot into
``docs/img/`` (how the one there was made); otherwise it goes to a temporary folder.
"""

from __future__ import annotations

import json
import os
import queue
import re
import time
import urllib.request
from pathlib import Path

import pytest

from orchestrator.client import OrchestratorClient
from tests.browser_util import CHROMIUM, Browser
from tests.rpc_util import spawn, wait_for

pytestmark = pytest.mark.skipif(CHROMIUM is None,
                                reason="chromium is not installed (apt-get install chromium)")
DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
DASHBOARD = re.compile(r"View the dashboard at \S*?(http://[0-9.]+:\d+)")


def _dashboard_url(lines: queue.Queue, timeout_s: float = 180) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if m := DASHBOARD.search(re.sub(r"\x1b\[[0-9;]*m", "", line)):
            return m[1]
    raise TimeoutError("Ray did not say where its dashboard is")


def _ray_token() -> str | None:
    """Ray's token when its token authentication is on (the dashboard then asks for it)."""
    path = Path.home() / ".ray" / "auth_token"
    return path.read_text().strip() if path.exists() else None


def _actors(url: str, token: str | None) -> list[dict]:
    req = urllib.request.Request(f"{url}/api/v0/actors?limit=100&detail=1")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["data"]["result"]["result"]


def test_the_dashboard_lists_the_replicas_by_what_they_are(tiny_target_dir, tmp_path):
    proc, lines = spawn(["serve", "orchestrator", "--port", "0", "--target", str(tiny_target_dir),
                         "--drafter", "random", "--threads", "1", "--dtype", "float32", "--ray-dashboard",
                         "--drain-s", "0", "--grace-s", "0"])
    browser = None
    try:
        url = _dashboard_url(lines)
        port = wait_for(lines, "listening")["port"]
        wait_for(lines, "serving")
        client = OrchestratorClient(f"127.0.0.1:{port}")
        for prompt in ([1, 2, 3], [4, 5, 6, 7], [8, 9]):  # the replicas serve before they are looked at
            chunks = client.generate(prompt, max_new_tokens=6, method="marginal")
            assert sum(len(c.tokens) for c in chunks) == 6
        token = _ray_token()
        actors = {a["name"]: a for a in _actors(url, token) if a.get("name", "").startswith("presto-")}
        kinds = {(a["class_name"], a["state"]) for a in actors.values()}
        assert kinds == {("VerifierReplica", "ALIVE"), ("DrafterReplica", "ALIVE")}, actors
        assert {n.rsplit("-", 1)[0] for n in actors} == {"presto-verifier-local-0", "presto-drafter-local-0"}

        browser = Browser()
        folder = DOCS_IMG if os.environ.get("PRESTO_DOCS_SCREENSHOTS") else tmp_path
        shot = folder / "ray-dashboard-actors.png"
        host = url.split("//", 1)[1].split(":")[0]
        cookies = [{"name": "ray-authentication-token", "value": token, "domain": host, "path": "/"}
                   for _ in [token] if token]
        text = browser.run(f"{url}/#/actors", cookies, wait_for_text="presto-verifier-local-0",
                           screenshot=shot)
        for name in actors:  # the page a person opens names both replicas
            assert name in text, (name, text[:2000])
        assert "VerifierReplica" in text and "DrafterReplica" in text
        assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
    finally:
        if browser is not None:
            browser.close()
        proc.terminate()
        proc.wait(timeout=60)
