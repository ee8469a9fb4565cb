"""Can xFormers' attention run here? Detected once per process, with a repair for one known breakage.

xFormers wheels are built against one PyTorch release. On a newer PyTorch its compiled extension fails
to load, and xFormers then refuses every CUDA operator (its global ``_built_with_cuda`` is False),
even the two forward operators that run entirely on PyTorch's own kernels: flash (``fa2F@…-pt``,
through ``aten::_flash_attention_forward``) and cutlass (``cutlassF-pt``, through
``aten::_efficient_attention_forward``). When those PyTorch kernels pass xFormers' own schema checks
(``is_pt_cutlass_compatible`` and ``ensure_pt_flash_ok`` in ``xformers.ops.fmha.torch_attention_compat``)
the refusal is only the global flag, so we set ``xformers.ops.fmha.common._built_with_cuda`` back to
True; operators that do need the extension stay refused by their own availability checks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class XformersStatus:
    """What ``xformers_status()`` found; ``graphrt info`` prints ``describe()``."""

    #: True when ``memory_efficient_attention_forward`` can run prefill on this machine's CUDA device.
    usable: bool
    #: Why it is unusable (e.g. "no CUDA device"), or how it is usable.
    reason: str
    #: xFormers' version, or None when it does not import.
    version: str | None = None
    #: True when xFormers' compiled extension loaded.
    extension_loaded: bool = False
    #: True when graphrt re-enabled xFormers' PyTorch-backed operators (see the module docstring).
    re_enabled: bool = False
    #: Forward operators that accept a representative prefill input (NAME strings, priority order).
    operators: tuple[str, ...] = ()
    #: The operator xFormers dispatches that representative prefill to, or None.
    prefill_operator: str | None = None

    def describe(self) -> str:
        """One line for ``graphrt info``."""
        if not self.usable:
            return f"xformers {self.version or '-'}: unusable ({self.reason}); prefill falls back to the reference backend on CPU, the Triton prefix-prefill kernel on CUDA"
        ops = ", ".join(self.operators) or "-"
        return (
            f"xformers {self.version}: usable ({self.reason}); prefill dispatches to {self.prefill_operator}"
            f" [accepting: {ops}]"
        )


def _one_line(exc: BaseException) -> str:
    """An exception's message squeezed onto one line (xFormers' load error spans several)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:3]) or type(exc).__name__


def _pytorch_kernels_check(compat) -> tuple[bool, bool, list[str]]:
    """Run xFormers' own schema checks on PyTorch's cutlass and flash kernels: (cutlass ok, flash ok, why not)."""
    why_not = []
    try:
        cutlass_ok = bool(compat.is_pt_cutlass_compatible(force=True))
    except ImportError as exc:
        cutlass_ok = False
        why_not.append(f"cutlass: {_one_line(exc)}")
    try:
        compat.ensure_pt_flash_ok()
        flash_ok = True
    except ImportError as exc:
        flash_ok = False
        why_not.append(f"flash: {_one_line(exc)}")
    return cutlass_ok, flash_ok, why_not


def _representative_inputs(fmha, device: torch.device):
    """Two prompts (200 + 312 tokens), 32 query / 8 KV heads, d=128, bf16, causal: graphrt's prefill layout."""
    kv_heads, per_kv, head_size, lens = 8, 4, 128, [200, 312]
    total = sum(lens)
    query = torch.empty(1, total, kv_heads, per_kv, head_size, dtype=torch.bfloat16, device=device)
    key = torch.empty(1, total, kv_heads, 1, head_size, dtype=torch.bfloat16, device=device)
    key = key.expand(1, total, kv_heads, per_kv, head_size)
    bias = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens(lens, device=device)
    return fmha.common.Inputs(query=query, key=key, value=key, attn_bias=bias, scale=head_size**-0.5)


def _dispatch(fmha, device: torch.device) -> tuple[tuple[str, ...], str | None]:
    """Names of the forward operators that accept the representative input, and the one dispatch picks."""
    inp = _representative_inputs(fmha, device)
    accepting = tuple(
        op.NAME for op in fmha.dispatch._dispatch_fw_priority_list(inp, False) if not op.not_supported_reasons(inp)
    )
    try:
        chosen = fmha.dispatch._dispatch_fw(inp, False).NAME
    except NotImplementedError:
        chosen = None
    return accepting, chosen


@contextlib.contextmanager
def _quiet_xformers():
    """xFormers' import logs a warning of several lines when its compiled extension does not load; the
    status graphrt reports says the same in one line (``-v`` logs it), so its logger is held at errors."""
    xformers_logger = logging.getLogger("xformers")
    level = xformers_logger.level
    xformers_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        xformers_logger.setLevel(level)


def _detect() -> XformersStatus:
    with _quiet_xformers():
        return _detect_quietly()


def _detect_quietly() -> XformersStatus:
    try:
        import xformers
        from xformers import _cpp_lib
    except Exception as exc:  # any import failure means the same thing here: no xFormers
        return XformersStatus(False, f"xformers does not import: {_one_line(exc)}")
    version = getattr(xformers, "__version__", "?")
    load_error = _cpp_lib._cpp_library_load_exception
    extension_loaded = load_error is None and _cpp_lib._build_metadata is not None
    try:
        import xformers.ops.fmha as fmha
        from xformers.ops.fmha import torch_attention_compat
    except Exception as exc:
        return XformersStatus(False, f"xformers.ops.fmha does not import: {_one_line(exc)}", version, extension_loaded)
    if not torch.cuda.is_available():
        return XformersStatus(False, "no CUDA device", version, extension_loaded)
    if torch.version.hip is not None:
        return XformersStatus(False, "ROCm is not supported by graphrt's xFormers path", version, extension_loaded)

    re_enabled = False
    if extension_loaded and fmha.common._built_with_cuda:
        how = "compiled extension loaded"
    else:
        cause = _one_line(load_error) if load_error is not None else "extension built without CUDA"
        cutlass_ok, flash_ok, why_not = _pytorch_kernels_check(torch_attention_compat)
        if not (cutlass_ok or flash_ok):
            return XformersStatus(
                False,
                f"compiled extension unusable ({cause}) and PyTorch's kernels fail xFormers' schema checks: "
                + "; ".join(why_not),
                version,
                extension_loaded,
            )
        fmha.common._built_with_cuda = True
        re_enabled = True
        passed = "/".join(name for name, ok in (("flash", flash_ok), ("cutlass", cutlass_ok)) if ok)
        how = f"compiled extension unusable, PyTorch-backed {passed} operators re-enabled"

    device = torch.device("cuda", torch.cuda.current_device())
    try:
        operators, chosen = _dispatch(fmha, device)
    except (AttributeError, RuntimeError) as exc:  # private dispatch API moved, or the device refused
        return XformersStatus(False, f"{how}, but dispatch failed: {_one_line(exc)}", version, extension_loaded, re_enabled)
    if re_enabled:
        logger.warning(
            "xFormers %s: compiled extension unusable (%s); PyTorch's %s kernels pass xFormers' schema checks, "
            "so its PyTorch-backed operators were re-enabled; prefill dispatches to %s",
            version,
            cause,
            passed,
            chosen,
        )
    if chosen is None:
        return XformersStatus(
            False, f"{how}, but no operator accepts a bf16 causal prefill", version, extension_loaded, re_enabled, operators
        )
    return XformersStatus(True, how, version, extension_loaded, re_enabled, operators, chosen)


@functools.cache
def xformers_status() -> XformersStatus:
    """Detect xFormers' state once per process (re-enabling its PyTorch-backed operators if needed); logged
    once at INFO (``-v``), in place of the warning xFormers' own import prints."""
    status = _detect()
    logger.info("%s", status.describe())
    return status
