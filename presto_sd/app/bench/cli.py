"""``presto-sd bench``: every drafting method side by side with AR and a peer, on the machine at hand.

    presto-sd bench --datasets gsm8k,humaneval,mtbench --n 10 --max-new-tokens 128 \\
        --methods ar,hf-prompt-lookup,linear,marginal,presto-beam,presto-best-first \\
        --budgets 8,16,32,64 --out runs/bench
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_DATASETS = "gsm8k,humaneval,mtbench"
DEFAULT_METHODS = "ar,hf-prompt-lookup,linear,marginal,presto-beam,presto-best-first,taps"


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    from presto_sd.app.cli import DTYPE_CHOICES, DTYPE_HELP

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
                   help='a JSONL file of {"prompt": ...} or {"messages": [...]} (its own dataset)')
    w.add_argument("--n", type=int, default=10, help="prompts per dataset (the first N)")
    w.add_argument("--no-chat", action="store_true", help="feed prompts raw, without the chat template")
    w.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated (default: %(default)s); ar always runs (the baseline)")
    w.add_argument("--budget", type=int, default=16, help="draft tree nodes per round (root excluded)")
    w.add_argument("--budgets", default=None,
                   help="comma-separated budget sweep, e.g. 8,16,32,64 (overrides --budget)")
    w.add_argument("--out", default="runs/bench", help="output dir (default: %(default)s)")
    w.add_argument("--no-warmup", action="store_true", help="skip the discarded warm-up generations")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.add_argument("--replay", action="store_true",
                   help="offline tau replay (greedy): one recorded AR pass per prompt stands in for the "
                        "target, so every builder and budget costs only its drafting; writes "
                        "DIR/replay.json (tau per method and budget, the drafter's recall@K per depth "
                        "and the oracle accepted length over its top-K). taps and hf-prompt-lookup "
                        "are skipped: their rounds follow measured time")
    w.add_argument("--recordings", default=None,
                   help="replay: a file of recorded AR passes to reuse or create "
                        "(default: one per target, prompts and length in the cache)")
    w.add_argument("--positions-top-k", type=int, default=16,
                   help="replay: K for recall@K and the top-K oracle (default: %(default)s)")
    t = p.add_argument_group("drafting")
    t.add_argument("--depth", type=int, default=15, help="max tree depth (<= block size - 1)")
    t.add_argument("--branching", type=int, default=4, help="presto-beam: children per frontier path")
    t.add_argument("--beam", type=int, default=4, help="presto-beam: frontier paths kept per depth")
    t.add_argument("--rho", default=None, help="PRESTO rho provider: ngram | hphi | constant")
    t.add_argument("--lambda", dest="lambdas", default=None, help="lambda_d: one value or per depth")
    t.add_argument("--taps-cap", type=int, default=64,
                   help="taps: the most draft nodes a round may choose (default: %(default)s)")
    t.add_argument("--taps-rho", default=None,
                   help="taps: acceptance provider hphi | ngram | constant | marginal "
                        "(default: hphi when the drafter ships it, else --rho)")
    t.add_argument("--lookup-tokens", type=int, default=10,
                   help="hf-prompt-lookup: prompt_lookup_num_tokens (default: %(default)s)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (lossless is checked)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("models")
    m.add_argument("--target", default=None, help="as for generate (default: SmolLM2-135M-Instruct)")
    m.add_argument("--drafter", default=None, help="as for generate ('random' = untrained)")
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    m.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)


def load_bench_prompts(args: argparse.Namespace) -> list:
    """The ``Prompt`` objects the flags name: the datasets' first N, then the file's."""
    from presto_sd.app.datasets import load_prompts, load_prompts_file

    names = args.datasets if args.datasets is not None else (
        "" if args.prompts_file else DEFAULT_DATASETS)
    prompts = [p for ds in _csv(names) for p in load_prompts(ds, "heldout", args.n)]
    if args.prompts_file:
        prompts.extend(load_prompts_file(args.prompts_file)[: args.n])
    if not prompts:
        raise SystemExit("presto-sd bench: no prompts (check --datasets / --prompts-file / --n)")
    return prompts


def bench_config(args: argparse.Namespace, eos: tuple[int, ...], presto_defaults: dict):
    from presto_sd.app.bench.runner import BenchConfig
    from presto_sd.app.cli import default_taps_rho, generation_params

    budgets = tuple(int(b) for b in _csv(args.budgets)) if args.budgets else (args.budget,)
    base = generation_params(argparse.Namespace(**{**vars(args), "method": "linear"}), eos, presto_defaults)
    return BenchConfig(tuple(_csv(args.methods)), budgets, base, args.lookup_tokens,
                       warmup=not args.no_warmup, taps_cap=args.taps_cap,
                       taps_rho=args.taps_rho or default_taps_rho(presto_defaults))


def run(args: argparse.Namespace) -> int:
    import torch

    from presto_sd.app.bench.report import command_line, machine_info
    from presto_sd.app.bench.runner import BenchPrompt, bench
    from presto_sd.embedded.stack import build_embedded
    from presto_sd.models.loading import encode_messages, parse_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_bench_prompts(args)
    stack = build_embedded(args.target, args.drafter, dtype=parse_dtype(args.dtype))
    config = bench_config(args, stack.verifier.eos_token_ids, stack.presto_defaults)
    chat = not args.no_chat
    encoded = [BenchPrompt(p.dataset, p.id, tuple(encode_messages(stack.tokenizer, p.messages, chat)))
               for p in prompts]
    info = stack.verifier.info()
    meta = {
        "command": command_line(),
        "target": info.model,
        "drafter": str(stack.drafter_spec.path) if stack.drafter_spec.path else "random",
        "machine": machine_info(info.device, info.dtype),
    }
    out = Path(args.out)
    if args.replay:
        from presto_sd.app.bench.replay_cli import run_replay

        return run_replay(args, stack, encoded, config, out, meta)
    result = bench(stack.verifier, stack.drafter, encoded, config, out, meta, progress=not args.no_progress)
    from presto_sd.app.bench.report import markdown_table

    print(markdown_table(result["rows"]))
    print(f"\nwrote {out}/results.json, results.md, runs.jsonl and the plots")
    return 0
