"""The methods a bench can run, looked up by name.

A method is a function ``(ctx, prompt_ids, params) -> GenerationResult``: it decodes one
prompt with ``params`` (max_new_tokens, sampling, stop ids, and ``params.tree`` holding
the job's budget) and reports tokens, per-round stats and wall times. Register a new one
(TAPS, self-speculative, ...) with ``@register_method("name", budgeted=...)``; a budgeted
method runs once per ``--budgets`` value, an unbudgeted one once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from presto_sd.app.errors import FlagError
from presto_sd.engine.drafter import Drafter
from presto_sd.engine.verifier import Verifier
from presto_sd.loop.generate import GenerationParams, GenerationResult, generate
from presto_sd.method.methods import METHODS, Method


@dataclass
class BenchContext:
    verifier: Verifier
    drafter: Drafter | None
    lookup_tokens: int = 10  # hf-prompt-lookup: prompt_lookup_num_tokens
    gguf: str | None = None  # llama-cpp: the GGUF file it decodes
    threads: int = 1  # llama-cpp: its threads (the bench's torch threads)
    self_drafter: Drafter | None = None  # self-*: the self-speculative mode (the verifier has the adapter)


MethodFn = Callable[[BenchContext, list[int], GenerationParams], GenerationResult]


@dataclass(frozen=True)
class BenchMethod:
    name: str
    run: MethodFn
    budgeted: bool  # swept over the budgets; else run once, budget recorded as None
    needs_drafter: bool
    describe: Callable[[BenchContext, GenerationParams], dict[str, Any]] = lambda ctx, p: {}
    core: str | None = None  # the presto-sd method it runs (``METHODS``); None: a peer

REGISTRY: dict[str, BenchMethod] = {}


def register_method(
    name: str, *, budgeted: bool, needs_drafter: bool = False,
    describe: Callable[[BenchContext, GenerationParams], dict[str, Any]] | None = None,
    core: str | None = None,
) -> Callable[[MethodFn], MethodFn]:
    def deco(fn: MethodFn) -> MethodFn:
        REGISTRY[name] = BenchMethod(name, fn, budgeted, needs_drafter, describe or (lambda c, p: {}), core)
        return fn

    return deco


def get_method(name: str) -> BenchMethod:
    if name not in REGISTRY:
        raise FlagError(f"unknown bench method {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


@register_method("ar", budgeted=METHODS["ar"].budgeted, core="ar")
def run_ar(ctx: BenchContext, prompt_ids: list[int], params: GenerationParams) -> GenerationResult:
    """Plain AR decoding by the same verifier engine: the baseline."""
    return generate(ctx.verifier, None, prompt_ids, replace(params, method="ar"))


def _tree_method(name: str) -> MethodFn:
    def run(ctx: BenchContext, prompt_ids: list[int], params: GenerationParams) -> GenerationResult:
        return generate(ctx.verifier, ctx.drafter, prompt_ids, replace(params, method=name))

    run.__name__ = f"run_{name.replace('-', '_')}"
    return run


def _tree_describe(ctx: BenchContext, params: GenerationParams) -> dict[str, Any]:
    t = params.tree
    return {"depth": t.depth, "top_k": t.top_k}


def _presto_describe(ctx: BenchContext, params: GenerationParams) -> dict[str, Any]:
    t = params.tree
    return {**_tree_describe(ctx, params), "rho": t.rho, "lambdas": list(t.lambdas)}


def _taps_describe(ctx: BenchContext, params: GenerationParams) -> dict[str, Any]:
    t = params.tree
    return {**_tree_describe(ctx, params), "rho": t.rho, "cap": t.budget}


def _beam_describe(ctx: BenchContext, params: GenerationParams) -> dict[str, Any]:
    t = params.tree
    return {**_presto_describe(ctx, params), "branching": t.branching, "beam": t.beam}


def _describe(m: Method) -> Callable[[BenchContext, GenerationParams], dict[str, Any]]:
    if m.sizes_itself:
        return _taps_describe
    if m.uses_rho:
        return _beam_describe if m.name == "presto-beam" else _presto_describe
    return _tree_describe


SELF = "self-"  # self-<method>: the method in the self-speculative mode (docs/self_speculative.md)


def _self_method(name: str) -> MethodFn:
    def run(ctx: BenchContext, prompt_ids: list[int], params: GenerationParams) -> GenerationResult:
        if ctx.self_drafter is None:
            raise FlagError(f"bench method {SELF + name!r} needs a self-draft adapter (--self-draft DIR)")
        return generate(ctx.verifier, ctx.self_drafter, prompt_ids, self_params(ctx, params, name))

    run.__name__ = f"run_self_{name.replace('-', '_')}"
    return run


def self_params(ctx: BenchContext, params: GenerationParams, name: str) -> GenerationParams:
    """``params`` for the self mode: a rho it offers (h_phi reads a dedicated drafter's states,
    so ngram stands in) and the default lambdas (the fitted ones are the drafter's)."""
    tree = params.tree
    offered = ctx.self_drafter.info().rho_providers if ctx.self_drafter is not None else ()
    if tree.rho not in offered and tree.rho != "marginal":
        tree = replace(tree, rho="ngram", lambdas=(1.0,))
    return replace(params, method=name, tree=tree)


def _self_describe(m: Method) -> Callable[[BenchContext, GenerationParams], dict[str, Any]]:
    inner = _describe(m)

    def describe(ctx: BenchContext, params: GenerationParams) -> dict[str, Any]:
        info = ctx.self_drafter.info() if ctx.self_drafter is not None else None
        out = {**inner(ctx, self_params(ctx, params, m.name)), "mode": "self"}
        if info is not None:
            out["adapter"], out["chains_depth"] = info.name, min(params.tree.depth, info.block_size - 1)
        return out

    return describe


# not swept over --budgets: linear drafts the whole block (its size is the depth) and taps
# picks its own budget every round, up to --taps-cap
for _m in METHODS.values():
    if _m.needs_drafter:
        budgeted = _m.budgeted and not _m.sizes_itself
        register_method(_m.name, budgeted=budgeted, needs_drafter=True, describe=_describe(_m),
                        core=_m.name)(_tree_method(_m.name))
        register_method(SELF + _m.name, budgeted=budgeted, describe=_self_describe(_m),
                        core=_m.name)(_self_method(_m.name))
