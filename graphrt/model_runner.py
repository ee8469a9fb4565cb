"""Turns a scheduled step into tensors once, runs the model, and samples one token per sequence."""

from __future__ import annotations

import torch

from graphrt.attention import AttentionBackend

from .block_manager import BlockManager
from .models.llama import LlamaForCausalLM
from .sampler import SamplingTensors, sample
from .sequence import Sequence


class ModelRunner:
    """Eager execution of mixed prefill/decode steps over the paged KV cache.

    kv_caches: one tensor per layer, shaped by ``backend.get_kv_cache_shape``.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        backend: type[AttentionBackend],
        block_manager: BlockManager,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_manager = block_manager
        self.device = device
        self.block_size = block_manager.block_size

    @torch.inference_mode()
    def execute(self, prefills: list[Sequence], decodes: list[Sequence]) -> list[int]:
        """Run one step; returns the sampled token id of each sequence, prefills first then decodes."""
        seqs = prefills + decodes
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_tokens
            input_ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self.block_manager.slots(seq.seq_id, start, end))
            query_lens.append(end - start)
        metadata = self.backend.make_metadata(
            query_lens=query_lens,
            seq_lens=[seq.num_tokens for seq in seqs],
            num_prefills=len(prefills),
            block_tables=[self.block_manager.block_table(seq.seq_id) for seq in seqs],
            slot_mapping=slots,
            block_size=self.block_size,
            device=self.device,
        )
        hidden = self.model(self._to_device(input_ids), self._to_device(positions), self.kv_caches, metadata)
        last_token_rows = metadata.query_start_loc[1:].long() - 1  # [B]: each sequence's last new token
        logits = self.model.compute_logits(hidden[last_token_rows])  # [B, V] float32
        sampling = SamplingTensors.from_params(
            [seq.params for seq in seqs],
            seeds=[seq.seed for seq in seqs],
            steps=[len(seq.output_token_ids) for seq in seqs],
            device=self.device,
        )
        token_ids = sample(logits, sampling).tolist()  # the step's one device-to-host copy
        for seq in seqs:
            seq.num_computed_tokens = seq.num_tokens
        return token_ids

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, max_seq_len: int) -> int:
        """Peak CUDA bytes of a prefill of ``num_tokens`` tokens (in sequences of at most
        ``max_seq_len``) with no KV cache; sizes the cache on GPU."""
        seq_lens = [min(max_seq_len, num_tokens - start) for start in range(0, num_tokens, max_seq_len)]
        metadata = self.backend.make_metadata(
            query_lens=seq_lens,
            seq_lens=seq_lens,
            num_prefills=len(seq_lens),
            block_tables=[[] for _ in seq_lens],
            slot_mapping=[-1] * num_tokens,
            block_size=self.block_size,
            device=self.device,
        )
        vocab = self.model.config.vocab_size
        input_ids = torch.randint(0, vocab, (num_tokens,), device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in seq_lens])
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden = self.model(input_ids, positions, [None] * len(self.model.layers), metadata)
        self.model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1])
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)
