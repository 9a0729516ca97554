"""The KDA layer's elementwise chains fused into fla's Triton kernels (CUDA only), for training and prefill.

Each function here computes exactly what a piece of `KimiDeltaAttention`'s reference forward computes
(openk3/model/model.py), with one kernel instead of a chain of fp32 elementwise ops over [B, T, H*K]
(measured on the H200, those chains and their casts took most of a step's GPU time; docs/training.md); conv_silu
and chunk_gated also start from a cache's state (the conv tail, the recurrent state) for a cached prefill:

    conv_silu      causal_conv_silu: depthwise causal short conv + SiLU, restarting at document starts; one
                   token after a cache's tail (a decode step) in plain PyTorch instead (`conv_silu_one_token`), or
                   over the engine's slot pool in one Triton kernel that updates the tails there (conv_step.py);
                   a chunk without gradients goes to conv_chunk.py's kernel instead (model.py `forward_fused`)
    chunk_gated    decay() + the delta rule: the gate  lb * sigmoid(exp(A_log) * (f + dt_bias))  (K3, bounded;
                   fla's `safe_gate`) or  -exp(A_log) * softplus(f + dt_bias)  (Kimi-Linear) computed inside
                   fla's chunk_kda, which also returns the gradients of A_log and dt_bias
    recurrent_gated the same gate, beta's sigmoid and the q, k L2 norms inside fla's token-by-token kernel, from a
                   cache's state (forward only): a decode step, and a cached prefill of few tokens, where
                   chunk_kda's ~2 ms of host time a call outweighs the recurrence's device time (docs/engine.md
                   "KDA from a cache, token by token"); a decode step of the engine's slot pool updates the pool's
                   rows in place (no gather, no scatter)
    gated_rms_norm the per-head o_norm times sigmoid(output gate)
    rms_norm       model.py's rms_norm in one kernel, for inference (forward only): the eager decode step ran
                   three dtype casts around each of its ~37 norms (docs/engine.md "KDA from a cache, token by token")
    add_rms_norm   a sublayer's output added to the fp32 residual stream and normed, in one kernel (inference)
    swiglu         ops/situ.py's swiglu (the Kimi-Linear MLPs and experts; K3's SiTU has no fla kernel)

Arithmetic is fp32 inside the kernels, as in the reference; the results round once to the input dtype where
the reference rounds the same values (a few ulps apart). tests/model/test_kda_backends_gpu.py (its fused=1 cases)
compares a whole model's training step (loss and every gradient) against the torch reference path on the GPU, and
its test_fused_cached_prefill_equals_one_forward cases a prefill in chunks with a state against one forward.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor


def on_device(x: Tensor):
    """The CUDA device context of x (fla's guarded wrappers enter it; its bare kernels launch on the current device)."""
    return torch.cuda.device(x.device) if x.is_cuda else nullcontext()


def conv_silu(qkv: Tensor, w_CW: Tensor, cu_seqlens: Tensor | None, tail_BWC: Tensor | None = None) -> Tensor:
    """SiLU(causal depthwise conv of qkv [B, T, C] with w [C, W]) in qkv's dtype; with cu_seqlens (over the
    flattened B*T tokens) the window stops at every document start; `tail_BWC` [B, W-1, C] holds the W-1 inputs
    before this chunk (a cache's conv tail; not with cu_seqlens)."""
    B, T, C = qkv.shape
    if T == 1 and tail_BWC is not None and cu_seqlens is None:
        # NOTE: a decode step. fla's kernel took 55 us a layer for this one token at batch 64 on the H200 (2.2 us
        # at batch 1; issue #12); here it is a few small elementwise kernels over [B, W, C]
        return conv_silu_one_token(qkv, w_CW, tail_BWC)
    from fla.modules.causal_conv1d import causal_conv1d

    if cu_seqlens is None:
        # NOTE: fla's conv state is [B, C, W], the last W inputs with the newest at index W-1; the kernel reads
        # indices 1..W-1 as the inputs before the chunk, so the tail goes there and index 0 is never read.
        init = None if tail_BWC is None else F.pad(tail_BWC.transpose(1, 2), (1, 0)).contiguous()
        y, _ = causal_conv1d(qkv, weight=w_CW, activation="silu", initial_state=init)
        return y
    if tail_BWC is not None:
        raise ValueError("conv_silu: a conv tail cannot be combined with cu_seqlens (packed documents)")
    y, _ = causal_conv1d(qkv.reshape(1, B * T, C), weight=w_CW, activation="silu", cu_seqlens=cu_seqlens)
    return y.view(B, T, C)


def conv_silu_one_token(x_B1C: Tensor, w_CW: Tensor, tail_BWC: Tensor) -> Tensor:
    """`conv_silu` of one token x [B, 1, C] after its tail [B, W-1, C] (plain PyTorch, any device; no host sync,
    so a captured decode step can hold it): SiLU(sum over the window [tail | x] of window * w), in fp32 like
    `causal_conv_silu`, in x's dtype."""
    window_BWC = torch.cat([tail_BWC, x_B1C], dim=1)
    # the product promotes a half-precision window to fp32 as it reads it (exactly), no separate cast
    y_BC = (window_BWC * w_CW.float().T).sum(1)
    return F.silu(y_BC).unsqueeze(1).to(x_B1C.dtype)


def chunk_gated(q: Tensor, k: Tensor, v: Tensor, f: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
                lower_bound: float | None, scale: float, cu_seqlens: Tensor | None,
                initial_state: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The delta rule with the decay computed from the raw gate input f [B, T, H, K] inside the kernel.
    q, k, v [B, T, H, K] (L2-normed in the kernel), beta [B, T, H] after its sigmoid -> o [B, T, H, K] and, from
    `initial_state` [B, H, K, V] fp32 (a cache's recurrent state; not with cu_seqlens), the final state [B, H, K, V]
    fp32 (else None)."""
    from fla.ops.kda import chunk_kda

    B, T, H, K = q.shape
    args = dict(scale=scale, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                dt_bias=dt_bias, safe_gate=lower_bound is not None, lower_bound=lower_bound)
    if cu_seqlens is None:
        init = None if initial_state is None else initial_state.float().contiguous()
        o, final = chunk_kda(q, k.to(q.dtype), v.to(q.dtype), f, beta.to(q.dtype), initial_state=init,
                             output_final_state=init is not None, **args)
        return o, None if final is None else final.float()
    if initial_state is not None:
        raise ValueError("chunk_gated: an initial state cannot be combined with cu_seqlens (packed documents)")
    o, _ = chunk_kda(*(t.flatten(0, 1)[None] for t in (q, k.to(q.dtype), v.to(q.dtype), f, beta.to(q.dtype))),
                     cu_seqlens=cu_seqlens, **args)
    return o.view(B, T, H, K), None


def recurrent_gated(q: Tensor, k: Tensor, v: Tensor, f: Tensor, beta_logits: Tensor, A_log: Tensor,
                    dt_bias: Tensor, lower_bound: float | None, scale: float, initial_state: Tensor,
                    state_indices: Tensor | None = None,
                    accepted: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """`chunk_gated`'s delta rule token by token from `initial_state` (forward only; fla has no backward for it):
    q, k, v [B, T, H, K] (L2-normed in the kernel), f the raw gate input [B, T, H, K], beta_logits [B, T, H] before
    their sigmoid (taken in the kernel, in fp32) -> (o [B, T, H, K], the final state [B, H, K, V] fp32).
    With `state_indices`, `initial_state` is a pool [S, H, K, V] fp32 addressed by row (the engine's slot pool) and
    the final state returned is None (it is in the pool):
    - [B] (T = 1 only): row b's state is read from the pool's row state_indices[b] and overwritten there in place
      (fla's continuous-batching mode);
    - [B, T] with `accepted` [B] int32 all equal to T (a speculative verification): row b's state is read from
      state_indices[b, T - 1] and its state after token t written to state_indices[b, t] (fla's speculative-decoding
      mode), so the state after every prefix of the tokens is kept and a rollback is a copy of one row."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    # NOTE: the kernel walks q, k, v, f by pointer over contiguous [B, T, H, K] rows and has no input guard: the
    # q | k | v split views of the conv output are copied (conv_step.py's outputs are contiguous already: no copy),
    # and the launch is put on the inputs' device here. `out`:
    # the kernel writes every row of it (its default zero-fills one first: a kernel more per layer)
    v = v.to(q.dtype).contiguous()
    args = dict(q=q.contiguous(), k=k.to(q.dtype).contiguous(), v=v, g=f.contiguous(), beta=beta_logits.contiguous(),
                A_log=A_log.float(), dt_bias=dt_bias.float(), scale=scale, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
                out=torch.empty_like(v))
    with on_device(q):
        if state_indices is not None:
            B, T = q.shape[:2]
            if state_indices.shape not in ((B,), (B, T)) or (T > 1 and state_indices.ndim == 1) \
                    or (state_indices.ndim == 2) != (accepted is not None):
                raise ValueError(f"recurrent_gated: state_indices {tuple(state_indices.shape)} (accepted "
                                 f"{'given' if accepted is not None else 'None'}) for q {tuple(q.shape)}: [B] at one "
                                 f"token a row, or [B, T] with accepted")
            if state_indices.ndim == 1:
                o = recurrent_pool_step(initial_state=initial_state, state_indices=state_indices, **args)
                if o is not None:
                    return o, None
            # for row n the kernel reads initial_state[state_indices[n, accepted[n] - 1]] (or [n]; rows
            # initial_state.stride(0) apart, the index row contiguous) and writes its state after token t to
            # initial_state[state_indices[n, t]]
            o, _ = fused_recurrent_kda_fwd(initial_state=initial_state, inplace_final_state=True,
                                           ssm_state_indices=state_indices.contiguous(),
                                           num_accepted_tokens=accepted, **args)
            return o, None
        return fused_recurrent_kda_fwd(initial_state=initial_state.float().contiguous(), inplace_final_state=False,
                                       output_final_state=True, **args)


def recurrent_block(B: int) -> tuple[int, int]:
    """(BV, warps) of fla's token-by-token kernel for a decode step of B rows (`recurrent_pool_step`).
    NOTE: measured on one H200 (`decode_probe.py recurrent`, 16 heads of 128, fp32 states from HBM, fourteenth
    session, docs/engine_h200_log.md), us a layer's call with fla's wrapper's (32, 4) -> these: batch 1 3.98 -> 2.95 (8
    programs of 16 columns a head, 128 in all, fill more of the 132 SMs than 64), 16 14.76 -> 12.67, 64 46.66 ->
    42.35 (a copy of the same states, read and written once: 33.6); the best of 12 (BV, warps) pairs from 8 to 128
    and 1 to 8 at each."""
    return (16, 1) if B <= 16 else (32, 2)


def recurrent_pool_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
                        scale: float, lower_bound: float | None, initial_state: Tensor, state_indices: Tensor,
                        out: Tensor, block_v: int | None = None, warps: int | None = None, *,
                        use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
                        use_beta_sigmoid_in_kernel: bool) -> Tensor | None:
    """One token a row through fla's token-by-token kernel over the engine's slot pool, launched here with a grid of
    `block_v` state columns a program and `warps` (fla's wrapper fixes 32 and 4; `recurrent_block` picks them by
    batch size): row n's state initial_state[state_indices[n]] updated in place. The arguments are
    `recurrent_gated`'s (contiguous, on the inputs' device; the three use_* switches must be True). -> out
    [B, 1, HV, V], or None (nothing launched) where fla's kernel does not take the arguments named below (another fla
    version): `recurrent_gated` then runs fla's wrapper, with its own grid."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd_kernel

    B, T, H, K = k.shape
    HV, V = v.shape[2:]
    bv, nw = recurrent_block(B)
    bv, nw = block_v or bv, warps or nw
    if (T != 1 or state_indices.shape != (B,) or out.shape != v.shape or bv & (bv - 1)
            or not (use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel)):
        raise ValueError(f"recurrent_pool_step: one token a row with the gate, norms and beta's sigmoid in the kernel "
                         f"and BV a power of two; got q {tuple(q.shape)}, v {tuple(v.shape)}, out {tuple(out.shape)}, "
                         f"state_indices {tuple(state_indices.shape)}, BV {bv}")
    stride = initial_state.stride(0)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, o=out, h0=initial_state,
                ht=initial_state, cu_seqlens=None, ssm_state_indices=state_indices.contiguous(),
                num_accepted_tokens=None, lower_bound=lower_bound, scale=scale, N=B, T=T, H=H, HV=HV, K=K, V=V,
                BK=1 << (K - 1).bit_length(), BV=bv, stride_init_state_token=stride, stride_final_state_token=stride,
                stride_indices_seq=1, stride_indices_tok=1, IS_BETA_HEADWISE=False, USE_QK_L2NORM_IN_KERNEL=True,
                INPLACE_FINAL_STATE=True, USE_GATE_IN_KERNEL=True, APPLY_BETA_SIGMOID=True, ALLOW_NEG_EIGVAL=False,
                STATE_V_FIRST=False)
    if not set(args) <= set(getattr(fused_recurrent_kda_fwd_kernel, "arg_names", ())):
        return None
    # NOTE: fla 0.6's kernel with the arguments its wrapper `fused_recurrent_kda_fwd` passes in the continuous-batching
    # mode (ssm_state_indices [N], in place), over a grid of (V / BV) x N x HV programs
    fused_recurrent_kda_fwd_kernel[(-(-V // bv) * B * HV,)](**args, num_warps=nw, num_stages=2)
    return out


def gated_rms_norm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm(o) * weight * sigmoid(gate) over the last dim, in o's dtype; o and gate [..., K]."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(o, gate.reshape(o.shape), weight, None, activation="sigmoid", eps=eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim with fp32 statistics, rounded once to x's dtype or
    `out_dtype` (model.py `rms_norm`, `RMSNorm.from_residual`); fla's layer-norm forward kernel, no autograd."""
    from fla.modules.norm.layernorm import layer_norm_fwd

    D = x.shape[-1]
    # NOTE: the kernel steps from row to row by D and has no input guard: a split view (GatedMLA.latent's c, whose
    # rows are r + rope apart) must be copied, or the norm reads the wrong rows
    with on_device(x):
        y, _, _, _ = layer_norm_fwd(x.reshape(-1, D).contiguous(), weight, None, eps, out_dtype=out_dtype,
                                    is_rms_norm=True)
    return y.view(x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(rms_norm(residual + x) in `dtype`, residual + x in the residual's dtype) with the sum and the statistics in
    fp32 (model.py `RMSNorm.add`, whose reference norms the sum rounded to `dtype`); fla's layer-norm forward kernel
    with its residual input, no autograd."""
    from fla.modules.norm.layernorm import layer_norm_fwd

    D = x.shape[-1]
    with on_device(x):
        y, _, _, h = layer_norm_fwd(x.reshape(-1, D).contiguous(), weight, None, eps,
                                    residual=residual.reshape(-1, D).contiguous(), out_dtype=dtype, is_rms_norm=True)
    return y.view(x.shape), h.view(residual.shape)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up in fp32, rounded to gate's dtype (ops/situ.py `swiglu`); fla's fused kernel."""
    from fla.modules.activations import swiglu as fla_swiglu

    return fla_swiglu(gate, up)
