"""The drafting methods by name, with what each needs: the one list of them (docs/design.md §1).

``ar`` decodes plainly; the others build a tree from the drafter's marginals each round
(``builders.build_tree``). Code asks a ``Method`` what it needs instead of comparing names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    help: str
    needs_drafter: bool = True  # False: plain AR decoding, no tree
    uses_rho: bool = False  # scores nodes with an acceptance estimate rho (PRESTO, TAPS)
    budgeted: bool = True  # --budget sizes its tree (linear: the chain is --depth long)
    sizes_itself: bool = False  # chooses its tree size each round from the verifier's cost model
    wants_calibrated_rho: bool = False  # sums reaches, so takes h_phi by default where shipped


_ALL = (
    Method("ar", "plain decoding", needs_drafter=False, budgeted=False),
    Method("linear", "DFlash: the top-1 chain", budgeted=False),
    Method("marginal", "DDTree: best-first on log q"),
    Method("presto-beam", "PRESTO Algorithm 1: beam search with global retention", uses_rho=True),
    Method("presto-best-first", "PRESTO: best-first on the prefix-aligned score", uses_rho=True),
    Method("taps", "TAPS: the tree size chosen each round from the verifier's measured cost",
           uses_rho=True, sizes_itself=True, wants_calibrated_rho=True),
)
METHODS: dict[str, Method] = {m.name: m for m in _ALL}
METHOD_NAMES: tuple[str, ...] = tuple(METHODS)  # every method, ar first
TREE_METHODS: tuple[str, ...] = tuple(m.name for m in _ALL if m.needs_drafter)  # the tree builders
RHO_METHODS: tuple[str, ...] = tuple(m.name for m in _ALL if m.uses_rho)
# every front's default (the CLI, a request without one, the gRPC services): the bench's
# fastest on a 2-core CPU (docs/benchmarks.md); its budget is ``TreeParams.budget``
DEFAULT_METHOD = "presto-best-first"


def get_method(name: str, what: str = "method") -> Method:
    """The method called ``name``; ValueError naming ``what`` and the choices for any other."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"{what} = {name!r}: unknown (choose from {', '.join(METHOD_NAMES)})") from None
