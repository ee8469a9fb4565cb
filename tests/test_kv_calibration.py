"""KV-cache scales calibrated over the first prefill (EngineConfig.calibrate_kv_scales), CPU float32.

The reference for the maxima is an engine with a 16-bit-free float32 cache whose QKV projections are
watched by forward hooks during the same prompt's prefill (its keys rotated by the model's rotary),
so the calibrated scales are checked against values computed apart from the calibration code. A
model whose values are ~1000x too large for a scale of 1 (fp8 saturates at 448) shows the cache
holding them only when calibrated."""

from __future__ import annotations

import pytest
import torch

from graphrt.base.errors import ConfigError
from graphrt.cli import build_parser
from graphrt.config import EngineConfig
from graphrt.engine import LLMEngine
from graphrt.models.fp8 import FP8_MAX
from graphrt.models.llama import KV_SCALE_HEADROOM
from graphrt.sampling.params import SamplingParams

PROMPT = [5, 17, 3, 99, 42, 7, 250, 11, 64, 8, 31, 2, 77, 19, 140, 6, 23]  # 17 tokens: past one 16-token block
#: How much larger the value rows of the QKV weight are made (the O projection shrinks as much).
VALUE_GAIN = 1000.0


def _engine(kv_cache_dtype: str = "fp8", device: str = "cpu", **options) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model="random:tiny", dtype="float32", device=device, kv_cache_dtype=kv_cache_dtype,
                                    num_kv_blocks=16, **options), progress=False)
    with torch.no_grad():  # values far beyond a scale of 1's 448, the layers' outputs as before
        for layer in engine.model.layers:
            attention = layer.self_attn
            attention.qkv_proj.weight[attention.q_size + attention.kv_size:] *= VALUE_GAIN
            attention.o_proj.weight /= VALUE_GAIN
    return engine


def _first_prefill(engine: LLMEngine) -> int:
    """Runs one step (the prompt's prefill); returns the request's sequence id."""
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=4))
    engine.step()
    return engine._requests[request].seq_id


def _reference_maxima() -> list[tuple[float, float, torch.Tensor, torch.Tensor]]:
    """Per layer: max |k| (rotated), max |v| and the k, v of the prompt's prefill, [T, KVH * D] each,
    from a float32-cache engine's projections."""
    engine = _engine(kv_cache_dtype="auto")
    captured = []
    hooks = [layer.self_attn.qkv_proj.register_forward_hook(lambda _m, _i, out: captured.append(out.clone()))
             for layer in engine.model.layers]
    _first_prefill(engine)
    for hook in hooks:
        hook.remove()
    positions = torch.arange(len(PROMPT))
    maxima = []
    for layer, qkv in zip(engine.model.layers, captured[:len(engine.model.layers)]):
        attention = layer.self_attn
        q, k, v = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
        _, k = engine.model.rotary(positions, q.clone(), k.clone())
        maxima.append((k.abs().max().item(), v.abs().max().item(), k, v))
    engine.close()
    return maxima


def _cached(engine: LLMEngine, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's cached k and v of one layer as stored, dequantised: [T, KVH * D] float32 each."""
    attention = engine.model.layers[layer].self_attn
    cache = engine.runner.kv_caches[layer]
    slots = torch.tensor(engine.block_manager.slots(seq_id, 0, len(PROMPT)))
    keys, values = (cache[kind].view(-1, attention.kv_size)[slots].float() for kind in (0, 1))
    return keys * attention.k_scale, values * attention.v_scale


def _within_e4m3(stored: torch.Tensor, exact: torch.Tensor, scale: float) -> bool:
    """Half an E4M3 step: 2**-4 relative, or half the subnormal spacing (2**-10 of the scale)."""
    return bool(((stored - exact).abs() <= 2**-4 * exact.abs() + scale * 2**-10).all())


def test_calibrated_scales_map_the_first_prefills_largest_key_and_value_onto_a_quarter_of_448():
    reference = _reference_maxima()
    engine = _engine(calibrate_kv_scales=True)
    assert engine.runner.kv_scales_pending  # until the first prefill
    seq_id = _first_prefill(engine)
    assert not engine.runner.kv_scales_pending
    assert KV_SCALE_HEADROOM == 4.0
    for index, (k_max, v_max, k, v) in enumerate(reference):
        attention = engine.model.layers[index].self_attn
        assert attention.k_scale == pytest.approx(4 * k_max / FP8_MAX, rel=1e-6)
        assert attention.v_scale == pytest.approx(4 * v_max / FP8_MAX, rel=1e-6)
        assert attention.kv_amax is None  # recording ended
        # The prefill that followed stored the prompt with the new scales: every value within rounding.
        keys, values = _cached(engine, seq_id, index)
        assert _within_e4m3(keys, k, attention.k_scale) and _within_e4m3(values, v, attention.v_scale)
    engine.close()


def test_without_calibration_the_large_values_saturate():
    """The same model at a scale of 1: the cache cannot hold the values (so the test above can fail)."""
    reference = _reference_maxima()
    engine = _engine()
    seq_id = _first_prefill(engine)
    _, values = _cached(engine, seq_id, 0)
    assert engine.model.layers[0].self_attn.v_scale == 1.0
    assert reference[0][1] > 2 * FP8_MAX and values.abs().max() == FP8_MAX
    assert not _within_e4m3(values, reference[0][3], 1.0)
    engine.close()


def _greedy(**options) -> tuple[list[int], list[float], int]:
    """12 greedy tokens after PROMPT, their logprobs, and the decode graphs captured, from a fresh
    ``_engine(**options)``."""
    engine = _engine(**options)
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=12, logprobs=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request and out.finished:
                tokens, logprobs = out.token_ids, [entry.logprob for entry in out.logprobs]
    graphs = engine.decode_runner.stats.num_graphs
    engine.close()
    return tokens, logprobs, graphs


def test_calibrated_decoding_follows_the_float32_cache():
    """Greedy tokens with the calibrated fp8 cache equal a float32 cache's for 12 steps; at scale 1
    the saturated values change the decode's attention outputs."""
    greedy = _greedy

    exact_tokens, exact_logprobs, _ = greedy(kv_cache_dtype="auto")
    calibrated_tokens, calibrated_logprobs, _ = greedy(calibrate_kv_scales=True)
    _, saturated_logprobs, _ = greedy()
    assert calibrated_tokens == exact_tokens
    calibrated_error = max(abs(a - b) for a, b in zip(calibrated_logprobs, exact_logprobs))
    saturated_error = max(abs(a - b) for a, b in zip(saturated_logprobs, exact_logprobs))
    assert calibrated_error < saturated_error


def test_the_decode_graphs_are_captured_once_after_the_scales_are_set(monkeypatch):
    """Graphs bake the scales in: the engine does not capture at start-up, the first prefill captures
    once the scales are set and recording has ended, and later prefills do not capture again."""
    engine = _engine(calibrate_kv_scales=True)
    seen = []
    monkeypatch.setattr(engine.decode_runner, "capture", lambda progress=True: seen.append(
        [(layer.self_attn.k_scale, layer.self_attn.v_scale, layer.self_attn.kv_amax) for layer in engine.model.layers]))
    _first_prefill(engine)
    scales = [(layer.self_attn.k_scale, layer.self_attn.v_scale, None) for layer in engine.model.layers]
    assert seen == [scales] and all(k != 1.0 and v != 1.0 for k, v, _ in scales)
    _first_prefill(engine)  # a second request's prefill
    assert len(seen) == 1
    engine.close()


def test_a_stored_key_scale_is_kept_and_the_missing_value_scale_calibrated():
    engine = _engine(calibrate_kv_scales=True)  # built before any prefill: mark layer 0's k as from a checkpoint
    stored = engine.model.layers[0].self_attn
    stored.k_scale, stored.k_scale_stored = 0.5, True
    _first_prefill(engine)
    assert stored.k_scale == 0.5 and stored.v_scale > 1.0  # the gained values need a large scale
    assert all(layer.self_attn.k_scale != 1.0 for layer in engine.model.layers[1:])
    engine.close()


def test_a_maximum_that_is_not_finite_keeps_scale_one(caplog):
    engine = _engine(calibrate_kv_scales=True)
    with torch.no_grad():  # layer 1's value rows overflow float32
        attention = engine.model.layers[1].self_attn
        attention.qkv_proj.weight[attention.q_size + attention.kv_size:] = float("inf")
    with caplog.at_level("WARNING", logger="graphrt.models.llama"):
        _first_prefill(engine)
    assert attention.v_scale == 1.0 and attention.k_scale != 1.0
    assert "layer 1: the calibration prefill's largest |v| is" in caplog.text
    engine.close()


def test_calibration_needs_an_fp8_cache_and_a_boolean():
    with pytest.raises(ConfigError, match="calibrate_kv_scales \\(--calibrate-kv-scales\\) needs kv_cache_dtype='fp8'"):
        EngineConfig(calibrate_kv_scales=True)
    with pytest.raises(ConfigError, match="calibrate_kv_scales must be True or False"):
        EngineConfig(kv_cache_dtype="fp8", calibrate_kv_scales="yes")
    args = build_parser().parse_args(["generate", "--kv-cache-dtype", "fp8", "--calibrate-kv-scales"])
    assert args.calibrate_kv_scales and not build_parser().parse_args(["generate"]).calibrate_kv_scales


@pytest.mark.parametrize("prompt_length", [1, 5])
def test_calibration_through_the_fused_kernels_and_the_gemv_layers(prompt_length):
    """Fused kernels (the CPU interpreter): a one-token first prefill runs the GEMV layers, whose QKV
    kernel reads the residual stream and normalises it itself; calibration normalises it the same way.
    The scales equal those of the unfused reference path on the same prompt."""
    def scales(**options):
        engine = _engine(**options, calibrate_kv_scales=True)
        engine.add_request(PROMPT[:prompt_length], SamplingParams(max_tokens=1))
        engine.step()
        found = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in engine.model.layers]
        engine.close()
        return found

    fused = scales(fused_kernels=True)
    for (k_fused, v_fused), (k_plain, v_plain) in zip(fused, scales(fused_kernels=False)):
        assert k_fused == pytest.approx(k_plain, rel=1e-5) and v_fused == pytest.approx(v_plain, rel=1e-5)


FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA GPU of compute capability 8.9+ (FP8)")
def test_graphs_captured_after_calibration_give_the_eager_tokens():
    """On the GPU the decode graphs are captured after the first prefill: replaying them (fused
    kernels, calibrated scales baked in) gives the eager decode's tokens and logprobs, and both stay
    near the float32 cache's where a scale of 1 does not."""
    graph_tokens, graph_logprobs, graphs = _greedy(device="cuda", calibrate_kv_scales=True)
    eager_tokens, eager_logprobs, no_graphs = _greedy(device="cuda", calibrate_kv_scales=True, enforce_eager=True)
    exact_tokens, exact_logprobs, _ = _greedy(device="cuda", kv_cache_dtype="auto")
    _, saturated_logprobs, _ = _greedy(device="cuda")
    assert graphs > 0 and no_graphs == 0
    assert graph_tokens == eager_tokens == exact_tokens
    assert max(abs(a - b) for a, b in zip(graph_logprobs, eager_logprobs)) < 1e-4
    calibrated_error = max(abs(a - b) for a, b in zip(graph_logprobs, exact_logprobs))
    assert calibrated_error < max(abs(a - b) for a, b in zip(saturated_logprobs, exact_logprobs))
