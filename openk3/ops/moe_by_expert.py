"""Routed experts for small batches: each expert's weights read once for all its token slots (issue #12).

Between decode at batch 1-4 at K = 4 (the GEMV kernels of moe_gemv.py, S <= GEMV_MAX_SLOTS = 16, where every token
slot reads its own expert: at S = 64 slots that would be ~64 expert copies) and prefill (the grouped matmuls) lies
decode at batch 5-256 and small prefill chunks. There the grouped path at inference (`moe_experts_grouped_combined`) ran, on one H200 at
kimi-linear-1.5b's shapes (E = 32, F = 512, D = 1536, K = 4, bf16) at batch 64 (S = 256): three
`torch._grouped_mm` reading the experts at ~2 TB/s (~73 us a layer for 151 MB) plus ~30 us of small ops
(`expert_order`'s 9, the gather of x's rows, each matmul's prepare kernel, the activation, the scatter before
`combine_slots`). Here it is four launches, grids from static shapes only (E, F, D, S):

- ordering, grid (S + E) / BLOCK_ORDER: the stable sort of the slots by expert, by counting: the row of slot s is
  the number of slots j with (e_j, j) < (e_s, s), and the end row of expert e the number with e_j <= e. Writes
  order_S (row -> slot), row_S (slot -> row) and offs_E (end rows). O(S^2) comparisons, nothing at these sizes
  (S = 1024: a million, spread over 33 programs; the loop over the slots unrolled to S rounded up to a power of
  two). Ids are clamped to 0..E-1 as the GEMV kernels clamp them.
- kernel 1 (gate/up), grid (chunks, F tiles): program (p, f) takes one chunk of BLOCK_M rows of one expert's group
  (the groups' chunks in expert order; each program finds its own from offs_E, E loads and a prefix sum; a grid of
  `chunk_programs` = min(S, S // BLOCK_M + min(E, S)) bounds them all, so it is static, and the programs past the
  last chunk exit), gathers the x rows of their tokens (slot // K), computes gate and up tiles with tl.dot over D in
  fp32, and `glu_rounded` (moe_gemv.py: the GEMV kernel's activation and roundings) stores h [S, F] in x's dtype,
  one row per slot in expert order.
- kernel 2 (down), grid (chunks, D tiles): out[row, d] = h[row, :] . w2[e, d, :] in fp32, rounded to x's dtype.
- `combine_rows` (moe_gemv.py): y[t] = sum_k topk_w[t, k] * out[row of slot t*K + k] in fp32, k in order, cast
  (the weights rounded to x's dtype first, as Experts.forward gives them).

So every expert's weights are read from memory once per layer (a program's F or D tile of them; a group of more
than BLOCK_M rows has each tile read by as many programs as it has chunks, from L2 when they run together: not
measured), at the precision of openk3/ops/moe.py's docstring: `moe_experts_by_expert` has `moe_experts_loop`'s
signature and result (tests/ops/test_moe_by_expert.py). Forward only; no host syncs and no data-dependent shapes,
so it can be captured in the decode step's CUDA graph.
NOTE: two launches instead of four were tried and measured in the twelfth session (the same engine run on one
H200, decode steps at batch 16 / 64): each program finding its expert's slots by scanning the ids (no ordering
kernel) and the down kernel's last program per D tile combining (a ticket, as ops/router_topk.py): 1.77 / 2.59 ms a
step against these four launches' 1.75 / 2.50 (the scan's latency comes before every program's first load); the
ordering kernel kept and only the combine moved into the down kernel: 1.75 / 2.51 (its end-to-end lead in that
run, 1-2.5%, was all in the prefill, which these kernels do not run: docs/engine.md). Neither was kept.
NOTE: until the sixteenth session a program took a whole group, looping over its chunks. The random model's router
is skewed (its busiest expert takes up to 11.9% of the slots, 3.8x an even share), so at batch 64 a few groups of
more than 16 rows (up to ~30) made their programs loop twice: the gate/up kernel took 34.9-42.2 us a layer (15
layers 584 us of a step; `decode_probe.py timeline:64`, H200, fifteenth session). A program per chunk: 30.9-36.0 us
(512 us; the same probe, sixteenth session, another machine), and the engine's decode step at batch 64 2.31-2.35 ms
against 2.42-2.43 (`vs_transformers_decode.py --prefill-chunk 32768`, the session start's code from a copy, two
runs each, one machine; batch 16 unchanged at 1.65-1.66). BLOCK_M_MIN 32 instead (one chunk for groups up to 32
rows) was slower: 2.41 ms a step against 2.35 (`--prefill-chunk 8192`, where the last steps of a run have fewer
rows, so its ms a step read lower than at 32768's).
`openk3.ops.moe_experts` sends a call here when `by_expert_applies` and the GEMV kernels do not take it.

The crossovers (GEMV_MAX_SLOTS below, BY_EXPERT_MAX_SLOTS above) come from bench/moe_gemv.py on an H200 (see
their NOTEs), and so do the tiles. Triton's interpreter (TRITON_INTERPRET=1) runs
the kernels on CPU tensors, as for moe_gemv.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from openk3.ops.moe import Activation, WeightFn
from openk3.ops.moe_gemv import INTERPRET, check_kernel_call, check_shared, combine_rows, kernels_apply, triton

if triton is not None:
    import triton.language as tl

    from openk3.ops.moe_gemv import glu_rounded

# NOTE: the largest S = T*K sent here (GEMV_MAX_SLOTS and below go to the GEMV kernels first). Above it the grouped
# matmuls, whose CUTLASS kernels should win once every expert has many rows. Measured on one H200 (kimi-linear-1.5b,
# bench/moe_gemv.py --layers 15, tenth session): at S = 1024, the largest the bench times by default, this path took
# 91.8 us a call against grouped+combine's 137.1 (S = 64 / 256: 44.4 / 49.4 against 119.2 / 122.4); past 1024 not
# measured.
BY_EXPERT_MAX_SLOTS = 1024

# Tile sizes (powers of two, tl.dot needs 16 or more; a tile is capped at its dimension rounded up to a power of
# two): at kimi-linear-1.5b's shapes and S = 256, 48 chunk programs x F / BLOCK_F = 768 programs in kernel 1 and
# 48 x D / BLOCK_D = 1,152 in kernel 2 (before the sixteenth session's chunk grid: E x 16 = 512 and E x 24 = 768).
# Measured with that earlier grid on one H200 (bench/moe_gemv.py --tokens 16 64 8 --layers 15 --by-expert-blocks
# ..., twelfth session): at S = 32 / 64 / 256 these took 33.6 / 44.9 / 49.2 us a call (3.1-3.2 TB/s of the experts'
# weights at S >= 64), and the best of 14 other tile and warp sets 33.2 / 44.2 / 49.0: within 2%. Not swept again
# with the chunk grid, nor BY_EXPERT_MAX_SLOTS above.
BLOCK_F, BLOCK_D1 = 32, 128  # kernel 1: F rows of w1/w3 x D per step
BLOCK_D, BLOCK_F2 = 64, 128  # kernel 2: D rows of w2 x F per step
WARPS = (4, 4)
STAGES = (3, 3)  # Triton's default on the GPU
# Rows (token slots) of an expert a program multiplies at once: the mean group S / E rounded up to a power of two,
# within these bounds (16: tl.dot's least; 64: two accumulators of 64 x 32 fp32 stay in registers). From static
# shapes only, so a captured graph keeps it.
BLOCK_M_MIN, BLOCK_M_MAX = 16, 64
# The ordering kernel: queries (slots or experts) a program x slots compared a step. NOTE: measured on one H200
# (seventeenth session, 15 calls in a CUDA graph, by a session probe not committed; its printout is in
# bench/results/decode_probe/seventeenth/call1_log.txt): with the loop over the slots a runtime one (S an argument)
# and 64, 4.60 us a call at S = 256 (2.46 at 64, 13.08 at 1024); unrolled with S a compile-time constant, 32: 3.38
# (1.72, 9.98); 64: 4.33 (2.28, 12.28); 128: 30.73 (3.44, 122.34). The kernel now unrolls to S_MAX, S rounded up to
# a power of two, with S an argument (fewer compiles): at these S, all powers of two, the same loop; not timed again.
BLOCK_ORDER = 32


def by_expert_applies(x_TD: Tensor, topk_idx_TK: Tensor, topk_w_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor,
                      w3_EFD: Tensor, act: Activation, weight_fn: WeightFn | None = None) -> bool:
    """The per-call test (same arguments as the expert functions): a forward of at most BY_EXPERT_MAX_SLOTS slots
    the kernels can run. Reads only shapes and flags, so it does not sync and is fixed for a captured graph."""
    return topk_idx_TK.numel() <= BY_EXPERT_MAX_SLOTS and kernels_apply(x_TD, topk_w_TK, w1_EFD, w2_EDF, w3_EFD,
                                                                        act, weight_fn)


def block_m(S: int, E: int) -> int:
    """Rows per chunk for S slots over E experts (BLOCK_M_MIN, BLOCK_M_MAX)."""
    return min(BLOCK_M_MAX, max(BLOCK_M_MIN, triton.next_power_of_2(triton.cdiv(S, E))))


def chunk_programs(S: int, E: int, block_rows: int) -> int:
    """The kernels' programs for the routed rows (`_chunk`): at least the chunks of block_rows rows that any routing
    of S slots over E experts makes. A group of n > 0 rows is ceil(n / block_rows) <= n // block_rows + 1 chunks, and
    at most min(E, S) groups are not empty, so the chunks are at most S // block_rows + min(E, S); each holds a row,
    so at most S."""
    return min(S, S // block_rows + min(E, S))


if triton is not None:
    @triton.jit
    def _order_kernel(idx_ptr, order_ptr, row_ptr, offs_ptr, S, E, S_MAX: tl.constexpr, BLOCK: tl.constexpr):
        """Queries q < S are slots: row[q] = #{j : (e_j, j) < (e_q, q)}, order[row[q]] = q. Queries S + e are
        experts: offs[e] = #{j : e_j <= e}. Both counts of one comparison, key_j < key_q with key = e * S + slot:
        an expert's key is (e + 1) * S. The loop over the slots runs to S_MAX >= S, a compile-time power of two, so
        it unrolls and its loads are all in flight at once (BLOCK_ORDER's NOTE), with one compile per power of two
        (eager forwards at every batch size: 6 between the GEMV kernels' 16 slots and BY_EXPERT_MAX_SLOTS)."""
        q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        is_slot = q < S
        e_q = tl.minimum(tl.maximum(tl.load(idx_ptr + q, mask=is_slot, other=0).to(tl.int64), 0), E - 1)
        key_q = tl.where(is_slot, e_q * S + q, (q - S + 1).to(tl.int64) * S)
        count = tl.zeros((BLOCK,), dtype=tl.int32)
        for j0 in tl.static_range(0, S_MAX, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            j_mask = j < S
            e_j = tl.minimum(tl.maximum(tl.load(idx_ptr + j, mask=j_mask, other=0).to(tl.int64), 0), E - 1)
            before = (e_j * S + j)[None, :] < key_q[:, None]
            count += tl.sum((before & j_mask[None, :]).to(tl.int32), axis=1)
        tl.store(row_ptr + q, count, mask=is_slot)
        tl.store(order_ptr + count, q, mask=is_slot)
        tl.store(offs_ptr + (q - S), count, mask=(q >= S) & (q < S + E))

    @triton.jit
    def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ b in fp32. UPCAST: the operands turned fp32 first (exact for bf16), for the interpreter only."""
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _chunk(offs_ptr, p, E, S, T, R, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        """Program p's expert and rows: (e, start, end). Programs p < R take the routed groups' chunks of BLOCK_M rows
        in expert order (offs holds every group's end; a group of n rows is cdiv(n, BLOCK_M) chunks), one chunk
        each; those past the last chunk get start = end (nothing to do). Programs p >= R take the shared expert's
        (p - R)-th chunk of BLOCK_M of the T rows S ... S + T - 1 (token t's at row S + t), as expert e = E."""
        if p < R:
            es = tl.arange(0, BLOCK_E)
            valid = es < E
            ends = tl.load(offs_ptr + es, mask=valid, other=0)
            starts = tl.load(offs_ptr + es - 1, mask=valid & (es > 0), other=0)
            chunks = tl.where(valid, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
            before = tl.cumsum(chunks, 0) - chunks  # chunks of the experts ahead of each
            mine = valid & (before <= p) & (p < before + chunks)  # at most one expert's chunk range holds p
            e = tl.sum(tl.where(mine, es, 0), 0)
            start = tl.sum(tl.where(mine, starts + (p - before) * BLOCK_M, 0), 0)
            end = tl.minimum(start + BLOCK_M, tl.sum(tl.where(mine, ends, 0), 0))
        else:
            e = E
            start = S + (p - R) * BLOCK_M
            end = tl.minimum(start + BLOCK_M, S + T)
        return e, start, end

    @triton.jit
    def _tokens(order_ptr, rows, m_mask, S, K: tl.constexpr):
        """The tokens of rows (in expert order; the shared expert's rows S + t are token t)."""
        routed = rows < S
        slot = tl.load(order_ptr + rows, mask=m_mask & routed, other=0)
        return tl.where(routed, slot // K, rows - S).to(tl.int64)

    @triton.jit
    def _gate_up_kernel(x_ptr, order_ptr, offs_ptr, w1_ptr, w3_ptr, w1s_ptr, w3s_ptr, h_ptr, E, S, T, R,
                        F: tl.constexpr, D: tl.constexpr, K: tl.constexpr, stride_xt, stride_xd, stride_we,
                        stride_wf, stride_wd, SITU: tl.constexpr, beta, linear_beta, PRECISION: tl.constexpr,
                        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr,
                        BLOCK_D: tl.constexpr):
        """h[r, f] = act(round(x_t . w1[e, f]), round(x_t . w3[e, f])) for the rows r of program (p, f)'s chunk
        (`_chunk`), e their expert, t a row's token; the shared expert's chunks through w1s, w3s.
        F, D, K compile-time constants as in moe_gemv.py's kernels (one compile per layer shape)."""
        e, start, end = _chunk(offs_ptr, tl.program_id(0), E, S, T, R, BLOCK_M, BLOCK_E)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        f_mask = f < F
        # int64: e * E*F*D overflows int32 at the release's sizes
        if e < E:
            w1_at = w1_ptr + e.to(tl.int64) * stride_we
            w3_at = w3_ptr + e.to(tl.int64) * stride_we
        else:
            w1_at = w1s_ptr
            w3_at = w3s_ptr
        w_cols = f[None, :].to(tl.int64) * stride_wf  # [1, BLOCK_F]: w1[e].T's columns
        dtype = h_ptr.dtype.element_ty
        for m0 in range(start, end, BLOCK_M):  # one pass (a chunk), or none
            rows = m0 + tl.arange(0, BLOCK_M)
            m_mask = rows < end
            token = _tokens(order_ptr, rows, m_mask, S, K)
            gate = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                d_mask = d < D
                x = tl.load(x_ptr + token[:, None] * stride_xt + d[None, :] * stride_xd,
                            mask=m_mask[:, None] & d_mask[None, :], other=0.0)
                w_at = w_cols + d[:, None] * stride_wd  # [BLOCK_D, BLOCK_F]
                w_mask = d_mask[:, None] & f_mask[None, :]
                gate = _dot(x, tl.load(w1_at + w_at, mask=w_mask, other=0.0), gate, PRECISION, UPCAST)
                up = _dot(x, tl.load(w3_at + w_at, mask=w_mask, other=0.0), up, PRECISION, UPCAST)
            h = glu_rounded(gate, up, dtype, SITU, beta, linear_beta)
            tl.store(h_ptr + rows[:, None].to(tl.int64) * F + f[None, :], h, mask=m_mask[:, None] & f_mask[None, :])

    @triton.jit
    def _down_kernel(h_ptr, offs_ptr, w2_ptr, w2s_ptr, out_ptr, E, S, T, R, F: tl.constexpr, D: tl.constexpr,
                     stride_we, stride_wd, stride_wf, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr):
        """out[r, d] = round(h[r] . w2[e, d]) for the rows r of program (p, d)'s chunk, e their expert: the
        expert's output in x's dtype; the shared expert's chunks through w2s."""
        e, start, end = _chunk(offs_ptr, tl.program_id(0), E, S, T, R, BLOCK_M, BLOCK_E)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = d < D
        if e < E:
            w2_at = w2_ptr + e.to(tl.int64) * stride_we
        else:
            w2_at = w2s_ptr
        w_cols = d[None, :].to(tl.int64) * stride_wd  # [1, BLOCK_D]: w2[e].T's columns
        for m0 in range(start, end, BLOCK_M):  # one pass (a chunk), or none
            rows = m0 + tl.arange(0, BLOCK_M)
            m_mask = rows < end
            h_rows = rows[:, None].to(tl.int64) * F
            out = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for f0 in range(0, F, BLOCK_F):
                f = f0 + tl.arange(0, BLOCK_F)
                f_mask = f < F
                h = tl.load(h_ptr + h_rows + f[None, :], mask=m_mask[:, None] & f_mask[None, :], other=0.0)
                w2 = tl.load(w2_at + w_cols + f[:, None] * stride_wf, mask=f_mask[:, None] & d_mask[None, :],
                             other=0.0)
                out = _dot(h, w2, out, PRECISION, UPCAST)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & d_mask[None, :])


def expert_rows(topk_idx_TK: Tensor, E: int) -> tuple[Tensor, Tensor, Tensor]:
    """The slots t*K + k of topk_idx_TK [T, K] in expert order, by the ordering kernel: order_S [S] (the slot of
    each row: a stable sort by expert, as `moe.expert_order`), row_S [S] (the row of each slot) and offs_E [E]
    (each expert's end row), all int32. Ids are clamped to 0..E-1 (expert_order leaves them as they are)."""
    idx_S = topk_idx_TK.contiguous().view(-1)
    S = idx_S.shape[0]
    order_S = torch.empty(S, dtype=torch.int32, device=idx_S.device)
    row_S = torch.empty_like(order_S)
    offs_E = torch.empty(E, dtype=torch.int32, device=idx_S.device)
    _order_kernel[(triton.cdiv(S + E, BLOCK_ORDER),)](idx_S, order_S, row_S, offs_E, S, E,
                                                       S_MAX=triton.next_power_of_2(S), BLOCK=BLOCK_ORDER)
    return order_S, row_S, offs_E


def moe_experts_by_expert(
    x_TD: Tensor,
    topk_idx_TK: Tensor,
    topk_w_TK: Tensor,
    w1_EFD: Tensor,
    w2_EDF: Tensor,
    w3_EFD: Tensor,
    act: Activation,
    weight_fn: WeightFn | None = None,
    blocks: tuple[int, int, int, int, int] | None = None,
    warps: tuple[int, int] | None = None,
    shared: tuple[Tensor, Tensor, Tensor] | None = None,
    stages: tuple[int, int] | None = None,
) -> Tensor:
    """Same as moe_experts_loop (forward only), with the kernels of the module docstring.

    x_TD: [T, D]. topk_idx_TK: [T, K]. topk_w_TK: [T, K]. w1_EFD, w3_EFD: [E, F, D]. w2_EDF: [E, D, F].
    act: a callable `moe_gemv.glu_spec` knows. Returns y_TD: [T, D] in x's dtype.
    blocks: (BLOCK_M, BLOCK_F, BLOCK_D1, BLOCK_D, BLOCK_F2) tile sizes (powers of two, at least 16), warps: the
    warps of a program of kernel 1, kernel 2, stages: their software-pipelining stages; for the bench and the tests;
    None = the module's (`block_m`, BLOCK_*, WARPS, STAGES). Raises ValueError as moe_experts_gemv (`moe_gemv.check_kernel_call`).
    shared: a shared expert's weights, as moe_experts_gemv takes them (y is then `routed + shared`, each in x's
    dtype): its T rows follow the routed ones, in chunks of BLOCK_M rows each a program of both kernels, and the
    combine adds them.
    """
    spec = check_kernel_call("moe_experts_by_expert", x_TD, topk_idx_TK, topk_w_TK, w1_EFD, w2_EDF, w3_EFD, act,
                             weight_fn)
    T, D = x_TD.shape
    E, F, _ = w1_EFD.shape
    K = topk_idx_TK.shape[1]
    S = T * K
    if S == 0:
        return torch.zeros((T, D), dtype=x_TD.dtype, device=x_TD.device)

    def cap(block: int, n: int) -> int:
        return min(block, max(16, triton.next_power_of_2(n)))
    block_rows, block_f, block_d1, block_d, block_f2 = blocks or (
        block_m(S, E), cap(BLOCK_F, F), cap(BLOCK_D1, D), cap(BLOCK_D, D), cap(BLOCK_F2, F))
    warps1, warps2 = warps or WARPS
    stages1, stages2 = stages or STAGES
    # one set of strides serves the gate and up matrices of every expert (and the down matrices theirs)
    w1_EFD, w3_EFD, w2_EDF = (w.contiguous() for w in (w1_EFD, w3_EFD, w2_EDF))
    # NOTE: tl.dot on fp32 defaults to TF32 on the GPU (10-bit mantissas); the reference multiplies in full fp32
    # (bf16 and fp16 products are exact in fp32 whatever the flag says). And Triton's interpreter (3.9) multiplies
    # bf16 tiles as their raw bits: there the kernels turn them fp32 first
    upcast = INTERPRET and x_TD.dtype == torch.bfloat16
    precision = "ieee" if x_TD.dtype == torch.float32 or upcast else "tf32"
    w1s, w2s, w3s = check_shared(shared, w1_EFD, x_TD) if shared is not None else (w1_EFD, w2_EDF, w3_EFD)
    order_S, row_S, offs_E = expert_rows(topk_idx_TK, E)
    # one program per chunk of BLOCK_M rows of a group, then the shared expert's rows S ... S + T - 1 after the
    # routed ones, in chunks of BLOCK_M rows
    routed = chunk_programs(S, E, block_rows)
    rows = S + (T if shared is not None else 0)
    programs = routed + (triton.cdiv(T, block_rows) if shared is not None else 0)
    block_e = triton.next_power_of_2(E)
    h_SF = torch.empty((rows, F), dtype=x_TD.dtype, device=x_TD.device)
    out_SD = torch.empty((rows, D), dtype=x_TD.dtype, device=x_TD.device)
    _gate_up_kernel[(programs, triton.cdiv(F, block_f))](
        x_TD, order_S, offs_E, w1_EFD, w3_EFD, w1s, w3s, h_SF, E, S, T, routed, F, D, K, *x_TD.stride(),
        *w1_EFD.stride(), SITU=spec.kind == "situ", beta=float(spec.beta), linear_beta=float(spec.linear_beta),
        PRECISION=precision, UPCAST=upcast, BLOCK_M=block_rows, BLOCK_E=block_e, BLOCK_F=block_f, BLOCK_D=block_d1,
        num_warps=warps1, num_stages=stages1)
    _down_kernel[(programs, triton.cdiv(D, block_d))](
        h_SF, offs_E, w2_EDF, w2s, out_SD, E, S, T, routed, F, D, *w2_EDF.stride(), PRECISION=precision,
        UPCAST=upcast, BLOCK_M=block_rows, BLOCK_E=block_e, BLOCK_D=block_d, BLOCK_F=block_f2, num_warps=warps2,
        num_stages=stages2)
    return combine_rows(out_SD, row_S, topk_w_TK, shared=shared is not None)
