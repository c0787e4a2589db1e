"""A headless Chromium driven over the DevTools protocol, for the tests that open real pages.

Debian's ``chromium`` (no Playwright, no driver binary): started with a debugging port,
spoken to over its websocket with aiohttp (a dependency of Ray's already). Just what the
tests need: set a cookie, open a page, read its text, take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# what a closed network and a root user need (the flags of the machine's own probe)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,900", "--remote-debugging-port=0"]


class Browser:
    def __init__(self) -> None:
        if CHROMIUM is None:
            raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium)")
        self.profile = tempfile.mkdtemp(prefix="presto-chromium-")
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium did not open its debugging port")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        self._ids = itertools.count(1)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

    def run(self, url: str, cookies: list[dict] = (), wait_for_text: str = "", timeout_s: float = 90,
            screenshot: Path | None = None) -> str:
        """Open ``url`` in a page (after setting ``cookies``), wait until its text holds
        ``wait_for_text``, optionally save a PNG screenshot; returns the page's text."""
        return asyncio.run(self._run(url, list(cookies), wait_for_text, timeout_s, screenshot))

    async def _run(self, url, cookies, wait_for_text, timeout_s, screenshot) -> str:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{self.port}/json/list") as r:
                page = next(t for t in await r.json() if t["type"] == "page")
            async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                async def call(method: str, **params):
                    n = next(self._ids)
                    await ws.send_str(json.dumps({"id": n, "method": method, "params": params}))
                    async for msg in ws:
                        data = json.loads(msg.data)
                        if data.get("id") == n:
                            if "error" in data:
                                raise RuntimeError(f"{method}: {data['error']}")
                            return data.get("result", {})
                    raise RuntimeError("chromium closed the connection")

                for cookie in cookies:
                    await call("Network.setCookie", **cookie)
                await call("Page.enable")
                await call("Page.navigate", url=url)
                deadline, text = time.monotonic() + timeout_s, ""
                while time.monotonic() < deadline:
                    got = await call("Runtime.evaluate", returnByValue=True,
                                     expression="document.body ? document.body.innerText : ''")
                    text = got.get("result", {}).get("value", "") or ""
                    if wait_for_text in text:
                        break
                    await asyncio.sleep(1.0)
                if screenshot is not None:
                    shot = await call("Page.captureScreenshot", format="png")
                    screenshot.parent.mkdir(parents=True, exist_ok=True)
                    screenshot.write_bytes(base64.b64decode(shot["data"]))
                return text
