"""Bench plots (matplotlib, Agg, PNG): the budget sweep, the verifier's cost per tree size,
and the acceptance-length histogram."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from presto_sd.app.bench.stats import RunLog  # noqa: E402


def _pooled(rows: list[dict]) -> list[dict]:
    """The rows over all datasets: the ``all`` rows when there are several, else all rows."""
    pooled = [r for r in rows if r["dataset"] == "all"]
    return pooled or rows


def budget_sweep(rows: list[dict], path: Path) -> Path:
    """tau and tokens/s against budget, a line per budgeted method; unbudgeted methods
    (ar, linear, the peer) as horizontal lines."""
    rows = _pooled(rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "tau", "tau (tokens / round)"), (axes[1], "tokens_per_s", "tokens / s")):
        methods = list(dict.fromkeys(r["method"] for r in rows))
        for i, m in enumerate(methods):
            mr = sorted((r for r in rows if r["method"] == m and r[key] is not None),
                        key=lambda r: r["budget"] or 0)
            if not mr:
                continue
            color = f"C{i}"
            if mr[0]["budget"] is None:
                ax.axhline(mr[0][key], color=color, ls="--", lw=1.2, label=m)
            else:
                ax.plot([r["budget"] for r in mr], [r[key] for r in mr], "o-", color=color, label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (draft nodes per round)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("budget sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def verify_cost(runs: Sequence[RunLog], path: Path) -> Path:
    """Every round's verify seconds against the nodes it verified, and the mean per size."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    methods = list(dict.fromkeys(r.method for r in runs))
    by_size: dict[int, list[float]] = {}
    for i, m in enumerate(methods):
        pts = [(x.tree_size, x.verify_s * 1e3) for r in runs if r.method == m for x in r.rounds]
        if not pts:
            continue
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, alpha=0.3, color=f"C{i}", label=m)
        for size, ms in pts:
            by_size.setdefault(size, []).append(ms)
    if by_size:
        sizes = sorted(by_size)
        ax.plot(sizes, [sum(by_size[s]) / len(by_size[s]) for s in sizes], "k-", lw=1.5, label="mean")
        # a few stalls (another process, a page fault) must not flatten the curve: clip them
        all_ms = sorted(ms for v in by_size.values() for ms in v)
        high = all_ms[min(len(all_ms) - 1, int(0.99 * len(all_ms)))]
        if all_ms[-1] > 2 * high:
            ax.set_ylim(0, 1.3 * high)
            n_out = sum(ms > 1.3 * high for ms in all_ms)
            ax.set_title(f"the verifier's measured cost ({n_out} outliers above the plot)", fontsize=10)
    ax.set_xlabel("tree size (draft nodes verified; 0 = one AR step)")
    ax.set_ylabel("verify time (ms)")
    if not ax.get_title():
        ax.set_title("the verifier's measured cost")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, markerscale=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def acceptance_histogram(runs: Sequence[RunLog], path: Path) -> Path:
    """Tokens committed per round (accepted + 1), a panel per speculative method, a line per budget."""
    methods = [m for m in dict.fromkeys(r.method for r in runs) if m != "ar"]
    n = max(1, len(methods))
    cols = min(3, n)
    rows_ = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows_, cols, figsize=(4.2 * cols, 3.3 * rows_), squeeze=False)
    top = max((x.accepted + 1 for r in runs for x in r.rounds), default=1)
    bins = [b + 0.5 for b in range(0, top + 1)]
    for ax, m in zip(axes.flat, methods):
        budgets = list(dict.fromkeys(r.budget for r in runs if r.method == m))
        for j, b in enumerate(budgets):
            lens = [x.accepted + 1 for r in runs if r.method == m and r.budget == b for x in r.rounds]
            if lens:
                ax.hist(lens, bins=bins, density=True, histtype="step", lw=1.4, color=f"C{j}",
                        label="unbudgeted" if b is None else f"B={b}")
        ax.set_title(m, fontsize=10)
        ax.set_xlabel("tokens per round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(methods):]:
        ax.axis("off")
    axes[0][0].set_ylabel("share of rounds")
    fig.suptitle("acceptance length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def chosen_budgets(runs: Sequence[RunLog], path: Path) -> Path:
    """TAPS: the tree size it chose round by round, a line per dataset."""
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    taps = [r for r in runs if r.method == "taps"]
    top = max((x.tree_size for r in taps for x in r.rounds), default=1)
    bins = [b - 0.5 for b in range(0, top + 2)]
    for j, ds in enumerate(dict.fromkeys(r.dataset for r in taps)):
        rounds = [x for r in taps if r.dataset == ds for x in r.rounds if not getattr(x, "fallback", False)]
        sizes = [x.tree_size for x in rounds if not getattr(x, "gated", False)]  # where TAPS chose
        skipped = 1 - len(sizes) / max(1, len(rounds))
        ax.hist(sizes, bins=bins, density=True, histtype="step", lw=1.4, color=f"C{j}",
                label=f"{ds} ({skipped:.0%} of rounds gated)")
    ax.set_xlabel("draft nodes chosen (B*)")
    ax.set_ylabel("share of drafted rounds")
    ax.set_title("taps: chosen budget per drafted round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(out: Path, rows: list[dict], runs: Sequence[RunLog]) -> list[Path]:
    plots = [
        budget_sweep(rows, out / "budget_sweep.png"),
        verify_cost(runs, out / "verify_cost.png"),
        acceptance_histogram(runs, out / "acceptance_hist.png"),
    ]
    if any(r.method == "taps" for r in runs):
        plots.append(chosen_budgets(runs, out / "taps_budgets.png"))
    return plots
