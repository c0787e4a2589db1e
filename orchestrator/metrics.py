"""The orchestrator's metrics, through ``ray.util.metrics`` (docs/design.md §3, operations).

Ray's per-node metrics agent (``ray[default]``) exports them for Prometheus on the node's
metrics export port (``ray start --metrics-export-port``, or ``ray.init(_metrics_export_
port=...)``) with a ``ray_`` prefix; counters gain ``_total`` and histograms ``_bucket`` /
``_sum`` / ``_count``: ``presto_tokens_committed`` is scraped as
``ray_presto_tokens_committed_total``. ``helm/presto-sd/dashboards/presto-sd.json`` plots
exactly those names. Every value is also tallied here (``tallies``) for tests and the
benchmark, which need no scrape.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as Tally

from ray.util import metrics as rm

log = logging.getLogger(__name__)

# tau per round: accepted draft tokens + 1
ACCEPT_BOUNDS = [float(b) for b in range(1, 17)]
TREE_BOUNDS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0]
SECONDS_BOUNDS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]
BATCH_BOUNDS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]
TOKEN_BOUNDS = [1.0, 4.0, 16.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0]
PHASES = ("draft", "verify", "queue", "transfer")
# fallback kinds: a round without a tree while the drafter was away; a session moved to
# another replica (onto one that computes otherwise: no replica alike was healthy); a
# verifier session rebuilt from the committed tokens
FALLBACKS = ("ar_round", "drafter_rehome", "verifier_rehome", "verifier_rehome_mismatch",
             "verifier_reprefill")


# key -> (kind, name, description, tag keys, histogram boundaries)
_SPECS: dict[str, tuple] = {
    "tokens": ("counter", "presto_tokens_committed", "Output tokens committed", ("method",), None),
    "requests": ("counter", "presto_requests", "Requests finished, by how", ("method", "finish"), None),
    "accept": ("histogram", "presto_acceptance_length", "Tokens committed per round (accepted + 1)",
               ("method",), ACCEPT_BOUNDS),
    "tree": ("histogram", "presto_tree_size", "Draft nodes verified per round", ("method",), TREE_BOUNDS),
    "phase": ("histogram", "presto_round_phase_seconds", "Round latency split: drafter engine, verifier "
              "engine, waiting for the verifier, transfer", ("phase",), SECONDS_BOUNDS),
    "round": ("histogram", "presto_round_seconds", "Round latency", ("method",), SECONDS_BOUNDS),
    "batch": ("histogram", "presto_verify_batch_size", "Trees per verifier call", ("replica",), BATCH_BOUNDS),
    "batch_tokens": ("histogram", "presto_verify_batch_tokens", "New tokens (tree nodes, AR steps) per "
                     "verifier forward", ("replica",), TOKEN_BOUNDS),
    "batch_prompts": ("histogram", "presto_verify_batch_prompts", "New sessions' prompts prefilled in a "
                      "verifier forward beside the steps", ("replica",), BATCH_BOUNDS),
    "draft_batch": ("histogram", "presto_draft_batch_size", "Blocks per drafter call", ("replica",),
                    BATCH_BOUNDS),
    "busy": ("counter", "presto_engine_busy_seconds", "Seconds an engine replica spent in calls "
             "(1 - rate = its idle share)", ("service", "replica"), None),
    "active": ("gauge", "presto_active_requests", "Requests being generated", (), None),
    "sessions": ("gauge", "presto_sessions", "Sessions a replica holds for live requests",
                 ("service", "replica"), None),
    "link": ("gauge", "presto_link_round_trip_seconds", "What a call to an engine replica costs beyond "
             "the engine's work: network round trip and transfer (remote), actor hop (in-process); "
             "the median of its last calls, what taps prices each round with", ("service", "replica"), None),
    "fallbacks": ("counter", "presto_fallbacks", "Fault fallbacks, by kind", ("kind",), None),
    "gated": ("counter", "presto_taps_gated_rounds", "taps rounds run as plain AR steps while its "
              "draft gate was shut (drafting did not pay)", ("method",), None),
    "errors": ("counter", "presto_errors", "Engine refusals and failed requests, by status code",
               ("service", "code"), None),
}
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def prometheus_names() -> set[str]:
    """Every series name Prometheus scrapes for these metrics (what the dashboard may query)."""
    return {f"ray_{name}{suffix}" for kind, name, *_ in _SPECS.values() for suffix in _SUFFIXES[kind]}


class Metrics:
    def __init__(self, export: bool = True, flush_s: float = 0.5) -> None:
        """``export=False``: tallies only (no Ray needed). Values reach Ray within ``flush_s``."""
        self.tallies: Tally[str] = Tally()
        self._lock = threading.Lock()
        ray_metrics: dict[str, rm.Metric] = {}
        for key, (kind, name, description, tag_keys, bounds) in (_SPECS.items() if export else ()):
            if kind == "histogram":
                ray_metrics[key] = rm.Histogram(name, description, bounds, tag_keys=tag_keys)
            else:
                cls = rm.Counter if kind == "counter" else rm.Gauge
                ray_metrics[key] = cls(name, description, tag_keys=tag_keys)
        self._export = _RayExport(ray_metrics, flush_s) if ray_metrics else None

    def _tally(self, key: str, n: float = 1) -> None:
        with self._lock:
            self.tallies[key] += n

    def _emit(self, name: str, value: float, **tags: str) -> None:
        if self._export is not None:
            self._export.add(name, value, tags)

    def flush(self) -> None:
        """Hand every value so far to Ray now (they go every ``flush_s`` anyway)."""
        if self._export is not None:
            self._export.flush()

    def round(self, method: str, tokens: int, accepted: int, tree_size: int,
              phases: dict[str, float], fallback: bool, gated: bool = False) -> None:
        self._tally("rounds")
        self._tally("tokens", tokens)
        self._emit("tokens", tokens, method=method)
        self._emit("accept", accepted + 1, method=method)
        self._emit("tree", tree_size, method=method)
        self._emit("round", sum(phases.values()), method=method)
        for phase, seconds in phases.items():
            self._emit("phase", seconds, phase=phase)
        if fallback:
            self.fallback("ar_round")
        if gated:
            self._tally("gated")
            self._emit("gated", 1, method=method)

    def first_token(self, method: str) -> None:
        self._tally("tokens")
        self._emit("tokens", 1, method=method)

    def fallback(self, kind: str) -> None:
        self._tally(f"fallback:{kind}")
        self._emit("fallbacks", 1, kind=kind)

    def error(self, service: str, code: str) -> None:
        self._tally(f"error:{service}:{code}")
        self._emit("errors", 1, service=service, code=code)

    def finished(self, method: str, finish: str) -> None:
        self._tally(f"finish:{finish}")
        self._emit("requests", 1, method=method, finish=finish)

    def batch(self, replica: str, size: int, tokens: int, busy_s: float, prompts: int = 0) -> None:
        self._tally("verify_batches")
        self._tally("verify_batched_calls", size)
        self._tally("verify_batched_prompts", prompts)
        self._emit("batch", size, replica=replica)
        self._emit("batch_tokens", tokens, replica=replica)
        self._emit("batch_prompts", prompts, replica=replica)

    def draft_batch(self, replica: str, size: int) -> None:
        self._tally("draft_batches")
        self._tally("draft_batched_calls", size)
        self._emit("draft_batch", size, replica=replica)

    def busy(self, service: str, replica: str, seconds: float) -> None:
        self._emit("busy", seconds, service=service, replica=replica)

    def link(self, service: str, replica: str, seconds: float) -> None:
        self._emit("link", seconds, service=service, replica=replica)

    def active(self, n: int) -> None:
        self._emit("active", n)

    def sessions(self, service: str, replica: str, n: int) -> None:
        self._emit("sessions", n, service=service, replica=replica)


class _RayExport:
    """Ray's metric calls, off the request threads: a round appends its values to a list and
    one thread records them every ``flush_s`` (counters summed per series, gauges their last
    value, every histogram value observed). A Ray call costs ~30 us a round, under the
    GIL, and 64 streams' rounds queued behind one another in the gap between two verify
    batches (the largest self time in the orchestrator's profile at 64 streams)."""

    def __init__(self, metrics: dict[str, rm.Metric], flush_s: float) -> None:
        self._metrics, self._flush_s = metrics, flush_s
        self._pending: list[tuple[str, float, tuple[tuple[str, str], ...]]] = []
        self._lock = threading.Lock()  # the list's
        self._recording = threading.Lock()  # one flush at a time
        threading.Thread(target=self._run, daemon=True, name="metrics-export").start()

    def add(self, name: str, value: float, tags: dict[str, str]) -> None:
        if name in self._metrics:
            with self._lock:
                self._pending.append((name, value, tuple(tags.items())))

    def _run(self) -> None:
        while True:
            time.sleep(self._flush_s)
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - metrics must outlive one bad record
                log.exception("metrics export: a flush failed; the values it held are dropped")

    def flush(self) -> None:
        with self._recording:
            with self._lock:
                pending, self._pending = self._pending, []
            sums: dict[tuple, float] = {}
            last: dict[tuple, float] = {}
            for name, value, tags in pending:
                m = self._metrics[name]
                if isinstance(m, rm.Counter):
                    sums[name, tags] = sums.get((name, tags), 0.0) + value
                elif isinstance(m, rm.Histogram):
                    m.observe(value, tags=dict(tags) or None)
                else:
                    last[name, tags] = value
            for (name, tags), value in sums.items():
                if value > 0:
                    self._metrics[name].inc(value, tags=dict(tags) or None)
            for (name, tags), value in last.items():
                self._metrics[name].set(value, tags=dict(tags) or None)
