"""`autoxla plan --plot FILE`: per-device memory by category as stacked bars, against the chip.

One bar per plan: the chosen strategy, or with --recommend every ranked mesh side by side. The
segments are the forecast's lines (planning/memory.py), so the picture and the printed table are
the same numbers; two horizontal lines mark the chip's HBM and what is left of it after the
headroom. matplotlib draws through its object API (no pyplot: no global figure state, no GUI
backend), and the file is written next to its destination and renamed over it, so an interrupted
or failed save never leaves a half-written picture.
"""
from __future__ import annotations

import os
import secrets
import textwrap
from dataclasses import dataclass

from .memory import Forecast, Line

GiB = 2**30
# What FILE's extension may be: the vector and raster formats matplotlib's Agg backend writes
# without extra libraries.
FORMATS = ("png", "svg", "pdf")
CLIP = 2.5     # the y axis ends at this many times the chip's HBM when a bar goes far beyond


@dataclass(frozen=True)
class Bar:
    label: str            # strategy and mesh, e.g. "2d (1, 4, 2)"
    lines: tuple          # of memory.Line: the stacked segments, bottom first


def bar(label: str, forecast: Forecast | None, weights_bytes: int) -> Bar:
    """A bar from a forecast, or the weights alone when neither --train nor --infer was asked."""
    if forecast is None:
        return Bar(label, (Line("weights", weights_bytes, "the plan's bytes per device"),))
    return Bar(label, tuple(forecast.lines))


def check_path(path: str) -> str:
    """The format FILE names, or a ValueError saying what is wrong with FILE and the fix (called
    with the other flags, before any model is built)."""
    if os.path.isdir(path):
        raise ValueError(f"--plot {path!r} is a directory: give a file name such as "
                         f"{os.path.join(path, 'memory.png')}")
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in FORMATS:
        raise ValueError(f"--plot {path!r}: the file's extension says its format; use one of "
                         f"{', '.join('.' + f for f in FORMATS)}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"--plot {path!r}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--plot {path!r}: folder {parent} is not writable; choose another")
    return ext


def render(bars: list[Bar], title: str, hbm_bytes: int | None = None,
           capacity_bytes: int | None = None, xlabel: str = ""):
    """The matplotlib Figure: stacked bars in GiB, the HBM and usable-capacity lines if known."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("--plot draws with matplotlib, which is not installed: pip install "
                          "matplotlib (or autoxla[plot])") from e
    if not bars:
        raise ValueError("nothing to plot: no plan was built")
    categories = []                  # every line name in first-seen order: one colour each
    for b in bars:
        categories += [x.name for x in b.lines if x.name not in categories]
    fig = Figure(figsize=(max(8.0, 2.5 + 0.75 * len(bars)), 5.0), layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(bars))
    bottoms = [0.0] * len(bars)
    colours = _colours(len(categories))
    for name, colour in zip(categories, colours):
        heights = [sum(x.bytes_per_device for x in b.lines if x.name == name) / GiB for b in bars]
        ax.bar(xs, heights, bottom=bottoms, color=colour, label=name, width=0.7,
               edgecolor="white", linewidth=0.5)
        bottoms = [lo + h for lo, h in zip(bottoms, heights)]
    # A bar far above the chip (dp of a large model) would flatten every other: the axis stops
    # at 2.5x the HBM and the clipped bars say their total at the top.
    top = max(bottoms) * 1.08
    if hbm_bytes is not None and max(bottoms) > CLIP * hbm_bytes / GiB:
        top = CLIP * hbm_bytes / GiB
        ax.set_ylim(0, top)
    for x, total in zip(xs, bottoms):
        clipped = total > top
        ax.annotate(f"{total:.1f}" + (" ^" if clipped else ""), (x, min(total, top)),
                    ha="center", va="top" if clipped else "bottom", fontsize=8,
                    xytext=(0, -2 if clipped else 2), textcoords="offset points",
                    bbox=dict(facecolor="white", edgecolor="none", pad=1) if clipped else None)
    if hbm_bytes is not None:
        ax.axhline(hbm_bytes / GiB, color="black", linewidth=1.2,
                   label=f"HBM per chip {hbm_bytes / GiB:.0f} GiB")
    if capacity_bytes is not None and capacity_bytes != hbm_bytes:
        ax.axhline(capacity_bytes / GiB, color="black", linewidth=1.0, linestyle="--",
                   label=f"usable after headroom {capacity_bytes / GiB:.1f} GiB")
    ax.set_xticks(list(xs), [b.label for b in bars], rotation=30 if len(bars) > 3 else 0,
                  ha="right" if len(bars) > 3 else "center", fontsize=8)
    ax.set_ylabel("GiB per device")
    ax.set_xlabel(xlabel, fontsize=8)
    pad = max(0.0, (3 - len(bars)) / 2)        # one or two bars keep a bar's width
    ax.set_xlim(-0.6 - pad, len(bars) - 0.4 + pad)
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def save(fig, path: str) -> None:
    """Writes ``fig`` to ``path`` atomically: a new file beside it (created with the user's umask,
    as a plain open would), then a rename over the target."""
    fmt = check_path(path)
    parent = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=fmt, dpi=120)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _colours(n: int):
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]
