"""A decode step's short conv over the engine's slot pool in one Triton kernel, for forwards without gradients
(issue #12).

At a decode step (one token a row) `KimiDeltaAttention.forward_fused` (openk3/model/model.py) ran, per KDA layer, the
q | k | v conv weights' cat, `conv_silu_one_token` (the window's cat, a product, a sum, a SiLU, a cast), the conv
tail's cat / slice / cast and the slot pool's `index_copy_` (`SlotKDAState.conv`'s setter), then fla's decode
kernel copied the q, k, v split views to contiguous tensors: about 8 launches and ~17 us a layer at batch 1 on the
H200 (more at batch 64), and the static step gathered every layer's conv tails out of the pool first. Here one
program per (row, q/k/v, channel block) reads its row's window where the pool keeps it and updates it there:

    window = [pool[rows[b], 0 .. W-2, c], qkv[b, c]]
    y = silu(sum_j window[j] * w[c, j])             in fp32, rounded to qkv's dtype, into q, k or v [B, 1, H, K]
    pool[rows[b], j] = window[j + 1]  for j < W-1   the tail shifted, the new input cast to the pool's dtype

which is `conv_silu_one_token` followed by `conv_tail` and the setter's `index_copy_` (tests/ops/test_conv_step.py).
At one row the same launch also runs the KDA gate's low-rank products (`lowrank`: f_b, and g_b of a low-rank output
gate, each F.linear of a [1, 128] input and a [2048, 128] weight at kimi-linear-1.5b) in more programs: two launches
fewer a layer, which took ~1.9 us each on the H200 at batch 1 (`decode_probe.py timeline:1`, eleventh session).
The window's values are promoted to fp32 as stored, the weights too; the sum over the window runs in another order
than torch's (fp32 rounding apart); q, k, v are contiguous, so fla's decode kernel copies nothing. Programs of one
row touch disjoint channels. Checked in the interpreter and on the H200 (its GPU tests); not timed alone.

Triton is optional: without it `conv_step_applies` is False and the PyTorch chain runs. With TRITON_INTERPRET=1 in
the environment at import, the kernel runs in Triton's CPU interpreter on CPU tensors (the tests).
NOTE: the interpreter casts fp32 to bf16 by truncation, the GPU rounds to nearest (ops/moe_gemv.py).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_C = 256  # channels a program: kimi-linear-1.5b's H*K = 2048 is 8 blocks of each of q, k, v
LOWRANK_TILE = 8192  # weight elements a low-rank product's program reads (kimi-linear-1.5b: 64 rows of 128)


def conv_step_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel runs on `device` for a pool / projections of `dtype`: Triton, CUDA (or the interpreter on
    the CPU), bf16, fp16 or fp32. What the static step asks before it leaves the conv tails ungathered."""
    device = torch.device(device)
    on_device = device.type == "cuda" or (INTERPRET and device.type == "cpu")
    return triton is not None and on_device and dtype in DTYPES


def conv_step_applies(qkv: Tensor, conv_pool: Tensor) -> bool:
    """Whether `conv_step_in_place` runs for these projections and pool: `conv_step_supported` for both, and no
    gradient wanted (the kernel has no backward). Reads shapes and flags only (no sync)."""
    if torch.is_grad_enabled() and qkv.requires_grad:
        return False
    return conv_step_supported(qkv.device, qkv.dtype) and conv_step_supported(conv_pool.device, conv_pool.dtype)


if triton is not None:
    @triton.jit
    def _conv_block(qkv_row_ptr, w_ptr, pool_row_ptr, out_row_ptr, part, c, HK: tl.constexpr, W: tl.constexpr,
                    BLOCK_W: tl.constexpr):
        """One program's channels c [BLOCK_C] of one of q, k, v (`part`) for one row (the pointers at that row)."""
        valid = c < HK
        ch = part * HK + c  # the channel in qkv and the pool
        j = tl.arange(0, BLOCK_W)[:, None]  # the window's position; W - 1 is the new token
        x = tl.load(qkv_row_ptr + ch, mask=valid, other=0.0)
        tail = tl.load(pool_row_ptr + j * (3 * HK) + ch[None, :], mask=(j < W - 1) & valid[None, :], other=0.0)
        window = tl.where(j == W - 1, x[None, :].to(tl.float32), tail.to(tl.float32))
        w = tl.load(w_ptr + c[None, :] * W + j, mask=(j < W) & valid[None, :], other=0.0).to(tl.float32)
        y = tl.sum(window * w, axis=0)
        y = y * tl.sigmoid(y)
        tl.store(out_row_ptr + c, y.to(out_row_ptr.dtype.element_ty), mask=valid)
        # the tail shifted by one: position j takes j + 1's input, the last the new token's
        nxt = tl.load(pool_row_ptr + (j + 1) * (3 * HK) + ch[None, :], mask=(j + 1 < W - 1) & valid[None, :], other=0.0)
        nxt = tl.where(j == W - 2, x[None, :].to(pool_row_ptr.dtype.element_ty), nxt)
        # NOTE: every thread's reads of the window before any thread's writes: a thread stores positions another
        # thread read
        tl.debug_barrier()
        tl.store(pool_row_ptr + j * (3 * HK) + ch[None, :], nxt, mask=(j < W - 1) & valid[None, :])

    @triton.jit
    def _lowrank_block(x_ptr, w_ptr, y_ptr, n, N, R: tl.constexpr, BLOCK_R: tl.constexpr):
        """y[n] = x . w[n] in fp32 over R, rounded once to y's dtype, for this program's rows n (one input row)."""
        r = tl.arange(0, BLOCK_R)
        x = tl.load(x_ptr + r, mask=r < R, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * R + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R),
                    other=0.0).to(tl.float32)
        tl.store(y_ptr + n, tl.sum(w * x[None, :], axis=1).to(y_ptr.dtype.element_ty), mask=n < N)

    @triton.jit
    def _conv_step_kernel(qkv_ptr, stride_qkv, wq_ptr, wk_ptr, wv_ptr, pool_ptr, rows_ptr, q_ptr, k_ptr, v_ptr,
                          xf_ptr, wf_ptr, yf_ptr, xg_ptr, wg_ptr, yg_ptr, N, HK: tl.constexpr, W: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_N: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)  # 0 q, 1 k, 2 v; 3 and 4 the low-rank products (one row only)
        blk = tl.program_id(2)
        if part < 3:
            if blk * BLOCK_C < HK:
                c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
                row = tl.load(rows_ptr + b)
                qkv_row = qkv_ptr + b * stride_qkv
                pool_row = pool_ptr + row * ((W - 1) * 3 * HK)
                if part == 0:
                    _conv_block(qkv_row, wq_ptr, pool_row, q_ptr + b * HK, part, c, HK, W, BLOCK_W)
                elif part == 1:
                    _conv_block(qkv_row, wk_ptr, pool_row, k_ptr + b * HK, part, c, HK, W, BLOCK_W)
                else:
                    _conv_block(qkv_row, wv_ptr, pool_row, v_ptr + b * HK, part, c, HK, W, BLOCK_W)
        else:
            n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            if part == 3:
                _lowrank_block(xf_ptr, wf_ptr, yf_ptr, n, N, R, BLOCK_R)
            else:
                _lowrank_block(xg_ptr, wg_ptr, yg_ptr, n, N, R, BLOCK_R)


def conv_step_in_place(qkv_BC: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor, conv_pool: Tensor, rows_B: Tensor,
                       H: int, K: int, lowrank: list[tuple[Tensor, Tensor]] = ()) -> tuple[Tensor, ...]:
    """One token's short conv + SiLU for B rows whose conv tails live in a pool, the tails updated there (module
    docstring). Only where `conv_step_applies`.

    qkv_BC [B, 3*H*K]: the raw q | k | v projections (a strided view is fine: rows any stride apart, the channels
    contiguous); w_q, w_k, w_v: the conv modules' weights [H*K, 1, W]; conv_pool [N, W-1, 3*H*K] contiguous;
    rows_B [B] int64: row b's tail is conv_pool[rows_B[b]].
    lowrank: at most two (x [1, R], weight [N, R]) pairs of one row (B = 1), computed as F.linear(x, weight) in the
    same launch (KDA's f_b and g_b projections at batch 1: two launches fewer a layer), in fp32, rounded once to x's
    dtype (a matmul's precision); both of one N and R, x contiguous, the weights contiguous in x's dtype.
    -> q, k, v [B, 1, H, K] contiguous, in qkv's dtype, then each low-rank product [1, N].
    NOTE: rows that pad a batch share the pool's scratch row (the static step's slot 0): their programs read and
    write the same tail in no fixed order, so their outputs and that row are garbage. Both are discarded (the padding
    rows' outputs are never read, the scratch row is zeroed after the step, serve/static.py `clear_scratch`); rows of
    real requests are distinct and exact."""
    B, C3 = qkv_BC.shape
    HK = H * K
    W = w_q.shape[-1]
    if C3 != 3 * HK or qkv_BC.stride(-1) != 1:
        raise ValueError(f"conv_step_in_place: qkv {tuple(qkv_BC.shape)} stride {qkv_BC.stride()}: want [B, {3 * HK}] "
                         f"with contiguous channels")
    for name, w in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v)):
        if w.shape != (HK, 1, W) or not w.is_contiguous() or w.dtype != w_q.dtype:
            raise ValueError(f"conv_step_in_place: {name} {tuple(w.shape)} {w.dtype}: want contiguous [{HK}, 1, {W}] "
                             f"in {w_q.dtype}")
    if conv_pool.shape[1:] != (W - 1, C3) or not conv_pool.is_contiguous():
        raise ValueError(f"conv_step_in_place: conv_pool {tuple(conv_pool.shape)}: want contiguous [N, {W - 1}, {C3}]")
    if rows_B.shape != (B,) or rows_B.dtype != torch.int64:
        raise ValueError(f"conv_step_in_place: rows {tuple(rows_B.shape)} {rows_B.dtype}: want [{B}] int64")
    lowrank = list(lowrank)
    if lowrank:
        N, R = lowrank[0][1].shape
        if len(lowrank) > 2 or B != 1 or any(x.shape != (1, R) or not x.is_contiguous() or w.shape != (N, R)
                                             or not w.is_contiguous() or w.dtype != x.dtype or x.device != qkv_BC.device
                                             for x, w in lowrank):
            raise ValueError(f"conv_step_in_place: lowrank {[(tuple(x.shape), tuple(w.shape)) for x, w in lowrank]} "
                             f"for {B} rows: want one row, at most two pairs of contiguous x [1, R] and weight [N, R] "
                             f"of one N and R, in one dtype")
    else:
        N, R = 0, 1
    q, k, v = (torch.empty(B, 1, H, K, dtype=qkv_BC.dtype, device=qkv_BC.device) for _ in range(3))
    ys = [torch.empty(1, N, dtype=x.dtype, device=x.device) for x, _ in lowrank]
    if B:
        block_c = min(MAX_BLOCK_C, triton.next_power_of_2(HK))
        block_r = triton.next_power_of_2(R)
        block_n = max(1, min(LOWRANK_TILE // block_r, triton.next_power_of_2(max(N, 1))))
        blocks = max(triton.cdiv(HK, block_c), triton.cdiv(N, block_n))
        f, g = (lowrank + lowrank[-1:] * 2)[:2] if lowrank else ((q, q), (q, q))  # (not read past len(lowrank))
        yf, yg = (ys + ys[-1:] * 2)[:2] if ys else (q, q)
        _conv_step_kernel[(B, 3 + len(lowrank), blocks)](
            qkv_BC, qkv_BC.stride(0), w_q, w_k, w_v, conv_pool, rows_B.contiguous(), q, k, v, f[0], f[1], yf, g[0],
            g[1], yg, N, HK=HK, W=W, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(W), R=R, BLOCK_R=block_r,
            BLOCK_N=block_n)
    return (q, k, v, *ys)
