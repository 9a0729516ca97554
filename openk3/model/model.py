"""The K3 network, top to bottom (K3_SPEC sections 1-4).

Embedding -> 93 decoder layers (KDA or gated MLA token mixer, then a dense FFN or a Stable LatentMoE),
wired by Block Attention Residuals -> final norm -> lm_head. The same code runs Kimi-Linear configs:
every K3 addition is switched by a config field, absent = Kimi-Linear behaviour.

Parameter names are the checkpoint's (HF) names without the `language_model.` prefix, except the routed
experts, which live stacked as `experts.w1 [E, F, D]`; `checkpoint.py` holds the one name-mapping table.

Precision (STYLE rule 7): the residual stream (AttnRes prefix and bank) is fp32; RMSNorm, router scores,
KDA gates, conv, recurrent state, AttnRes mixing, attention scores with their softmax and the loss compute
in fp32. Matmuls run in the parameters' dtype.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

from openk3.config import K3Config
from openk3.model.state import K3Cache, KDAState, MLAState, SlotKDAState
from openk3.ops import moe_experts, small_experts_kernel
from openk3.ops.attnres import attnres_mix
from openk3.ops.kda import fused as kda_fused
from openk3.ops.kda import select_kda_backend
from openk3.ops.gemv import gemv, gemv_applies as linear_gemv_applies
from openk3.ops.kda.conv_chunk import conv_chunk, conv_chunk_applies
from openk3.ops.kda.conv_step import conv_step_applies, conv_step_in_place
from openk3.ops.mla_decode import latent_attention, paged_latent_attention
from openk3.ops.moe import route
from openk3.ops.moe_gemv import GLUSpec
from openk3.ops.router_topk import route_kernel_applies, route_topk, router_forward, router_kernel_applies
from openk3.ops.mxfp import fake_quant_mxfp4, fake_quant_mxfp8
from openk3.ops.situ import situ_glu, swiglu


# Tensors the release stores in fp32 and that stay fp32 whatever dtype the rest of the model has (K3_SPEC section 6):
# the model computes with them in fp32 (.float() where they are used), and rounding o_norm alone to bf16 moves K3's
# logits by ~3e-3. `K3ForCausalLM.cast` keeps them; checkpoint.py stores them in fp32. Suffixes of state_dict names.
FP32_TENSORS = ("self_attn.o_norm.weight", "conv1d.weight", "self_attn.dt_bias", "self_attn.A_log",
                "gate.e_score_correction_bias")


def keeps_fp32(name: str) -> bool:
    """Whether the model tensor `name` (a state_dict name) stays fp32 in a model of any dtype."""
    return name.endswith(FP32_TENSORS)


def recomputed(fn, *args):
    """fn(*args), keeping only the inputs for backward and running fn again there. For the cheap fp32 elementwise
    chains (norms, AttnRes mixes, SiTU, the short conv) whose saved intermediates would cost far more memory than
    their recompute costs time (k3-1b on the CPU: saved activations 7.7 -> 5.0 MB a token; docs/training.md)."""
    if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


# A KDA forward from a cache over at most this many tokens (batch x new tokens) runs fla's token-by-token kernel, not
# chunk_kda: on the H200 chunk_kda's wrapper costs 1.6-2.1 ms of host time a call at any length, the recurrence's
# device time 0.27 ms at 1 token, 0.46 ms at 257 and 0.78 ms at 512 (batch 1; docs/engine.md "KDA from a cache,
# token by token")
RECURRENT_MAX_TOKENS = 1024
# The reference chain (no fused kernels, or `keep_inputs`) runs a forward from a cache over at most this many new
# tokens a row token by token too: a speculative verification (num_draft_tokens + 1) then runs the kernel its
# rollback recomputes with (serve/cache.py `rollback_kda`), and inside the fast path's captured verify step
# (serve/static.py) no chunked kernel pads 5 tokens to a chunk of 64
RECURRENT_SEGMENT_TOKENS = 16


@torch.compiler.disable
def outside_graph(fn, *args, **kwargs):
    """fn(*args, **kwargs), run eagerly when a torch.compile'd region calls it (a graph break; train/compile.py).
    NOTE: for the KDA kernels of a forward without a cache (training). fla's are Triton kernels already (nothing for Inductor to fuse; fla wraps most of them
    in torch.compiler.disable itself), and the CPU's chunked reference reads every packed document's length back to
    the host, which inside a compiled layer would compile it again for every new packing."""
    return fn(*args, **kwargs)


def fla_inference(x: Tensor) -> bool:
    """Whether an op on x runs fla's forward-only kernel: inference (no grad, not inside torch.compile) where fla's
    fused KDA backend runs (CUDA)."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling() and select_kda_backend(x.device).fused


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight with fp32 statistics, in x's dtype. F.rms_norm is one op (a fused
    kernel where torch has one) and on the CPU bit-identical to the three-op formula."""
    if fla_inference(x):
        return kda_fused.rms_norm(x, weight, eps)  # inference with fla: one kernel instead of four (casts)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return recomputed(rms_norm, x, self.weight, self.eps)

    def from_residual(self, h: Tensor, dtype: torch.dtype) -> Tensor:
        """This norm of the residual stream h (fp32) rounded to `dtype`. With fla at inference one kernel that norms
        h itself (the cast's launch saved; one rounding fewer, as `add`)."""
        if fla_inference(h):
            return kda_fused.rms_norm(h, self.weight, self.eps, out_dtype=dtype)
        return self(h.to(dtype))

    def add(self, x: Tensor, residual: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """A sublayer's output x added to the residual stream, and the sum normed for the next sublayer: (this
        norm of (residual + x) in `dtype`, residual + x in the residual's dtype, fp32). With fla at inference one
        kernel instead of three (the add, the cast, the norm: a decode step of kimi-linear-1.5b runs 16 of them),
        which norms the fp32 sum itself where the reference norms its rounding to `dtype`: one rounding fewer, ~1
        ulp of `dtype` apart (ops/kda/fused.py `add_rms_norm`; the same in an fp32 model)."""
        if fla_inference(x):
            return kda_fused.add_rms_norm(x, residual, self.weight, self.eps, dtype)
        h = residual + x
        return self(h.to(dtype)), h


def glu_activation(config: K3Config):
    """SiTU-GLU when the config says "situ" (K3), else SwiGLU (Kimi-Linear). The callable's `glu` attribute names
    it and its constants for kernels that compute it themselves (openk3/ops/moe_gemv.py)."""
    if config.hidden_act == "situ":
        b, lb = config.activation_situ_beta, config.activation_situ_linear_beta

        def situ_any(gate: Tensor, up: Tensor) -> Tensor:
            return recomputed(situ_glu, gate, up, b, lb)
        situ_any.glu = GLUSpec("situ", b, lb)
        return situ_any

    def swiglu_any(gate: Tensor, up: Tensor) -> Tensor:
        # fla's fused SwiGLU (fp32 inside, like swiglu; one kernel forward, one backward) wherever fla's fused
        # KDA path runs; elsewhere the recomputed reference
        if gate.is_cuda and select_kda_backend(gate.device).fused:
            return kda_fused.swiglu(gate, up)
        return recomputed(swiglu, gate, up)
    swiglu_any.glu = GLUSpec("swiglu")
    return swiglu_any


class Linear(nn.Linear):
    """`nn.Linear` whose forward at one input row without grad (a batch-1 decode step) runs ops/gemv.py's Triton
    kernel where it can (CUDA, no autocast, not compiling): cuBLAS read some of these weights at 0.3-0.8 TB/s on the
    H200 (ops/gemv.py). Same parameters, names and state dict as nn.Linear; everything else runs F.linear."""

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None and linear_gemv_applies(x, self.weight):
            return gemv(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear(x, weight) through `gemv` where it applies (`Linear`)."""
    return gemv(x, weight) if linear_gemv_applies(x, weight) else F.linear(x, weight)


@dataclass
class FusedLinears:
    """Inference only (issue #12): a COPY of the weights of a module's Linear submodules that read the same input,
    stacked [sum(sizes), in], and the output each part stands for (`keys`, widths `sizes`; a part may stack several
    modules, as KDA's "qkv"). openk3/model/fused.py attaches it as `module.fused_linears` and keeps it in sync with
    the parameters; `fused_outputs` reads it while it is `active`."""

    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    weight: Tensor
    # NOTE: True only during a forward of the engine's runner, which refreshes the copy first
    # (`FusedProjections.applied`): any other forward of the model (an evaluation under no_grad right after an
    # optimizer step) runs the modules and never reads a copy that may be stale
    active: bool = False


def fused_outputs(module: nn.Module, x: Tensor) -> dict[str, Tensor] | None:
    """{key: output} of the module's input projections from ONE matmul over their stacked weights, then a split:
    a batch-1 decode step is bound by kernel launches, one GEMV per projection (issue #12; Inductor does not merge
    matmuls horizontally). None without an active `FusedLinears` or under autograd: the caller then runs the
    modules themselves, so training, gradients and FSDP2 (which gathers a module's weight only in its own call) never
    see the copy. NOTE: the outputs are views into one [..., sum(sizes)] tensor."""
    fused = module.fused_linears
    if fused is None or not fused.active or torch.is_grad_enabled():
        return None
    return dict(zip(fused.keys, linear(x, fused.weight).split(fused.sizes, dim=-1)))


def project(module: nn.Module, key: str, x: Tensor, outs: dict[str, Tensor] | None) -> Tensor:
    """`module.<key>(x)`, or its output taken from `outs` (`fused_outputs`) when there is one."""
    return getattr(module, key)(x) if outs is None else outs[key]


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x), up(x))). The dense first layers and the (fused) shared experts."""

    # inference-only stacked input projections (openk3/model/fused.py); a class default, so the unfused path's lookup
    # is a plain attribute read (a missing attribute costs ~2 us through nn.Module.__getattr__ on this CPU)
    fused_linears: FusedLinears | None = None

    def __init__(self, config: K3Config, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.act = glu_activation(config)

    def forward(self, x: Tensor, outs: dict[str, Tensor] | None = None) -> Tensor:
        """`outs`: gate_proj's and up_proj's outputs from a fused matmul of the caller (a LatentMoE stacks them with
        its down projection); default: at most GEMV_MLP_TOKENS tokens without grad, the routed experts' GEMV
        kernels (`gemv`), else this module's own `fused_outputs`, else its Linear calls."""
        if outs is None and (y := self.gemv(x)) is not None:
            return y
        outs = fused_outputs(self, x) if outs is None else outs
        return self.down_proj(self.act(project(self, "gate_proj", x, outs), project(self, "up_proj", x, outs)))

    def gemv(self, x: Tensor) -> Tensor | None:
        """The MLP as one expert through the routed experts' two GEMV kernels (ops/moe_gemv.py: every token routed
        to expert 0, the MLP's own weights viewed as [1, ...], with weight 1), or None where they do not run (more
        than GEMV_MLP_TOKENS tokens, a gradient wanted, autocast on (the Linear calls then compute in its dtype), no
        GEMV backend for this device and dtype). Same numerics
        contract as the Linear calls (each projection rounded to x's dtype, the activation in fp32 on the rounded
        values, the down projection accumulated in fp32): only the summation order differs. On the H200 at batch 1
        cuBLAS ran kimi-linear-1.5b's shared expert (1536 -> 2 x 512 -> 1536) as three kernels of 14.8 us a layer
        together, its gate/up GEMV at ~0.3 TB/s (`decode_probe.py modules:1`, tenth session)."""
        x_TD = x.reshape(-1, x.shape[-1])
        if x_TD.shape[0] > GEMV_MLP_TOKENS or torch.is_grad_enabled() or torch.is_autocast_enabled(x_TD.device.type):
            return None
        weights = (self.gate_proj.weight[None], self.down_proj.weight[None], self.up_proj.weight[None])
        if any(p.dtype != x_TD.dtype for p in weights):
            return None
        idx, w = one_expert_route(x_TD)
        # (one token slot a token, at most GEMV_MLP_TOKENS: the GEMV kernels wherever the backend has them)
        kernel = small_experts_kernel(x_TD, idx, w, *weights, self.act)
        return None if kernel is None else kernel(x_TD, idx, w, *weights, self.act).view(*x.shape[:-1], -1)


# NOTE: `MLP.gemv` up to this many tokens. Measured on the H200 at batch 1 only (tenth session); at 16 tokens the
# kernels would read the MLP's weights once per token (L2 may serve the repeats: not measured)
GEMV_MLP_TOKENS = 4
_ONE_EXPERT: dict = {}


def one_expert_route(x_TD: Tensor) -> tuple[Tensor, Tensor]:
    """(idx [T, 1] int64 zeros, w [T, 1] ones in x's dtype): every token to expert 0 with weight 1 (`MLP.gemv`),
    slices of tensors made once per device and dtype, so a decode step does not fill them each time.
    NOTE: not kept when made while a CUDA graph is being captured: a fill captured there runs only at replay."""
    key = (x_TD.device, x_TD.dtype)
    made = _ONE_EXPERT.get(key)
    if made is None:
        made = (torch.zeros(GEMV_MLP_TOKENS, 1, dtype=torch.int64, device=x_TD.device),
                torch.ones(GEMV_MLP_TOKENS, 1, dtype=x_TD.dtype, device=x_TD.device))
        if not (x_TD.is_cuda and torch.cuda.is_current_stream_capturing()):
            _ONE_EXPERT[key] = made
    T = x_TD.shape[0]
    return made[0][:T], made[1][:T]


# ------------------------------------------------------------------------------------ token mixers

def segment_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """Position of every packed token inside its own sequence. cu_seqlens [N+1] -> [total] int64."""
    starts = torch.zeros(total, dtype=torch.long, device=cu_seqlens.device)
    starts[cu_seqlens[1:-1]] = 1
    seg = starts.cumsum(0)
    return torch.arange(total, device=cu_seqlens.device) - cu_seqlens[seg]


def causal_conv_silu(x_BTC: Tensor, w_C1W: Tensor, pos_BT: Tensor | None, tail_BWC: Tensor | None) -> Tensor:
    """Depthwise causal conv (width W) then SiLU, in fp32. `pos_BT` (position inside the document) stops the
    window at document starts; `tail_BWC` holds the W-1 inputs before this chunk (decode cache)."""
    W = w_C1W.shape[-1]
    x = x_BTC.float()
    T = x.shape[1]
    if tail_BWC is not None:
        x = torch.cat([tail_BWC.float(), x], dim=1)
    else:
        x = F.pad(x, (0, 0, W - 1, 0))
    w = w_C1W.float()[:, 0, :]  # [C, W]; w[:, W-1] multiplies the current token
    y = torch.zeros_like(x_BTC, dtype=torch.float32)
    for s in range(W):  # s = how many tokens back
        xs = x[:, W - 1 - s: W - 1 - s + T]
        if pos_BT is not None and s > 0:
            xs = xs * (pos_BT >= s).unsqueeze(-1)
        y = y + xs * w[:, W - 1 - s]
    return F.silu(y)


def document_causal_mask(cu_seqlens: Tensor, B: int, T: int) -> Tensor:
    """[B, 1, T, T] bool: causal within each packed document (cu_seqlens over the flattened B*T tokens)."""
    pos = segment_positions(cu_seqlens.long(), B * T).view(B, T)
    seg = (pos == 0).long().view(-1).cumsum(0).view(B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


# SDPA's kernels in order of preference. On CUDA cuDNN's kernel takes MLA's qk width (192) apart from its v width
# (128), which flash cannot; measured on the H200 at [2, 16, 2048], causal bf16: cuDNN 0.15 ms, memory-efficient
# 0.37 ms (docs/training.md).
SDPA_DEFAULT = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SDPA_ORDER = {"cuda": [SDPBackend.CUDNN_ATTENTION, *SDPA_DEFAULT]}


def varlen_causal_kwargs(fn) -> dict:
    """How `fn` (torch's varlen_attn) is asked for causal attention. NOTE: torch 2.10 names it `is_causal=True`;
    later versions replaced that with `window_size=(-1, 0)` (and refuse is_causal)."""
    return {"window_size": (-1, 0)} if "window_size" in inspect.signature(fn).parameters else {"is_causal": True}


VARLEN_CAUSAL = varlen_causal_kwargs(varlen_attn) if varlen_attn is not None else {}


def varlen_attention_runs(q: Tensor) -> bool:
    """Whether torch's varlen flash attention can take q (CUDA, bf16 or fp16)."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and varlen_attn is not None


def varlen_causal_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int,
                            scale: float, keys: tuple[Tensor, int] | None = None) -> Tensor:
    """Causal attention within packed documents through torch's varlen flash kernel: q [B, T, H, qd], k [B, S, H, qd],
    v [B, S, H, vd] -> [B, T, H, vd]. Flash needs one head width, so v is zero-padded to qd and the output cut back.
    `keys` (cu_seqlens over the B*S keys, longest key run; default: the queries' own) for documents with more keys
    than queries: flash's causal mask is then aligned to the last key (query t of a T-query, S-key document sees
    keys 0..S-T+t), which is a cached prefill's attention (`GatedMLA.attend_expanded`)."""
    B, T, H, qd = q.shape
    S, vd = k.shape[1], v.shape[-1]
    cu_k, max_k = keys if keys is not None else (cu_seqlens, max_len)
    if vd < qd:
        v = F.pad(v, (0, qd - vd))
    o = varlen_attn(q.reshape(B * T, H, qd), k.reshape(B * S, H, qd), v.reshape(B * S, H, qd), cu_seqlens,
                    cu_k, max_len, max_k, scale=scale, **VARLEN_CAUSAL)
    return o[..., :vd].view(B, T, H, vd)


# Opt-in (=1): a cached chunk's attention through cuDNN (`prefix_causal_attention`). NOTE: cuDNN builds an execution
# plan for every new shape, and a cached chunk's shape (T new tokens, S keys) is new for nearly every prompt length and
# prefix hit: on the H200 a first call at a new shape took 126-1,605 ms, a repeat 0.3-8 ms against varlen flash's 0.4-20
# ms (docs/engine_h200_log.md, eighth session). It pays where shapes repeat (long prompts in full chunks: S = n x
# chunk), not for a server's varied prompts; hence off by default. TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (torch's ragged
# cuDNN path, meant to avoid the rebuilds) made every first call ~73 ms instead (72.5-75.5 ms at the five shapes that
# took 78-1,597 ms without it; ninth session): still far above flash's, so still off.
CUDNN_PREFIX_ENV = "OPENK3_CUDNN_PREFIX_ATTENTION"


def cudnn_attention_runs(q: Tensor, v: Tensor) -> bool:
    """Whether `prefix_causal_attention` takes q [.., qd] and v [.., vd]: asked for (`CUDNN_PREFIX_ENV`=1), cuDNN's
    fused attention with its log-sum-exp (`_scaled_dot_product_cudnn_attention`) on a Hopper GPU (sm90, where it was
    measured and tested), bf16 or fp16, head widths multiples of 8 up to 256, cuDNN's SDPA not turned off
    (`torch.backends.cuda.enable_cudnn_sdp(False)`), and nothing needing a gradient: cuDNN's log-sum-exp carries
    none, so a merge's backward would be wrong."""
    return (os.environ.get(CUDNN_PREFIX_ENV) == "1" and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and all(d % 8 == 0 and d <= 256 for d in (q.shape[-1], v.shape[-1]))
            and not (torch.is_grad_enabled() and (q.requires_grad or v.requires_grad))
            and torch.cuda.get_device_capability(q.device)[0] == 9)


def merge_attention(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """Attention over two disjoint key sets from each one's output [B, H, T, vd] and log-sum-exp [B, H, T]: each
    output weighted by its share of the softmax's normaliser, in fp32, cast to o1's dtype."""
    w1 = torch.sigmoid(lse1 - lse2)[..., None]  # e^lse1 / (e^lse1 + e^lse2), without overflow
    return torch.lerp(o2.float(), o1.float(), w1).to(o1.dtype)  # o2 + w1 (o1 - o2)


def prefix_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """A cached chunk's attention through cuDNN: q [B, H, T, qd], k [B, H, S, qd], v [B, H, S, vd] -> [B, H, T, vd],
    query t seeing keys 0..S-T+t, as two calls merged by their log-sum-exps: every query against the S-T cached keys
    (no mask), and the T new keys causally (square). NOTE: on the H200 (kimi-linear-1.5b, bf16) cuDNN's Hopper kernel
    ran a 64K-token prompt's causal attention in 33 ms a layer where torch's varlen flash kernel (FA2) took
    ~2.5x as long over the same prompt in 8K chunks (docs/engine.md); each part's output is rounded to q's dtype
    before the merge, one rounding more than one fused kernel makes."""
    B, H, T, _ = q.shape
    P = k.shape[2] - T
    parts = [torch.ops.aten._scaled_dot_product_cudnn_attention(q, k_, v_, None, True, 0.0, causal, False, scale=scale)
             for k_, v_, causal in ((k[:, :, :P], v[:, :, :P], False), (k[:, :, P:], v[:, :, P:], True))]
    return merge_attention(parts[0][0], parts[0][1].reshape(B, H, T).float(),
                           parts[1][0], parts[1][1].reshape(B, H, T).float())


def lower_right_causal_mask(T: int, S: int, device) -> Tensor:
    """[1, 1, T, S] bool: query t (at position S - T + t) sees keys 0..S - T + t: T new tokens after S - T cached."""
    return (torch.arange(S, device=device)[None, :] <= (S - T) + torch.arange(T, device=device)[:, None])[None, None]


# A cached forward of at most this many new tokens (absorb=None) attends in latent space: decode (1 token) and
# speculative verification (num_draft_tokens + 1, 5 by default) stay absorbed, a prefill chunk goes expanded.
# Why 16: the expanded form up-projects every cached latent on each forward (S r H (nope + vd) multiply-adds, as
# much as ~170 queries' absorbed attention at K3's widths), which only a chunk of many queries pays back; and the
# absorbed form's materialised fp32 scores [B, H, T, S] stay at most 16x a decode step's. NOTE: a number for the
# form, never a different result: both forms compute the same attention (tests/model/test_model.py).
ABSORB_MAX_TOKENS = 16


def kda_decay(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None) -> Tensor:
    """KDA's per-channel log-decay in fp32 from the raw gate input f [..., H, K], A_log [H] and dt_bias [H * K]
    (spec 2.1): what fla's kernels compute inside with `use_gate_in_kernel` (ops/kda/fused.py)."""
    H, K = f.shape[-2:]
    x = f.float() + dt_bias.float().view(H, K)
    a = A_log.float().exp().view(H, 1)
    if lower_bound is not None:  # K3: bounded in (lb, 0) so exp of a 16-token cumsum stays in bf16 range
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x)  # Kimi-Linear: unbounded


class KimiDeltaAttention(nn.Module):
    """KDA (spec 2.1): short conv + SiLU on q, k, v; L2-normed q, k; per-channel decay g; delta rule;
    per-head RMSNorm gated by a sigmoid output gate."""

    # inference-only stacked input projections (openk3/model/fused.py); see MLP
    fused_linears: FusedLinears | None = None

    def __init__(self, config: K3Config):
        super().__init__()
        lac = config.linear_attn_config
        D, H, K = config.hidden_size, lac.num_heads, lac.head_dim
        self.H, self.K, self.W = H, K, lac.short_conv_kernel_size
        self.lower_bound = lac.gate_lower_bound
        self.q_proj = Linear(D, H * K, bias=False)
        self.k_proj = Linear(D, H * K, bias=False)
        self.v_proj = Linear(D, H * K, bias=False)
        self.q_conv1d = nn.Conv1d(H * K, H * K, self.W, groups=H * K, bias=False)
        self.k_conv1d = nn.Conv1d(H * K, H * K, self.W, groups=H * K, bias=False)
        self.v_conv1d = nn.Conv1d(H * K, H * K, self.W, groups=H * K, bias=False)
        self.f_a_proj = Linear(D, K, bias=False)  # low rank = head_dim (128 in K3 and Kimi-Linear)
        self.f_b_proj = Linear(K, H * K, bias=False)
        self.b_proj = Linear(D, H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        if lac.use_full_rank_gate:
            self.g_proj = Linear(D, H * K, bias=False)
        else:
            self.g_a_proj = Linear(D, K, bias=False)
            self.g_b_proj = Linear(K, H * K, bias=False)
        self.o_norm = RMSNorm(K, config.rms_norm_eps)
        self.o_proj = Linear(H * K, D, bias=False)
        self.full_rank_gate = lac.use_full_rank_gate

    # `outs` below: the projections of x from one fused matmul (`fused_outputs`), or None for the modules' own calls.
    def decay_input(self, x: Tensor, outs: dict[str, Tensor] | None = None) -> Tensor:
        """The low-rank projection f [B, T, H, K] the decay gate is computed from (x's dtype)."""
        return self.f_b_proj(project(self, "f_a_proj", x, outs)).unflatten(-1, (self.H, self.K))

    def output_gate(self, x: Tensor, outs: dict[str, Tensor] | None = None) -> Tensor:
        """The sigmoid output gate's input [B, T, H, K] (full-rank in K3, low-rank in Kimi-Linear)."""
        gate = project(self, "g_proj", x, outs) if self.full_rank_gate else \
            self.g_b_proj(project(self, "g_a_proj", x, outs))
        return gate.unflatten(-1, (self.H, self.K))

    def conv_weight(self) -> Tensor:
        """The q, k, v short-conv weights stacked as one depthwise conv over the 3 H K channels [3HK, 1, W]."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0)

    def decay(self, x: Tensor, outs: dict[str, Tensor] | None = None) -> Tensor:
        """Per-channel log-decay g [B, T, H, K] in fp32 (spec 2.1)."""
        return kda_decay(self.decay_input(x, outs), self.A_log, self.dt_bias, self.lower_bound)

    def forward(self, x: Tensor, cu_seqlens: Tensor | None = None, pos: Tensor | None = None,
                state: KDAState | None = None, keep_inputs: bool = False) -> Tensor:
        """x [B, T, D] -> [B, T, D]. With cu_seqlens (packed documents, over the flattened B*T tokens) the
        recurrence and the conv restart at every document; with `state` they continue from it (and update it).
        With `keep_inputs`, `state.inputs` gets this forward's per-token inputs (`KDAState`), else None; a slot-pool
        state with `token_rows` (a speculative verification with fla) keeps every token's state in the pool instead
        and gets {"qkv", "conv"} whatever `keep_inputs` says (`forward_fused`)."""
        B, T, _ = x.shape
        H, K = self.H, self.K
        backend = select_kda_backend(x.device)
        # The fused path also runs from a cache: a decode step and a short cached prefill token by token, a longer
        # one chunked; `keep_inputs` (speculative rollback) needs the per-token inputs only the reference chain
        # produces, unless the state keeps every token's state in its pool (`token_rows`). NOTE: a decode step
        # inside torch.compile (the compiled step, serve/static.py) keeps the reference chain: with fla's wrappers
        # as graph breaks there, dynamo failed on the H200 at the second batch bucket (an internal error in its
        # shape guards); with fla's decode kernel as a custom op (no graph break) the compiled step wrote wrong conv
        # tails on the H200 (right on the CPU; docs/engine.md "The compiled step and fla");
        # the reference chain traces whole and matches an uncached forward there
        if backend.fused and isinstance(state, SlotKDAState) and state.token_rows is not None:
            return self.forward_fused(x, cu_seqlens, state, recurrent=True)  # a verification keeping every state
        if backend.fused and (state is None or not keep_inputs):
            token_by_token = state is not None and B * T <= RECURRENT_MAX_TOKENS \
                and not (state.chunked and T > RECURRENT_SEGMENT_TOKENS)
            if token_by_token and not torch.compiler.is_compiling():
                return self.forward_fused(x, cu_seqlens, state, recurrent=True)
            if state is None or T > 1:
                return self.forward_fused(x, cu_seqlens, state)
        outs = fused_outputs(self, x)
        qkv = self.qkv_proj(x) if outs is None else outs["qkv"]
        q, k, v, g, beta = self.kernel_inputs(x, qkv, pos, state.conv if state is not None else None, outs)
        if state is not None:
            state.conv = self.conv_tail(state.conv, qkv)
            state.inputs = {"qkv": qkv, "k": k, "v": v, "g": g, "beta": beta} if keep_inputs else None
        kda = backend.recurrent if state is not None and T <= RECURRENT_SEGMENT_TOKENS else backend.chunk
        args = dict(scale=K ** -0.5, use_qk_l2norm_in_kernel=True)
        if cu_seqlens is not None:
            # varlen ops take one packed row: [1, B*T, ...]
            o, _ = outside_graph(kda, q.flatten(0, 1)[None], k.flatten(0, 1)[None], v.flatten(0, 1)[None],
                                 g.flatten(0, 1)[None], beta.flatten(0, 1)[None], cu_seqlens=cu_seqlens, **args)
            o = o.view(B, T, H, K)
        else:
            init = state.recurrent if state is not None else None
            kw = dict(initial_state=init, output_final_state=state is not None, **args)
            # with a cache (decode, cached prefill) the kernel stays traceable: the compiled decode step
            # (serve/static.py) traces whole on the CPU
            o, final = kda(q, k, v, g, beta, **kw) if state is not None else outside_graph(kda, q, k, v, g, beta, **kw)
            if state is not None:
                state.recurrent = final
        return self.output(o, x, outs)

    def forward_fused(self, x: Tensor, cu_seqlens: Tensor | None, state: KDAState | None = None,
                      recurrent: bool = False) -> Tensor:
        """`forward` with its elementwise chains inside fla's kernels (ops/kda/fused.py): the short conv + SiLU (at a
        decode step's one token, a few PyTorch ops instead: `conv_silu`; over the engine's slot pool, one kernel that
        updates the pool's conv tails in place where Triton runs: ops/kda/conv_step.py; a chunk without gradients
        there, one kernel writing q, k, v apart: ops/kda/conv_chunk.py), the decay gate inside
        chunk_kda, and the gated output norm; with `state` (not with cu_seqlens) the conv starts from its tail and the
        recurrence from its state, and both are updated as `forward` updates them (inputs None). `recurrent` (with a
        state, forward only): fla's token-by-token kernel in place of chunk_kda, with beta's sigmoid inside it too; a
        decode step of the engine's slot pool (T = 1) updates the pool's rows where they are (`recurrent_gated`,
        docs/engine.md "KDA from a cache, token by token"), and a speculative verification over the slot pool
        (`SlotKDAState.token_rows`) writes the state after each of its tokens to its own pool row and keeps {"qkv",
        "conv"} in `inputs` for the conv tail's rollback. Same math as the reference pieces below;
        tests/model/test_kda_backends_gpu.py checks a training step (its fused=1 cases) and a cached prefill and decode
        both ways against them on the GPU, tests/model/test_kda_fused_routing.py the routing and the slot pool on any
        machine."""
        B, T, _ = x.shape
        H, K = self.H, self.K
        outs = fused_outputs(self, x)
        qkv_in = self.qkv_proj(x) if outs is None else outs["qkv"]
        per_token = isinstance(state, SlotKDAState) and state.token_rows is not None  # a verification's states kept
        # a decode step of the engine's slot pool: the conv tails read and updated where the pool keeps them, by one
        # kernel (the PyTorch chain's ~8 launches a layer and the tails' gather, ops/kda/conv_step.py)
        conv_in_place = T == 1 and isinstance(state, SlotKDAState) and not per_token and cu_seqlens is None \
            and not torch.compiler.is_compiling() and conv_step_applies(qkv_in, state.conv_pool)
        tail = state.conv if state is not None and not conv_in_place else None
        f = out_gate = None
        b = project(self, "b_proj", x, outs)
        if conv_in_place:
            # the gate's low-rank products (f_b; g_b of a low-rank output gate) in the conv's launch, and beta copied
            # contiguous for fla's kernel there (a view of the fused projections' output at B > 1)
            lowrank = self.lowrank_products(x, outs)
            strided_beta = not b.is_contiguous()
            q, k, v, *low = conv_step_in_place(qkv_in[:, 0], self.q_conv1d.weight, self.k_conv1d.weight,
                                               self.v_conv1d.weight, *state.conv_pool_rows(), H, K, lowrank=lowrank,
                                               beta=b[:, 0] if strided_beta else None)
            if strided_beta:
                b = low.pop()
            if low:
                f = low[0].view(B, T, H, K)
                out_gate = low[1].view(B, T, H, K) if len(low) > 1 else None
        elif T > 1 and cu_seqlens is None and not torch.compiler.is_compiling() and conv_chunk_applies(
                qkv_in, tail, conv_ws := (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)):
            # a chunk without gradients: q, k, v written apart and contiguous by one kernel (ops/kda/conv_chunk.py),
            # where fla's conv and chunk_kda's input guards copied the strided qkv_in and the q | k | v views
            # (NOTE: projecting and convolving q, k, v apart instead was measured and not kept; docs/engine.md,
            # thirteenth session)
            q, k, v = conv_chunk(qkv_in, *conv_ws, tail, H, K)
        else:
            qkv = outside_graph(kda_fused.conv_silu, qkv_in, self.conv_weight()[:, 0, :], cu_seqlens, tail)
            q, k, v = (t.unflatten(-1, (H, K)) for t in qkv.split(H * K, dim=-1))
        f = self.decay_input(x, outs) if f is None else f
        gate = (self.A_log.float(), self.dt_bias.float(), self.lower_bound, K ** -0.5)
        if not recurrent:
            o, final = outside_graph(kda_fused.chunk_gated, q, k, v, f, torch.sigmoid(b.float()), *gate, cu_seqlens,
                                     initial_state=state.recurrent if state is not None else None)
        elif per_token:  # every token's state kept in the pool
            o, final = kda_fused.recurrent_gated(q, k, v, f, b, *gate, *state.pool_token_rows())
        elif T == 1 and isinstance(state, SlotKDAState):  # the engine's slot pool: its rows updated where they are
            o, final = kda_fused.recurrent_gated(q, k, v, f, b, *gate, *state.pool_rows())
        else:
            o, final = kda_fused.recurrent_gated(q, k, v, f, b, *gate, state.recurrent)
        if state is not None:
            if not conv_in_place:  # (else updated in the pool)
                state.conv = self.conv_tail(tail, qkv_in)
            if final is not None:  # (None: updated in the pool)
                state.recurrent = final
            # a verification keeping every token's state keeps what its conv tail's rollback reads: the raw inputs
            # and the tail before them (serve/cache.py `kept_conv_tail`)
            state.inputs = {"qkv": qkv_in, "conv": tail} if per_token else None
        out_gate = self.output_gate(x, outs) if out_gate is None else out_gate
        o = outside_graph(kda_fused.gated_rms_norm, o, out_gate, self.o_norm.weight, self.o_norm.eps)
        return self.o_proj(o.flatten(-2).to(x.dtype))

    def lowrank_products(self, x: Tensor, outs: dict[str, Tensor] | None) -> list[tuple[Tensor, Tensor]]:
        """At one token a row (x [B, 1, D]): the (low-rank input [B, R], weight) pairs of f_b_proj and, with a
        low-rank output gate, g_b_proj, for ops/kda/conv_step.py to compute in the conv's launch, where a row of
        them meets the one-row GEMV's conditions (`linear_gemv_applies`: no grad, no autocast, not compiling, one
        dtype, a contiguous weight) and the inputs share a row stride; else [] (their Linear calls run). On the H200
        they were two launches a KDA layer of ~1.9 us each at batch 1 (`decode_probe.py timeline:1`, eleventh
        session) and ~2.8 us at batch 64 (cuBLAS)."""
        pairs = [("f_a_proj", self.f_b_proj)] + ([] if self.full_rank_gate else [("g_a_proj", self.g_b_proj)])
        out = [(project(self, key, x, outs)[:, 0], proj.weight) for key, proj in pairs]
        return out if all(linear_gemv_applies(lr[:1], w) and lr.stride(-1) == 1 and lr.stride(0) == out[0][0].stride(0)
                          for lr, w in out) else []

    # The pieces of `forward` around the delta-rule kernel; parallel/context.py runs the same pieces around its
    # context-parallel kernel.
    def qkv_proj(self, x: Tensor) -> Tensor:
        """[B, T, D] -> the conv inputs [B, T, 3 H K] (q, k, v projections side by side).
        NOTE: calls the three Linear modules (not one matmul over their stacked weights): FSDP2's bf16 policy shards
        each of them as its own unit, and only a module's own call gathers its weight. The inference-only fused
        path (`fused_outputs`: a separate copy, never used under autograd) takes "qkv" from its one matmul instead."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def kernel_inputs(self, x: Tensor, qkv: Tensor, pos: Tensor | None, tail: Tensor | None,
                      outs: dict[str, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The delta rule's q, k, v [B, T, H, K] (conv + SiLU of `qkv`, whose W-1 preceding inputs are `tail`),
        g [B, T, H, K] and beta [B, T, H] (both fp32)."""
        qkv_act = recomputed(causal_conv_silu, qkv, self.conv_weight(), pos, tail).to(x.dtype)
        q, k, v = (t.unflatten(-1, (self.H, self.K)) for t in qkv_act.split(self.H * self.K, dim=-1))
        return q, k, v, self.decay(x, outs), torch.sigmoid(project(self, "b_proj", x, outs).float())

    def conv_tail(self, tail: Tensor, qkv: Tensor) -> Tensor:
        """A cache's conv tail after this forward: the last W-1 raw projections of tail [B, W-1, 3HK] followed by
        qkv [B, T, 3HK], in the tail's dtype."""
        return torch.cat([tail, qkv[:, -(self.W - 1):].to(tail.dtype)], dim=1)[:, -(self.W - 1):]

    def output(self, o: Tensor, x: Tensor, outs: dict[str, Tensor] | None = None) -> Tensor:
        """The delta rule's output o [B, T, H, K] -> [B, T, D]: per-head norm, sigmoid gate of x, o_proj."""
        o = self.o_norm(o) * torch.sigmoid(self.output_gate(x, outs).float()).to(o.dtype)
        return self.o_proj(o.flatten(-2).to(x.dtype))


class GatedMLA(nn.Module):
    """Multi-head latent attention without positions (NoPE), with an optional sigmoid output gate (spec 2.2).

    The "rope" part of q and k is never rotated; k_pe is one 64-wide key shared by all heads."""

    # inference-only stacked input projections (openk3/model/fused.py); see MLP
    fused_linears: FusedLinears | None = None

    def __init__(self, config: K3Config):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.H, self.nope, self.rope, self.vd = H, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.r = config.kv_lora_rank
        self.qd = self.nope + self.rope
        self.scale = self.qd ** -0.5
        if config.q_lora_rank is not None:
            self.q_a_proj = Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)  # NOTE: the MLA latent norms use 1e-6
            self.q_b_proj = Linear(config.q_lora_rank, H * self.qd, bias=False)
        else:
            self.q_proj = Linear(D, H * self.qd, bias=False)
        self.kv_a_proj_with_mqa = Linear(D, self.r + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)
        self.kv_b_proj = Linear(self.r, H * (self.nope + self.vd), bias=False)
        if config.mla_use_output_gate:
            self.g_proj = Linear(D, H * self.vd, bias=False)
        self.o_proj = Linear(H * self.vd, D, bias=False)
        self.use_gate = config.mla_use_output_gate

    # `outs` below: the projections of x from one fused matmul (`fused_outputs`), or None for the modules' own calls.
    def query(self, x: Tensor, outs: dict[str, Tensor] | None = None) -> Tensor:
        """[B, T, D] -> [B, T, H, nope + rope]."""
        if hasattr(self, "q_b_proj"):
            q = self.q_b_proj(self.q_a_layernorm(project(self, "q_a_proj", x, outs)))
        else:
            q = project(self, "q_proj", x, outs)
        return q.unflatten(-1, (self.H, self.qd))

    def latent(self, x: Tensor, outs: dict[str, Tensor] | None = None) -> Tensor:
        """[B, T, D] -> the cached values [B, T, r + rope] = [normed c | k_pe]."""
        c, k_pe = project(self, "kv_a_proj_with_mqa", x, outs).split([self.r, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)

    def attend_expanded(self, q: Tensor, lat: Tensor, mask: Tensor | None, causal: bool,
                        varlen: tuple[Tensor, int] | None = None) -> Tensor:
        """Up-project the latent to full heads and run SDPA. q [B,T,H,qd], lat [B,S,r+rope] -> [B,T,H,vd].
        `causal` without a mask: query t sees keys 0..S-T+t, i.e. the S-T cached tokens then the new ones up to itself
        (plain causal when S == T). `varlen` (cu_seqlens int32 over the B*T tokens, longest document): packed
        documents without a mask (S == T)."""
        B, T = q.shape[:2]
        S = lat.shape[1]
        c, k_pe = lat.split([self.r, self.rope], dim=-1)
        kv = self.kv_b_proj(c).unflatten(-1, (self.H, self.nope + self.vd))
        k_nope, v = kv.split([self.nope, self.vd], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.H, -1)], dim=-1)
        if varlen is not None:
            return varlen_causal_attention(q, k, v, *varlen, self.scale)
        if (causal and mask is None and S == T and varlen_attention_runs(q)
                and not (torch.is_grad_enabled() and q.requires_grad)):
            # A prompt's first chunk at inference: the varlen flash kernel, not SDPA's cuDNN kernel first (SDPA_ORDER):
            # cuDNN builds an execution plan for every new shape, and a server's prompt lengths are new all the time (on
            # the H200 a first call at a new length took 35.7-542.8 ms where flash took 0.4-1.9 ms; a repeat 0.07-0.65
            # ms against 0.13-1.57; docs/engine_h200_log.md, ninth session). A training step (q needs a gradient) keeps
            # SDPA's order: its shapes repeat. The keys and values take q's dtype as in the cached branch below (under
            # autocast the cached k_pe keeps the cache's dtype; varlen is not cast by autocast as SDPA is).
            cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
            return varlen_causal_attention(q, k.to(q.dtype), v.to(q.dtype), cu, T, self.scale)
        if causal and mask is None and S != T:
            # A cached chunk: causal aligned to the last key, without a dense [T, S] mask. Opted in, on CUDA sm90 in
            # bf16/fp16 cuDNN's kernel in two parts (`prefix_causal_attention`); else on CUDA in bf16/fp16 the
            # varlen flash kernel (one "document" per row, its causal mask is bottom-right aligned); elsewhere
            # SDPA with torch's lower-right causal bias, which runs the memory-efficient kernel on CUDA (its
            # custom_mask_type) and a materialised mask where no kernel takes it (the CPU).
            # NOTE: under autocast the cached k_pe keeps the cache's dtype while q and k_nope come out of autocast's
            # matmuls; neither kernel call below goes through autocast, so the keys and values take q's dtype here.
            k, v = k.to(q.dtype), v.to(q.dtype)
            if cudnn_attention_runs(q, v):
                return prefix_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               self.scale).transpose(1, 2)
            if varlen_attention_runs(q):
                cu_q = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
                cu_k = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device)
                return varlen_causal_attention(q, k, v, cu_q, T, self.scale, keys=(cu_k, S))
            mask, causal = causal_lower_right(T, S), False
        with sdpa_kernel(SDPA_ORDER.get(q.device.type, SDPA_DEFAULT), set_priority=True):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask, is_causal=causal and mask is None, scale=self.scale)
        return o.transpose(1, 2)

    def attend_absorbed(self, q: Tensor, lat: Tensor, mask: Tensor | None) -> Tensor:
        """Attend in latent space (the decode form): fold kv_b's k part into q_nope, score against the latent
        cache, then apply kv_b's v part. q [B,T,H,qd], lat [B,S,r+rope], mask [B or 1, 1, T, S] -> [B,T,H,vd].
        Same math as `attend_expanded`. The matmuls run in kv_b's dtype (q and lat are cast to it), the scores,
        mask and softmax in fp32 (openk3/ops/mla_decode.py `latent_attention`)."""
        # NOTE: a flash-attention kernel's precision (issue #12): half-precision operands with fp32 accumulation,
        # the scores fp32 through the mask and softmax, p rounded to the operands' dtype for p @ c. Casting kv_b's
        # weight and the whole latent cache to fp32 for fp32 matmuls took ~0.8 ms of a 6.4 ms decode step on the
        # H200 (kimi-linear-1.5b, batch 64). An fp32 model computes in fp32 throughout.
        q_cat = self.absorbed_query(q)
        o_lat = latent_attention(q_cat, lat.to(q_cat.dtype), mask, self.scale, self.r)
        return self.absorbed_output(o_lat, q)

    def attend_paged(self, q: Tensor, pages: Tensor, table: Tensor, visible: Tensor) -> Tensor:
        """`attend_absorbed` over a paged latent cache read in place by a Triton kernel (openk3/ops/mla_decode.py
        `paged_latent_attention`): pages [num_pages, page_size, r+rope] of this layer, table [B, P], visible [B] (the
        keys each row's last new token sees) -> [B,T,H,vd]. The fast decode step's path (serve/static.py)."""
        q_cat = self.absorbed_query(q)
        o_lat = paged_latent_attention(q_cat, pages, table, visible, self.scale, self.r, self.H)
        return self.absorbed_output(o_lat, q)

    def absorbed_query(self, q: Tensor) -> Tensor:
        """q [B,T,H,qd] -> q_cat [B, T*H, r+rope] = [q_nope . w_k | q_pe] in kv_b's dtype: lat is [c | k_pe], so one
        product with q_cat gives q_lat . c + q_pe . k_pe."""
        B, T, H, _ = q.shape
        w_k = self.kv_b_proj.weight.view(H, self.nope + self.vd, self.r)[:, :self.nope]  # [H, nope, r]
        q_nope, q_pe = q.to(w_k.dtype).split([self.nope, self.rope], dim=-1)
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_k)
        return torch.cat([q_lat, q_pe], dim=-1).view(B, T * H, self.r + self.rope)

    def absorbed_output(self, o_lat: Tensor, q: Tensor) -> Tensor:
        """o_lat [B, T*H, r] -> [B,T,H,vd] in q's dtype: kv_b's v part applied."""
        B, T, H, _ = q.shape
        w_v = self.kv_b_proj.weight.view(H, self.nope + self.vd, self.r)[:, self.nope:]  # [H, vd, r]
        return torch.einsum("bthr,hvr->bthv", o_lat.view(B, T, H, self.r), w_v).to(q.dtype)

    def forward(self, x: Tensor, mask: Tensor | None = None, state: MLAState | None = None,
                absorb: bool | None = None, varlen: tuple[Tensor, int] | None = None) -> Tensor:
        """x [B, T, D] -> [B, T, D]. `mask` [B, 1, T, T] bool (block-diagonal causal for packed documents) or None
        for plain causal. With `state`, the new latents are appended to the cache and attention covers it.
        `absorb` picks the latent-space form; default: with a cache and at most ABSORB_MAX_TOKENS new tokens (decode,
        speculative verification), else the expanded form (training, prefill chunks). `varlen` (cu_seqlens, longest
        document) describes packed documents instead of `mask`, for the varlen flash kernel (bf16/fp16 on CUDA);
        where that cannot run, the mask is built from it."""
        B, T, _ = x.shape
        outs = fused_outputs(self, x)
        q = self.query(x, outs)
        lat = self.latent(x, outs)
        if varlen is not None and (absorb or state is not None or not varlen_attention_runs(q)):
            mask, varlen = document_causal_mask(varlen[0], B, T), None
        if state is not None:
            if mask is not None:
                raise ValueError("packed-document masks are not supported together with a decode cache")
            absorb = absorb if absorb is not None else T <= ABSORB_MAX_TOKENS
            if absorb and getattr(state, "paged", False):
                # the fast decode step's cache (serve/static.py `StaticMLA`): its pages read in place, no gather
                return self.output(self.attend_paged(q, *state.append_paged(lat)), x, outs)
            # mask None: every row's keys are its cached tokens then these T (`MLAState.append`)
            lat, mask = state.append(lat)
            lat = lat.to(x.dtype)
        if absorb:
            if mask is None:
                mask = lower_right_causal_mask(T, lat.shape[1], x.device)
            o = self.attend_absorbed(q, lat, mask)
        else:
            o = self.attend_expanded(q, lat, mask, causal=True, varlen=varlen)
        return self.output(o, x, outs)

    def output(self, o: Tensor, x: Tensor, outs: dict[str, Tensor] | None = None) -> Tensor:
        """Attention output o [B, T, H, vd] -> [B, T, D]: the sigmoid gate of x (when configured), o_proj."""
        if self.use_gate:
            o = o * torch.sigmoid(project(self, "g_proj", x, outs).float()).unflatten(-1, (self.H, self.vd)).to(o.dtype)
        return self.o_proj(o.flatten(-2))


# ------------------------------------------------------------------------------------------- MoE

class Router(nn.Module):
    """Sigmoid router with the selection-only bias (`e_score_correction_bias`, updated by Quantile Balancing,
    never by gradients)."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.k, self.renorm, self.scale = config.num_experts_per_token, config.moe_renormalize, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x_TD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """-> (topk_idx [T, k], topk_w [T, k] fp32, scores [T, E] fp32)."""
        if router_kernel_applies(x_TD, self.weight, self.k):  # no grad, on CUDA, decode sizes: one kernel
            return router_forward(x_TD, self.weight, self.e_score_correction_bias, self.k, self.renorm, self.scale)
        with torch.autocast(x_TD.device.type, enabled=False):  # fp32 router scores, also under bf16 autocast
            s = torch.sigmoid(F.linear(x_TD.float(), self.weight.float()))
        if route_kernel_applies(s, self.k):  # no grad, on CUDA: the chain below in one kernel (decode speed)
            return *route_topk(s, self.e_score_correction_bias, self.k, self.renorm, self.scale), s
        idx = route(s.detach(), self.e_score_correction_bias, self.k)  # the bias steers selection only
        w = s.gather(-1, idx)
        if self.renorm:
            w = w / w.sum(-1, keepdim=True)
        return idx, w * self.scale if self.scale != 1 else w, s  # K3's scale is 1: no op for it


class Experts(nn.Module):
    """Routed experts stacked for grouped matmuls: w1 (gate) and w3 (up) [E, F, D], w2 (down) [E, D, F]."""

    def __init__(self, n: int, dim: int, inter: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, inter, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, inter))
        self.w3 = nn.Parameter(torch.empty(n, inter, dim))

    def forward(self, z: Tensor, idx: Tensor, w: Tensor, act, weight_fn=None) -> Tensor:
        """sum_k w[t, k] E_idx[t, k](z_t) [T, De] (openk3.ops.moe_experts). parallel/expert.py swaps this forward
        for the expert-parallel one."""
        z = self.autocast_input(z)
        weights = [p.to(z.dtype) for p in (self.w1, self.w2, self.w3)]
        if weight_fn is fake_quant_mxfp4 and self.on_mxfp4_grid(weights):
            weight_fn = None
        return moe_experts(z, idx, w.to(z.dtype), *weights, act, weight_fn=weight_fn)

    @staticmethod
    def autocast_input(z: Tensor) -> Tensor:
        """z in the autocast dtype when autocast is on (the expert weights are then cast to it too).
        NOTE: autocast does not cover torch._grouped_mm, so this does what it does for a Linear. Without it, a model of
        fp32 parameters under bf16 autocast (the training recipe) ran its routed experts as fp32 matmuls, one per
        expert (the H200 profile of kimi-linear-1.5b: ~4,200 fp32 GEMM kernels a step, nearly half of it)."""
        if torch.is_autocast_enabled(z.device.type):
            return z.to(torch.get_autocast_dtype(z.device.type))
        return z

    def on_mxfp4_grid(self, weights: list[Tensor]) -> bool:
        """Outside autograd: whether the expert weights are already MXFP4 values (a model loaded from an MXFP4
        checkpoint), so fake-quantising them is the identity and can be skipped. Checked once per version of the
        weights (`_version` counts in-place writes: a weight load or an optimizer step makes it check again).
        Under autograd it answers False: training fake-quantises every step, as before."""
        if torch.is_grad_enabled():
            return False
        key = tuple((p.data_ptr(), p._version, p.dtype) for p in (self.w1, self.w2, self.w3)) + (weights[0].dtype,)
        if getattr(self, "_grid_key", None) != key:
            self._on_grid = all(torch.equal(fake_quant_mxfp4(t), t) for t in weights)
            self._grid_key = key
        return self._on_grid


class MoE(nn.Module):
    """Stable LatentMoE (K3, when `routed_expert_hidden_size` is set) or the plain Kimi-Linear MoE.

    LatentMoE: y = up(RMSNorm(sum_i w_i E_i(down(x)))) + Shared(x); plain: y = sum_i w_i E_i(x) + Shared(x)."""

    # inference-only stacked input projections (openk3/model/fused.py); see MLP
    fused_linears: FusedLinears | None = None

    def __init__(self, config: K3Config):
        super().__init__()
        D, De = config.hidden_size, config.expert_dim
        self.gate = Router(config)
        self.experts = Experts(config.num_experts, De, config.moe_intermediate_size)
        self.latent = config.latent_moe
        if self.latent:
            self.routed_expert_down_proj = Linear(D, De, bias=False)
            self.routed_expert_up_proj = Linear(De, D, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(De, config.rms_norm_eps)
        if config.num_shared_experts:
            self.shared_experts = MLP(config, D, config.moe_intermediate_size * config.num_shared_experts)
        self.act = glu_activation(config)

    def forward(self, x: Tensor, qat: bool = False, record=None) -> Tensor:
        """x [..., D] -> [..., D]. `qat`: MXFP4 fake-quant of the expert weights + MXFP8 of their inputs (spec
        section 5). `record`, when given, is called with this layer's (scores [T, E] fp32, topk_idx [T, k])
        (`ForwardContext.add_router`)."""
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        idx, w, scores = self.gate(x_TD)
        if record is not None:
            record(scores, idx)
        if not qat and (y := self.experts_with_shared(x_TD, idx, w)) is not None:
            return y.view(shape)
        # a LatentMoE's fused matmul: its down projection and the shared experts' gate_proj and up_proj (all read
        # x_TD; keys "routed_expert_down_proj", "gate_proj", "up_proj"). A plain MoE's shared experts fuse their own.
        outs = fused_outputs(self, x_TD)
        z = project(self, "routed_expert_down_proj", x_TD, outs) if self.latent else x_TD
        if qat:
            z = fake_quant_mxfp8(z)
        u = self.experts(z, idx, w, self.act, weight_fn=fake_quant_mxfp4 if qat else None)
        if self.latent:
            if hasattr(self, "routed_expert_norm"):
                u = self.routed_expert_norm(u)
            u = self.routed_expert_up_proj(u)
        if hasattr(self, "shared_experts"):
            u = u + self.shared_experts(x_TD, outs)
        return u.view(shape)

    def experts_with_shared(self, x_TD: Tensor, idx: Tensor, w: Tensor) -> Tensor | None:
        """A plain MoE's routed and shared experts, `routed + shared`, in the routed experts' kernels with the shared
        experts as one more slot of every token (ops/moe_gemv.py `moe_experts_gemv` at decode sizes,
        ops/moe_by_expert.py `moe_experts_by_expert` above them, each with `shared`: the add in their last kernel; the
        same roundings as `forward`'s), or None where neither runs (a gradient wanted, autocast, no kernel backend,
        larger calls), for a LatentMoE, without shared experts, for experts whose forward is not `Experts.forward`
        (expert parallelism swaps it), or for a shared width or dtype other than the experts'. On the H200 at batch 1
        the shared experts' own kernels and the add took ~9 us of a MoE layer's ~40, at batch 64 ~13 us of ~85
        (`decode_probe.py timeline:B`, kimi-linear-1.5b, eleventh session)."""
        if self.latent or not hasattr(self, "shared_experts") or type(self.experts).forward is not Experts.forward \
                or "forward" in vars(self.experts):
            return None
        if torch.is_grad_enabled() or torch.is_autocast_enabled(x_TD.device.type):
            return None
        mlp = self.shared_experts
        shared = (mlp.gate_proj.weight, mlp.down_proj.weight, mlp.up_proj.weight)
        experts = (self.experts.w1, self.experts.w2, self.experts.w3)
        if shared[0].shape != experts[0].shape[1:] or any(p.dtype != x_TD.dtype for p in shared + experts):
            return None
        kernel = small_experts_kernel(x_TD, idx, w, *experts, self.act)
        # (the kernels round the fp32 routing weights to x's dtype as Experts.forward does before it calls them)
        return None if kernel is None else kernel(x_TD, idx, w, *experts, self.act, shared=shared)


# --------------------------------------------------------------------------------- decoder layer

class DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, i: int):
        super().__init__()
        D = config.hidden_size
        self.i = i
        self.is_kda = config.layer_types[i] == "kda"
        self.self_attn = KimiDeltaAttention(config) if self.is_kda else GatedMLA(config)
        if config.is_moe_layer(i):
            self.block_sparse_moe = MoE(config)
        else:
            self.mlp = MLP(config, D, config.intermediate_size)
        self.input_layernorm = RMSNorm(D, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, config.rms_norm_eps)
        self.block_size = config.attn_res_block_size
        self.eps = config.rms_norm_eps
        if self.block_size is not None:
            # HF names: self_attention_res_norm.weight [D], self_attention_res_proj.weight [1, D], same for mlp_res_*
            self.self_attention_res_norm = RMSNormWeight(D)
            self.self_attention_res_proj = Linear(D, 1, bias=False)
            self.mlp_res_norm = RMSNormWeight(D)
            self.mlp_res_proj = Linear(D, 1, bias=False)

    def ffn(self, x: Tensor, ctx: "ForwardContext | None" = None) -> Tensor:
        """The dense MLP or the MoE of this layer; `ctx` (default: none) gives QAT and the router records."""
        if hasattr(self, "block_sparse_moe"):
            ctx = ForwardContext() if ctx is None else ctx
            return self.block_sparse_moe(x, qat=ctx.qat, record=ctx.add_router if ctx.record_router else None)
        return self.mlp(x)

    def mixer(self, x: Tensor, ctx: "ForwardContext", layer_cache) -> Tensor:
        if self.is_kda:
            return self.self_attn(x, cu_seqlens=ctx.cu_seqlens, pos=ctx.pos, state=layer_cache,
                                  keep_inputs=ctx.keep_inputs)
        return self.self_attn(x, mask=ctx.mask, state=layer_cache, absorb=ctx.absorb, varlen=ctx.varlen)

    def mix(self, prefix: Tensor, bank: list[Tensor], norm: "RMSNormWeight", proj: nn.Linear, name: str,
            ctx: "ForwardContext") -> Tensor:
        """The AttnRes mix before the mixer ("attn") or the FFN ("mlp"); its mean mixing weight of each source goes
        to ctx.attnres["<layer>.<name>"] when the forward records them."""
        record = ctx.record_attnres
        out = recomputed(attnres_mix, bank + [prefix], norm.weight, proj.weight.view(-1), self.eps, record)
        if record:
            out, w = out
            ctx.add_attnres(f"{self.i}.{name}", w)
        return out

    def forward(self, prefix: Tensor | None, bank: list[Tensor], dtype: torch.dtype, ctx: "ForwardContext",
                layer_cache=None) -> tuple[Tensor, list[Tensor]]:
        """Block AttnRes wiring exactly as K3_SPEC section 3 (fp32 `prefix` and `bank`); plain residual when the
        config has no block size. With the plain residual `bank` carries no blocks but the FFN output of the layer
        before, not yet added to `prefix`: this layer adds it in its input norm (`RMSNorm.add`, with fla at inference
        one kernel for the add and the norm: the same sum and the same norm of it as the add and `from_residual`) and
        returns its own FFN output the same way, [ffn]; `K3ForCausalLM.forward` adds the last one."""
        # NOTE: fp32 + a bf16 sublayer output is one op: the add promotes the output to fp32 exactly, as a .float()
        # before it would, without that extra cast per sublayer (docs/engine.md "Fast decode path"). The residual
        # stays in the dtype `K3ForCausalLM.forward` gave it (fp32; an fp64 model's fp64), never narrower.
        if self.block_size is None:
            if bank:
                x, prefix = self.input_layernorm.add(bank[0], prefix, dtype)
            else:
                x = self.input_layernorm.from_residual(prefix, dtype)
            a = self.mixer(x, ctx, layer_cache)
            x, h = self.post_attention_layernorm.add(a, prefix, dtype)
            return h, [self.ffn(x, ctx)]
        h = self.mix(prefix, bank, self.self_attention_res_norm, self.self_attention_res_proj, "attn", ctx) if bank \
            else prefix
        if self.i % self.block_size == 0:
            bank = bank + [prefix]
            prefix = None
        a = self.mixer(self.input_layernorm.from_residual(h, dtype), ctx, layer_cache)
        prefix = a.to(h.dtype) if prefix is None else prefix + a
        h = self.mix(prefix, bank, self.mlp_res_norm, self.mlp_res_proj, "mlp", ctx)
        return prefix + self.ffn(self.post_attention_layernorm.from_residual(h, dtype), ctx), bank


class RMSNormWeight(nn.Module):
    """Holds only the weight of the weightless-key RMS normalisation inside an AttnRes mix (HF name `.weight`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


@dataclass
class ForwardContext:
    """What every layer needs to know about one forward: the batch layout (computed once), the forward's options,
    and the lists the layers fill with the statistics it was asked to record. Lives for one forward only."""

    cu_seqlens: Tensor | None = None  # packed documents over the flattened B*T tokens
    pos: Tensor | None = None  # [B, T] position inside the document (for the KDA conv)
    mask: Tensor | None = None  # [B, 1, T, T] block-diagonal causal mask for MLA (None = plain causal)
    varlen: tuple[Tensor, int] | None = None  # instead of `mask` on CUDA: (cu_seqlens int32, longest document)
    absorb: bool | None = None
    qat: bool = False  # MoE experts fake-quantised (MXFP4 weights, MXFP8 inputs)
    keep_inputs: bool = False  # KDA layers leave their per-token inputs in their state
    router: list[tuple[Tensor, Tensor]] | None = None  # filled per MoE layer when recording
    attnres: dict[str, Tensor] | None = None  # filled per AttnRes mix when recording
    # Whether `router` / `attnres` are being filled. NOTE: the layers read these flags and fill the records through
    # add_router / add_attnres, never touching the list or dict themselves: torch.compile guards a list or dict a
    # compiled layer reads on its length and keys, which differ from layer to layer, so every layer would compile
    # a graph of its own (train/compile.py).
    record_router: bool = False
    record_attnres: bool = False

    @torch.compiler.disable
    def add_router(self, scores: Tensor, idx: Tensor) -> None:
        """Record one MoE layer's router scores [T, E] fp32 and selected experts [T, k], detached."""
        self.router.append((scores.detach(), idx.detach()))

    @torch.compiler.disable
    def add_attnres(self, key: str, w: Tensor) -> None:
        """Record the mean mixing weight of each source [S] (fp32, detached) of the AttnRes mix `key`."""
        self.attnres[key] = w.detach().float().flatten(1).mean(1)


@dataclass
class CausalLMOutput:
    logits: Tensor | None  # None when the loss was computed in chunks (loss_chunk)
    loss: Tensor | None = None
    # with record=True: per MoE layer in order, (router scores [B*T, E] fp32, selected experts [B*T, k]), detached
    router: list[tuple[Tensor, Tensor]] | None = None
    # with record_attnres=True: {"<layer>.attn" | "<layer>.mlp" | "output": mean mixing weight of each source [S]}
    # (fp32, detached; sources: 0 = embedding, then the completed blocks, last = the partial block); None = no AttnRes
    attnres: dict[str, Tensor] | None = None


def _ce_sum(h: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=-100, reduction="sum")


def chunked_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor, chunk: int) -> Tensor:
    """Mean fp32 cross-entropy of the logits h @ weight.T over tokens whose label is not -100, without ever
    holding all the logits: each chunk of `chunk` tokens is `recomputed`, so its logits are rebuilt in
    backward. h [N, D], labels [N]. For K3's 163,840-entry vocabulary the full fp32 logits of 8 x 4096 tokens
    would take 21 GB; a 4096-token chunk takes 2.7 GB. With no valid label the loss is 0, not NaN."""
    total = h.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[0], chunk):
        total = total + recomputed(_ce_sum, h[s:s + chunk], weight, labels[s:s + chunk])
    return total / (labels != -100).sum().clamp(min=1)


# ------------------------------------------------------------------------------------------ model

class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)


class K3ForCausalLM(nn.Module):
    """The whole K3 language model. `forward(input_ids, labels)` -> CausalLMOutput(logits, loss).

    `labels` are aligned targets (labels[:, t] is the token to predict after input_ids[:, t]; -100 = ignore):
    the data pipeline shifts, because packed documents need per-position targets."""

    def __init__(self, config: K3Config, qat: bool = False):
        super().__init__()
        self.config = config
        # How this model runs, fixed at construction: MXFP4 quantisation-aware training of the routed experts (and
        # MXFP8 expert inputs), spec section 5. The trainer decides it from --qat; load_for_inference from the config.
        self.qat = qat
        self.model = K3Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.attn_res:
            self.output_attn_res_norm = RMSNormWeight(config.hidden_size)
            self.output_attn_res_proj = Linear(config.hidden_size, 1, bias=False)
        if self.lm_head.weight.device.type != "meta":
            self.reset_parameters()

    # ---- init
    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Random init. NOTE: K3's own init is unpublished; this is the usual LLM scheme: normal(0, 0.02) matrices,
        output projections scaled by 1/sqrt(2 L), unit norms, zero AttnRes queries, and KDA decay rates drawn
        log-uniformly in [1e-3, 1e-1] per channel (as fla's Mamba-style dt init)."""
        c = self.config
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = c.initializer_range

        def normal_(t: Tensor, s: float = std) -> None:
            t.copy_(torch.randn(t.shape, generator=gen) * s)

        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2", "routed_expert_up_proj.weight")):
                normal_(p, std / math.sqrt(2 * c.num_hidden_layers))
            elif name.endswith("_res_proj.weight") or name.endswith("_res_proj"):
                p.zero_()
            elif p.dim() >= 2 and not name.endswith("conv1d.weight"):
                normal_(p)
            elif name.endswith("conv1d.weight"):
                bound = 1 / math.sqrt(p.shape[-1])
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
            else:
                p.fill_(1.0)  # norm weights
        for layer in self.model.layers:
            attn = layer.self_attn
            if isinstance(attn, KimiDeltaAttention):
                H, K = attn.H, attn.K
                # drawn on the CPU (the generator's device) and copied in, so a model on any device initialises alike
                A = torch.rand(H, generator=gen) * 15 + 1  # Kimi-Linear: A in [1, 16]
                attn.A_log.copy_(A.log())
                dt = torch.exp(torch.rand(H * K, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                a = A.repeat_interleave(K)
                if attn.lower_bound is not None:
                    # g = lb * sigmoid(a * dt_bias) = -dt at f = 0
                    attn.dt_bias.copy_(torch.logit(dt / -attn.lower_bound) / a)
                else:
                    # g = -a * softplus(dt_bias) = -a * dt at f = 0 (Kimi-Linear's parameterisation)
                    attn.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            if hasattr(layer, "block_sparse_moe"):
                layer.block_sparse_moe.gate.e_score_correction_bias.zero_()

    def cast(self, dtype: torch.dtype) -> "K3ForCausalLM":
        """Cast every parameter and buffer to `dtype` except the FP32_TENSORS, which stay (or become) fp32. Use this
        instead of `.to(dtype)`, which would round them. Works on the meta device too. Returns self."""
        for module_name, module in self.named_modules():
            for tensors in (module._parameters, module._buffers):
                for leaf, t in tensors.items():
                    if t is not None:
                        name = f"{module_name}.{leaf}" if module_name else leaf
                        t.data = t.data.to(torch.float32 if keeps_fp32(name) else dtype)
        return self

    # ---- run
    def forward(self, input_ids: Tensor, labels: Tensor | None = None, cu_seqlens: Tensor | None = None,
                cache: K3Cache | None = None, absorb: bool | None = None, logits_to_keep: int = 0,
                loss_chunk: int = 0, record: bool = False, record_attnres: bool = False,
                keep_inputs: bool = False, inputs_embeds: Tensor | None = None,
                validate: bool = True) -> CausalLMOutput:
        """input_ids [B, T]. cu_seqlens: int64 [N+1] document starts over the flattened B*T tokens (each row start
        must be one); documents reset KDA state and the MLA mask. cache: a K3Cache to continue from and update.
        logits_to_keep: when > 0, logits only for the last that many positions (a prefill needs only the last).
        loss_chunk: when > 0 and the batch has more tokens than that, the loss is computed chunk by chunk with
        recomputed logits (`chunked_cross_entropy`) and the output's logits are None.
        record: the output's `router` holds every MoE layer's router scores and selection (for balancing, metrics).
        record_attnres: the output's `attnres` holds the mean AttnRes mixing weights (when the config has AttnRes).
        keep_inputs: every KDA state of `cache` gets this forward's per-token inputs (`KDAState.inputs`).
        inputs_embeds: [B, T, D] used instead of embedding input_ids (which still give the shape and are checked):
        K3ForConditionalGeneration passes the embeddings with its images' vision vectors in the media slots.
        validate: False skips the token-id range check, a host sync: for callers that checked the ids already (the
        engine checks prompts at submit and samples the rest) and for CUDA-graph capture, which forbids syncs.
        Nothing is left on any module: options come in as arguments, statistics go out in the CausalLMOutput."""
        c = self.config
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if validate and input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= c.vocab_size):
            bad = input_ids[(input_ids < 0) | (input_ids >= c.vocab_size)][0].item()
            raise ValueError(f"token id {bad} outside the vocabulary [0, {c.vocab_size})")
        B, T = input_ids.shape
        record_attnres = record_attnres and c.attn_res
        ctx = ForwardContext(absorb=absorb, qat=self.qat, keep_inputs=keep_inputs, router=[] if record else None,
                             attnres={} if record_attnres else None, record_router=record,
                             record_attnres=record_attnres)
        if cu_seqlens is not None:
            if cache is not None:
                raise ValueError("cu_seqlens (packed training batches) and a decode cache cannot be combined")
            ctx.cu_seqlens = cu_seqlens = cu_seqlens.to(input_ids.device, torch.long)
            row_starts = torch.arange(0, B * T, T, device=input_ids.device)
            if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != B * T or not torch.isin(row_starts, cu_seqlens).all():
                raise ValueError(f"cu_seqlens must start at 0, end at B*T={B * T} and contain every row start; "
                                 f"got {cu_seqlens.tolist()[:8]}...")
            ctx.pos = segment_positions(cu_seqlens, B * T).view(B, T)
            # No dense [B, 1, T, T] mask where the varlen kernel runs (it keeps SDPA off its fast kernels); elsewhere
            # the mask once here, not in every MLA layer (GatedMLA.forward would build it from `varlen` itself).
            half = self.lm_head.weight.dtype in (torch.bfloat16, torch.float16) or (
                torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in (torch.bfloat16, torch.float16))
            if input_ids.device.type == "cuda" and half and not absorb and varlen_attn is not None:
                ctx.varlen = (cu_seqlens.to(torch.int32), int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
            else:
                ctx.mask = document_causal_mask(cu_seqlens, B, T)
        if cache is not None and len(cache.layers) != c.num_hidden_layers:
            raise ValueError(f"cache has {len(cache.layers)} layers, model has {c.num_hidden_layers}")

        dtype = self.lm_head.weight.dtype
        if inputs_embeds is not None and inputs_embeds.shape != (B, T, c.hidden_size):
            raise ValueError(f"inputs_embeds shape {tuple(inputs_embeds.shape)} != {(B, T, c.hidden_size)}")
        embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        prefix = embeds.to(torch.promote_types(embeds.dtype, torch.float32))  # fp32 residual stream (an fp64 model's: fp64)
        bank: list[Tensor] = []
        for i, layer in enumerate(self.model.layers):
            prefix, bank = layer(prefix, bank, dtype, ctx, cache.layers[i] if cache is not None else None)
        if c.attn_res:
            h = attnres_mix(bank + [prefix], self.output_attn_res_norm.weight, self.output_attn_res_proj.weight.view(-1),
                            c.rms_norm_eps, return_weights=ctx.attnres is not None)
            if ctx.attnres is not None:
                h, w = h
                ctx.add_attnres("output", w)
        else:
            h = prefix + bank[0] if bank else prefix  # the last layer's FFN output (DecoderLayer.forward)
        if logits_to_keep > 0:
            if labels is not None:
                raise ValueError(f"logits_to_keep={logits_to_keep} cannot be combined with labels (the loss needs all)")
            h = h[:, -logits_to_keep:]
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
        if loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 0, got {loss_chunk}")
        logits, loss = self.head(h.to(dtype), labels, loss_chunk)
        return CausalLMOutput(logits=logits, loss=loss, router=ctx.router, attnres=ctx.attnres)

    def head(self, h: Tensor, labels: Tensor | None, loss_chunk: int) -> tuple[Tensor | None, Tensor | None]:
        """The final norm, lm_head and the fp32 loss: h [B, T, D] in the compute dtype -> (logits [B, T, V], mean
        cross-entropy over labels != -100, or None without labels). With 0 < loss_chunk < B*T tokens and labels,
        the loss comes chunk by chunk (`chunked_cross_entropy`) and the logits are None. One method, so that
        train/compile.py can compile it as one region."""
        h = self.model.norm(h)
        if labels is not None and 0 < loss_chunk < labels.numel():
            return None, chunked_cross_entropy(h.flatten(0, 1), self.lm_head.weight, labels.flatten(), loss_chunk)
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)  # fp32 loss
        return logits, loss

    # ---- helpers
    def moe_layers(self) -> list[MoE]:
        return [l.block_sparse_moe for l in self.model.layers if hasattr(l, "block_sparse_moe")]


# ---------------------------------------------------------------------------- parameter counting

def count_params(config: K3Config) -> dict:
    """Total and active (per token, excluding the input embedding) parameter counts, built on the meta
    device so nothing is allocated (the release: 2.7795e12 total, 104.19e9 active)."""
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    inactive = model.model.embed_tokens.weight.numel()
    for moe in model.moe_layers():
        per_expert = sum(p[0].numel() for p in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
        inactive += (config.num_experts - config.num_experts_per_token) * per_expert
    # The router bias is a buffer in the module but a stored tensor in the checkpoint: count it like the release.
    bias = sum(m.gate.e_score_correction_bias.numel() for m in model.moe_layers())
    return {"total_params": total + bias, "active_params": total + bias - inactive}
