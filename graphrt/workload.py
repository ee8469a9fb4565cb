"""A steady decode workload: an engine sized for B sequences of a given context, with those sequences
already in its paged cache, and the ``DecodeBatch`` that decodes their next token.

Shared by ``graphrt bench``, ``graphrt profile`` and the scenario scripts in ``profiles/``. The
cache holds random K/V (nothing is prefilled), so a step costs what a real decode at that context
costs without paying for the prompts first. Every call of ``decode_runner.decode(batch)`` decodes the
same position again (it rewrites the same cache slot), so steps stay identical however many run.
"""

from __future__ import annotations

import torch

from graphrt.base.errors import ConfigError
from graphrt.capture import DecodeBatch
from graphrt.config import EngineConfig
from graphrt.engine import LLMEngine
from graphrt.sampling.params import SamplingParams

BLOCK_SIZE = 16


def decode_engine(
    model: str,
    device: str,
    dtype: str,
    batch_size: int,
    context: int,
    enforce_eager: bool,
    query_tokens: int = 1,
    **options,
) -> LLMEngine:
    """An engine for exactly ``batch_size`` sequences of up to ``context`` + ``query_tokens`` tokens
    decoding ``query_tokens`` rows each a step: KV blocks for them plus the null block, one capture
    bucket (``batch_size`` x ``query_tokens`` rows), no memory profiling.
    ``options`` are further ``EngineConfig`` fields (e.g. ``nvtx=True``)."""
    if options.get("tensor_parallel_size", 1) != 1:
        raise ConfigError("bench and profile drive one engine's decode graphs directly, on one rank; "
                          "tensor_parallel_size > 1 runs through the engine (generate, chat, serve, bench-serving, "
                          "and bench --tensor-parallel-size, which times engine steps)")
    rows = batch_size * query_tokens
    blocks = batch_size * -(-(context + query_tokens) // BLOCK_SIZE) + 1
    config = EngineConfig(
        model=model, device=device, dtype=dtype, max_num_seqs=rows, max_model_len=context + query_tokens,
        block_size=BLOCK_SIZE, num_kv_blocks=blocks, enforce_eager=enforce_eager, capture_sizes=[rows],
        **options,
    )
    try:
        return LLMEngine(config, progress=False)
    except ConfigError as exc:
        if "max_position_embeddings" not in str(exc):
            raise
        raise ConfigError(f"a context of {context} tokens leaves no position for the {query_tokens} decoded "
                          f"token(s) ({exc}): lower --context / --contexts") from None


def fill_decode_batch(engine: LLMEngine, batch_size: int, context: int,
                      params: SamplingParams | None = None, query_tokens: int = 1) -> DecodeBatch:
    """B sequences (ids 0..B-1) of ``context`` tokens each, their blocks filled with random K/V; returns
    the batch that decodes token ``context`` of each (position ``context`` - 1), every row sampled with
    ``params`` (default greedy; sequence i seeded with i). With ``query_tokens`` q > 1 each sequence
    has q consecutive rows, positions ``context`` - 1 .. ``context`` + q - 2 on its one block table, as
    a verify step decodes a newest token and q - 1 draft tokens (rows ordered by sequence)."""
    bm = engine.block_manager
    for sid in range(batch_size):
        bm.allocate(sid, context + query_tokens - 1)
    for kv in engine.runner.kv_caches:
        if kv.dtype == torch.float8_e4m3fn:  # no random kernel writes fp8: draw in bf16 and convert
            kv.copy_(torch.randn(kv.shape, dtype=torch.bfloat16, device=kv.device))
        else:
            kv.normal_()
    vocab = engine.model_config.vocab_size
    rows = [(sid, context - 1 + j) for sid in range(batch_size) for j in range(query_tokens)]
    return DecodeBatch(
        input_ids=[(7 * sid + 3 + 11 * (position - context + 1)) % vocab for sid, position in rows],
        positions=[position for _, position in rows],
        block_tables=[bm.block_table(sid) for sid, _ in rows],
        slot_mapping=[bm.slot(sid, position) for sid, position in rows],
        params=[params or SamplingParams(temperature=0.0)] * len(rows),
        seeds=[sid for sid, _ in rows],
        block_table_versions=[bm.table_version(sid) for sid, _ in rows],
        steps=[position - context + 1 for _, position in rows],
    )


def decode_workload(
    model: str, device: str, dtype: str, batch_size: int, context: int, enforce_eager: bool, **options,
) -> tuple[LLMEngine, DecodeBatch]:
    """``decode_engine`` and its ``fill_decode_batch``, in one call."""
    engine = decode_engine(model, device, dtype, batch_size, context, enforce_eager, **options)
    return engine, fill_decode_batch(engine, batch_size, context)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
