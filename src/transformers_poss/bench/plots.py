"""PNG plots of the `poss bench` and `poss tune` reports (matplotlib on the non-interactive Agg backend).

`poss bench`: position-wise acceptance per method, speed-up per method and, with ``--sweep``, speed-up and mean
acceptance length against total tokens (one line per depth, one row per draft). `poss tune`: the measured cost
curve t(n) and the predicted speed-up of every candidate shape, the chosen one marked. Each is written next to the
JSON report (``<stem>.NAME.png``); without matplotlib there are no plots (a warning says so).
"""

from __future__ import annotations

from pathlib import Path

from transformers.utils import logging


logger = logging.get_logger(__name__)


def _pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_position_acceptance(report: dict, path: Path, plt) -> Path | None:
    """Acceptance rate at each draft position given the earlier positions were accepted, one line per method."""
    series = {name: m["position_acceptance"] for name, m in report["methods"].items() if m.get("position_acceptance")}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rates in series.items():  # a position reached by too few rounds has no rate (None): not drawn
        points = [(i, r) for i, r in enumerate(rates, 1) if r is not None]
        if not points:
            continue
        line, = ax.plot(*zip(*points), marker="o", label=name)
        counts = report["methods"][name].get("position_rounds") or []
        for i, rate in points:  # each rate with the rounds it rests on
            if i <= len(counts):
                ax.annotate(f"n={counts[i - 1]}", (i, rate), textcoords="offset points", xytext=(0, 6),
                            ha="center", fontsize=6, color=line.get_color())
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance rate at i (given 1..i-1 accepted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_title(report, "Position-wise acceptance"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_speedup(report: dict, path: Path, plt) -> Path:
    """Aggregate and median speed-up over the baseline, one pair of bars per method."""
    names = list(report["methods"])
    aggregate = [report["methods"][n]["speedup"]["aggregate"] or 0 for n in names]
    median = [report["methods"][n]["speedup"]["median"] or 0 for n in names]
    positions = range(len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names) + 2), 4.5))
    ax.bar([p - 0.2 for p in positions], aggregate, width=0.4, label="aggregate")
    ax.bar([p + 0.2 for p in positions], median, width=0.4, label="median per prompt")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(positions))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speed-up over baseline")
    ax.legend(fontsize=8)
    ax.set_title(_title(report, "Speed-up"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _title(report: dict, what: str) -> str:
    settings = report.get("settings", {})
    mode = "greedy" if settings.get("greedy", True) else f"T={settings.get('temperature')}"
    return f"{what}: {settings.get('target', '')}, {mode}"


def _by_depth(rows: list[dict]) -> tuple[dict, dict, list[dict]]:
    """Sweep / tune rows split into tree lines ``{depth: rows by total tokens}``, automatic-budget rows ``{depth:
    row}`` (no node count to plot against) and chain rows (top-k 1, by total tokens)."""
    lines, auto, chains = {}, {}, []
    for row in rows:
        if row.get("kind") == "chain" or row.get("top_k") == 1:
            chains.append(row)
        elif row["total_tokens"] == "auto":
            auto[row["depth"]] = row
        else:
            lines.setdefault(row["depth"], []).append(row)
    return ({d: sorted(r, key=lambda row: row["total_tokens"]) for d, r in sorted(lines.items())}, auto,
            sorted(chains, key=lambda row: row["total_tokens"]))


def _shape_lines(ax, rows: list[dict], key: str) -> None:
    """One line of ``key`` against total tokens per depth, a dashed level per depth for ``auto``, the chains."""
    lines, auto, chains = _by_depth(rows)
    colors = {depth: f"C{i}" for i, depth in enumerate(sorted(set(lines) | set(auto)))}
    for depth, series in lines.items():
        ax.plot([r["total_tokens"] for r in series], [r[key] for r in series], marker="o", color=colors[depth],
                label=f"depth {depth}")
    for depth, row in auto.items():
        if row.get(key) is not None:
            ax.axhline(row[key], linestyle="--", linewidth=1, color=colors[depth], label=f"depth {depth}, auto")
    if chains:
        ax.plot([r["total_tokens"] for r in chains], [r[key] for r in chains], marker="s", color="black",
                linestyle=":", label="chain (top-k 1)")
    ax.set_xlabel("total tokens (nodes verified per round, root included)")
    ax.grid(alpha=0.3)


def plot_sweep(report: dict, path: Path, plt) -> Path | None:
    """``poss bench --sweep``: speed-up and mean acceptance length against total tokens, one line per depth, one row
    of two panels per draft."""
    rows = [r for r in report.get("sweep", {}).get("shapes", []) if r.get("speedup") is not None]
    drafts = list(dict.fromkeys(r["draft"] for r in rows))
    if not drafts:
        return None
    fig, axes = plt.subplots(len(drafts), 2, figsize=(12, 4.2 * len(drafts)), squeeze=False)
    for (speed_ax, tau_ax), draft in zip(axes, drafts):
        mine = [r for r in rows if r["draft"] == draft]
        _shape_lines(speed_ax, mine, "speedup")
        speed_ax.axhline(1.0, color="black", linewidth=0.8)
        speed_ax.set_ylabel("speed-up over baseline (aggregate)")
        speed_ax.set_title(f"{draft}: speed-up", fontsize=10)
        speed_ax.legend(fontsize=7)
        _shape_lines(tau_ax, [r for r in mine if r.get("mean_acceptance_length") is not None],
                     "mean_acceptance_length")
        tau_ax.set_ylabel("mean acceptance length (+1 convention)")
        tau_ax.set_title(f"{draft}: mean acceptance length", fontsize=10)
    fig.suptitle(_title(report, "Tree-shape sweep"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _stem(output: str | Path) -> Path:
    """``output`` without its suffix (its folder created): plots are ``<stem>.NAME.png`` next to the report."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    return output.with_suffix("") if output.suffix else output


def save_plots(report: dict, output: str | Path) -> list[Path]:
    """Write ``<stem>.position_acceptance.png``, ``<stem>.speedup.png`` and, for a sweep, ``<stem>.sweep.png`` next
    to `output`; returns the paths."""
    plt = _pyplot()
    if plt is None:
        return []
    stem = _stem(output)
    paths = [plot_position_acceptance(report, Path(f"{stem}.position_acceptance.png"), plt),
             plot_speedup(report, Path(f"{stem}.speedup.png"), plt)]
    if report.get("sweep"):
        paths.append(plot_sweep(report, Path(f"{stem}.sweep.png"), plt))
    return [p for p in paths if p is not None]


# ---------------------------------------------------------------------------------------------------- poss tune
def plot_cost_curve(report: dict, path: Path, plt) -> Path:
    """``poss tune``: the measured verification cost t(n) against n (the chosen node count marked) and the predicted
    speed-up of every candidate shape against total tokens (one line per depth, the chains; chosen and measured
    marked)."""
    verify = {int(n): float(t) for n, t in report["profile"]["verify_seconds"].items()}
    sizes = sorted(verify)
    chosen, measured = report.get("chosen"), report.get("measured") or {}
    fig, (cost_ax, speed_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    cost_ax.plot(sizes, [verify[n] * 1000 for n in sizes], marker="o", label="t(n), measured")
    cost_ax.plot(sizes, [verify[sizes[0]] * 1000 * n / sizes[0] for n in sizes], linestyle=":", color="grey",
                 label="n x t(1): the cost of n plain steps")
    if chosen:
        cost_ax.axvline(chosen["total_tokens"], color="C3", linestyle="--",
                        label=f"chosen: {chosen['kind']}, {chosen['total_tokens']} nodes")
    cost_ax.set_ylim(0, max(verify.values()) * 1000 * 1.15)
    cost_ax.set_xlabel("tokens verified in one target forward (n)")
    cost_ax.set_ylabel("target forward t(n), ms")
    cost_ax.set_title("Verification cost on this machine", fontsize=10)
    cost_ax.grid(alpha=0.3)
    cost_ax.legend(fontsize=7)
    candidates = [dict(r, speedup=r["predicted_speedup"]) for r in report.get("candidates", [])]
    _shape_lines(speed_ax, candidates, "speedup")
    speed_ax.axhline(1.0, color="black", linewidth=0.8)
    if chosen:
        speed_ax.plot([chosen["total_tokens"]], [chosen["predicted_speedup"]], marker="*", markersize=14,
                      color="C3", linestyle="none", label=f"chosen: depth {chosen['depth']}, top-k {chosen['top_k']}")
    if measured.get("speedup") is not None and chosen:
        speed_ax.plot([chosen["total_tokens"]], [measured["speedup"]], marker="X", markersize=10, color="C3",
                      linestyle="none", label=f"chosen, measured {measured['speedup']:.2f}x")
    speed_ax.set_ylabel("predicted speed-up over plain decoding")
    speed_ax.set_title("Replayed shapes", fontsize=10)
    speed_ax.legend(fontsize=7)
    fig.suptitle(f"poss tune: {report.get('target', '')}".rstrip(": "))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_tune_plot(report: dict, output: str | Path) -> Path | None:
    """Write ``<stem>.cost_curve.png`` next to `output` (the tune report's path); returns it (None: no matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return None
    return plot_cost_curve(report, Path(f"{_stem(output)}.cost_curve.png"), plt)
