"""Kimi Delta Attention, one token at a time: the reference every faster path is tested against.

Spec section 2.1, per head, with the state S a [K, V] matrix in fp32:

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

written here in the equivalent "decay, then delta-rule write" order that flash-linear-attention's
`naive_recurrent_kda` also uses:

    S <- Diag(exp g_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T

The ops take already projected and activated tensors; the model does the projections, the short
convolution, SiLU and the log-decay g. This file also holds the input checks and the q/k
normalisation that the other KDA paths share, so that there is one copy of each.
"""

import torch
from torch import Tensor


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (spec 2.1's q/k normalisation)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def check_kda_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     initial_state: Tensor | None, cu_seqlens: Tensor | None) -> int:
    """Check the shapes shared by every KDA path and return N, the number of sequences.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; cu_seqlens: [N+1] integer (B must be 1);
    initial_state: [N, H, K, V] with N = B, or the number of sequences when cu_seqlens is given.
    Only shapes are checked here, never values, so the check costs no device synchronisation.
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if T == 0:
        raise ValueError(f"KDA needs at least one token, got q of shape {tuple(q.shape)}")
    for name, x in (("k", k), ("g", g)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1] with N >= 1, "
                             f"got dtype {cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens needs the sequences packed into batch size 1, got B={B}")
        N = cu_seqlens.numel() - 1
    V = v.shape[-1]
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, V)}, "
                         f"got {tuple(initial_state.shape)}")
    return N


def sequence_bounds(cu_seqlens: Tensor | None, batch: int, length: int) -> list[tuple[int, int, int]]:
    """The sequences as (row in the batch, start, end) on the host, with cu_seqlens' values checked.

    Without cu_seqlens every batch row is one sequence [0, length). With it (batch is 1) sequence i
    is [cu_seqlens[i], cu_seqlens[i+1]) of row 0; empty sequences are allowed.
    """
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    cuts = cu_seqlens.tolist()
    if cuts[0] != 0 or cuts[-1] != length or any(a > b for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={length} without decreasing, got {cuts}")
    return [(0, start, end) for start, end in zip(cuts, cuts[1:])]


def naive_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """KDA as a plain loop over time, in fp32.

    Args:
        q, k: [B, T, H, K]. v: [B, T, H, V].
        g: [B, T, H, K] per-channel log-decay (<= 0), already computed by the model.
        beta: [B, T, H] write strength, already in (0, 1).
        scale: multiplies q; defaults to K ** -0.5.
        initial_state: [N, H, K, V], any float dtype (used in fp32); zeros when None.
        output_final_state: return the state after the last token of each sequence.
        use_qk_l2norm_in_kernel: replace q and k by l2norm(q), l2norm(k) first.
        cu_seqlens: [N+1] boundaries of N sequences packed into batch row 0 (needs B == 1); each
            sequence starts from its own initial_state row, and no state crosses a boundary.
    Returns:
        o: [B, T, H, V] in q's dtype; final state [N, H, K, V] fp32, or None.
    """
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    out_dtype = q.dtype
    # fp32 from here on; o is cast back to q's dtype on the last line.
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * scale

    if cu_seqlens is None:  # every row is one sequence of length T: step them all together
        S_BHKV = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
        o_BTHV, S_BHKV = delta_rule(S_BHKV, q, k, v, g, beta)
        return o_BTHV.to(out_dtype), (S_BHKV if output_final_state else None)
    o_parts, states = [], []
    for n, (_, start, end) in enumerate(sequence_bounds(cu_seqlens, B, T)):
        S_1HKV = q.new_zeros(1, H, K, V) if initial_state is None else initial_state[n:n + 1].float()
        o_1LHV, S_1HKV = delta_rule(S_1HKV, *(x[:, start:end] for x in (q, k, v, g, beta)))
        o_parts.append(o_1LHV)
        states.append(S_1HKV)
    final_state = torch.cat(states) if output_final_state else None
    return torch.cat(o_parts, dim=1).to(out_dtype), final_state


def delta_rule(S_NHKV: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """N sequences of one length L through the gated delta rule, one token at a time (all fp32).
    q, k, g: [N, L, H, K]; v: [N, L, H, V]; beta: [N, L, H]; S: [N, H, K, V]. Returns o [N, L, H, V], S."""
    o_steps = []
    for t in range(q.shape[1]):
        S_NHKV = S_NHKV * g[:, t].exp()[..., None]  # decay each key channel
        error_NHV = v[:, t] - torch.einsum("nhk,nhkv->nhv", k[:, t], S_NHKV)  # what the state mispredicts
        S_NHKV = S_NHKV + beta[:, t][..., None, None] * k[:, t][..., None] * error_NHV[..., None, :]
        o_steps.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S_NHKV))
    N, _, H, V = v.shape
    o_NLHV = torch.stack(o_steps, dim=1) if o_steps else q.new_zeros(N, 0, H, V)
    return o_NLHV, S_NHKV
