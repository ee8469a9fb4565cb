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

from graphrt.kernels import fp8_matmul  # noqa: E402
from graphrt.models import kernel_policy, layers  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
interpreted(fp8_matmul, "_weight_rows_kernel")


def _decode(monkeypatch, rows_kernel: bool):
    """Greedy outputs (with logprobs) of six prompts decoded together, then of the second alone; the rows
    kernel's call sizes in the first run and in the second."""
    from graphrt import LLM, SamplingParams

    bound = dict(rows_kernel_max_tokens=16, rows_kernel_min_layer_bytes=0) if rows_kernel else \
        dict(rows_kernel_max_tokens=0)
    monkeypatch.setattr(kernel_policy, "GEMV_THRESHOLDS", dataclasses.replace(kernel_policy.GEMV_THRESHOLDS, **bound))
    monkeypatch.setattr(layers, "rows_kernel_runs_on", lambda device: True)  # the interpreter on a CPU
    calls = []
    rows_matmul = fp8_matmul.rows_matmul
    monkeypatch.setattr(fp8_matmul, "rows_matmul", lambda x, *a, **k: calls.append(x.shape[0]) or rows_matmul(x, *a, **k))
    prompts = [[(13 * i + 7 * n) % 500 + 3 for i in range(n)] for n in (3, 9, 17, 4, 11, 6)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    with LLM("random:tiny", dtype="float32", device=DEVICE, fused_kernels=True, max_model_len=64, num_kv_blocks=64,
             enforce_eager=not CUDA, progress=False, loader_options={"init_std": 0.1}) as llm:
        policy = llm.engine.model.kernel_policy
        assert policy.rows_kernel_max_tokens == (16 if rows_kernel else 0)
        linear = llm.engine.model.layers[0].mlp.down_proj
        assert isinstance(linear, layers.FewRowsLinear) is rows_kernel
        outputs = llm.generate(prompts, params)
        decode_calls = list(calls)
        alone = llm.generate([prompts[1]], params)  # a 9-token prompt's prefill, then one-row steps
        return outputs + alone, decode_calls, calls[len(decode_calls):]


@pytest.mark.gpu
def test_a_model_on_the_rows_kernel_decodes_as_on_cublas(monkeypatch):
    """Decode steps of six rows and a 9-token prompt's prefill on the rows kernel; the six prompts' prefill
    together (50 tokens) and one-row steps not. Float32 products on both paths: the same tokens, logprobs
    within float32 summation order."""
    reference, _, _ = _decode(monkeypatch, rows_kernel=False)
    outputs, decode_calls, alone_calls = _decode(monkeypatch, rows_kernel=True)
    assert decode_calls and set(decode_calls) == {6}  # the prompts' prefill together: 50 tokens, cuBLAS
    assert alone_calls and set(alone_calls) == {9}  # then one token a step: cuBLAS (or the GEMV layers)
    for got, want in zip(outputs, reference):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4


def test_few_rows_linear_falls_back_outside_its_bound(monkeypatch):
    """One token, more than max_tokens, the switch off, or a device it does not run on: nn.Linear's
    result bit for bit (the rows kernel never called)."""
    monkeypatch.setattr(fp8_matmul, "rows_matmul", lambda *a, **k: pytest.fail("the rows kernel ran"))
    torch.manual_seed(0)
    linear = layers.FewRowsLinear(64, 48, bias=True, device=DEVICE, max_tokens=4)
    for rows in (1, 5):
        x = torch.randn(rows, 64, device=DEVICE)
        assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    monkeypatch.setattr(layers, "ROWS_KERNEL", False)
    monkeypatch.setattr(layers, "rows_kernel_runs_on", lambda device: True)
    x = torch.randn(3, 64, device=DEVICE)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    assert "rows kernel for 2-4 tokens" in repr(linear)
