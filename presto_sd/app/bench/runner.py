"""The bench loop: every (method, budget) on every prompt, interleaved so drift cancels.

For prompt ``i`` the jobs run in the job list rotated by ``i``: each job sees every
position in the order as often as the others, so a machine that speeds up or slows down
(thermal, a neighbour's load) shifts every method alike. One short warm-up generation
per method runs first and is thrown away (first-call allocation, lazy init).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from presto_sd.app.bench import gguf_peer, hf_lookup  # noqa: F401 (the peers register themselves)
from presto_sd.app.bench.methods import BenchContext, get_method
from presto_sd.app.bench.stats import RunLog, table_rows
from presto_sd.app.errors import FlagError
from presto_sd.engine.drafter import Drafter
from presto_sd.engine.verifier import Verifier
from presto_sd.loop.generate import GenerationParams
from presto_sd.method.methods import METHODS

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class BenchPrompt:
    dataset: str
    id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Job:
    method: str
    budget: int | None  # None: an unbudgeted method


@dataclass(frozen=True)
class BenchConfig:
    methods: tuple[str, ...]
    budgets: tuple[int, ...]
    params: GenerationParams  # tree settings, sampling, max_new_tokens, stop ids
    lookup_tokens: int = 10
    warmup: bool = True
    taps_cap: int = 64  # taps: the most nodes a round may choose
    taps_rho: str | None = None  # taps: its acceptance provider (None: params.tree.rho)
    gguf: str | None = None  # llama-cpp: the GGUF file it decodes

    def __post_init__(self) -> None:
        if not self.methods:
            raise FlagError("bench: no methods")
        for m in self.methods:
            get_method(m)  # raises on an unknown name
        if not self.budgets or any(b < 1 for b in self.budgets):
            raise FlagError(f"bench: budgets {self.budgets} must be non-empty and >= 1")
        if self.lookup_tokens < 1:
            raise FlagError(f"bench: lookup_tokens = {self.lookup_tokens}: must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.params.sampling.temperature == 0

    def jobs(self) -> list[Job]:
        """``ar`` first (always run: it is what speedup and lossless compare with)."""
        names = ["ar", *(m for m in self.methods if m != "ar")]
        jobs = []
        for name in dict.fromkeys(names):
            if get_method(name).budgeted:
                jobs.extend(Job(name, b) for b in self.budgets)
            else:
                jobs.append(Job(name, None))
        return jobs

    def job_params(self, job: Job, seed_offset: int) -> GenerationParams:
        p = self.params
        tree = p.tree if job.budget is None else replace(p.tree, budget=job.budget)
        core = get_method(job.method).core
        method = METHODS.get(core) if core is not None else None  # None: a peer (hf-prompt-lookup)
        if method is not None and method.sizes_itself:
            tree = replace(tree, budget=self.taps_cap, rho=self.taps_rho or tree.rho)
        elif job.budget is None and (method is None or method.needs_drafter):
            tree = replace(tree, budget=max(tree.budget, tree.depth))
        seed = p.sampling.seed
        sampling = p.sampling if seed is None else replace(p.sampling, seed=seed + seed_offset)
        return replace(p, tree=tree, sampling=sampling)


def run_bench(
    verifier: Verifier,
    drafter: Drafter | None,
    prompts: Sequence[BenchPrompt],
    config: BenchConfig,
    progress: bool = True,
    self_drafter: Drafter | None = None,
) -> list[RunLog]:
    """Decode every prompt with every job; returns one ``RunLog`` per (prompt, job).
    ``self_drafter``: the self-* jobs' (the verifier carries its adapter)."""
    if not prompts:
        raise FlagError("bench: no prompts")
    jobs = config.jobs()
    for job in jobs:
        if get_method(job.method).needs_drafter and drafter is None:
            raise FlagError(f"bench method {job.method!r} needs a drafter")
    ctx = BenchContext(verifier, drafter, config.lookup_tokens, config.gguf, torch.get_num_threads(),
                       self_drafter)
    if config.warmup:
        warm = replace(config.params, max_new_tokens=min(WARMUP_TOKENS, config.params.max_new_tokens))
        for name in dict.fromkeys(j.method for j in jobs):
            get_method(name).run(ctx, list(prompts[0].token_ids), warm)
    logs: list[RunLog] = []
    bar = tqdm(total=len(prompts) * len(jobs), desc="bench", unit="gen", disable=not progress)
    try:
        for i, prompt in enumerate(prompts):
            k = i % len(jobs)
            for job in jobs[k:] + jobs[:k]:
                at = f"@{job.budget}" if job.budget else ""
                bar.set_postfix_str(f"{prompt.dataset} {job.method}{at}")
                logs.append(run_one(ctx, prompt, job, config.job_params(job, i)))
                bar.update()
    finally:
        bar.close()
    # report in job order, prompts in order, whatever order they ran in
    order = {job: n for n, job in enumerate(jobs)}
    logs.sort(key=lambda r: order[Job(r.method, r.budget)])
    return logs


def run_one(ctx: BenchContext, prompt: BenchPrompt, job: Job, params: GenerationParams) -> RunLog:
    method = get_method(job.method)
    res = method.run(ctx, list(prompt.token_ids), params)
    return RunLog(
        dataset=prompt.dataset, prompt_id=prompt.id, method=job.method, budget=job.budget,
        token_ids=list(res.token_ids), rounds=list(res.rounds), prefill_s=res.prefill_s,
        decode_s=res.decode_s, finish_reason=res.finish_reason, params=method.describe(ctx, params),
    )


def bench(
    verifier: Verifier,
    drafter: Drafter | None,
    prompts: Sequence[BenchPrompt],
    config: BenchConfig,
    out: Path,
    meta: dict[str, Any],
    progress: bool = True,
    self_drafter: Drafter | None = None,
) -> dict[str, Any]:
    """Run the bench and write ``out/``: results.json, results.md, runs.jsonl, the PNGs.

    ``meta`` goes into results.json as is (machine, command, target, drafter); the
    config fields are added. Returns the results.json object."""
    from presto_sd.app.bench import plots, report

    runs = run_bench(verifier, drafter, prompts, config, progress, self_drafter)
    rows = table_rows(runs, config.greedy)
    p = config.params
    meta = {
        **meta,
        "config": {
            "prompts": len(prompts),
            "datasets": list(dict.fromkeys(x.dataset for x in prompts)),
            "methods": list(dict.fromkeys(j.method for j in config.jobs())),
            "budgets": list(config.budgets),
            "max_new_tokens": p.max_new_tokens,
            "temperature": p.sampling.temperature,
            "top_p": p.sampling.top_p,
            "top_k": p.sampling.top_k,
            "seed": p.sampling.seed,
            "tree": {"depth": p.tree.depth, "branching": p.tree.branching, "beam": p.tree.beam,
                     "top_k": p.tree.top_k, "rho": p.tree.rho, "lambdas": list(p.tree.lambdas)},
            "lookup_tokens": config.lookup_tokens,
            "taps": {"cap": config.taps_cap, "rho": config.taps_rho or p.tree.rho},
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out, rows, meta, runs)
    pngs = plots.write_plots(out, rows, runs)
    report.write_markdown(out, rows, meta, [str(x) for x in pngs])
    return {**meta, "rows": rows}
