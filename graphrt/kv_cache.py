"""Sizing and allocating the paged KV cache (one tensor per layer, shaped by the attention backend)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from graphrt.attention import AttentionBackend
from graphrt.base.errors import ConfigError
from graphrt.models.config import ModelConfig

#: CPU default cap on KV-cache bytes when the config gives neither a block count nor a byte budget.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of ``block_size`` tokens across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.kv_size * element


def num_blocks_for_bytes(budget: int, config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks fit in ``budget`` bytes (the null block included)."""
    blocks = budget // bytes_per_block(config, block_size, dtype)
    if blocks < 2:
        raise ConfigError(
            f"a KV-cache budget of {budget} bytes holds {blocks} blocks of {block_size} tokens; at least 2 are needed"
        )
    return int(blocks)


def default_cpu_num_blocks(
    config: ModelConfig, block_size: int, dtype: torch.dtype, max_num_seqs: int, max_model_len: int
) -> int:
    """Enough blocks for ``max_num_seqs`` full-length sequences, capped at DEFAULT_CPU_KV_CACHE_BYTES."""
    wanted = max_num_seqs * -(-max_model_len // block_size) + 1
    cap = DEFAULT_CPU_KV_CACHE_BYTES // bytes_per_block(config, block_size, dtype)
    return int(max(2, min(wanted, cap)))


def memory_bytes(device: torch.device) -> int:
    """All the memory of ``device``: the GPU's, or the host's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@contextlib.contextmanager
def allocation_named(what: str, num_bytes: int, device: torch.device, where: str, remedy: str) -> Iterator[None]:
    """For the allocation of ``num_bytes`` of ``what`` on ``device``: refuses, on entry, a size that
    ``device``'s memory could never hold (before anything is built for it: the allocation, and the
    bookkeeping sized with it, would fail or exhaust the host), and turns a failed allocation inside
    (out of device memory, or a host allocator's refusal) into a ConfigError. Either names ``what``,
    its size, ``where`` and the option that sets it (``remedy``), instead of the allocator's traceback."""
    total = memory_bytes(device)
    if num_bytes > total:
        raise ConfigError(f"{what} takes {num_bytes / 2**30:.2f} GiB, more than {where} has "
                          f"({total / 2**30:.2f} GiB); {remedy}")
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and "alloc" not in str(exc).lower():
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{what} of {num_bytes / 2**30:.2f} GiB could not be allocated on {where} ({reason}); "
                          f"{remedy}") from None


def allocate_kv_caches(
    config: ModelConfig,
    backend: type[AttentionBackend],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One cache per layer. Fresh caches are zeroed so that stale data can never look valid."""
    shape = backend.get_kv_cache_shape(num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
