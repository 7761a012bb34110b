"""Presentation of measurements: text tables and PNG plots (matplotlib, imported lazily).

* :func:`format_memory_report`: a :class:`~remat.measure.profile.MemoryReport` as a breakdown table
  (defined in :mod:`remat.profile` next to :meth:`~remat.measure.profile.MemoryReport.table`, which
  uses it: the measuring layer does not import this one);
* :func:`format_module_peaks`: the modules with the highest peaks;
* :func:`format_chain`: a captured :class:`~remat.core.chain.Chain`, one row per stage;
* :func:`plot_profile`: breakdown bar + memory timeline, written as a PNG.

Nothing here measures or plans; units come from :mod:`remat.core.units`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from remat.core.units import format_bytes, format_time
from remat.measure.profile import CATEGORIES, MemoryReport, format_memory_report

if TYPE_CHECKING:
    from remat.core.chain import Chain

__all__ = ["format_memory_report", "format_module_peaks", "format_chain", "plot_profile"]

_COLOURS = {
    "parameters": "#4c72b0",
    "buffers": "#8172b2",
    "gradients": "#dd8452",
    "optimizer": "#937860",
    "activations": "#55a868",
    "temporaries": "#c44e52",
}


def format_module_peaks(report: MemoryReport, depth: int = 1, top: int = 10) -> str:
    """The ``top`` modules (FQN depth <= ``depth``) with the highest forward/backward peaks."""
    rows = [
        (name, fwd, bwd)
        for name, (fwd, bwd) in report.module_peaks.items()
        if name.count(".") < depth
    ]
    rows.sort(key=lambda r: max(r[1], r[2]), reverse=True)
    width = max([len("module"), *(len(r[0]) for r in rows[:top])])
    lines = [f"{'module':<{width}} {'forward peak':>13} {'backward peak':>14}"]
    for name, fwd, bwd in rows[:top]:
        lines.append(f"{name:<{width}} {format_bytes(fwd):>13} {format_bytes(bwd):>14}")
    return "\n".join(lines)


def format_chain(chain: Chain, limit: int = 40) -> str:
    """The per-stage costs of a chain (first and last stages when there are more than
    ``limit``)."""
    unit = format_time if chain.time_unit == "s" else (lambda t: f"{t:.3g} flop")
    width = max(len("stage"), *(len(n) for n in chain.names))
    width = min(width, 40)
    lines = [
        f"chain: {chain.n} stages, input {format_bytes(chain.input_bytes)}",
        f"{'#':>4} {'stage':<{width}} {'out':>11} {'saved':>11} {'fwd extra':>11} "
        f"{'bwd extra':>11} {'forward':>11} {'backward':>11}",
    ]
    indices = list(range(chain.n))
    if chain.n > limit:
        indices = indices[: limit // 2] + [-1] + indices[-limit // 2 :]
    for i in indices:
        if i < 0:
            lines.append(f"{'...':>4}")
            continue
        name = chain.names[i]
        if len(name) > width:
            name = name[: width - 3] + "..."
        lines.append(
            f"{i + 1:>4} {name:<{width}} {format_bytes(chain.out_bytes[i]):>11} "
            f"{format_bytes(chain.saved_bytes[i]):>11} "
            f"{format_bytes(chain.fwd_overhead_bytes[i]):>11} "
            f"{format_bytes(chain.bwd_overhead_bytes[i]):>11} "
            f"{unit(chain.fwd_time[i]):>11} {unit(chain.bwd_time[i]):>11}"
        )
    lines.append(
        f"total: saved {format_bytes(sum(chain.saved_bytes))}, forward "
        f"{unit(chain.total_fwd_time())}, backward {unit(chain.total_bwd_time())}"
    )
    return "\n".join(lines)


def plot_profile(report: MemoryReport, path: str | Path, title: str | None = None) -> Path:
    """Write a PNG: the breakdown at the peak (stacked bar) and live memory over the step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover
        raise ImportError("plots need matplotlib: pip install 'remat[plot]'") from err
    path = Path(path)
    mib = 2**20
    fig, (bar_ax, line_ax) = plt.subplots(
        1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 4]}
    )
    bottom = 0.0
    for key in CATEGORIES:
        value = report.categories[key] / mib
        bar_ax.bar([0], [value], bottom=[bottom], color=_COLOURS[key], label=key)
        bottom += value
    bar_ax.set_xticks([0], ["peak"])
    bar_ax.set_ylabel("MiB")
    bar_ax.set_title(f"at the peak: {format_bytes(report.peak_bytes)}")
    bar_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), fontsize=8, ncol=2)

    points = report.timeline
    if points:
        step = max(1, len(points) // 20000)
        xs = list(range(0, len(points), step))
        ys = [max(b for _, b in points[i : i + step]) / mib for i in xs]
        line_ax.plot(xs, ys, color="black", linewidth=0.8)
        phases: list[tuple[str, int]] = []
        for i, (label, _) in enumerate(points):
            phase = label.split(":", 1)[0]
            if not phases or phases[-1][0] != phase:
                phases.append((phase, i))
        colours = {"forward": "#55a868", "backward": "#c44e52", "optimizer": "#937860"}
        for k, (phase, start) in enumerate(phases):
            end = phases[k + 1][1] if k + 1 < len(phases) else len(points)
            if phase in colours:
                line_ax.axvspan(start, end, color=colours[phase], alpha=0.15, label=phase)
        peak_at = next(i for i, (_, b) in enumerate(points) if b == report.peak_bytes)
        line_ax.plot([peak_at], [report.peak_bytes / mib], "v", color="black")
        line_ax.annotate(
            f"peak {format_bytes(report.peak_bytes)}",
            (peak_at, report.peak_bytes / mib),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
        line_ax.legend(loc="upper left", fontsize=8)
    line_ax.set_xlabel("operation")
    line_ax.set_ylabel("live MiB")
    line_ax.set_title("memory over the step")
    fig.suptitle(title or f"{report.model_name}: one training step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
