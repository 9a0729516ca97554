"""Kimi Delta Attention in chunks, in plain PyTorch: the CPU training path (spec 2.1, "Chunked form").

Within a chunk of C tokens, with G the inclusive cumulative sum of g inside the chunk and S the
state at the chunk's start, the recurrence unrolls to (all products per channel, i, j in the chunk):

    A_kk[i,j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)      i > j  (0 elsewhere)
    A_qk[i,j] =        sum_c q_ic k_jc exp(G_ic - G_jc)      i >= j (0 elsewhere)
    (I + A_kk) [W | U] = Diag(beta) [exp(G) * K | V]           (the WY representation, a triangular solve)
    V_new = U - W S                                            (what each token actually writes)
    O     = (Q * exp(G)) S + A_qk V_new
    S     = Diag(exp G_C) S + (exp(G_C - G) * K)^T V_new

Everything but the last three lines is computed for all chunks at once; only the state pass loops
over chunks. Autograd differentiates through all of it.

NOTE: numerical safety for any decay. g <= 0, so G falls along the chunk and every exponent used
here is <= 0: exp(G_i - G_j) only for i >= j (masked to -inf BEFORE exp), exp(G) and exp(G_C - G).
Kimi-Linear's unbounded decay (-50 per step and below) then underflows to 0 instead of overflowing.
A single reference point (exp(G_i) * exp(-G_j)) would overflow fp32 after ~88 units of decay.
The price is the [C, C, K] decay tensor per chunk: memory B*H*T*C*K floats, so lower chunk_size
when that matters on CPU.
"""

import torch
from torch import Tensor

from openk3.ops.kda.naive import check_kda_inputs, l2norm, sequence_bounds


def chunk_kda_torch(
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
    chunk_size: int = 16,
) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA; same arguments and results as `naive_recurrent_kda`, plus chunk_size.

    Args:
        q, k: [B, T, H, K]. v: [B, T, H, V]. g: [B, T, H, K] log-decay (<= 0). beta: [B, T, H].
        scale: multiplies q; defaults to K ** -0.5.
        initial_state: [N, H, K, V], used in fp32; zeros when None.
        output_final_state: return the state after the last token of each sequence.
        use_qk_l2norm_in_kernel: replace q and k by l2norm(q), l2norm(k) first.
        cu_seqlens: [N+1] boundaries of N sequences packed into batch row 0 (needs B == 1).
        chunk_size: tokens per chunk; any T works (each sequence is padded to whole chunks). The default 16
            is the fastest measured for training the tiny preset on 2 CPU cores (fwd+bwd, B=8, T=256:
            1.5 s at 16, 2.4 s at 32, 19.9 s at 64, where the [C, C, K] decay tensor stops fitting in cache).
    Returns:
        o: [B, T, H, V] in q's dtype; final state [N, H, K, V] fp32, or None.
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
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

    # Lay the sequences out as N rows, each padded at its end to a whole number of chunks.
    # NOTE: padded tokens have k = v = q = 0, g = 0 and beta = 0, so they write nothing and decay
    # nothing: the state after the padding is the state after the sequence's last real token.
    bounds = sequence_bounds(cu_seqlens, B, T)
    lengths = torch.tensor([end - start for _, start, end in bounds], device=q.device)
    starts = torch.tensor([row * T + start for row, start, _ in bounds], device=q.device)
    # the longest from the host's bounds, not lengths.max(): reading that back is a host sync per layer and forward
    padded_len = -(-max(end - start for _, start, end in bounds) // chunk_size) * chunk_size
    position = torch.arange(padded_len, device=q.device)
    is_real_NL = position[None, :] < lengths[:, None]
    # Each padded slot reads its token from the flattened [B*T] stream, or the extra zero row B*T.
    source_NL = torch.where(is_real_NL, starts[:, None] + position[None, :], B * T)

    def pad(x: Tensor) -> Tensor:
        x_flat = x.flatten(0, 1)
        return torch.cat([x_flat, x_flat.new_zeros(1, *x_flat.shape[1:])])[source_NL]

    S0_NHKV = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.float()
    o_NLHV, S_NHKV = _chunked_delta_rule(pad(q), pad(k), pad(v), pad(g), pad(beta), S0_NHKV, chunk_size)

    o_BTHV = o_NLHV[is_real_NL].reshape(B, T, H, V)
    return o_BTHV.to(out_dtype), (S_NHKV if output_final_state else None)


def _chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor,
                        C: int) -> tuple[Tensor, Tensor]:
    """The chunked recurrence on fp32 tensors whose length L is a multiple of C.

    q (already scaled), k, g: [N, L, H, K]; v: [N, L, H, V]; beta: [N, L, H]; S: [N, H, K, V].
    Returns o [N, L, H, V] and the final state [N, H, K, V].
    """
    N, L, H, K = q.shape
    V = v.shape[-1]
    n = L // C

    def chunks(x: Tensor) -> Tensor:  # [N, L, H, ...] -> [N, H, n, C, ...]
        return x.reshape(N, n, C, H, *x.shape[3:]).movedim(3, 1)

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    G = g.cumsum(-2)                                                 # [N, H, n, C, K]

    # decay[i, j, c] = exp(G_ic - G_jc) for i >= j and 0 above the diagonal (see NOTE at the top).
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    G_diff = G[..., :, None, :] - G[..., None, :, :]                 # [N, H, n, C, C, K]
    decay = G_diff.masked_fill(~causal_CC[:, :, None], float("-inf")).exp()
    k_decayed = decay * k[..., None, :, :]                           # k_j exp(G_i - G_j)
    A_qk = torch.einsum("...ik,...ijk->...ij", q, k_decayed)         # [N, H, n, C, C], i >= j
    A_kk = (beta[..., None] * torch.einsum("...ik,...ijk->...ij", k, k_decayed)).tril(-1)

    # [W | U] = (I + A_kk)^-1 Diag(beta) [exp(G) * K | V]; the unit diagonal is implied.
    rhs = beta[..., None] * torch.cat([G.exp() * k, v], dim=-1)
    W, U = torch.linalg.solve_triangular(A_kk, rhs, upper=False, unitriangular=True).split([K, V], -1)

    q_from_start = q * G.exp()                                       # reads S as it was at chunk start
    k_to_end = (k * (G[..., -1:, :] - G).exp()).transpose(-1, -2)    # [N, H, n, K, C]
    decay_to_end = G[..., -1, :].exp()[..., None]                    # [N, H, n, K, 1]

    o_chunks = []
    for i in range(n):
        v_new = U[:, :, i] - W[:, :, i] @ S                          # [N, H, C, V]
        o_chunks.append(q_from_start[:, :, i] @ S + A_qk[:, :, i] @ v_new)
        S = decay_to_end[:, :, i] * S + k_to_end[:, :, i] @ v_new
    o = torch.stack(o_chunks, dim=2)                                 # [N, H, n, C, V]
    return o.movedim(1, 3).reshape(N, L, H, V), S
