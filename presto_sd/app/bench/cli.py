"""``presto-sd bench``: every drafting method side by side with AR and a peer, on the machine at hand.

    presto-sd bench --datasets gsm8k,humaneval,mtbench --n 10 --max-new-tokens 128 \\
        --methods ar,hf-generate,hf-prompt-lookup,linear,marginal,presto-beam,presto-best-first \\
        --budgets 8,16,32,64 --out runs/bench
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from presto_sd.app.flags import add_model_args, add_sampling_args, add_tree_args, csv

DEFAULT_DATASETS = "gsm8k,humaneval,mtbench"
DEFAULT_METHODS = ("ar,hf-generate,hf-prompt-lookup,llama-cpp,linear,marginal,presto-beam,presto-best-first,"
                   "taps")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="measure every drafting method against AR and transformers' prompt lookup",
        description="Decode benchmark prompts with each (method, budget), interleaved prompt by "
                    "prompt; write DIR/results.json, results.md, runs.jsonl and PNG plots.",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--datasets", default=None,
                   help=f"comma-separated benchmark sets (default: {DEFAULT_DATASETS}, "
                        "or none when --prompts-file is given)")
    w.add_argument("--prompts-file", default=None,
                   help='a JSONL file of {"prompt": ...} or {"messages": [...]} (its own dataset, or '
                        'the sets its lines name in "dataset")')
    w.add_argument("--n", type=int, default=10, help="prompts per dataset (the first N)")
    w.add_argument("--no-chat", action="store_true", help="feed prompts raw, without the chat template")
    w.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated (default: %(default)s); ar always runs (the baseline)")
    w.add_argument("--budget", type=int, default=16, help="draft tree nodes per round (root excluded)")
    w.add_argument("--budgets", default=None,
                   help="comma-separated budget sweep, e.g. 8,16,32,64 (overrides --budget)")
    w.add_argument("--out", default="runs/bench", help="output dir (default: %(default)s)")
    w.add_argument("--gguf", default=None,
                   help="llama-cpp: the GGUF file llama.cpp decodes (default: the target's own, where the "
                        "target is a .gguf or the default SmolLM2); the row is skipped, saying why, where "
                        "llama-cpp-python is not installed (pip install -e '.[peers]')")
    w.add_argument("--self-draft", default=None, metavar="DIR",
                   help="the self-draft adapter the self-* methods run with (self-linear, self-marginal, "
                        "self-presto-best-first, ...: each method in the self-speculative mode, beside "
                        "the drafter's rows; default: the shipped adapter)")
    w.add_argument("--no-warmup", action="store_true", help="skip the discarded warm-up generations")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.add_argument("--replay", action="store_true",
                   help="offline tau replay (greedy): one recorded AR pass per prompt stands in for the "
                        "target, so every builder and budget costs only its drafting; writes "
                        "DIR/replay.json (tau per method and budget, the drafter's recall@K per depth "
                        "and the oracle accepted length over its top-K). taps and the hf-* peers "
                        "are skipped: their rounds follow measured time")
    w.add_argument("--recordings", default=None,
                   help="replay: a file of recorded AR passes to reuse or create "
                        "(default: one per target, prompts and length in the cache)")
    w.add_argument("--positions-top-k", type=int, default=16,
                   help="replay: K for recall@K and the top-K oracle; 0 skips the per-position pass "
                        "(default: %(default)s)")
    t = p.add_argument_group("drafting")
    add_tree_args(t)
    t.add_argument("--rho", default=None,
                   help="PRESTO rho provider: ngram | ngram-lookup | hphi | constant | prefix | prefix-ngram "
                        "| prefix-lookup (the last three: drafters with a prefix head)")
    t.add_argument("--lambda", dest="lambdas", default=None, help="lambda_d: one value or per depth")
    t.add_argument("--taps-cap", type=int, default=64,
                   help="taps: the most draft nodes a round may choose (default: %(default)s)")
    t.add_argument("--taps-rho", default=None,
                   help="taps: acceptance provider hphi | ngram | constant | marginal "
                        "(default: hphi when the drafter ships it, else --rho)")
    t.add_argument("--lookup-tokens", type=int, default=10,
                   help="hf-prompt-lookup: prompt_lookup_num_tokens (default: %(default)s)")
    add_sampling_args(p, "0 = greedy (lossless is checked)")
    add_model_args(p, "as for generate (default: SmolLM2-135M-Instruct)",
                   "as for generate ('random' = untrained)")
    p.set_defaults(run=run)


def self_draft_for(args: argparse.Namespace) -> str | None:
    """The adapter dir the self-* methods need: ``--self-draft``, else the shipped one; None
    when no self-* method runs."""
    from presto_sd.app.bench.methods import SELF
    from presto_sd.embedded.stack import DEFAULT_SELF_DRAFT

    if not any(m.startswith(SELF) for m in csv(args.methods)):
        return None
    path = Path(args.self_draft) if args.self_draft else DEFAULT_SELF_DRAFT
    if not path.is_dir():
        raise SystemExit(f"presto-sd bench: the self-* methods need a self-draft adapter: no dir {path} "
                         "(presto-sd train self-draft makes one; --self-draft DIR)")
    return str(path)


def load_bench_prompts(args: argparse.Namespace) -> list:
    """The ``Prompt`` objects the flags name: the datasets' first N, then the file's."""
    from presto_sd.app.datasets import load_prompts, load_prompts_file

    names = args.datasets if args.datasets is not None else (
        "" if args.prompts_file else DEFAULT_DATASETS)
    prompts = [p for ds in csv(names) for p in load_prompts(ds, "heldout", args.n)]
    if args.prompts_file:  # the first N of each of its sets (a line's "dataset", else the file's)
        taken: dict[str, int] = {}
        for p in load_prompts_file(args.prompts_file):
            if (k := taken.get(p.dataset, 0)) < args.n:
                taken[p.dataset] = k + 1
                prompts.append(p)
    if not prompts:
        raise SystemExit("presto-sd bench: no prompts (check --datasets / --prompts-file / --n)")
    return prompts


def bench_config(args: argparse.Namespace, eos: tuple[int, ...], drafter_info):
    """Every method's params from the flags, filled in from the drafter's fitted defaults."""
    from presto_sd.app.bench.runner import BenchConfig
    from presto_sd.app.stack import generation_params
    from presto_sd.models.assets import DrafterDefaults

    budgets = tuple(int(b) for b in csv(args.budgets)) if args.budgets else (args.budget,)
    methods, gguf = peer_gguf(args, tuple(csv(args.methods)))
    base = generation_params(argparse.Namespace(**{**vars(args), "method": "linear"}), eos, drafter_info)
    defaults = drafter_info.defaults if drafter_info is not None else DrafterDefaults()
    providers = drafter_info.rho_providers if drafter_info is not None else ()
    return BenchConfig(methods, budgets, base, args.lookup_tokens,
                       warmup=not args.no_warmup, taps_cap=args.taps_cap,
                       taps_rho=args.taps_rho or defaults.calibrated_rho(providers), gguf=gguf)


def peer_gguf(args: argparse.Namespace, methods: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
    """The methods to run and llama-cpp's GGUF; without llama-cpp-python or a GGUF, the
    llama-cpp row is dropped and the reason printed (an optional extra, not an error)."""
    from presto_sd.app.bench import gguf_peer
    from presto_sd.models.loading import target_gguf

    if gguf_peer.NAME not in methods:
        return methods, None
    why = gguf_peer.available()
    gguf = None
    if why is None:
        try:
            gguf = args.gguf or str(target_gguf(args.target))
        except ValueError as e:
            why = f"{e}; give --gguf"
    if why is None:
        return methods, gguf
    print(f"presto-sd bench: {gguf_peer.NAME} skipped: {why}", file=sys.stderr)
    return tuple(m for m in methods if m != gguf_peer.NAME), None


def run(args: argparse.Namespace) -> int:
    import torch

    from presto_sd.app.bench.report import command_line, machine_info
    from presto_sd.app.bench.runner import BenchPrompt, bench
    from presto_sd.embedded.stack import build_embedded, self_drafter_engine
    from presto_sd.models.loading import encode_messages, parse_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_bench_prompts(args)
    self_dir = self_draft_for(args)
    stack = build_embedded(args.target, args.drafter, dtype=parse_dtype(args.dtype), decoder=args.decoder,
                           weights=args.weights, self_draft=self_dir)
    self_drafter = None
    if self_dir:
        chains = args.self_chains or None
        self_drafter = self_drafter_engine(stack.verifier, Path(self_dir), stack.assets, chains)
    config = bench_config(args, stack.verifier.eos_token_ids, stack.drafter.info())
    chat = not args.no_chat
    encoded = [BenchPrompt(p.dataset, p.id, tuple(encode_messages(stack.tokenizer, p.messages, chat)))
               for p in prompts]
    info = stack.verifier.info()
    meta = {
        "command": command_line(),
        "target": info.model,
        "drafter": stack.drafter.info().name or "random",
        "self_draft": self_dir,
        "machine": machine_info(info.device, info.dtype),
        "decoder": info.decoder,
        "weights": info.weights,
        "attention_kernel": info.attention_kernel,
    }
    out = Path(args.out)
    if args.replay:
        from presto_sd.app.bench.replay_cli import run_replay

        return run_replay(args, stack, encoded, config, out, meta, self_drafter)
    result = bench(stack.verifier, stack.drafter, encoded, config, out, meta, progress=not args.no_progress,
                   self_drafter=self_drafter)
    from presto_sd.app.bench.report import markdown_table

    print(markdown_table(result["rows"]))
    print(f"\nwrote {out}/results.json, results.md, runs.jsonl and the plots")
    return 0
