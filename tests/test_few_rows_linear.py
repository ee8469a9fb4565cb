"""16-bit decoder linears on the rows kernel for a few tokens (``graphrt.models.layers.FewRowsLinear``,
``fp8_matmul.rows_matmul``): a model whose 2-16-token forwards take it gives the cuBLAS path's tokens and
logprobs (float32: the CPU interpreter, and on a GPU), and the layer falls back beyond its bound."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from triton_cpu import interpreted  # noqa: E402

from graphrt.attention import triton_qkv_rows as qkv_rows  # noqa: E402
from graphrt.kernels import fp8_matmul  # noqa: E402
from graphrt.models import kernel_policy, layers, llama  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
interpreted(fp8_matmul, "_weight_rows_kernel")
qkv_rows = interpreted(qkv_rows, "_weight_rows_qkv_rope_cache_kernel")


def _decode(monkeypatch, rows_kernel: bool, norm_prologue: bool = False, rope_epilogue: bool = True,
            silu_splits: bool = False):
    """Greedy outputs (with logprobs) of six prompts decoded together, then of the second alone; the rows
    kernel's call sizes in the first run and in the second. ``norm_prologue``: the layers normalise in
    QKV's and gate/up's products and add O's and down's into the stream (``llama.ROWS_NORM_PROLOGUE``);
    ``rope_epilogue``: ``llama.ROWS_ROPE_EPILOGUE``; ``silu_splits``: every gate/up product counts as
    splitting K, so the activation keeps its own kernel."""
    from graphrt import LLM, SamplingParams

    # float32 (products exact on both paths, so the tokens must agree): a dtype the bound was not measured in.
    bound = dict(rows_kernel_max_tokens=16, rows_kernel_min_layer_bytes=0, rows_kernel_dtypes=(torch.float32,)) \
        if rows_kernel else dict(rows_kernel_max_tokens=0)
    monkeypatch.setattr(kernel_policy, "GEMV_THRESHOLDS", dataclasses.replace(kernel_policy.GEMV_THRESHOLDS, **bound))
    monkeypatch.setattr(layers, "rows_kernel_runs_on", lambda device: True)  # the interpreter on a CPU
    # The tiny gate/up splits K on a large GPU, where the rule keeps the activation's launch: every product
    # takes the epilogue here (the rule: test_the_silu_epilogue_is_for_unsplit_16bit_products).
    monkeypatch.setattr(fp8_matmul, "silu_mul_splits_k", lambda rows, weight: silu_splits)
    monkeypatch.setattr(llama, "ROWS_ROPE_EPILOGUE", rope_epilogue)  # off by default until measured: tested here
    monkeypatch.setattr(llama, "ROWS_NORM_PROLOGUE", norm_prologue)
    calls = []
    rows_matmul = fp8_matmul.rows_matmul

    def record(x, *args, **kwargs):
        fused = [name for name, on in (("norm", kwargs.get("norm_weight") is not None),
                                       ("add", kwargs.get("residual") is not None)) if on]
        silu = kwargs.get("silu_mul", False)
        calls.append((x.shape[0], "+".join(fused + ["silu"] * silu) if fused else silu))
        return rows_matmul(x, *args, **kwargs)

    monkeypatch.setattr(fp8_matmul, "rows_matmul", record)
    project = qkv_rows.project_rope_and_write_kv_cache_on_rows_kernel
    monkeypatch.setattr(qkv_rows, "project_rope_and_write_kv_cache_on_rows_kernel",
                        lambda x, *a, **k: calls.append((x.shape[0], "qkv" + ("+norm" if k.get("norm_weight")
                                                                                    is not None else "")))
                        or project(x, *a, **k))
    prompts = [[(13 * i + 7 * n) % 500 + 3 for i in range(n)] for n in (3, 9, 17, 4, 11, 6)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    with LLM("random:tiny", dtype="float32", device=DEVICE, fused_kernels=True, max_model_len=64, num_kv_blocks=64,
             enforce_eager=not CUDA, progress=False, loader_options={"init_std": 0.1}) as llm:
        captured = list(calls)  # the decode graphs' capture on a GPU (their replays call no Python)
        calls.clear()
        policy = llm.engine.model.kernel_policy
        assert policy.rows_kernel_max_tokens == (16 if rows_kernel else 0)
        linear = llm.engine.model.layers[0].mlp.down_proj
        assert isinstance(linear, layers.FewRowsLinear) is rows_kernel
        outputs = llm.generate(prompts, params)
        decode_calls = list(calls)
        alone = llm.generate([prompts[1]], params)  # a 9-token prompt's prefill, then one-row steps
        return outputs + alone, captured + decode_calls, calls[len(decode_calls):]


@pytest.mark.gpu
def test_a_model_on_the_rows_kernel_decodes_as_on_cublas(monkeypatch):
    """Decode steps of six rows and a 9-token prompt's prefill on the rows kernel, rotary and the cache write
    in the QKV product's epilogue, SiLU * up in gate/up's; the six prompts' prefill together (50 tokens) and
    one-row steps not. Float32 products on both paths: the same tokens, logprobs within float32 summation
    order."""
    reference, _, _ = _decode(monkeypatch, rows_kernel=False)
    outputs, decode_calls, alone_calls = _decode(monkeypatch, rows_kernel=True)
    # Each layer's four products: QKV with rotary and the cache write in its epilogue, O and down, gate/up
    # with SiLU * up in its epilogue (no rotary or activation kernel); the prompts' prefill together (50
    # tokens) and one-token steps on cuBLAS. On a GPU the decode steps replay graphs captured for padded
    # batches of up to 16 rows (the calls made while capturing).
    sizes = {rows for rows, _ in decode_calls}
    assert (sizes == {6}) if not CUDA else (6 not in sizes and 8 in sizes and sizes <= set(range(2, 17)))
    kinds = [kind for _, kind in decode_calls]
    assert kinds.count("qkv") == kinds.count(True) == kinds.count(False) // 2 > 0
    if not CUDA:  # on a GPU the prompt runs in a prompt graph captured at start (its calls among the above)
        assert set(alone_calls) == {(9, "qkv"), (9, False), (9, True)}
    for got, want in zip(outputs, reference):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize("rope_epilogue,silu_splits", [(True, False), (False, True)],
                         ids=["qkv-epilogue-silu-epilogue", "rotary-and-activation-kernels"])
@pytest.mark.parametrize("run", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_layers_normalising_in_their_products_decode_as_on_cublas(monkeypatch, run, rope_epilogue, silu_splits):
    """``ROWS_NORM_PROLOGUE``: each layer of the six-row decode steps (and the 9-token prefill) runs QKV
    normalising the stream in its prologue (rotary and the cache write in its epilogue, or the rotary
    kernel after it), O and down adding into the stream, gate/up normalising it (SiLU * up in its
    epilogue, or the activation kernel where the product splits K): no norm kernel. Float32: cuBLAS's
    tokens, logprobs within float32 summation order."""
    if (run == "gpu") != CUDA:
        pytest.skip("the CPU case runs without a GPU, the GPU case with one")
    reference, _, _ = _decode(monkeypatch, rows_kernel=False)
    outputs, decode_calls, alone_calls = _decode(monkeypatch, rows_kernel=True, norm_prologue=True,
                                                 rope_epilogue=rope_epilogue, silu_splits=silu_splits)
    kinds = [kind for _, kind in decode_calls]
    layers_run = kinds.count("add") // 2
    gate_up = "norm" if silu_splits else "norm+silu"
    expected = {"add": 2 * layers_run} | ({"qkv+norm": layers_run, gate_up: layers_run} if rope_epilogue
                                          else {"norm": 2 * layers_run})
    assert layers_run > 0 and {kind: kinds.count(kind) for kind in set(kinds)} == expected
    if not CUDA:
        assert {kind for rows, kind in alone_calls if rows == 9} == set(expected)
    for got, want in zip(outputs, reference):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4


def test_rows_layers_need_the_switch_one_rank_and_every_product_on_the_rows_kernel(monkeypatch):
    """``LlamaDecoderLayer._runs_rows_layer``: off with the switch off, over several ranks, or where a product
    is not a FewRowsLinear taking the rows kernel for these tokens."""
    from types import SimpleNamespace

    monkeypatch.setattr(layers, "rows_kernel_runs_on", lambda device: True)
    few = [layers.FewRowsLinear(64, 64, bias=False, device="meta", max_tokens=16) for _ in range(4)]
    layer = SimpleNamespace(tensor_parallel=SimpleNamespace(enabled=False),
                            self_attn=SimpleNamespace(qkv_proj=few[0], o_proj=few[1]),
                            mlp=SimpleNamespace(gate_up_proj=few[2], down_proj=few[3]))
    runs = lambda x: llama.LlamaDecoderLayer._runs_rows_layer(layer, x)  # noqa: E731
    x = torch.empty(5, 64, device="meta")
    monkeypatch.setattr(llama, "ROWS_NORM_PROLOGUE", False)
    assert not runs(x)
    monkeypatch.setattr(llama, "ROWS_NORM_PROLOGUE", True)
    assert runs(x)
    assert not runs(torch.empty(1, 64, device="meta")) and not runs(torch.empty(17, 64, device="meta"))
    layer.tensor_parallel.enabled = True
    assert not runs(x)
    layer.tensor_parallel.enabled = False
    layer.mlp.down_proj = torch.nn.Linear(64, 64, device="meta")
    assert not runs(x)


def test_the_silu_epilogue_is_for_unsplit_16bit_products(monkeypatch):
    """On an H100/H200's 132 multiprocessors the 1B's gate/up (8192 outputs) splits K at 8 rows and keeps
    the activation kernel; the 8B's (14336) does not, and takes the epilogue."""
    monkeypatch.setattr(fp8_matmul, "multiprocessors", lambda device: 132)
    assert fp8_matmul.silu_mul_splits_k(8, torch.empty(16384, 2048, dtype=torch.bfloat16, device="meta"))
    assert not fp8_matmul.silu_mul_splits_k(8, torch.empty(28672, 4096, dtype=torch.bfloat16, device="meta"))
    monkeypatch.setattr(layers, "rows_kernel_runs_on", lambda device: True)
    for out_features, fuses in ((16384, False), (28672, True)):
        linear = layers.FewRowsLinear(64, out_features, bias=False, device="meta", max_tokens=16)
        linear.weight = torch.nn.Parameter(torch.empty(out_features, 2048 if fuses is False else 4096,
                                                       dtype=torch.bfloat16, device="meta"))
        x = torch.empty(8, linear.weight.shape[1], dtype=torch.bfloat16, device="meta")
        assert linear.fuses_silu_mul(x) is fuses


def test_few_rows_linear_falls_back_outside_its_bound(monkeypatch):
    """On a device it runs on: one token, more than max_tokens, x in another dtype or with strided columns,
    or the switch off: nn.Linear's result bit for bit (the rows kernel never called); a device it does not
    run on, the same. A SiLU * up epilogue, norm prologue or residual add asked of such a forward is refused."""
    monkeypatch.setattr(fp8_matmul, "rows_matmul", lambda *a, **k: pytest.fail("the rows kernel ran"))
    torch.manual_seed(0)
    linear = layers.FewRowsLinear(64, 48, bias=True, device=DEVICE, max_tokens=4)
    reference = lambda x: torch.nn.functional.linear(x, linear.weight, linear.bias)  # noqa: E731
    x = torch.randn(3, 64, device=DEVICE)
    if not CUDA:
        assert torch.equal(linear(x), reference(x))  # the CPU: never
    monkeypatch.setattr(layers, "rows_kernel_runs_on", lambda device: True)
    assert not linear.takes_rows_kernel(torch.randn(3, 64, device=DEVICE, dtype=torch.float64))  # not its dtype
    for x in (torch.randn(1, 64, device=DEVICE), torch.randn(5, 64, device=DEVICE), torch.randn(64, 3, device=DEVICE).t()):
        assert not linear.takes_rows_kernel(x)
        assert torch.equal(linear(x), reference(x))
        for fusion in (dict(silu_mul=True), dict(norm=layers.RMSNorm(64, 1e-5, device=DEVICE)),
                       dict(residual=torch.zeros(x.shape[0], 48, device=DEVICE))):
            with pytest.raises(ValueError, match="no SiLU \\* up, norm or residual fusion"):
                linear(x, **fusion)
    monkeypatch.setattr(layers, "ROWS_KERNEL", False)
    x = torch.randn(3, 64, device=DEVICE)
    assert torch.equal(linear(x), reference(x))
    assert "rows kernel for 2-4 tokens" in repr(linear)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("batch", [3, 12, 40])
@pytest.mark.parametrize("qkv_epilogue", [False, True])
def test_fp8_gate_up_with_silu_epilogue_decodes_as_with_the_activation_kernel(monkeypatch, batch, qkv_epilogue):
    """FP8 weights, float32 activations (products in float32): SiLU * up written by the gate/up product's
    epilogue where the down projection takes 16-bit input (W8A16, up to 16 rows), the activation kernel
    where it takes FP8 codes (more rows: the prompts' prefill, 40 rows): the same tokens and logprobs as
    with the epilogue switched off; and so with QKV rotating and writing the cache in its own epilogue."""
    from graphrt import LLM, SamplingParams

    # The W8A16 kernel at up to 16 rows on every matrix (the tiny model's down does not split K, which
    # sends it to FP8 tensor cores by default): the down projection then takes 16-bit input, as the 1B's and
    # the 8B's do. The FP8 x FP8 kernel's epilogue: test_fp8_matmul.py.
    monkeypatch.setattr(fp8_matmul, "w8a16_is_faster", lambda tile: True)
    monkeypatch.setattr(llama, "ROWS_ROPE_EPILOGUE", qkv_epilogue)
    results, fused_calls = {}, []
    for name in ("scaled_mm", "w8a16_matmul"):
        function = getattr(fp8_matmul, name)
        monkeypatch.setattr(fp8_matmul, name, lambda x, *a, _f=function, **k: fused_calls.append(
            (x.shape[0], k.get("silu_mul", False))) or _f(x, *a, **k))
    prompts = [[(11 * i + 5 * n) % 400 + 3 for i in range(4 + n % 7)] for n in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    for epilogue in (False, True):
        monkeypatch.setattr(llama, "ROWS_SILU_EPILOGUE", epilogue)
        with LLM("random:tiny", dtype="float32", quantization="fp8", max_model_len=64, num_kv_blocks=256,
                 max_num_seqs=batch, progress=False, loader_options={"init_std": 0.1}) as llm:
            results[epilogue] = llm.generate(prompts, params)
    # With the epilogue on, at 2-16 rows (the decode graphs captured up to the batch), where down takes 16 bits.
    assert any(silu for _, silu in fused_calls)
    assert all(1 < rows <= 16 for rows, silu in fused_calls if silu)
    for got, want in zip(results[True], results[False]):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4
