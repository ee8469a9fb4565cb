"""Asking L2 for bytes a kernel will read, before it reads them: ``prefetch.global.L2``, a hint that
loads nothing into registers and changes no result. A kernel launched as a programmatic dependent
(``graphrt.kernels.dependent_launch``) may issue it before its wait, so that bytes stream while the kernel
before it finishes: the paged decode asks for its first K/V tile (``L2_PREFETCH_FIRST_TILE``; its module
says why the lines it asks for are safe to read). CUDA only: the interpreter has no PTX, so callers pass
the prefetch's constexprs as off there."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.base.checks import triton_interpreter_on

#: Bytes one prefetch asks for: a cache line.
L2_LINE_BYTES = 128


@triton.jit
def prefetch_to_l2(ptrs, mask):
    """Asks L2 for the cache line of each pointer in ``ptrs`` where ``mask`` holds (any shape, one
    request a pointer; predicated, so masked-off pointers, which may lie past the tensor, are never
    touched)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def prefetching(asked: bool | None, default: bool, device: torch.device) -> bool:
    """Whether a launch on ``device`` compiles its prefetch in: ``asked`` (None: the kernel module's
    ``default`` switch), and only where kernels run compiled PTX (a CUDA device, not Triton's
    interpreter)."""
    wanted = default if asked is None else asked
    return bool(wanted) and device.type == "cuda" and not triton_interpreter_on()


def line_elements(element_size: int) -> int:
    """Elements of ``element_size`` bytes one prefetched line holds."""
    return max(1, L2_LINE_BYTES // element_size)


__all__ = ["L2_LINE_BYTES", "line_elements", "prefetch_to_l2", "prefetching"]
