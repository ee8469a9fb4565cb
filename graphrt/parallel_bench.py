"""``graphrt bench --tensor-parallel-size N``: steady decode steps of an engine split over N ranks,
against the floor of one rank's bytes.

``bench`` drives one engine's decode graphs directly; over several ranks every forward has to be
relayed to the others, so this measures the engine itself: B requests of ``context`` prompt tokens
are prefilled, then the engine steps them (pipelined on CUDA, as it serves) and the median wall time of
a step is the point's figure. The floor is what one rank reads a step (its weights, its KV heads' cache)
over the HBM read bandwidth measured in the same run. On CUDA, a profile of a few steps on rank 0 gives
the collectives' share of the GPU's time (NCCL kernels, which include waiting for the other ranks).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from graphrt.base.errors import ConfigError
from graphrt.bench import format_optional, kv_bytes_read, measure_read_bandwidth, weight_bytes_read
from graphrt.config import EngineConfig, resolve_device, resolve_dtype
from graphrt.engine import LLMEngine
from graphrt.sampling.params import SamplingParams
from graphrt.workload import BLOCK_SIZE

#: Steps run before timing (prefill done, graphs warm, pipelining settled).
_WARMUP_STEPS = 5
#: Steps recorded by the profiler for the collectives' share.
_PROFILED_STEPS = 5


@dataclass
class ParallelBenchRow:
    batch_size: int
    context: int
    tensor_parallel_size: int
    step_ms: float  # median wall ms of an engine step decoding the batch
    floor_ms: float | None  # one rank's bytes over the measured read bandwidth
    ratio_to_floor: float | None
    tokens_per_s: float
    collective_share: float | None  # NCCL kernels' share of rank 0's GPU time over profiled steps


def _steady_engine(model: str, device: str, dtype: str, batch_size: int, context: int, steps: int, size: int,
                   options: dict) -> LLMEngine:
    """An engine over ``size`` ranks for ``batch_size`` sequences of ``context`` + every step's tokens."""
    length = context + _WARMUP_STEPS + steps + _PROFILED_STEPS + 2
    config = EngineConfig(model=model, device=device, dtype=dtype, max_num_seqs=batch_size, max_model_len=length,
                          capture_sizes=[batch_size], enable_prefix_caching=False, tensor_parallel_size=size,
                          num_kv_blocks=batch_size * -(-length // BLOCK_SIZE) + 1, block_size=BLOCK_SIZE, **options)
    return LLMEngine(config, progress=False)


def _start_batch(engine: LLMEngine, batch_size: int, context: int, max_tokens: int, seed: int = 0) -> None:
    """B requests of ``context`` random token ids (greedy, never stopping early), stepped until every one
    has its first token (prefilled) and ``_WARMUP_STEPS`` decode steps more."""
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index in range(batch_size):
        ids = torch.randint(3, vocab, (context,), generator=generator).tolist()
        engine.add_request(ids, params, request_id=f"bench-{index}")
    started: set[str] = set()
    while len(started) < batch_size:
        started.update(out.request_id for out in engine.step() if out.token_ids)
    for _ in range(_WARMUP_STEPS):
        engine.step()


def _median_step_ms(engine: LLMEngine, steps: int) -> float:
    samples, last = [], time.perf_counter()
    for _ in range(steps):
        engine.step()
        now = time.perf_counter()
        samples.append((now - last) * 1e3)
        last = now
    return statistics.median(samples)


def _collective_share(engine: LLMEngine) -> float | None:
    """NCCL kernels' share of rank 0's CUDA kernel time over a few steps (None without CUDA kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(_PROFILED_STEPS):
            engine.step()
        torch.cuda.synchronize(engine.device)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    nccl = sum(e.device_time_total for e in events if "nccl" in e.key.lower())
    return nccl / total if total else None


def run_parallel_bench(model: str, device: str, dtype: str, batch_sizes, contexts, steps: int, size: int,
                       **options) -> dict:
    """Every (batch, context) point over ``size`` ranks; a JSON-able dict of rows and set-up. ``options``:
    further ``EngineConfig`` fields (quantization, kv_cache_dtype, kernels)."""
    if steps < 1 or not batch_sizes or not contexts or min(*batch_sizes, *contexts) < 1:
        raise ConfigError(f"bench needs steps >= 1 and at least one batch size and context, each >= 1; got "
                          f"steps={steps}, batch sizes {list(batch_sizes)}, contexts {list(contexts)}")
    dev = resolve_device(device)
    bandwidth = measure_read_bandwidth(dev) if dev.type == "cuda" else None
    rows = []
    for context in contexts:
        for batch_size in batch_sizes:
            engine = _steady_engine(model, device, dtype, batch_size, context, steps, size, options)
            try:
                _start_batch(engine, batch_size, context, _WARMUP_STEPS + steps + _PROFILED_STEPS + 1)
                step_ms = _median_step_ms(engine, steps)
                share = _collective_share(engine) if dev.type == "cuda" else None
                read = weight_bytes_read(engine, batch_size) + kv_bytes_read(engine, batch_size, context)
            finally:
                for index in range(batch_size):  # the requests' remaining tokens are not wanted
                    engine.abort_request(f"bench-{index}")
                while engine.has_unfinished_requests():  # a running request leaves at the next step
                    engine.step()
                engine.close()
            floor = read / bandwidth * 1e3 if bandwidth else None
            row = ParallelBenchRow(
                batch_size=batch_size, context=context, tensor_parallel_size=size, step_ms=round(step_ms, 4),
                floor_ms=None if floor is None else round(floor, 4),
                ratio_to_floor=None if floor is None else round(step_ms / floor, 2),
                tokens_per_s=round(batch_size / step_ms * 1e3, 1),
                collective_share=None if share is None else round(share, 3))
            rows.append(row)
            print(format_parallel_row(row), flush=True)
    return {
        "model": model, "tensor_parallel_size": size,
        "dtype": str(resolve_dtype(dtype, dev)).removeprefix("torch."),
        "quantization": options.get("quantization"), "kv_cache_dtype": options.get("kv_cache_dtype", "auto"),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
        "hbm_read_bandwidth_gbps": None if bandwidth is None else round(bandwidth / 1e9, 1),
        "steps_per_point": steps, "rows": [asdict(r) for r in rows],
    }


PARALLEL_HEADER = (f"{'batch':>5} {'ctx':>6} {'ranks':>5} {'step ms':>9} {'floor ms':>9} {'x floor':>7} "
                   f"{'tok/s':>10} {'NCCL share':>10}")


def format_parallel_row(r: ParallelBenchRow) -> str:
    return (f"{r.batch_size:>5} {r.context:>6} {r.tensor_parallel_size:>5} {r.step_ms:>9.3f} "
            f"{format_optional(r.floor_ms, '>9.3f')} {format_optional(r.ratio_to_floor, '>7.2f')} "
            f"{r.tokens_per_s:>10.1f} {format_optional(r.collective_share, '>10.1%')}")
