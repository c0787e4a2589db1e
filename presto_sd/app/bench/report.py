"""Bench outputs: ``results.json`` (rows + machine), ``results.md`` (the table), ``runs.jsonl``
(every generation with its round log, for re-analysis)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from presto_sd.app.bench.stats import SPLIT_KEYS, RunLog


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu", dtype: str = "") -> dict[str, Any]:
    import torch
    import transformers

    info = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": device,
        "dtype": dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def run_record(r: RunLog) -> dict[str, Any]:
    return {
        "dataset": r.dataset, "prompt_id": r.prompt_id, "method": r.method, "budget": r.budget,
        "finish_reason": r.finish_reason, "prefill_s": r.prefill_s, "decode_s": r.decode_s,
        "token_ids": r.token_ids,
        # accepted, tree_size, draft_s, build_s, verify_s, commit_s, fallback, gated
        "rounds": [[x.accepted, x.tree_size, x.draft_s, x.build_s, x.verify_s, x.commit_s,
                    bool(getattr(x, "fallback", False)), bool(getattr(x, "gated", False))] for x in r.rounds],
    }


def write_json(out: Path, rows: list[dict], meta: dict[str, Any], runs: Sequence[RunLog]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    with (out / "runs.jsonl").open("w") as f:
        for r in runs:
            f.write(json.dumps(run_record(r)) + "\n")


def _fmt(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    return format(x, spec)


def markdown_table(rows: list[dict]) -> str:
    head = ["dataset", "method", "budget", "tau", "tok/s", "speedup", "tree",
            *(f"{k} %" for k in SPLIT_KEYS), "lossless", "= ar %"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        split = r["time_split"]
        cells = [
            r["dataset"], r["method"], _fmt(r["budget"], "d"), _fmt(r["tau"]),
            _fmt(r["tokens_per_s"], ".1f"), _fmt(r["speedup"]), _fmt(r["mean_tree_size"], ".1f"),
            *(_fmt(100 * split[k], ".1f") for k in SPLIT_KEYS), _fmt(r["lossless"]),
            _fmt(None if r.get("ar_equal") is None else 100 * r["ar_equal"], ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_markdown(out: Path, rows: list[dict], meta: dict[str, Any], plots: Sequence[str]) -> None:
    m = meta["machine"]
    cfg = meta["config"]
    text = [
        "# presto-sd bench",
        "",
        f"- command: `{meta['command']}`",
        f"- target: {meta['target']}; drafter: {meta['drafter']}",
        f"- machine: {m['cpu']} ({m['cpu_count']} cores), torch threads {m['threads']}, {m['device']} "
        f"{m['dtype']}" + (f", {m['gpu']}" if "gpu" in m else ""),
        f"- torch {m['torch']}, transformers {m['transformers']}, {m['date']}",
        f"- {cfg['prompts']} prompts, max_new_tokens {cfg['max_new_tokens']}, temperature "
        f"{cfg['temperature']}, seed {cfg['seed']}",
        "",
        markdown_table(rows),
        "",
        "tau = mean tokens per round (accepted + 1); speedup = tok/s over `ar` on the same prompts "
        "in the same run; tree = mean draft nodes verified per round; draft/build/verify/commit/other "
        "= shares of decode time; lossless = greedy output identical to `ar` on every prompt; "
        "= ar % = the share of prompts whose greedy output is `ar`'s (a peer's own arithmetic may "
        "differ: reported, not hidden).",
        "",
        *(f"![{Path(p).stem}]({Path(p).name})" for p in plots),
        "",
    ]
    (out / "results.md").write_text("\n".join(text))


def command_line() -> str:
    """This process's command, as ``presto-sd ...`` (argv[0] is a path or ``-m`` module)."""
    return shlex.join(["presto-sd", *sys.argv[1:]])
