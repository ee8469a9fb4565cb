"""Files the commands write when they end: checked before the run, written whole or not at all."""

from __future__ import annotations

import json

import pytest
import torch

from graphrt.base.files import replaced_when_done
from graphrt.cli import main


def test_a_file_is_replaced_only_when_its_writer_finishes(tmp_path):
    target = tmp_path / "result.json"
    target.write_text("old")
    with pytest.raises(OSError, match="disk full"):
        with replaced_when_done(target) as partial, open(partial, "w") as f:
            f.write('{"half": ')
            raise OSError("disk full")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["result.json"]
    with replaced_when_done(target) as partial, open(partial, "w") as f:
        assert partial.parent == tmp_path and partial.suffix == ".json" and partial != target
        json.dump({"whole": True}, f)
    assert json.loads(target.read_text()) == {"whole": True}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


@pytest.mark.parametrize("command", ["bench", "bench-serving"])
def test_a_plot_format_matplotlib_cannot_write_is_refused_before_the_run(command, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--model", "random:tiny", "--device", "cpu", "--plot", str(tmp_path / "out.xyz")])
    assert exit_info.value.code == 2
    assert "matplotlib writes no 'xyz' files" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_on_a_cuda_device_torch_does_not_see_is_refused_by_name(capsys):
    assert main(["bench", "--model", "random:tiny", "--device", "cuda", "--batch-sizes", "1", "--contexts", "16"]) == 2
    captured = capsys.readouterr()
    assert "device 'cuda' was asked for but torch sees no CUDA device" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_a_trace_in_a_folder_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    """(As root every folder passes ``os.access``; a user's read-only folder is stood in for.)"""
    import os

    folder = tmp_path / "read-only"
    folder.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(folder) else real_access(path, mode))
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--model", "random:tiny", "--device", "cpu", "--trace", str(folder / "t.json")])
    assert exit_info.value.code == 2
    assert f"the folder {str(folder)!r} is not writable" in capsys.readouterr().err
