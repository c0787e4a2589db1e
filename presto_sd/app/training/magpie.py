"""``presto-sd train magpie``: the corpus's second plan — prompts the target writes itself.

The first plan (every ShareGPT turn, stdlib code, templated arithmetic) is spent: the
repo corpus holds all of it. New regenerated data needs new prompts, and they must come
from nothing that is evaluation material. An instruct model given its chat template up to
the start of a user turn — and nothing else — writes a user's request (Magpie, Xu et al.
2024): sampled at temperature 1, SmolLM2-135M-Instruct asks for stories, role-play, plans,
code and explanations, the kinds of request MT-Bench holds and the drafter reads worst.

Two stages, both in the repo, both resumable:

1. **Prompts** (``corpus/prompts/<name>``): chunk ``i`` is one sampling batch of
   ``chunk_size`` requests, seeded by ``i``; a request is kept when the target ended it
   (``<|im_end|>``) within ``max_query_tokens`` and it has at least ``min_words`` words,
   once per chunk. The chunks are committed as xz-compressed JSON lines with a manifest
   (sha256, sampled, kept, the command, dtype and CPU): sampling is not reproduced across
   machines, so what was sampled is kept, not re-drawn.
2. **Answers**: ``grow-corpus --sources magpie --prompts DIR`` into a corpus of its own,
   the target's greedy answers, shard ``i`` answering chunk ``i`` (the plan appends as chunks
   are added, so adding prompts never makes a committed shard stale).

``--request-start TEXT`` steers a plan: every request begins with TEXT and the target writes
the rest (math word problems for GSM8K: ``corpus/prompts/smollm2-135m-magpie-math``); the
folder's key holds TEXT, so a steered plan and a free one never share a folder.

Every request passes the corpus's 13-gram decontamination against every benchmark
prompt when it is planned (``corpus.is_contaminated``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from presto_sd.app.training.grow_corpus import GrowConfig, _flag, grow_corpus, plan_key
from presto_sd.app.training.token_corpus import Corpus, PromptChunks, made_by

DEFAULT_PROMPTS = "corpus/prompts/smollm2-135m-magpie"
DEFAULT_MAGPIE_CORPUS = "corpus/smollm2-135m-magpie"
# the steered third plan (since 2026-12-08): math word problems, for GSM8K
MATH_REQUEST_START = "Solve this math word problem:"
MATH_PROMPTS = "corpus/prompts/smollm2-135m-magpie-math"
MATH_CORPUS = "corpus/smollm2-135m-magpie-math"
_PLACEHOLDER = "\x00PROMPT\x00"


@dataclass(frozen=True)
class MagpieConfig:
    prompts: str = _flag(DEFAULT_PROMPTS, "the prompts folder (manifest.json and chunk files)")
    corpus: str = _flag(DEFAULT_MAGPIE_CORPUS, "the corpus folder the answers go to")
    target: str | None = _flag(None, "the target model dir; none: SmolLM2-135M-Instruct")
    chunks: int = _flag(100, "prompt chunks (and answer shards) to have, 8 sampled then answered at a time")
    chunk_size: int = _flag(64, "requests sampled per chunk (one batch)")
    max_query_tokens: int = _flag(96, "a request the target has not ended by then is dropped")
    min_words: int = _flag(3, "requests of fewer words the target wrote are dropped")
    temperature: float = _flag(1.0, "the requests' sampling temperature")
    seed: int = _flag(0, "chunk i samples with seed (seed, i)")
    dtype: str = _flag("bfloat16", "the target's dtype; bfloat16 only where the CPU has AVX512-BF16/AMX")
    max_new_tokens: int = _flag(256, "answer tokens per request at most")
    answer: bool = _flag(True, "answer the chunks after sampling them (--no-answer: prompts only)")
    request_start: str = _flag("", "the words every request begins with, the target writing the rest: "
                                   "steers the requests to a domain (e.g. math word problems); '' = free")

    def __post_init__(self) -> None:  # the target goes on from its last word (its own space or newline)
        object.__setattr__(self, "request_start", self.request_start.strip())


def prompt_key(cfg: MagpieConfig, prefix: str) -> dict:
    """What decides a chunk's requests (the manifest's key: chunks of other keys do not mix)."""
    return {"target": cfg.target, "prefix": prefix, "chunk_size": cfg.chunk_size,
            "max_query_tokens": cfg.max_query_tokens, "min_words": cfg.min_words,
            "temperature": cfg.temperature, "seed": cfg.seed, "dtype": cfg.dtype}


def user_turn_prefix(tok) -> str:
    """The chat template's text up to where a user's request begins (its default system
    prompt included: what every request the target answers starts with)."""
    text = tok.apply_chat_template([{"role": "user", "content": _PLACEHOLDER}], tokenize=False)
    return text[: text.index(_PLACEHOLDER)]


def sampling_prefix(tok, cfg: MagpieConfig) -> str:
    """What the target continues into a request: the user turn's start, then ``request_start``."""
    return user_turn_prefix(tok) + cfg.request_start


def sample_requests(model, tok, cfg: MagpieConfig, index: int) -> tuple[list[str], int]:
    """Chunk ``index``: (the kept requests, how many were sampled)."""
    from presto_sd.app.training.gen_data import GenDataConfig, _generate_batch

    prefix = tok(sampling_prefix(tok, cfg), add_special_tokens=False).input_ids
    gen = GenDataConfig(out="", temperature=cfg.temperature, max_new_tokens=cfg.max_query_tokens)
    end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(cfg.seed * 1_000_003 + index)
    rows, _ = _generate_batch(model, [prefix] * cfg.chunk_size, gen, pad, {end}, capture_features=False)
    kept, seen = [], set()
    for ids in rows:
        if not ids or ids[-1] != end:  # not ended within max_query_tokens
            continue
        written = tok.decode(ids[:-1], skip_special_tokens=True)  # the target's own words
        text = (cfg.request_start + written).strip()  # as the target read and wrote it
        if len(written.split()) >= cfg.min_words and text.lower() not in seen:
            seen.add(text.lower())
            kept.append(text)
    return kept, len(rows)


def grow_prompts(cfg: MagpieConfig, model, tok, upto: int) -> PromptChunks:
    """Sample every chunk below ``upto`` the folder lacks."""
    chunks = PromptChunks(cfg.prompts)
    chunks.open(prompt_key(cfg, sampling_prefix(tok, cfg)))  # a free folder's key: as before
    have = set(chunks.indices())
    todo = [i for i in range(upto) if i not in have]
    bar = tqdm(total=upto, initial=upto - len(todo), desc="magpie prompts", unit="chunk", mininterval=10)
    for i in todo:
        t0 = time.perf_counter()
        requests, sampled = sample_requests(model, tok, cfg, i)
        chunks.write(i, requests, sampled, made_by(cfg.dtype, time.perf_counter() - t0))
        bar.update(1)
        bar.set_postfix(requests=chunks.manifest()["totals"]["requests"])
    bar.close()
    return chunks


def answer_config(cfg: MagpieConfig) -> GrowConfig:
    """The answering stage: ``grow-corpus`` over the sampled requests."""
    return GrowConfig(corpus=cfg.corpus, target=cfg.target, sources="magpie", prompts=cfg.prompts,
                      max_new_tokens=cfg.max_new_tokens, dtype=cfg.dtype, seed=cfg.seed)


# chunks sampled, then answered, per step: a job stopped anywhere has both stages' work committed
_STEP_CHUNKS = 8


def run_magpie(cfg: MagpieConfig, model=None, tok=None) -> Path:
    """Both stages up to ``cfg.chunks``, ``_STEP_CHUNKS`` at a time: the prompts, then
    (``cfg.answer``) their answers."""
    from presto_sd.models.loading import load_target

    if model is None:
        model, tok = load_target(cfg.target, torch.device("cpu"), getattr(torch, cfg.dtype))
    grow = answer_config(cfg)
    answers = Corpus(cfg.corpus)
    if cfg.answer and answers.manifest_path.exists():  # another plan's (a forgotten --corpus): refused
        answers.open_plan(plan_key(grow), tok.name_or_path or str(cfg.target))  # before any sampling
    for upto in [*range(_STEP_CHUNKS, cfg.chunks, _STEP_CHUNKS), cfg.chunks]:
        grow_prompts(cfg, model, tok, upto)
        if cfg.answer:
            grow_corpus(replace(grow, max_shards=upto), model, tok)
    return Path(cfg.corpus if cfg.answer else cfg.prompts)
