"""Target-regenerated training data: the target's own responses plus its features.

A drafter must predict what *this* target says, so its training text is the target's own
greedy (optionally sampled) answers to training prompts (DFlash recipe): every ShareGPT
assistant turn plus synthesised code and arithmetic prompts (``corpus.py``). Each
shard holds a batch of sequences and the target hidden states at the drafter's
``target_layer_ids`` for every token, in bf16 (half the disk of fp32, fp32 range: the
residual stream has outliers past fp16 range; the drafter
trains in fp32 from them). Shards are written atomically and skipped when present, so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from presto_sd.app.errors import FlagError
from presto_sd.app.training.token_corpus import write_atomically
from presto_sd.models.loading import cache_kwarg, encode_messages, load_target


@dataclass(frozen=True)
class GenDataConfig:
    out: str
    target: str | None = None
    target_layer_ids: tuple[int, ...] = (1, 8, 14, 20, 27)
    # comma list of corpus.SOURCES, or "v1": the first plan (first ShareGPT turns only, 2026-11-29)
    sources: str = "sharegpt,code,arith"
    n_code: int = 6000  # synthesised programming prompts (stdlib signatures and docstrings)
    n_arith: int = 6000  # synthesised arithmetic word problems
    n_prompts: int = 0  # keep the first n items of the shuffled corpus (0 = all)
    max_prompt_tokens: int = 256  # longer histories lose their oldest turns; longer turns are skipped
    max_new_tokens: int = 256
    batch_size: int = 64
    # training data needs no fp32, but bf16 only pays on a CPU with native bf16 (AVX512-BF16,
    # AMX): on an AVX2-only CPU a bf16 matmul is ~5x slower than fp32 (docs/training.md)
    dtype: str = "float32"
    device: str = "cpu"  # "cuda" on a GPU (scripts/gpu_drafter.sh); features are written from the CPU
    temperature: float = 0.0  # 0 = greedy responses
    seed: int = 0
    max_batches: int = 0  # stop after this many shards (0 = all): a run cut short, reproducibly
    prompts: str = ""  # sources "magpie": the folder of sampled requests (``magpie.PromptChunks``)


# Batches are cut from groups of this many batches sorted by prompt length (less padding
# in the batched prefill); the groups follow the seeded shuffle, so any prefix of the run
# is still a representative sample.
_SORT_GROUP_BATCHES = 16


def plan_batches(cfg: GenDataConfig, tok, cache: Path | None = None) -> list[list[tuple[str, list[int]]]]:
    """Every shard's ``(item id, prompt ids)``: a pure function of ``cfg`` and the tokenizer.

    Tokenising ~50k chat prompts takes minutes on this CPU, so the plan is kept in ``cache``
    (keyed by every field that shapes it) and a restarted job reads it back.
    """
    key = {k: v for k, v in asdict(cfg).items()
           if k not in ("out", "max_batches", "dtype", "device") and not (k == "prompts" and not v)}
    key["decontaminated"] = "13-gram"  # plans made before the filter are planned again
    if cache is not None and cache.exists():
        saved = json.loads(cache.read_text())
        if saved["key"] == key:
            batches = [[(i, ids) for i, ids in b] for b in saved["batches"]]
            return batches[: cfg.max_batches] if cfg.max_batches else batches
    from presto_sd.app.training.corpus import benchmark_ngrams, build_corpus, is_contaminated

    sources = tuple(s for s in cfg.sources.split(",") if s)
    if sources == ("magpie",):  # not cached: it grows as chunks are sampled (and is quick)
        batches = _plan_magpie(cfg, tok)
        return batches[: cfg.max_batches] if cfg.max_batches else batches
    if sources == ("v1",):  # the shipped drafter's data (2026-11-29), reproduced as it was made
        return _cache_plan(cache, key, _plan_v1(cfg, tok), cfg)
    items = build_corpus(sources, cfg.n_code, cfg.n_arith, cfg.seed)
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    items = [items[i] for i in order]
    if cfg.n_prompts:
        items = items[: cfg.n_prompts]
    # after the shuffle, so dropping an item moves nothing before its sort group
    grams = benchmark_ngrams()
    items = [it for it in items if not is_contaminated(it, grams)]
    encoded = []
    for item in items:
        ids = _fit_prompt(tok, list(item.messages), cfg.max_prompt_tokens)
        if ids is not None:
            encoded.append((item.id, ids))
    group = cfg.batch_size * _SORT_GROUP_BATCHES
    batches = []
    for g in range(0, len(encoded), group):
        chunk = sorted(encoded[g : g + group], key=lambda e: len(e[1]))
        batches += [chunk[i : i + cfg.batch_size] for i in range(0, len(chunk), cfg.batch_size)]
    return _cache_plan(cache, key, batches, cfg)


def _cache_plan(cache: Path | None, key: dict, batches: list, cfg: GenDataConfig) -> list:
    if cache is not None:
        write_atomically(cache, json.dumps({"key": key, "batches": batches}).encode())
    return batches[: cfg.max_batches] if cfg.max_batches else batches


def _plan_v1(cfg: GenDataConfig, tok) -> list[list[tuple[str, list[int]]]]:
    """The first plan: the first ``n_prompts`` first human turns of ShareGPT's train split,
    those over ``max_prompt_tokens`` dropped, shuffled, cut into batches in that order."""
    from presto_sd.app.datasets import load_prompts

    prompts = load_prompts("sharegpt", "train", cfg.n_prompts or None)
    encoded = [(p.id, encode_messages(tok, p.messages)) for p in prompts]
    encoded = [(pid, ids) for pid, ids in encoded if len(ids) <= cfg.max_prompt_tokens]
    order = torch.randperm(len(encoded), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    encoded = [encoded[i] for i in order]
    return [encoded[i : i + cfg.batch_size] for i in range(0, len(encoded), cfg.batch_size)]


def _plan_magpie(cfg: GenDataConfig, tok) -> list[list[tuple[str, list[int]]]]:
    """Shard ``i`` answers prompt chunk ``i`` (``magpie.py``): its requests that pass the
    decontamination and fit ``max_prompt_tokens``, shortest first. Chunks only append, so a
    committed shard's batch never changes."""
    from presto_sd.app.training.corpus import benchmark_ngrams, text_is_contaminated
    from presto_sd.app.training.token_corpus import PromptChunks

    if not cfg.prompts:
        raise FlagError("--sources magpie needs --prompts DIR (the folder `presto-sd train magpie` "
                        "samples into)")
    chunks, grams = PromptChunks(cfg.prompts), benchmark_ngrams()
    indices = chunks.indices()
    if indices != list(range(len(indices))):
        raise FlagError(f"{cfg.prompts}: prompt chunks {indices[:8]}... are not 0..n-1 without a gap")
    batches = []
    for i in indices:
        batch = []
        for k, text in enumerate(chunks.read(i)):
            ids = None if text_is_contaminated(text, grams) else _fit_prompt(
                tok, [{"role": "user", "content": text}], cfg.max_prompt_tokens)
            if ids is not None:
                batch.append((f"magpie/{i}/{k}", ids))
        batches.append(sorted(batch, key=lambda e: len(e[1])))
    return batches


def _fit_prompt(tok, messages: list[dict[str, str]], max_tokens: int) -> list[int] | None:
    """The prompt's ids with its oldest turns dropped until it fits; None if the last turn alone does not."""
    # a cheap pre-filter: a history averaging over 12 characters a token is dropped untokenised
    budget_chars = max_tokens * 12
    while messages:
        if sum(len(m["content"]) for m in messages) <= budget_chars:
            ids = encode_messages(tok, messages)
            if len(ids) <= max_tokens:
                return ids
        if len(messages) < 3:
            return None
        messages = messages[2:]  # drop the oldest user/assistant exchange
    return None


def generate_training_data(cfg: GenDataConfig) -> Path:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps(asdict(cfg), indent=2))
    model, tok = load_target(cfg.target, torch.device(cfg.device), getattr(torch, cfg.dtype))
    batches = plan_batches(cfg, tok, out / "plan.json")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = set(filter(None, [tok.eos_token_id])) | {2}
    _check_existing_shards(out, batches)
    todo = [b for b in range(len(batches)) if not (out / f"shard_{b:05d}.safetensors").exists()]
    bar = tqdm(total=len(batches), initial=len(batches) - len(todo), desc="gen-data", unit="shard",
               mininterval=10)
    new_tokens, t0 = 0, time.perf_counter()
    progress = open(out / "progress.jsonl", "a")
    for b in todo:
        batch = batches[b]
        shard = out / f"shard_{b:05d}.safetensors"
        torch.manual_seed(cfg.seed * 1_000_003 + b)  # a shard's samples do not depend on what ran before
        t_shard = time.perf_counter()
        responses, feats = _generate_batch(model, [ids for _, ids in batch], cfg, pad, eos)
        seqs, prompt_lens = [], []
        for (_, ids), resp in zip(batch, responses):
            seqs.append(ids + resp)
            prompt_lens.append(len(ids))
        lens = torch.tensor([len(s) for s in seqs])
        tensors = {
            "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
            "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),
            "features": torch.cat(feats, dim=0).contiguous(),
        }
        tmp = shard.with_suffix(".tmp")
        save_file(tensors, tmp, metadata={"ids": json.dumps([i for i, _ in batch])})
        tmp.rename(shard)  # atomic: a shard on disk is always whole
        n_new = sum(len(r) for r in responses)
        new_tokens += n_new
        row = {"shard": b, "seqs": len(batch), "new_tokens": n_new, "tokens": int(lens.sum()),
               "seconds": round(time.perf_counter() - t_shard, 2), "bytes": shard.stat().st_size,
               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        progress.write(json.dumps(row) + "\n")
        progress.flush()
        bar.update(1)
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    return out


def _check_existing_shards(out: Path, batches: list) -> None:
    """Refuse to resume over shards another plan made (other flags, another corpus)."""
    for shard in sorted(out.glob("shard_*.safetensors")):
        b = int(shard.stem.split("_")[1])
        with safe_open(shard, "pt") as f:
            ids = json.loads((f.metadata() or {}).get("ids", "null"))
        if ids is not None and (b >= len(batches) or ids != [i for i, _ in batches[b]]):
            raise FlagError(f"{shard} was written by another plan than these flags make: "
                            "resume with the flags it was made with, or give another --out")


class _ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` that writes new keys into a buffer reserved for the whole generation
    instead of concatenating: transformers' ``torch.cat`` copies the layer's every key and
    value on every step, 30 % of a 64-token generation batch's CPU here (torch profiler,
    2026-12-06), and more the longer the answers. Attention reads a view of the filled part:
    the same values, so the same tokens (checked against shards made with ``DynamicLayer``)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            b, h, _, d = key_states.shape
            self._k = key_states.new_empty(b, h, self.capacity, d)
            self._v = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        end = self.length + key_states.shape[-2]
        if end > self.capacity:  # past the reservation: grow (not on the generation path)
            self.capacity = max(end, 2 * self.capacity)
            self._k, self._v = (_regrown(t, self.length, self.capacity) for t in (self._k, self._v))
        self._k[..., self.length : end, :] = key_states
        self._v[..., self.length : end, :] = value_states
        self.length = end
        self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[..., : self.length, :], self._v[..., : self.length, :]


def _regrown(buffer: torch.Tensor, filled: int, capacity: int) -> torch.Tensor:
    b, h, _, d = buffer.shape
    out = buffer.new_empty(b, h, capacity, d)
    out[..., :filled, :] = buffer[..., :filled, :]
    return out


class ReservedCache(DynamicCache):
    """A ``DynamicCache`` of ``_ReservedLayer``: ``capacity`` positions reserved per layer."""

    def __init__(self, n_layers: int, capacity: int) -> None:
        super().__init__()
        self.layers = [_ReservedLayer(capacity) for _ in range(n_layers)]
        self.layer_class_to_replicate = None


@torch.inference_mode()
def _generate_batch(model, prompts: list[list[int]], cfg: GenDataConfig, pad: int, eos: set[int],
                    capture_features: bool = True, kv_cache: str = "reserved"):
    """Batched greedy/sampled decoding that drops finished rows from the batch each step.

    transformers' ``generate`` keeps stepping finished rows until the longest one ends;
    on chat data most answers are short, so that wasted most of the CPU. The features are
    captured from the same forwards (no second pass): every token's hidden states at the
    target layers, except the last token's, which is never fed and never needed (a
    training block only sees context before its anchor); it is stored as zeros.
    """
    layer_ids = cfg.target_layer_ids

    def layer_feats(o) -> torch.Tensor:
        return torch.cat([o.hidden_states[i + 1] for i in layer_ids], dim=-1).to("cpu", torch.bfloat16)

    dev = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    ids, attn = ids.to(dev), attn.to(dev)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    # ``kv_cache`` "reserved" (``ReservedCache``) where every layer attends fully, as a Llama's do;
    # "dynamic", or a model with sliding-window layers: transformers' own
    full = getattr(model.config, "sliding_window", None) is None
    if kv_cache == "reserved" and full:
        cache = ReservedCache(model.config.num_hidden_layers, width + cfg.max_new_tokens)
    else:
        cache = DynamicCache()
    kv = {cache_kwarg(model): cache}
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **kv,
                logits_to_keep=1, output_hidden_states=capture_features)  # full [B, T, V] logits: gigabytes
    if capture_features:
        pre = layer_feats(out)
        feats = [[pre[i, width - len(p):]] for i, p in enumerate(prompts)]
    rows = torch.arange(len(prompts))  # original index of each active row
    last_pos = pos[:, -1]
    responses: list[list[int]] = [[] for _ in prompts]
    for _ in range(cfg.max_new_tokens):
        logits = out.logits[:, -1].float()
        if cfg.temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / cfg.temperature, -1), 1)[:, 0]
        else:
            nxt = logits.argmax(-1)
        done = torch.zeros(len(rows), dtype=torch.bool)
        for j, (r, t) in enumerate(zip(rows.tolist(), nxt.tolist())):
            responses[r].append(t)
            done[j] = t in eos or len(responses[r]) >= cfg.max_new_tokens
        keep = (~done).nonzero()[:, 0]
        if len(keep) == 0:
            break
        if len(keep) < len(rows):
            rows, keep = rows[keep], keep.to(dev)
            cache.batch_select_indices(keep)
            attn, nxt, last_pos = attn[keep], nxt[keep], last_pos[keep]
        attn = torch.cat([attn, torch.ones(len(rows), 1, dtype=attn.dtype, device=dev)], dim=1)
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos[:, None],
                    use_cache=True, output_hidden_states=capture_features, **kv)
        if capture_features:
            step = layer_feats(out)
            for j, r in enumerate(rows.tolist()):
                feats[r].append(step[j])
    if not capture_features:
        return responses, None
    width_f = feats[0][0].shape[-1]
    feats = [torch.cat([*f, torch.zeros(1, width_f, dtype=torch.bfloat16)]) for f in feats]
    return responses, feats


@dataclass
class Sequence:
    """One training sequence; its features stay on disk until read (shards can outgrow RAM)."""

    tokens: torch.Tensor  # long [T]
    prompt_len: int
    shard: Path
    start: int  # row of the first token in the shard's features

    @property
    def features(self) -> torch.Tensor:
        """bf16 [T, F], read from the shard's memory map."""
        return _open_shard(self.shard).get_slice("features")[self.start : self.start + len(self.tokens)]

    @property
    def soft_labels(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The target's top-k ids int [T, k] and log-probs [T, k] at every row (row t predicts
        token t + 1), where the shard has them (``features.py`` prefills); else None."""
        f = _open_shard(self.shard)
        if "topk_ids" not in f.keys():
            return None
        rows = slice(self.start, self.start + len(self.tokens))
        return f.get_slice("topk_ids")[rows], f.get_slice("topk_logprobs")[rows]


@lru_cache(maxsize=64)
def _open_shard(path: Path):
    return safe_open(path, "pt")


def load_shards(data_dir: str | Path) -> list[Sequence]:
    """Every sequence of every shard in ``data_dir`` (tokens in memory, features on disk)."""
    seqs = []
    for f in sorted(Path(data_dir).glob("shard_*.safetensors")):
        with safe_open(f, "pt") as t:
            tokens, off = t.get_tensor("tokens"), t.get_tensor("offsets").tolist()
            plens = t.get_tensor("prompt_lens")
        for i in range(len(off) - 1):
            seqs.append(Sequence(tokens[off[i] : off[i + 1]].long(), int(plens[i]), f, off[i]))
    return seqs
