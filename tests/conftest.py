"""Without a CUDA device, Triton kernels run on Triton's CPU interpreter. ``@triton.jit`` reads
``TRITON_INTERPRET`` when it decorates a kernel, so it must be set before any test imports one."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
