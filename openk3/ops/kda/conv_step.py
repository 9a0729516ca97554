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
The same launch also runs the KDA gate's low-rank products (`lowrank`: f_b, and g_b of a low-rank output gate, each
F.linear of a [B, 128] input and a [2048, 128] weight at kimi-linear-1.5b) in more programs (a dot product per
output at one row, tl.dot tiles of 16 rows at more: tensor cores in bf16 / fp16): two launches fewer a layer, which
took ~1.9 us each on the H200 at batch 1 (`decode_probe.py timeline:1`, eleventh session) and ~2.8 us at batch 64
(cuBLAS). It also copies beta's rows contiguous (`beta`), for fla's decode kernel: at B > 1 beta is a strided view of
the fused projections' output, which fla's wrapper copied in a launch of its own (docs/engine.md, thirteenth
session: a decode step at batch 16 / 64 went from 1.74 / 2.49 to 1.66 / 2.41 ms with both).
The window's values are promoted to fp32 as stored, the weights too; the sum over the window runs in another order
than torch's (fp32 rounding apart); q, k, v are contiguous, so fla's decode kernel copies nothing. Programs of one
row touch disjoint channels. Checked in the interpreter and on the H200 (its GPU tests); timed only in whole
decode steps.

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
LOWRANK_ROWS = 16  # input rows a low-rank product's program takes at B > 1 (tl.dot's smallest tile)


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
    def _lowrank_block(x_ptr, stride_x, w_ptr, y_ptr, b, n, B, N, R: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_B: tl.constexpr, DOT_FP32: tl.constexpr):
        """y[b, n] = x[b] . w[n] in fp32 over R, rounded once to y's dtype, for this program's rows b of x and
        outputs n: a dot product per output at one row (BLOCK_B 1), else a tl.dot tile product (tensor cores in bf16 /
        fp16, fp32 FMAs in fp32)."""
        r = tl.arange(0, BLOCK_R)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * R + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R),
                    other=0.0)
        if BLOCK_B == 1:
            x = tl.load(x_ptr + r, mask=r < R, other=0.0).to(tl.float32)
            tl.store(y_ptr + n, tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(y_ptr.dtype.element_ty), mask=n < N)
        else:
            x = tl.load(x_ptr + b[:, None] * stride_x + r[None, :], mask=(b[:, None] < B) & (r[None, :] < R),
                        other=0.0)
            if DOT_FP32:  # NOTE: Triton 3.9's interpreter returns garbage for a bf16 tl.dot; the products are exact
                x, w = x.to(tl.float32), w.to(tl.float32)  # in fp32 either way
            # "ieee": an fp32 model's product in fp32, not TF32 (bf16 / fp16 inputs: their products are exact)
            y = tl.dot(x, tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
            tl.store(y_ptr + b[:, None] * N + n[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=(b[:, None] < B) & (n[None, :] < N))

    @triton.jit
    def _conv_step_kernel(qkv_ptr, stride_qkv, wq_ptr, wk_ptr, wv_ptr, pool_ptr, rows_ptr, q_ptr, k_ptr, v_ptr,
                          beta_ptr, stride_beta, beta_out_ptr, xf_ptr, wf_ptr, yf_ptr, xg_ptr, wg_ptr, yg_ptr,
                          stride_lr, B, N, HK: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr,
                          BLOCK_W: tl.constexpr, HB: tl.constexpr, BLOCK_HB: tl.constexpr, R: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                          DOT_FP32: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)  # 0 q, 1 k, 2 v; 3 and 4 the low-rank products
        blk = tl.program_id(2)
        if part < 3:
            b = pid
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
            if HB > 0:  # beta's row copied contiguous, by the row's first program
                if part == 0 and blk == 0:
                    h = tl.arange(0, BLOCK_HB)
                    tl.store(beta_out_ptr + b * HB + h, tl.load(beta_ptr + b * stride_beta + h, mask=h < HB),
                             mask=h < HB)
        else:
            # the programs of the grid's rows and blocks, counted row-major, take the (row block, output block)
            # pairs: cdiv(B, BLOCK_B) * cdiv(N, BLOCK_N) of the B * blocks
            work = pid * tl.num_programs(2) + blk
            n_blocks = tl.cdiv(N, BLOCK_N)
            if work < tl.cdiv(B, BLOCK_B) * n_blocks:
                b = (work // n_blocks) * BLOCK_B + tl.arange(0, BLOCK_B)
                n = (work % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
                if part == 3:
                    _lowrank_block(xf_ptr, stride_lr, wf_ptr, yf_ptr, b, n, B, N, R, BLOCK_R, BLOCK_B, DOT_FP32)
                else:
                    _lowrank_block(xg_ptr, stride_lr, wg_ptr, yg_ptr, b, n, B, N, R, BLOCK_R, BLOCK_B, DOT_FP32)


def check_conv_inputs(fn: str, qkv: Tensor, ws: tuple[Tensor, Tensor, Tensor], H: int, K: int) -> tuple[int, int]:
    """Raises ValueError naming the bad one unless qkv [..., 3*H*K] has contiguous channels and the q, k, v conv
    weights ws are contiguous [H*K, 1, W] of one W and one dtype on qkv's device (a kernel's branch per q, k, v needs
    one pointer type). -> (H*K, W)."""
    HK, W = H * K, ws[0].shape[-1]
    if qkv.shape[-1] != 3 * HK or qkv.stride(-1) != 1:
        want = ", ".join(["B", "T"][:qkv.dim() - 1] + [str(3 * HK)])
        raise ValueError(f"{fn}: qkv {tuple(qkv.shape)} stride {qkv.stride()}: want [{want}] with contiguous channels")
    for name, w in zip(("w_q", "w_k", "w_v"), ws):
        if w.shape != (HK, 1, W) or not w.is_contiguous() or w.dtype != ws[0].dtype or w.device != qkv.device:
            raise ValueError(f"{fn}: {name} {tuple(w.shape)} {w.dtype} on {w.device}: want contiguous [{HK}, 1, {W}] "
                             f"in {ws[0].dtype} on {qkv.device}")
    return HK, W


def conv_step_in_place(qkv_BC: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor, conv_pool: Tensor, rows_B: Tensor,
                       H: int, K: int, lowrank: list[tuple[Tensor, Tensor]] = (),
                       beta: Tensor | None = None) -> tuple[Tensor, ...]:
    """One token's short conv + SiLU for B rows whose conv tails live in a pool, the tails updated there (module
    docstring). Only where `conv_step_applies`.

    qkv_BC [B, 3*H*K]: the raw q | k | v projections (a strided view is fine: rows any stride apart, the channels
    contiguous); w_q, w_k, w_v: the conv modules' weights [H*K, 1, W]; conv_pool [N, W-1, 3*H*K] contiguous;
    rows_B [B] int64: row b's tail is conv_pool[rows_B[b]].
    lowrank: at most two (x [B, R], weight [N, R]) pairs, computed as F.linear(x, weight) in the same launch (KDA's
    f_b and g_b projections: two launches fewer a layer), in fp32, rounded once to x's dtype (a matmul's precision);
    both of one N and R, x's rows any stride apart (both pairs' the same stride, R contiguous), the weights
    contiguous in x's dtype.
    beta [B, Hb] (rows any stride apart, Hb contiguous): also copied to a contiguous [B, 1, Hb], for fla's decode
    kernel, which walks beta by pointer (a copy kernel fewer a layer at B > 1, where it is a view of the fused
    projections' output).
    -> q, k, v [B, 1, H, K] contiguous, in qkv's dtype, then each low-rank product [B, N], then beta's copy if given.
    NOTE: rows that pad a batch share the pool's scratch row (the static step's slot 0): their programs read and
    write the same tail in no fixed order, so their outputs and that row are garbage. Both are discarded (the padding
    rows' outputs are never read, the scratch row is zeroed after the step, serve/static.py `clear_scratch`); rows of
    real requests are distinct and exact."""
    B, C3 = qkv_BC.shape
    HK, W = check_conv_inputs("conv_step_in_place", qkv_BC, (w_q, w_k, w_v), H, K)
    if conv_pool.shape[1:] != (W - 1, C3) or not conv_pool.is_contiguous():
        raise ValueError(f"conv_step_in_place: conv_pool {tuple(conv_pool.shape)}: want contiguous [N, {W - 1}, {C3}]")
    if rows_B.shape != (B,) or rows_B.dtype != torch.int64:
        raise ValueError(f"conv_step_in_place: rows {tuple(rows_B.shape)} {rows_B.dtype}: want [{B}] int64")
    if beta is not None and (beta.dim() != 2 or beta.shape[0] != B or beta.stride(-1) != 1
                             or beta.device != qkv_BC.device):
        raise ValueError(f"conv_step_in_place: beta {tuple(beta.shape)} stride {beta.stride()}: want [{B}, Hb] with "
                         f"contiguous heads on {qkv_BC.device}")
    lowrank = list(lowrank)
    if lowrank:
        N, R = lowrank[0][1].shape
        if len(lowrank) > 2 or any(x.shape != (B, R) or x.stride(-1) != 1 or x.stride(0) != lowrank[0][0].stride(0)
                                   or w.shape != (N, R) or not w.is_contiguous() or w.dtype != x.dtype
                                   or x.device != qkv_BC.device for x, w in lowrank):
            shapes = [(tuple(x.shape), x.stride(), tuple(w.shape)) for x, w in lowrank]
            raise ValueError(f"conv_step_in_place: lowrank {shapes} for {B} rows: want at most two pairs of x "
                             f"[{B}, R] (rows one stride apart, R contiguous) and a contiguous weight [N, R] of one N "
                             f"and R, in one dtype")
    else:
        N, R = 0, 1
    q, k, v = (torch.empty(B, 1, H, K, dtype=qkv_BC.dtype, device=qkv_BC.device) for _ in range(3))
    ys = [torch.empty(B, N, dtype=x.dtype, device=x.device) for x, _ in lowrank]
    HB = 0 if beta is None else beta.shape[1]
    beta_out = None if beta is None else torch.empty(B, 1, HB, dtype=beta.dtype, device=beta.device)
    if B:
        block_c = min(MAX_BLOCK_C, triton.next_power_of_2(HK))
        block_b = 1 if B == 1 else LOWRANK_ROWS  # a tile product needs 16 rows (masked past B)
        block_r = triton.next_power_of_2(R) if block_b == 1 else max(16, triton.next_power_of_2(R))
        # a tile product reads as many weight bytes as a bf16 one (fp32 at 64 outputs spilled registers for sm90)
        tile = LOWRANK_TILE if block_b == 1 else LOWRANK_TILE * 2 // (lowrank[0][1].element_size() if lowrank else 2)
        block_n = max(1 if block_b == 1 else 16, min(tile // block_r, triton.next_power_of_2(max(N, 1))))
        work = triton.cdiv(B, block_b) * triton.cdiv(N, block_n)  # (row block, output block) pairs a product
        blocks = max(triton.cdiv(HK, block_c), triton.cdiv(work, B))
        f, g = (lowrank + lowrank[-1:] * 2)[:2] if lowrank else ((q, q), (q, q))  # (not read past len(lowrank))
        yf, yg = (ys + ys[-1:] * 2)[:2] if ys else (q, q)
        _conv_step_kernel[(B, 3 + len(lowrank), blocks)](
            qkv_BC, qkv_BC.stride(0), w_q, w_k, w_v, conv_pool, rows_B.contiguous(), q, k, v,
            q if beta is None else beta, 0 if beta is None else beta.stride(0), q if beta_out is None else beta_out,
            f[0], f[1], yf, g[0], g[1], yg, f[0].stride(0), B, N, HK=HK, W=W, BLOCK_C=block_c,
            BLOCK_W=triton.next_power_of_2(W), HB=HB, BLOCK_HB=triton.next_power_of_2(max(HB, 1)), R=R,
            BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_B=block_b, DOT_FP32=INTERPRET)
    return (q, k, v, *ys) + (() if beta_out is None else (beta_out,))
