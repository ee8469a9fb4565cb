"""Probe: what one dependency between two phases of decode work costs on the GPU, as a kernel boundary
(a chain of kernels launched as programmatic dependents, as the batch-1 decode layers run today) against
a grid-wide barrier inside one persistent kernel (what a kernel per decoder layer would pay instead,
profiles/notes_fusion.md "Next").

Both run ``PHASES`` dependent phases over ``programs`` programs (half the multiprocessors, then all of
them; one program each). In each
phase every program reads the value the previous phase left (one float per program, written by another
program) and writes its own: a real dependency and almost no work, so the time per phase is the cost
of the dependency itself. Timed as CUDA-graph replays (medians), like the decode step.

    python profiles/bench_grid_barrier.py --json profiles/results/grid_barrier_h200.json

The barrier spins: every program of the grid must be resident at once, which ``programs`` <= the
multiprocessors guarantees here (one small program a multiprocessor). GPU only: the CPU interpreter
runs programs one after another, so a spinning program would wait forever.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from bench_gemv import time_graph

from graphrt.kernels.dependent_launch import launch_options

PHASES = 128


@triton.jit
def _phase_kernel(values_ptr, phase, PROGRAMS: tl.constexpr, PDL: tl.constexpr):
    """One phase as its own kernel: read a neighbour's value of the previous phase, write ours."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    previous = tl.load(values_ptr + ((phase + 1) % 2) * PROGRAMS + (pid + 1) % PROGRAMS)
    tl.store(values_ptr + (phase % 2) * PROGRAMS + pid, previous + 1.0)


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program arrives (release), then waits until ``target`` arrivals are counted (acquire)."""
    tl.debug_barrier()  # the program's stores are issued before it counts itself in
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while arrived < target:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(values_ptr, counter_ptr, num_phases, PROGRAMS: tl.constexpr):
    """Every phase in one kernel, a grid barrier between phases; previous values read from L2 (.cg)."""
    pid = tl.program_id(0)
    for phase in range(num_phases):
        previous = tl.load(values_ptr + ((phase + 1) % 2) * PROGRAMS + (pid + 1) % PROGRAMS, cache_modifier=".cg")
        tl.store(values_ptr + (phase % 2) * PROGRAMS + pid, previous + 1.0)
        _grid_barrier(counter_ptr, (phase + 1) * PROGRAMS)


def measure(programs: int) -> dict:
    values = torch.zeros(2 * programs, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    def chain(pdl: bool):
        def run():
            for phase in range(PHASES):
                _phase_kernel[(programs,)](values, phase, PROGRAMS=programs, num_warps=4, **launch_options(pdl))
        return run

    def persistent():
        counter.zero_()  # a memset node: the barrier counts from zero each replay
        _persistent_kernel[(programs,)](values, counter, PHASES, PROGRAMS=programs, num_warps=4)

    def empty_persistent():
        counter.zero_()
        _persistent_kernel[(programs,)](values, counter, 1, PROGRAMS=programs, num_warps=4)

    plain, dependent = time_graph([chain(False)], 30), time_graph([chain(True)], 30)
    barrier, single = time_graph([persistent], 30), time_graph([empty_persistent], 30)

    def consistent(run) -> bool:
        """From zeros, phase p writes p + 1 everywhere only if every read saw the phase before."""
        values.zero_()
        run()
        torch.cuda.synchronize()
        last = values[(PHASES - 1) % 2 * programs:][:programs]
        return bool(torch.all(last == float(PHASES)))

    return {
        "programs": programs,
        "phases": PHASES,
        "kernel_chain_plain_us_per_phase": plain * 1e3 / PHASES,
        "kernel_chain_dependent_us_per_phase": dependent * 1e3 / PHASES,
        "grid_barrier_us_per_phase": (barrier - single) * 1e3 / (PHASES - 1),
        "chain_values_consistent": consistent(chain(True)),
        "persistent_values_consistent": consistent(persistent),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "points": []}
    for programs in (sms // 2, sms):
        point = measure(programs)
        results["points"].append(point)
        print(json.dumps(point), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
