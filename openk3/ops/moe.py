"""Routed experts of a MoE layer: the loop reference and the grouped-matmul version.

The router's weights and bias live in the model; `route` (its top-k selection) is here, below both the model's
Router and train/balance.py, which share it. The expert functions take the router's output and compute

    y_t = sum_k topk_w[t, k] * E_{topk_idx[t, k]}(x_t),   E_e(x) = w2[e] act(w1[e] x, w3[e] x)

with w1 the gate, w3 the up and w2 the down projection of each expert, in HF Linear layout:
w1, w3: [E, F, D] (rows = intermediate), w2: [E, D, F].

Precision: the expert matmuls and the activation's output are in x's dtype (the activation
itself computes in fp32, see situ.py); each expert's output is multiplied by its routing weight
and summed over the k experts in fp32 (float64 for float64 inputs, for gradcheck), and the sum
is cast back to x's dtype at the end.

``weight_fn`` (optional) is applied to w1, w2 and w3 before use, e.g. ``fake_quant_mxfp4`` for
quantisation-aware training of the routed experts.

Both functions have the same signature and must agree (tests/ops/test_moe.py checks forward
and backward); the loop stays in the tree as the reference (STYLE rule 8).
"""

from collections.abc import Callable

import torch
from torch import Tensor

Activation = Callable[[Tensor, Tensor], Tensor]
WeightFn = Callable[[Tensor], Tensor]


def route(scores_MN: Tensor, bias_N: Tensor, k: int) -> Tensor:
    """The router's selection, topk(s + bias, k), as expert indices [M, k] (spec 4)."""
    return (scores_MN.float() + bias_N.float()).topk(k, dim=1).indices


def _check_inputs(x_TD: Tensor, topk_idx_TK: Tensor, topk_w_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor, w3_EFD: Tensor) -> None:
    if x_TD.dim() != 2:
        raise ValueError(f"x must be [T, D], got shape {tuple(x_TD.shape)}")
    T, D = x_TD.shape
    if w1_EFD.dim() != 3 or w1_EFD.shape[2] != D:
        raise ValueError(f"w1 must be [E, F, {D}], got shape {tuple(w1_EFD.shape)}")
    E, F, _ = w1_EFD.shape
    if w3_EFD.shape != (E, F, D):
        raise ValueError(f"w3 must be [{E}, {F}, {D}] like w1, got shape {tuple(w3_EFD.shape)}")
    if w2_EDF.shape != (E, D, F):
        raise ValueError(f"w2 must be [{E}, {D}, {F}], got shape {tuple(w2_EDF.shape)}")
    if topk_idx_TK.dim() != 2 or topk_idx_TK.shape[0] != T or topk_w_TK.shape != topk_idx_TK.shape:
        raise ValueError(
            f"topk_idx and topk_w must both be [T={T}, K], got {tuple(topk_idx_TK.shape)} and {tuple(topk_w_TK.shape)}"
        )
    if topk_idx_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be int32 or int64, got {topk_idx_TK.dtype}")
    if {w1_EFD.dtype, w2_EDF.dtype, w3_EFD.dtype} != {x_TD.dtype}:
        raise ValueError(
            f"x and the expert weights must share one dtype, got x {x_TD.dtype}, "
            f"w1 {w1_EFD.dtype}, w2 {w2_EDF.dtype}, w3 {w3_EFD.dtype}"
        )


def moe_experts_loop(
    x_TD: Tensor,
    topk_idx_TK: Tensor,
    topk_w_TK: Tensor,
    w1_EFD: Tensor,
    w2_EDF: Tensor,
    w3_EFD: Tensor,
    act: Activation,
    weight_fn: WeightFn | None = None,
) -> Tensor:
    """Reference: one expert at a time, gathering the tokens routed to it.

    x_TD: [T, D]. topk_idx_TK: [T, K] expert ids in 0..E-1. topk_w_TK: [T, K] routing weights.
    w1_EFD, w3_EFD: [E, F, D]. w2_EDF: [E, D, F]. act(gate, up) -> h, e.g. situ_glu or swiglu.
    Returns y_TD: [T, D] in x's dtype.
    NOTE: one host sync per expert (nonzero); a reference, not for speed.
    """
    _check_inputs(x_TD, topk_idx_TK, topk_w_TK, w1_EFD, w2_EDF, w3_EFD)
    if weight_fn is not None:
        w1_EFD, w2_EDF, w3_EFD = weight_fn(w1_EFD), weight_fn(w2_EDF), weight_fn(w3_EFD)
    E = w1_EFD.shape[0]
    if topk_idx_TK.numel() > 0 and (int(topk_idx_TK.min()) < 0 or int(topk_idx_TK.max()) >= E):
        raise ValueError(
            f"topk_idx must hold expert ids in 0..{E - 1}, got min {int(topk_idx_TK.min())}, max {int(topk_idx_TK.max())}"
        )
    acc_dtype = torch.promote_types(x_TD.dtype, torch.float32)
    y_TD = torch.zeros(x_TD.shape, dtype=acc_dtype, device=x_TD.device)
    for e in range(E):
        token, slot = (topk_idx_TK == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        x_nD = x_TD[token]
        h_nF = act(x_nD @ w1_EFD[e].T, x_nD @ w3_EFD[e].T)
        out_nD = h_nF @ w2_EDF[e].T
        y_TD = y_TD.index_add(0, token, topk_w_TK[token, slot].to(acc_dtype).unsqueeze(-1) * out_nD.to(acc_dtype))
    return y_TD.to(x_TD.dtype)


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether ``torch._grouped_mm`` (hence moe_experts_grouped) runs on this device and dtype.

    Returns (ok, reason); the reason is meant to be printed where the backend is chosen.
    As of torch 2.11 .. 2.13: the CPU runs fp32, bf16 and fp16 through torch's per-group loop of
    mm (measured here, torch 2.13); CUDA runs bf16 on sm90+ through a fused CUTLASS kernel, and
    fp32/fp16 (and bf16 below sm90) through the same per-group loop, which needs compute
    capability 8.0+ (from pytorch/pytorch PRs #161407 and #162059, not yet measured on a GPU).
    NOTE: torch.compile only traces bf16 here (the fake-tensor rule of aten._grouped_mm
    rejects other dtypes): `openk3.ops.moe_experts` runs it outside the graph for other dtypes.
    NOTE: every dimension a grouped matmul reads along must be a multiple of 16 bytes
    (D and F multiples of 4 in fp32, of 8 in bf16); moe_experts_grouped checks the shapes.
    """
    device = torch.device(device)
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False, f"torch._grouped_mm takes fp32, bf16 or fp16, not {dtype}"
    if device.type == "cpu":
        return True, f"CPU {dtype}: torch._grouped_mm runs as a loop of mm per expert"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return False, f"CUDA sm_{major}{minor}: torch._grouped_mm needs compute capability 8.0 or newer"
        if dtype == torch.bfloat16 and major >= 9:
            return True, f"CUDA sm_{major}{minor} bf16: fused grouped GEMM kernel"
        return True, f"CUDA sm_{major}{minor} {dtype}: torch._grouped_mm runs as a loop of mm per expert (host sync)"
    return False, f"torch._grouped_mm is not known to run on device type {device.type!r}"


# At most this many token slots (S = T*K) are put in expert order by counting rather than by torch.sort. Counting
# compares every pair of slots ([S, S] bools, 4 MiB at the limit) in a few elementwise kernels; at a decode step of
# kimi-linear-1.5b (batch 64, 256 slots) on the H200 the sort's radix kernel alone took 26 us a MoE layer (issue
# #12). Beyond it (training, prefill chunks) the pairs would grow as S^2, so the sort stays.
COUNT_ORDER_MAX_SLOTS = 2048


def expert_order(expert_S: Tensor, E: int) -> tuple[Tensor, Tensor]:
    """Token slots grouped by expert: order_S [S] int64 (expert 0's slots in slot order, then expert 1's, ...) and
    offs_E [E] int32, the end row of every expert's range (int32 as _grouped_mm takes it). Exactly a stable sort of
    the ids expert_S [S] and a searchsorted over the sorted ids, for any ids (out-of-range ones included).
    NOTE: neither path syncs with the host, which CUDA-graph capture of the engine's decode step forbids
    (serve/static.py); hence no bincount + cumsum (CUDA's bincount reads the max id back to the host)."""
    S = expert_S.shape[0]
    experts_E = torch.arange(E, device=expert_S.device, dtype=expert_S.dtype)
    if S > COUNT_ORDER_MAX_SLOTS:
        sorted_S, order_S = torch.sort(expert_S, stable=True)
        return order_S, torch.searchsorted(sorted_S, experts_E, right=True, out_int32=True)
    slot_S = torch.arange(S, device=expert_S.device)
    # (expert, slot) as one number, ordered as the stable sort orders slots; a slot's row in the sorted order is
    # how many slots come before it, an expert's end row how many ids are <= its own
    key_S = torch.add(slot_S, expert_S, alpha=S)  # expert * S + slot, in one op
    row_S = (key_S[None, :] < key_S[:, None]).sum(1)
    order_S = torch.empty_like(slot_S).scatter_(0, row_S, slot_S)
    return order_S, (expert_S[None, :] <= experts_E[:, None]).sum(1, dtype=torch.int32)


def grouped_expert_outputs(
    x_TD: Tensor,
    topk_idx_TK: Tensor,
    w1_EFD: Tensor,
    w2_EDF: Tensor,
    w3_EFD: Tensor,
    act: Activation,
    weight_fn: WeightFn | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The experts' outputs of moe_experts_grouped before the routing weights: out_SD [S, D] in x's dtype, one row
    per token slot in expert order, order_S [S], the slot (t*K + k) of each row, and token_S [S], its token (t).
    Checks as moe_experts_grouped."""
    ok, reason = grouped_mm_supported(x_TD.device, x_TD.dtype)
    if not ok:
        raise ValueError(f"moe_experts_grouped cannot run here: {reason}; use moe_experts_loop")
    D = x_TD.shape[1]
    F = w1_EFD.shape[1]
    align = 16 // x_TD.element_size()
    if D % align != 0 or F % align != 0:
        raise ValueError(
            f"torch._grouped_mm needs D and F to be multiples of {align} for {x_TD.dtype} "
            f"(16-byte strides), got D={D}, F={F}; use moe_experts_loop"
        )
    if weight_fn is not None:
        w1_EFD, w2_EDF, w3_EFD = weight_fn(w1_EFD), weight_fn(w2_EDF), weight_fn(w3_EFD)

    K = topk_idx_TK.shape[1]
    expert_S = topk_idx_TK.reshape(-1)  # S = T*K token slots, slot s belongs to token s // K
    order_S, offs_E = expert_order(expert_S, w1_EFD.shape[0])
    token_S = order_S // K
    x_SD = x_TD[token_S]
    # NOTE: the transposed weight views ([E, D, F] with strides (F*D, 1, D)) are what
    # _grouped_mm expects for "x @ w.T"; no copy is made.
    gate_SF = torch._grouped_mm(x_SD, w1_EFD.transpose(-2, -1), offs=offs_E)
    up_SF = torch._grouped_mm(x_SD, w3_EFD.transpose(-2, -1), offs=offs_E)
    h_SF = act(gate_SF, up_SF)
    return torch._grouped_mm(h_SF, w2_EDF.transpose(-2, -1), offs=offs_E), order_S, token_S


def moe_experts_grouped(
    x_TD: Tensor,
    topk_idx_TK: Tensor,
    topk_w_TK: Tensor,
    w1_EFD: Tensor,
    w2_EDF: Tensor,
    w3_EFD: Tensor,
    act: Activation,
    weight_fn: WeightFn | None = None,
) -> Tensor:
    """Same as moe_experts_loop, with one ``torch._grouped_mm`` per weight (`grouped_expert_outputs`).

    The T*K token slots are put in expert order (`expert_order`: a stable sort, or counting for few slots)
    so each expert's tokens are one contiguous row range; ``offs`` holds the end row of every expert's
    range (equal neighbours = an expert with no tokens). Outputs are scattered back to their tokens with
    an fp32 index_add (at inference, openk3/ops/moe_gemv.py's `combine_slots` does that part in one kernel).
    Raises ValueError if grouped_mm_supported says no, or if D or F breaks the 16-byte rule.
    NOTE: expert ids are not range-checked here (that would sync with the GPU), and an id outside
    0..E-1 raises nothing: a negative id joins expert 0's rows, an id >= E no expert's (its
    slot's output is garbage). The router's top-k guarantees the range; the loop checks it.
    """
    _check_inputs(x_TD, topk_idx_TK, topk_w_TK, w1_EFD, w2_EDF, w3_EFD)
    out_SD, order_S, token_S = grouped_expert_outputs(x_TD, topk_idx_TK, w1_EFD, w2_EDF, w3_EFD, act, weight_fn)
    # fp32 weight x out_SD promotes the product to fp32 (no cast of out_SD first); summed in place into the zeros
    weight_S = topk_w_TK.reshape(-1)[order_S].float()
    y_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    y_TD.index_add_(0, token_S, weight_S.unsqueeze(-1) * out_SD)
    return y_TD.to(x_TD.dtype)
