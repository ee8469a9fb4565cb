"""Matplotlib set-up the benchmarks' PNG figures share: a headless backend, log axes labelled with plain
numbers (``0.8``, ``2``, ``30``; matplotlib's default writes ``8 x 10^-1``), and a figure written whole or
not at all."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plain_log_labels(axis) -> None:
    """Labels a log-scale ``axis`` (``ax.xaxis`` / ``ax.yaxis``) with plain numbers: every decade, and
    between decades where matplotlib would label its minor ticks (an axis spanning up to two decades)."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    axis.set_major_formatter(PlainLogFormatter())
    axis.set_minor_formatter(PlainLogFormatter(minor_thresholds=(2, 0.4)))


def ticks_at(axis, values) -> None:
    """Ticks (labelled with plain numbers) at ``values`` only on ``axis``, say the batch sizes measured."""
    from matplotlib.ticker import NullLocator

    values = sorted(set(values))
    axis.set_ticks(values, labels=[f"{value:g}" for value in values])
    axis.set_minor_locator(NullLocator())


def save_figure(fig, path) -> None:
    """Writes ``fig`` to ``path`` (a str or path; the format from its extension) at 120 dpi, through a
    temporary file (no half-written figure)."""
    from graphrt.base.files import replaced_when_done

    fig.tight_layout()
    with replaced_when_done(path) as partial:
        fig.savefig(partial, dpi=120)
