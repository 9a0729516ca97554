"""The inference-only fla kernels of ops/kda/fused.py against their fp32 references (issue #12):
`recurrent_gated` (fla's token-by-token KDA with the gate, beta's sigmoid and the q, k L2 norms in the kernel,
from a state, and in place in a slot pool) and `rms_norm` (split views included); and `conv_silu`'s one-token case
(a decode step), which is plain PyTorch and runs anywhere. What openk3 does around them (which path runs, the slot
pool's rows) is checked on any machine by tests/model/test_kda_fused_routing.py.

fla's kernels are CUDA only. NOTE: Triton's interpreter (TRITON_INTERPRET=1, triton 3.6) cannot run them on the
CPU: the recurrent kernel's `tl.range(0, T)` over a scalar argument fails there, and the norm kernel's autotuner
needs a GPU driver.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from openk3.model.model import causal_conv_silu, kda_decay
from openk3.ops.kda import fused as kda_fused
from openk3.ops.kda.naive import naive_recurrent_kda
from tests.helpers import rel_err

DEVICE = "cuda"
needs_fla = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                               reason="needs CUDA and flash-linear-attention")

B, H, K = 2, 2, 16


def inputs(T: int, dtype: torch.dtype, seed: int, saturated: bool):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)
    q, k, v = (r(B, T, H, K).to(dtype) for _ in range(3))
    f = r(B, T, H, K).to(dtype)
    beta_logits = r(B, T, H).to(dtype)
    A_log = r(H, scale=0.5)
    # saturated: the bounded gate at its bound (lb * sigmoid(+large) = lb), the softplus gate at a large decay
    dt_bias = torch.full((H * K,), 30.0, device=DEVICE) if saturated else r(H * K)
    state = r(B, H, K, K, scale=0.3)
    return q, k, v, f, beta_logits, A_log, dt_bias, state


def reference(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, state):
    """model.py's decay and beta's sigmoid in fp32, then the naive recurrence (fp32, scale 1/sqrt(head width))."""
    g = kda_decay(f, A_log, dt_bias, lower_bound)
    return naive_recurrent_kda(q.float(), k.float(), v.float(), g, torch.sigmoid(beta_logits.float()),
                               scale=q.shape[-1] ** -0.5, initial_state=state, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("saturated", [False, True])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["k3-gate", "softplus-gate"])
@pytest.mark.parametrize("T", [1, 7])
def test_recurrent_gated_equals_the_reference(T, lower_bound, saturated):
    """From a state: the outputs and the final state (fp32) match the fp32 chain; the initial state is not written."""
    q, k, v, f, beta_logits, A_log, dt_bias, state = inputs(T, torch.float32, seed=T, saturated=saturated)
    want_o, want_state = reference(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, state)
    before = state.clone()
    o, final = kda_fused.recurrent_gated(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, K ** -0.5, state)
    assert o.shape == (B, T, H, K) and final.dtype == torch.float32 and torch.equal(state, before)
    tol = 5e-3  # Triton's fp32 dot products run in TF32 on Hopper
    assert rel_err(o.float(), want_o) < tol
    assert rel_err(final, want_state) < tol


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["k3-gate", "softplus-gate"])
def test_recurrent_gated_updates_the_slot_pool_in_place(lower_bound):
    """A decode step (T = 1) with state indices: the rows of the pool at the indices are updated in place (no gather,
    no write back), equal to the step from those rows, and no other row changes."""
    q, k, v, f, beta_logits, A_log, dt_bias, state = inputs(1, torch.bfloat16, seed=5, saturated=False)
    want_o, want_state = kda_fused.recurrent_gated(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, K ** -0.5,
                                                   state)
    pool = torch.randn(5, H, K, K, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    slots = torch.tensor([3, 1], device=DEVICE)
    pool[slots] = state
    before = pool.clone()
    o, final = kda_fused.recurrent_gated(q, k, v, f, beta_logits, A_log, dt_bias, lower_bound, K ** -0.5, pool,
                                         slots)
    # (the pool's step launches fla's kernel with its own grid and warps: sums over K in another order)
    assert final is None and rel_err(o.float(), want_o.float()) < 1e-2 and rel_err(pool[slots], want_state) < 1e-6
    others = [i for i in range(5) if i not in (1, 3)]
    assert torch.equal(pool[others], before[others])
    with pytest.raises(ValueError, match=r"state_indices \(2,\).*for q \(2, 2, 2, 16\)"):
        q2, k2, v2, f2, b2, *_ = inputs(2, torch.bfloat16, seed=6, saturated=False)
        kda_fused.recurrent_gated(q2, k2, v2, f2, b2, A_log, dt_bias, lower_bound, K ** -0.5, pool, slots)


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("saturated", [False, True])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["k3-gate", "softplus-gate"])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_the_pool_step_at_every_grid_equals_the_reference(rows, lower_bound, saturated):
    """`recurrent_pool_step` at kimi-linear-1.5b's 16 heads of 128, at the (BV, warps) `recurrent_block` picks for
    the batch and at fla's own (32, 4) and others: each equals the fp32 chain (outputs in bf16, states fp32) from the
    pool's rows, which it updates in place; no other pool row changes."""
    Hh, Kh = 16, 128
    g = torch.Generator().manual_seed(rows)
    q, k, v, f = ((torch.randn(rows, 1, Hh, Kh, generator=g)).to(DEVICE).bfloat16() for _ in range(4))
    beta = torch.randn(rows, 1, Hh, generator=g).to(DEVICE).bfloat16()
    A_log = (torch.randn(Hh, generator=g) * 0.5).to(DEVICE)
    # saturated: the bounded gate at its bound, the softplus gate at a large decay (as `inputs`)
    dt_bias = torch.full((Hh * Kh,), 30.0, device=DEVICE) if saturated else torch.randn(Hh * Kh, generator=g).to(DEVICE)
    pool = (torch.randn(rows + 3, Hh, Kh, Kh, generator=g) * 0.3).to(DEVICE)
    slots = torch.randperm(rows + 3, generator=g)[:rows].to(DEVICE).int()
    want_o, want_state = reference(q, k, v, f, beta, A_log, dt_bias, lower_bound, pool[slots.long()])
    others = torch.ones(rows + 3, dtype=torch.bool, device=DEVICE)
    others[slots.long()] = False
    for grid in [kda_fused.recurrent_block(rows), (32, 4), (16, 1), (64, 4), (128, 4)]:
        p = pool.clone()
        o = kda_fused.recurrent_pool_step(q, k, v, f, beta, A_log, dt_bias, scale=Kh ** -0.5,
                                          lower_bound=lower_bound, initial_state=p, state_indices=slots,
                                          out=torch.empty_like(v), block_v=grid[0], warps=grid[1],
                                          use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                          use_beta_sigmoid_in_kernel=True)
        assert rel_err(o.float(), want_o) < 1e-2, grid  # bf16 outputs
        assert rel_err(p[slots.long()], want_state) < 1e-4, grid
        assert torch.equal(p[others], pool[others]), grid


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_reference(dtype):
    """fla's one-kernel norm against model.py's reference formula (fp32 statistics, one rounding)."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, 48, generator=g) * 4).to(DEVICE, dtype)
    w = (torch.rand(48, generator=g) + 0.5).to(DEVICE, dtype)
    want = F.rms_norm(x.float(), (48,), w.float(), 1e-5).to(dtype)
    got = kda_fused.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(got.float(), want.float()) < tol
    c = x[..., :40]  # a split view, as GatedMLA.latent's c: rows 48 apart, not 40
    want = F.rms_norm(c.float(), (40,), w[:40].float(), 1e-5).to(dtype)
    assert rel_err(kda_fused.rms_norm(c, w[:40], 1e-5).float(), want.float()) < tol


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_equals_the_reference(dtype):
    """fla's add + norm kernel against `RMSNorm.add`'s reference: the fp32 sum exactly (one fp32 add either way);
    the norm of that sum within fp32's rounding, and within 1 ulp of `dtype` of the reference's norm of the sum
    rounded to `dtype` (the one rounding the kernel leaves out); and `rms_norm` with `out_dtype` of the fp32 stream
    itself (`RMSNorm.from_residual`)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 5, 48, generator=g) * 4).to(DEVICE, dtype)
    residual = (torch.randn(3, 5, 48, generator=g) * 30).to(DEVICE)
    w = (torch.rand(48, generator=g) + 0.5).to(DEVICE, dtype)
    y, h = kda_fused.add_rms_norm(x, residual, w, 1e-5, dtype)
    assert y.dtype == dtype and h.dtype == torch.float32 and y.shape == x.shape and h.shape == residual.shape
    assert torch.equal(h, residual + x)
    of_sum = F.rms_norm(h, (48,), w.float(), 1e-5)
    assert rel_err(y.float(), of_sum) < (1e-6 if dtype == torch.float32 else 4e-3)
    reference = F.rms_norm(h.to(dtype).float(), (48,), w.float(), 1e-5).to(dtype)
    assert rel_err(y.float(), reference.float()) < (1e-6 if dtype == torch.float32 else 1e-2)
    y = kda_fused.rms_norm(h, w, 1e-5, out_dtype=dtype)  # RMSNorm.from_residual: the fp32 stream normed as it is
    assert y.dtype == dtype and rel_err(y.float(), of_sum) < (1e-6 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tail_dtype", ["x", "fp32"])
def test_conv_silu_one_token_equals_the_reference(dtype, bound, tail_dtype):
    """A decode step's conv (one token after a random tail; on the CPU here, the same code as on the GPU) against
    model.py's causal_conv_silu in fp32 on the same inputs; through `conv_silu`, which takes this path without
    fla. The tail in x's dtype (the engine's slot pool) or fp32 (K3Cache's default)."""
    g = torch.Generator().manual_seed(5)
    Bc, W, C = 3, 4, 40
    x = (torch.randn(Bc, 1, C, generator=g) * 2).to(dtype)
    tail = (torch.randn(Bc, W - 1, C, generator=g) * 2).to(dtype if tail_dtype == "x" else torch.float32)
    w = (torch.randn(C, W, generator=g) * 0.5).to(dtype)
    want = causal_conv_silu(x, w[:, None, :], None, tail)
    got = kda_fused.conv_silu(x, w, None, tail)
    assert got.dtype == dtype and got.shape == (Bc, 1, C)
    assert torch.equal(got, kda_fused.conv_silu_one_token(x, w, tail))
    assert rel_err(got, want) < bound
