"""A linear layer at one to a few input rows in one Triton kernel, for forwards without gradients (issue #12).

A decode step at batch 1 runs every projection of the model as a matrix-vector product. cuBLAS's kernels for
them read the smaller weights far below the H200's bandwidth (`bench/decode_probe.py linear`, graph-replayed, each
call reading its weight from HBM, kimi-linear-1.5b, tenth session; 1 row, us a call):

    shape (in -> out)                cuBLAS    this kernel
    2048 -> 1536 (KDA o_proj)          7.90      4.78
    1536 -> 1024 (shared gate_up)     10.44      4.52
    128 -> 2048 (KDA f_b / g_b)        2.44      1.86
    512 -> 1536 (shared down)          3.47      2.04
    4096 -> 1536 (dense down)          7.64      6.84
    1536 -> 6416 (KDA input proj)      8.46     10.10   (cuBLAS: larger weights, GEMV_MAX_WEIGHT)
    1536 -> 32000 (lm_head)           26.63     35.21

One program computes BLOCK_N outputs of every row: it walks the input in BLOCK_K slices, reads each [BLOCK_N,
BLOCK_K] tile of the weight once for all T rows, and accumulates the dot products in fp32; the result is rounded
once to x's dtype (a matmul's precision: fp32 accumulation, only the summation order differs from cuBLAS). At 16
rows cuBLAS's tensor-core kernels win by far (a first probe: 3-10x), so `gemv_applies` takes at most GEMV_MAX_ROWS
rows and GEMV_MAX_WEIGHT weight elements.

Triton is optional: without it nothing here runs. With TRITON_INTERPRET=1 in the environment when this module is
imported, the kernel runs in Triton's CPU interpreter on CPU tensors (the tests).
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

# NOTE: measured on the H200 at 1, 2 and 4 rows, each call reading its weight from HBM (decode_probe.py linear, 20
# weights cycled; tenth session): at 1 row this kernel won on every weight up to 6.3M elements (o_proj 4.78 us vs
# 7.90, shared gate_up 4.52 vs 10.44, shared down 2.04 vs 3.47, f_b 1.86 vs 2.44, dense down 6.84 vs 7.64) and lost
# on the larger ones (KDA's stacked input projection, 9.9M: 10.10 vs 8.46; dense gate_up 12.6M: 12.17 vs 8.77;
# lm_head 49M: 35.21 vs 26.63), where cuBLAS reads at 2.3-3.7 TB/s. At 2 and 4 rows it won less often and by less.
# NOTE: a second kernel for 2-64 rows was tried and not kept (sixteenth session, decode_probe.py linear, JSON in
# bench/results/decode_probe/sixteenth/): tl.dot tiles of [rows, 32 columns] with K split over 2-8 programs and the
# column tile's last program (a ticket) adding the fp32 partials. Against cuBLAS at 2 / 16 / 64 rows, us a call:
# KDA o_proj 5.66 / 5.97 / 8.71 against 7.93 / 5.99 / 6.22 (its best tiles at 64 rows 7.75), shared gate_up
# 4.79 / 4.93 / 7.34 against 10.36 / 5.21 / 5.17, dense down 6.90 / 6.97 / 10.22 against 8.37 / 8.58 / 9.24, KDA
# input projection 9.71 / 9.75 / 10.49 against 8.37 / 8.45 / 8.57. In the engine, on every bf16 Linear of 2-64 rows,
# the batch-64 decode step took 2.38-2.39 ms with it against 2.29-2.30 without; batch 4 and 16 ran 2-3.5% faster
# (one run without it; runs of one code spread 1.9% at batch 16). A cap at 16 rows and on the shapes it won was not
# tried.
GEMV_MAX_ROWS = 1
GEMV_MAX_WEIGHT = 2 ** 23  # elements: above it cuBLAS
TILE = 2048  # weight elements a program reads per step (BLOCK_N x BLOCK_K): the best tiles of the probe


def gemv_applies(x: Tensor, weight: Tensor) -> bool:
    """Whether `gemv` runs for F.linear(x, weight): Triton, CUDA (or the interpreter on the CPU), no gradient wanted,
    not inside torch.compile (Inductor makes its own kernels), x [..., K] of at most GEMV_MAX_ROWS rows with a
    contiguous last dim, the weight [N, K] contiguous and of at most GEMV_MAX_WEIGHT elements, both bf16 / fp16 / fp32
    of one dtype, autocast off. Shapes and flags only."""
    if triton is None or weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return False
    if x.device.type != "cuda" and not (INTERPRET and x.device.type == "cpu"):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):
        return False  # (under autocast F.linear would compute in the autocast dtype)
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return 0 < x.numel() // max(x.shape[-1], 1) <= GEMV_MAX_ROWS and weight.numel() <= GEMV_MAX_WEIGHT \
        and weight.is_contiguous() and x.stride(-1) == 1 and x.device == weight.device


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, stride_x, K: tl.constexpr, T: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[t, n] = x[t] . w[n] in fp32 for the program's BLOCK_N outputs n and every row t < T."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N
        t = tl.arange(0, BLOCK_T)
        t_mask = t < T
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < K
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0).to(tl.float32)
            x = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=t_mask[:, None] & k_mask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w[None, :, :] * x[:, None, :], axis=2)
        tl.store(y_ptr + t[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & n_mask[None, :])


def gemv(x: Tensor, weight: Tensor, warps: int = 4) -> Tensor:
    """F.linear(x, weight) (no bias) for x [..., K] of few rows, weight [N, K] -> [..., N] in x's dtype (module
    docstring). Only where `gemv_applies`. warps: a program's warps (Triton's default 4; other values for the bench,
    `bench/decode_probe.py linear`)."""
    K = x.shape[-1]
    N = weight.shape[0]
    x_TK = x.reshape(-1, K)
    T = x_TK.shape[0]
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    block_k = min(1024 if K % 1024 == 0 else 512, triton.next_power_of_2(K))
    block_n = min(8, max(2, TILE // block_k))
    _gemv_kernel[(triton.cdiv(N, block_n),)](x_TK, weight, y, N, x_TK.stride(0), K=K, T=T,
                                             BLOCK_T=triton.next_power_of_2(T), BLOCK_N=block_n, BLOCK_K=block_k,
                                             num_warps=warps)
    return y.view(*x.shape[:-1], N)
