"""PNG plots of a `poss bench` report: position-wise acceptance per method and speed-up per method."""

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
    for name, rates in series.items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
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


def save_plots(report: dict, output: str | Path) -> list[Path]:
    """Write ``<stem>.position_acceptance.png`` and ``<stem>.speedup.png`` next to `output`; returns the paths."""
    plt = _pyplot()
    if plt is None:
        return []
    output = Path(output)
    stem = output.with_suffix("") if output.suffix else output
    paths = [plot_position_acceptance(report, Path(f"{stem}.position_acceptance.png"), plt),
             plot_speedup(report, Path(f"{stem}.speedup.png"), plt)]
    return [p for p in paths if p is not None]
