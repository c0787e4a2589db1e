"""``presto-sd train ...``: data generation, drafter and acceptance-predictor training."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from presto_sd.app.errors import UsageError
from presto_sd.models.cache import cache_dir

DEFAULT_DATA = "data/smollm2-sharegpt"


def _add_dataclass_args(p: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per config field, typed from its default (tuples as comma lists); the
    help is the field's ``metadata["help"]`` where it has one."""
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        what = f.metadata.get("help", "")
        # typed from the annotation where the default cannot say (none, or None)
        kind = {"int": int, "float": float}.get(str(f.type).removesuffix(" | None"), str)
        if default is MISSING:  # a field without a default: a required flag
            p.add_argument(flag, type=kind, required=True, help=what or None)
        elif isinstance(default, bool):
            p.add_argument(flag, default=default, action=argparse.BooleanOptionalAction, help=what or None)
        elif isinstance(default, tuple):
            p.add_argument(flag, default=",".join(map(str, default)),
                           help=f"{what + '; ' if what else ''}comma-separated (default: %(default)s)")
        else:
            kind = type(default) if default is not None else kind
            p.add_argument(flag, type=kind, default=default,
                           help=f"{what + ' ' if what else ''}(default: %(default)s)")


def _to_config(cls, args: argparse.Namespace, **fixed):
    kwargs = dict(fixed)
    for f in fields(cls):
        if f.name in kwargs or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if isinstance(f.default, tuple) and isinstance(value, str):
            value = tuple(int(x) for x in value.split(",") if x)
        kwargs[f.name] = value
    return cls(**kwargs)


def register(sub: argparse._SubParsersAction) -> None:
    from presto_sd.app.training.gen_data import GenDataConfig
    from presto_sd.app.training.train_drafter import TrainConfig

    train = sub.add_parser("train", help="train a drafter and acceptance predictors for a target")
    tsub = train.add_subparsers(dest="train_command", required=True)

    gen = tsub.add_parser("gen-data", help="the target's own responses to ShareGPT training prompts, "
                          "with its features, written in resumable shards")
    _add_dataclass_args(gen, GenDataConfig, skip=("out",))
    gen.add_argument("--out", default=str(cache_dir() / DEFAULT_DATA), help="(default: %(default)s)")

    from presto_sd.app.training.grow_corpus import DEFAULT_CORPUS, GrowConfig

    grow = tsub.add_parser("grow-corpus", help="add the target's responses to the repo corpus (token ids, "
                           "resumable from the committed shards; docs/training.md)")
    _add_dataclass_args(grow, GrowConfig)

    feat = tsub.add_parser("features", help="a `train drafter --data` dir from the repo corpus: the target's "
                           "features and top-k soft labels, prefilled into the cache where missing")
    feat.add_argument("--corpus", default=DEFAULT_CORPUS, help="(default: %(default)s)")
    feat.add_argument("--out", default=str(cache_dir() / "data" / "corpus-features"),
                      help="(default: %(default)s)")
    feat.add_argument("--target", default=None, help="(default: SmolLM2-135M-Instruct)")
    feat.add_argument("--target-layer-ids", default="1,8,14,20,27", help="(default: %(default)s)")
    feat.add_argument("--top-k", type=int, default=16, help="soft labels per position (default: %(default)s)")
    feat.add_argument("--dtype", default="bfloat16",
                      help="(default: %(default)s; float32 on a CPU without native bf16)")
    feat.add_argument("--max-shards", type=int, default=0, help="n shards only (default: all)")
    feat.add_argument("--first-shard", type=int, default=0,
                      help="start at this shard, e.g. the first one a warm-started drafter's parent "
                           "never saw (default: %(default)s)")
    feat.add_argument("--sources", default="", help="only these plan sources' items, comma-separated "
                      "(sharegpt, code, arith, magpie; default: all)")

    from presto_sd.app.training.magpie import MagpieConfig

    mp = tsub.add_parser("magpie", help="the corpus's second plan: requests the target writes itself from "
                         "its chat template's empty user turn (sampled, kept in the repo), then its "
                         "greedy answers in a corpus of their own; resumable (docs/training.md)")
    _add_dataclass_args(mp, MagpieConfig)

    from presto_sd.app.training.written import WrittenConfig

    wr = tsub.add_parser("written", help="a corpus of answers as written (ShareGPT's, the stdlib's own "
                         "source for code prompts, opt-in worked solutions for arithmetic), mirroring "
                         "the repo corpus's shards: prefill-only data "
                         "(`train features --corpus` it, then `train drafter --hard-labels target`; "
                         "docs/training.md)")
    _add_dataclass_args(wr, WrittenConfig)

    dr = tsub.add_parser("drafter", help="train a DFlash drafter on gen-data shards (resumable)")
    _add_dataclass_args(dr, TrainConfig, skip=("data", "out"))
    dr.add_argument("--data", default=str(cache_dir() / DEFAULT_DATA),
                    help="a `train features` dir, or several comma-separated (e.g. the corpus's and the "
                         "written answers') (default: %(default)s)")
    dr.add_argument("--out", default="runs/drafter", help="(default: %(default)s)")

    ex = tsub.add_parser("export", help="a trained drafter checkpoint as a dir that ships: its weights in "
                         "bf16, its training log and report (then `train acceptance` on it)")
    ex.add_argument("--checkpoint", required=True, help="a `train drafter` run's drafter dir (RUN/drafter)")
    ex.add_argument("--out", required=True, help="the new drafter dir (must be new or empty)")
    ex.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="the weights' dtype on disk (default: %(default)s; loading casts to the target's)")

    av = tsub.add_parser("average", help="drafters' weights averaged into a new dir (a link's trained "
                         "weights with its parent's, or a chain's links), without predictors "
                         "(then `train export` and `train acceptance` on it)")
    av.add_argument("--drafters", required=True,
                    help="drafter dirs of one architecture and token map, comma-separated, the newest first "
                         "(its config, log and report are kept)")
    av.add_argument("--weights", default="", help="their weights, comma-separated (default: equal)")
    av.add_argument("--out", required=True, help="the new drafter dir (must be new or empty)")

    ah = tsub.add_parser("add-head", help="put a prefix head trained alone on a drafter (`train drafter "
                         "--init-drafter DIR --prefix-rank R --prefix-only`) into that drafter dir, digests "
                         "rewritten (then `train choose-lambda` on it)")
    ah.add_argument("--checkpoint", required=True, help="the head's `train drafter` run's drafter dir")
    ah.add_argument("--drafter", required=True, help="the drafter dir the head was trained on")

    from presto_sd.app.training.train_self import SelfTrainConfig

    sd = tsub.add_parser("self-draft", help="the self-speculative adapter (mask rows of the target draft "
                         "its next block) from the repo corpus's token ids (resumable; "
                         "docs/self_speculative.md)")
    _add_dataclass_args(sd, SelfTrainConfig)

    from presto_sd.app.training.acceptance import AcceptanceConfig

    acc = tsub.add_parser("acceptance", help="verification traces -> h_phi, n-gram table, lambda_d, "
                          "calibration report; written into the drafter dir")
    _add_dataclass_args(acc, AcceptanceConfig, skip=("drafter", "data"))
    acc.add_argument("--drafter", required=True, help="the drafter dir to equip")
    acc.add_argument("--data", default=str(cache_dir() / DEFAULT_DATA), help="gen-data shards (n-gram table)")

    from presto_sd.app.training.link import LinkConfig

    link = tsub.add_parser("link", help="the next drafter of a warm-start chain: features, training from "
                           "the parent, predictors, and the choices (rho; better than the parent?) made "
                           "by the replay on held-out prompts; resumable (docs/training.md)")
    _add_dataclass_args(link, LinkConfig)

    cs = tsub.add_parser("choose-set", help="the held-out mix a link chooses on (ShareGPT's held-out split, "
                         "code prompts on stdlib submodules, fresh word problems; none planned, none a "
                         "benchmark's) as a `bench --prompts-file` JSONL")
    cs.add_argument("--out", required=True, help="the JSONL file to write")
    cs.add_argument("--n", type=int, default=LinkConfig.choose_n,
                    help="prompts of each set (default: %(default)s)")
    cs.add_argument("--corpora", default=DEFAULT_CORPUS,
                    help="comma-separated corpora whose plans' prompts it leaves out, word for word "
                         "(default: %(default)s)")
    from presto_sd.app.training.choose_lambda import GRID, PROPOSING_RHOS

    cl = tsub.add_parser("choose-lambda", help="the lambda of a rho that proposes its own candidates "
                         "(prefix-ngram: children from the prefix head's conditional; ngram-lookup: the "
                         "marginal's top-K mixed with the request's own n-gram), chosen by the replay "
                         "on held-out prompts and written into the drafter's presto.json")
    cl.add_argument("--drafter", required=True, help="the drafter dir (with its presto.json)")
    cl.add_argument("--prompts-file", required=True,
                    help="held-out prompts, a `bench --prompts-file` JSONL (`train choose-set` writes "
                         "the mix a link chooses on); never a benchmark's")
    cl.add_argument("--n", type=int, default=LinkConfig.choose_n,
                    help="prompts of each set in the file (default: %(default)s)")
    cl.add_argument("--rho", default=PROPOSING_RHOS[0], choices=PROPOSING_RHOS, help="(default: %(default)s)")
    cl.add_argument("--grid", default=",".join(f"{x:g}" for x in GRID),
                    help="lambdas to try (default: %(default)s)")
    cl.add_argument("--budgets", default="4,16",
                    help="tree budgets the score averages (default: %(default)s)")
    cl.add_argument("--max-new-tokens", type=int, default=LinkConfig.max_new_tokens,
                    help="(default: %(default)s)")
    cl.add_argument("--target", default=None, help="the target (default: the drafter's own)")
    cl.add_argument("--out", required=True, help="a dir for the replays and lambda_report.json (reused)")
    cl.add_argument("--make-default", action="store_true",
                    help="also make the rho the drafter's default where it beats the current default's "
                         "score (by tau alone: time it live first, scripts/rho_ab.py)")
    train.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.train_command == "gen-data":
        from presto_sd.app.training.gen_data import GenDataConfig, generate_training_data

        print(generate_training_data(_to_config(GenDataConfig, args)))
    elif args.train_command == "grow-corpus":
        from presto_sd.app.training.grow_corpus import GrowConfig, grow_corpus

        print(grow_corpus(_to_config(GrowConfig, args)))
    elif args.train_command == "features":
        import torch

        from presto_sd.app.training.features import materialize
        from presto_sd.models.loading import load_target

        model, _ = load_target(args.target, torch.device("cpu"), getattr(torch, args.dtype))
        layers = tuple(int(x) for x in args.target_layer_ids.split(","))
        sources = tuple(x for x in args.sources.split(",") if x)
        print(materialize(args.corpus, args.out, model, args.target, layers, args.top_k, args.max_shards,
                          args.first_shard, sources))
    elif args.train_command == "magpie":
        from presto_sd.app.training.magpie import MagpieConfig, run_magpie

        print(run_magpie(_to_config(MagpieConfig, args)))
    elif args.train_command == "written":
        from presto_sd.app.training.written import WrittenConfig, write_written_corpus

        print(write_written_corpus(_to_config(WrittenConfig, args)))
    elif args.train_command == "drafter":
        from presto_sd.app.training.train_drafter import TrainConfig, train_drafter

        print(train_drafter(_to_config(TrainConfig, args)))
    elif args.train_command == "self-draft":
        from presto_sd.app.training.train_self import SelfTrainConfig, train_self_draft

        print(train_self_draft(_to_config(SelfTrainConfig, args)))
    elif args.train_command == "export":
        import torch

        from presto_sd.app.training.export import export_drafter

        print(export_drafter(args.checkpoint, args.out, getattr(torch, args.dtype)))
    elif args.train_command == "average":
        from presto_sd.app.training.average import average_drafters

        try:  # the files named on the command line: what the user asked for, not a bug
            weights = [float(w) for w in args.weights.split(",")] if args.weights else None
            print(average_drafters(args.drafters.split(","), args.out, weights))
        except (FileExistsError, FileNotFoundError, ValueError) as e:
            raise UsageError(f"train average: {e}") from None
    elif args.train_command == "add-head":
        from presto_sd.app.training.export import add_prefix_head

        print(add_prefix_head(args.checkpoint, args.drafter))
    elif args.train_command == "acceptance":
        import json

        from presto_sd.app.training.acceptance import AcceptanceConfig, train_acceptance

        report = train_acceptance(_to_config(AcceptanceConfig, args))
        print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))
    elif args.train_command == "link":
        import json

        from presto_sd.app.training.link import LinkConfig, run_link

        report = run_link(_to_config(LinkConfig, args))
        print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))
    elif args.train_command == "choose-lambda":
        import json

        from presto_sd.app.training.choose_lambda import choose_lambda

        prompts = ["--prompts-file", args.prompts_file, "--datasets", "", "--n", str(args.n)]
        print(json.dumps(choose_lambda(
            args.drafter, prompts, args.out, args.rho, [float(x) for x in args.grid.split(",")],
            [int(x) for x in args.budgets.split(",")], args.max_new_tokens, args.target,
            args.make_default), indent=2))
    elif args.train_command == "choose-set":
        from presto_sd.app.training.choose_set import write_heldout_mix

        print(write_heldout_mix(args.out, args.n, tuple(c for c in args.corpora.split(",") if c)))
    return 0
