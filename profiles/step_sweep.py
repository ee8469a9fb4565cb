"""What the step sweeps in profiles/ share (``bench_step_tiles.py``, ``bench_step_attention.py``,
``bench_attention_floor.py``): one engine per model:batch:context point with its greedy batch, graphs of
the greedy mode only, a results header and the JSON written after every point. Imported by those
scripts as a sibling module (``python profiles/<script>.py`` puts profiles/ on the path)."""

from __future__ import annotations

import json

import torch

import graphrt.capture.graph_runner as graph_runner
from graphrt.bench import measure_read_bandwidth
from graphrt.sampling_params import SamplingParams
from graphrt.workload import decode_engine, fill_decode_batch


def capture_greedy_graphs_only() -> None:
    """One graph a capture (the greedy mode, the bench's): recaptures take a third of the time."""
    graph_runner.SAMPLING_MODES = ("greedy",)


def parse_point(point: str) -> tuple[str, int, int]:
    """(model, batch size, context) of ``model:batch:context``; the model name may hold colons."""
    model, batch_size, context = point.rsplit(":", 2)
    return model, int(batch_size), int(context)


def greedy_engine(model: str, batch_size: int, context: int):
    """(engine, batch): a captured engine for ``batch_size`` sequences of ``context`` tokens and its
    greedy decode batch (``graphrt.workload``)."""
    engine = decode_engine(model, "cuda", "auto", batch_size, context, enforce_eager=False)
    return engine, fill_decode_batch(engine, batch_size, context, SamplingParams(temperature=0.0))


def results_header(**fields) -> dict:
    """The device, torch and this run's HBM read bandwidth, then ``fields``."""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "hbm_read_bandwidth_gbps": round(measure_read_bandwidth(torch.device("cuda")) / 1e9, 1), **fields}


def write_results(path: str | None, results: dict) -> None:
    """Writes ``results`` as JSON to ``path`` (nothing when None): called after every point, so a run cut
    short by a timeout keeps what it measured."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
