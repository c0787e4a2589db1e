"""The held-out mix a link chooses on (``train link --choose-on mix``, ``train choose-set``).

ShareGPT's held-out split alone let a link whose data moved toward chat win while it lost
math and code (the eleventh link, docs/training.md). The mix holds three sets of ``n``
prompts each, none of them in a training plan and none a benchmark's:

- ``sharegpt-heldout``: ShareGPT's held-out split (by conversation hash; the plans take the
  train split only);
- ``code-heldout``: the plans' code templates over functions of the stdlib's *submodules*
  (``email.utils``, ``urllib.parse``): the plans walk the top-level modules only;
- ``arith-heldout``: the word-problem templates drawn from another seed, any problem the
  first plan holds dropped.

Every prompt passes the benchmark n-gram check the plans use. The mix is a pure function of
``n`` and the seed (and of the Python whose stdlib it walks), so a link's resume and its
parent's replay read the same file.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

HELDOUT_MIX = "mix"  # the name `train link --choose-on` knows it by
MIX_SETS = ("sharegpt-heldout", "code-heldout", "arith-heldout")
HELDOUT_SEED = 1  # the plans draw with seed 0
PLAN_ARITH = (6000, 0)  # the first plan's arithmetic items (n, seed): corpus/smollm2-135m's plan_key


def heldout_mix(n: int, seed: int = HELDOUT_SEED) -> list[dict]:
    """``n`` prompts of each of ``MIX_SETS``, as ``bench --prompts-file`` lines (``id``,
    ``dataset``, ``messages``)."""
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
        raise ValueError(f"a held-out mix needs n >= 1 prompts a set, got {n}")
    grams = benchmark_ngrams()
    rng = random.Random(seed)

    def clean(messages: list[dict]) -> bool:
        return not any(text_is_contaminated(m["content"], grams) for m in messages)

    sets: dict[str, list[tuple[str, list[dict]]]] = {name: [] for name in MIX_SETS}
    for p in load_prompts("sharegpt", "heldout"):
        if len(sets["sharegpt-heldout"]) == n:
            break
        if clean(list(p.messages)):
            sets["sharegpt-heldout"].append((p.id, list(p.messages)))

    functions = stdlib_functions(submodules=True)
    for k in rng.sample(range(len(functions)), len(functions)):
        if len(sets["code-heldout"]) == n:
            break
        msgs = [{"role": "user", "content": code_prompt(functions[k], rng.randrange(N_CODE_TEMPLATES))}]
        if clean(msgs):
            sets["code-heldout"].append((".".join(functions[k][:2]), msgs))

    # the plan's generator seeded apart (4n drawn: a few are dropped); a problem the plan holds is skipped
    planned = {problem for problem, _, _ in arithmetic_draws(*PLAN_ARITH)}
    for i, (problem, suffix, _) in enumerate(arithmetic_draws(4 * n, seed)):
        msgs = [{"role": "user", "content": problem + suffix}]
        if len(sets["arith-heldout"]) < n and problem not in planned and clean(msgs):
            sets["arith-heldout"].append((str(i), msgs))

    for name, got in sets.items():
        if len(got) < n:
            raise ValueError(f"{name}: only {len(got)} held-out prompts, {n} asked")
    return [{"id": f"{name}/{pid}", "dataset": name, "messages": msgs}
            for name, got in sets.items() for pid, msgs in got]


def write_heldout_mix(path: str | os.PathLike[str], n: int, seed: int = HELDOUT_SEED) -> Path:
    """The mix written to ``path`` (a JSONL prompts file), whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in heldout_mix(n, seed)), encoding="utf-8")
    tmp.replace(path)
    return path
