"""Tensor parallelism inside the model: which part of every weight a rank holds, and the collectives
that join the parts (Megatron-style).

A rank holds a slice of the attention heads (q/k/v rows of its heads, the o projection's columns for
them), of the MLP (gate/up rows, down columns) and of the vocabulary (embedding and LM head rows). The
o and down projections give partial sums, added over the ranks by an all-reduce; the embedding looks
up the rows a rank holds (zeros elsewhere) and all-reduces; the LM head's float32 logits are gathered,
so every rank holds the whole [N, V] logits and samples the same tokens from them. KV heads are split
across ranks, or replicated when there are fewer KV heads than ranks (each rank keeps the one its query
heads read).

The collectives are ``torch.distributed`` ones over the process group the engine sets up (NCCL on
CUDA, which CUDA graphs capture; gloo on the CPU). One rank (``TensorParallel.size == 1``) runs none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from graphrt.base.errors import ConfigError, ModelLoadError

from .config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among ``size`` ranks that each hold a slice of one model, and the process
    group their collectives run over (None for one rank)."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum ``partial`` over the ranks, in place; returns it (as is for one rank)."""
        if self.enabled:
            import torch.distributed as dist

            dist.all_reduce(partial, group=self.group)
        return partial

    def gather_columns(self, local: torch.Tensor, columns: int) -> torch.Tensor:
        """local: [N, C] on every rank -> [N, columns], the ranks' blocks side by side in rank order,
        cut to ``columns`` (the last rank's padding dropped)."""
        if not self.enabled:
            return local[:, :columns]
        import torch.distributed as dist

        rows = local.shape[0]
        gathered = torch.empty((self.size * rows, local.shape[1]), dtype=local.dtype, device=local.device)
        # all_gather_into_tensor was renamed all_gather_single (torch 2.13); both take the ranks' rows stacked.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, local.contiguous(), group=self.group)
        return gathered.view(self.size, rows, -1).permute(1, 0, 2).reshape(rows, -1)[:, :columns]


def check_divides(config: ModelConfig, size: int) -> None:
    """Raise ConfigError unless ``size`` ranks can split ``config``: the query heads and the MLP's
    intermediate size divide by it, and the KV heads divide by it or it by them."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    problems = []
    if config.num_attention_heads % size:
        problems.append(f"num_attention_heads ({config.num_attention_heads})")
    if config.intermediate_size % size:
        problems.append(f"intermediate_size ({config.intermediate_size})")
    kv = config.num_key_value_heads
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads ({kv}, neither a multiple nor a divisor of it)")
    if problems:
        raise ConfigError(f"tensor_parallel_size {size} does not divide {config.architecture}'s "
                          f"{', '.join(problems)}; choose a size that divides the heads and the MLP")


@dataclass(frozen=True)
class ShardLayout:
    """Which rows and columns of the full model's weights one rank holds.

    ``config``: the rank's own model (its heads, KV heads and intermediate size; the vocabulary and
    hidden size are the full model's). Row ranges are [start, stop) in the checkpoint's tensors.
    """

    full: ModelConfig
    config: ModelConfig
    rank: int
    size: int

    @classmethod
    def of(cls, full: ModelConfig, rank: int, size: int) -> ShardLayout:
        check_divides(full, size)
        kv_heads = max(1, full.num_key_value_heads // size)
        local = dataclasses.replace(full, num_attention_heads=full.num_attention_heads // size,
                                    num_key_value_heads=kv_heads, intermediate_size=full.intermediate_size // size)
        return cls(full, local, rank, size)

    @property
    def vocab_rows(self) -> int:
        """Embedding / LM-head rows each rank holds: the vocabulary split evenly, rounded up (the last
        rank's rows past the vocabulary are zeros)."""
        return -(-self.full.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def _kv_head_start(self) -> int:
        heads = self.full.num_key_value_heads
        if heads >= self.size:
            return self.rank * self.config.num_key_value_heads
        return self.rank // (self.size // heads)  # replicated: the KV head this rank's query heads read

    def _row_range(self, target: str, shard: int | None) -> tuple[int, int] | None:
        """The checkpoint rows of ``target`` (shard ``shard`` of a fused one) this rank holds; None when
        the rows are not split."""
        local, dim = self.config, self.full.head_dim
        if "qkv_proj" in target:
            if shard == 0:
                return self.rank * local.q_size, (self.rank + 1) * local.q_size
            start = self._kv_head_start() * dim
            return start, start + local.kv_size
        if "gate_up_proj" in target:
            return self.rank * local.intermediate_size, (self.rank + 1) * local.intermediate_size
        if target.startswith(("embed_tokens.", "lm_head.")):
            return self.vocab_start, self.vocab_start + self.vocab_rows
        return None

    def _column_range(self, target: str) -> tuple[int, int] | None:
        local = self.config
        if "o_proj" in target:
            return self.rank * local.q_size, (self.rank + 1) * local.q_size
        if "down_proj" in target:
            return self.rank * local.intermediate_size, (self.rank + 1) * local.intermediate_size
        return None

    def splits_columns(self, name: str) -> bool:
        """Whether a rank holds some of the columns of parameter ``name`` (the o and down projections),
        whose products are partial sums."""
        return self._column_range(name) is not None

    def full_shape(self, name: str, local_shape: torch.Size) -> tuple[int, ...]:
        """The full model's shape of parameter ``name`` (graphrt's naming: q/k/v and gate/up fused), given
        this rank's."""
        full, shape = self.full, list(local_shape)
        if "qkv_proj" in name:
            shape[0] = full.q_size + 2 * full.kv_size
        elif "gate_up_proj" in name:
            shape[0] = 2 * full.intermediate_size
        elif name.startswith(("embed_tokens.", "lm_head.")):
            shape[0] = full.vocab_size
        elif len(shape) == 2 and "o_proj" in name:
            shape[1] = full.q_size
        elif len(shape) == 2 and "down_proj" in name:
            shape[1] = full.intermediate_size
        return tuple(shape)

    def local_of_parameter(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full model's parameter ``name`` (graphrt's naming: a fused q/k/v or
        gate/up tensor is cut shard by shard)."""
        full = self.full
        if "qkv_proj" in name:
            parts = tensor.split([full.q_size, full.kv_size, full.kv_size])
        elif "gate_up_proj" in name:
            parts = tensor.split([full.intermediate_size] * 2)
        else:
            return self.local_part(name, None, tensor, name)
        return torch.cat([self.local_part(name, shard, part, name) for shard, part in enumerate(parts)])

    def local_part(self, target: str, shard: int | None, tensor: torch.Tensor, name: str,
                   scale_block: tuple[int, int] | None = None) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (our parameter ``target``, fused shard
        ``shard``): a weight or bias cut to the rank's rows or columns, vocabulary rows padded with zeros;
        an FP8 weight scale cut alike (one a tensor: kept; one a row: cut with the rows; one a block of
        ``scale_block``: cut along block boundaries, which the split must fall on). Tensors not split
        (norms, KV scales) come back as they are."""
        leaf = target.rpartition(".")[2]
        is_scale = leaf in ("weight_scale", "weight_scale_inv")
        if is_scale and tensor.numel() == 1:
            return tensor
        rows, columns = self._row_range(target, shard), self._column_range(target)
        if not is_scale:
            self._check_full_shape(target, shard, tensor, name, rows is not None, columns is not None)
        if rows is not None:
            if is_scale:
                return self._scale_part(tensor, rows, 0, scale_block, name)
            part = tensor[rows[0]:rows[1]]
            missing = rows[1] - rows[0] - part.shape[0]
            if missing > 0:  # the last vocabulary rows: padding
                part = torch.cat([part, part.new_zeros((missing, *part.shape[1:]))])
            return part
        if columns is not None and tensor.dim() == 2:
            if is_scale:
                if scale_block is None:
                    return tensor  # one scale a row (output channel): every rank's rows are all of them
                return self._scale_part(tensor, columns, 1, scale_block, name)
            return tensor[:, columns[0]:columns[1]]
        return tensor

    def _check_full_shape(self, target: str, shard: int | None, tensor: torch.Tensor, name: str, split_rows: bool,
                          split_columns: bool) -> None:
        """A checkpoint tensor about to be cut must have the full model's extent along the cut: a slice of
        a wrongly shaped tensor could otherwise pass the shape check of the rank's part."""
        full = self.full
        if split_rows:
            if "qkv_proj" in target:
                expected = full.q_size if shard == 0 else full.kv_size
            elif "gate_up_proj" in target:
                expected = full.intermediate_size
            else:
                expected = full.vocab_size
            actual = tensor.shape[0] if tensor.dim() else None
        elif split_columns and tensor.dim() == 2:
            expected = full.q_size if "o_proj" in target else full.intermediate_size
            actual = tensor.shape[1]
        else:
            return
        if actual != expected:
            raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}: the split for "
                                 f"tensor parallelism expects {expected} {'rows' if split_rows else 'columns'}")

    @staticmethod
    def _scale_part(scale: torch.Tensor, span: tuple[int, int], dim: int, block: tuple[int, int] | None,
                    name: str) -> torch.Tensor:
        if block is None:  # one a row
            return scale[span[0]:span[1]]
        size = block[dim]
        if span[0] % size or span[1] % size:
            raise ModelLoadError(f"checkpoint tensor {name!r}: its scale blocks of {size} do not fall on the "
                                 f"tensor-parallel split at {span[0]}..{span[1]}; use a tensor_parallel_size "
                                 "whose slices are whole blocks")
        return scale.narrow(dim, span[0] // size, (span[1] - span[0]) // size)
