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

At decode sizes the matmul before it goes into a kernel too (`router_kernel_applies`, `router_forward`): the eager
`sigmoid(F.linear(x.float(), weight.float()))` is four or five kernels a layer at batch 1 (two casts, cuBLAS's dot
and its reduction, the sigmoid: 10.6 us a layer on the H200, kimi-linear-1.5b, `decode_probe.py modules:1`, tenth
session). The scores of one token are split over programs of a few experts each, so that every weight row is read
at once (one program per token, scoring its 32 experts and selecting, took 13.2 us a layer on the H200 at any batch
size, `decode_probe.py timeline:1`, eleventh session): each computes the fp32 dot products of x with its experts'
weight rows (both read in their own dtype and promoted: a bf16 x bf16 product is exact in fp32, so only the
summation order differs from the eager matmul) and the sigmoid 1 / (1 + exp(-z)), stores them, and takes a ticket
(an atomic counter per token); the token's last program reads all E scores back and selects: one kernel for the
whole router at any E. Up to RANK_MAX_EXPERTS the selection is one comparison of every pair (an expert's rank is
the number ahead of it), whose renormalising sum is a tree over the picks. The scores are not bit-equal to the eager
chain's (summation order, Triton's exp): within ~1e-6 relative; the picks differ only at near-ties of s + bias.
Each token's scores come from its own programs whatever the batch, so a token routes the same in a decode step, a
speculative verification and a short cached prefill. Above MAX_SCORE_MACS (T * E * D: prefill chunks, K3 at batch
>= 16) cuBLAS's matmul runs, as before.

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
# `router_forward` at most this many multiply-adds (T * E * D): every program reads its experts' weight rows, so
# at large T cuBLAS's matmul, which reads them once, is the better kernel. kimi-linear-1.5b's decode step at batch
# 64 is 3.1e6, K3's at batch 1 6.4e6; a prefill chunk of 8,192 tokens 4e8 (cuBLAS). NOTE: the crossover is not
# measured; the bound keeps every size that was (decode) on the kernel.
MAX_SCORE_MACS = 2 ** 24
# `router_forward`'s programs: each scores BLOCK_E experts of one token, the largest power of two of rows of D that
# fit in TILE elements (kimi-linear-1.5b, D = 1536: 4 experts, 8 programs a token; K3, D = 7168: 1, 896 programs),
# at most MAX_ROWS, reading CHUNK elements a step. The selection compares every pair of experts at once up to
# RANK_MAX_EXPERTS (a BLOCK x BLOCK tile), else takes the k largest one after the other.
TILE, CHUNK, MAX_ROWS, RANK_MAX_EXPERTS = 8192, 2048, 16, 64
# NOTE: one program per 16 tokens scoring all E experts with tl.dot (no ticket; the selection by rank for all its
# tokens at once) was tried in the seventeenth session and removed: `decode_probe.py variants:router` (commit
# 49b8be9; bench/results/decode_probe/seventeenth/variants_router.json; H200, 15 calls over 15 weights in a CUDA
# graph) at kimi-linear-1.5b's shape took 6.34-11.16 us a call at 1 token and 6.43-11.27 at 4 over D steps of
# 64-256, 2-4 stages and 4 / 8 warps (the same picks), against this kernel's 4.31 and 4.76; in the engine (16, 128,
# 3) batch 1 ran 0.93 ms a step against 0.89-0.90.


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
    def _select(s, bias_ptr, idx_ptr, w_ptr, t, scale, E, K: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_K: tl.constexpr, RENORM: tl.constexpr):
        """Token t's picks and weights from its scores s [BLOCK_E] (module docstring), stored at row t."""
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
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

    @triton.jit
    def _route_kernel(scores_ptr, bias_ptr, idx_ptr, w_ptr, scale, E, K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, RENORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        s = tl.load(scores_ptr + t * E + offs, mask=offs < E, other=0.0)
        _select(s, bias_ptr, idx_ptr, w_ptr, t, scale, E, K, BLOCK_E, BLOCK_K, RENORM)

    @triton.jit
    def _select_by_rank(s, bias_ptr, idx_ptr, w_ptr, t, scale, E, K: tl.constexpr, BLOCK_E: tl.constexpr,
                        RENORM: tl.constexpr):
        """`_select` for small E in one comparison: expert e's rank is the number of experts ahead of it (a larger
        score + bias, or an equal one at a lower index), so the picks are the ranks 0..K-1 in `_select`'s order;
        each is stored at its rank. The renormalising sum is a tree over the picks (not left to right)."""
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        sel = tl.where(valid, s + tl.load(bias_ptr + offs, mask=valid, other=0.0), float("-inf"))
        ahead = (sel[None, :] > sel[:, None]) | ((sel[None, :] == sel[:, None]) & (offs[None, :] < offs[:, None]))
        rank = tl.sum(ahead.to(tl.int32), axis=1)
        picked = valid & (rank < K)
        weight = s
        if RENORM:
            weight = weight / tl.sum(tl.where(picked, s, 0.0), axis=0)
        weight = weight * scale
        tl.store(idx_ptr + t * K + rank, offs.to(tl.int64), mask=picked)
        tl.store(w_ptr + t * K + rank, weight, mask=picked)

    @triton.jit
    def _router_kernel(x_ptr, x_stride, weight_ptr, scores_ptr, bias_ptr, idx_ptr, w_ptr, tickets_ptr, scale, E,
                       D: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_ALL: tl.constexpr, BLOCK_K: tl.constexpr, RANK: tl.constexpr, RENORM: tl.constexpr):
        """Program (t, j): token t's scores of experts j * BLOCK_E ... (fp32 dot products over D, sigmoid), stored;
        the last of token t's programs to finish (its ticket) then reads all E scores back and selects."""
        t = tl.program_id(0).to(tl.int64)
        es = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        valid = es < E
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        for d0 in tl.static_range(0, D, BLOCK_D):  # unrolled (D is fixed per model): every load in flight at once
            ds = d0 + tl.arange(0, BLOCK_D)
            x = tl.load(x_ptr + t * x_stride + ds, mask=ds < D, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + es[:, None] * D + ds[None, :], mask=valid[:, None] & (ds[None, :] < D),
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(scores_ptr + t * E + es, 1.0 / (1.0 + tl.exp(-acc)), mask=valid)
        # every thread's stores before the one atomic (taken by one thread); acq_rel: this program's scores are then
        # visible to whichever program takes the last ticket, and that one sees every other program's
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + t, 1, sem="acq_rel")
        if ticket == tl.num_programs(1) - 1:
            offs = tl.arange(0, BLOCK_ALL)
            s = tl.load(scores_ptr + t * E + offs, mask=offs < E, other=0.0, cache_modifier=".cg")
            if RANK:
                _select_by_rank(s, bias_ptr, idx_ptr, w_ptr, t, scale, E, K, BLOCK_ALL, RENORM)
            else:
                _select(s, bias_ptr, idx_ptr, w_ptr, t, scale, E, K, BLOCK_ALL, BLOCK_K, RENORM)
            tl.store(tickets_ptr + t, 0)  # for the next call


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


def router_kernel_applies(x_TD: Tensor, weight_ED: Tensor, k: int) -> bool:
    """Whether `router_forward` runs: `route_kernel_applies`' conditions for the scores it would make (Triton, CUDA
    or the interpreter, no gradient wanted), x [T, D] and the weight [E, D] in bf16 / fp16 / fp32 on x's device, the
    weight contiguous, and at most MAX_SCORE_MACS multiply-adds. Shapes and flags only (no sync)."""
    if triton is None or x_TD.dim() != 2 or weight_ED.dim() != 2 or x_TD.shape[1] != weight_ED.shape[1]:
        return False
    if torch.is_grad_enabled() and (x_TD.requires_grad or weight_ED.requires_grad):
        return False
    if x_TD.device != weight_ED.device or not weight_ED.is_contiguous() or x_TD.stride(-1) != 1:
        return False
    if x_TD.device.type != "cuda" and not (INTERPRET and x_TD.device.type == "cpu"):
        return False
    floats = (torch.bfloat16, torch.float16, torch.float32)
    E = weight_ED.shape[0]
    return x_TD.dtype in floats and weight_ED.dtype in floats and 0 < k <= E <= MAX_EXPERTS \
        and x_TD.numel() * E <= MAX_SCORE_MACS


def tickets(device: torch.device, n: int) -> Tensor:
    """At least n int32 zeros that a kernel counts each row's finished programs in (the last one resets its counter to
    0: `router_forward`'s, ops/greedy.py's), kept per device so that a decode step does not zero them every call.
    A larger n makes a larger buffer (doubling); every buffer made stays alive, because CUDA graphs captured with an
    earlier one keep using it (freed, its memory could be handed to another tensor).
    NOTE: not kept when made while a CUDA graph is being captured (a fill captured there runs only at replay: that
    graph then zeroes its own counters before each replay; the engine's warmup before a capture makes them first).
    Two kernels running at the same time on two streams of one device would share the counters: openk3 runs its
    forwards on one stream at a time."""
    made = _TICKETS.setdefault(device, [])
    if made and made[-1].numel() >= n:
        return made[-1]
    buffer = torch.zeros(max(n, 2 * made[-1].numel() if made else 64), dtype=torch.int32, device=device)
    if not (buffer.is_cuda and torch.cuda.is_current_stream_capturing()):
        made.append(buffer)
    return buffer


_TICKETS: dict[torch.device, list[Tensor]] = {}


def router_forward(x_TD: Tensor, weight_ED: Tensor, bias_E: Tensor, k: int, renorm: bool, scale: float,
                   blocks: tuple[int, int] | None = None, warps: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """`Router.forward` from its input x [T, D]: (topk_idx [T, k] int64, topk_w [T, k] fp32, scores [T, E] fp32),
    scores = sigmoid(x . weight^T) in fp32 (module docstring). Only where `router_kernel_applies`.
    blocks: (experts a program scores, elements of D it reads a step), powers of two, and warps: a program's warps,
    for the bench; None = the module's (TILE, CHUNK, MAX_ROWS)."""
    T, D = x_TD.shape
    E = weight_ED.shape[0]
    device = x_TD.device
    scores = torch.empty(T, E, dtype=torch.float32, device=device)
    idx = torch.empty(T, k, dtype=torch.int64, device=device)
    w = torch.empty(T, k, dtype=torch.float32, device=device)
    if not T:
        return idx, w, scores
    bias = bias_E.float().contiguous()
    if blocks is None:
        rows = max(1, TILE // D)
        block_e = min(1 << (rows.bit_length() - 1), MAX_ROWS, triton.next_power_of_2(E))
        block_d = max(16, min(triton.next_power_of_2(D), CHUNK // block_e))
    else:
        block_e, block_d = blocks
    block_all = triton.next_power_of_2(E)
    _router_kernel[(T, triton.cdiv(E, block_e))](
        x_TD, x_TD.stride(0), weight_ED, scores, bias, idx, w, tickets(device, T), float(scale), E, D, K=k,
        BLOCK_E=block_e, BLOCK_D=block_d, BLOCK_ALL=block_all, BLOCK_K=triton.next_power_of_2(k),
        RANK=block_all <= RANK_MAX_EXPERTS, RENORM=bool(renorm), num_warps=warps)
    return idx, w, scores
