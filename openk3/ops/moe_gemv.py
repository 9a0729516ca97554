"""Routed experts for decode-sized token counts: two Triton GEMV kernels instead of three grouped GEMMs (issue #12).

At batch 1 the decode step's routed experts are 4 token slots against 32 experts. `moe_experts_grouped` runs three
`torch._grouped_mm` over all 32 groups plus the sort / searchsorted / index_add around them (the H200 profile of
kimi-linear-1.5b in issue #12: ~1.1 ms of a ~2.9 ms step, against ~5 us for reading the 4 chosen experts'
weights). Here every slot reads only its own expert's rows, in two launches and no sort:

- kernel 1, grid (S slots, F tiles): slot s = t*K + k of token t runs expert e = topk_idx[t, k]:
  gate = x_t . w1[e, f, :] and up = x_t . w3[e, f, :], accumulated in fp32 over D; each is rounded to x's dtype
  (the reference's matmul outputs are in x's dtype), the activation runs in fp32 on those rounded values and is
  rounded to x's dtype -> h [S, F].
- kernel 2, grid (T tokens, D tiles): for each of the token's K slots, out = h[s, :] . w2[e, d, :] in fp32,
  rounded to x's dtype, times the slot's routing weight (rounded to x's dtype, as Experts.forward gives it to every
  backend; no op for a weight in that dtype) in fp32, summed over the K slots in fp32 (slots are token-major, so a
  token's slots are adjacent: no sort, no atomics, deterministic) and cast to x's dtype.

That is the precision of openk3/ops/moe.py's docstring, so `moe_experts_gemv` has `moe_experts_loop`'s signature
and result for routing weights in x's dtype (tests/ops/test_moe_gemv.py compares them; fp32 weights are rounded
first, where the loop would multiply by them unrounded). It is forward only: `openk3.ops.moe_experts` sends a call
here only when `gemv_applies` (no gradient needed, no weight_fn, a known activation, S = T*K <= GEMV_MAX_SLOTS);
everything else runs the backend chosen once (grouped or loop). No host syncs and no data-dependent shapes, so
it runs inside the CUDA-graph capture of the decode step (openk3/serve/static.py).

A third kernel serves the grouped path at inference (`moe_experts_grouped_combined`: every forward without grad
that neither the GEMV kernels nor moe_by_expert.py's take, prefill chunks above all): after the grouped matmuls (`grouped_expert_outputs`),
`combine_slots` weights each token's K expert outputs and sums them in fp32 in one pass, where moe_experts_grouped
(which the backward needs) materialises an fp32 product of every slot and scatters it with an fp32 index_add.

The kernels compute the activation themselves, so they must know which one `act` is: `GLUSpec`, attached to the
callable as `act.glu` (openk3/model/model.py `glu_activation` does), or the plain `swiglu` / `situ_glu`
references of situ.py with their default constants.

Triton is optional (not a dependency): without it `gemv_supported` says why and nothing here runs. With
TRITON_INTERPRET=1 in the environment when this module is imported, triton.jit makes the kernels run in Triton's
CPU interpreter (slow), so they then take CPU tensors: the tests run them that way.
NOTE: the interpreter casts fp32 to bf16 by truncation, the GPU rounds to nearest; fp32 and fp16 match the GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from openk3.ops.moe import Activation, WeightFn, _check_inputs, grouped_expert_outputs
from openk3.ops.situ import situ_glu, swiglu

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# what triton.jit reads when it decorates the kernels below (at this module's import)
INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"

# NOTE: the largest S = T*K sent to the GEMV kernels. Every slot reads its whole expert (3 F x D matrices), so past
# some S a kernel that reads each used expert once wins. Measured on one H200 at kimi-linear-1.5b's shapes
# (bench/moe_gemv.py --layers 15, graph-replayed, tenth session), us a call of GEMV / by-expert (moe_by_expert.py) /
# grouped+combine: S = 4: 13.0 / 22.5 / 70.7; S = 16: 23.5 / 28.3 / 86.7; S = 64: 63.0 / 44.4 / 119.2; S = 256:
# 202.4 / 49.4 / 122.4. So GEMV up to 16 slots; between 16 and 64 (S = 32, batch 8) not measured.
GEMV_MAX_SLOTS = 16

# Tile sizes: rows of a weight matrix x elements along the dot product that one program reads per step (the
# latter capped at the dot product's length, rounded up to a power of two). A memory-bound GEMV needs many bytes in
# flight: small row tiles for many programs (kimi-linear-1.5b at batch 1: 4 slots x 512 / 4 = 512 programs in
# kernel 1, 1536 / 4 = 384 in kernel 2). Measured on one H200 (bench/moe_gemv.py --layers 15, each call reading its
# experts from HBM as a decode step's MoE layers do; docs/engine.md "Routed experts at decode sizes"): both kernels
# at batch 1 took 20.5 us with the first tiles chosen (8, 256, 8, 512), 12.9 us with these; 25.4 -> 23.5 us at 4
# tokens, 62.1 -> 62.7 at 16.
BLOCK_F, BLOCK_D1 = 4, 512  # kernel 1: F rows of w1/w3 x D
BLOCK_D, BLOCK_F2 = 4, 512  # kernel 2: D rows of w2 x F
# Warps a program of kernel 1, kernel 2: WARPS up to WARPS_MAX_SLOTS slots, else WARPS_MORE. Measured on one H200
# (bench/moe_gemv.py --tokens 1 4 --layers 15 --blocks ..., twelfth session, without a shared expert) over the warp
# pairs 2/4/8: at S = 4 (batch 1) 8, 8 took 11.5 us a call against 13.4 with Triton's default 4, 4 (2, 2: 12.4); at
# S = 16 (batch 4) 2, 2 took 20.1 against 24.6 (8, 8: 25.1). S = 5 .. 15 not measured: they get the S = 16 choice.
WARPS, WARPS_MAX_SLOTS, WARPS_MORE = (8, 8), 4, (2, 2)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

BLOCK_COMBINE = 1024  # combine_slots: elements of D a program sums (one token's row, or a tile of it)


@dataclass(frozen=True)
class GLUSpec:
    """Which gated activation act(gate, up) is, for kernels that compute it themselves (situ.py defines both)."""

    kind: str  # "swiglu" or "situ"
    beta: float = 4.0  # situ only: the gate's clamp
    linear_beta: float = 25.0  # situ only: the up's clamp

    def __post_init__(self):
        if self.kind not in ("swiglu", "situ"):
            raise ValueError(f"GLUSpec kind must be 'swiglu' or 'situ', got {self.kind!r}")
        if not (self.beta > 0 and self.linear_beta > 0):
            raise ValueError(f"GLUSpec beta and linear_beta must be positive, got {self.beta}, {self.linear_beta}")


def glu_spec(act: Activation) -> GLUSpec | None:
    """The GLUSpec of `act`: its `glu` attribute, the plain references of situ.py, else None (not known here)."""
    spec = getattr(act, "glu", None)
    if spec is not None:
        return spec
    if act is swiglu:
        return GLUSpec("swiglu")
    if act is situ_glu:
        return GLUSpec("situ")
    return None


def gemv_supported(device: torch.device | str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the GEMV kernels run on this device and dtype: (ok, reason), the reason meant to be printed."""
    device = torch.device(device)
    if triton is None:
        return False, "triton is not installed"
    if dtype not in DTYPES:
        return False, f"the Triton kernels take bf16, fp16 or fp32, not {dtype}"
    where = "the Triton GEMV kernels"
    if INTERPRET and device.type == "cpu":
        where += " in Triton's CPU interpreter (TRITON_INTERPRET=1: slow, for tests)"
    elif device.type != "cuda":
        return False, f"the Triton kernels run on CUDA, not {device.type}"
    return True, f"decode-sized calls (T*K <= {GEMV_MAX_SLOTS} slots, no grad) run {where}"


def needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def gemv_applies(x_TD: Tensor, topk_idx_TK: Tensor, topk_w_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor,
                 w3_EFD: Tensor, act: Activation, weight_fn: WeightFn | None = None) -> bool:
    """The per-call test (same arguments as the expert functions): a decode-sized forward the kernels can run.
    Only shapes and flags are read, never values, so it does not sync and is fixed for a captured graph."""
    return topk_idx_TK.numel() <= GEMV_MAX_SLOTS and kernels_apply(x_TD, topk_w_TK, w1_EFD, w2_EDF, w3_EFD, act,
                                                                   weight_fn)


def kernels_apply(x_TD: Tensor, topk_w_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor, w3_EFD: Tensor, act: Activation,
                  weight_fn: WeightFn | None) -> bool:
    """What every forward-only kernel path here and in moe_by_expert.py asks of a call, apart from its size: no
    weight_fn, an activation the kernels know, no input that needs a gradient."""
    return weight_fn is None and glu_spec(act) is not None and not needs_grad(x_TD, topk_w_TK, w1_EFD, w2_EDF, w3_EFD)


def check_kernel_call(name: str, x_TD: Tensor, topk_idx_TK: Tensor, topk_w_TK: Tensor, w1_EFD: Tensor,
                      w2_EDF: Tensor, w3_EFD: Tensor, act: Activation, weight_fn: WeightFn | None) -> GLUSpec:
    """The checks of a call to the kernels that compute the activation themselves (here and moe_by_expert.py),
    `name` their function: ValueError where they cannot run (gemv_supported), for an activation they do not know, a
    weight_fn, or inputs that need a gradient. Returns the activation's GLUSpec."""
    _check_inputs(x_TD, topk_idx_TK, topk_w_TK, w1_EFD, w2_EDF, w3_EFD)
    ok, reason = gemv_supported(x_TD.device, x_TD.dtype)
    if not ok:
        raise ValueError(f"{name} cannot run here: {reason}; use moe_experts_grouped or moe_experts_loop")
    spec = glu_spec(act)
    if spec is None:
        raise ValueError(f"{name} does not know the activation {act!r}: give it a `glu` GLUSpec attribute")
    if weight_fn is not None:
        raise ValueError(f"{name} takes no weight_fn (got {weight_fn!r}); use moe_experts_grouped")
    if needs_grad(x_TD, topk_w_TK, w1_EFD, w2_EDF, w3_EFD):
        raise ValueError(f"{name} is forward only, but an input requires grad; use moe_experts_grouped")
    return spec


if triton is not None:
    @triton.jit
    def _tanh(x):
        # NOTE: libdevice.tanh does not run under TRITON_INTERPRET (the CPU tests), and 2 sigmoid(2x) - 1 loses
        # all relative precision near 0; so the odd Taylor series below 1/8 (truncation ~1e-9 relative) and
        # (1 - e) / (1 + e), e = exp(-2|x|) <= 1 (no overflow at any |x|), above.
        a = tl.abs(x)
        x2 = x * x
        series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        e = tl.exp(-2.0 * a)
        t = (1.0 - e) / (1.0 + e)
        return tl.where(a < 0.125, series, tl.where(x < 0, -t, t))

    @triton.jit
    def glu_rounded(gate, up, dtype: tl.constexpr, SITU: tl.constexpr, beta, linear_beta):
        """act(gate, up) of fp32 dot products, in `dtype`: the reference's matmul outputs are in x's dtype, so gate
        and up are rounded to it first, then the activation runs in fp32 (situ.py) and is rounded again. Shared with
        the by-expert kernels (moe_by_expert.py): one copy of the activation's math."""
        g = gate.to(dtype).to(tl.float32)
        u = up.to(dtype).to(tl.float32)
        if SITU:
            h = beta * _tanh(g / beta) * tl.sigmoid(g) * (linear_beta * _tanh(u / linear_beta))
        else:
            h = g * tl.sigmoid(g) * u
        return h.to(dtype)

    @triton.jit
    def _gate_up_kernel(x_ptr, idx_ptr, w1_ptr, w3_ptr, w1s_ptr, w3s_ptr, h_ptr, E, S, F: tl.constexpr,
                        D: tl.constexpr, K: tl.constexpr, stride_xt, stride_xd, stride_we, stride_wf, stride_wd,
                        SITU: tl.constexpr, beta, linear_beta, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
        """h[s, f] = act(round(x_t . w1[e, f]), round(x_t . w3[e, f])) for slot s = t*K + k, e = idx[s]; the slots
        s = S + t past the S routed ones (when the grid has them: the shared expert) run token t through w1s, w3s.
        F, D, K are compile-time constants: fixed per model, so one compile per layer shape, and the loops' trip counts
        are known. NOTE: also because the interpreter (TRITON_INTERPRET, the CPU tests) with numpy 2.4 cannot loop
        `range` over a runtime int argument."""
        s = tl.program_id(0)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        if s < S:
            t = s // K
            # NOTE: ids are not range-checked (a check would sync); clamping keeps an id outside 0..E-1 from reading
            # outside the weights (its slot is then wrong, as with moe_experts_grouped). int64: e * E*F*D overflows
            # int32 at the release's sizes
            e = tl.minimum(tl.maximum(tl.load(idx_ptr + s).to(tl.int64), 0), E - 1)
            w1_at = w1_ptr + e * stride_we
            w3_at = w3_ptr + e * stride_we
        else:
            t = s - S
            w1_at = w1s_ptr
            w3_at = w3s_ptr
        f_mask = f < F
        w_rows = f[:, None].to(tl.int64) * stride_wf
        gate = tl.zeros((BLOCK_F,), dtype=tl.float32)
        up = tl.zeros((BLOCK_F,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_mask = d < D
            x = tl.load(x_ptr + t * stride_xt + d * stride_xd, mask=d_mask, other=0.0).to(tl.float32)
            mask = f_mask[:, None] & d_mask[None, :]
            w_at = w_rows + d[None, :] * stride_wd
            w1 = tl.load(w1_at + w_at, mask=mask, other=0.0).to(tl.float32)
            w3 = tl.load(w3_at + w_at, mask=mask, other=0.0).to(tl.float32)
            gate += tl.sum(w1 * x[None, :], axis=1)
            up += tl.sum(w3 * x[None, :], axis=1)
        h = glu_rounded(gate, up, h_ptr.dtype.element_ty, SITU, beta, linear_beta)
        tl.store(h_ptr + s * F + f, h, mask=f_mask)

    @triton.jit
    def _down_rows(h_ptr, w2_at, d, d_mask, stride_wd, stride_wf, F: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_F: tl.constexpr):
        """h [F] (at h_ptr) . w2 [d, :] (rows at w2_at) in fp32, for the BLOCK_D rows d."""
        w_rows = w2_at + d[:, None].to(tl.int64) * stride_wd
        out = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            f_mask = f < F
            h = tl.load(h_ptr + f, mask=f_mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_rows + f[None, :] * stride_wf, mask=d_mask[:, None] & f_mask[None, :],
                         other=0.0).to(tl.float32)
            out += tl.sum(w2 * h[None, :], axis=1)
        return out

    @triton.jit
    def _down_kernel(h_ptr, idx_ptr, topk_w_ptr, w2_ptr, w2s_ptr, y_ptr, E, S, F: tl.constexpr, D: tl.constexpr,
                     K: tl.constexpr, stride_we, stride_wd, stride_wf, SHARED: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_F: tl.constexpr):
        """y[t, d] = sum_k round(topk_w[t, k]) * round(h[t*K + k] . w2[e, d]) in fp32 (both rounded to y's dtype),
        cast to y's dtype; with SHARED, plus
        round(h[S + t] . w2s[d]) (the shared expert), added in fp32 to that cast and cast again."""
        t = tl.program_id(0)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = d < D
        dtype = y_ptr.dtype.element_ty
        y = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for k in tl.static_range(K):  # unrolled: the K experts' loads can be in flight together
            s = t * K + k
            e = tl.minimum(tl.maximum(tl.load(idx_ptr + s).to(tl.int64), 0), E - 1)
            out = _down_rows(h_ptr + s * F, w2_ptr + e * stride_we, d, d_mask, stride_wd, stride_wf, F, BLOCK_D,
                             BLOCK_F)
            # the expert's output in x's dtype (as the reference's matmul), weighted and summed in fp32
            # the routing weight rounded to x's dtype first (as Experts.forward gives it: no op for a weight in it)
            y += tl.load(topk_w_ptr + s).to(dtype).to(tl.float32) * out.to(dtype).to(tl.float32)
        if SHARED:  # the MoE's `routed + shared`, both in x's dtype
            out = _down_rows(h_ptr + (S + t) * F, w2s_ptr, d, d_mask, stride_wd, stride_wf, F, BLOCK_D, BLOCK_F)
            y = y.to(dtype).to(tl.float32) + out.to(dtype).to(tl.float32)
        tl.store(y_ptr + t * D + d, y.to(dtype), mask=d_mask)

    @triton.jit
    def _combine_kernel(out_ptr, row_ptr, w_ptr, y_ptr, S, D: tl.constexpr, K: tl.constexpr, stride_out,
                        SHARED: tl.constexpr, BLOCK_D: tl.constexpr):
        """y[t, d] = sum_k w[t*K + k] * out[row[t*K + k], d] in fp32 (k in order; w rounded to y's dtype first, as
        Experts.forward rounds it), cast to y's dtype; with SHARED,
        plus out[S + t, d] (the shared expert's output, in y's dtype) added in fp32 to that cast and cast again."""
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = d < D
        dtype = y_ptr.dtype.element_ty
        y = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for k in tl.static_range(K):  # unrolled: the K rows' loads can be in flight together
            s = t * K + k
            r = tl.load(row_ptr + s).to(tl.int64)
            y += tl.load(w_ptr + s).to(dtype).to(tl.float32) * tl.load(out_ptr + r * stride_out + d, mask=d_mask,
                                                             other=0.0).to(tl.float32)
        if SHARED:  # the MoE's `routed + shared`, both in x's dtype
            y = y.to(dtype).to(tl.float32) + tl.load(out_ptr + (S + t) * stride_out + d, mask=d_mask,
                                                     other=0.0).to(tl.float32)
        tl.store(y_ptr + t * D + d, y.to(dtype), mask=d_mask)


def check_shared(shared: tuple[Tensor, Tensor, Tensor], w1_EFD: Tensor, x_TD: Tensor) -> tuple[Tensor, ...]:
    """A shared expert's (gate [F, D], down [D, F], up [F, D]) weights for the kernels here and in moe_by_expert.py,
    made contiguous (the routed experts' strides serve them); ValueError where their shapes are not the routed
    experts' (w1_EFD [E, F, D]), or their dtype or device not w1's and x's."""
    _, F, D = w1_EFD.shape
    shared = tuple(w.contiguous() for w in shared)
    if tuple(tuple(w.shape) for w in shared) != ((F, D), (D, F), (F, D)) or \
            any(w.dtype != w1_EFD.dtype or w.device != x_TD.device for w in shared):
        raise ValueError(f"the shared expert's weights {[tuple(w.shape) for w in shared]} must be [F, D], [D, F], "
                         f"[F, D] = {[(F, D), (D, F), (F, D)]} in the experts' dtype {w1_EFD.dtype} on x's device")
    return shared


def combine_slots(out_SD: Tensor, order_S: Tensor, topk_w_TK: Tensor, block_d: int | None = None) -> Tensor:
    """The grouped path's last step in one kernel: y[t] = sum_k topk_w[t, k] * out_SD[row of slot t*K + k] in fp32
    (the weights rounded to out_SD's dtype first, as Experts.forward gives them),
    cast to out_SD's dtype, where order_S [S] is the slot of each row of out_SD (`grouped_expert_outputs`). The same
    sum as moe_experts_grouped's fp32 index_add, whose atomics add in any order; here each token's K terms add in k
    order (deterministic). One read of out_SD and one write of y: at a 64K-token prefill of kimi-linear-1.5b on the
    H200 the zeros + product + index_add + cast it replaces took ~4.6 ms a MoE layer (docs/engine.md).
    Forward only. block_d: elements of D a program sums (a power of two; None = BLOCK_COMBINE)."""
    T, K = topk_w_TK.shape
    if out_SD.shape[0] != T * K or order_S.shape != (T * K,):
        raise ValueError(f"combine_slots: out_SD {tuple(out_SD.shape)} and order_S {tuple(order_S.shape)} must both "
                         f"have T*K = {T * K} rows (topk_w {tuple(topk_w_TK.shape)})")
    # the row of each slot: the inverse of order_S
    row_S = torch.empty_like(order_S).scatter_(0, order_S, torch.arange(T * K, device=order_S.device))
    return combine_rows(out_SD, row_S, topk_w_TK, block_d)


def combine_rows(out_SD: Tensor, row_S: Tensor, topk_w_TK: Tensor, block_d: int | None = None,
                 shared: bool = False) -> Tensor:
    """`combine_slots` given the row of out_SD of each slot, row_S [S] (the inverse of its order_S), where the caller
    has it already (moe_by_expert.py's ordering kernel writes both). `shared`: out_SD has T more rows after the S
    routed ones, token t's shared expert output at row S + t, added as moe_experts_gemv's `shared` adds it."""
    T, K = topk_w_TK.shape
    D = out_SD.shape[1]
    y_TD = torch.empty((T, D), dtype=out_SD.dtype, device=out_SD.device)
    if T * K == 0:
        return y_TD.zero_()
    if out_SD.stride(1) != 1:
        out_SD = out_SD.contiguous()
    block = block_d or min(BLOCK_COMBINE, triton.next_power_of_2(D))
    _combine_kernel[(T, triton.cdiv(D, block))](out_SD, row_S, topk_w_TK.contiguous(), y_TD, T * K, D, K,
                                                out_SD.stride(0), SHARED=shared, BLOCK_D=block)
    return y_TD


def moe_experts_grouped_combined(
    x_TD: Tensor,
    topk_idx_TK: Tensor,
    topk_w_TK: Tensor,
    w1_EFD: Tensor,
    w2_EDF: Tensor,
    w3_EFD: Tensor,
    act: Activation,
    weight_fn: WeightFn | None = None,
) -> Tensor:
    """moe_experts_grouped at inference: the same grouped matmuls (`grouped_expert_outputs`), then `combine_slots`
    instead of the product, the fp32 index_add and the cast. Forward only (`moe_experts` sends a call here when no
    input needs a gradient); raises ValueError where the kernel cannot run (gemv_supported) or an input needs one."""
    _check_inputs(x_TD, topk_idx_TK, topk_w_TK, w1_EFD, w2_EDF, w3_EFD)
    ok, reason = gemv_supported(x_TD.device, x_TD.dtype)
    if not ok:
        raise ValueError(f"moe_experts_grouped_combined cannot run here: {reason}; use moe_experts_grouped")
    if needs_grad(x_TD, topk_w_TK, w1_EFD, w2_EDF, w3_EFD):
        raise ValueError("moe_experts_grouped_combined is forward only, but an input requires grad; "
                         "use moe_experts_grouped")
    out_SD, order_S, _ = grouped_expert_outputs(x_TD, topk_idx_TK, w1_EFD, w2_EDF, w3_EFD, act, weight_fn)
    return combine_slots(out_SD, order_S, topk_w_TK)


def moe_experts_gemv(
    x_TD: Tensor,
    topk_idx_TK: Tensor,
    topk_w_TK: Tensor,
    w1_EFD: Tensor,
    w2_EDF: Tensor,
    w3_EFD: Tensor,
    act: Activation,
    weight_fn: WeightFn | None = None,
    blocks: tuple[int, int, int, int] | None = None,
    warps: tuple[int, int] | None = None,
    shared: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """Same as moe_experts_loop (forward only), with the two Triton kernels of the module docstring.

    x_TD: [T, D]. topk_idx_TK: [T, K]. topk_w_TK: [T, K] (any float dtype: rounded to x's in the kernel, as
    Experts.forward rounds it before every backend). w1_EFD, w3_EFD: [E, F, D]. w2_EDF: [E, D, F].
    act: a callable `glu_spec` knows. Returns y_TD: [T, D] in x's dtype.
    blocks: (BLOCK_F, BLOCK_D1, BLOCK_D, BLOCK_F2) tile sizes (powers of two), warps: the warps of a program of each
    kernel; for the bench; None = the module's (BLOCK_*; WARPS, or WARPS_MORE past WARPS_MAX_SLOTS slots).
    shared: a shared expert's (gate [F, D], down [D, F], up [F, D]) weights (a plain MoE's, of the routed experts'
    F): every token also runs through it as one more slot, and y is then the MoE's `routed + shared`, each rounded to
    x's dtype and added in fp32, as `MoE.forward` adds them: two launches for both (model.py `MoE.experts_with_shared`).
    Raises ValueError where the kernels cannot run (gemv_supported), for an activation they do not know, a
    weight_fn, or inputs that need a gradient (nothing here is differentiable).
    """
    spec = check_kernel_call("moe_experts_gemv", x_TD, topk_idx_TK, topk_w_TK, w1_EFD, w2_EDF, w3_EFD, act,
                             weight_fn)
    T, D = x_TD.shape
    E, F, _ = w1_EFD.shape
    block_f, block_d1, block_d, block_f2 = blocks or (BLOCK_F, min(BLOCK_D1, triton.next_power_of_2(D)), BLOCK_D,
                                                      min(BLOCK_F2, triton.next_power_of_2(F)))
    K = topk_idx_TK.shape[1]
    S = T * K
    if S == 0:
        return torch.zeros((T, D), dtype=x_TD.dtype, device=x_TD.device)
    # one set of strides serves the gate and up matrices of every expert (and the down matrices theirs)
    w1_EFD, w3_EFD, w2_EDF = (w.contiguous() for w in (w1_EFD, w3_EFD, w2_EDF))
    w1s, w2s, w3s = check_shared(shared, w1_EFD, x_TD) if shared is not None else (w1_EFD, w2_EDF, w3_EFD)
    idx_S = topk_idx_TK.contiguous()
    w_S = topk_w_TK.contiguous()
    h_SF = torch.empty((S + (T if shared is not None else 0), F), dtype=x_TD.dtype, device=x_TD.device)
    y_TD = torch.empty((T, D), dtype=x_TD.dtype, device=x_TD.device)
    situ = spec.kind == "situ"
    warps1, warps2 = warps or (WARPS if S <= WARPS_MAX_SLOTS else WARPS_MORE)
    _gate_up_kernel[(h_SF.shape[0], triton.cdiv(F, block_f))](
        x_TD, idx_S, w1_EFD, w3_EFD, w1s, w3s, h_SF, E, S, F, D, K, *x_TD.stride(), *w1_EFD.stride(),
        SITU=situ, beta=float(spec.beta), linear_beta=float(spec.linear_beta), BLOCK_F=block_f, BLOCK_D=block_d1,
        num_warps=warps1)
    _down_kernel[(T, triton.cdiv(D, block_d))](
        h_SF, idx_S, w_S, w2_EDF, w2s, y_TD, E, S, F, D, K, *w2_EDF.stride(), SHARED=shared is not None,
        BLOCK_D=block_d, BLOCK_F=block_f2, num_warps=warps2)
    return y_TD
