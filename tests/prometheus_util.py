"""A real Prometheus (Debian's ``prometheus``) scraping a metrics endpoint, for the tests that
hold the shipped Grafana dashboard's queries to what a scrape really holds."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

PROMETHEUS = shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """Scrapes ``targets`` every second into a temporary TSDB; ``query`` asks its HTTP API."""

    def __init__(self, targets: list[str]) -> None:
        if PROMETHEUS is None:
            raise FileNotFoundError("prometheus is not installed (Debian: apt-get install prometheus)")
        self.dir = Path(tempfile.mkdtemp(prefix="presto-prometheus-"))
        (self.dir / "prometheus.yml").write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "presto", "static_configs": [{"targets": targets}]}],
        }))
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'db'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self._get("/-/ready")
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("prometheus did not become ready")

    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return r.read()

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector (``metric`` labels and ``value``)."""
        out = json.loads(self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        if out["status"] != "success":
            raise ValueError(f"{expr}: {out}")
        return out["data"]["result"]

    def scrapes(self) -> int:
        """Scrapes of the targets so far."""
        result = self.query("sum(count_over_time(up[1h]))")
        return int(float(result[0]["value"][1])) if result else 0

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
