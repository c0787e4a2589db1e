"""``presto-sd train link``: the next drafter of a warm-start chain, in one resumable command.

A link is what the shipped SmolLM2 drafter grew by (docs/training.md): the parent trained on
corpus shards it never saw, fitted its acceptance predictors on the shards after those, and
judged against its parent. The choices a link makes (which rho its ``presto.json`` names;
whether it beats its parent) are made by the replay on a held-out prompt set that nothing
trains on: by default a mix of ShareGPT's held-out split, code and arithmetic prompts no plan
holds (``choose_set.py``), never a benchmark set. Each step leaves its
output in the link's dir and is skipped when it is there, so an interrupted link resumes
(with the settings it started with: ``link.json``; other settings are refused):

    data/        the shards' features and soft labels (``train features``; cached by sha256)
    run/         the training run (``train drafter --init-drafter PARENT``; resumable)
    averaged/    its weights averaged with the parent's (``train average``; ``--average``, 0.5)
    candidate/   the exported drafter with its predictors (``train export``, ``train acceptance``)
    choice/      the held-out mix (``heldout-mix.jsonl``), one replay per (drafter, rho) (``bench --replay``);
                 ``candidate-lambda/RHO/``: the lambda of each rho that proposes its own candidates
                 (``choose_lambda``: ngram-lookup; prefix-ngram with a head); a rho one drafter
                 lacks is replayed for it at the other's lambdas
    link_report.json   the taus, each drafter's best rho, and whether the candidate beats its parent

Shipping stays a person's act: the report names the command that copies the candidate.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from presto_sd.app.datasets import BENCHMARKS, DATASETS
from presto_sd.app.errors import UsageError
from presto_sd.app.training.choose_lambda import PROPOSING_RHOS, REPORTED_ONLY_RHOS, choose_lambda
from presto_sd.app.training.choose_set import HELDOUT_MIX, write_heldout_mix
from presto_sd.app.training.export import HEAD_RHOS
from presto_sd.app.training.grow_corpus import DEFAULT_CORPUS
from presto_sd.app.training.held_out_replay import (
    CHOICE_METHOD,
    by_set,
    choice_score,
    held_out_replay,
    pooled,
)
from presto_sd.app.training.written import DEFAULT_WRITTEN_SOURCES, written_sources
from presto_sd.models.assets import DIGESTS_FILE, has_prefix_head


@dataclass(frozen=True)
class LinkConfig:
    work: str = field(metadata={"help": "the link's dir: data/, run/, candidate/, choice/, its report"})
    first_shard: int = field(metadata={"help": "the window's first corpus shard (the first the parent "
                                                 "never saw, while the corpus has unseen shards)"})
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
    acceptance_from_shard: int | None = field(default=None, metadata={
        "help": "the first corpus shard the acceptance predictors are traced on (default: the one after the "
                "window); a window over shards the chain saw before can name shards no link trained on"})
    acceptance_tokens: int = 64
    choose_on: str = field(default=HELDOUT_MIX, metadata={
        "help": f"the prompts the choices are made on: '{HELDOUT_MIX}' (ShareGPT's held-out split, code "
                "prompts on stdlib submodules and fresh word problems, --choose-n of each: `train "
                "choose-set`), a dataset's held-out split (never a benchmark) or a JSONL prompts file"})
    choose_n: int = field(default=24, metadata={"help": "prompts of each set chosen on (the held-out mix: "
                                                        "3 x this many)"})
    budgets: tuple[int, ...] = (4, 16)
    max_new_tokens: int = 128
    dtype: str = "bfloat16"  # the target's, for the features (float32 on a CPU without native bf16)
    written: bool = field(default=False, metadata={
        "help": "also train on the window's items answered as written (ShareGPT's answers, the stdlib's "
                "own source for code items: prefill-only data, `train written`; a step on ShareGPT's "
                "taught as much as one on regenerated answers, from scratch at 0.37 M tokens: "
                "docs/training.md)"})
    mix: str = field(default="", metadata={
        "help": "windows of other corpora trained on beside this one, comma-separated CORPUS:FIRST:SHARDS "
                "(their answers as the corpus holds them; e.g. corpus/smollm2-135m:98:49 beside a magpie "
                "window: magpie answers alone pulled the drafter off math and code, docs/training.md); "
                "the n-gram rho table is fitted on every window"})
    average: float = field(default=0.5, metadata={
        "help": "the trained weights' share of their average with the parent's, which is the candidate "
                "(1 = the trained weights alone, as every link through the fourteenth made; the fourteenth's "
                "midpoint beat both ends on every drafter-only row: docs/training.md)"})
    written_sources: str = field(default=DEFAULT_WRITTEN_SOURCES, metadata={
        "help": "with --written: the plan sources whose written answers it trains on (sharegpt, code, "
                "arith: templated worked solutions, not yet measured)"})

    @property
    def choose_on_file(self) -> bool:
        """Are the choices made on a JSONL prompts file of the user's (else on the held-out mix
        or a dataset's held-out split)?"""
        return self.choose_on != HELDOUT_MIX and Path(self.choose_on).is_file()


class LinkError(UsageError, ValueError):
    """A link that cannot run as asked (a benchmark to choose on, no shards past its window)."""


@dataclass(frozen=True)
class MixWindow:
    """A window of another corpus a link trains on beside its own (``--mix``)."""

    corpus: str
    first_shard: int
    shards: int


def mix_windows(spec: str) -> list[MixWindow]:
    """``CORPUS:FIRST:SHARDS,...`` -> windows; a malformed one is a ``LinkError``."""
    windows = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        corpus, _, rest = part.rpartition(":")
        corpus, _, first = corpus.rpartition(":")
        try:
            window = MixWindow(corpus, int(first), int(rest))
        except ValueError:
            window = None
        if window is None or not corpus or window.first_shard < 0 or window.shards < 1:
            raise LinkError(f"--mix {part!r}: expected CORPUS:FIRST:SHARDS (a shard >= 0, at least 1 shard)")
        windows.append(window)
    return windows


def run_link(cfg: LinkConfig) -> dict:
    """Every step of the link not done yet; returns (and writes) the link's report. A link's
    dir is for one set of settings: resuming it with others is refused (a new ``--work``)."""
    _check(cfg)
    from presto_sd.models.loading import DEFAULT_DRAFTER

    work = Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    settings, asked = work / "link.json", _settings(cfg)
    if settings.is_file() and (changed := _changed(was := json.loads(settings.read_text()), asked)):
        hint = (f" (it chose on {was['choose_on']!r}: --choose-on {was['choose_on']})"
                if "choose_on" in changed and "choose_on" in was else "")
        if "average" in changed and "average" not in was:
            hint += " (made before --average, its candidate is its trained weights alone: --average 1)"
        raise LinkError(f"{work} holds a link made with other settings ({', '.join(changed)}){hint}: "
                        "give a new --work, or the same settings to resume it")
    if not settings.is_file():
        settings.write_text(json.dumps(asked, indent=2) + "\n")
    # written before the hours of features and training: a mix that cannot be made fails now
    prompts = _choice_prompts(cfg, work / "choice")
    parent = Path(cfg.parent) if cfg.parent else DEFAULT_DRAFTER
    candidate = work / "candidate"
    # train_acceptance writes the digests last: a fitted candidate needs no features any more, so
    # a link dir carried to another machine without data/ and run/ goes on at the choice
    if not (candidate / DIGESTS_FILE).is_file():
        _fitted_candidate(cfg, work, parent, candidate)
    _proposing_lambdas(cfg, candidate, work / "choice" / "candidate-lambda", prompts)
    report = _choose(cfg, work / "choice", parent, candidate, prompts)
    (work / "link_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _fitted_candidate(cfg: LinkConfig, work: Path, parent: Path, candidate: Path) -> None:
    """The features, the training, the export and the acceptance predictors: each skipped where done."""
    parent_config = json.loads((parent / "config.json").read_text())
    data = _features(cfg, work / "data", parent_config)
    # the target's own answers: this window's, then each --mix window's (the n-gram table's text too)
    answers = [str(data)] + [
        str(_features(replace(cfg, corpus=m.corpus, first_shard=m.first_shard, shards=m.shards),
                      work / f"mix{j}-data", parent_config))
        for j, m in enumerate(mix_windows(cfg.mix))]
    train_data = ",".join(answers)
    if cfg.written:  # the window's items answered as written, beside the target's answers
        train_data += f",{_written_features(cfg, work, parent_config)}"
    if not candidate.is_dir():  # exported beside it, then renamed: a dir there is a whole export
        from presto_sd.app.training.export import export_drafter

        trained = _train(cfg, train_data, work / "run", parent)
        if cfg.average < 1:
            trained = _averaged(parent, trained, work / "averaged", cfg.average)
        staged = work / "candidate.export"
        shutil.rmtree(staged, ignore_errors=True)
        export_drafter(trained, staged).rename(candidate)
    # its n-gram table models the target's own text: the regenerated answers only
    _acceptance(cfg, ",".join(answers), candidate, parent_config)


def _settings(cfg: LinkConfig) -> dict:
    return {**asdict(cfg), "budgets": list(cfg.budgets)}  # as JSON reads it back


# a setting added since a dir was made reads as what such a dir did (else as its default)
BEFORE_THE_SETTING = {"average": 1.0}


def _changed(was: dict, asked: dict) -> list[str]:
    """The settings a link dir was made with that differ from these; a setting added since
    (absent from its link.json) reads as what the dir did without it, so older dirs still
    resume. Where the dir lies is not a setting: a dir moved (to another machine) resumes."""
    defaults = {**_settings(LinkConfig(work="", first_shard=0, shards=0)), **BEFORE_THE_SETTING}
    return sorted(k for k in asked if k != "work" and was.get(k, defaults[k]) != asked[k])


def _check(cfg: LinkConfig) -> None:
    """Refuse, before anything runs, a benchmark to choose on and a window the corpus cannot
    fill: its shards, and after them the acceptance fit's prompts."""
    from presto_sd.app.flags import csv
    from presto_sd.app.training.token_corpus import Corpus

    if cfg.choose_on != HELDOUT_MIX and not cfg.choose_on_file:  # datasets' held-out splits
        sets = csv(cfg.choose_on)
        if bench := sorted(set(sets) & BENCHMARKS):
            raise LinkError(f"--choose-on {cfg.choose_on}: {', '.join(bench)} is a benchmark set; a link's "
                            f"choices are made on held-out prompts nothing trains or is judged on "
                            f"({HELDOUT_MIX}, sharegpt, or a JSONL file)")
        if not sets or (unknown := [s for s in sets if s not in DATASETS]):
            known = ", ".join(sorted(set(DATASETS) - BENCHMARKS))
            raise LinkError(f"--choose-on {cfg.choose_on}: {', '.join(unknown) if sets else 'nothing'} is "
                            f"neither {HELDOUT_MIX}, a dataset ({known}) nor a JSONL file")
    if not 0.0 < cfg.average <= 1.0:
        raise LinkError(f"--average {cfg.average}: the trained weights' share, in (0, 1]")
    if cfg.average < 1 and cfg.grow_layers:
        raise LinkError("--grow-layers with --average below 1: a grown drafter's weights do not match its "
                        "parent's (give --average 1)")
    if cfg.choose_n < 1:
        raise LinkError(f"--choose-n {cfg.choose_n}: the choice needs at least 1 prompt a set")
    if cfg.written:  # checked here, not hours later past the features
        written_sources(cfg.written_sources, "--written-sources")

    def lacking(held: dict, first: int, n: int) -> list[int]:
        return [i for i in range(first, first + n) if str(i) not in held]

    for m in mix_windows(cfg.mix):
        if missing := lacking(Corpus(m.corpus).manifest()["shards"], m.first_shard, m.shards):
            raise LinkError(f"--mix {m.corpus}:{m.first_shard}:{m.shards}: the corpus lacks {missing[:4]}")
    shards = Corpus(cfg.corpus).manifest()["shards"]
    end = cfg.first_shard + cfg.shards
    missing = lacking(shards, cfg.first_shard, cfg.shards)
    if cfg.shards < 1 or missing:
        raise LinkError(f"shards {cfg.first_shard}-{end - 1}: the corpus lacks {missing[:4]} (grow it first)")
    start = _acceptance_start(cfg)
    if cfg.first_shard <= start < end:
        raise LinkError(f"--acceptance-from-shard {start} lies in the window {cfg.first_shard}-{end - 1}: "
                        "the predictors must be fitted on prompts the candidate does not train on")
    held = sum(e["sequences"] for i, e in shards.items() if int(i) >= start)
    if held < cfg.acceptance_prompts:
        raise LinkError(f"the corpus has {held} prompts in its shards from {start} on, the acceptance fit "
                        f"asks {cfg.acceptance_prompts}: its predictors are fitted on shards after the "
                        "link's window (grow the corpus first)")


def _acceptance_start(cfg: LinkConfig) -> int:
    """The first shard the predictors are traced on: the one after the window unless named."""
    return cfg.first_shard + cfg.shards if cfg.acceptance_from_shard is None else cfg.acceptance_from_shard


def _features(cfg: LinkConfig, out: Path, parent_config: dict) -> Path:
    import torch

    from presto_sd.app.training.features import materialize

    meta = out / "meta.json"
    if meta.is_file():
        return out
    from presto_sd.models.loading import load_target

    model, _ = load_target(cfg.target, torch.device("cpu"), getattr(torch, cfg.dtype))
    layers = tuple(parent_config["dflash_config"]["target_layer_ids"])
    return materialize(cfg.corpus, out, model, cfg.target, layers, max_shards=cfg.shards,
                       first_shard=cfg.first_shard)


def _written_features(cfg: LinkConfig, work: Path, parent_config: dict) -> Path:
    from presto_sd.app.training.written import WrittenConfig, write_written_corpus

    written = write_written_corpus(WrittenConfig(
        out=str(work / "written-corpus"), first_shard=cfg.first_shard, shards=cfg.shards, corpus=cfg.corpus,
        target=cfg.target, sources=cfg.written_sources))
    return _features(replace(cfg, corpus=str(written)), work / "written-data", parent_config)


def _train(cfg: LinkConfig, data: str, run: Path, parent: Path) -> Path:
    from presto_sd.app.training.train_drafter import TrainConfig, train_drafter

    return train_drafter(TrainConfig(
        data=data, out=str(run), target=cfg.target, steps=cfg.steps, lr=cfg.lr,
        soft_weight=cfg.soft_weight, ckpt_every=cfg.ckpt_every, init_drafter=str(parent), bf16=cfg.bf16,
        grow_layers=cfg.grow_layers, batch_seqs=cfg.batch_seqs, heldout_seqs=cfg.heldout_seqs,
        # beside written answers the hard label is the target's own choice (for its answers the same)
        hard_labels="target" if cfg.written else "tokens"))


def _averaged(parent: Path, trained: Path, out: Path, share: float) -> Path:
    """The trained weights averaged with the parent's, in fp32 (the export casts)."""
    import torch

    from presto_sd.app.training.average import REPORT, average_drafters

    if (out / REPORT).is_file():  # written last: the dir is whole
        return out
    shutil.rmtree(out, ignore_errors=True)
    return average_drafters([trained, parent], out, [share, 1.0 - share], dtype=torch.float32)


def _acceptance(cfg: LinkConfig, data: str, candidate: Path, parent_config: dict) -> None:
    from presto_sd.app.training.acceptance import AcceptanceConfig, train_acceptance

    block = parent_config["block_size"]
    train_acceptance(AcceptanceConfig(
        drafter=str(candidate), data=data, target=cfg.target, n_prompts=cfg.acceptance_prompts,
        max_new_tokens=cfg.acceptance_tokens, depth=min(AcceptanceConfig.depth, block - 1),
        corpus=cfg.corpus, corpus_from_shard=_acceptance_start(cfg)))


def _proposing_lambdas(cfg: LinkConfig, candidate: Path, out: Path, prompts: list[str]) -> None:
    """The lambda of each rho that proposes its own children (a prefix head's: only with a
    head), which `train acceptance` cannot fit, chosen on the held-out prompts (``choose_lambda``)."""
    fitted = json.loads((candidate / "presto.json").read_text()).get("lambdas_by_rho", {})
    for rho in PROPOSING_RHOS:
        if rho not in fitted and (rho not in HEAD_RHOS or has_prefix_head(candidate)):
            choose_lambda(candidate, prompts, out / rho, rho, budgets=cfg.budgets,
                          max_new_tokens=cfg.max_new_tokens, target=cfg.target)


def _choice_prompts(cfg: LinkConfig, choice: Path) -> list[str]:
    """``bench`` flags for the prompts the choice replays (the held-out mix written once)."""
    if cfg.choose_on == HELDOUT_MIX:
        mix = choice / "heldout-mix.jsonl"
        if not mix.is_file():  # none of its prompts a user turn of the plans the link trains on
            write_heldout_mix(mix, cfg.choose_n, (cfg.corpus, *(m.corpus for m in mix_windows(cfg.mix))))
        source = ["--prompts-file", str(mix), "--datasets", ""]
    elif cfg.choose_on_file:
        source = ["--prompts-file", cfg.choose_on, "--datasets", ""]
    else:
        source = ["--datasets", cfg.choose_on]
    return [*source, "--n", str(cfg.choose_n)]


def _prompts_record(prompts: list[str]) -> dict:
    """What the choice replayed: its bench flags and a prompts file's sha256 (a verdict names its prompts)."""
    record: dict = {"flags": prompts}
    if "--prompts-file" in prompts:
        from presto_sd.models.loading import sha256_of

        record["sha256"] = sha256_of(Path(prompts[prompts.index("--prompts-file") + 1]))
    return record


def _replay(cfg: LinkConfig, drafter: Path, out: Path, rho: str, methods: str,
            prompts: list[str], lambdas: list[float] | None = None) -> list[dict]:
    return held_out_replay(drafter, out, rho, methods, prompts, cfg.budgets, cfg.max_new_tokens, cfg.target,
                           lambdas)


def _choose(cfg: LinkConfig, choice: Path, parent: Path, candidate: Path, prompts: list[str]) -> dict:
    """Each drafter replayed on the held-out prompts with every rho it has lambdas for (and a
    proposing rho only the other has, at the other's lambdas); the candidate's best rho
    (presto-best-first tau averaged over the budgets) written into its ``presto.json``; and
    the verdict, each drafter at its best rho whose lambdas `train acceptance` fitted on
    traces: a proposing rho's lambda was chosen on these very prompts (for the candidate
    alone), so judging with it would tilt the verdict towards the one that chose."""
    from presto_sd.models.assets import file_digests, write_digests

    fitted = {who: json.loads((d / "presto.json").read_text())["lambdas_by_rho"]
              for who, d in (("candidate", candidate), ("parent", parent))}

    def by_rho(drafter: Path, name: str) -> dict[str, list[dict]]:
        own, other = fitted[name], fitted["parent" if name == "candidate" else "candidate"]
        borrowed = [r for r in other if r in PROPOSING_RHOS and r not in own
                    and (r not in HEAD_RHOS or has_prefix_head(drafter))]
        return {rho: _replay(cfg, drafter, choice / f"{name}-{rho}", rho,
                             "linear,marginal," + CHOICE_METHOD if k == 0 else CHOICE_METHOD, prompts,
                             other[rho] if rho in borrowed else None)
                for k, rho in enumerate(sorted([*own, *borrowed]))}

    def score(taus: dict[str, float]) -> float:
        return choice_score(taus, cfg.budgets)

    def best(taus: dict[str, dict[str, float]], rhos: list[str]) -> str:
        return max((r for r in taus if r in rhos), key=lambda r: score(taus[r]))

    my_rows, their_rows = by_rho(candidate, "candidate"), by_rho(parent, "parent")
    mine, theirs = ({rho: pooled(rows) for rho, rows in t.items()} for t in (my_rows, their_rows))
    # the candidate's default, of its own rhos: a head's proposing rho is replayed and reported,
    # never chosen (its tree building, which a replay does not see, ate its tau at budget 4)
    rho = best(mine, [r for r in fitted["candidate"] if r not in REPORTED_ONLY_RHOS])
    judged, parent_rho = (best(t, [r for r in fitted[who] if r not in PROPOSING_RHOS])
                          for t, who in ((mine, "candidate"), (theirs, "parent")))
    presto_file = candidate / "presto.json"
    presto = json.loads(presto_file.read_text())
    if (presto["rho"], presto["lambdas"]) != (rho, presto["lambdas_by_rho"][rho]):
        presto.update(rho=rho, lambdas=presto["lambdas_by_rho"][rho])
        presto_file.write_text(json.dumps(presto, indent=2))
    # checked every time: a stop between the two writes must not leave digests that refuse the dir
    if json.loads((candidate / DIGESTS_FILE).read_text()) != file_digests(candidate):
        write_digests(candidate)
    # (the parent may read best at another rho than its presto.json names: parent.rho says so)
    wins = score(mine[judged]) > score(theirs[parent_rho])
    return {
        "config": _settings(cfg),
        "prompts": _prompts_record(prompts),
        # by_set: at the rho each is judged at, a set each (a link can win pooled and lose code)
        "parent": {"dir": str(parent), "rho": parent_rho, "tau_by_rho": theirs,
                   "by_set": by_set(their_rows[parent_rho])},
        "candidate": {"dir": str(candidate), "rho": rho, "judged_at": judged, "tau_by_rho": mine,
                      "by_set": by_set(my_rows[judged])},
        "score": {"what": f"{CHOICE_METHOD} tau, mean over budgets {list(cfg.budgets)}, each at its best "
                          "rho of those `train acceptance` fitted",
                  "parent": round(score(theirs[parent_rho]), 4), "candidate": round(score(mine[judged]), 4)},
        "wins": wins,
        "ship": f"rm -r {parent} && cp -r {candidate} {parent}" if wins else
                "the parent stays: the candidate does not beat it on the held-out prompts",
    }
