"""The paged MLA decode kernel (openk3/ops/mla_decode.py) against its reference (the gather + `latent_attention`, the
math of `GatedMLA.attend_absorbed`), and the fast decode step running it against the general path.

On the CPU the kernel runs in Triton's interpreter, in a child pytest started with TRITON_INTERPRET=1 (the
`test_interpreted_*` tests). Skipped without triton (CI has none). The GPU test runs the real kernel.
"""

import pytest
import torch

from openk3.ops import mla_decode
from openk3.ops.mla_decode import (latent_attention, paged_latent_attention, paged_latent_attention_reference,
                                   select_paged_attention, split_keys, visible_mask)
from tests.helpers import INTERPRETED, cuda, interpreted_only, interpreter_child_test, needs_triton, rel_norm_err


# fp32 matches to the order of the fp32 sums; fp16 and bf16 within their rounding of p and of o_lat. NOTE: the
# interpreter's fp32 -> bf16 cast truncates (the GPU rounds to nearest): its bf16 bound is loose, the GPU test's tight.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


test_kernels_under_the_interpreter = interpreter_child_test(__file__)


def random_paged(B, T, H, r, rope, page_size, P, lengths, dtype, seed, layers=2, layer=1, device="cpu"):
    """A pool [N, layers, page_size, r + rope] of random latents (page 0 zero, as between steps), and for row b with
    lengths[b] cached tokens (None: a padding row) a page table of distinct pages in shuffled pool order, padded with
    page 0, and visible = lengths[b] + T. Every page a row does not own holds NaN, and so does its last page past its
    keys, so a read of a key the row does not see shows.
    -> (q_cat [B, T*H, r + rope], the layer's pages [N, page_size, r + rope], table [B, P], visible [B])."""
    gen = torch.Generator().manual_seed(seed)
    C = r + rope
    N = 1 + sum(-(-(n + T) // page_size) for n in lengths if n is not None) + 3
    pool = torch.full((N, layers, page_size, C), float("nan"))
    order = (1 + torch.randperm(N - 1, generator=gen)).tolist()
    table = torch.zeros(B, P, dtype=torch.long)
    visible = torch.zeros(B, dtype=torch.long)
    for b, n in enumerate(lengths):
        if n is None:  # a padding row: the zero page, its T new latents written at offset 0
            visible[b] = T
            continue
        pages = [order.pop() for _ in range(-(-(n + T) // page_size))]
        table[b, :len(pages)] = torch.tensor(pages)
        latents = torch.randn(len(pages) * page_size, C, generator=gen)
        latents[n + T:] = float("nan")  # past the row's keys in its last page
        pool[pages, layer] = latents.view(len(pages), page_size, C)
        visible[b] = n + T
    pool[0] = 0
    pool[0, layer, 0] = torch.randn(C, generator=gen)  # what a padding row wrote
    q = torch.randn(B, T * H, C, generator=gen)
    return [t.to(device) for t in (q.to(dtype), pool.to(dtype)[:, layer], table, visible)]


def test_visible_mask_is_the_step_buffers_mask():
    """The kernel's visibility rule (`visible_mask`) is serve/static.py `StepBuffers.mask`'s, for a verification's T
    tokens and for a draft step's one token."""
    from openk3.serve.static import StepBuffers

    buf = StepBuffers(3, 4, 4, "cpu", T=3)
    buf.lengths.copy_(torch.tensor([5, 0, 11]))
    assert torch.equal(visible_mask(buf.lengths + 3, 3, 16), buf.mask())
    assert torch.equal(visible_mask(buf.lengths + 2, 1, 16), buf.mask(token=1))


def test_the_reference_is_attend_absorbed_math():
    """`paged_latent_attention_reference` is the gather then the decode step's scores, mask, softmax and p @ c."""
    q, pages, table, visible = random_paged(3, 2, 4, 16, 8, 4, 4, [3, 6, None], torch.float32, seed=1)
    pages = pages.nan_to_num(0.0)  # the gather reads whole pages: the dense reference multiplies them by p = 0
    lat = pages[table].flatten(1, 2)
    T, S = 2, lat.shape[1]
    scores = torch.bmm(q, lat.transpose(1, 2)).view(3, T, 4, S) * 0.25
    scores = scores.masked_fill(~visible_mask(visible, T, S).transpose(1, 2), float("-inf"))
    want = torch.bmm(scores.softmax(-1).view(3, T * 4, S), lat[..., :16])
    got = paged_latent_attention_reference(q, pages, table, visible, 0.25, 16, heads=4)
    assert rel_norm_err(got, want) < 1e-6
    assert torch.equal(latent_attention(q, lat, visible_mask(visible, T, S), 0.25, 16), got)


@needs_triton
def test_splits_depend_on_static_shapes_only():
    assert split_keys(64, 1, 1024) == (4, 256)  # kimi-linear-1.5b at batch 64, 16 pages of 64
    assert split_keys(1, 1, 1024) == (32, 32)  # batch 1: one block of keys a split
    assert split_keys(1, 1, 64 * 1024) == (128, 512)  # capped at MAX_SPLITS
    assert split_keys(512, 1, 1024) == (1, 1024)
    # long rows: a split's keys on at most ~SPLIT_PAGES pages (the kernel's page lookup), while MAX_SPLITS allows
    assert split_keys(64, 1, 1024, page_size=64) == (4, 256)
    splits, keys = split_keys(64, 1, 32768, page_size=64)
    assert splits == 9 and -(-keys // 64) + 1 <= 64
    assert split_keys(1, 1, 64 * 1024, page_size=4)[0] == 128  # MAX_SPLITS still caps it
    splits, keys = split_keys(3, 2, 100, block_n=16)
    assert keys % 16 == 0 and (splits - 1) * keys < 100 <= splits * keys


def test_select_paged_attention_obeys_the_environment(monkeypatch):
    monkeypatch.setenv(mla_decode.ENV, "0")
    assert select_paged_attention("cpu", torch.float32)[0] is False
    monkeypatch.setenv(mla_decode.ENV, "2")
    with pytest.raises(ValueError, match="OPENK3_MLA_KERNEL"):
        select_paged_attention("cpu", torch.float32)
    if not INTERPRETED:
        monkeypatch.setenv(mla_decode.ENV, "1")
        with pytest.raises(RuntimeError, match="cannot run here"):
            select_paged_attention("cpu", torch.float32)


CASES = [  # B, T, H, r, rope, page_size, P, lengths (None: a padding row)
    (3, 1, 2, 16, 8, 4, 8, [0, 13, 30]),  # a row of length 1 (its own new key only), one whose table is full
    (4, 1, 4, 24, 8, 5, 8, [7, None, 1, 19]),  # a padding row; r and page_size not powers of two
    (2, 3, 2, 16, 8, 4, 4, [0, 9]),  # a verification's 3 tokens: causal among them
    (2, 4, 8, 32, 16, 8, 4, [17, 3]),  # T*H = 32 query rows: two query blocks
    (2, 1, 2, 16, 8, 3, 16, [40, 7]),  # pages of 3: a block of keys on 6-7 pages, a split on several
    (2, 1, 2, 16, 8, 9, 8, [60, 23]),  # pages of 9: splits of 16 or 32 keys start mid-page (BLOCK_P's + 1)
    # the hard gate's speculative engine's calls at the example where the H200 gave other tokens (nineteenth
    # session, docs/engine_h200_log.md): pages of 6, 8 table entries (48 keys); at the engine's BLOCK_N (32) two
    # splits, the second (keys 32-47) past both rows' keys: its verification of 2 tokens, its draft's step
    (2, 2, 2, 16, 8, 6, 8, [23, 10]),
    (2, 1, 2, 16, 8, 6, 8, [24, 11]),
]


@interpreted_only
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-H{c[2]}")
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_n", [16, None], ids=["keys16", "keys-default"])
def test_interpreted_kernel_matches_the_reference(case, splits, dtype, block_n):
    B, T, H, r, rope, page_size, P, lengths = case
    q, pages, table, visible = random_paged(B, T, H, r, rope, page_size, P, lengths, dtype, seed=B + T + H)
    got = paged_latent_attention(q, pages, table, visible, 0.3, r, H, splits=splits, block_n=block_n)
    want = paged_latent_attention_reference(q, pages.nan_to_num(0.0), table, visible, 0.3, r, H)
    assert got.dtype == dtype and got.shape == (B, T * H, r)
    assert torch.isfinite(got).all()  # the NaN pages past each row's keys were never read
    assert rel_norm_err(got, want) < TOLERANCE[dtype]
    if dtype == torch.float32:  # and no row is worse than the whole
        for b in range(B):
            assert rel_norm_err(got[b], want[b]) < 1e-5


@interpreted_only
def test_interpreted_long_contexts():
    """Rows of 20K-66K keys on 64-token pages (the 32K prefix-hit turn's decode): the engine's split count (over 100
    splits of a few pages each) and one split of 500+ pages, against the reference."""
    for B, T, P, lengths in ((1, 1, 1030, [65800]), (2, 2, 520, [32767, 20001])):
        q, pages, table, visible = random_paged(B, T, 2, 16, 8, 64, P, lengths, torch.float32, seed=P)
        want = paged_latent_attention_reference(q, pages.nan_to_num(0.0), table, visible, 0.3, 16, 2)
        for splits in (None, 1):
            got = paged_latent_attention(q, pages, table, visible, 0.3, 16, 2, splits=splits)
            assert rel_norm_err(got, want) < TOLERANCE[torch.float32], (lengths, splits)


@interpreted_only
@pytest.mark.parametrize("warps, stages", [(2, 1), (4, 2), (8, 3)])
def test_interpreted_a_latent_wider_than_a_combine_tile(warps, stages):
    """r = 80 > BLOCK_COMBINE = 64: the combine's second program of a query row takes the masked rest; the split
    kernel's warps and stages are passed through (the interpreter ignores both: this checks the arguments, the GPU
    test the kernel at its defaults)."""
    B, T, H, r, rope = 2, 1, 2, 80, 8
    q, pages, table, visible = random_paged(B, T, H, r, rope, 4, 8, [21, 6], torch.float32, seed=11)
    got = paged_latent_attention(q, pages, table, visible, 0.3, r, H, splits=3, block_n=16, warps=warps,
                                 stages=stages)
    want = paged_latent_attention_reference(q, pages.nan_to_num(0.0), table, visible, 0.3, r, H)
    assert torch.isfinite(got).all() and rel_norm_err(got, want) < TOLERANCE[torch.float32]
    assert rel_norm_err(got[:, :, 64:], want[:, :, 64:]) < TOLERANCE[torch.float32]  # the second combine tile


@interpreted_only
def test_interpreted_strided_table_and_visible():
    """A page table and `visible` that are views (every other column of a wider buffer): read as the tensors say."""
    q, pages, table, visible = random_paged(3, 1, 2, 16, 8, 4, 4, [5, 9, 2], torch.float32, seed=7)
    wide = torch.zeros(3, 2 * table.shape[1], dtype=table.dtype)
    wide[:, ::2] = table
    pairs = torch.zeros(3, 2, dtype=visible.dtype)
    pairs[:, 0] = visible
    got = paged_latent_attention(q, pages, wide[:, ::2], pairs[:, 0], 0.3, 16, 2, block_n=16)
    assert torch.equal(got, paged_latent_attention(q, pages, table, visible, 0.3, 16, 2, block_n=16))


@interpreted_only
def test_interpreted_visible_past_the_table_sees_the_table():
    """visible > P * page_size (no caller passes it): the row attends to the table's keys, as the reference's mask
    does, not to zero scores past them (before the seventeenth session's review, keys S .. visible - 1 scored 0)."""
    q, pages, table, visible = random_paged(2, 1, 2, 16, 8, 4, 3, [5, 9], torch.float32, seed=4)
    S = table.shape[1] * 4
    pages = pages.nan_to_num(0.0)
    visible[1] = S + 3
    for splits in (1, 2):
        got = paged_latent_attention(q, pages, table, visible, 0.3, 16, 2, splits=splits, block_n=16)
        want = paged_latent_attention_reference(q, pages, table, visible, 0.3, 16, 2)
        assert rel_norm_err(got, want) < 1e-5


@interpreted_only
def test_interpreted_a_row_that_sees_no_key_gives_zeros():
    """visible = 0 (no caller passes it: a row sees at least its new token): zeros, not NaN, split or not."""
    q, pages, table, visible = random_paged(2, 1, 2, 16, 8, 4, 4, [5, 6], torch.float32, seed=0)
    visible[1] = 0
    for splits in (1, 2):
        got = paged_latent_attention(q, pages, table, visible, 0.3, 16, 2, splits=splits, block_n=16)
        assert torch.isfinite(got).all() and got[1].abs().max() == 0 and got[0].abs().max() > 0


@interpreted_only
def test_interpreted_static_step_runs_the_kernel_and_equals_the_general_path():
    """With the kernel (the interpreter counts as a device it runs on), the fast decode step's logits equal the
    general path's for ragged batches that join and leave (tests/serve/test_static.py `ragged_decode`, fp32).
    NOTE: dense models in this file: the interpreter also runs the MoE's Triton kernels, which took most of ~11
    minutes with MoE layers."""
    from openk3.serve.runner import ModelRunner
    from tests.serve.test_cache import small_model
    from tests.serve.test_static import ragged_decode

    model = small_model("kimi-linear", seed=3, dense=True)
    runners = [ModelRunner(model, num_pages=200, page_size=4),
               ModelRunner(model, num_pages=200, page_size=4, slots=8)]
    assert runners[1].decoder.mla_kernel, runners[1].decoder.mla_reason
    ragged_decode(model, runners, steps=10)


@interpreted_only
def test_interpreted_static_verification_and_prefill_equal_the_general_path():
    """The kernel's T > 1: a verification's k + 1 tokens (and the decode step after its rollback), prefill pieces of
    up to 16 tokens. (A draft run's step i, `visible` = length + i + 1: `test_visible_mask_is_the_step_buffers_mask`.)"""
    import tests.serve.test_static as static
    from tests.helpers import rel_err
    from tests.serve.test_cache import small_model

    both = static.verify_both_ways(small_model("kimi-linear", seed=3, dense=True), keep=[1, 3, 4])
    assert both["fast"][2].decoder.mla_kernel
    assert rel_err(both["fast"][0], both["general"][0]) < 1e-5
    assert rel_err(both["fast"][1], both["general"][1]) < 1e-5
    (gen, _), (fast, _) = static.prefill_both_ways(small_model("k3", seed=5, dense=True), [[0] * 7, [0] * 16, [0] * 1])
    assert rel_err(fast, gen) < 1e-5


@needs_triton
@pytest.mark.skipif(INTERPRETED, reason="the interpreter compiles nothing")
def test_kernel_compiles_for_sm90_with_its_key_loop_pipelined():
    """What the interpreter cannot check: at kimi-linear-1.5b's shapes at batch 64 (16 heads, 512 + 64, pages of 64,
    a 16-page table, 4 splits) the split kernel compiles for sm_90 without spilled registers, and at 3 stages (the
    module's) the latents of the next block of keys are in flight while a block is scored: two shared-memory buffers
    for them and an async wait that leaves copies outstanding. With the page table read inside the key loop (before
    the seventeenth session) Triton gave them one buffer and waited for every copy (`async_wait {num = 0}`).
    NOTE: checked with the Triton installed here (3.9 on the CPU machine), not the device's."""
    import re

    from tests.ops.test_moe_gemv import compile_for_sm90

    splits, keys = split_keys(64, 1, 1024, page_size=64)
    types = {"q_ptr": "*bf16", "pages_ptr": "*bf16", "table_ptr": "*i64", "visible_ptr": "*i64", "o_ptr": "*bf16",
             "part_ptr": "*fp32", "ml_ptr": "*fp32", "scale": "fp32"}
    ttgir = []
    usage = compile_for_sm90(
        mla_decode._split_kernel, types,
        dict(T=1, H=16, R=512, PE=64, PAGE=64, S=1024, KEYS=keys, SPLITS=splits, stride_qm=576, stride_po=576,
             BLOCK_M=mla_decode.BLOCK_M, BLOCK_N=mla_decode.BLOCK_N, BLOCK_R=512, BLOCK_PE=64,
             BLOCK_P=mla_decode.triton.next_power_of_2(-(-keys // 64) + 1), UPCAST=False, NUM_STAGES=3),
        divisible=("stride_qb", "stride_pn", "stride_tb", "stride_ob", "stride_om"), ttgir=ttgir)
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
    buffers = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x%dx512xbf16" % mla_decode.BLOCK_N, ttgir[0])
    assert buffers == ["2"], buffers
    assert re.search(r"async_wait [^{]*\{num = [1-9]", ttgir[0])


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-H{c[2]}-page{c[5]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference_at_small_shapes_on_cuda(case, dtype):
    """The interpreter's cases compiled for the GPU: the small model of the engine's tests (tests/serve) runs these
    shapes (2 heads, r = 16, rope = 8, pages of 4-9 tokens) through the kernel in the hard gate, where the
    interpreter cannot show a GPU-only fault. Every split count from the engine's to 3, keys 16 and 32 a step (the
    engine's BLOCK_N), each row against the fp32 reference."""
    check_on_cuda(case, dtype, seed=case[0] + case[1] + case[2], block_ns=(None, 16), splits=(None, 1, 2, 3))


def check_on_cuda(case, dtype, seed, block_ns, splits):
    """The kernel on the GPU at `case` against the fp32 reference, row by row, for each keys-a-step and split count."""
    B, T, H, r, rope, page_size, P, lengths = case
    q, pages, table, visible = random_paged(B, T, H, r, rope, page_size, P, lengths, dtype, seed=seed, device="cuda")
    want = paged_latent_attention_reference(q.float(), pages.float().nan_to_num(0.0), table, visible, 0.3, r, H)
    bound = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: p and o_lat rounded (2^-9 each)
    for block_n in block_ns:
        for n_splits in splits:
            got = paged_latent_attention(q, pages, table, visible, 0.3, r, H, splits=n_splits, block_n=block_n)
            assert torch.isfinite(got).all(), (block_n, n_splits)
            errs = [rel_norm_err(got[b], want[b]) for b in range(B)]
            assert max(errs) < bound, (block_n, n_splits, errs)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", range(2, 13))
def test_kernel_matches_the_reference_at_every_small_page_size_on_cuda(page_size):
    """The engine tests' model (2 heads, 16 + 8) at every page size from 2 to 12 tokens, 1 and 3 new tokens, fp32
    and bf16, 1 and 3 splits and the engine's, each row against the fp32 reference. Before the key's page was picked by
    tl.gather (ops/mla_decode.py, NOTE at BLOCK_N), Triton 3.6 compiled the kernel wrongly for the H200 in fp32:
    this test failed at pages of 3, 5, 6, 9, 10, 11 and 12 tokens (twentieth session); the gate drew pages of 6."""
    gen = torch.Generator().manual_seed(page_size)
    P = -(-48 // page_size) + 1  # 50-66 keys: two or three blocks of 32, most starting mid-page
    for T in (1, 3):
        lengths = [int(torch.randint(8, 30, (), generator=gen)), P * page_size - T, None]
        for dtype in (torch.float32, torch.bfloat16):
            check_on_cuda((3, T, 2, 16, 8, page_size, P, lengths), dtype, seed=page_size + T, block_ns=(None,),
                          splits=(None, 1, 3))


def check_at_kimi_linear_heads(B, T, P, lengths, seed, layers=1, layer=0):
    """kimi-linear-1.5b's MLA (16 heads, r = 512, rope = 64) on the engine bench's 64-token pages on the GPU, bf16
    and fp32, the split count the engine picks and one split, against the fp32 reference."""
    H, r, rope, page_size = 16, 512, 64, 64
    for dtype in (torch.bfloat16, torch.float32):
        q, pages, table, visible = random_paged(B, T, H, r, rope, page_size, P, lengths, dtype, seed=seed,
                                                layers=layers, layer=layer, device="cuda")
        want = paged_latent_attention_reference(q.float(), pages.float().nan_to_num(0.0), table, visible,
                                                0.07, r, H)
        for splits in (None, 1):
            got = paged_latent_attention(q, pages, table, visible, 0.07, r, H, splits=splits)
            assert torch.isfinite(got).all()
            # bf16: against the fp32 reference, within bf16's rounding of p and o_lat (about 2^-9 each)
            assert rel_norm_err(got, want) < (1e-5 if dtype == torch.float32 else 6e-3), (dtype, splits)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("T", [1, 4])
def test_kernel_matches_the_reference_at_kimi_linear_shapes(B, T):
    """~640-token ragged contexts (P = 16) at kimi-linear-1.5b's heads."""
    lengths = [600 + (37 * b) % 80 for b in range(B)]
    if B > 1:
        lengths[-1] = None  # a padding row
    check_at_kimi_linear_heads(B, T, 16, lengths, seed=B, layers=4, layer=2)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("B, lengths", [(1, [32700]), (2, [65800, 20001])], ids=["32K", "64K-20K"])
def test_kernel_matches_the_reference_at_long_contexts_on_cuda(B, lengths):
    """20K-66K cached keys at kimi-linear-1.5b's heads, the split count `split_keys` picks for this table (over 100
    splits of a few pages each) and one split: the contexts of the bench's 32K prefix-hit turn, whose fp32 hit
    differed from the cold prefill more than a no-cache control did (twenty-first session; TF32 rounding in fla's
    kernels, the twenty-second found: docs/engine_h200_log.md); the other GPU tests reach 683 keys."""
    check_at_kimi_linear_heads(B, 1, -(-(max(lengths) + 1) // 64) + 1, lengths, seed=B)
