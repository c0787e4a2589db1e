"""One way to build what a command runs on: the embedded engines, remote ones, or the orchestrator.

Every mode takes the drafter's name and fitted PRESTO settings from its ``DrafterInfo``
(``DrafterDefaults``: rho, lambdas and the lambdas fitted per rho), and turns the same
flags into the same ``GenerationParams`` with ``generation_params`` — embedded, through
``serve`` and through ``up`` alike.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from presto_sd.app.flags import client_config, csv, parse_lambdas
from presto_sd.method.methods import get_method


@dataclass
class Stack:
    """The engines ``generate`` and ``bench`` drive, in this process or over gRPC."""

    verifier: Any  # Verifier
    drafter: Any  # Drafter | None (remote engines without --drafter-addr: AR only)
    tokenizer: Any

    @cached_property
    def drafter_info(self):
        """Its name and fitted defaults (asked once: over gRPC, Info is a call)."""
        return self.drafter.info() if self.drafter is not None else None

    @property
    def drafter_name(self) -> str:
        info = self.drafter_info
        return (info.name if info is not None else "") or "random"


def tree_settings(method: str, rho: str | None, lambdas: tuple[float, ...] | None, drafter_info):
    """``(rho, lambdas)``: what is given, else the drafter's fitted ones (``DrafterDefaults``)."""
    from presto_sd.models.assets import DrafterDefaults

    defaults = drafter_info.defaults if drafter_info is not None else DrafterDefaults()
    providers = drafter_info.rho_providers if drafter_info is not None else ()
    return defaults.tree_settings(rho, lambdas, get_method(method).wants_calibrated_rho, providers)


def generation_params(args: argparse.Namespace, eos: tuple[int, ...], drafter_info):
    """The ``GenerationParams`` of the generation flags, filled in from the drafter's defaults."""
    from presto_sd.loop.generate import GenerationParams
    from presto_sd.method.acceptance import SamplingParams
    from presto_sd.method.builders import TreeParams

    rho, lambdas = tree_settings(args.method, args.rho, parse_lambdas(args.lambdas), drafter_info)
    tree = TreeParams(budget=args.budget, depth=args.depth,
                      branching=args.branching, beam=args.beam, lambdas=lambdas, rho=rho)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    return GenerationParams(args.method, tree, args.max_new_tokens, sampling, stop_token_ids=eos)


def embedded_stack(args: argparse.Namespace) -> Stack:
    from presto_sd.embedded.stack import build_embedded
    from presto_sd.models.loading import parse_dtype

    s = build_embedded(args.target, args.drafter, dtype=parse_dtype(args.dtype), decoder=args.decoder,
                       weights=args.weights, self_chains=getattr(args, "self_chains", 0) or None)
    return Stack(s.verifier, s.drafter, s.tokenizer)


def remote_stack(args: argparse.Namespace) -> Stack:
    from drafter_service.remote import RemoteDrafter
    from presto_sd.models.loading import load_tokenizer
    from verifier_service.remote import RemoteVerifier

    if not args.verifier_addr:
        raise SystemExit("presto-sd generate: --drafter-addr needs --verifier-addr")
    if get_method(args.method).needs_drafter and not args.drafter_addr:
        raise SystemExit(f"presto-sd generate: --method {args.method} needs --drafter-addr")
    config = client_config(args)
    drafter = RemoteDrafter(args.drafter_addr, config) if args.drafter_addr else None
    return Stack(RemoteVerifier(args.verifier_addr, config), drafter, load_tokenizer(args.target))


def engine_stack(args: argparse.Namespace) -> Stack:
    """Remote engines when their addresses are given, else the embedded ones."""
    return remote_stack(args) if args.verifier_addr or args.drafter_addr else embedded_stack(args)


# -- the orchestrator (serve orchestrator, up) -------------------------------------------
def replica_specs(args: argparse.Namespace) -> tuple[list, list]:
    from orchestrator.actors import local_spec, remote_spec

    drafters, verifiers = csv(args.drafter_addr), csv(args.verifier_addr)
    if bool(drafters) != bool(verifiers):
        raise SystemExit("presto-sd serve orchestrator: give --drafter-addr and --verifier-addr, "
                         "or neither (in-process engines)")
    if verifiers:
        config = client_config(args, "engine_")
        return ([remote_spec("drafter", a, config) for a in drafters],
                [remote_spec("verifier", a, config) for a in verifiers])
    models = {"dtype": args.dtype, "decoder": args.decoder, "weights": args.weights}
    return ([local_spec("drafter", i, args.target, args.drafter, args.threads, args.drafter_gpus, **models)
             for i in range(args.local_drafters)],
            [local_spec("verifier", i, args.target, args.drafter, args.threads, args.verifier_gpus, **models)
             for i in range(args.local_verifiers)])


def orchestrated(args: argparse.Namespace):
    """Start the replicas and work out the request defaults: (orchestrator, defaults, tokenizer)."""
    from orchestrator.orchestrator import Orchestrator, OrchestratorConfig
    from orchestrator.service import ServiceDefaults
    from presto_sd.engine.calls import Info
    from presto_sd.models.loading import load_tokenizer

    drafters, verifiers = replica_specs(args)
    tok = load_tokenizer(args.target)
    config = OrchestratorConfig(args.max_requests, args.max_batch, args.max_batch_tokens,
                                args.max_batch_prefill_tokens)
    orch = Orchestrator.start(drafters, verifiers, config,
                              detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True))
    vinfo = orch.verifiers.replicas[0].call(Info()).value
    dinfo = orch.drafters.replicas[0].call(Info()).value  # its name and fitted settings
    params = generation_params(args, vinfo.eos_token_ids, dinfo)
    defaults = ServiceDefaults(params, vinfo.model, dinfo.name or "random", dinfo,
                               rho=args.rho, lambdas=parse_lambdas(args.lambdas), vocab_size=vinfo.vocab_size)
    return orch, defaults, tok


def request_tree(args: argparse.Namespace) -> dict[str, Any]:
    """The tree fields a client sets in a request: the shape, and rho / lambdas if given."""
    tree: dict[str, Any] = {"budget": args.budget, "depth": args.depth, "branching": args.branching,
                            "beam": args.beam}
    if args.rho:
        tree["rho"] = args.rho
    if args.lambdas is not None:
        tree["lambdas"] = list(parse_lambdas(args.lambdas))
    return tree
