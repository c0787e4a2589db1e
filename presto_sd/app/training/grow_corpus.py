"""``presto-sd train grow-corpus``: add the target's responses to the repo corpus, shard by shard.

The job is meant to run in the background for as long as there is work on the project
(``nice 19``; ``kill -STOP`` it while anything is timed): every shard it finishes is whole
on disk with its manifest entry, so it stops anywhere and resumes from the committed
shards on any machine. The plan (which prompts go in which shard) is a pure function of
the flags and the tokenizer (``gen_data.plan_batches``); each shard keeps its item ids and
a resume checks them against the plan.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from presto_sd.app.training.gen_data import GenDataConfig, _generate_batch, plan_batches
from presto_sd.app.training.token_corpus import Corpus, CorpusError, IdShard, made_by
from presto_sd.models.cache import cache_dir
from presto_sd.models.loading import load_target

DEFAULT_CORPUS = "corpus/smollm2-135m"


def _flag(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class GrowConfig:
    corpus: str = _flag(DEFAULT_CORPUS, "the corpus folder (manifest.json and id shards)")
    target: str | None = _flag(None, "the target model dir; none: SmolLM2-135M-Instruct")
    sources: str = _flag("sharegpt,code,arith", "prompt sources, in plan order; or magpie alone "
                         "(the requests `train magpie` sampled, in --prompts)")
    prompts: str = _flag("", "the sampled prompts folder, for --sources magpie")
    n_code: int = _flag(6000, "stdlib-function prompts in the plan")
    n_arith: int = _flag(6000, "templated arithmetic prompts in the plan")
    max_prompt_tokens: int = _flag(256, "prompt tokens at most")
    max_new_tokens: int = _flag(256, "response tokens per prompt at most")
    batch_size: int = _flag(64, "prompts per shard (one generation batch)")
    dtype: str = _flag("bfloat16", "the target's dtype; bfloat16 only where the CPU has AVX512-BF16/AMX")
    seed: int = _flag(0, "the plan's shuffle and the sampling seed per shard")
    max_shards: int = _flag(0, "stop once the corpus holds this many plan batches (0: the whole plan)")
    drop_stale: bool = _flag(False, "remove committed shards the plan no longer makes, then regenerate them")

    def gen_config(self) -> GenDataConfig:
        return GenDataConfig(out="", target=self.target, sources=self.sources, n_code=self.n_code,
                             n_arith=self.n_arith, max_prompt_tokens=self.max_prompt_tokens,
                             max_new_tokens=self.max_new_tokens, batch_size=self.batch_size,
                             dtype=self.dtype, seed=self.seed, prompts=self.prompts)


def plan_key(cfg: GrowConfig) -> dict:
    """What decides the corpus's content: everything but where it goes and how far it runs.
    ``prompts`` by its folder's name, so that another checkout's path resumes the same corpus
    (and left out where unset, so corpora of the first plan keep their key)."""
    key = {k: v for k, v in asdict(cfg).items()
           if k not in ("corpus", "max_shards", "drop_stale") and not (k == "prompts" and not v)}
    if "prompts" in key:
        key["prompts"] = Path(key["prompts"]).name
    return key


def stale_shards(corpus: Corpus, batches: list) -> list[int]:
    """Committed shards whose (item id, prompt ids) differ from the plan's batch of that index."""
    stale = []
    for i in corpus.indices():
        shard = corpus.read(i)
        planned = batches[i] if i < len(batches) else []
        made = list(zip(shard.item_ids, map(list, shard.prompts)))
        if made != [(item, list(ids)) for item, ids in planned]:
            stale.append(i)
    return stale


def grow_corpus(cfg: GrowConfig, model=None, tok=None) -> Path:
    """Generate every plan batch the corpus lacks, in plan order, up to ``max_shards``."""
    corpus = Corpus(cfg.corpus)
    if model is None:
        model, tok = load_target(cfg.target, torch.device("cpu"), getattr(torch, cfg.dtype))
    corpus.open_plan(plan_key(cfg), tok.name_or_path or str(cfg.target))
    gen = cfg.gen_config()
    key_hash = hashlib.sha256(json.dumps(plan_key(cfg), sort_keys=True).encode()).hexdigest()[:16]
    batches = plan_batches(gen, tok, cache_dir("plans") / f"corpus-{key_hash}.json")
    last = min(len(batches), cfg.max_shards) if cfg.max_shards else len(batches)
    stale = stale_shards(corpus, batches)
    if stale and cfg.drop_stale:
        for i in stale:
            corpus.remove(i)
        print(f"grow-corpus: removed stale shards {stale}; they are generated again", flush=True)
    elif stale:
        raise CorpusError(f"shards {stale} of {corpus.root} hold other prompts than the plan's batches: "
                          "the plan changed (tokenizer, stdlib, datasets); remove them "
                          "(`presto-sd train grow-corpus --drop-stale`) or give another --corpus")
    done = set(corpus.indices())
    todo = [b for b in range(last) if b not in done]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = set(filter(None, [tok.eos_token_id])) | {2}
    bar = tqdm(total=last, initial=last - len(todo), desc="grow-corpus", unit="shard", mininterval=10)
    new_tokens, t0 = 0, time.perf_counter()
    for b in todo:
        batch = batches[b]
        torch.manual_seed(cfg.seed * 1_000_003 + b)  # a shard does not depend on what ran before it
        t_shard = time.perf_counter()
        prompts = [ids for _, ids in batch]
        responses = _generate_batch(model, prompts, gen, pad, eos, capture_features=False)[0] if batch else []
        shard = IdShard(tuple(i for i, _ in batch), tuple(tuple(ids) for _, ids in batch),
                        tuple(tuple(r) for r in responses))
        corpus.write(b, shard, made_by(cfg.dtype, time.perf_counter() - t_shard))
        new_tokens += shard.n_response_tokens
        bar.update(1)
        bar.set_postfix(new_tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}",
                        corpus_tokens=corpus.manifest()["totals"]["tokens"])
    bar.close()
    return corpus.root
