"""``presto-sd generate``: one prompt, on embedded engines, remote ones, or through an orchestrator.

    presto-sd generate "PROMPT" [--method presto-best-first] [--budget 4] [--json]
    presto-sd generate "PROMPT" --drafter-addr HOST:PORT --verifier-addr HOST:PORT
    presto-sd generate "PROMPT" --orchestrator-addr HOST:PORT

The output, ``--json`` fields included, is the same in all three (greedy: the target's own).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator

from presto_sd.app.flags import add_client_args, add_generation_args, client_config
from presto_sd.method.methods import get_method


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt (embedded, or remote engines)",
                         description="Speculative decoding of PROMPT; output is identical to plain "
                                     "AR decoding of the target (greedy) or distributed as it (sampling).")
    gen.add_argument("prompt")
    gen.add_argument("--no-chat", action="store_true", help="feed the prompt raw, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_generation_args(gen)
    g = gen.add_argument_group("remote engines (gRPC; default: embedded, in this process)")
    g.add_argument("--verifier-addr", default=None, help="HOST:PORT of a `presto-sd serve verifier`")
    g.add_argument("--drafter-addr", default=None, help="HOST:PORT of a `presto-sd serve drafter`")
    add_client_args(g)
    g.add_argument("--orchestrator-addr", default=None,
                   help="HOST:PORT[,HOST:PORT...] of `presto-sd serve orchestrator` (or `up`): generate "
                        "through it; with several, a stream broken by an orchestrator's death resumes "
                        "on the next")
    gen.set_defaults(run=run)


def encode_prompt(tok, prompt: str, chat: bool) -> list[int]:
    from presto_sd.models.loading import encode_messages

    return encode_messages(tok, [{"role": "user", "content": prompt}], chat)


def tree_summary(tree, method: str) -> dict:
    """The tree parameters a request ran with (``TreeParams`` and its method, or a server's
    report of them)."""
    if isinstance(tree, dict):
        return tree
    return {"method": method, "budget": tree.budget, "depth": tree.depth, "branching": tree.branching,
            "beam": tree.beam, "rho": tree.rho, "lambdas": list(tree.lambdas)}


def generation_summary(args: argparse.Namespace, res, drafter: str, tree) -> dict:
    """The fields ``generate`` reports beside the text (the same embedded, remote, orchestrated)."""
    return {
        "method": args.method,
        "budget": args.budget if get_method(args.method).budgeted else None,
        "rounds": len(res.rounds),
        "tau": round(res.tau, 3),
        "tokens_per_s": round(res.tokens_per_s, 2),
        "new_tokens": len(res.token_ids),
        "finish_reason": res.finish_reason,
        "mean_tree_size": round(res.mean_tree_size, 2),
        "drafter": drafter,
        "tree": tree_summary(tree, args.method) if tree is not None else None,
    }


def _print_stream(args: argparse.Namespace, chunks: Iterator, text_of: Callable):
    """Collect ``(tokens, round, finish_reason, text)`` chunks, streaming the text unless --json."""
    from presto_sd.loop.generate import ResultCollector

    out = ResultCollector()
    for tokens, round_stats, finish, text in chunks:
        out.add(tokens, round_stats, finish, text)
        if not args.json:
            sys.stdout.write(text_of(out))
            sys.stdout.flush()
    return out.result()


def _report(args: argparse.Namespace, res, text: str, drafter: str, tree) -> None:
    summary = generation_summary(args, res, drafter, tree)
    if args.json:
        print(json.dumps({"text": text, "token_ids": res.token_ids, **summary}))
    else:
        tree_fields = summary["tree"] or {}
        line = {**summary, "rho": tree_fields.get("rho")} if tree_fields.get("rho") else summary
        print("\n" + " ".join(f"{k}={v}" for k, v in line.items() if k != "tree"), file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    remote = args.orchestrator_addr or args.verifier_addr or args.drafter_addr
    for flag, value, default in (("--dtype", args.dtype, "auto"), ("--decoder", args.decoder, "auto"),
                                 ("--weights", args.weights, "dense")):
        if remote and value != default:
            raise SystemExit(f"presto-sd generate: {flag} sets embedded engines; remote ones take it "
                             f"from `presto-sd serve verifier|drafter {flag}` (or `up {flag}`)")
    if args.orchestrator_addr:
        return run_orchestrated(args)
    import torch

    from presto_sd.app.stack import engine_stack, generation_params
    from presto_sd.loop.generate import stream_generate

    if args.threads:
        torch.set_num_threads(args.threads)
    stack = engine_stack(args)
    tok = stack.tokenizer
    params = generation_params(args, stack.verifier.eos_token_ids, stack.drafter_info)
    prompt_ids = encode_prompt(tok, args.prompt, not args.no_chat)
    drafter = stack.drafter if get_method(args.method).needs_drafter else None

    def detok(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    if get_method(args.method).sizes_itself and stack.verifier.cost_model() is None:  # once, not timed
        t0 = time.perf_counter()
        stack.verifier.calibrate_cost()
        print(f"presto-sd: measured the verify cost model in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    printed = [""]

    def new_text(out) -> str:  # the text the tokens so far add to what was printed
        text = detok(out.tokens)
        added, printed[0] = text[len(printed[0]):], text
        return added

    chunks = ((c.tokens, c.round, c.finish_reason, "")
              for c in stream_generate(stack.verifier, drafter, prompt_ids, params, detok))
    res = _print_stream(args, chunks, new_text)
    _report(args, res, detok(res.token_ids), stack.drafter_name, params.tree)
    return 0


def run_orchestrated(args: argparse.Namespace) -> int:
    """``generate`` through an orchestrator: the same output and ``--json``."""
    from orchestrator.client import OrchestratorClient
    from presto_sd.app.stack import request_tree
    from presto_sd.loop.generate import RoundStats

    client = OrchestratorClient(args.orchestrator_addr, client_config(args))
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
    tree: list = [None]

    def chunks():
        for chunk in client.generate(args.prompt, method=args.method, tree=request_tree(args),
                                     sampling=sampling, max_new_tokens=args.max_new_tokens,
                                     chat=not args.no_chat):
            tree[0] = tree[0] or chunk.tree
            s = chunk.stats  # what the summary reads: accepted and tree size per round
            stats = None if s is None else RoundStats(
                s.accepted, s.tree_size, s.draft_s, 0.0, s.verify_s, 0.0, s.fallback, s.gated)
            yield chunk.tokens, stats, chunk.finish_reason, chunk.text

    printed = [0]

    def new_text(out) -> str:
        added, printed[0] = out.text[printed[0]:], len(out.text)
        return added

    try:
        res = _print_stream(args, chunks(), new_text)
        drafter = client.info().drafter
    finally:
        client.close()
    _report(args, res, res.text, drafter, tree[0])
    return 0
