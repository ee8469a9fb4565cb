"""Compile Triton kernels for the H200 (sm_90) on a machine without a GPU.

The CPU interpreter runs kernels but does not check them as the GPU compiler does (branches returning
different shapes, shared memory beyond the device's limit pass there and fail on the device), so the
CPU suite also compiles the kernels' launch specialisations with Triton's compiler and the ``ptxas``
its wheel ships. That must happen in a process where Triton was imported without
``TRITON_INTERPRET`` (Triton's own ``tl.sum`` & co. are decorated at import), hence a subprocess:
``compile_for_sm90(cases)`` runs this file, which reads the cases as JSON on stdin.

Triton versions differ in what their front end accepts (the GPU machine's Triton is older than the one
the CPU suite installs), so ``GRAPHRT_SM90_TRITON`` may name a folder holding another Triton package
(``pip install --no-deps --target DIR triton==X``): the compile process then imports that one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: Shared memory one H200 thread block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin).
H200_SHARED_MEMORY = 232448


def compile_for_sm90(cases: list[dict]) -> list[dict]:
    """Compile each case for sm_90 in one fresh process.

    A case: ``module`` (import path), ``kernel`` (its ``@triton.jit`` name), ``signature`` (argument ->
    Triton type, e.g. ``"*bf16"``, ``"i32"``, ``"fp32"``, or a host tensor descriptor's
    ``"tensordesc<fp8e4nv[64, 256]>"``), ``constexprs`` (name -> value), ``num_warps``,
    ``num_stages``, optionally ``launch_pdl`` and ``aligned_ints`` (integer arguments to specialise as
    multiples of 16, as a launch does for such values; pointers always are). Returns, per case,
    ``{"shared": bytes, "dependency_waits": n, "dependency_launches": n, "loads_before_wait": n or None,
    "l2_prefetches_before_wait": n or None, "tma_loads": n}`` (grid dependency control instructions in its
    PTX, global loads and L2 prefetches placed before the first wait, and TMA bulk tensor copies) or
    ``{"error": text}``.
    """
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    other_triton = os.environ.get("GRAPHRT_SM90_TRITON")
    if other_triton:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [other_triton, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__], input=json.dumps(cases), capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode:
        raise RuntimeError(f"the sm_90 compile process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gemv_case(name: str, dtype: str, variant: str, config, pdl: bool = False, in_features: int = 2048,
              fp8_weight: bool = False) -> dict:
    """A case for ``graphrt.kernels.gemv._gemv_kernel``: ``dtype`` "bf16"/"fp32"; ``variant`` "bias",
    "norm", "norm_silu", "silu" or "add" (as tests/test_gemv.py names them); ``config`` a
    ``gemv.TileConfig``; ``in_features`` sets the norm's row load (``gemv.norm_block``); ``fp8_weight``:
    the weight is FP8 E4M3 codes with per-row float32 scales."""
    from graphrt.kernels import gemv

    pointers = {arg: f"*{dtype}" for arg in ("x_ptr", "w_ptr", "bias_ptr", "norm_w_ptr", "out_ptr")}
    pointers.update(scale_ptr="*fp32", **({"w_ptr": "*fp8e4nv"} if fp8_weight else {}))
    integers = {arg: "i32" for arg in ("stride_x", "stride_w", "stride_out", "N", "K")}
    epilogue = {"norm_silu": gemv.EPILOGUE_SILU_MUL, "silu": gemv.EPILOGUE_SILU_MUL,
                "add": gemv.EPILOGUE_ADD_TO_OUT}.get(variant, gemv.EPILOGUE_STORE)
    constexprs = dict(NORM=variant.startswith("norm"), EPILOGUE=epilogue, HAS_BIAS=variant == "bias",
                      W_SCALED=fp8_weight, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                      THREAD_SUM=config.thread_sum, NORM_BLOCK=gemv.norm_block(in_features),
                      PDL=pdl)
    return dict(name=name, module="graphrt.kernels.gemv", kernel="_gemv_kernel",
                signature={**pointers, **integers, "eps": "fp32"}, constexprs=constexprs,
                num_warps=config.num_warps, num_stages=3, launch_pdl=pdl,  # stages: Triton's default, as launched
                aligned_ints=list(integers))  # the presets' widths are multiples of 16


def _compile(case: dict) -> dict:
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    kernel = getattr(importlib.import_module(case["module"]), case["kernel"])
    signature = {**case["signature"], **{name: "constexpr" for name in case["constexprs"]}}
    # As a launch specialises them: torch allocations are 16-byte aligned, and so are the integer
    # arguments the case names (strides and sizes that are multiples of 16).
    aligned = [name for name, kind in case["signature"].items() if kind.startswith("*")] + case.get("aligned_ints", [])
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    try:
        compiled = triton_compile(ASTSource(fn=kernel, signature=signature, constexprs=case["constexprs"], attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": case["num_warps"], "num_stages": case["num_stages"],
                                           "launch_pdl": case.get("launch_pdl", False)})
    except Exception as error:  # reported per case; the test names the case
        cause = error  # a helper's error arrives wrapped in its callers': the innermost one says what failed
        while cause.__cause__ is not None:
            cause = cause.__cause__
        return {"error": f"{type(error).__name__}: {error}"[-2000:] + f"\ncaused by {type(cause).__name__}: ..." + repr(cause)[-1500:]}
    ptx = compiled.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    return {"shared": compiled.metadata.shared, "dependency_waits": ptx.count("griddepcontrol.wait"),
            "dependency_launches": ptx.count("griddepcontrol.launch_dependents"),
            "loads_before_wait": None if wait < 0 else sum(ptx[:wait].count(op) for op in ("ld.global", "cp.async.ca", "cp.async.cg")),
            "l2_prefetches_before_wait": None if wait < 0 else ptx[:wait].count("prefetch.global.L2"),
            "tma_loads": ptx.count("cp.async.bulk.tensor")}


if __name__ == "__main__":
    print(json.dumps([_compile(case) for case in json.loads(sys.stdin.read())]))
