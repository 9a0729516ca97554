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
    def _conv_step_kernel(qkv_ptr, stride_qkv, wq_ptr, wk_ptr, wv_ptr, pool_ptr, rows_ptr, q_ptr, k_ptr, v_ptr,
                          HK: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)  # 0 q, 1 k, 2 v
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        row = tl.load(rows_ptr + b)
        qkv_row = qkv_ptr + b * stride_qkv
        pool_row = pool_ptr + row * ((W - 1) * 3 * HK)
        if part == 0:
            _conv_block(qkv_row, wq_ptr, pool_row, q_ptr + b * HK, part, c, HK, W, BLOCK_W)
        elif part == 1:
            _conv_block(qkv_row, wk_ptr, pool_row, k_ptr + b * HK, part, c, HK, W, BLOCK_W)
        else:
            _conv_block(qkv_row, wv_ptr, pool_row, v_ptr + b * HK, part, c, HK, W, BLOCK_W)


def conv_step_in_place(qkv_BC: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor, conv_pool: Tensor, rows_B: Tensor,
                       H: int, K: int) -> tuple[Tensor, Tensor, Tensor]:
    """One token's short conv + SiLU for B rows whose conv tails live in a pool, the tails updated there (module
    docstring). Only where `conv_step_applies`.

    qkv_BC [B, 3*H*K]: the raw q | k | v projections (a strided view is fine: rows any stride apart, the channels
    contiguous); w_q, w_k, w_v: the conv modules' weights [H*K, 1, W]; conv_pool [N, W-1, 3*H*K] contiguous;
    rows_B [B] int64: row b's tail is conv_pool[rows_B[b]].
    -> q, k, v [B, 1, H, K] contiguous, in qkv's dtype.
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
    q, k, v = (torch.empty(B, 1, H, K, dtype=qkv_BC.dtype, device=qkv_BC.device) for _ in range(3))
    if B:
        block_c = min(MAX_BLOCK_C, triton.next_power_of_2(HK))
        _conv_step_kernel[(B, 3, triton.cdiv(HK, block_c))](
            qkv_BC, qkv_BC.stride(0), w_q, w_k, w_v, conv_pool, rows_B.contiguous(), q, k, v, HK=HK, W=W,
            BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(W))
    return q, k, v
