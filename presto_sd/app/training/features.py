"""Target features and soft labels, recomputed from the repo corpus's token ids by a prefill.

The repo keeps only ids (``token_corpus``); what a drafter trains on besides them — the
target's hidden states at its feature layers, and the target's own distribution at every
position (top-k log-probabilities: the soft labels) — is one batched prefill of each
sequence away. It is cached under ``$PRESTO_SD_CACHE/features``, keyed by the shard's
sha256, the layers, k and the dtype, so a cache miss costs a prefill, never a
regeneration. ``materialize`` lays the cached files out as a ``train drafter --data`` dir.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from presto_sd.app.training.corpus import item_source
from presto_sd.app.training.token_corpus import Corpus, CorpusError, IdShard
from presto_sd.models.cache import cache_dir

SOFT_TOP_K = 16


@torch.inference_mode()
def prefill_sequences(
    model, seqs: list[list[int]], layer_ids: tuple[int, ...], top_k: int = SOFT_TOP_K,
    max_batch_tokens: int = 4096,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: features bf16 [T, F], top-k target ids int32 [T, k], their log-probs fp16 [T, k].

    Row t holds what the target computes after reading tokens 0..t (its prediction of
    token t + 1), so the last row is a real prediction here (generation never fed the
    last token and stored zeros for its features). Sequences are right-padded in batches
    of similar length: with causal attention a pad after a row never reaches it.
    """
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    feats: list = [None] * len(seqs)
    top_ids: list = [None] * len(seqs)
    top_lp: list = [None] * len(seqs)
    head = model.get_output_embeddings()
    dev = next(model.parameters()).device
    at = 0
    while at < len(order):
        group: list[int] = []  # ascending lengths: the last one added sets the width
        while at < len(order):
            if group and len(seqs[order[at]]) * (len(group) + 1) > max_batch_tokens:
                break
            group.append(order[at])
            at += 1
        width = len(seqs[group[-1]])
        ids = torch.zeros(len(group), width, dtype=torch.long)
        for j, i in enumerate(group):
            ids[j, : len(seqs[i])] = torch.tensor(seqs[i])
        out = model.get_decoder()(input_ids=ids.to(dev), output_hidden_states=True, use_cache=False)
        layers = torch.cat([out.hidden_states[k + 1] for k in layer_ids], dim=-1)
        for j, i in enumerate(group):
            n = len(seqs[i])
            feats[i] = layers[j, :n].to("cpu", torch.bfloat16)
            logp = torch.log_softmax(head(out.last_hidden_state[j, :n]).float(), dim=-1)
            lp, ti = logp.topk(top_k, dim=-1)
            top_ids[i], top_lp[i] = ti.to("cpu", torch.int32), lp.to("cpu", torch.float16)
    return feats, top_ids, top_lp


def shard_tensors(
    model, shard: IdShard, layer_ids: tuple[int, ...], top_k: int = SOFT_TOP_K
) -> dict[str, torch.Tensor]:
    """A ``load_shards``-format dict for one id shard: tokens, offsets, prompt_lens, features, soft labels."""
    seqs = [list(p) + list(r) for p, r in zip(shard.prompts, shard.responses)]
    feats, top_ids, top_lp = prefill_sequences(model, seqs, layer_ids, top_k)
    lens = torch.tensor([len(s) for s in seqs])
    return {
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
        "prompt_lens": torch.tensor([len(p) for p in shard.prompts], dtype=torch.int32),
        "features": torch.cat(feats).contiguous(),
        "topk_ids": torch.cat(top_ids).contiguous(),
        "topk_logprobs": torch.cat(top_lp).contiguous(),
    }


def feature_cache_path(sha256: str, layer_ids: tuple[int, ...], top_k: int, dtype: torch.dtype) -> Path:
    layers, dt = "-".join(map(str, layer_ids)), str(dtype).removeprefix("torch.")
    return cache_dir("features") / f"{sha256[:24]}.L{layers}.k{top_k}.{dt}.safetensors"


def materialize(corpus_dir: str | Path, out: str | Path, model, target: str | None,
                layer_ids: tuple[int, ...], top_k: int = SOFT_TOP_K, max_shards: int = 0,
                first_shard: int = 0, sources: tuple[str, ...] = ()) -> Path:
    """A ``train drafter --data`` dir for the corpus: each shard's features from the cache,
    prefilled first where missing. Returns ``out``; its ``meta.json`` states the prefill rate.

    ``first_shard``/``max_shards`` pick a window of shards in corpus order (a warm-started
    drafter trains on the shards its parent never saw). ``sources`` (plan sources, e.g.
    ``("sharegpt",)``): only those items, written out as a copy of each cached shard's rows
    instead of a link to it (the cache keeps whole shards)."""
    corpus = Corpus(corpus_dir)
    if not corpus.manifest_path.exists():  # a mistyped path would otherwise train on nothing
        raise CorpusError(f"{corpus_dir}: not a corpus (no manifest.json)")
    indices = [i for i in corpus.indices() if i >= first_shard][: max_shards or None]
    if not indices:
        raise CorpusError(f"{corpus_dir}: no corpus shards from shard {first_shard} (its manifest.json "
                          f"lists {len(corpus.indices())})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    entries = corpus.manifest()["shards"]
    prefilled_tokens, prefill_s = 0, 0.0
    for i in tqdm(indices, desc="features", unit="shard", mininterval=10):
        if entries[str(i)]["sequences"] == 0:  # a written corpus's shard with no ShareGPT item
            continue
        cached = feature_cache_path(entries[str(i)]["sha256"], layer_ids, top_k, dtype)
        if not cached.exists():
            shard = corpus.read(i)
            t0 = time.perf_counter()
            tensors = shard_tensors(model, shard, layer_ids, top_k)
            prefill_s += time.perf_counter() - t0
            prefilled_tokens += shard.n_tokens
            tmp = cached.with_suffix(".tmp")
            save_file(tensors, tmp, metadata={"ids": json.dumps(list(shard.item_ids))})
            tmp.rename(cached)
        link = out / f"shard_{i:05d}.safetensors"
        if sources:  # a copy of the rows, kept while it is the copy of this cached shard
            origin = f"{cached.name} {','.join(sources)}"
            if _copied_from(link) != origin:
                tensors, metadata = subset_rows(cached, sources)
                tmp = link.with_suffix(".tmp")
                save_file(tensors, tmp, metadata={**metadata, "copied_from": origin})
                tmp.replace(link)
        else:
            link.unlink(missing_ok=True)
            link.symlink_to(cached)
    meta = {"target": target, "target_layer_ids": list(layer_ids), "top_k": top_k,
            "dtype": str(dtype).removeprefix("torch."), "corpus": str(corpus_dir), "shards": len(indices),
            "first_shard": indices[0], "sources": list(sources) or "all",
            "prefilled_tokens": prefilled_tokens, "prefill_seconds": round(prefill_s, 1),
            "prefill_tokens_per_s": round(prefilled_tokens / prefill_s, 1) if prefill_s else None}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return out


def _copied_from(path: Path) -> str | None:
    """The cached shard and sources a copy of rows was made from (None: no copy there, or a link)."""
    if path.is_symlink() or not path.is_file():
        return None
    with safe_open(path, "pt") as f:
        return (f.metadata() or {}).get("copied_from")


def subset_rows(path: Path, sources: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A cached shard's tensors and metadata with only the sequences whose item comes from ``sources``."""
    with safe_open(path, "pt") as f:
        ids = json.loads(f.metadata()["ids"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    keep = [j for j, item in enumerate(ids) if item_source(item) in sources]
    off = t["offsets"].tolist()
    rows = torch.cat([torch.arange(off[j], off[j + 1]) for j in keep] or [torch.zeros(0, dtype=torch.long)])
    lens = torch.tensor([off[j + 1] - off[j] for j in keep], dtype=torch.long)
    out = {k: t[k][rows].contiguous() for k in ("tokens", "features", "topk_ids", "topk_logprobs")}
    out["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    out["prompt_lens"] = t["prompt_lens"][keep].contiguous()
    return out, {"ids": json.dumps([ids[j] for j in keep])}
