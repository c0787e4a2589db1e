"""The held-out mix a link chooses on (``train link --choose-on heldout-mix``, ``train choose-set``).

ShareGPT's held-out split alone let a link whose data moved toward chat win while it lost
math and code (the eleventh link, docs/training.md). The mix holds three sets of ``n``
prompts each, none a benchmark's and none a training plan's:

- ``sharegpt-heldout``: ShareGPT's held-out split (by conversation hash; the plans take the
  train split);
- ``code-heldout``: the plans' code templates over functions of the stdlib's *submodules*
  (``email.utils``, ``urllib.parse``): the plans walk the top-level modules only;
- ``arith-heldout``: the word-problem templates drawn from another seed.

Beyond those constructions, a prompt is dropped when any of its user turns is, word for word, a
user turn of a plan the corpora were made by (ShareGPT repeats first turns across
conversations), or shares a 13-word n-gram with a benchmark prompt. A magpie plan's requests
are the target's own samples and are not compared. Functions and templates are ranked by a
hash of their names, so a stdlib that differs on another Python moves only its own entries.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from presto_sd.app.errors import FlagError
from presto_sd.app.training.token_corpus import write_atomically

HELDOUT_MIX = "heldout-mix"  # the name `train link --choose-on` knows it by
MIX_SETS = ("sharegpt-heldout", "code-heldout", "arith-heldout")
HELDOUT_SEED = 1  # the plans draw with seed 0


def planned_user_turns(corpora: tuple[str, ...]) -> set[str]:
    """Every user turn of every item of the plans ``corpora`` were made by (their manifests'
    plan keys; a magpie plan has none to rebuild)."""
    from presto_sd.app.training.corpus import SOURCES, build_corpus
    from presto_sd.app.training.token_corpus import Corpus

    turns: set[str] = set()
    for root in corpora:
        key = Corpus(root).manifest().get("plan_key") or {}
        sources = tuple(s for s in str(key.get("sources", "")).split(",") if s in SOURCES)
        if sources:
            for item in build_corpus(sources, key["n_code"], key["n_arith"], key["seed"]):
                turns |= {m["content"] for m in item.messages if m["role"] == "user"}
    return turns


def _rank(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big")


def heldout_mix(n: int, corpora: tuple[str, ...], seed: int = HELDOUT_SEED) -> list[dict]:
    """``n`` prompts of each of ``MIX_SETS``, none a user turn of ``corpora``'s plans, as
    ``bench --prompts-file`` lines (``id``, ``dataset``, ``messages``)."""
    from presto_sd.app.datasets import load_prompts
    from presto_sd.app.training.corpus import (
        N_CODE_TEMPLATES,
        arithmetic_draws,
        benchmark_ngrams,
        code_prompt,
        stdlib_functions,
        text_is_contaminated,
    )

    if n < 1:
        raise FlagError(f"a held-out mix needs n >= 1 prompts a set, got {n}")
    grams, planned = benchmark_ngrams(), planned_user_turns(corpora)

    def held_out(messages: list[dict]) -> bool:
        users = [m["content"] for m in messages if m["role"] == "user"]
        return not any(u in planned or text_is_contaminated(u, grams) for u in users)

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    functions = {f"{f[0]}.{f[1]}": f for f in stdlib_functions(submodules=True)}
    candidates: dict[str, list[tuple[str, list[dict]]]] = {
        "sharegpt-heldout": [(p.id, list(p.messages)) for p in load_prompts("sharegpt", "heldout")],
        "code-heldout": [(name, user(code_prompt(functions[name], _rank(seed, name) % N_CODE_TEMPLATES)))
                         for name in sorted(functions, key=lambda name: _rank(seed, name))],
        # the plans' generator seeded apart; 4n drawn, as a few may be dropped
        "arith-heldout": [(str(i), user(problem + suffix))
                          for i, (problem, suffix, _) in enumerate(arithmetic_draws(4 * n, seed))],
    }
    out = []
    for name, items in candidates.items():
        kept = []
        for pid, msgs in items:
            if len(kept) == n:
                break
            if held_out(msgs):
                kept.append({"id": f"{name}/{pid}", "dataset": name, "messages": msgs})
        if len(kept) < n:
            raise FlagError(f"{name}: only {len(kept)} held-out prompts, {n} asked")
        out += kept
    return out


def write_heldout_mix(path: str | os.PathLike[str], n: int, corpora: tuple[str, ...],
                      seed: int = HELDOUT_SEED) -> Path:
    """The mix written to ``path`` (a JSONL prompts file), whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, "".join(json.dumps(r) + "\n" for r in heldout_mix(n, corpora, seed)).encode())
    return path
