"""A greedy decode step's pick from its logits in one Triton kernel, for forwards without gradients (issue #12).

After the lm_head the fast decode step of greedy rows (openk3/serve/static.py `StaticDecoder._run`) wants, per row,
the token (the first index of the largest logit, as torch.argmax), its log-probability under the raw logits and
whether every logit is finite. In PyTorch that is the logits' fp32 cast, argmax, log_softmax, a gather and the
isfinite / all chain: about ten kernels and ~40 us a step at batch 1 on the H200, kimi-linear-1.5b's 32,000 logits
(`decode_probe.py timeline:1`, eleventh session), most of it single-block reductions. Here each row's logits are
split over programs of BLOCK values each; a program reduces its slice to (its largest value, the first index of
it, sum of exp(x - that value), all finite) and takes a ticket (an atomic counter per row, as ops/router_topk.py
does); the row's last program combines the slices in order:

    M = max over slices of m_i; token = the index of the first slice whose m_i == M (its first index)
    logprob = (x_token - M) - log(sum_i s_i * exp(m_i - M)) = -log(sum_i s_i * exp(m_i - M))

in fp32 from the logits as stored (bf16 promotes exactly). The token is torch.argmax's; the logprob is
log_softmax's up to the order of the sum and Triton's exp / log (a few fp32 ulps). Rows with a non-finite logit
get finite = False and an unspecified token and logprob (the engine reports them as errors).

Triton is optional: without it `greedy_pick_applies` is False and the PyTorch chain runs. With TRITON_INTERPRET=1
in the environment at import, the kernel runs in Triton's CPU interpreter on CPU tensors (the tests).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from openk3.ops.router_topk import tickets

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 2048  # logits a program reduces (kimi-linear-1.5b: 16 programs a row)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def greedy_pick_applies(logits_BV: Tensor) -> bool:
    """Whether `greedy_pick` runs for these logits: Triton, CUDA (or the interpreter on the CPU), [B, V] with
    contiguous rows in bf16 / fp16 / fp32, no gradient wanted. Shapes and flags only (no sync)."""
    if triton is None or logits_BV.dim() != 2 or logits_BV.stride(-1) != 1 or logits_BV.dtype not in DTYPES:
        return False
    if torch.is_grad_enabled() and logits_BV.requires_grad:
        return False
    return logits_BV.device.type == "cuda" or (INTERPRET and logits_BV.device.type == "cpu")


if triton is not None:
    @triton.jit
    def _greedy_kernel(logits_ptr, stride_b, part_ptr, tickets_ptr, token_ptr, logprob_ptr, finite_ptr, V,
                       BLOCK: tl.constexpr, SPLITS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        offs = j * BLOCK + tl.arange(0, BLOCK)
        valid = offs < V
        x = tl.load(logits_ptr + b * stride_b + offs, mask=valid, other=float("-inf")).to(tl.float32)
        ok = tl.sum(tl.where(valid & ((x != x) | (tl.abs(x) == float("inf"))), 1, 0), axis=0) == 0
        m = tl.max(x, axis=0)
        first = tl.min(tl.where(x == m, offs, 2 ** 30), axis=0)
        s = tl.sum(tl.where(valid, tl.exp(x - m), 0.0), axis=0)
        # the slice's partials: max, first index of it, sum of exp, finite (as floats: one row of 4 per program)
        row = part_ptr + (b * SPLITS + j) * 4
        tl.store(row, m)
        tl.store(row + 1, first.to(tl.float32))
        tl.store(row + 2, s)
        tl.store(row + 3, ok.to(tl.float32))
        tl.debug_barrier()  # every thread's stores before the atomic (ops/router_topk.py's kernel)
        ticket = tl.atomic_add(tickets_ptr + b, 1, sem="acq_rel")  # (ops/router_topk.py `tickets`)
        if ticket == SPLITS - 1:
            i = tl.arange(0, SPLITS)
            at = part_ptr + (b * SPLITS + i) * 4
            ms = tl.load(at, cache_modifier=".cg")
            firsts = tl.load(at + 1, cache_modifier=".cg")
            ss = tl.load(at + 2, cache_modifier=".cg")
            oks = tl.load(at + 3, cache_modifier=".cg")
            big = tl.max(ms, axis=0)
            winner = tl.min(tl.where(ms == big, i, SPLITS), axis=0)
            token = tl.sum(tl.where(i == winner, firsts, 0.0), axis=0)
            total = tl.sum(ss * tl.exp(ms - big), axis=0)
            tl.store(token_ptr + b, token.to(tl.int64))
            tl.store(logprob_ptr + b, -tl.log(total))
            tl.store(finite_ptr + b, tl.min(oks, axis=0) > 0.5)
            tl.store(tickets_ptr + b, 0)  # for the next call


def greedy_pick(logits_BV: Tensor, block: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens [B] int64, their fp32 log-probabilities [B], finite [B] bool) of logits [B, V] (module docstring).
    Only where `greedy_pick_applies`. block: logits a program reduces (a power of two; None = BLOCK)."""
    B, V = logits_BV.shape
    device = logits_BV.device
    tokens = torch.empty(B, dtype=torch.int64, device=device)
    logprobs = torch.empty(B, dtype=torch.float32, device=device)
    finite = torch.empty(B, dtype=torch.bool, device=device)
    if B == 0 or V == 0:
        raise ValueError(f"greedy_pick: logits {tuple(logits_BV.shape)}: want [B, V] with B, V > 0")
    block = block or min(BLOCK, triton.next_power_of_2(V))
    splits = triton.cdiv(V, block)
    # the slices' partials: SPLITS must be a power of two for the combine's arange; the extra slices are empty
    splits = triton.next_power_of_2(splits)
    part = torch.empty(B, splits, 4, dtype=torch.float32, device=device)
    _greedy_kernel[(B, splits)](logits_BV, logits_BV.stride(0), part, tickets(device, B), tokens, logprobs, finite, V,
                                BLOCK=block, SPLITS=splits)
    return tokens, logprobs, finite
