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


def test_a_failed_write_names_the_file_asked_for_not_the_temporary_one(tmp_path):
    """A folder that turned unwritable after the check (here: gone) fails the write; the error names the
    user's path."""
    target = tmp_path / "gone" / "result.json"
    with pytest.raises(OSError, match=r"cannot write '.*gone/result\.json': No such file") as raised:
        with replaced_when_done(target) as partial, open(partial, "w") as f:
            f.write("{}")
    assert "partial" not in str(raised.value)


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


@pytest.mark.parametrize("command", [["profile", "--trace"], ["bench", "--json"], ["bench", "--plot"],
                                     ["bench-serving", "--json"]])
def test_an_output_in_a_folder_that_cannot_be_written_is_refused_before_the_run(command, capsys):
    """/proc exists and passes ``os.access`` for root, yet no file can be made there: the check makes one."""
    import os

    if not os.path.isdir("/proc") or os.path.exists("/proc/graphrt-check.json"):
        pytest.skip("needs Linux's /proc")
    with pytest.raises(SystemExit) as exit_info:
        main([command[0], "--model", "random:tiny", "--device", "cpu", command[1], "/proc/graphrt-check.json"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot write '/proc/graphrt-check.json': the folder '/proc' is not writable" in err, err
