"""How many of the target's tokens on the benchmark sets a draft vocabulary cannot hold.

A token outside the drafter's vocabulary (``d2t``) is a certain rejection at its position.
Reads the replay's recordings (the target's greedy continuations of the benchmark prompts:
``presto-sd bench --replay`` writes them into the cache) and reports, per set, the share
of continuation tokens outside (a) the shipped drafter's vocabulary and (b) vocabularies
of the N most frequent response tokens of the repo corpus.

    .venv/bin/python scripts/draft_vocab_coverage.py [--recordings FILE] [--sizes 8192,16384,32768]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

import torch

from presto_sd.app.bench.replay import load_recordings
from presto_sd.app.training.grow_corpus import DEFAULT_CORPUS
from presto_sd.app.training.token_corpus import Corpus
from presto_sd.models.cache import cache_dir
from presto_sd.models.dflash import DFlashDraftModel
from presto_sd.models.loading import DEFAULT_DRAFTER


def corpus_counts(corpus: Corpus) -> Counter[int]:
    counts: Counter[int] = Counter()
    for i in corpus.indices():
        for r in corpus.read(i).responses:
            counts.update(r)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recordings", default=None, help="a recordings file (default: the newest in the cache)")
    p.add_argument("--corpus", default=DEFAULT_CORPUS)
    p.add_argument("--sizes", default="8192,16384,32768")
    args = p.parse_args()
    path = Path(args.recordings) if args.recordings else max(cache_dir("replay").glob("*.pt"),
                                                              key=lambda f: f.stat().st_mtime)
    recordings = load_recordings(path)
    by_set: dict[str, list[int]] = defaultdict(list)
    for key, rec in recordings.items():
        by_set[key.split("/")[0]].extend(rec.continuation)
    vocabs = {"shipped": set(DFlashDraftModel.load(DEFAULT_DRAFTER).d2t.tolist())}
    counts = corpus_counts(Corpus(args.corpus))
    for n in (int(x) for x in args.sizes.split(",")):
        vocabs[f"corpus-top{n}"] = {t for t, _ in counts.most_common(n)}
    rows = {name: {ds: round(sum(t not in v for t in toks) / len(toks), 4)
                   for ds, toks in sorted(by_set.items())} for name, v in vocabs.items()}
    print(json.dumps({"recordings": str(path), "tokens": {ds: len(t) for ds, t in sorted(by_set.items())},
                      "corpus_response_tokens": sum(counts.values()), "out_of_vocab": rows}, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
