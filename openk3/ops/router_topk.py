"""The router's selection after its sigmoid in one Triton kernel, for forwards without gradients (issue #12).

`Router.forward` (openk3/model/model.py) turns the fp32 router logits into scores s = sigmoid(logits), picks
topk(s + bias, k) (the bias steers the selection only, spec 4), gathers the chosen scores and renormalises them. In
eager PyTorch that is about seven kernels per MoE layer (sigmoid, add, topk's two, gather, sum, div); a decode step
at batch 1 is bound by kernel launches (the H200 profile of kimi-linear-1.5b: ~17 us of router kernels per layer
around a ~2 us matmul), so after torch's sigmoid one program per token does the rest:

    for j in 0..k-1: the largest score + bias not yet taken (the lowest index among exact ties)
    w = the chosen scores, / their sum when renormalising, * scale

The sigmoid stays torch's (Triton's rounds differently in the last bit, which would move near-tie selections away
from the eager chain's). The result is the eager chain's: the same picks in the same (descending) order
(tests/ops/test_router_topk.py). The renormalising sum adds the k picks left to right, which may round the last bit
differently from torch's reduction order. Exact ties of s + bias (measure zero for real-valued logits) may pick
another of the tied experts than torch.topk does, whose order for ties is unspecified.

Triton is optional: without it `route_kernel_applies` is False and the eager chain runs. With TRITON_INTERPRET=1 in
the environment at import, the kernel runs in Triton's CPU interpreter on CPU tensors (the tests).
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
MAX_EXPERTS = 4096  # one program holds a token's E scores in registers (K3: 896)


def route_kernel_applies(scores_TE: Tensor, k: int) -> bool:
    """Whether `route_topk` runs for these scores: Triton, CUDA (or the interpreter on the CPU), fp32, no gradient
    wanted, at most MAX_EXPERTS experts. Reads shapes and flags only (no sync: fixed for a captured graph)."""
    if triton is None or scores_TE.dtype != torch.float32 or scores_TE.dim() != 2:
        return False
    if torch.is_grad_enabled() and scores_TE.requires_grad:
        return False
    if scores_TE.device.type != "cuda" and not (INTERPRET and scores_TE.device.type == "cpu"):
        return False
    return 0 < k <= scores_TE.shape[1] <= MAX_EXPERTS


if triton is not None:
    @triton.jit
    def _route_kernel(scores_ptr, bias_ptr, idx_ptr, w_ptr, scale, E, K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, RENORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        s = tl.load(scores_ptr + t * E + offs, mask=valid, other=0.0)
        sel = tl.where(valid, s + tl.load(bias_ptr + offs, mask=valid, other=0.0), float("-inf"))
        ks = tl.arange(0, BLOCK_K)
        picked = tl.zeros([BLOCK_K], dtype=tl.int64)
        weight = tl.zeros([BLOCK_K], dtype=tl.float32)
        total = 0.0
        for j in tl.static_range(K):
            best = tl.max(sel, axis=0)
            i = tl.min(tl.where(sel == best, offs, BLOCK_E), axis=0)
            wj = tl.sum(tl.where(offs == i, s, 0.0), axis=0)
            picked = tl.where(ks == j, i.to(tl.int64), picked)
            weight = tl.where(ks == j, wj, weight)
            total += wj
            sel = tl.where(offs == i, float("-inf"), sel)
        if RENORM:
            weight = weight / total
        weight = weight * scale
        tl.store(idx_ptr + t * K + ks, picked, mask=ks < K)
        tl.store(w_ptr + t * K + ks, weight, mask=ks < K)


def route_topk(scores_TE: Tensor, bias_E: Tensor, k: int, renorm: bool, scale: float) -> tuple[Tensor, Tensor]:
    """fp32 router scores [T, E] (after the sigmoid) -> (topk_idx [T, k] int64, topk_w [T, k] fp32), as
    `Router.forward` computes them (module docstring). Only where `route_kernel_applies`."""
    T, E = scores_TE.shape
    scores = scores_TE.contiguous()
    bias = bias_E.float().contiguous()
    idx = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    w = torch.empty(T, k, dtype=torch.float32, device=scores.device)
    if T:
        _route_kernel[(T,)](scores, bias, idx, w, float(scale), E, K=k, BLOCK_E=triton.next_power_of_2(E),
                            BLOCK_K=triton.next_power_of_2(k), RENORM=bool(renorm))
    return idx, w
