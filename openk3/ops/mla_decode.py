"""MLA attention in latent space over a paged cache, read in place: a Triton flash-decoding kernel (issue #12).

The decode form of MLA (`GatedMLA.attend_absorbed`, openk3/model/model.py) scores the queries folded into latent
space, q_cat = [q_nope . w_k | q_pe] [B, T*H, r + rope], against every cached latent [c | k_pe] and returns
o_lat = softmax(scale * q_cat . lat) @ c [B, T*H, r]; all H heads share one latent per key. `latent_attention` is that
step on a dense latent tensor (the reference, and the general path). The engine's fast decode step keeps the latents
in pages (openk3/serve/cache.py `PagePool`: [num_pages, page_size, C] per MLA layer, C = r + rope) behind a page table
[B, P], and gathered every row's pages into a contiguous copy first (`paged_latent_attention_reference`): on the H200
at batch 64 the gather, scores, mask, softmax and p @ c took ~130 us an MLA layer, at batch 1 ~16 kernels a layer.

`paged_latent_attention` reads the pages where they are, in two launches:

- kernel 1, grid (B rows, blocks of BLOCK_M query rows (heads x new tokens), key splits): a program reads its split's
  entries of the page table once (BLOCK_P pages), then walks the split's keys that the row sees BLOCK_N at a time,
  each key's page picked from them by `tl.gather` (through shared memory or warp shuffles: no load from global
  memory inside the loop feeds the latents' addresses, so Triton's pipeliner keeps the next block's latents in
  flight: see the NOTEs at STAGES); it loads the keys' latents once for all its query rows ([BLOCK_N, r] and
  [BLOCK_N, rope]), scores them with tl.dot in fp32, masks them and runs the online softmax (running max and sum in
  fp32; p = exp(s - max) rounded to the operands' dtype for p @ c, accumulated in fp32). With one split it writes
  o = acc / sum in the operands' dtype; with several, its (acc, max, sum) in fp32.
- kernel 2, grid (B x T*H query rows, R / BLOCK_COMBINE): combines the splits, o = sum_s exp(m_s - m) acc_s /
  sum_s exp(m_s - m) l_s.

Splitting the keys gives a small batch enough programs (flash-decoding); the split count is a function of the static
shapes only (B, T*H, P and page_size: `split_keys`), so a captured CUDA graph replays it for any lengths.

Visibility (serve/static.py `StepBuffers.mask`): `visible` [B] is the number of keys the row's last new token sees
(its cached tokens plus its T new ones); new token t sees keys 0 .. visible - (T - t) - 1, the causal rule of a
speculative verification (T = k + 1) or a prefill piece. Keys past a row's `visible` are never loaded, so what lies
there (another row's page, stale data) cannot reach the result; a row that sees no key returns zeros, not NaN.

Precision is attend_absorbed's (a flash kernel's): operands in q's dtype (the latents are cast to it as loaded),
scores, max and sum in fp32 with the scale applied to the fp32 scores, p rounded to the operands' dtype before p @ c
with fp32 accumulation, o_lat in the operands' dtype. Where the two differ: the kernel rounds p before normalising
(exp(s - running max), then / sum in fp32), the reference after; both are bf16 roundings of p.

Triton is optional (not a dependency): without it `paged_supported` says why and nothing here runs. With
TRITON_INTERPRET=1 in the environment when this module is imported, the kernels run in Triton's CPU interpreter on CPU
tensors (the tests). NOTE: the interpreter casts fp32 to bf16 by truncation, the GPU rounds to nearest.
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

# what triton.jit reads when it decorates the kernels below (at this module's import)
INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"

# "0": the fast decode step keeps the gather + `latent_attention` (the old path, for comparison); "1": an error where
# the kernel cannot run (`select_paged_attention`)
ENV = "OPENK3_MLA_KERNEL"

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# BLOCK_M query rows (kimi-linear-1.5b's 16 heads of a decode step: one block) x BLOCK_N keys a step; tl.dot needs
# both >= 16. A program holds acc [BLOCK_M, r] fp32 (r = 512: 32 KB). STAGES: the key loop's software pipelining.
# NOTE: measured on one H200 (bench/decode_probe.py mla: 16 heads, 512 + 64, a row's 640 keys in bf16 pages, 4 layers
# cycled; fifteenth session): BLOCK_N 16 / 32 / 64 x 1-64 splits at these warps and stages, then 2 / 4 / 8 warps x 1-4
# stages for the default and the best pair: nothing beat the defaults by more than 4% at batch 1 (7.87 us a call,
# best 7.58; the default's settings timed 7.77-8.39 in the same sweep) nor 0.3% at 16 and 64 (19.30 and 43.54 us).
# At batch 64 that is ~1.1 TB/s of the latents.
# NOTE: why the stages did not matter then (seventeenth session): the key loop loaded each key's page from the table
# and then the latents at that page, so the latents' addresses came from a load in the same iteration, and Triton
# (sm_90 TTGIR) gave the latents one shared-memory buffer and waited for every copy at the top of each iteration
# (`async_wait {num = 0}`): each block of keys waited out the memory's latency. With the split's pages read before
# the loop, 3 stages give two buffers and a wait that leaves the next block's copies in flight
# (tests/ops/test_mla_decode.py checks the compiled kernel). Measured on one H200 (a row's 512-640 keys in shuffled
# pages, 4 layers cycled; bench/results/decode_probe/seventeenth/call3_micro.json), old -> new at 3 stages: batch 64
# 42.96 -> 38.97 us a call, batch 16 19.93 -> 18.48 (2 stages 17.21), batch 1 7.48 -> 7.82; 4 and 5 stages 47.0 at
# batch 64. A loop over all of the split's keys (masked past `visible`, as before) instead of only those the row sees
# timed 36.62 / 17.19 / 7.75 at 3 stages; it was not kept, because the GPU tests and the engine ran this one.
# Still ~1.1 TB/s at batch 64: the kernel is not bound by the memory's bandwidth, and what bounds it is not known.
# NOTE: the kernel transposed (the keys as the matmuls' M, the query rows as N: s^T = c @ q^T, o^T += c^T @ p^T, so
# that Triton picks Hopper's wgmma instead of mma at 16 heads) was tried in the seventeenth session and removed:
# `decode_probe.py variants:mla` (commit 49b8be9; bench/results/decode_probe/seventeenth/variants_mla.json), batch
# 64, 4 layers cycled: 48.7-62.8 us a call at BLOCK_N 32 over 1-3 stages and 4 / 8 splits, against this kernel's
# 43.2; BLOCK_N 64 faulted (an illegal address on the device; not chased); at batch 1 (call 1) 8.33 against 8.36.
# In the engine (BLOCK_N 32, 3 stages) batch 64 ran 2.30-2.31 ms a step, as without it.
# NOTE: each key's page is picked by `tl.gather` from the split's page numbers (twentieth session). Until then it was
# a select-and-sum over a [BLOCK_N, BLOCK_P] comparison, tl.sum(tl.where(key's index == ps, split_pages, 0)), which
# Triton 3.6 compiled wrongly for the H200 in fp32 with 2 heads at BLOCK_N 32 and 3 stages (the defaults), with
# pages of 3, 5, 6, 9 and 11 tokens in a sweep (93 of 512 kernel checks off by 0.9-2.0, relative norm) and of 10 and
# 12 in tests/ops/test_mla_decode.py's page-size test; bf16 was right, and so was the select-and-sum at 1 stage (568
# checks). A call whose files were lost also saw it right at BLOCK_N 16, and wrong at 2 stages with pages of 3 only;
# there the engine's wrong calls returned exact zeros, as if every key were read from the zero page. That is what
# made the hard gate's speculative engine give other tokens on the H200 (the gate's small fp32 model has 2 heads and
# drew pages of 6). The gather was right in all 560 checks of the same sweep (fp32 and bf16, 1-3 splits, 2 heads,
# pages of 2-11 tokens: 2, 3, 5, 6, 7, 9, 11 and the tests' 4 and 8), and the CUDA gate and every GPU test of the
# kernel and the engine passed with it (before the clamp below). Measured on one H200
# (bench/results/decode_probe/twentieth: kimi-linear-1.5b's shapes, bf16, rows of 513-640 keys in shuffled pages,
# 4 layers cycled), select-and-sum -> gather at 3 stages: batch 1 7.53 -> 7.86 us a call, batch 16 17.21 -> 17.57,
# batch 64 32.02 -> 34.38 (not profiled); the gather at 2 stages 7.98 / 16.66 / 37.02, at BLOCK_N 16 7.67 / 18.28
# / 41.45; the select-and-sum at 1 stage 7.46 / 18.17 / 44.06; the page table read inside the loop (before the
# seventeenth session) 7.87 / 18.64 / 42.50. The root cause inside Triton was not found.
BLOCK_M, BLOCK_N = 16, 32
WARPS = 4
STAGES = 3
# Splits: enough programs to fill a GPU (the H200 has 132 SMs) when B x query blocks alone do not, at most MAX_SPLITS
# (the combine holds [MAX_SPLITS, BLOCK_COMBINE] fp32 partial outputs in one tile).
TARGET_PROGRAMS, MAX_SPLITS = 256, 128
# A program holds its split's page numbers in registers (BLOCK_P of them, the next power of two of a split's pages
# + 1), and the splits are made short enough that a split's keys lie on about this many pages (kimi-linear-1.5b at
# batch 64 with 32K-token rows and pages of 64: 9 splits instead of 4). That rule was made for the select-and-sum
# (NOTE above), whose registers grew with BLOCK_P (compiled for sm_90 at batch 64: 186 at BLOCK_P 8, 244 at 64, 250
# at 128, a 48-byte stack at 256); with the gather the kernel takes 126-128 registers at BLOCK_P 8 to 256 (Triton
# 3.6 and 3.9, no spills). It was kept: longer splits were not timed.
SPLIT_PAGES = 62
BLOCK_COMBINE = 64  # the combine: R elements a program (grid B x T*H x R / BLOCK_COMBINE)


def paged_supported(device: torch.device | str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the paged kernel runs on this device and dtype: (ok, reason), the reason meant to be printed."""
    device = torch.device(device)
    if triton is None:
        return False, "triton is not installed"
    if dtype not in DTYPES:
        return False, f"the Triton kernel takes bf16, fp16 or fp32, not {dtype}"
    where = "a Triton flash-decoding kernel reading the latent pages in place"
    if INTERPRET and device.type == "cpu":
        where += " in Triton's CPU interpreter (TRITON_INTERPRET=1: slow, for tests)"
    elif device.type != "cuda":
        return False, f"the Triton kernel runs on CUDA, not {device.type}"
    return True, where


def select_paged_attention(device: torch.device | str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the fast decode step's MLA layers run `paged_latent_attention` (chosen once, by serve/static.py
    `StaticDecoder`), under the environment's override `OPENK3_MLA_KERNEL` (0: off, 1: required). -> (on, reason)."""
    requested = os.environ.get(ENV)
    if requested not in (None, "", "0", "1"):
        raise ValueError(f"{ENV}={requested!r}: expected '0' (off) or '1' (required)")
    ok, why = paged_supported(device, dtype)
    if requested == "0":
        return False, f"{ENV}=0: the pages are gathered, then scored in PyTorch"
    if requested == "1" and not ok:
        raise RuntimeError(f"{ENV}=1 but the paged MLA kernel cannot run here: {why}")
    return ok, why if ok else f"the pages are gathered, then scored in PyTorch: {why}"


def bmm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a [N, m, k] @ b [N, k, n] -> [N, m, n] fp32, accumulated in fp32. On CUDA half-precision operands stay as
    they are (tensor cores; torch.bmm's out_dtype); elsewhere, where out_dtype has no kernel, both are upcast: the same
    fp32 accumulation (a product of two bf16 or fp16 numbers is exact in fp32)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def latent_attention(q_cat: Tensor, lat: Tensor, mask: Tensor | None, scale: float, r: int) -> Tensor:
    """The reference: q_cat [B, T*H, r + rope], lat [B, S, r + rope] (both in the operands' dtype), mask
    [B or 1, 1, T, S] bool (True = may attend) or None -> o_lat [B, T*H, r] in the operands' dtype. Scores, mask and
    softmax in fp32; p rounded to the operands' dtype for p @ c (module docstring)."""
    B, M, _ = q_cat.shape
    scores = bmm_fp32(q_cat, lat.transpose(1, 2)) * scale  # [B, T*H, S]
    if mask is not None:
        T = mask.shape[2]
        scores = scores.view(B, T, M // T, -1).masked_fill(~mask.transpose(1, 2), float("-inf")).view(B, M, -1)
    p = scores.softmax(-1).to(q_cat.dtype)
    return torch.bmm(p, lat[..., :r])


def visible_mask(visible: Tensor, T: int, S: int) -> Tensor:
    """[B, 1, T, S] bool: new token t of a row sees keys 0 .. visible - (T - t) - 1 (module docstring)."""
    keys = torch.arange(S, device=visible.device)
    limit = visible[:, None] - (T - 1) + torch.arange(T, device=visible.device)  # [B, T]
    return (keys[None, None, :] < limit[:, :, None])[:, None]


def _check_inputs(q_cat: Tensor, pages: Tensor, table: Tensor, visible: Tensor, r: int, heads: int) -> None:
    B, _, C = q_cat.shape
    if pages.dim() != 3 or pages.shape[2] != C:
        raise ValueError(f"pages {tuple(pages.shape)} must be [num_pages, page_size, {C}] (q_cat {tuple(q_cat.shape)})")
    if table.dim() != 2 or table.shape[0] != B or visible.shape != (B,):
        raise ValueError(f"table {tuple(table.shape)} must be [B, P] and visible {tuple(visible.shape)} [B], B = {B}")
    if not 0 < r <= C:
        raise ValueError(f"r={r} must be in 1..{C} (the latent's width, without k_pe)")
    if heads < 1 or q_cat.shape[1] % heads:
        raise ValueError(f"q_cat has {q_cat.shape[1]} query rows, not a multiple of heads={heads}")


def paged_latent_attention_reference(q_cat: Tensor, pages: Tensor, table: Tensor, visible: Tensor, scale: float,
                                     r: int, heads: int) -> Tensor:
    """`paged_latent_attention` the old way: gather every row's pages [B, P * page_size, C], cast to q_cat's dtype,
    then `latent_attention` with the mask of `visible` (what the fast decode step did before the kernel)."""
    _check_inputs(q_cat, pages, table, visible, r, heads)
    lat = pages[table].flatten(1, 2).to(q_cat.dtype)
    return latent_attention(q_cat, lat, visible_mask(visible, q_cat.shape[1] // heads, lat.shape[1]), scale, r)


def split_keys(B: int, query_blocks: int, S: int, block_n: int = BLOCK_N, page_size: int | None = None
               ) -> tuple[int, int]:
    """-> (splits, keys a split: a multiple of block_n) for S keys a row: enough splits that B x query_blocks x
    splits reaches TARGET_PROGRAMS where it can, and (given page_size) that a split's keys lie on at most about
    SPLIT_PAGES pages, at most MAX_SPLITS and one block of keys each. Static shapes only."""
    blocks = triton.cdiv(S, block_n)
    want = triton.cdiv(TARGET_PROGRAMS, B * query_blocks)
    if page_size is not None:
        want = max(want, triton.cdiv(S, SPLIT_PAGES * page_size))
    want = min(want, blocks, MAX_SPLITS)
    per_split = triton.cdiv(blocks, want)
    return triton.cdiv(blocks, per_split), per_split * block_n


if triton is not None:
    @triton.jit
    def _dot(a, b, UPCAST: tl.constexpr):
        """a @ b accumulated in fp32. NOTE: Triton 3.9's interpreter (the CPU tests) multiplies bf16 operands of
        tl.dot wrongly (off by ~1e10); there they are upcast first, the same sum: a product of two bf16 numbers is
        exact in fp32. "ieee": fp32 operands stay fp32 (the GPU's default for them would be tf32)."""
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def _split_kernel(q_ptr, pages_ptr, table_ptr, visible_ptr, o_ptr, part_ptr, ml_ptr, scale,
                      T: tl.constexpr, H: tl.constexpr, R: tl.constexpr, PE: tl.constexpr, PAGE: tl.constexpr,
                      S: tl.constexpr, KEYS: tl.constexpr, SPLITS: tl.constexpr,
                      stride_qb, stride_qm, stride_pn, stride_po, stride_tb, stride_ob, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_PE: tl.constexpr,
                      BLOCK_P: tl.constexpr, UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr):
        """Row b, query rows m (token t = m // H), keys [split * KEYS, (split + 1) * KEYS): the online softmax of
        the module docstring. T*H query rows, R + PE the latent's width, S = P * PAGE the table's keys.
        The shapes are compile-time constants: fixed per model and bucket. The key loop ends at the split's last key
        the row sees (from `visible`, a loaded value). NOTE: the interpreter (TRITON_INTERPRET, the CPU tests) with
        numpy 2.4 cannot loop `range` over a runtime int argument (moe_gemv.py); over a loaded value it can (as
        ops/moe_by_expert.py's chunk loops)."""
        b = tl.program_id(0).to(tl.int64)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        split = tl.program_id(2)
        M: tl.constexpr = T * H
        m_ok = m < M
        visible = tl.load(visible_ptr + b)
        limit = visible - (T - 1) + m // H  # [BLOCK_M]: the keys each query row sees
        rc = tl.arange(0, BLOCK_R)
        pe = tl.arange(0, BLOCK_PE)
        q_rows = q_ptr + b * stride_qb + m[:, None] * stride_qm
        q_lat = tl.load(q_rows + rc[None, :], mask=m_ok[:, None] & (rc < R)[None, :], other=0.0)
        q_pe = tl.load(q_rows + R + pe[None, :], mask=m_ok[:, None] & (pe < PE)[None, :], other=0.0)
        dtype = q_lat.dtype
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        lo = split * KEYS
        first = lo // PAGE
        ps = tl.arange(0, BLOCK_P)
        split_pages = tl.load(table_ptr + b * stride_tb + first + ps, mask=first + ps < S // PAGE,
                              other=0).to(tl.int64)
        hi = tl.minimum(tl.minimum(lo + KEYS, visible), S)  # the split's last key the row sees, + 1
        for n0 in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            n = n0 + tl.arange(0, BLOCK_N)
            # NOTE: keys past the row's `visible` are not loaded at all: a masked-out key's latent is multiplied by
            # p = 0 in p @ c, and 0 x NaN (stale bytes in a page past the row's length) would be NaN
            n_ok = n < hi
            # NOTE: n < lo + KEYS in every iteration the loop runs, so the index is < BLOCK_P there; the clamp is
            # for the blocks past `hi` whose page lookups Triton's pipeliner computes ahead (their copies masked
            # off): unclamped, those read past the gather's shared-memory scratch (found in review in the sm_90
            # code of Triton 3.9; the reads stayed inside the block's shared memory, their pages unused). Compiled
            # with Triton 3.6 for sm_90, the clamp changed only the index arithmetic and the addresses of the
            # lookups it feeds (the same shared memory size, copies, barriers, branches and matmuls). With it the
            # kernel tests and the engine's gate pass on the H200 (docs/engine_h200_log.md, twenty-first session).
            page = tl.gather(split_pages, tl.minimum(n // PAGE - first, BLOCK_P - 1), 0)
            rows = pages_ptr + page * stride_pn + (n % PAGE) * stride_po  # [BLOCK_N]
            c = tl.load(rows[:, None] + rc[None, :], mask=n_ok[:, None] & (rc < R)[None, :], other=0.0).to(dtype)
            k_pe = tl.load(rows[:, None] + R + pe[None, :], mask=n_ok[:, None] & (pe < PE)[None, :],
                           other=0.0).to(dtype)
            s = (_dot(q_lat, tl.trans(c), UPCAST) + _dot(q_pe, tl.trans(k_pe), UPCAST)) * scale
            s = tl.where((n[None, :] < limit[:, None]) & n_ok[None, :], s, float("-inf"))  # (n_ok: past S too)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: exp(-inf - 0) = 0, not NaN
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p.to(dtype), c, UPCAST)
            m_i = m_new
        if SPLITS == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(o_ptr + b * stride_ob + m[:, None] * stride_om + rc[None, :], o.to(o_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & (rc < R)[None, :])
        else:
            # partials [B, M, SPLITS, R] fp32 and (max, sum) [B, M, SPLITS, 2] fp32
            at = (b * M + m) * SPLITS + split
            tl.store(part_ptr + at[:, None] * R + rc[None, :], acc, mask=m_ok[:, None] & (rc < R)[None, :])
            tl.store(ml_ptr + at * 2, m_i, mask=m_ok)
            tl.store(ml_ptr + at * 2 + 1, l_i, mask=m_ok)

    @triton.jit
    def _combine_kernel(part_ptr, ml_ptr, o_ptr, M: tl.constexpr, R: tl.constexpr, SPLITS: tl.constexpr,
                        stride_ob, stride_om, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
        """Query row m of row b, its BLOCK_R elements of o: o = sum_s exp(m_s - max) acc_s / sum_s exp(m_s - max) l_s,
        in fp32."""
        row = tl.program_id(0).to(tl.int64)  # b * M + m
        b, m = row // M, row % M
        rc = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        s = tl.arange(0, BLOCK_S)
        s_ok = s < SPLITS
        m_s = tl.load(ml_ptr + (row * SPLITS + s) * 2, mask=s_ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + (row * SPLITS + s) * 2 + 1, mask=s_ok, other=0.0)
        top = tl.max(m_s, axis=0)
        w = tl.exp(m_s - tl.where(top == float("-inf"), 0.0, top))  # a split that saw no key: exp(-inf) = 0
        total = tl.sum(w * l_s, axis=0)
        inv = 1.0 / tl.where(total > 0, total, 1.0)  # a row that saw no key at all: zeros
        part = tl.load(part_ptr + (row * SPLITS + s)[:, None] * R + rc[None, :],
                       mask=s_ok[:, None] & (rc < R)[None, :], other=0.0)
        o = tl.sum(part * w[:, None], axis=0) * inv
        tl.store(o_ptr + b * stride_ob + m * stride_om + rc, o.to(o_ptr.dtype.element_ty), mask=rc < R)


def paged_latent_attention(q_cat: Tensor, pages: Tensor, table: Tensor, visible: Tensor, scale: float, r: int,
                           heads: int, splits: int | None = None, block_n: int | None = None,
                           warps: int | None = None, stages: int | None = None) -> Tensor:
    """`latent_attention` over a paged cache read in place (module docstring). Forward only.

    q_cat: [B, T*H, r + rope] in the operands' dtype (bf16, fp16 or fp32), row t*H + h. pages: [num_pages, page_size,
    r + rope] (one MLA layer of the pool, any of those dtypes: cast to q_cat's as loaded). table: [B, P] integer pages
    of each row (entries past a row's pages: any page, e.g. the zero page). visible: [B] integer, the keys the row's
    last new token sees. heads: H. -> o_lat [B, T*H, r] in q_cat's dtype.
    splits: key splits (None: `split_keys`), block_n: keys a step (a power of two >= 16), warps and stages (the key
    loop's pipelining) of the split kernel, None for the module's (BLOCK_N, WARPS, STAGES); for tests and the bench.
    No host sync and no data-dependent shape: it runs inside the captured decode step (serve/static.py)."""
    _check_inputs(q_cat, pages, table, visible, r, heads)
    ok, why = paged_supported(q_cat.device, q_cat.dtype)
    if not ok or pages.dtype not in DTYPES:
        raise ValueError(f"paged_latent_attention cannot run here: {why} (q_cat {q_cat.dtype}, pages {pages.dtype}); "
                         f"use paged_latent_attention_reference")
    B, M, C = q_cat.shape
    if q_cat.stride(2) != 1:
        q_cat = q_cat.contiguous()
    # the kernel walks a table row and `visible` by unit steps (no copy for the static step's own buffers)
    table, visible = table.contiguous(), visible.contiguous()
    if pages.stride(2) != 1:
        raise ValueError(f"pages must be contiguous along the latent (strides {pages.stride()})")
    num_pages, page_size, _ = pages.shape
    S = table.shape[1] * page_size
    o_lat = torch.empty(B, M, r, dtype=q_cat.dtype, device=q_cat.device)
    query_blocks = triton.cdiv(M, BLOCK_M)
    block_n, warps, stages = block_n or BLOCK_N, warps or WARPS, stages or STAGES
    if splits is None:
        splits, keys = split_keys(B, query_blocks, S, block_n, page_size)
    else:
        keys = triton.cdiv(triton.cdiv(S, splits), block_n) * block_n
    if splits > 1:
        part = torch.empty(B, M, splits, r, dtype=torch.float32, device=q_cat.device)
        ml = torch.empty(B, M, splits, 2, dtype=torch.float32, device=q_cat.device)
    else:
        part = ml = o_lat  # not written
    _split_kernel[(B, query_blocks, splits)](
        q_cat, pages, table, visible, o_lat, part, ml, float(scale), M // heads, heads, r, C - r, page_size, S, keys,
        splits, q_cat.stride(0), q_cat.stride(1), pages.stride(0), pages.stride(1), table.stride(0), o_lat.stride(0),
        o_lat.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(r)),
        BLOCK_PE=max(16, triton.next_power_of_2(C - r)),
        BLOCK_P=triton.next_power_of_2(triton.cdiv(keys, page_size) + 1),  # the pages a split's keys can lie on
        UPCAST=INTERPRET and q_cat.dtype == torch.bfloat16, NUM_STAGES=stages, num_warps=warps)
    if splits > 1:
        block_r = min(BLOCK_COMBINE, triton.next_power_of_2(r))
        _combine_kernel[(B * M, triton.cdiv(r, block_r))](part, ml, o_lat, M, r, splits, o_lat.stride(0),
                                                          o_lat.stride(1), BLOCK_S=triton.next_power_of_2(splits),
                                                          BLOCK_R=block_r)
    return o_lat
