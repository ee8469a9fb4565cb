"""The benchmarks' figure helpers: log axes read as plain numbers, ticks at the measured sizes."""

import pytest

from graphrt.base.plots import plain_log_labels, pyplot, save_figure, ticks_at

pytest.importorskip("matplotlib")


def _labels(axis, minor=False):
    return [label.get_text() for label in axis.get_ticklabels(minor=minor) if label.get_text()]


@pytest.mark.parametrize("low,high,major,some_minor", [
    (0.7, 1.6, ["0.1", "1", "10"], {"0.8", "2"}),  # within a decade: the minor ticks labelled too
    (0.05, 300, ["0.01", "0.1", "1", "10", "100", "1000"], set()),  # four decades: only the decades
])
def test_log_axis_labels_are_plain_numbers(low, high, major, some_minor):
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [low, high])
    ax.set_yscale("log")
    plain_log_labels(ax.yaxis)
    fig.canvas.draw()
    assert _labels(ax.yaxis) == major
    minor = set(_labels(ax.yaxis, minor=True))
    assert some_minor <= minor and all("e" not in text and "10^" not in text for text in minor)
    plt.close(fig)


def test_ticks_at_the_values_given_only(tmp_path):
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 8, 64, 256], [1, 2, 3, 4])
    ax.set_xscale("log", base=2)
    ticks_at(ax.xaxis, [64, 1, 8, 256, 8])
    fig.canvas.draw()
    assert _labels(ax.xaxis) == ["1", "8", "64", "256"] and not _labels(ax.xaxis, minor=True)
    save_figure(fig, tmp_path / "figure.png")
    assert (tmp_path / "figure.png").read_bytes().startswith(b"\x89PNG") and len(list(tmp_path.iterdir())) == 1
    plt.close(fig)
