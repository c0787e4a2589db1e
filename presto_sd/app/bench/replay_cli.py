"""``presto-sd bench --replay``: the replay's outputs (``replay.json``, a printed table)."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from presto_sd.app.bench.replay import (
    load_recordings,
    position_stats,
    recording_key,
    replay_bench,
    replay_rows,
    save_recordings,
)
from presto_sd.app.bench.report import run_record
from presto_sd.app.bench.runner import BenchConfig, BenchPrompt
from presto_sd.models.cache import cache_dir


def _recordings_path(args: argparse.Namespace, info, prompts: list[BenchPrompt]) -> Path:
    """One file per target and its arithmetic (dtype, decoder, weights, attention kernel: what
    decides its tokens), feature layers, length and prompt set: an engine that rounds otherwise
    records anew, so the replay's tau stays the live bench's."""
    if args.recordings:
        return Path(args.recordings)
    key = json.dumps([info.arithmetic(), list(info.target_layer_ids), args.max_new_tokens,
                      [p.token_ids for p in prompts]], sort_keys=True)
    return cache_dir("replay") / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def run_replay(args: argparse.Namespace, stack, prompts: list[BenchPrompt], config: BenchConfig,
               out: Path, meta: dict[str, Any], self_drafter=None) -> int:
    info = stack.verifier.info()
    rec_path = _recordings_path(args, info, prompts)
    recordings = load_recordings(rec_path) if rec_path.exists() else {}
    t0 = time.perf_counter()
    logs, recordings = replay_bench(stack.verifier, stack.drafter, prompts, config,
                                    progress=not args.no_progress, recordings=recordings,
                                    self_drafter=self_drafter)
    save_recordings(rec_path, recordings)
    t1 = time.perf_counter()
    rows = replay_rows(logs)
    result = {**meta, "replay": True, "recordings": str(rec_path), "wall_s": {"walk": round(t1 - t0, 1)},
              "rows": rows, "positions": {}}
    out.mkdir(parents=True, exist_ok=True)
    _write(out, result)  # the walks first: the per-position pass is the long part
    with open(out / "replay_runs.jsonl", "w") as f:  # every walk's rounds, as bench's runs.jsonl
        for r in logs:
            f.write(json.dumps(run_record(r)) + "\n")
    print("| dataset | method | budget | tau | mean tree |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dataset']} | {r['method']} | {r['budget'] or ''} | {r['tau']:.3f} | "
              f"{r['mean_tree_size']:.1f} |")
    datasets = list(dict.fromkeys(p.dataset for p in prompts))
    for ds in datasets if args.positions_top_k > 0 else ():
        recs = [recordings[recording_key(p)] for p in prompts if p.dataset == ds]
        stats = position_stats(stack.drafter, recs, config.params.max_new_tokens, args.positions_top_k,
                               progress=not args.no_progress)
        result["positions"][ds] = stats.summary()
        result["wall_s"]["positions"] = round(time.perf_counter() - t1, 1)
        _write(out, result)
    positions = result["positions"]
    if positions:
        print("\n| dataset | top-1 @ depth 1..3 | top-K @ depth 1 | oracle top-K accept "
              "| top-1 chain accept |")
        print("|---|---|---|---|---|")
    for ds, s in positions.items():
        r1, rk = s["recall"]["1"], s["recall"][str(s["top_k"])]
        print(f"| {ds} | {' / '.join(f'{x:.3f}' for x in r1[:3])} | {rk[0]:.3f} | "
              f"{s['oracle_accept_mean']:.3f} | {s['top1_accept_mean']:.3f} |")
        if "prefix_recall" in s:
            c1 = s["prefix_recall"]["1"]
            print(f"|   prefix head, given the true parent | {' / '.join(f'{x:.3f}' for x in c1[:3])} | "
                  f"{s['prefix_recall'][str(s['top_k'])][0]:.3f} | | |")
    print(f"\nwrote {out}/replay.json (recordings: {rec_path})")
    return 0


def _write(out: Path, result: dict[str, Any]) -> None:
    tmp = out / "replay.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    tmp.rename(out / "replay.json")
