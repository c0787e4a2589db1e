"""``presto-sd train self-draft``: the self-speculative adapter, from the repo corpus's token ids.

Each step takes ``batch_seqs`` sequences of the corpus (a prompt and the target's own
response), runs the frozen target over them once without gradients (its K/V per layer and
its own next-token distributions), then hangs ``chains_per_seq`` mask chains of ``block``
rows after random response positions and trains only the adapter
(``models/self_draft.py``): mask ``j`` after position ``p`` learns the token at
``p + j + 1``, by cross-entropy on the corpus token and on the target's own distribution
there (``soft_weight``), weighted ``exp(-(j - 1) / gamma)`` as the DFlash recipe weights
block slots. No features are stored: the corpus's ids are the whole input.

Resumable: ``OUT/train_state.pt`` every ``ckpt_every`` steps; ``OUT/adapter`` is the
adapter dir ``--drafter self:OUT/adapter`` loads.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from presto_sd.app.errors import FlagError
from presto_sd.app.training.grow_corpus import DEFAULT_CORPUS
from presto_sd.models.assets import write_digests
from presto_sd.models.self_draft import SelfDraftAdapter, mask_chain_forward, real_pass


@dataclass(frozen=True)
class SelfTrainConfig:
    corpus: str = DEFAULT_CORPUS
    first_shard: int = field(default=0, metadata={"help": "the corpus's first shard to read"})
    max_shards: int = field(default=0, metadata={"help": "shards to read (0: all from --first-shard)"})
    target: str = ""  # the target (default: SmolLM2-135M-Instruct)
    block: int = field(default=6, metadata={"help": "mask rows per chain: the depths drafted"})
    rank: int = 16
    alpha: float = 32.0
    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 30
    grad_clip: float = 1.0
    batch_seqs: int = 4
    max_len: int = field(default=256, metadata={"help": "tokens per sequence window"})
    chains_per_seq: int = 16
    soft_weight: float = field(default=0.5, metadata={"help": "weight of the target-distribution loss"})
    gamma: float = 4.0
    heldout_seqs: int = 32
    log_every: int = 10
    ckpt_every: int = 50
    bf16: bool = field(default=False, metadata={"help": "autocast the forwards to bf16 (native-bf16 CPUs)"})
    seed: int = 0
    out: str = "runs/self-draft"


Sequence = tuple[tuple[int, ...], tuple[int, ...]]  # prompt ids, response ids


def corpus_sequences(corpus: str, first: int = 0, max_shards: int = 0) -> list[Sequence]:
    """Every (prompt, response) of the corpus's shards ``first ..`` (``max_shards`` of them)."""
    from presto_sd.app.training.token_corpus import Corpus

    c = Corpus(corpus)
    indices = [i for i in c.indices() if i >= first]
    if max_shards:
        indices = indices[:max_shards]
    out: list[Sequence] = []
    for i in indices:
        shard = c.read(i)
        out += [(p, r) for p, r in zip(shard.prompts, shard.responses)]
    return out


def window(seq: Sequence, max_len: int, block: int) -> tuple[list[int], int] | None:
    """A window of at most ``max_len`` tokens with room for a chain in the response: its
    ids and the first position a chain may hang after (the prompt's last token); None when
    the response is too short for one chain."""
    prompt, response = seq
    start = max(0, len(prompt) - max_len // 2)  # at least half the window is response
    ids = [*prompt, *response][start : start + max_len]
    first = len(prompt) - 1 - start
    if len(ids) - block - 2 < first:
        return None
    return ids, first


def make_batch(windows: list[tuple[list[int], int]], chains: int, block: int,
               rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids ``[B, T]`` and chain hang positions ``[B, chains]`` (with repeats when
    a response has fewer positions)."""
    t = max(len(ids) for ids, _ in windows)
    ids = torch.zeros(len(windows), t, dtype=torch.long)
    hang = torch.zeros(len(windows), chains, dtype=torch.long)
    for b, (w, first) in enumerate(windows):
        ids[b, : len(w)] = torch.tensor(w)
        last = len(w) - block - 2  # the chain's last label, at hang + block + 1, stays inside
        hang[b] = torch.tensor([rng.randint(first, last) for _ in range(chains)])
    return ids, hang


def chain_loss(model, adapter: SelfDraftAdapter, ids: torch.Tensor, hang: torch.Tensor, block: int,
               soft_weight: float, gamma: float) -> tuple[torch.Tensor, dict]:
    """The adapter's loss on chains after ``hang [B, A]`` in the sequences ``ids [B, T]``, and
    its top-1 accuracy per depth (against the target's own argmax at each label position)."""
    with torch.no_grad():  # the real rows: the target as it is, once
        last, real_kv = real_pass(model, ids)
        j = torch.arange(1, block + 1)
        label_pos = (hang[..., None] + j + 1).flatten(1)  # [B, A*block]: the token mask j predicts
        # the target's distribution there is its row at label_pos - 1
        rows = torch.gather(last, 1, (label_pos - 1)[..., None].expand(-1, -1, last.shape[-1]))
        target_logp = torch.log_softmax(model.lm_head(rows).float(), dim=-1)
        labels = torch.gather(ids, 1, label_pos)
    hidden = mask_chain_forward(model, adapter, real_kv, hang, block)
    logp = torch.log_softmax(model.lm_head(hidden).float(), dim=-1)  # [B, A*block, V]
    hard = -torch.gather(logp, -1, labels[..., None])[..., 0]
    soft = -(target_logp.exp() * logp).sum(-1)
    weights = torch.exp(-(j - 1) / gamma).repeat(hang.shape[1])  # [A*block]
    per_row = (1 - soft_weight) * hard + soft_weight * soft
    loss = (per_row * weights).sum(-1).mean() / weights.sum()
    with torch.no_grad():
        hit = (logp.argmax(-1) == target_logp.argmax(-1)).float().view(*hang.shape, block)
        stats = {"hard": float(hard.mean()), "soft": float(soft.mean()),
                 "top1_by_depth": [round(float(x), 4) for x in hit.mean((0, 1))]}
    return loss, stats


def evaluate(model, adapter: SelfDraftAdapter, heldout: list[tuple[list[int], int]], cfg: SelfTrainConfig,
             seed: int = 1234) -> dict:
    """Held-out top-1 per depth (fixed chains, so steps compare)."""
    rng = random.Random(seed)
    hits, n = None, 0
    for i in range(0, len(heldout), cfg.batch_seqs):
        ids, hang = make_batch(heldout[i : i + cfg.batch_seqs], cfg.chains_per_seq, cfg.block, rng)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=cfg.bf16):
            _, stats = chain_loss(model, adapter, ids, hang, cfg.block, cfg.soft_weight, cfg.gamma)
        top1 = torch.tensor(stats["top1_by_depth"]) * len(ids)
        hits = top1 if hits is None else hits + top1
        n += len(ids)
    return {"top1_by_depth": [round(float(x), 4) for x in hits / max(1, n)]}


def train_self_draft(cfg: SelfTrainConfig, model=None, sequences: list[Sequence] | None = None) -> Path:
    """Train (or resume) the adapter; returns the adapter dir. ``model``/``sequences``: a
    loaded target and data instead of ``cfg.target`` / the corpus (tests)."""
    from presto_sd.models.loading import load_target

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if model is None:
        model, _ = load_target(cfg.target or None, torch.device("cpu"), torch.float32)
    model.requires_grad_(False)
    if sequences is None:
        sequences = corpus_sequences(cfg.corpus, cfg.first_shard, cfg.max_shards)
    windows = [w for w in (window(s, cfg.max_len, cfg.block) for s in sequences) if w is not None]
    if len(windows) <= cfg.heldout_seqs:
        raise FlagError(f"{len(windows)} usable sequences: need more than --heldout-seqs {cfg.heldout_seqs}")
    rng.shuffle(windows)
    heldout, train = windows[: cfg.heldout_seqs], windows[cfg.heldout_seqs :]
    name = cfg.target or "SmolLM2-135M-Instruct"
    adapter = SelfDraftAdapter.for_model(model, cfg.block, cfg.rank, cfg.alpha, name)
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=0.0)
    ckpt, log_path = out / "train_state.pt", out / "train_log.jsonl"
    step, wall = 0, 0.0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        adapter.load_state_dict(state["adapter"])
        opt.load_state_dict(state["opt"])
        step, wall = state["step"], state["wall_s"]
        rng.setstate(state["rng"])
    # a resumed run: the schedule where it stopped (the optimizer's state holds initial_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg.warmup, cfg.steps),
                                              last_epoch=step - 1)
    t_start = time.perf_counter()
    with log_path.open("a") as log:
        while step < cfg.steps:
            batch = [train[rng.randrange(len(train))] for _ in range(cfg.batch_seqs)]
            ids, hang = make_batch(batch, cfg.chains_per_seq, cfg.block, rng)
            with torch.autocast("cpu", torch.bfloat16, enabled=cfg.bf16):
                loss, stats = chain_loss(model, adapter, ids, hang, cfg.block, cfg.soft_weight, cfg.gamma)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(adapter.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            if step % cfg.log_every == 0 or step == cfg.steps:
                elapsed = wall + time.perf_counter() - t_start
                log.write(json.dumps({"step": step, "loss": round(loss.item(), 4), **stats,
                                      "lr": sched.get_last_lr()[0], "wall_s": round(elapsed, 1)}) + "\n")
                log.flush()
                print(f"self-draft step {step}/{cfg.steps} loss {loss.item():.3f} "
                      f"top1 {stats['top1_by_depth'][:3]} {elapsed:.0f}s", flush=True)
            if step % cfg.ckpt_every == 0 or step == cfg.steps:
                torch.save({"adapter": adapter.state_dict(), "opt": opt.state_dict(), "step": step,
                            "wall_s": wall + time.perf_counter() - t_start, "rng": rng.getstate()}, ckpt)
    wall += time.perf_counter() - t_start
    adapter.save(out / "adapter")
    report = {"config": asdict(cfg), "steps": step, "wall_s": round(wall, 1), "train_sequences": len(train),
              "train_tokens": sum(len(ids) for ids, _ in train),
              "heldout": evaluate(model, adapter, heldout, cfg)}
    (out / "adapter" / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_digests(out / "adapter")  # what ships is guarded (SelfDraftAdapter.load checks them)
    return out / "adapter"


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
