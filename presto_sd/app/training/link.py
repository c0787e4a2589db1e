"""``presto-sd train link``: the next drafter of a warm-start chain, in one resumable command.

A link is what the shipped SmolLM2 drafter grew by (docs/training.md): the parent trained on
corpus shards it never saw, fitted its acceptance predictors on the shards after those, and
judged against its parent. The choices a link makes (which rho its ``presto.json`` names;
whether it beats its parent) are made by the replay on a held-out prompt set that nothing
trains on: ShareGPT's held-out split by default, never a benchmark set. Each step leaves its
output in the link's dir and is skipped when it is there, so an interrupted link resumes:

    data/        the shards' features and soft labels (``train features``; cached by sha256)
    run/         the training run (``train drafter --init-drafter PARENT``; resumable)
    candidate/   the exported drafter with its predictors (``train export``, ``train acceptance``)
    choice/      one replay per (drafter, rho) (``bench --replay``)
    link_report.json   the taus, the rho chosen, and whether the candidate beats its parent

Shipping stays a person's act: the report names the command that copies the candidate.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from presto_sd.app.datasets import BENCHMARKS
from presto_sd.app.training.grow_corpus import DEFAULT_CORPUS

CHOICE_METHOD = "presto-best-first"  # the CLI default's builder: what a rho is chosen for


@dataclass(frozen=True)
class LinkConfig:
    work: str = field(metadata={"help": "the link's dir: data/, run/, candidate/, choice/, its report"})
    first_shard: int = field(metadata={"help": "the first corpus shard the parent never saw"})
    shards: int = field(metadata={"help": "corpus shards to train on; the acceptance predictors are fitted "
                                          "on the shards after them"})
    parent: str = field(default="", metadata={"help": "the drafter dir to start from ('' = the shipped one)"})
    corpus: str = DEFAULT_CORPUS
    target: str | None = None
    steps: int = 3000
    lr: float = 5e-4
    soft_weight: float = 0.5
    bf16: bool = False
    grow_layers: int = 0
    batch_seqs: int = 8
    heldout_seqs: int = 64
    ckpt_every: int = 250
    acceptance_prompts: int = 60
    acceptance_tokens: int = 64
    choose_on: str = field(default="sharegpt", metadata={
        "help": "the prompts the choices are made on: a dataset's held-out split (never a benchmark) "
                "or a JSONL prompts file"})
    choose_n: int = 24
    budgets: tuple[int, ...] = (4, 16)
    max_new_tokens: int = 128
    dtype: str = "bfloat16"  # the target's, for the features (float32 on a CPU without native bf16)


class LinkError(ValueError):
    """A link that cannot run as asked (a benchmark to choose on, no shards past its window)."""


def run_link(cfg: LinkConfig) -> dict:
    """Every step of the link not done yet; returns (and writes) the link's report."""
    if cfg.choose_on in BENCHMARKS:
        raise LinkError(f"--choose-on {cfg.choose_on}: a benchmark set; a link's choices are made on "
                        "held-out prompts nothing trains or is judged on (sharegpt, or a JSONL file)")
    from presto_sd.models.loading import DEFAULT_DRAFTER

    work = Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    parent = Path(cfg.parent) if cfg.parent else DEFAULT_DRAFTER
    parent_config = json.loads((parent / "config.json").read_text())
    data = _features(cfg, work / "data", parent_config)
    candidate = work / "candidate"
    if not (candidate / "model.safetensors").is_file():
        from presto_sd.app.training.export import export_drafter

        export_drafter(_train(cfg, data, work / "run", parent), candidate)
    if not (candidate / "acceptance_report.json").is_file():
        _acceptance(cfg, data, candidate, parent_config)
    report = _choose(cfg, work / "choice", parent, candidate)
    (work / "link_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _features(cfg: LinkConfig, out: Path, parent_config: dict) -> Path:
    import torch

    from presto_sd.app.training.features import materialize
    from presto_sd.app.training.token_corpus import Corpus

    later = [i for i in Corpus(cfg.corpus).indices() if i >= cfg.first_shard + cfg.shards]
    if not later:
        raise LinkError(f"the corpus has no shard from {cfg.first_shard + cfg.shards} on: the acceptance "
                        "traces need held-out shards after the link's window (grow the corpus first)")
    meta = out / "meta.json"
    if meta.is_file():
        done = json.loads(meta.read_text())
        if (done["first_shard"], done["shards"]) == (cfg.first_shard, cfg.shards):
            return out
    from presto_sd.models.loading import load_target

    model, _ = load_target(cfg.target, torch.device("cpu"), getattr(torch, cfg.dtype))
    layers = tuple(parent_config["dflash_config"]["target_layer_ids"])
    return materialize(cfg.corpus, out, model, cfg.target, layers, max_shards=cfg.shards,
                       first_shard=cfg.first_shard)


def _train(cfg: LinkConfig, data: Path, run: Path, parent: Path) -> Path:
    from presto_sd.app.training.train_drafter import TrainConfig, train_drafter

    return train_drafter(TrainConfig(
        data=str(data), out=str(run), target=cfg.target, steps=cfg.steps, lr=cfg.lr,
        soft_weight=cfg.soft_weight, ckpt_every=cfg.ckpt_every, init_drafter=str(parent), bf16=cfg.bf16,
        grow_layers=cfg.grow_layers, batch_seqs=cfg.batch_seqs, heldout_seqs=cfg.heldout_seqs))


def _acceptance(cfg: LinkConfig, data: Path, candidate: Path, parent_config: dict) -> None:
    from presto_sd.app.training.acceptance import AcceptanceConfig, train_acceptance

    block = parent_config["block_size"]
    train_acceptance(AcceptanceConfig(
        drafter=str(candidate), data=str(data), target=cfg.target, n_prompts=cfg.acceptance_prompts,
        max_new_tokens=cfg.acceptance_tokens, depth=min(AcceptanceConfig.depth, block - 1),
        corpus=cfg.corpus, corpus_from_shard=cfg.first_shard + cfg.shards))


def _replay(cfg: LinkConfig, drafter: Path, out: Path, rho: str, methods: str) -> dict[str, float]:
    """``bench --replay`` of ``drafter`` with ``rho`` (its output kept in ``out``): pooled tau
    per method and budget."""
    if not (out / "replay.json").is_file():
        from presto_sd.app.cli import build_parser

        is_file = Path(cfg.choose_on).is_file()
        argv = ["bench", "--replay", "--drafter", str(drafter), "--methods", methods,
                "--budgets", ",".join(map(str, cfg.budgets)), "--n", str(cfg.choose_n),
                "--max-new-tokens", str(cfg.max_new_tokens), "--rho", rho, "--positions-top-k", "0",
                "--no-progress", "--out", str(out),
                *(["--prompts-file", cfg.choose_on, "--datasets", ""] if is_file else
                  ["--datasets", cfg.choose_on]),
                *(["--target", cfg.target] if cfg.target else [])]
        args = build_parser().parse_args(argv)
        args.run(args)
    rows = json.loads((out / "replay.json").read_text())["rows"]
    pooled = [r for r in rows if r["dataset"] == "all"] or rows  # one set: its own rows
    return {r["method"] + (f"@{r['budget']}" if r["budget"] else ""): round(r["tau"], 4) for r in pooled}


def _choose(cfg: LinkConfig, choice: Path, parent: Path, candidate: Path) -> dict:
    """The candidate's rho (the one its presto-best-first reads best on the held-out prompts,
    averaged over the budgets), written into its ``presto.json``; and the verdict against
    the parent's own settings on the same prompts."""
    from presto_sd.models.assets import write_digests

    presto_file = candidate / "presto.json"
    presto = json.loads(presto_file.read_text())
    by_rho = {rho: _replay(cfg, candidate, choice / f"candidate-{rho}", rho,
                           "linear,marginal," + CHOICE_METHOD if k == 0 else CHOICE_METHOD)
              for k, rho in enumerate(sorted(presto["lambdas_by_rho"]))}
    parent_rho = json.loads((parent / "presto.json").read_text())["rho"]
    parent_tau = _replay(cfg, parent, choice / f"parent-{parent_rho}", parent_rho,
                         "linear,marginal," + CHOICE_METHOD)

    def score(taus: dict[str, float]) -> float:
        return sum(taus[f"{CHOICE_METHOD}@{b}"] for b in cfg.budgets) / len(cfg.budgets)

    rho = max(by_rho, key=lambda r: score(by_rho[r]))
    if presto["rho"] != rho:
        presto.update(rho=rho, lambdas=presto["lambdas_by_rho"][rho])
        presto_file.write_text(json.dumps(presto, indent=2))
        write_digests(candidate)
    wins = score(by_rho[rho]) > score(parent_tau)
    return {
        "config": {**asdict(cfg), "budgets": list(cfg.budgets)},  # as JSON reads it back
        "choose_on": cfg.choose_on,
        "parent": {"dir": str(parent), "rho": parent_rho, "tau": parent_tau},
        "candidate": {"dir": str(candidate), "rho": rho, "tau_by_rho": by_rho},
        "score": {"what": f"{CHOICE_METHOD} tau, mean over budgets {list(cfg.budgets)}",
                  "parent": round(score(parent_tau), 4), "candidate": round(score(by_rho[rho]), 4)},
        "wins": wins,
        "ship": (f"rm -r {parent} && cp -r {candidate} {parent}" if wins else
                 "the parent stays: the candidate does not beat it on the held-out prompts"),
    }

