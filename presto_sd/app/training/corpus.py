"""The drafter's training prompts: every ShareGPT assistant turn, plus synthesised code and
arithmetic prompts for the domains ShareGPT covers thinly.

Nothing here reads a benchmark. The code prompts come from the signatures and docstrings
of the Python standard library (the interpreter's own files); the word problems from
templates filled by a seeded generator. Every list is a pure function of its arguments,
so a data job that restarts rebuilds exactly the same items in the same order.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass

from presto_sd.app.datasets import load_sharegpt_conversations
from presto_sd.app.errors import FlagError

SOURCES = ("sharegpt", "code", "arith")


@dataclass(frozen=True)
class TrainingItem:
    """One prompt to answer: chat ``messages`` ending with a user turn."""

    id: str
    source: str
    messages: tuple[dict[str, str], ...]


def item_source(item_id: str) -> str:
    """The source of an item id as the plans make them (``code/12``, ``arith/7``, ``magpie/3/41``;
    ShareGPT's ``conversation/turn``)."""
    head = item_id.split("/", 1)[0]
    return head if head in ("code", "arith", "magpie") else "sharegpt"


def sharegpt_turn_items(split: str = "train") -> list[TrainingItem]:
    """One item per assistant turn of every ShareGPT conversation of ``split``.

    The prompt is the conversation up to that turn's user message, with the earlier
    assistant turns as ShareGPT has them; the target writes the answer itself.
    """
    out = []
    for conv in load_sharegpt_conversations(split):
        history: list[dict[str, str]] = []
        for k, (role, text) in enumerate(conv.turns):
            if role == "assistant" and history and history[-1]["role"] == "user":
                out.append(TrainingItem(f"{conv.id}/{k}", "sharegpt", tuple(history)))
            history.append({"role": role, "content": text})
    return out


# Modules that open windows, print on import, or take long to import.
_SKIP_MODULES = frozenset({
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data",
    "lib2to3", "ensurepip", "venv", "test", "xxsubtype", "__hello__", "__phello__",
})

_CODE_TEMPLATES = (
    "Write a Python function `{name}{sig}` that does the following: {doc}",
    "Complete the following Python function:\n```python\ndef {name}{sig}:\n    \"\"\"{doc}\"\"\"\n```",
    "Explain what the Python function `{qual}{sig}` does and give a short usage example.",
    "Implement `{name}{sig}` in Python without using the `{module}` module. "
    "Its documentation says: {doc}",
    "Write unit tests with pytest for `{qual}{sig}`, whose documentation says: {doc}",
)


def stdlib_functions(submodules: bool = False) -> list[tuple[str, str, str, str]]:
    """``(module, name, signature, first docstring paragraph)`` of public stdlib functions: of
    the top-level modules (the plans' code prompts), or with ``submodules`` of the modules
    inside the stdlib's packages (``json.decoder``, ``email.utils``: prompts no plan holds).

    Importing every stdlib module has side effects (signal handlers, terminal state), so the
    walk runs in a child interpreter.
    """
    walk = "_walk_stdlib_submodules" if submodules else "_walk_stdlib"
    proc = subprocess.run([sys.executable, "-c", "import json, presto_sd.app.training.corpus as c; "
                           f"print(json.dumps(c.{walk}()))"], capture_output=True, text=True, check=True)
    return [tuple(x) for x in json.loads(proc.stdout.strip().splitlines()[-1])]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _top_level_stdlib() -> list[str]:
    return sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _SKIP_MODULES)


def _walk_stdlib() -> list[tuple[str, str, str, str]]:
    return _walk_modules(_top_level_stdlib())


def _walk_stdlib_submodules() -> list[tuple[str, str, str, str]]:
    import pkgutil

    names: list[str] = []
    for top in _top_level_stdlib():
        try:
            path = importlib.import_module(top).__path__  # a package's; a plain module has none
        except Exception:
            continue
        for info in pkgutil.walk_packages(path, prefix=top + ".", onerror=lambda _: None):
            parts = info.name.split(".")
            # __main__ runs a tool on import; tests and private modules are not the API
            if not any(p.startswith("_") or p in ("test", "tests") for p in parts):
                names.append(info.name)
    return _walk_modules(sorted(names))


def _walk_modules(names: list[str]) -> list[tuple[str, str, str, str]]:
    found = []
    for modname in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(modname)
        except Exception:  # platform-specific or optional modules
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != modname:
                continue
            doc = inspect.getdoc(obj) or ""
            first = doc.split("\n\n")[0].replace("\n", " ").strip()
            if len(first) < 20:
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            # a default's repr may hold its address (``<function f at 0x7f...>``), which differs
            # between processes: without it, the plan is the same on every machine
            sig = _ADDRESS.sub("", sig)
            found.append((modname, name, sig, first[:400]))
    return found


# the templates whose answer is the function itself: its own source is a written answer
CODE_WRITTEN_TEMPLATES = (0, 1, 3)


def code_draws(n: int, seed: int = 0) -> list[tuple[tuple[str, str, str, str], int]]:
    """Item ``code/i``'s stdlib function and template index, for ``i < n`` (``code_items``'s draws)."""
    funcs = stdlib_functions()
    if not funcs or n <= 0:
        return []
    rng = random.Random(seed)
    return [(funcs[i % len(funcs)], rng.randrange(len(_CODE_TEMPLATES))) for i in range(n)]


def code_prompt(function: tuple[str, str, str, str], template: int) -> str:
    """The prompt of code template ``template`` about ``(module, name, signature, doc)``."""
    module, name, sig, doc = function
    qual = f"{module}.{name}"
    return _CODE_TEMPLATES[template].format(name=name, sig=sig, doc=doc, module=module, qual=qual)


N_CODE_TEMPLATES = len(_CODE_TEMPLATES)


def code_items(n: int, seed: int = 0) -> list[TrainingItem]:
    """``n`` programming prompts about stdlib functions, templates chosen by ``seed``."""
    return [TrainingItem(f"code/{i}", "code", ({"role": "user", "content": code_prompt(f, t)},))
            for i, (f, t) in enumerate(code_draws(n, seed))]


def stdlib_sources(functions: list[tuple[str, str]]) -> list[str | None]:
    """The source of each ``(module, name)`` stdlib function (None where it has none), read in a
    child interpreter as ``stdlib_functions`` walks them."""
    code = ("import importlib, inspect, json, sys, warnings\n"
            "warnings.simplefilter('ignore')\n"
            "out = []\n"
            "for m, n in json.loads(sys.stdin.read()):\n"
            "    try:\n"
            "        out.append(inspect.getsource(getattr(importlib.import_module(m), n)))\n"
            "    except Exception:\n"
            "        out.append(None)\n"
            "print(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(functions), capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


_NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena",
          "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tomas", "Uma", "Vik", "Wen", "Yara")
_ITEMS = ("apples", "stickers", "marbles", "books", "cookies", "pencils", "stamps", "shells",
          "cupcakes", "postcards", "tickets", "bottles of juice", "bags of rice", "toy cars")
_PLACES = ("market", "school fair", "bakery", "bookshop", "garage sale", "farm stand")


def _num(x: float) -> str:
    """A quantity as a worked solution writes it: 12, 7.5, 3.33."""
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}".rstrip("0")


def _money(x: float) -> str:
    return f"${int(x)}" if float(x).is_integer() else f"${x:.2f}"


def _word_problem(rng: random.Random) -> tuple[str, str]:
    """A word problem and its worked solution (each step an equation, the answer last).

    The draws come first and in a fixed order: the problems are the plan's, so they must not
    change when the solutions do.
    """
    who, other = rng.sample(_NAMES, 2)
    item, place = rng.choice(_ITEMS), rng.choice(_PLACES)
    a, b, c, d = (rng.randint(2, 60) for _ in range(4))
    price, pct = rng.randint(2, 25), rng.choice((10, 20, 25, 40, 50, 75))
    hours, rate = rng.randint(2, 12), rng.randint(8, 40)
    kind = rng.randrange(8)
    if kind == 0:
        problem = (f"{who} has {a} {item}. {who} buys {b} packs with {c} {item} in each pack, then gives "
                   f"{d} {item} to {other}. How many {item} does {who} have now?")
        got, have = b * c, a + b * c
        steps = [f"{who} starts with {a} {item}.",
                 f"{b} packs of {c} is {b} × {c} = {got} {item}, so {who} then has {a} + {got} = {have}."]
        if d > have:
            return problem, "\n".join([*steps, f"{who} cannot give away {d}: that is {d} − {have} = "
                                                f"{d - have} more than {who} has, so the numbers in the "
                                                f"question do not fit."])
        steps.append(f"After giving {d} to {other}: {have} − {d} = {have - d}.")
        answer = f"{have - d} {item}"
    elif kind == 1:
        bill, cost = (a * price // 50 + 1) * 50, a * price
        steps = [f"{a} {item} at ${price} each cost {a} × {price} = ${cost}.",
                 f"The change from a ${bill} bill is {bill} − {cost} = ${bill - cost}."]
        answer = f"${bill - cost}"
        problem = (f"At the {place}, {item} cost ${price} each. {who} buys {a} of them and pays with a "
                   f"${bill} bill. How much change does {who} get?")
    elif kind == 2:
        days = c % 6 + 2
        day, total = rate * hours, rate * hours * days
        rent = total * pct / 100
        steps = [f"In a day {who} earns {rate} × {hours} = ${day}.",
                 f"Over {days} days that is {day} × {days} = ${total}.",
                 f"Rent takes {pct}% of it: {total} × {pct} ÷ 100 = {_money(rent)}.",
                 f"What is left: {total} − {_num(rent)} = {_money(total - rent)}."]
        answer = _money(total - rent)
        problem = (f"{who} earns ${rate} an hour and works {hours} hours a day for {days} days. "
                   f"{who} spends {pct}% of the money on rent. How much money is left?")
    elif kind == 3:
        problem = (f"{who} reads {a} pages on Monday, twice as many on Tuesday, and {d} fewer than on "
                   f"Tuesday on Wednesday. How many pages did {who} read in the three days?")
        steps = [f"Monday: {a} pages.", f"Tuesday: twice as many, 2 × {a} = {2 * a} pages."]
        if d > 2 * a:
            return problem, "\n".join([*steps, f"Wednesday would be {d} fewer than {2 * a}, which is less "
                                                f"than zero: the numbers in the question do not fit."])
        steps += [f"Wednesday: {d} fewer than Tuesday, {2 * a} − {d} = {2 * a - d} pages.",
                  f"In all: {a} + {2 * a} + {2 * a - d} = {5 * a - d} pages."]
        answer = f"{5 * a - d} pages"
    elif kind == 4:
        last, more = a * 10, a * 10 * pct / 100
        steps = [f"Last week: {last} {item}.",
                 f"{pct}% more is {last} × {pct} ÷ 100 = {_num(more)} more, so this week it sold "
                 f"{last} + {_num(more)} = {_num(last + more)}.",
                 f"Over the two weeks: {last} + {_num(last + more)} = {_num(2 * last + more)} {item}."]
        answer = f"{_num(2 * last + more)} {item}"
        problem = (f"A {place} sold {last} {item} last week. This week it sold {pct}% more. "
                   f"How many {item} did it sell over the two weeks?")
    elif kind == 5:
        total, r1, r2 = a * b, c % 5 + 1, d % 5 + 1
        part = total / (r1 + r2)
        steps = [f"The ratio {r1}:{r2} has {r1} + {r2} = {r1 + r2} parts.",
                 f"One part is {total} ÷ {r1 + r2} = {_num(part)} {item}.",
                 f"{who} gets {r1} × {_num(part)} = {_num(r1 * part)} and {other} gets "
                 f"{r2} × {_num(part)} = {_num(r2 * part)}."]
        answer = f"{who} {_num(r1 * part)}, {other} {_num(r2 * part)}"
        problem = (f"{who} and {other} share {total} {item} in the ratio {r1}:{r2}. "
                   f"How many {item} does each of them get?")
    elif kind == 6:
        more_hours = c % 5 + 1
        first, second = rate * 3 * hours, rate * 2 * more_hours
        steps = [f"First part: {rate * 3} × {hours} = {first} km.",
                 f"Second part: {rate * 2} × {more_hours} = {second} km.",
                 f"Total: {first} + {second} = {first + second} km."]
        answer = f"{first + second} km"
        problem = (f"A train travels at {rate * 3} km per hour for {hours} hours, then at {rate * 2} km "
                   f"per hour for {more_hours} more hours. What is the total distance it travels?")
    else:
        gap, later = b % 9 + 2, c % 10 + 1
        steps = [f"{other} is {a} + {gap} = {a + gap} years old.",
                 f"In {later} years {who} will be {a} + {later} = {a + later} and {other} "
                 f"{a + gap} + {later} = {a + gap + later}.",
                 f"The sum: {a + later} + {a + gap + later} = {2 * a + gap + 2 * later}."]
        answer = f"{2 * a + gap + 2 * later} years"
        problem = (f"{who} is {a} years old. {other} is {gap} years older than {who}. In {later} "
                   f"years, what will the sum of their ages be?")
    return problem, "\n".join(steps) + f"\n\n**Answer: {answer}**"


_ARITH_SUFFIXES = ("", " Explain your reasoning step by step.", " Show your work.",
                   " Give the final answer at the end.")


def arithmetic_draws(n: int, seed: int) -> list[tuple[str, str, str]]:
    """``n`` word problems of ``seed``'s generator: (problem, a prompt suffix, worked solution);
    the first ``k`` of ``n`` draws are ``arithmetic_draws(k, seed)`` (the plan's items in order)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        problem, solution = _word_problem(rng)
        out.append((problem, rng.choice(_ARITH_SUFFIXES), solution))
    return out


def arithmetic_items(n: int, seed: int = 0) -> list[TrainingItem]:
    """``n`` templated arithmetic word problems (a seeded generator; no benchmark text)."""
    return [TrainingItem(f"arith/{i}", "arith", ({"role": "user", "content": problem + suffix},))
            for i, (problem, suffix, _) in enumerate(arithmetic_draws(n, seed))]


def arithmetic_solutions(n: int, seed: int = 0) -> dict[str, str]:
    """The worked solution of each of ``arithmetic_items(n, seed)``, by item id."""
    return {f"arith/{i}": solution for i, (_, _, solution) in enumerate(arithmetic_draws(n, seed))}


def build_corpus(sources: tuple[str, ...], n_code: int, n_arith: int, seed: int = 0) -> list[TrainingItem]:
    """Every item of the named sources, in a fixed order (shuffling is the data job's)."""
    unknown = set(sources) - set(SOURCES)
    if unknown:
        raise FlagError(f"unknown corpus sources {sorted(unknown)}; known: {', '.join(SOURCES)}")
    items: list[TrainingItem] = []
    if "sharegpt" in sources:
        items += sharegpt_turn_items("train")
    if "code" in sources:
        items += code_items(n_code, seed)
    if "arith" in sources:
        items += arithmetic_items(n_arith, seed)
    return items


_WORD = re.compile(r"\w+")
DECONTAMINATION_N = 13  # word n-grams, as GPT-3's decontamination


def _ngrams(text: str, n: int) -> set[int]:
    words = _WORD.findall(text.lower())
    return {hash(tuple(words[i : i + n])) for i in range(len(words) - n + 1)}


def benchmark_ngrams(n: int = DECONTAMINATION_N) -> set[int]:
    """Every word n-gram of every benchmark prompt this project evaluates on."""
    from presto_sd.app.datasets import BENCHMARKS, load_prompts

    grams: set[int] = set()
    for name in sorted(BENCHMARKS):
        for p in load_prompts(name, "heldout"):
            grams |= _ngrams(" ".join(p.turns), n)
    return grams


def is_contaminated(item: TrainingItem, grams: set[int], n: int = DECONTAMINATION_N) -> bool:
    """Whether any word n-gram of the item's messages is one of a benchmark prompt's."""
    return text_is_contaminated(" ".join(m["content"] for m in item.messages), grams, n)


def text_is_contaminated(text: str, grams: set[int], n: int = DECONTAMINATION_N) -> bool:
    """Whether any word n-gram of ``text`` is one of a benchmark prompt's (``benchmark_ngrams``)."""
    return not grams.isdisjoint(_ngrams(text, n))
