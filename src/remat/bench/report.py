"""Benchmark presentation: Markdown tables and memory–time plots (matplotlib, lazy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remat.core.units import format_bytes

__all__ = ["write_markdown", "write_plots", "markdown_table"]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One table per model: method, peak, memory ratio, time ratio, gradient checks (against
    eager, and the whole gradient's error against float64: eager's row is float32's own),
    notes."""
    lines: list[str] = []
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += [
            f"### {model}",
            "",
            "| method | peak | memory ratio | time ratio | predicted peak | max grad rel. diff | "
            "grad error vs fp64 | notes |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r["model"] == model):
            peak = format_bytes(r["peak_bytes"]) if "peak_bytes" in r else "-"
            mem = f"{r['memory_ratio']:.3f}" if "memory_ratio" in r else "-"
            tim = f"{r['time_ratio']:.2f}" if "time_ratio" in r else "-"
            pred = format_bytes(r["predicted_peak_bytes"]) if r.get("predicted_peak_bytes") else ""
            grad = f"{r['max_grad_rel_diff']:.1e}" if "max_grad_rel_diff" in r else ""
            fp64 = f"{r['grad_error_fp64']:.1e}" if "grad_error_fp64" in r else ""
            notes = r.get("error") or r.get("plan") or ""
            if "time_vs_optimal" in r:
                notes = (
                    f"time vs optimal {r['time_vs_optimal']:.3f}, memory vs optimal "
                    f"{r['memory_vs_optimal']:.3f}, planned in {r['plan_seconds']:.3f} s"
                )
            notes = str(notes).replace("|", "/").replace("\n", " ")
            if len(notes) > 160:
                notes = notes[:157] + "..."
            lines.append(
                f"| {r['method']} | {peak} | {mem} | {tim} | {pred} | {grad} | {fp64} | {notes} |"
            )
        lines.append("")
    return "\n".join(lines)


def write_markdown(path: Path, suite: str, result: dict[str, Any], notes: str = "") -> None:
    machine = result["machine"]
    what = notes or (
        "Peak = exact bytes of a whole training step (Adam); ratios against eager measured in "
        "the same run (interleaved, median of 5 steps)."
    )
    header = [
        f"# remat bench {suite}{' (quick)' if result.get('quick') else ''}",
        "",
        f"Measured {machine['date']} on {machine['device']} ({machine.get('cpus')} CPUs, "
        f"{machine['threads']} torch threads), torch {machine['torch']}, Python "
        f"{machine['python']}; the run took {result['seconds']:.0f} s. {what}",
        "",
    ]
    path.write_text("\n".join(header) + markdown_table(result["rows"]) + "\n")


def write_plots(out: Path, suite: str, rows: list[dict[str, Any]]) -> list[Path]:
    """One PNG per model: memory ratio against time ratio, remat's points as a curve."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - plotting is optional
        return []
    paths = []
    if any("depth" in r for r in rows):
        paths.append(_depth_plot(out, suite, rows, plt))
    for model in dict.fromkeys(r["model"] for r in rows):
        points = [
            r for r in rows if r["model"] == model and "memory_ratio" in r and "time_ratio" in r
        ]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(7, 5))
        remat_pts = sorted(
            (r for r in points if r.get("family") == "remat"), key=lambda r: r["memory_ratio"]
        )
        if remat_pts:
            ax.plot(
                [r["memory_ratio"] for r in remat_pts],
                [r["time_ratio"] for r in remat_pts],
                "o-",
                color="tab:blue",
                label="remat",
                zorder=3,
            )
        for r in points:
            if r.get("family") == "remat":
                continue
            ax.scatter(r["memory_ratio"], r["time_ratio"], s=40, zorder=4)
            ax.annotate(
                r["method"],
                (r["memory_ratio"], r["time_ratio"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        xs = [r["memory_ratio"] for r in points]
        if max(xs) - min(xs) < 0.02:  # equal peaks: no axis magnified to a few bytes
            ax.set_xlim(min(xs) - 0.05, max(xs) + 0.05)
            ax.ticklabel_format(axis="x", useOffset=False)
        ax.set_xlabel("peak memory / eager")
        ax.set_ylabel("step time / eager")
        ax.set_title(f"{suite}: {model}")
        ax.grid(alpha=0.3)
        if remat_pts:
            ax.legend(loc="upper right")
        path = out / f"{suite}-{model}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _depth_plot(out: Path, suite: str, rows: list[dict[str, Any]], plt: Any) -> Path:
    """Peak activation memory against depth, one line per method (log–log)."""
    fig, ax = plt.subplots(figsize=(7, 5))
    for method in dict.fromkeys(r["method"] for r in rows if "depth" in r):
        pts = sorted(
            (r["depth"], r["peak_bytes"])
            for r in rows
            if r["method"] == method and "peak_bytes" in r and "depth" in r
        )
        if pts:
            ax.plot([d for d, _ in pts], [b / 2**30 for _, b in pts], "o-", label=method)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("layers")
    ax.set_ylabel("peak activation memory (GiB)")
    ax.set_title(f"{suite}: memory against depth")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    path = out / f"{suite}-depth.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
