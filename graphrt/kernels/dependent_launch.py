"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

Inside a CUDA graph a kernel still starts only after the previous one has fully finished: its
programs are scheduled, then read their first bytes, while the SMs drain the previous kernel's last
programs. A step of batch-1 decode is a chain of a few hundred short kernels, so those gaps add up
(a layer is several kernels, each with little work at batch 1). On Hopper (sm_90) and later a kernel
launched as a *programmatic dependent* may start as soon as every program of the previous kernel has
signalled ``gdc_launch_dependents``; it must then call ``gdc_wait`` (which returns once the previous
kernel has finished and its writes are visible) before it touches anything that kernel, or an earlier
one, reads or writes. Static data (weights) can be read before the wait.

Rules every kernel launched with ``launch_pdl=True`` here follows:

* every program calls ``gdc_wait`` before its first read of anything a kernel of the same step may
  write (activations, workspaces, this step's K/V rows in the cache) and before its first write (so the
  kernel finishing implies every earlier kernel finished: the dependency stays transitive along the
  chain);
* what no kernel of the step writes may be read before the wait: weights, and the step's inputs that
  the host uploads before its first kernel (positions, slot mapping, sequence lengths, block tables;
  rotary tables) together with the cache rows of earlier steps. A chain starts with a plainly launched
  kernel (the embedding lookup), which starts after the upload and after the previous step's last
  kernel; a dependent kernel starts only once every program of the kernel before it has started, so by
  induction after that first kernel: those bytes are final before any program of the chain runs;
* ``gdc_launch_dependents`` comes early (before the weight loads): it only lets the next kernel's
  programs be scheduled into free slots, where they wait; correctness never depends on where it sits.
  (The fused QKV kernel issues its position, rotary, slot and bias loads just before it, the GEMV its
  bias load.)

Launched as dependents, a layer's batch-1 GEMV kernels run measurably faster with identical outputs
(profiles/notes_fusion.md has the measurements).

The grid dependency instructions are compiled only into launches with ``PDL=True``; the CPU
interpreter, which has none, always gets ``PDL=False``. A kernel's ``PDL`` constexpr and Triton's
``launch_pdl`` option must agree (launched early without the wait, a kernel would race the one
before it), so launch sites take both from ``launch_options``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.base.checks import triton_interpreter_on


def dependent_launch_available(device: torch.device | str) -> bool:
    """Whether kernels on ``device`` can be launched as programmatic dependents: an NVIDIA GPU of
    compute capability 9.0 or later (ROCm builds report AMD GPUs as CUDA devices too), a Triton with
    grid dependency control, not the CPU interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None or triton_interpreter_on():
        return False
    if not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(dependent_launch: bool) -> dict:
    """The keyword arguments a kernel launch takes for ``dependent_launch``: the kernel's ``PDL``
    constexpr and Triton's ``launch_pdl`` option, always equal."""
    return {"PDL": dependent_launch, "launch_pdl": dependent_launch}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Let the next kernel be scheduled, then wait until the previous kernel has finished and its
    writes are visible. For kernels whose every input is produced earlier in the step; call it first."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


__all__ = ["dependent_launch_available", "launch_options", "wait_for_previous_kernel"]
