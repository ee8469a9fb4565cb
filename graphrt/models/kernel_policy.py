"""Which kernels a model runs, decided once when it is built: fused Triton kernels or the unfused torch
reference, matrix-vector (GEMV) layers for one-token forwards or cuBLAS GEMMs, plain or programmatic
dependent launches, and the fused samplers or the sorting one.

The GEMV layers fuse a layer's norms, SiLU * up and residual adds into its four matrix-vector products
(``graphrt.kernels.gemv``). That saves the fixed cost of the separate small kernels, while cuBLAS
streams the largest matrices a little faster, so they pay only up to a layer size; launched as
programmatic dependents, each kernel's start overlaps the previous one's end, which moves that size
up. The sizes are measured, and ``GemvThresholds.measured_on`` says where.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from graphrt.sampling.sampler import SamplingTensors, sample

from .config import ModelConfig
from .fp8 import QUANTIZATIONS


@dataclass(frozen=True)
class GemvThresholds:
    """Where the GEMV layers beat cuBLAS with separate norm and activation kernels."""

    #: Forwards of at most this many tokens may run the GEMV layers (their kernels are built for one
    #: row: decode at batch 1, or a one-token prompt).
    max_tokens: int
    #: Largest decoder layer, in bytes of its four linear weights, run on GEMV kernels launched plainly.
    max_layer_bytes: int
    #: The same bound for kernels launched as programmatic dependents.
    max_dependent_layer_bytes: int
    #: The machine, dtype and workload the bounds were measured on, and the notes that hold the figures.
    measured_on: str
    #: FP8 weights on a GPU with FP8 tensor cores: forwards of one token run the W8A16 kernel (keeping
    #: the GEMV kernels' numerics, activations not quantised, where those do not run: unfused models,
    #: the 8B launched plainly), and so do forwards of up to this many tokens through the weights whose
    #: K the rows kernel splits the most ways (``fp8_matmul.w8a16_is_faster``: there it took 0.63-0.91x
    #: the FP8 tensor-core kernel's time at 2-16 rows of the Llama-3-8B and 1B layers); the rest run FP8
    #: tensor cores with per-token activation scales (profiles/notes_fp8.md).
    w8a16_max_tokens: int = 16
    #: Layers of at most ``small_layer_bytes`` run the GEMV layers for forwards of up to
    #: ``small_layer_max_tokens`` tokens (a verify step's few rows, small batches): each row is a program
    #: of its own, and a small layer's weights, read once from memory, serve the other rows from L2,
    #: where a larger layer's rows each stream their weights again.
    small_layer_bytes: int = 0
    small_layer_max_tokens: int = 1
    #: Forwards of more tokens than the GEMV kernels take, up to this many, run the GEMV layers on the
    #: few-row kernels (``graphrt.kernels.gemv_rows``: each weight read once for every row, on tensor
    #: cores; 16-bit weights). 0: never, the bound until they are timed against cuBLAS on the GPU.
    rows_max_tokens: int = 0
    #: Forwards of 2 to this many tokens through 16-bit decoder layers of at least
    #: ``rows_kernel_min_layer_bytes`` run their linear products on the rows kernel
    #: (``graphrt.kernels.fp8_matmul.rows_matmul``) instead of cuBLAS, which pads so few tokens to its own
    #: tiles; the norms and rotary stay the kernels they are beside cuBLAS, SiLU * up becomes the gate/up
    #: product's epilogue where its tile does not split K (``FewRowsLinear.fuses_silu_mul``).
    rows_kernel_max_tokens: int = 0
    rows_kernel_min_layer_bytes: int = 0
    #: The model dtypes the rows-kernel bound was measured in (float32 products run without tensor cores).
    rows_kernel_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


#: The bounds in use. Plainly launched, the GEMV layers won at SmolLM2-135M's and Llama-3.2-1B's layer
#: sizes and lost at Llama-3-8B's; the bound lies between. As dependents they won at every measured
#: size, so the bound sits just above the largest; larger layers keep cuBLAS until measured.
GEMV_THRESHOLDS = GemvThresholds(
    max_tokens=1,
    # SmolLM2-135M's layers (7 MiB) ran 2 and 4 rows faster on the GEMV layers than on cuBLAS, 8 slower;
    # Llama-3.2-1B's (120 MiB) 4 rows slower. The bound lies between.
    small_layer_bytes=32 << 20,
    small_layer_max_tokens=4,
    max_layer_bytes=256 << 20,
    max_dependent_layer_bytes=512 << 20,
    # The rows kernel made the 1B's and the 8B's decode steps of a few rows faster; smaller layers are
    # unmeasured and keep cuBLAS.
    rows_kernel_max_tokens=16,
    rows_kernel_min_layer_bytes=64 << 20,
    measured_on="NVIDIA H200 (sm_90), bfloat16, one token through one decoder layer, and decode steps of 1-16 "
                "rows (profiles/notes_fusion.md, profiles/notes_speculative.md); the rows-kernel bound on an "
                "NVIDIA H100 (profiles/notes_fusion.md)",
)


def layer_weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one decoder layer's four linear weights (QKV, O, gate/up, down) in ``dtype``."""
    hidden, inter = config.hidden_size, config.intermediate_size
    elements = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden + 3 * hidden * inter
    return elements * torch.empty((), dtype=dtype).element_size()


@functools.cache
def _fused_sampler():
    """``graphrt.sampling.fused.sample_fused``, imported on first use: it imports Triton, which only
    fused models need."""
    from graphrt.sampling.fused import sample_fused

    return sample_fused


@dataclass(frozen=True)
class KernelPolicy:
    """The kernel strategy of one model, fixed at build time (``choose``); layers read it, never decide.

    fused: Triton kernels for the layers' elementwise work (add + RMSNorm, rotary + KV-cache write,
    SiLU * up) and the fused samplers; False = the unfused torch ops and the sorting sampler, kept as
    the reference to compare against. dependent_launch: the fused decode kernels launch as programmatic
    dependents (needs ``fused``, sm_90+). gemv_max_tokens: forwards of at most this many tokens run
    each layer on GEMV kernels (0 = never), and forwards of more, up to gemv_rows_max_tokens (at most
    ``gemv_rows.MAX_ROWS``), on the few-row GEMV kernels (16-bit weights). rows_kernel_max_tokens: the
    other forwards of 2 to this many tokens run 16-bit linear layers on the rows kernel rather than cuBLAS
    (``graphrt.models.layers.FewRowsLinear``; 0 = never). quantization: None, or
    "fp8": the layers' linear weights are FP8 E4M3 codes with float32 scales (``graphrt.models.fp8``), one a row, or with
    ``weight_scale_columns`` one a row and block of that many columns (block-scaled checkpoints). The
    GEMV kernels read FP8 codes with row scales (W8A16); on CUDA the other forwards with row scales run
    FP8 tensor cores with per-token activation scales (``fp8_tensor_cores``: sm_89+), or the W8A16
    tensor-core kernel for one token and up to ``w8a16_max_tokens`` where it is faster
    (``graphrt.models.fp8.Fp8Linear``);
    block scales and the CPU dequantise and run one matmul.
    """

    fused: bool = False
    dependent_launch: bool = False
    gemv_max_tokens: int = 0
    quantization: str | None = None
    weight_scale_columns: int | None = None
    fp8_tensor_cores: bool = False
    w8a16_max_tokens: int = 0
    gemv_rows_max_tokens: int = 0
    rows_kernel_max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.dependent_launch and not self.fused:
            raise ValueError("dependent_launch needs fused_kernels=True (it launches the fused Triton kernels)")
        if self.gemv_max_tokens and not self.fused:
            raise ValueError("GEMV layers need fused_kernels=True")
        if self.gemv_rows_max_tokens and (not self.gemv_max_tokens or self.quantization is not None):
            raise ValueError("the few-row GEMV layers need the GEMV layers and 16-bit weights")
        if self.rows_kernel_max_tokens and (not self.fused or self.quantization is not None):
            raise ValueError("the rows kernel for 16-bit layers needs fused_kernels=True and 16-bit weights")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
        if self.quantization is None and (self.weight_scale_columns is not None or self.fp8_tensor_cores):
            raise ValueError("weight scales and FP8 tensor cores need quantization='fp8'")
        if self.quantization is None and self.w8a16_max_tokens:
            raise ValueError("the W8A16 kernel needs quantization='fp8'")
        if self.weight_scale_columns is not None and (self.gemv_max_tokens or self.fp8_tensor_cores
                                                      or self.w8a16_max_tokens):
            raise ValueError("the GEMV kernels and FP8 tensor cores take one weight scale a row, not block scales")

    @classmethod
    def choose(cls, config: ModelConfig, dtype: torch.dtype, fused: bool, dependent_launch: bool = False,
               thresholds: GemvThresholds | None = None, quantization: str | None = None,
               device: torch.device | None = None) -> KernelPolicy:
        """The policy for a model of ``config`` in ``dtype`` on ``device``: GEMV layers when fused, the
        weights 16-bit or FP8 with row scales, and the layer (in its weights' bytes) within the measured
        bound for the launch mode; FP8 tensor cores for FP8 row scales on a CUDA GPU of compute
        capability 8.9 or later. A checkpoint stored in FP8 (``config.fp8_checkpoint``) needs
        ``quantization="fp8"``. ``thresholds``: default ``GEMV_THRESHOLDS`` as the module holds it at the
        call (an experiment may replace it to time other bounds)."""
        thresholds = thresholds or GEMV_THRESHOLDS
        stored = config.fp8_checkpoint
        if stored is not None and quantization != "fp8":
            raise ValueError(f"the checkpoint's weights are FP8 ({stored.method}); build the model with "
                             "quantization='fp8'")
        scale_columns = stored.scale_columns if stored is not None else None
        row_scales = quantization is None or scale_columns is None
        bound = thresholds.max_dependent_layer_bytes if dependent_launch else thresholds.max_layer_bytes
        weight_dtype = dtype if quantization is None else torch.float8_e4m3fn
        gemv = (fused and row_scales and config.num_hidden_layers > 0
                and layer_weight_bytes(config, weight_dtype) <= bound)
        fp8_on_cuda = quantization is not None and row_scales and device is not None and device.type == "cuda"
        tensor_cores = fp8_on_cuda and torch.cuda.get_device_capability(device) >= (8, 9)
        # Measured with 16-bit weights only; FP8 layers keep their measured few-row kernels.
        small = quantization is None and layer_weight_bytes(config, weight_dtype) <= thresholds.small_layer_bytes
        gemv_tokens = max(thresholds.max_tokens, thresholds.small_layer_max_tokens if small else 0)
        rows_tokens = thresholds.rows_max_tokens if gemv and quantization is None else 0
        rows_kernel = (fused and quantization is None and dtype in thresholds.rows_kernel_dtypes
                       and layer_weight_bytes(config, weight_dtype) >= thresholds.rows_kernel_min_layer_bytes)
        return cls(fused=fused, dependent_launch=dependent_launch,
                   rows_kernel_max_tokens=thresholds.rows_kernel_max_tokens if rows_kernel else 0,
                   gemv_max_tokens=gemv_tokens if gemv else 0, quantization=quantization,
                   gemv_rows_max_tokens=rows_tokens if rows_tokens > gemv_tokens else 0,
                   weight_scale_columns=scale_columns if quantization is not None else None,
                   fp8_tensor_cores=tensor_cores, w8a16_max_tokens=thresholds.w8a16_max_tokens if fp8_on_cuda else 0)

    def runs_gemv(self, num_tokens: int) -> bool:
        """Whether a forward of ``num_tokens`` tokens runs the GEMV layers (``runs_gemv_rows``: on the
        few-row kernels)."""
        return 0 < num_tokens <= max(self.gemv_max_tokens, self.gemv_rows_max_tokens)

    def runs_gemv_rows(self, num_tokens: int) -> bool:
        """Whether a forward of ``num_tokens`` tokens runs the GEMV layers on the few-row kernels."""
        return self.gemv_max_tokens < num_tokens <= self.gemv_rows_max_tokens

    def sample(self, logits: torch.Tensor, sampling: SamplingTensors, out: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of ``logits`` [B, V] float32 -> [B] int64 (into ``out`` when given): the
        fused samplers with fused kernels, else the sorting sampler; both draw from the same noise."""
        if self.fused:
            return _fused_sampler()(logits, sampling, out=out)
        tokens = sample(logits, sampling)
        return tokens if out is None else out.copy_(tokens)
