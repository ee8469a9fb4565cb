"""Reading an HF checkpoint's ``quantization_config`` as an FP8 weight format (``Fp8CheckpointFormat``).

Two families store FP8 E4M3 linear weights, each with float scales that multiply (``W = Q * scale``):

* ``quant_method: "fp8"``: transformers' fine-grained FP8 (``weight_scale_inv`` per block of
  ``weight_block_size``, 128 x 128 when the key is absent; one scale a tensor when it is null) and
  per-tensor tools (``weight_scale`` of one element, no block size in the config). The config alone
  cannot tell the last two apart, so the scale tensors' names decide: ``weight_scale`` alone means no
  blocks.
* ``quant_method: "compressed-tensors"`` with float8 weights (``num_bits: 8``, ``type: "float"``,
  symmetric) of strategy ``tensor``, ``channel``, ``block`` (``block_structure``) or ``group``
  (``group_size`` columns: blocks of one row).

Activation scales the checkpoints carry (``input_scale``) are not used: graphrt quantises activations
per token as it runs (``graphrt.kernels.fp8_matmul``) or not at all (W8A16 GEMV, dequantising path).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from graphrt.base.errors import ModelLoadError
from graphrt.models.fp8 import Fp8CheckpointFormat

#: transformers' block size for ``quant_method: "fp8"`` configs without ``weight_block_size``.
DEFAULT_FP8_BLOCK = (128, 128)

#: compressed-tensors formats whose weights are stored as FP8 codes.
_COMPRESSED_TENSORS_FORMATS = ("float-quantized", "naive-quantized")


def fp8_checkpoint_format(quantization_config: Any, tensor_names: Iterable[str],
                          where: str = "config.json") -> Fp8CheckpointFormat:
    """The FP8 format a ``quantization_config`` (config.json's object) describes; ``tensor_names``: the
    checkpoint's tensor names (they decide between block and per-tensor scales where the config does
    not). Raises ModelLoadError naming the field for any other method or an FP8 variant graphrt cannot
    run (integer or 4-bit weights, zero points, dynamic weight scales)."""
    if not isinstance(quantization_config, dict):
        raise ModelLoadError(f"{where}: quantization_config must be a JSON object, got {quantization_config!r}")
    method = quantization_config.get("quant_method")
    if method == "fp8":
        return _fine_grained_fp8(quantization_config, set(tensor_names), where)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization_config, where)
    raise ModelLoadError(f"{where}: quantization method {method!r} is not supported; graphrt loads FP8 checkpoints "
                         "(quant_method 'fp8' or 'compressed-tensors' with float8 weights) and 16-bit ones")


def _block(value: Any, field: str, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ModelLoadError(f"{where}: {field} must be two positive integers [rows, columns], got {value!r}")
    return int(value[0]), int(value[1])


def _ignored(value: Any, field: str, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelLoadError(f"{where}: {field} must be a list of module names, got {value!r}")
    return tuple(value)


def _fine_grained_fp8(config: dict, names: set[str], where: str) -> Fp8CheckpointFormat:
    ignored = _ignored(config.get("modules_to_not_convert", config.get("ignored_layers")),
                       "modules_to_not_convert", where)
    block_scaled = any(name.endswith(".weight_scale_inv") for name in names)
    if "weight_block_size" in config:
        block = config["weight_block_size"]
        block = None if block is None else _block(block, "weight_block_size", where)
    else:
        block = DEFAULT_FP8_BLOCK if block_scaled else None
    return Fp8CheckpointFormat(method="fp8", weight_block=block, ignored=ignored)


def _compressed_tensors(config: dict, where: str) -> Fp8CheckpointFormat:
    form = config.get("format")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{where}: a compressed-tensors config needs config_groups (got {groups!r})")
    blocks = set()
    for group_name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ModelLoadError(f"{where}: config_groups.{group_name} has no weights scheme")
        label = f"{where}: config_groups.{group_name}.weights"
        group_format = group.get("format", form)
        if group_format not in _COMPRESSED_TENSORS_FORMATS:
            raise ModelLoadError(f"{where}: compressed-tensors format {group_format!r} is not supported; graphrt "
                                 f"reads {', '.join(_COMPRESSED_TENSORS_FORMATS)} (float8 weights)")
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ModelLoadError(f"{label}: only 8-bit float (FP8 E4M3) weights are supported, got "
                                 f"num_bits={weights.get('num_bits')!r}, type={weights.get('type')!r}")
        if weights.get("symmetric", True) is not True:
            raise ModelLoadError(f"{label}: asymmetric weights (zero points) are not supported")
        if weights.get("dynamic", False):
            raise ModelLoadError(f"{label}: dynamic weight scales are not supported (a checkpoint stores them)")
        strategy = weights.get("strategy")
        if strategy in ("tensor", "channel"):
            blocks.add(None)
        elif strategy == "block":
            blocks.add(_block(weights.get("block_structure"), "block_structure", label))
        elif strategy == "group":
            size = weights.get("group_size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ModelLoadError(f"{label}: group_size must be a positive integer, got {size!r}")
            blocks.add((1, size))
        else:
            raise ModelLoadError(f"{label}: weight strategy {strategy!r} is not supported; graphrt reads tensor, "
                                 "channel, block and group")
    if len(blocks) > 1:
        raise ModelLoadError(f"{where}: config groups with different weight scale layouts ({sorted(map(str, blocks))}) "
                             "are not supported")
    return Fp8CheckpointFormat(method="compressed-tensors", weight_block=blocks.pop(),
                               ignored=_ignored(config.get("ignore"), "ignore", where))
