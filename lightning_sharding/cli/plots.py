"""Pictures for the ``lightning-sharding`` command line: a plan's assignment, a checkpoint's progress.

matplotlib is optional (``pip install "lightning-sharding[plot]"``). It is imported only when a
picture is drawn, always onto an Agg canvas: no display is needed and pyplot's state is untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from lightning_sharding.core.rangeset import RangeSet

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from lightning_sharding.core.order import EpochOrder
    from lightning_sharding.core.plan import EpochPlan
    from lightning_sharding.mixture import MixtureOrder

# Above this many (rank, worker) bands the plan is drawn with one band per rank.
MAX_BANDS = 64
# Above this many batches in all, a worker's batches are drawn as one run instead of alternating shades.
MAX_BATCHES_SHADED = 4000
# Item boundaries are drawn as lines when there are at most this many items.
MAX_ITEM_LINES = 64


class MatplotlibMissingError(ImportError):
    """matplotlib is not installed; the message says how to install it."""


def _figure(width: float, height: float) -> Figure:
    """A figure on an Agg canvas, or :class:`MatplotlibMissingError`."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise MatplotlibMissingError(
            'drawing a plot needs matplotlib, which is not installed: pip install "lightning-sharding[plot]"'
        ) from err
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _colour(index: int, count: int) -> Any:
    from matplotlib import colormaps

    if count <= 10:
        return colormaps["tab10"](index % 10)
    if count <= 20:
        return colormaps["tab20"](index % 20)
    return colormaps["turbo"](index / max(1, count - 1))


def _bars(ranges: RangeSet) -> list[tuple[int, int]]:
    """``(start, width)`` pairs for ``Axes.broken_barh``."""
    return list(zip(ranges.starts.tolist(), (ranges.ends - ranges.starts).tolist(), strict=True))


def _item_band(ax: Axes, order: EpochOrder) -> None:
    """A thin band coloured by item id along the epoch order, sampled at about one value per pixel."""
    total = order.total
    xs = np.unique(np.linspace(0, total - 1, num=min(total, 4000)).astype(np.int64))
    slots = np.searchsorted(order.starts, xs, side="right") - 1
    items = order.item_order[slots]
    # Each sample is drawn over [x, next x): the band spans [0, total) with no gaps.
    edges = np.append(xs, total).astype(np.float64)
    ax.pcolormesh(
        edges, [0.0, 1.0], items[None, :].astype(np.float64), cmap="viridis", vmin=0, vmax=max(1, order.counts.size - 1)
    )
    ax.set_yticks([0.5], ["item id"])
    if order.counts.size <= MAX_ITEM_LINES // 2:
        # Few items: write each one's id in the middle of its run.
        middles = (order.starts[:-1] + order.starts[1:]) / 2
        top = max(1, order.counts.size - 1)
        for middle, item, count in zip(middles, order.item_order, order.counts[order.item_order], strict=True):
            if count > 0:  # viridis is dark below the middle and light above it
                colour = "white" if item / top < 0.5 else "black"
                ax.text(middle, 0.5, str(int(item)), ha="center", va="center", fontsize=7, color=colour)
    ax.set_xlim(0, total)
    ax.set_xlabel("epoch position")


def _stream_band(ax: Axes, order: MixtureOrder) -> None:
    """A thin band coloured by stream along a mixture's epoch, sampled at about one value per pixel."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    total = order.total
    count = len(order.names)
    xs = np.unique(np.linspace(0, total - 1, num=min(total, 4000)).astype(np.int64))
    streams, _ = order.streams(xs)
    palette = colormaps["Set2" if count <= 8 else "tab20b"]  # not the ranks' colours above
    colours = [palette(s % palette.N) for s in range(count)]
    edges = np.append(xs, total).astype(np.float64)
    ax.pcolormesh(
        edges,
        [0.0, 1.0],
        streams[None, :].astype(np.float64),
        cmap=ListedColormap(colours),
        vmin=-0.5,
        vmax=count - 0.5,
    )
    ax.set_yticks([0.5], ["stream"])
    handles = [Patch(color=c, label=f"{n} ({d})") for c, n, d in zip(colours, order.names, order.draws, strict=True)]
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -1.2), ncols=min(count, 6), fontsize=7, frameon=False
    )
    ax.set_xlim(0, total)
    ax.set_xlabel("epoch position")


def _mixture_title(order: MixtureOrder) -> str:
    return f"\na mixture of {len(order.names)} streams in {order.composition} batches"


def plot_plan(
    path: str | Path, plan: EpochPlan, order: EpochOrder | MixtureOrder, mixture: MixtureOrder | None = None
) -> None:
    """Draw which epoch positions each (rank, worker) reads into the image ``path``.

    One horizontal band per (rank, worker) (per rank when there are more than ``MAX_BANDS``), with
    the worker's batches in alternating shades of its rank's colour, above a thin band coloured by
    item id along the epoch order (by stream, for a ``mixture``: the order itself, when it is one).
    Padding samples are not drawn.
    """
    fig = _figure(10.0, 2.0)  # fails first when matplotlib is missing; resized below
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_rgba

    workers = max(1, plan.num_workers)
    per_rank = plan.world_size * workers > MAX_BANDS
    bands = plan.world_size if per_rank else plan.world_size * workers
    shaded = not per_rank and plan.num_batches * plan.world_size <= MAX_BATCHES_SHADED
    spans: list[RangeSet] = []  # what to draw, with its band and colour
    rows: list[int] = []
    colours: list[tuple[float, float, float, float]] = []
    labels: list[str] = []
    for r in range(plan.world_size):
        rank = plan.rank(r)
        colour = to_rgba(_colour(r, plan.world_size))
        light = to_rgba(colour, alpha=0.55)
        if per_rank:
            spans.append(rank.positions.select(0, rank.num_served))
            rows.append(r)
            colours.append(colour)
            labels.append(f"rank {r}")
            continue
        for w in range(workers):
            run = rank.worker_batches(w)
            labels.append(f"r{r} w{w}" if plan.num_workers else f"rank {r}")
            runs = [(run[0], run[-1])] if run and not shaded else [(b, b) for b in run]
            for k, (first, last) in enumerate(runs):
                spans.append(rank.positions.select(rank.bounds(first)[0], rank.bounds(last)[1]))
                rows.append(r * workers + w)
                colours.append(colour if k % 2 == 0 else light)
    # One collection of rectangles for all bands: a call per band would autoscale every time.
    counts = np.array([s.num_ranges for s in spans], dtype=np.int64)
    starts = np.concatenate([s.starts for s in spans] or [np.empty(0, np.int64)]).astype(np.float64)
    ends = np.concatenate([s.ends for s in spans] or [np.empty(0, np.int64)]).astype(np.float64)
    ys = np.repeat(np.asarray(rows, dtype=np.float64), counts)
    verts = np.stack(
        [
            np.stack(corner, axis=1)
            for corner in ((starts, ys - 0.4), (ends, ys - 0.4), (ends, ys + 0.4), (starts, ys + 0.4))
        ],
        axis=1,
    )
    face = np.repeat(np.asarray(colours, dtype=np.float64).reshape(-1, 4), counts, axis=0)

    height = min(14.0, 1.6 + 0.28 * bands)
    fig.set_size_inches(10.0, height)
    ax, items_ax = fig.subplots(2, 1, sharex=True, height_ratios=[height - 1.3, 0.3])
    ax.add_collection(PolyCollection(list(verts), facecolors=face, linewidths=0), autolim=False)
    if mixture is None and order.counts.size <= MAX_ITEM_LINES:
        ax.vlines(
            cast("EpochOrder", order).starts[1:-1], -0.5, bands - 0.5, colors="0.6", linewidth=0.6, linestyles="dotted"
        )
    step = max(1, -(-bands // 32))
    ax.set_yticks(range(0, bands, step), labels[::step])
    ax.set_ylim(bands - 0.5, -0.5)
    ax.set_title(
        f"epoch {plan.epoch}: {plan.total} samples over {plan.world_size} ranks x {plan.num_workers} workers, "
        f"batch size {plan.batch_size}, {plan.num_batches} batches per rank"
        + (_mixture_title(mixture) if mixture is not None else "")
        + (" (shades: batches)" if shaded else " (one band per rank)" if per_rank else ""),
        fontsize=10,
    )
    if mixture is not None:
        _stream_band(items_ax, mixture)
    else:
        _item_band(items_ax, cast("EpochOrder", order))
    fig.savefig(path, dpi=100)


def plot_progress(path: str | Path, consumed: RangeSet, total: int, epoch: int) -> None:
    """Draw an epoch's progress into the image ``path``: the consumed positions of ``[0, total)`` filled."""
    fig = _figure(10.0, 1.8)
    ax = fig.subplots()
    ax.broken_barh([(0, total)], (0, 1), facecolors="0.9")
    ax.broken_barh(_bars(consumed), (0, 1), facecolors="tab:green")
    ax.set_xlim(0, total)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("epoch position")
    share = 100.0 * len(consumed) / total if total else 0.0
    ax.set_title(
        f"epoch {epoch}: {len(consumed)} of {total} samples consumed ({share:.1f}%, green) "
        f"in {consumed.num_ranges} {'range' if consumed.num_ranges == 1 else 'ranges'}",
        fontsize=10,
    )
    fig.savefig(path, dpi=100)
