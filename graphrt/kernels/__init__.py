"""Fused Triton kernels for a decoder layer's small elementwise work, each beside its unfused torch reference.

At decode batch sizes a separate kernel costs more in launch latency than its work, even inside a CUDA
graph, so the layer's norms, residual adds and activation run as one kernel each instead of five to
eight (profiles/notes_fusion.md has the measurements). At batch 1, ``gemv`` goes further: the linear
layers themselves run as matrix-vector kernels with the norm, SiLU * up and residual add fused in;
``gemv_rows`` does the same for a few rows at once on tensor cores (off until measured on the GPU).
``fp8_matmul``'s rows kernel multiplies 2-64 tokens with the weight rows on the tensor cores' wide side:
FP8 weights, and 16-bit ones in place of cuBLAS for 2-16 tokens (``rows_matmul``), SiLU * up optionally
in its epilogue.
The rotary embedding fused with the KV-cache write lives with the cache kernels, in
``graphrt.attention.triton_rope_cache_write``; the fused samplers live in ``graphrt.sampling``.

Each fused kernel rounds to the model dtype exactly where the unfused torch code does (every torch
op on bf16 tensors computes in float32 and rounds its result), so in bf16 the two paths agree bit for
bit except where a float32 reduction sums in another order (the norm: its last bit; the GEMV's
products, as any two GEMM libraries differ). In float32 the GPU
may contract a product and a sum into one FMA; in float16 Triton may fold a rounding round trip. The
fused samplers in ``graphrt.sampling`` draw from the same noise as ``graphrt.sampling.sampler`` and differ
from it only at float32 near-ties: the temperature race in ``graphrt.sampling.fused``, and top-k / top-p
in ``graphrt.sampling.top_k_top_p``, which finds each row's kept set by a threshold search instead of
sorting the vocabulary.

Modules import Triton at import time; import them only where Triton can run (CUDA, or the CPU
interpreter under ``TRITON_INTERPRET=1``).
"""
