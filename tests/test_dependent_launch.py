"""Programmatic dependent launch (``graphrt.kernels.dependent_launch``): every kernel launched so
waits for the kernel before it ahead of touching activations, so results keep every bit.

On the CPU: the kernels compile for sm_90 with their grid dependency wait in place (and without it when
launched plainly), and the engine refuses ``dependent_launch=True`` where it cannot run. On a GPU: a
graph of chained kernels that each read what the previous one wrote gives the same bits launched
either way, and engines with and without dependent launches generate the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.base.errors import ConfigError

needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a CUDA device of compute capability 9.0 or later")


# -- the GPU compiler's view, checked without a GPU -----------------------------------------------------


def _case(name, module, kernel, signature, constexprs, num_warps=4):
    # Strides as the 1B's decode passes them: multiples of 16, so a launch specialises them as such.
    strides = [arg for arg in signature if arg.startswith("stride_")]
    return dict(name=name, module=module, kernel=kernel, signature=signature, constexprs=constexprs,
                num_warps=num_warps, num_stages=3, launch_pdl=constexprs["PDL"], aligned_ints=strides)


def _cases(pdl: bool) -> list[dict]:
    """One launch specialisation of each kernel the decode path launches as a dependent (bf16)."""
    from sm90_compile import gemv_case

    from graphrt.kernels.gemv import general_config

    gemv = gemv_case("gemv-norm-silu", "bf16", "norm_silu", general_config(2048, silu_mul=True), pdl)
    gemv_unnormed = gemv_case("gemv-silu", "bf16", "silu", general_config(2048, silu_mul=True), pdl)
    gemv_plain, gemv_add, gemv_bias = (gemv_case(f"gemv-{variant}", "bf16", variant, general_config(2048), pdl)
                                       for variant in ("plain", "add", "bias"))
    rope = _case("rope-cache-write", "graphrt.attention.triton_rope_cache_write", "_rope_cache_write_kernel",
                 {"qkv_ptr": "*bf16", "positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                  "cache_ptr": "*bf16", "slot_ptr": "*i64", "stride_qkv_row": "i32", "stride_table_row": "i32",
                  "stride_cache_kind": "i64", "inv_k_scale": "fp32", "inv_v_scale": "fp32"},
                 dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_SIZE=64, HEADS_BLOCK=32, HALF_BLOCK=32, WRITE_CACHE=True,
                      QUANTIZE=False, PDL=pdl))
    split = _case("decode-split", "graphrt.attention.triton_paged_decode", "_decode_split_kernel",
                  {"q_ptr": "*bf16", "kv_ptr": "*bf16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                   "alibi_ptr": "*bf16", "out_ptr": "*bf16", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
                   "arrivals_ptr": "*i32",
                   **{n: "i32" for n in ("stride_qb", "stride_qh", "stride_kv_token", "stride_bt", "stride_ob",
                                         "stride_oh", "stride_wb", "stride_wh", "stride_arrivals", "window",
                                         "num_splits")},
                   "stride_kv_kind": "i64", "stride_kv_block": "i32", "qk_scale": "fp32", "v_scale": "fp32"},
                  dict(HEAD_SIZE=64, HEAD_PAD=64, GROUP=4, GROUP_PAD=16, BLOCK_SIZE=16, BLOCK_N=64,
                       SINGLE_SPLIT=False, GROUP_MERGE=4, SPLITS_PAD=16, SPLITS_CHUNK=16, USE_ALIBI=False,
                       USE_WINDOW=False, DOT_PRECISION=None, DOT_F32=False, FP8_DOT_F16=False, BLOCK_IDS_AHEAD=False,
                       PDL=pdl, PREFETCH_LINES=0, LINE_ELEMS=64))
    split_fp8 = _case("decode-split-fp8-ids-ahead", "graphrt.attention.triton_paged_decode", "_decode_split_kernel",
                      {**split["signature"], "kv_ptr": "*fp8e4nv"},
                      {**split["constexprs"], "HEAD_SIZE": 128, "HEAD_PAD": 128, "FP8_DOT_F16": True,
                       "BLOCK_IDS_AHEAD": True}, num_warps=2)
    qkv_rope = _case("qkv-rope-cache", "graphrt.attention.triton_rope_cache_write", "_qkv_rope_cache_kernel",
                     {**{arg: "*bf16" for arg in ("x_ptr", "w_ptr", "bias_ptr", "norm_w_ptr", "qkv_ptr", "cache_ptr")},
                      "scale_ptr": "*fp32", "positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64",
                      **{n: "i32" for n in ("stride_x", "stride_w", "stride_qkv_row", "stride_table_row", "K")},
                      "stride_cache_kind": "i64", "eps": "fp32", "inv_k_scale": "fp32", "inv_v_scale": "fp32"},
                     dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_SIZE=64, NORM=True, HAS_BIAS=False, W_SCALED=False,
                          WRITE_CACHE=True,
                          QUANTIZE=False, BLOCK_N=4, BLOCK_K=1024, THREAD_SUM=1, NORM_BLOCK=2048, PDL=pdl))
    # With each program's first K/V tile prefetched into L2 (triton_paged_decode's l2_prefetch).
    split_prefetch = {**split, "name": "decode-split-l2-prefetch",
                      "constexprs": {**split["constexprs"], "PREFETCH_LINES": 1, "LINE_ELEMS": 64}}
    split_fp8_prefetch = {**split_fp8, "name": "decode-split-fp8-l2-prefetch",
                          "constexprs": {**split_fp8["constexprs"], "PREFETCH_LINES": 1, "LINE_ELEMS": 128}}
    return [gemv, gemv_unnormed, gemv_plain, gemv_add, gemv_bias, rope, split, split_fp8, qkv_rope, split_prefetch,
            split_fp8_prefetch]


def test_dependent_kernels_compile_for_sm90_with_their_wait_first():
    """Launched as dependents, each kernel's PTX holds the grid dependency wait (and the early launch
    of its own dependents) with no global load before the wait, except what no kernel of the step writes
    (weights, host-uploaded inputs), which the GEMV and fused QKV kernels request early; launched plainly,
    neither instruction."""
    from sm90_compile import compile_for_sm90

    dependent, plain = _cases(True), _cases(False)
    results = compile_for_sm90(dependent + plain)
    for case, result in zip(dependent + plain, results):
        assert "error" not in result, (case["name"], result)
        expected = 1 if case["constexprs"]["PDL"] else 0
        assert min(result["dependency_waits"], 1) == expected, (case["name"], case["constexprs"]["PDL"], result)
        assert min(result["dependency_launches"], 1) == expected, (case["name"], case["constexprs"]["PDL"], result)
    # L2 prefetches (all before the wait) where asked for only.
    prefetches = {case["name"]: result["l2_prefetches_before_wait"] for case, result in zip(dependent, results)}
    for name in ("decode-split-l2-prefetch", "decode-split-fp8-l2-prefetch"):
        assert prefetches.pop(name) > 0, name
    assert set(prefetches.values()) == {0}, prefetches
    loads_first = {case["name"]: result["loads_before_wait"] for case, result in zip(dependent, results)}
    # The prefetching split kernel reads the host's length and one block id before its wait, nothing else.
    for name in ("decode-split-l2-prefetch", "decode-split-fp8-l2-prefetch"):
        assert loads_first.pop(name) == 2, name
    # The first weight slice (gate and up), requested early, and with the norm its weight's first slice.
    unnormed = loads_first.pop("gemv-silu")
    assert loads_first.pop("gemv-norm-silu") > unnormed > 0
    # The residual addend is written by the step's kernels: read after the wait, like x; a bias is static.
    plain = loads_first.pop("gemv-plain")
    assert loads_first.pop("gemv-add") == plain > 0
    assert loads_first.pop("gemv-bias") > plain
    # Its first weight slice (both halves of its channels), the position, rotary rows and slot.
    assert loads_first.pop("qkv-rope-cache") > 0
    assert set(loads_first.values()) == {0}, loads_first


@pytest.mark.parametrize("device,capability,hip,interpreter,expected", [
    ("cuda", (9, 0), None, False, True), ("cuda", (10, 0), None, False, True), ("cuda", (8, 9), None, False, False),
    ("cuda", (9, 4), "6.2", False, False), ("cuda", (9, 0), None, True, False), ("cpu", (9, 0), None, False, False),
])
def test_dependent_launch_is_available_on_nvidia_sm90_and_later_only(monkeypatch, device, capability, hip,
                                                                      interpreter, expected):
    from graphrt.kernels import dependent_launch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(dependent_launch, "triton_interpreter_on", lambda: interpreter)
    assert dependent_launch.dependent_launch_available(device) is expected


def test_engine_refuses_dependent_launch_where_it_cannot_run():
    with pytest.raises(ConfigError, match="dependent_launch=True needs fused kernels on a CUDA GPU"):
        LLM("random:tiny", device="cpu", progress=False, max_num_seqs=2, max_model_len=64, dependent_launch=True)
    llm = LLM("random:tiny", device="cpu", progress=False, max_num_seqs=2, max_model_len=64)
    assert llm.engine.dependent_launch is False


# -- on the GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden,intermediate", [(256, 512), (576, 1536), (2048, 8192)])
def test_chained_gemv_graph_gives_the_same_bits_as_dependents(dtype, hidden, intermediate):
    """Forty layers' worth of GEMV kernels, each reading the residual stream the one before updated
    in place, captured in one graph: launched as dependents it must equal the plain launches bitwise
    (a kernel reading before its wait would see a stale stream)."""
    from graphrt.kernels import gemv

    generator = torch.Generator(device="cuda").manual_seed(hash((hidden, intermediate)) % 2**31)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale).to(dtype)

    layers = [(rand(2 * intermediate, hidden, scale=hidden**-0.5), rand(hidden, intermediate, scale=intermediate**-0.5),
               rand(hidden, scale=0.1) + 1) for _ in range(40)]
    start = rand(1, hidden)
    act = torch.full((1, intermediate), float("nan"), device="cuda", dtype=dtype)  # poisoned

    def run(residual, dependent_launch):
        for gate_up, down, norm in layers:
            gemv.linear_gemv(residual, gate_up, norm_weight=norm, eps=1e-5, epilogue=gemv.EPILOGUE_SILU_MUL, out=act,
                             dependent_launch=dependent_launch)
            gemv.linear_gemv(act, down, epilogue=gemv.EPILOGUE_ADD_TO_OUT, out=residual,
                             dependent_launch=dependent_launch)

    results = {}
    for dependent_launch in (False, True):
        residual = start.clone()
        run(residual, dependent_launch)  # warm-up: first launches load the modules, never inside a capture
        residual.copy_(start)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(residual, dependent_launch)
        residual.copy_(start)
        act.fill_(float("nan"))  # a kernel reading act before its producer finished would spread NaNs
        graph.replay()
        torch.cuda.synchronize()
        results[dependent_launch] = residual.clone()
    assert torch.isfinite(results[False]).all()
    assert torch.equal(results[True], results[False])


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("preset,dtype", [("tiny", "bfloat16"), ("tiny", "float32"), ("smollm2-135m", "bfloat16")])
def test_engines_with_and_without_dependent_launch_generate_the_same_tokens(preset, dtype):
    """Batch 1 (GEMV layers, rotary + cache write, split attention, all dependents) and a batch of
    four (cuBLAS GEMMs between dependent kernels), greedy, from captured graphs."""
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (int(n),), generator=generator).tolist() for n in (5, 17, 33, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = {}
    for dependent_launch in (False, True):
        llm = LLM(f"random:{preset}", device="cuda", dtype=dtype, progress=False, max_num_seqs=4, max_model_len=256,
                  num_kv_blocks=128, loader_options={"init_std": 0.5} if preset == "tiny" else {},
                  dependent_launch=dependent_launch)
        assert llm.engine.dependent_launch is dependent_launch
        alone = [llm.generate([prompt], params)[0].token_ids for prompt in prompts]
        together = [out.token_ids for out in llm.generate(prompts, params)]
        assert not llm.engine.decode_runner.stats.eager_steps
        outputs[dependent_launch] = alone, together
        del llm
        torch.cuda.empty_cache()
    assert outputs[True] == outputs[False]
