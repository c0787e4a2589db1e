"""Drafter training, DFlash recipe (docs/design.md §2), sized for a 2-core CPU.

Per sequence, random anchors in the response; a block ``[anchor, MASK x (L-1)]`` sees
only target features *before* its anchor (what the drafter has at inference) and its own
block; the loss is CE on block slots weighted ``w_k = exp(-(k-1)/gamma)``.

CPU choices (documented in docs/training.md):
- a reduced draft vocabulary: the most frequent target-generated tokens, with a token
  map ``d2t`` to target ids; the draft lm_head is the target's rows ``lm_head[d2t]``.
  The lm_head dominates the drafter's cost, so this cuts training and drafting time;
  a token outside the map can never be drafted (it costs acceptance, never correctness).
- layers initialised from the target's last layers (same width), ``fc`` from the deepest
  feature layer: a warm start that converges in the steps a CPU affords.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from presto_sd.app.errors import FlagError
from presto_sd.app.training.gen_data import Sequence, load_shards
from presto_sd.models.dflash import DFlashConfig, DFlashDraftModel
from presto_sd.models.loading import load_target, random_drafter_config

HARD_LABELS = ("tokens", "target")


@dataclass(frozen=True)
class TrainConfig:
    data: str
    out: str
    target: str | None = None
    num_layers: int = 2
    block_size: int = 8
    draft_vocab: int = 8192  # 0 = the target's full vocabulary
    mask_token_id: int = 16  # SmolLM2's "<empty_output>": never produced in chat
    gamma: float = 4.0
    anchors_per_seq: int = 16
    batch_seqs: int = 8
    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ckpt_every: int = 50
    log_every: int = 10
    heldout_seqs: int = 64
    seed: int = 0
    init_from_target: bool = True
    prefix_rank: int = 0  # rank of the prefix-conditioned head (0 = none; DFlash as published)
    prefix_weight: float = 1.0  # weight of the conditional CE beside the marginal one
    device: str = "cpu"  # "cuda" on a GPU (scripts/gpu_drafter.sh)
    # start from a trained drafter dir (its weights and token map) instead of the target;
    # with prefix_only, train just a new prefix head on top of it, the drafter frozen
    init_drafter: str = ""
    prefix_only: bool = False
    # with init_drafter: a new token map of the draft_vocab most frequent training tokens
    # instead of the drafter's own (its weights do not depend on the map: the head is the
    # target's rows); refused for a drafter with a prefix head, whose rows are the map's
    revocab: bool = False
    # with init_drafter: append this many decoder layers whose output projections (o_proj,
    # down_proj) start at zero, so the grown drafter starts as its parent's exact function
    # (the final norm follows the residual stream) and learns what the extra depth adds
    grow_layers: int = field(default=0, metadata={"help": "append N zero-init layers to --init-drafter"})
    # weight of the soft-label CE against the target's top-k distribution (restricted to the
    # draft vocabulary, renormalised) beside the hard CE: loss = (1 - w) hard + w soft.
    # Needs shards with soft labels (``train features``); 0 = hard labels only (DFlash).
    soft_weight: float = 0.0
    # run the forward's matmuls in bf16 (torch autocast; weights and optimizer stay fp32):
    # ~2x a step where the CPU has AVX512-BF16/AMX (or on a GPU), slower elsewhere
    bf16: bool = False
    # the hard CE's labels: "tokens", the sequence's own next tokens (the target's greedy
    # answer in the regenerated corpus), or "target", the target's top-1 at every position
    # (its soft labels' first id): for answers someone else wrote (``written.py``), what the
    # target would have written after the same text
    hard_labels: str = field(default="tokens", metadata={"help": "tokens | target"})


def sequence_key(s: Sequence) -> str:
    """A stable identity for a training sequence (its tokens), to keep held-out sets fixed."""
    import hashlib

    return hashlib.sha256(s.tokens.numpy().tobytes()).hexdigest()[:16]


def target_labels(s: Sequence, start: int, stop: int) -> torch.Tensor:
    """The target's top-1 after each of positions ``start..stop-1``: the hard labels of the
    tokens ``start+1..stop`` under ``--hard-labels target`` (soft-label row t predicts t + 1)."""
    return s.soft_labels[0][start:stop, 0].long()


def build_draft_vocab(seqs: list[Sequence], size: int, vocab_size: int, always: list[int],
                      hard_labels: str = "tokens") -> torch.Tensor:
    """``d2t``: the ``size`` most frequent response labels (plus ``always``), sorted.

    The labels are what the hard CE will ask for: the response tokens, or with
    ``hard_labels="target"`` the target's top-1 after each response position (on written
    answers those differ at ~40 % of positions, and a map of the written tokens left 1.4 %
    of the target's labels outside it: certain rejections).
    """
    counts: Counter[int] = Counter()
    for s in seqs:
        if hard_labels == "target":
            counts.update(target_labels(s, s.prompt_len - 1, len(s.tokens) - 1).tolist())
        else:
            counts.update(s.tokens[s.prompt_len :].tolist())
    top = [t for t, _ in counts.most_common(size)]
    ids = sorted(set(top[: size - len(always)]) | set(always))
    return torch.tensor(ids[:size] if len(ids) >= size else ids, dtype=torch.long)


def feature_scales(seqs: list[Sequence], max_tokens: int = 20_000) -> torch.Tensor:
    """Robust per-channel scale of the target features (median of |x|).

    The residual stream has massive-activation channels (SmolLM2: one channel ~1000x the
    median from layer 14 on); with ``fc`` unscaled, ``hidden_norm`` would leave nearly
    all of the context's energy in that channel and the drafter would start blind.
    """
    rows, n = [], 0
    for s in seqs:
        rows.append(s.features[:-1].float())  # the last row is the never-fed zero row
        n += len(rows[-1])
        if n >= max_tokens:
            break
    return torch.cat(rows).abs().median(dim=0).values.clamp_min(1e-3)


def init_from_target(draft: DFlashDraftModel, target, scales: torch.Tensor | None = None) -> None:
    """Copy the target's last decoder layers and final norm into the drafter.

    ``fc`` starts as the mean over feature layers of the identity, each input channel
    divided by its robust scale (a whitening folded into the weights: same format).
    """
    t_layers = target.get_decoder().layers
    k = len(draft.layers)
    with torch.no_grad():
        for d_layer, t_layer in zip(draft.layers, t_layers[-k:]):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(d_layer.self_attn, name).weight.copy_(getattr(t_layer.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(d_layer.mlp, name).weight.copy_(getattr(t_layer.mlp, name).weight)
            d_layer.input_layernorm.weight.copy_(t_layer.input_layernorm.weight)
            d_layer.post_attention_layernorm.weight.copy_(t_layer.post_attention_layernorm.weight)
        draft.norm.weight.copy_(target.get_decoder().norm.weight)
        h, n_layers = draft.config.hidden_size, len(draft.config.target_layer_ids)
        draft.fc.weight.normal_(0, 0.02 / math.sqrt(n_layers))
        draft.fc.weight += torch.eye(h).repeat(1, n_layers) / n_layers
        if scales is not None:
            draft.fc.weight /= scales[None, :]


def make_batch(seqs: list[Sequence], cfg: TrainConfig, t2d: torch.Tensor, rng: random.Random):
    """Blocks, positions, context features, mask and labels for a batch of sequences."""
    L, m = cfg.block_size, cfg.anchors_per_seq
    T = max(len(s.tokens) for s in seqs)
    B = len(seqs)
    feats = torch.zeros(B, T, seqs[0].features.shape[1])
    ctx_pos = torch.arange(T).expand(B, T)
    block_ids = torch.full((B, m * L), cfg.mask_token_id, dtype=torch.long)
    block_pos = torch.zeros(B, m * L, dtype=torch.long)
    labels = torch.full((B, m, L - 1), -100, dtype=torch.long)  # draft-vocab ids
    target_ids = torch.full((B, m, L - 1), -1, dtype=torch.long)  # target ids (accuracy)
    parents = torch.full((B, m, L - 1), -1, dtype=torch.long)  # draft id of each slot's parent token
    mask = torch.zeros(B, 1, m * L, T + m * L, dtype=torch.bool)
    need_soft = cfg.soft_weight > 0 or cfg.hard_labels == "target"
    soft = [s.soft_labels for s in seqs] if need_soft else [None] * B
    if need_soft and any(x is None for x in soft):
        raise FlagError("soft_weight > 0 and --hard-labels target need shards with soft labels: "
                        "make them with `train features`")
    k_soft = soft[0][0].shape[1] if soft[0] is not None else 1
    soft_ids = torch.full((B, m, L - 1, k_soft), -100, dtype=torch.long)  # draft ids, -100 outside
    soft_lp = torch.full((B, m, L - 1, k_soft), -torch.inf)
    for b, s in enumerate(seqs):
        labels_b = soft[b]
        n = len(s.tokens)
        feats[b, :n] = s.features.float()
        lo, hi = max(1, s.prompt_len - 1), n - 2  # anchors in the response (>= 1 context token)
        anchors = [rng.randint(lo, hi) for _ in range(m)] if hi >= lo else [n - 2] * m
        for j, a in enumerate(anchors):
            q = slice(j * L, (j + 1) * L)
            block_ids[b, j * L] = s.tokens[a]
            block_pos[b, q] = torch.arange(a, a + L)
            mask[b, 0, q, :a] = True  # context strictly before the anchor
            mask[b, 0, q, T + j * L : T + (j + 1) * L] = True  # its own block, both ways
            tgt = s.tokens[a + 1 : a + L]
            if cfg.hard_labels == "target":
                tgt = target_labels(s, a, a + len(tgt))
            target_ids[b, j, : len(tgt)] = tgt
            labels[b, j, : len(tgt)] = t2d[tgt]
            par = t2d[s.tokens[a : a + L - 1]]  # slot k's parent is the true token at k - 1
            parents[b, j, : len(par)] = torch.where(par < 0, -1, par)
            if labels_b is not None:  # slot k's label row is the target's prediction after token a + k - 1
                ids, lp = labels_b[0][a : a + len(tgt)].long(), labels_b[1][a : a + len(tgt)].float()
                soft_ids[b, j, : len(tgt)] = t2d[ids]
                soft_lp[b, j, : len(tgt)] = torch.where(t2d[ids] >= 0, lp, -torch.inf)
    return feats, ctx_pos, block_ids, block_pos, mask, labels, target_ids, parents, soft_ids, soft_lp


def block_loss(model, head, embed, batch, cfg: TrainConfig):
    """Position-weighted CE over block slots, plus the prefix head's conditional CE (its
    parents teacher-forced: in a tree, a node's children are scored given its own token);
    predictions of both for per-position top-1 accuracy (target ids)."""
    feats, ctx_pos, block_ids, block_pos, mask, labels, target_ids, parents, soft_ids, soft_lp = batch
    B, mL = block_ids.shape
    L = cfg.block_size
    ctx_kv = model.context_kv(feats, ctx_pos)
    hidden = model(embed[block_ids], block_pos, ctx_kv, mask)
    # predictions for slots 1..L-1; contiguous, or the matmul takes a strided batched path
    # that is ~6x slower on a CPU in fp32
    hidden = hidden.view(B, mL // L, L, -1)[:, :, 1:].contiguous()
    logits = F.linear(hidden, head)  # [B, m, L-1, Vd]
    weights = torch.exp(-torch.arange(L - 1, dtype=torch.float32) / cfg.gamma)
    valid = (labels >= 0).float()

    def weighted_ce(lg: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(lg.flatten(0, 2), labels.flatten(), ignore_index=-100, reduction="none")
        return (ce.view_as(labels) * valid * weights).sum() / (valid * weights).sum().clamp_min(1)

    loss = weighted_ce(logits)
    parts = {"hard_ce": loss.detach()}
    if cfg.soft_weight > 0:
        parts["soft_kl"] = soft_kl(logits, soft_ids, soft_lp, weights)
        loss = (1 - cfg.soft_weight) * loss + cfg.soft_weight * parts["soft_kl"]
    pred, pred_cond = logits.argmax(-1), None
    if model.prefix_head is not None:
        cond = logits + model.prefix_head(hidden, parents)
        loss = loss + cfg.prefix_weight * weighted_ce(cond)
        pred_cond = cond.argmax(-1)
    return loss, pred, target_ids, pred_cond, parts


def soft_kl(logits: torch.Tensor, soft_ids: torch.Tensor, soft_lp: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
    """KL from the target's top-k distribution to the drafter's, within the draft vocabulary.

    The CE's gradient, with its floor at 0 instead of the target's entropy, so the logged
    value says how far the drafter is from the target. The target's mass outside the
    draft vocabulary can never be drafted, so it is dropped and the rest renormalised; a
    slot with none of its top-k in the vocabulary (or no label) carries no soft loss.
    Position weights as for the hard CE.
    """
    has = soft_ids >= 0
    p = torch.softmax(soft_lp, dim=-1).nan_to_num(0.0)  # all -inf rows: NaN -> 0
    logp = torch.where(p > 0, p.clamp_min(1e-30).log(), 0.0)
    logq = torch.log_softmax(logits, dim=-1).gather(-1, soft_ids.clamp_min(0))
    per_slot = (p * (logp - logq) * has).sum(-1)  # [B, m, L-1]
    slot_w = has.any(-1).float() * weights
    return (per_slot * slot_w).sum() / slot_w.sum().clamp_min(1)


class DraftVocab:
    def __init__(self, d2t: torch.Tensor, vocab_size: int) -> None:
        self.d2t = d2t
        self.t2d = torch.full((vocab_size,), -100, dtype=torch.long)
        self.t2d[d2t] = torch.arange(len(d2t))


def read_data(data: str) -> tuple[dict, list[Sequence]]:
    """``data``: one ``train features`` dir or several, comma-separated (e.g. the regenerated
    corpus's and the written answers'): the first one's meta.json and every dir's sequences.
    Dirs whose features come from other target layers cannot be mixed."""
    dirs = [Path(d) for d in data.split(",") if d]
    if not dirs:
        raise FlagError("--data: no dir given")
    metas = [json.loads((d / "meta.json").read_text()) for d in dirs]
    for d, m in zip(dirs[1:], metas[1:]):
        if m["target_layer_ids"] != metas[0]["target_layer_ids"]:
            raise FlagError(f"--data: {d} has features of target layers {m['target_layer_ids']}, "
                            f"{dirs[0]} of {metas[0]['target_layer_ids']}: they cannot train one drafter")
    return metas[0], [s for d in dirs for s in load_shards(d)]


def train_drafter(cfg: TrainConfig) -> Path:
    if cfg.hard_labels not in HARD_LABELS:
        raise FlagError(f"--hard-labels {cfg.hard_labels!r}: one of {', '.join(HARD_LABELS)}")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    out = Path(cfg.out)  # made once every flag is checked: a refused run leaves nothing behind
    meta, seqs = read_data(cfg.data)
    target, _ = load_target(cfg.target or meta.get("target"), torch.device("cpu"), torch.float32)
    dev = torch.device(cfg.device)
    embed = target.get_input_embeddings().weight.detach().to(dev)
    rng.shuffle(seqs)
    ckpt = out / "train_state.pt"
    state = torch.load(ckpt, weights_only=False) if ckpt.exists() else None
    if state is not None:  # resume, possibly on more data: same held-out set, same token map
        held_keys = set(state["heldout_keys"])
        heldout = [s for s in seqs if sequence_key(s) in held_keys]
        train = [s for s in seqs if sequence_key(s) not in held_keys]
    else:
        heldout, train = seqs[: cfg.heldout_seqs], seqs[cfg.heldout_seqs :]
    vocab_size = target.config.vocab_size
    eos = [2] if vocab_size > 2 else []
    base = DFlashDraftModel.load(cfg.init_drafter) if cfg.init_drafter else None
    if cfg.grow_layers and (base is None or cfg.grow_layers < 0):
        raise FlagError("grow_layers appends layers to an --init-drafter: give it and a count >= 1")
    if base is not None:  # the blocks are the drafter's
        cfg = replace(cfg, block_size=base.config.block_size,
                      num_layers=base.config.num_hidden_layers + cfg.grow_layers)
    if cfg.prefix_only and (base is None or not cfg.prefix_rank):
        raise FlagError("prefix_only trains a new prefix head on --init-drafter: give it and --prefix-rank")
    if cfg.revocab and (base is None or base.prefix_head is not None):
        raise FlagError("revocab re-maps an --init-drafter without a prefix head")
    if state is not None:
        d2t = state["d2t"]
    elif base is not None and not cfg.revocab:
        d2t = base.d2t if base.d2t is not None else torch.arange(vocab_size)
    elif cfg.draft_vocab and cfg.draft_vocab < vocab_size:
        d2t = build_draft_vocab(train, cfg.draft_vocab, vocab_size, eos, cfg.hard_labels)
    else:
        d2t = torch.arange(vocab_size)
    vocab = DraftVocab(d2t, vocab_size)
    if base is not None:  # its architecture, plus the head asked for
        rank = cfg.prefix_rank or base.config.prefix_head_rank
        reduced = len(d2t) if len(d2t) < vocab_size else None
        model = DFlashDraftModel(replace(base.config, prefix_head_rank=rank, draft_vocab_size=reduced,
                                         num_hidden_layers=cfg.num_layers))
        # a --prefix-rank asks for a new head: the base's own (if any) is not carried over
        kept = {k: v for k, v in base.state_dict().items()
                if not (cfg.prefix_rank and k.startswith("prefix_head."))}
        model.load_state_dict(kept, strict=False)
        if state is None:
            for layer in model.layers[base.config.num_hidden_layers:]:
                nn.init.zeros_(layer.self_attn.o_proj.weight)
                nn.init.zeros_(layer.mlp.down_proj.weight)
        if tuple(meta["target_layer_ids"]) != model.config.target_layer_ids:
            raise FlagError(f"data has target layers {meta['target_layer_ids']}, the drafter reads "
                            f"{model.config.target_layer_ids}")
    else:
        dcfg = random_drafter_config(target.config, num_layers=cfg.num_layers, block_size=cfg.block_size)
        dcfg["dflash_config"].update(
            mask_token_id=cfg.mask_token_id, target_layer_ids=list(meta["target_layer_ids"])
        )
        dcfg["rope_parameters"] = dict(target.config.rope_parameters or {"rope_theta": 10000.0})
        if len(d2t) < vocab_size:
            dcfg["dflash_config"]["draft_vocab_size"] = len(d2t)
        if cfg.prefix_rank:
            dcfg["dflash_config"]["prefix_head_rank"] = cfg.prefix_rank
        model = DFlashDraftModel(DFlashConfig.from_dict(dcfg))
        if cfg.init_from_target and state is None:
            init_from_target(model, target, feature_scales(train))
    if cfg.prefix_only:
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("prefix_head."))
    head = target.get_output_embeddings().weight.detach()[d2t].to(dev)
    model = model.to(dev)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    step = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        rng.setstate(state["rng"])
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "train_log.jsonl", "a")
    bar = tqdm(total=cfg.steps, initial=step, desc="train drafter", mininterval=10)
    # wall time counts every stretch of a resumed run (its log's elapsed_s, the report's wall_s)
    t0 = time.perf_counter() - (state.get("wall_s", 0.0) if state is not None else 0.0)
    while step < cfg.steps:
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = tuple(x.to(dev) for x in make_batch(rng.sample(train, cfg.batch_seqs), cfg, vocab.t2d, rng))
        model.train()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, pred, tids, pred_cond, parts = block_loss(model, head, embed, batch, cfg)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0:
            tids = tids.cpu()
            acc = _position_accuracy(d2t[pred.clamp_min(0).cpu()], tids)
            rec = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "acc": acc,
                   **{k: round(v.item(), 4) for k, v in parts.items()},
                   "elapsed_s": round(time.perf_counter() - t0, 1)}
            if pred_cond is not None:  # top-1 given the true parent: what a tree's children see
                rec["acc_cond"] = _position_accuracy(d2t[pred_cond.clamp_min(0).cpu()], tids)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss.item():.3f}", acc1=f"{acc[0]:.2f}")
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                        "rng": rng.getstate(), "d2t": d2t, "wall_s": time.perf_counter() - t0,
                        "heldout_keys": [sequence_key(s) for s in heldout]}, ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").rename(ckpt)
            save_drafter(model, d2t, out / "drafter", cfg)
    bar.close()
    model.eval()
    with torch.no_grad():
        hb = tuple(x.to(dev) for x in make_batch(heldout, cfg, vocab.t2d, random.Random(1)))
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            hl, hp, ht, hc, _ = block_loss(model, head, embed, hb, cfg)
        hp, ht, hc = hp.cpu(), ht.cpu(), hc.cpu() if hc is not None else None
    heldout_acc = _position_accuracy(d2t[hp.clamp_min(0)], ht)
    report = {"heldout_loss": round(hl.item(), 4), "heldout_acc": heldout_acc,
              "heldout_acc_cond": _position_accuracy(d2t[hc.clamp_min(0)], ht) if hc is not None else None,
              "train_sequences": len(train), "train_tokens": sum(len(s.tokens) for s in train),
              # response labels the draft vocabulary cannot hold: masked out of the hard CE
              # (EAGLE-3's rule), a certain rejection at inference
              "oov_label_rate": round(out_of_vocab_rate(train, vocab.t2d), 4),
              "wall_s": round(time.perf_counter() - t0, 1), "config": asdict(cfg)}
    (out / "drafter" / "training_report.json").write_text(json.dumps(report, indent=2))
    return out / "drafter"


def out_of_vocab_rate(seqs: list[Sequence], t2d: torch.Tensor) -> float:
    """The share of response tokens outside the draft vocabulary."""
    resp = [s.tokens[s.prompt_len :] for s in seqs]
    n = sum(len(r) for r in resp)
    return sum(int((t2d[r] < 0).sum()) for r in resp) / max(n, 1)


def _position_accuracy(pred: torch.Tensor, target_ids: torch.Tensor) -> list[float]:
    valid = target_ids >= 0
    hits = (pred == target_ids) & valid
    return [round(float(hits[..., k].sum() / valid[..., k].sum().clamp_min(1)), 3)
            for k in range(target_ids.shape[-1])]


def save_drafter(model: DFlashDraftModel, d2t: torch.Tensor, path: Path, cfg: TrainConfig) -> None:
    reduced = len(d2t) < model.config.vocab_size
    model.config = replace(model.config, draft_vocab_size=len(d2t) if reduced else None)  # idempotent
    model.d2t = d2t if reduced else None
    model.save(path)  # DFlashDraftModel.save writes from the CPU
