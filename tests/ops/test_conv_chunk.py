"""A prefill chunk's conv kernel (openk3/ops/kda/conv_chunk.py) against `causal_conv_silu`, and the model's cached
prefill that runs it.

On the CPU the kernel runs in Triton's interpreter, in a child pytest started with TRITON_INTERPRET=1 (the
`test_interpreted_*` tests); skipped without triton (CI has none). The GPU tests run the real kernel.
"""

import pytest
import torch

import openk3.model.model as model_module
import openk3.ops
from openk3.model.model import causal_conv_silu
from openk3.ops.kda import conv_chunk as conv_chunk_module
from openk3.ops.kda.conv_chunk import conv_chunk, conv_chunk_applies
from tests.helpers import INTERPRETED, cuda, interpreted_only, interpreter_child_test, needs_triton, rel_err
from tests.model import test_kda_fused_routing as routing
from tests.model.test_kda_fused_routing import fake_fla  # noqa: F401 (the fixture)
from tests.ops.test_conv_step import ulp
from tests.ops.test_moe_gemv import compile_for_sm90


def random_inputs(B, T, H, K, W, dtype, tail_dtype, pad=0, device="cpu", seed=0):
    """Random (never zero) projections [B, T, 3HK] (a view of a wider tensor when pad > 0, as the fused projection's
    q | k | v columns are), the three conv weights [HK, 1, W] fp32 and a tail [B, W-1, 3HK] (None without
    tail_dtype)."""
    g = torch.Generator().manual_seed(seed)
    HK = H * K
    wide = (torch.randn(B, T, 3 * HK + pad, generator=g) * 2).to(dtype)
    qkv = wide[..., pad // 2: pad // 2 + 3 * HK]
    ws = [torch.randn(HK, 1, W, generator=g) * 0.5 for _ in range(3)]
    tail = None if tail_dtype is None else (torch.randn(B, W - 1, 3 * HK, generator=g) * 2).to(tail_dtype)
    return [None if t is None else t.to(device) for t in (qkv, *ws, tail)]


def check_against_reference(B, T, H, K, W, dtype, tail_dtype, pad, device="cpu", seed=0):
    qkv, wq, wk, wv, tail = random_inputs(B, T, H, K, W, dtype, tail_dtype, pad=pad, device=device, seed=seed)
    exact = causal_conv_silu(qkv, torch.cat([wq, wk, wv]), None, tail)  # fp32
    assert conv_chunk_applies(qkv, tail)
    q, k, v = conv_chunk(qkv, wq, wk, wv, tail, H, K)
    for t in (q, k, v):
        assert t.shape == (B, T, H, K) and t.dtype == dtype and t.is_contiguous()
    got = torch.cat([q, k, v], dim=2).flatten(2)
    if dtype == torch.float32:
        assert rel_err(got, exact) < 1e-6
    else:  # within one ulp of the fp32 result (the interpreter truncates, the GPU rounds to nearest), plus the fp32
        # sum's own error where the window's terms cancel (as tests/ops/test_conv_step.py)
        slack = 1e-6 * exact.abs().max()
        assert ((got.float() - exact).abs() <= 1.01 * ulp(exact, dtype) + slack).all()


# ---- in the parent process (no kernel runs)

test_kernels_under_the_interpreter = interpreter_child_test(__file__)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs the kernel on the CPU")
def test_where_the_kernel_applies(monkeypatch):
    """CUDA only without the interpreter, channels contiguous, never under autograd."""
    qkv = torch.randn(2, 3, 12, requires_grad=True)
    assert not conv_chunk_applies(qkv.detach(), None)
    monkeypatch.setattr(conv_chunk_module, "conv_step_supported", lambda device, dtype: True)
    assert conv_chunk_applies(qkv.detach(), None)
    assert not conv_chunk_applies(qkv, None)
    assert not conv_chunk_applies(qkv.detach().transpose(1, 2), None)
    weight = torch.randn(4, 1, 4, requires_grad=True)  # a conv weight wanting its gradient: fla's conv has one
    assert not conv_chunk_applies(qkv.detach(), None, (weight,))
    assert not conv_chunk_applies(qkv.detach(), torch.zeros(2, 12, 3).transpose(1, 2))  # the tail's channels strided
    with torch.no_grad():
        assert conv_chunk_applies(qkv, torch.zeros(2, 3, 12), (weight,))


def test_bad_inputs_are_named():
    qkv, wq, wk, wv, tail = random_inputs(2, 5, 2, 4, 4, torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"qkv \(2, 5, 20\).*want \[B, T, 24\]"):
        conv_chunk(qkv[..., :20], wq, wk, wv, tail, 2, 4)
    with pytest.raises(ValueError, match=r"w_v \(8, 1, 3\)"):
        conv_chunk(qkv, wq, wk, wv[..., :3].contiguous(), tail, 2, 4)
    with pytest.raises(ValueError, match=r"w_k \(8, 1, 4\) torch.bfloat16 on cpu: want .* in torch.float32"):
        conv_chunk(qkv, wq, wk.bfloat16(), wv, tail, 2, 4)
    with pytest.raises(ValueError, match=r"tail \(2, 2, 24\).*want \[2, 3, 24\]"):
        conv_chunk(qkv, wq, wk, wv, tail[:, 1:], 2, 4)


@needs_triton
@pytest.mark.skipif(INTERPRETED, reason="the interpreter compiles nothing")
@pytest.mark.parametrize("dtype,tail", [("bf16", "fp32"), ("fp32", "fp32"), ("bf16", None)])
def test_kernel_compiles_for_sm90_without_spills(dtype, tail):
    """What the interpreter cannot check: that Triton compiles the kernel (its branch per q, k, v) for the GPU the
    lead runs, at kimi-linear-1.5b's shapes, with no register spilled to local memory."""
    types = {n: f"*{dtype}" for n in ("x_ptr", "q_ptr", "k_ptr", "v_ptr")}
    types.update({n: "*fp32" for n in ("wq_ptr", "wk_ptr", "wv_ptr")}, tail_ptr=f"*{tail or dtype}",
                 stride_xb="i64", stride_xt="i64", stride_tb="i64", stride_tw="i64", T="i32")
    usage = compile_for_sm90(conv_chunk_module._conv_chunk_kernel, types,
                             {"HK": 16 * 128, "W": 4, "HAS_TAIL": tail is not None, "C_BLOCKS": 16,
                              "BLOCK_T": conv_chunk_module.BLOCK_T, "BLOCK_C": conv_chunk_module.BLOCK_C})
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage


# ---- in the child (TRITON_INTERPRET=1)

@interpreted_only
@pytest.mark.parametrize("dtype,tail_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float16,) * 2,
                                              (torch.bfloat16, torch.float32), (torch.bfloat16, None)])
@pytest.mark.parametrize("T", [1, 2, 37])
def test_interpreted_kernel_equals_causal_conv_silu(dtype, tail_dtype, T):
    """2 rows, their projections a strided view; T = 1 and 2 (fewer tokens than the window: the tail fills it), 37
    (two token blocks, masked); H*K = 24 (a channel block of 32, masked); W = 4, and 2 with a tail."""
    check_against_reference(2, T, 3, 8, 4, dtype, tail_dtype, pad=10, seed=T)
    if tail_dtype is not None:
        check_against_reference(2, T, 3, 8, 2, dtype, tail_dtype, pad=0, seed=T + 1)


@interpreted_only
def test_interpreted_kernel_channel_blocks():
    """H*K = 512: four blocks of 128 channels in each of q, k, v."""
    check_against_reference(1, 5, 4, 128, 4, torch.bfloat16, torch.bfloat16, pad=6)


@interpreted_only
def test_interpreted_cached_prefill_runs_the_kernel(fake_fla, monkeypatch):
    """A model's fused KDA forward (fla's stand-ins) of a chunk, first or after a cache, runs the kernel instead of
    fla's conv, and the logits equal the reference chain's (tests/model/test_kda_fused_routing.py's ragged serve:
    prefills of 5, 13 and 7 tokens, then decode steps)."""
    calls = []
    monkeypatch.setattr(model_module, "conv_chunk", lambda *a: calls.append(a[0].shape[1]) or conv_chunk(*a))
    monkeypatch.setattr(model_module, "route_kernel_applies", lambda *a: False)
    monkeypatch.setattr(openk3.ops, "gemv_applies", lambda *a, **k: False)
    routing.test_fused_routing_equals_the_reference_chain("kimi-linear", fake_fla, monkeypatch)
    assert sorted(set(calls)) == [5, 7, 13]
    assert "causal_conv1d" not in fake_fla


# ---- on the GPU

@cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,T,tail", [(16, 512, True), (1, 8192, True), (2, 300, False)])
def test_kernel_equals_causal_conv_silu_on_gpu(dtype, B, T, tail):
    """kimi-linear-1.5b's shapes (H 16, K 128, W 4), the projections a view of the fused output (6,416 wide)."""
    check_against_reference(B, T, 16, 128, 4, dtype, dtype if tail else None, pad=6416 - 6144, device="cuda", seed=T)
