"""Progress bars: none made where progress is off (a tensor-parallel rank's start-up), since tqdm's first
bar in a process creates a named semaphore that a rank killed with SIGKILL leaves to the resource tracker
to report as leaked."""

import pytest

from graphrt.base.progress import progress_bar


def test_no_bar_is_made_where_progress_is_off(monkeypatch):
    import tqdm.auto

    def no_bar(*args, **kwargs):
        raise AssertionError("a tqdm bar was made with progress off")

    monkeypatch.setattr(tqdm.auto, "tqdm", no_bar)
    items = [3, 1, 2]
    assert progress_bar(items, False, desc="loading weights") is items
    with pytest.raises(AssertionError, match="a tqdm bar was made"):
        progress_bar(items, True)


def test_a_bar_yields_the_items_in_order():
    assert list(progress_bar(iter([3, 1, 2]), True, desc="capturing", unit="graph", total=3)) == [3, 1, 2]
