"""A prefill chunk's short conv + SiLU in one Triton kernel that writes q, k and v apart, for forwards without
gradients (issue #12).

A cached forward of many tokens (`KimiDeltaAttention.forward_fused`, openk3/model/model.py) ran fla's
`causal_conv1d` over the q | k | v projections: a strided view of the fused projections' output, which fla's input
guard copied contiguous first, and whose output's q, k, v split views `chunk_kda`'s guard copied again. In a
captured prefill of 16 x 512 tokens on the H200 those copies were 60 of a forward's kernels and 1.6 ms of its
29.4 ms (docs/engine_h200_log.md, thirteenth session). Here one launch reads the projections where they are and writes
contiguous q, k, v [B, T, H, K]:

    y[b, t, c] = silu(sum_{s < W} x[b, t - s, c] * w[c, W-1-s])      in fp32 (s = 0 first, as `causal_conv_silu`),
                                                                     rounded once to x's dtype

where x[b, t - s] for t - s < 0 is the conv tail's (`tail`, the W-1 inputs before the chunk; zero without one),
promoted to fp32 as stored. One program a (token block, q/k/v channel block, row). The tail is only read: the caller
writes the new one (`KimiDeltaAttention.conv_tail`), so no program races another. Training keeps fla's kernel (it
has the backward). Checked against `causal_conv_silu` in the interpreter and on the H200 (tests/ops/test_conv_chunk.py;
fifteenth session: a 64K-token prompt in 0.650 s against 0.683 s with fla's conv and its copies, one run each,
docs/engine.md). Triton is optional; without it `conv_chunk_applies` is False.
"""

from __future__ import annotations

import torch
from torch import Tensor

from openk3.ops.kda.conv_step import check_conv_inputs, conv_step_supported, triton

if triton is not None:
    import triton.language as tl

BLOCK_T, BLOCK_C = 32, 128  # tokens x channels a program (4 warps); one compile for every T


def conv_chunk_applies(qkv: Tensor, tail: Tensor | None, weights: tuple[Tensor, ...] = ()) -> bool:
    """Whether `conv_chunk` runs here: Triton on CUDA (or its interpreter on the CPU) for qkv's and the tail's
    dtypes, their channels contiguous, one device, and no gradient wanted of qkv, the tail or the conv `weights`.
    Reads shapes and flags only (no sync)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (qkv, tail, *weights)):
        return False
    if qkv.stride(-1) != 1 or (tail is not None and (tail.stride(-1) != 1 or tail.device != qkv.device)):
        return False
    return conv_step_supported(qkv.device, qkv.dtype) and (tail is None or conv_step_supported(tail.device, tail.dtype))


if triton is not None:
    @triton.jit(do_not_specialize=["T"])
    def _conv_chunk_kernel(x_ptr, stride_xb, stride_xt, wq_ptr, wk_ptr, wv_ptr, tail_ptr, stride_tb, stride_tw,
                           q_ptr, k_ptr, v_ptr, T, HK: tl.constexpr, W: tl.constexpr, HAS_TAIL: tl.constexpr,
                           C_BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        b = tl.program_id(2).to(tl.int64)
        part = tl.program_id(1) // C_BLOCKS  # 0 q, 1 k, 2 v
        c = (tl.program_id(1) % C_BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        c_ok = c < HK
        t_ok = t < T
        ch = part * HK + c  # the channel in x and the tail
        if part == 0:
            w_ptr = wq_ptr
            out_ptr = q_ptr
        elif part == 1:
            w_ptr = wk_ptr
            out_ptr = k_ptr
        else:
            w_ptr = wv_ptr
            out_ptr = v_ptr
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for s in tl.static_range(W):  # s tokens back
            src = t - s
            x = tl.load(x_ptr + b * stride_xb + src[:, None] * stride_xt + ch[None, :],
                        mask=(t_ok & (src >= 0))[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            if HAS_TAIL:  # the tail's position W-1+src for src < 0 (the masks are disjoint: one of the two is 0)
                x += tl.load(tail_ptr + b * stride_tb + (src + W - 1)[:, None] * stride_tw + ch[None, :],
                             mask=(t_ok & (src < 0))[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c * W + (W - 1 - s), mask=c_ok, other=0.0).to(tl.float32)
            acc += x * w[None, :]
        y = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (b * T + t)[:, None] * HK + c[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & c_ok[None, :])


def conv_chunk(qkv: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor, tail: Tensor | None, H: int,
               K: int) -> tuple[Tensor, Tensor, Tensor]:
    """The short conv + SiLU of a chunk (module docstring). Only where `conv_chunk_applies`.

    qkv [B, T, 3*H*K]: the raw q | k | v projections (rows and batches any stride apart, channels contiguous: a view
    of the fused projections' output is fine); w_q, w_k, w_v: the conv modules' weights [H*K, 1, W] contiguous;
    tail [B, W-1, 3*H*K] (channels contiguous) or None (zeros before the chunk).
    -> q, k, v [B, T, H, K] contiguous in qkv's dtype."""
    B, T, C3 = qkv.shape
    HK, W = check_conv_inputs("conv_chunk", qkv, (w_q, w_k, w_v), H, K)
    if tail is not None and (tail.shape != (B, W - 1, C3) or tail.stride(-1) != 1 or tail.device != qkv.device):
        raise ValueError(f"conv_chunk: tail {tuple(tail.shape)} stride {tail.stride()} on {tail.device}: want "
                         f"[{B}, {W - 1}, {C3}] with contiguous channels on {qkv.device}")
    q, k, v = (torch.empty(B, T, H, K, dtype=qkv.dtype, device=qkv.device) for _ in range(3))
    if B and T:
        block_c = min(BLOCK_C, triton.next_power_of_2(HK))
        c_blocks = triton.cdiv(HK, block_c)
        _conv_chunk_kernel[(triton.cdiv(T, BLOCK_T), 3 * c_blocks, B)](
            qkv, qkv.stride(0), qkv.stride(1), w_q, w_k, w_v, qkv if tail is None else tail,
            0 if tail is None else tail.stride(0), 0 if tail is None else tail.stride(1), q, k, v, T, HK=HK, W=W,
            HAS_TAIL=tail is not None, C_BLOCKS=c_blocks, BLOCK_T=BLOCK_T, BLOCK_C=block_c)
    return q, k, v

