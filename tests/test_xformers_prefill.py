"""xFormers prefill (packed prompts, GQA by expansion, window, ALiBi) against the float32 reference.

On the CPU: the compatibility status must say why xFormers is unusable, and the masks/packing logic of
``xformers_prefill`` is checked by swapping xFormers' kernel for a dense one that reads the very
attention-bias objects the real call would get (``materialize``). On the GPU (``gpu`` marker, xFormers
usable): the real operators, dispatched and forced (flash, cutlass), on fresh random inputs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("xformers")

from graphrt.attention import xformers_prefill as xp  # noqa: E402
from graphrt.attention.reference import attend  # noqa: E402
from graphrt.attention.xformers_compat import XformersStatus, xformers_status  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
ODD_LENS = [1, 7, 33, 130, 257]


def _alibi_slopes(num_heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])


def _inputs(lens, num_heads, num_kv_heads, head_size, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, num_heads, head_size, generator=gen)
    k = torch.randn(total, num_kv_heads, head_size, generator=gen)
    v = torch.randn(total, num_kv_heads, head_size, generator=gen)
    return [t.to(device, dtype) for t in (q, k, v)]


def _check(out, q, k, v, lens, scale, window, slopes, dtype):
    assert out.shape == q.shape and out.dtype == q.dtype
    out = out.float().cpu()
    assert not out.isnan().any()
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    start = 0
    for n in lens:
        rows = slice(start, start + n)
        ref = attend(q[rows], k[rows], v[rows], 0, scale, window, slopes.cpu() if slopes is not None else None)
        err = ((out[rows] - ref).norm() / ref.norm()).item()
        assert err < TOLERANCE[dtype], f"prompt of {n} tokens at {start}: relative error {err:.2e}"
        start += n


# ---------------------------------------------------------------- CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_status_reports_unusable_on_cpu():
    status = xformers_status()
    assert not status.usable
    assert status.reason == "no CUDA device"
    assert status.prefill_operator is None and not status.re_enabled
    assert "no CUDA device" in status.describe()
    with pytest.raises(RuntimeError, match="no CUDA device"):
        q = torch.zeros(3, 2, 64)
        xp.xformers_prefill(q, q, q, [3], 0.125)


def _dense_xformers(query, key, value, attn_bias=None, scale=None, op=None):
    """memory_efficient_attention_forward on BMHK or BMGHK inputs, by materialising the bias object."""
    heads_shape = query.shape[2:-1]  # (H,) or (G, H/G)
    mask = attn_bias.materialize((query.shape[0], *heads_shape, query.shape[1], key.shape[1]), dtype=torch.float32)
    q, k, v = (x.flatten(2, 3) if x.ndim == 5 else x for x in (query, key, value))  # [B, M, H, D]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale + mask.flatten(1, -3)
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float()).to(query.dtype)
    return out.reshape(query.shape)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("window", [None, 1, 5], ids=["full", "w1", "w5"])
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_masks_and_packing_match_reference(monkeypatch, heads, window, alibi):
    import xformers.ops.fmha as fmha

    monkeypatch.setattr(fmha, "memory_efficient_attention_forward", _dense_xformers)
    monkeypatch.setattr(xp, "xformers_status", lambda: XformersStatus(True, "dense stand-in"))
    num_heads, num_kv_heads = heads
    lens = [3, 1, 11, 6]
    q, k, v = _inputs(lens, num_heads, num_kv_heads, 16, torch.float32, "cpu", seed=len(lens) + num_kv_heads)
    slopes = _alibi_slopes(num_heads) if alibi else None
    plan = xp.plan_prefill(
        lens, num_heads=num_heads, dtype=q.dtype, device=q.device,
        sliding_window=window, alibi_slopes=slopes,
    )
    assert (plan.padded_rows is not None) == alibi
    out = xp.xformers_prefill(q, k, v, lens, 0.25, window, slopes, plan=plan)
    _check(out, q, k, v, lens, 0.25, window, slopes, torch.float32)


def test_plan_rejects_mismatched_tokens(monkeypatch):
    monkeypatch.setattr(xp, "xformers_status", lambda: XformersStatus(True, "dense stand-in"))
    q = torch.zeros(5, 2, 16)
    plan = xp.plan_prefill([2, 2], num_heads=2, dtype=q.dtype, device=q.device)
    with pytest.raises(ValueError, match="4 tokens"):
        xp.xformers_prefill(q, q, q, [2, 3], 1.0, plan=plan)


# ---------------------------------------------------------------- GPU

def _need_usable():
    status = xformers_status()
    if not status.usable:
        pytest.skip(f"xFormers unusable: {status.reason}")
    return status


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_status_dispatches_to_flash(record_property):
    status = _need_usable()
    record_property("xformers_status", status.describe())
    print(status.describe())
    assert status.prefill_operator is not None and status.prefill_operator.startswith(("fa2F", "fa3F"))
    assert status is xformers_status()  # detected once


HEAD_SIZES = [64, 80, 96, 112, 128, 256]
HEADS = {"mha": (16, 16), "gqa4": (32, 8), "gqa8": (32, 4), "mqa": (16, 1)}


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_gpu(head_size, heads, dtype):
    _need_usable()
    num_heads, num_kv_heads = HEADS[heads]
    q, k, v = _inputs(ODD_LENS, num_heads, num_kv_heads, head_size, dtype, "cuda", seed=head_size + num_kv_heads)
    scale = head_size**-0.5
    _check(xp.xformers_prefill(q, k, v, ODD_LENS, scale), q, k, v, ODD_LENS, scale, None, None, dtype)


@pytest.mark.parametrize("window", [None, 1, 16, 100], ids=["full", "w1", "w16", "w100"])
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("heads", ["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_window_alibi_gpu(window, alibi, heads, dtype):
    _need_usable()
    num_heads, num_kv_heads = HEADS[heads]
    q, k, v = _inputs(ODD_LENS, num_heads, num_kv_heads, 128, dtype, "cuda", seed=(window or 0) + 7 * alibi)
    slopes = _alibi_slopes(num_heads).cuda() if alibi else None
    out = xp.xformers_prefill(q, k, v, ODD_LENS, 128**-0.5, window, slopes)
    _check(out, q, k, v, ODD_LENS, 128**-0.5, window, slopes, dtype)


@pytest.mark.parametrize("op_name", ["flash", "cutlass"])
@pytest.mark.parametrize("window", [None, 64], ids=["full", "w64"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forced_operator_and_shared_plan_gpu(op_name, window):
    """Both re-enabled operators are right, and one plan serves several layers."""
    _need_usable()
    import xformers.ops.fmha as fmha

    op = {"flash": fmha.flash.FwOp, "cutlass": fmha.cutlass.FwOp}[op_name]
    plan = xp.plan_prefill(ODD_LENS, num_heads=32, dtype=torch.bfloat16, device=torch.device("cuda"),
                           sliding_window=window)
    for layer in range(2):
        q, k, v = _inputs(ODD_LENS, 32, 8, 128, torch.bfloat16, "cuda", seed=100 + layer)
        out = xp.xformers_prefill(q, k, v, ODD_LENS, 0.1, window, plan=plan, op=op)
        _check(out, q, k, v, ODD_LENS, 0.1, window, None, torch.bfloat16)
