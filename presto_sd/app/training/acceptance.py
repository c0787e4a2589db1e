"""Acceptance predictors: verification traces, ``h_phi``, the n-gram table, ``lambda_d``.

Traces: wide ``marginal`` trees verified with per-node target probabilities. Every node
whose parent was accepted is a sample (it had its chance); label = it was accepted.
From them: ``h_phi`` (BCE), ``lambda_d`` per depth (held-out conditional likelihood of
the accepted child among its siblings under ``log q + lambda log rho``), and a
calibration report of ``h_phi``, the n-gram rho and the raw marginal ``q``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from presto_sd.app.errors import FlagError
from presto_sd.app.training.choose_lambda import PROPOSING_RHOS
from presto_sd.app.training.export import HEAD_RHOS
from presto_sd.method.builders import MAX_CANDIDATES, TreeParams
from presto_sd.method.ngram import NGramModel
from presto_sd.method.scores import RHO_FLOOR, HPhi, NGramRho, ScoringContext, hphi_features
from presto_sd.models.assets import write_digests

LAMBDA_GRID = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


@dataclass(frozen=True)
class AcceptanceConfig:
    drafter: str  # drafter dir; the outputs land beside its checkpoint
    data: str  # gen-data shards (for the n-gram table): a dir, or several comma-separated
    target: str | None = None
    n_prompts: int = 120
    heldout_fraction: float = 0.25
    max_new_tokens: int = 64
    budget: int = 48
    depth: int = 7
    ngram_order: int = 3
    ngram_min_count: int = 2
    epochs: int = 30
    seed: int = 0
    keep_traces: bool = False  # also write traces.pt (tens of MB) beside the predictors
    # trace prompts from the repo corpus's shards from this index on (the ones the drafter
    # did not train on); "" = gen-data's plan tail, else ShareGPT's train tail
    corpus: str = field(default="", metadata={
        "help": "a repo corpus dir to take held-out trace prompts from"})
    corpus_from_shard: int = field(default=0, metadata={
        "help": "with --corpus: its shards from this index on (those past the drafter's training prefix)"})


@dataclass
class Traces:
    """One row per sample; ``group`` ties siblings (same parent, same round)."""

    hidden: torch.Tensor  # [N, H]
    parent: torch.Tensor  # [N] parent token
    token: torch.Tensor  # [N]
    log_q: torch.Tensor  # [N]
    entropy: torch.Tensor  # [N]
    depth: torch.Tensor  # [N]
    log_rho_ngram: torch.Tensor  # [N]
    log_rho_prefix: torch.Tensor  # [N] the drafter's prefix head (0 when it has none)
    p_target: torch.Tensor  # [N]
    label: torch.Tensor  # [N] 1 = accepted
    group: torch.Tensor  # [N]
    prompt: torch.Tensor  # [N] which prompt (for the held-out split)

    def select(self, mask: torch.Tensor) -> Traces:
        return Traces(**{k: v[mask] for k, v in self.__dict__.items()})

    def __len__(self) -> int:
        return len(self.label)


def build_ngram_table(data_dir: str | Path, order: int, vocab_size: int) -> NGramModel:
    """An n-gram LM of the target's own generated responses (gen-data shards): one dir, or
    several comma-separated (a link's window and its ``--mix`` windows)."""
    from presto_sd.app.training.gen_data import load_shards

    seqs = [s for d in str(data_dir).split(",") if d for s in load_shards(d)]
    if not seqs:  # an empty table would score every tree by its marginals alone, silently
        raise FlagError(f"the n-gram table's data {data_dir}: no shards there")
    table = NGramModel(order=order, vocab_size=vocab_size)
    for s in seqs:
        toks = s.tokens.tolist()
        table.update(toks[s.prompt_len :], history=toks[: s.prompt_len])
    return table


@torch.inference_mode()
def collect_traces(stack, prompts: list[list[int]], cfg: AcceptanceConfig, table: NGramModel) -> Traces:
    verifier, drafter = stack.verifier, stack.drafter
    rho = NGramRho(table)
    prefix_rho = drafter.rho_providers.get("prefix")
    params = TreeParams(budget=cfg.budget, depth=cfg.depth,
                        top_k=min(MAX_CANDIDATES, max(10, cfg.budget)))
    rows: dict[str, list] = {k: [] for k in Traces.__dataclass_fields__}
    group = 0
    for pi, prompt in enumerate(tqdm(prompts, desc="traces", mininterval=10)):
        sid = uuid.uuid4().hex
        pre = verifier.prefill(sid, prompt)
        drafter.prefill(sid, pre.delta)
        anchor, base, produced = pre.anchor, pre.base, 1
        while produced < cfg.max_new_tokens and anchor not in verifier.eos_token_ids:
            d = drafter.draft(sid, anchor, base, "marginal", params)
            v = verifier.verify(sid, base, d.tree, want_node_probs=True)
            tree, m = d.tree, d.marginals
            session = drafter.sessions[sid]
            ctx = ScoringContext(m, session.tokens + [anchor], session.ngram)
            accepted = set(v.accepted_nodes)
            for parent in v.accepted_nodes:
                kids = list(tree.children(parent))
                if not kids:
                    continue
                depth = tree.depths[kids[0]]
                toks = torch.tensor([tree.tokens[c] for c in kids])
                idx = (m.token_ids[depth - 1][None, :] == toks[:, None]).float().argmax(-1)
                logq = m.log_probs[depth - 1][idx]
                prefix = tree.path_tokens(parent)[1:]
                lr = rho.log_rho(ctx, depth, [prefix], toks[None], logq[None])[0]
                lp = (prefix_rho.log_rho(ctx, depth, [prefix], toks[None], logq[None])[0]
                      if prefix_rho is not None else torch.zeros(len(kids)))
                for j, c in enumerate(kids):
                    rows["hidden"].append(m.hidden[depth - 1])
                    rows["parent"].append(tree.tokens[parent])
                    rows["token"].append(tree.tokens[c])
                    rows["log_q"].append(float(logq[j]))
                    rows["entropy"].append(float(m.entropy[depth - 1]))
                    rows["depth"].append(depth)
                    rows["log_rho_ngram"].append(float(lr[j]))
                    rows["log_rho_prefix"].append(float(lp[j]))
                    rows["p_target"].append(float(v.node_probs[c]))
                    rows["label"].append(float(c in accepted))
                    rows["group"].append(group)
                    rows["prompt"].append(pi)
                group += 1
            drafter.commit(sid, v.delta)
            anchor, base, produced = v.bonus, v.base, produced + len(v.new_tokens)
        verifier.close(sid)
        drafter.close(sid)
    stacked = {k: torch.stack(v) if k == "hidden" else torch.tensor(v) for k, v in rows.items()}
    return Traces(**stacked)


def features_of(t: Traces, embed: torch.Tensor) -> torch.Tensor:
    return hphi_features(t.hidden.float(), embed[t.parent].float(), embed[t.token].float(),
                         t.log_q.float(), t.entropy.float(), t.depth, t.log_rho_ngram.float())


def train_hphi(train: Traces, embed: torch.Tensor, epochs: int, seed: int) -> HPhi:
    """BCE on training traces; the epoch with the best validation BCE is kept.

    Validation = the last 15 % of the training prompts: a few thousand samples of a
    ~2k-dimensional input over-fit within a few epochs otherwise.
    """
    torch.manual_seed(seed)
    cut = int(train.prompt.max()) * 0.85
    fit, val = train.select(train.prompt <= cut), train.select(train.prompt > cut)
    x, y = features_of(fit, embed), fit.label.float()
    xv, yv = features_of(val, embed), val.label.float()
    # the n-gram's log rho is a feature: h_phi then ranks with what the prefix says (as
    # PRESTO's n-gram term does) and stays calibrated (what TAPS sums)
    model = HPhi(hidden_size=train.hidden.shape[1], embed_size=embed.shape[1], n_scalars=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    best, best_state = float("inf"), None
    for _ in tqdm(range(epochs), desc="h_phi", mininterval=10):
        model.train()
        for idx in torch.randperm(len(y)).split(512):
            loss = F.binary_cross_entropy_with_logits(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            val_loss = float(F.binary_cross_entropy_with_logits(model(xv), yv)) if len(yv) else 0.0
        if val_loss < best:
            best, best_state = val_loss, {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    return model.eval()


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half)."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).float().mean()
    ties = (pos[:, None] == neg[None, :]).float().mean()
    return float(greater + 0.5 * ties)


def calibration(probs: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> dict:
    edges = torch.linspace(0, 1, bins + 1)
    which = torch.bucketize(probs.clamp(0, 1), edges[1:-1])
    curve = []
    for b in range(bins):
        sel = which == b
        if sel.any():
            curve.append((float(probs[sel].mean()), float(labels[sel].mean()), int(sel.sum())))
    return {
        "auc": round(auc(probs, labels), 4),
        "brier": round(float(((probs - labels) ** 2).mean()), 4),
        "curve": curve,
    }


def fit_lambdas(t: Traces, log_rho: torch.Tensor, max_depth: int) -> tuple[list[float], float]:
    """Per depth, the lambda whose scores best single out the accepted sibling (held-out).

    Returns the lambdas and the mean held-out log-likelihood gain over ``lambda = 0``
    (what the provider adds to ``q`` for ranking: the quantity PRESTO's trees use).
    """
    lambdas, gain = [], 0.0
    for d in range(1, max_depth + 1):
        sel = t.depth == d
        best, best_ll, base_ll = 0.0, -math.inf, None
        for lam in LAMBDA_GRID:
            ll = _sibling_log_likelihood(t.log_q[sel] + lam * log_rho[sel], t.label[sel], t.group[sel])
            base_ll = ll if base_ll is None else base_ll  # the grid starts at 0
            if ll > best_ll + 1e-9:
                best, best_ll = lam, ll
        lambdas.append(best)
        gain += (best_ll - base_ll) / max_depth
    return lambdas, gain


def _sibling_log_likelihood(score: torch.Tensor, label: torch.Tensor, group: torch.Tensor) -> float:
    """Mean log softmax (within each sibling group) of the accepted child's score."""
    total, n = 0.0, 0
    for g in group.unique():
        sel = group == g
        if label[sel].sum() == 1:
            total += float(torch.log_softmax(score[sel], 0)[label[sel] == 1])
            n += 1
    return total / max(1, n)


def trace_prompts(cfg: AcceptanceConfig, tok) -> list[list[int]]:
    """Prompts the drafter never trained on: the tail of gen-data's plan (items past its
    last shard) when the data has a plan, else the tail of ShareGPT's train split."""
    from presto_sd.app.datasets import load_prompts
    from presto_sd.models.loading import encode_messages

    if cfg.corpus:
        return corpus_prompts(cfg.corpus, cfg.corpus_from_shard, cfg.n_prompts)
    plan = Path(cfg.data) / "plan.json"
    if plan.exists():
        batches = json.loads(plan.read_text())["batches"]
        done = len(list(Path(cfg.data).glob("shard_*.safetensors")))
        tail = [ids for b in batches[done:] for _, ids in b]
        if len(tail) >= cfg.n_prompts:
            step = len(tail) // cfg.n_prompts  # spread over the tail: every source, every length
            return tail[::step][: cfg.n_prompts]
    prompts = load_prompts("sharegpt", "train")[-cfg.n_prompts :]
    encoded = [encode_messages(tok, p.messages) for p in prompts]
    return [e for e in encoded if len(e) <= 256]


def corpus_prompts(corpus: str | Path, from_shard: int, n: int) -> list[list[int]]:
    """``n`` prompts spread over the repo corpus's shards from ``from_shard`` on (each a
    plan batch: every source, every length)."""
    from presto_sd.app.training.token_corpus import Corpus

    c = Corpus(corpus)
    shards = [i for i in c.indices() if i >= from_shard]
    if not shards:
        raise FlagError(f"corpus {corpus} has no shard from index {from_shard} on")
    prompts = [list(p) for i in shards for p in c.read(i).prompts]
    if len(prompts) < n:
        raise FlagError(f"corpus {corpus}: {len(prompts)} prompts from shard {from_shard} on, {n} asked")
    step = len(prompts) // n
    return prompts[::step][:n]


def _table_digest(path: Path) -> str | None:
    """The n-gram table's content (gzip's header holds a time: its bytes differ every save)."""
    return hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest() if path.is_file() else None


def train_acceptance(cfg: AcceptanceConfig) -> dict:
    from presto_sd.embedded.stack import build_embedded

    out = Path(cfg.drafter)
    stack = build_embedded(cfg.target, cfg.drafter, device=torch.device("cpu"))
    vocab = stack.verifier.vocab_size
    table = build_ngram_table(cfg.data, cfg.ngram_order, vocab)
    table_before = _table_digest(out / "ngram.json.gz")
    table.save(out / "ngram.json.gz", min_count=cfg.ngram_min_count)
    table_changed = table_before is not None and table_before != _table_digest(out / "ngram.json.gz")
    table = NGramModel.load(out / "ngram.json.gz")  # score with exactly what ships
    encoded = trace_prompts(cfg, stack.tokenizer)
    traces = collect_traces(stack, encoded, cfg, table)
    if cfg.keep_traces:
        torch.save(traces.__dict__, out / "traces.pt")
    n_held = int(len(encoded) * cfg.heldout_fraction)
    held_mask = traces.prompt < n_held
    train, held = traces.select(~held_mask), traces.select(held_mask)
    embed = stack.verifier.model.get_input_embeddings().weight.detach()
    hphi = train_hphi(train, embed, cfg.epochs, cfg.seed)
    hphi.save(out / "h_phi")
    with torch.no_grad():
        p_hphi = torch.sigmoid(hphi(features_of(held, embed)))
    log_rho_h = p_hphi.clamp_min(RHO_FLOOR).log()  # as LearnedRho scores at run time
    fits = {
        "hphi": fit_lambdas(held, log_rho_h, cfg.depth),
        "ngram": fit_lambdas(held, held.log_rho_ngram, cfg.depth),
    }
    has_prefix = "prefix" in stack.drafter.rho_providers
    if has_prefix:
        fits["prefix"] = fit_lambdas(held, held.log_rho_prefix, cfg.depth)
    lambdas = {k: v[0] for k, v in fits.items()}
    ranking_gain = {k: round(v[1], 4) for k, v in fits.items()}
    report = {
        "samples": {"train": len(train), "heldout": len(held)},
        "acceptance_rate": round(float(traces.label.mean()), 4),
        "hphi": calibration(p_hphi, held.label),
        "ngram": calibration(held.log_rho_ngram.exp(), held.label),
        "marginal_q": calibration(held.log_q.exp(), held.label),
        **({"prefix": calibration(held.log_rho_prefix.exp(), held.label)} if has_prefix else {}),
        "lambdas": lambdas,
        "sibling_loglik_gain": ranking_gain,
        "config": asdict(cfg),
    }
    # the default provider: the one that adds most to q's ranking of siblings (held-out)
    best = max(fits, key=lambda k: ranking_gain[k])
    # a proposing rho's lambda was chosen by the replay (`train choose-lambda`), not fitted here: kept
    before = json.loads((out / "presto.json").read_text()) if (out / "presto.json").is_file() else {}
    kept = {k: v for k, v in before.get("lambdas_by_rho", {}).items()
            if k in PROPOSING_RHOS and (has_prefix or k not in HEAD_RHOS)}
    if kept and table_changed:  # chosen by replays that read the old table: stale now
        print(f"train acceptance: the n-gram table changed, so the lambdas of {', '.join(sorted(kept))} "
              "(chosen by the replay with the old one) are dropped; choose them again: "
              "presto-sd train choose-lambda --rho RHO")
        kept = {}
    # a proposing default was chosen by the replay, which a refit cannot judge: it stays
    default = before["rho"] if before.get("rho") in kept else best
    by_rho = {**lambdas, **kept}
    (out / "presto.json").write_text(json.dumps({"rho": default, "lambdas": by_rho[default],
                                                 "lambdas_by_rho": by_rho}, indent=2))
    (out / "acceptance_report.json").write_text(json.dumps(report, indent=2))
    plot_reliability(report, out / "reliability.png")
    write_digests(out)  # the dir is what ships: its digests are written with its last file
    return report


def plot_reliability(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "k:", label="perfect")
    for name, label in (("hphi", "h_phi"), ("ngram", "n-gram rho"), ("prefix", "prefix head q(t|parent)"),
                        ("marginal_q", "marginal q")):
        if name not in report:
            continue
        r = report[name]
        xs, ys = [c[0] for c in r["curve"]], [c[1] for c in r["curve"]]
        ax.plot(xs, ys, "o-", label=f"{label} (AUC {r['auc']:.3f}, Brier {r['brier']:.3f})")
    ax.set_xlabel("predicted acceptance")
    ax.set_ylabel("observed acceptance (held-out)")
    ax.set_title("Acceptance predictors: reliability")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
