"""The decode step's conv kernel (openk3/ops/kda/conv_step.py) against `conv_silu_one_token` + `conv_tail` + the slot
pool's `index_copy_`, and the static step that runs it.

On the CPU the kernel runs in Triton's interpreter, in a child pytest started with TRITON_INTERPRET=1 (the
`test_interpreted_*` tests); skipped without triton (CI has none). The GPU tests run the real kernel.
"""

import random

import pytest
import torch

import openk3.model.model as model_module
import openk3.ops
from openk3.model.model import causal_conv_silu
from openk3.ops.kda import conv_step
from openk3.ops.kda.conv_step import conv_step_applies, conv_step_in_place, conv_step_supported
from openk3.ops.kda.fused import conv_silu_one_token
from openk3.serve.static import SlotPool
from tests.helpers import INTERPRETED, cuda, interpreted_only, interpreter_child_test, needs_triton, rel_err
from tests.model import test_kda_fused_routing as routing
from tests.model.test_kda_fused_routing import fake_fla  # noqa: F401 (the fixture)
from tests.ops.test_moe_gemv import compile_for_sm90
from tests.serve.test_cache import small_model


@pytest.fixture
def conv_kernel_only(monkeypatch):
    """The model's other Triton kernels (the router's, the experts' GEMV) off, for the model tests in the child: the
    interpreter ran the GEMV kernels for minutes; they have their own tests (tests/ops/test_router_topk.py,
    test_moe_gemv.py) and run the same on both paths compared here. -> the batch sizes the conv kernel ran at."""
    monkeypatch.setattr(openk3.ops, "gemv_applies", lambda *a, **k: False)
    monkeypatch.setattr(model_module, "route_kernel_applies", lambda *a: False)
    calls = []
    monkeypatch.setattr(model_module, "conv_step_in_place",
                        lambda *a, **k: calls.append((a[0].shape[0], k)) or conv_step_in_place(*a, **k))
    return calls


def random_inputs(B, H, K, W, dtype, pool_dtype, N=6, pad=0, device="cpu", seed=0):
    """Random (never zero) projections [B, 3HK] (a view of a wider tensor when pad > 0: rows 3HK + pad apart, as
    the fused projection's q | k | v columns are), the three conv weights [HK, 1, W] fp32 and a pool [N, W-1, 3HK]."""
    g = torch.Generator().manual_seed(seed)
    HK = H * K
    wide = (torch.randn(B, 3 * HK + pad, generator=g) * 2).to(dtype)
    qkv = wide[:, pad // 2: pad // 2 + 3 * HK]
    ws = [torch.randn(HK, 1, W, generator=g) * 0.5 for _ in range(3)]
    pool = (torch.randn(N, W - 1, 3 * HK, generator=g) * 2).to(pool_dtype)
    return [t.to(device) for t in (qkv, *ws, pool)]


def reference(qkv, ws, pool, rows):
    """-> (conv_silu_one_token's output [B, 1, 3HK] in qkv's dtype, causal_conv_silu's in fp32, the pool after
    conv_tail and SlotKDAState's setter)."""
    w = torch.cat(ws)
    tail = pool[rows]
    want = conv_silu_one_token(qkv[:, None], w[:, 0, :], tail)
    exact = causal_conv_silu(qkv[:, None], w, None, tail)
    after = pool.clone()
    after.index_copy_(0, rows, torch.cat([tail, qkv[:, None].to(pool.dtype)], dim=1)[:, 1:])
    return want, exact, after


def ulp(x, dtype):
    """The spacing of `dtype` numbers at |x| (x fp32)."""
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(dtype).tiny))))


def check_against_reference(B, H, K, W, dtype, pool_dtype, pad, rows, device="cpu"):
    qkv, wq, wk, wv, pool = random_inputs(B, H, K, W, dtype, pool_dtype, N=max(rows) + 2, pad=pad, device=device,
                                          seed=B * W + K)
    rows = torch.tensor(rows, device=device)
    want, exact, after = reference(qkv, (wq, wk, wv), pool, rows)
    assert conv_step_applies(qkv, pool)
    q, k, v = conv_step_in_place(qkv, wq, wk, wv, pool, rows, H, K)
    for t in (q, k, v):
        assert t.shape == (B, 1, H, K) and t.dtype == dtype and t.is_contiguous()
    got = torch.cat([q, k, v], dim=2).flatten(2)
    if dtype == torch.float32:
        assert rel_err(got, want) < 1e-6
    else:  # within one ulp of the fp32 result (the interpreter truncates to bf16; the GPU rounds to nearest), plus
        # the fp32 sum's own error where the window's terms cancel to a result near 0 (the GPU fuses multiply-adds:
        # on the H200 one of 64 x 6144 bf16 outputs was past the ulp bound alone)
        slack = 1e-6 * exact.abs().max()
        assert ((got.float() - exact).abs() <= 1.01 * ulp(exact, dtype) + slack).all()
        assert rel_err(got, want) < 2 * torch.finfo(dtype).eps
    assert torch.equal(pool, after)  # the tails shifted exactly, every other row as it was


# ---- in the parent process (no kernel runs)

test_kernels_under_the_interpreter = interpreter_child_test(__file__)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs the kernel on the CPU")
def test_the_cpu_keeps_the_pytorch_chain(monkeypatch):
    """Without the interpreter the kernel runs on CUDA only, for the dtypes it reads; not under autograd."""
    assert not conv_step_supported("cpu", torch.float32)
    assert not conv_step_supported("cuda", torch.float64)
    assert conv_step_supported("cuda", torch.bfloat16) == (conv_step.triton is not None)
    qkv, pool = torch.randn(2, 12, requires_grad=True), torch.zeros(3, 3, 12)
    assert not conv_step_applies(qkv, pool)
    # where it runs (the interpreter's CPU here: the flag alone, no kernel runs), only the gradient says no
    monkeypatch.setattr(conv_step, "INTERPRET", True)
    assert conv_step_applies(qkv.detach(), pool) == (conv_step.triton is not None)
    assert not conv_step_applies(qkv, pool)
    with torch.no_grad():
        assert conv_step_applies(qkv, pool) == (conv_step.triton is not None)


@needs_triton
@pytest.mark.skipif(INTERPRETED, reason="the interpreter compiles nothing")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("block_b", [1, conv_step.LOWRANK_ROWS])
def test_kernel_compiles_for_sm90_without_spills(dtype, block_b):
    """What the interpreter cannot check: that Triton compiles the kernel (its branch per q, k, v, the barrier, the
    low-rank products as dot products at one row and as tl.dot tiles at more) for the GPU the lead runs, at
    kimi-linear-1.5b's shapes, with no register spilled to local memory."""
    # conv_step_in_place's weight elements a program: an fp32 tile product half a bf16 one's
    tile = conv_step.LOWRANK_TILE if block_b == 1 or dtype == "bf16" else conv_step.LOWRANK_TILE // 2
    types = {n: f"*{dtype}" for n in ("qkv_ptr", "pool_ptr", "q_ptr", "k_ptr", "v_ptr", "beta_ptr", "beta_out_ptr",
                                     "xf_ptr", "wf_ptr", "yf_ptr", "xg_ptr", "wg_ptr", "yg_ptr")}
    types.update({n: "*fp32" for n in ("wq_ptr", "wk_ptr", "wv_ptr")}, rows_ptr="*i64", stride_qkv="i64",
                 stride_beta="i64", stride_lr="i64")
    usage = compile_for_sm90(conv_step._conv_step_kernel, types,
                             {"HK": 16 * 128, "W": 4, "BLOCK_C": conv_step.MAX_BLOCK_C, "BLOCK_W": 4, "HB": 16,
                              "BLOCK_HB": 16, "R": 128, "BLOCK_R": 128, "BLOCK_N": tile // 128,
                              "BLOCK_B": block_b, "DOT_FP32": False})
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage


def test_bad_inputs_are_named():
    qkv, wq, wk, wv, pool = random_inputs(2, 2, 4, 4, torch.float32, torch.float32)
    rows = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"qkv \(2, 24\) stride \(1, 2\): want \[B, 24\] with contiguous channels"):
        conv_step_in_place(qkv.t().contiguous().t(), wq, wk, wv, pool, rows, 2, 4)
    with pytest.raises(ValueError, match=r"w_k \(8, 1, 4\) torch.float64"):
        conv_step_in_place(qkv, wq, wk.double(), wv, pool, rows, 2, 4)
    with pytest.raises(ValueError, match=r"conv_pool \(6, 2, 24\)"):
        conv_step_in_place(qkv, wq, wk, wv, pool[:, 1:], rows, 2, 4)
    with pytest.raises(ValueError, match=r"rows \(2,\) torch.int32: want \[2\] int64"):
        conv_step_in_place(qkv, wq, wk, wv, pool, rows.int(), 2, 4)


# ---- in the child (TRITON_INTERPRET=1)

@interpreted_only
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float16,) * 2,
                                              (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("W", [2, 4])
def test_interpreted_kernel_equals_the_pytorch_chain(dtype, pool_dtype, W):
    """3 rows in no order, one of them the scratch row 0, their projections a strided view; H*K = 32 (one block)."""
    check_against_reference(3, 2, 16, W, dtype, pool_dtype, pad=10, rows=[4, 0, 2])


@interpreted_only
@pytest.mark.parametrize("pairs, N, R", [(1, 24, 8), (2, 24, 8), (2, 2048, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3, 20])
def test_interpreted_lowrank_products_and_beta_in_the_conv_launch(pairs, N, R, dtype, B):
    """`lowrank`: each product F.linear(x, weight) in fp32 rounded once, its inputs strided views (as the fused
    projections' output gives them), at one row (a dot product per output; N = 2048: 32 programs of 64 outputs) and
    at 3 and 20 rows (tl.dot tiles of 16 rows, masked; 20 rows are two tiles); `beta` copied contiguous; the
    conv's outputs and tails as without them. A pair of another shape, or inputs of two row strides, are named."""
    H, K, W, Hb = 3, 8, 4, 5
    qkv, wq, wk, wv, pool = random_inputs(B, H, K, W, dtype, dtype, N=B + 2, seed=N + pairs)
    g = torch.Generator().manual_seed(pairs)
    wide = torch.randn(B, pairs * R + Hb + 7, generator=g).to(dtype)  # the fused output: x's, beta's columns
    lowrank = [(wide[:, i * R:(i + 1) * R], (torch.randn(N, R, generator=g) * R ** -0.5).to(dtype))
               for i in range(pairs)]
    beta = wide[:, pairs * R + 3:pairs * R + 3 + Hb]
    rows = torch.randperm(B + 2, generator=g)[:B]
    plain_pool = pool.clone()
    q0, k0, v0 = conv_step_in_place(qkv, wq, wk, wv, plain_pool, rows, H, K)
    q, k, v, *ys, beta_out = conv_step_in_place(qkv, wq, wk, wv, pool, rows, H, K, lowrank=lowrank, beta=beta)
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0) and torch.equal(pool, plain_pool)
    assert beta_out.shape == (B, 1, Hb) and beta_out.is_contiguous() and torch.equal(beta_out[:, 0], beta)
    assert len(ys) == pairs
    for y, (x, w) in zip(ys, lowrank):
        want = torch.nn.functional.linear(x.double(), w.double())
        assert y.shape == (B, N) and y.dtype == dtype and y.is_contiguous()
        assert rel_err(y, want) < (1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps)
    with pytest.raises(ValueError, match="lowrank"):
        conv_step_in_place(qkv, wq, wk, wv, pool, rows, H, K, lowrank=[(lowrank[0][0], lowrank[0][1][:, :-1])])
    if B > 1:
        with pytest.raises(ValueError, match="lowrank"):  # two row strides
            conv_step_in_place(qkv, wq, wk, wv, pool, rows, H, K,
                               lowrank=[lowrank[0], (lowrank[0][0].contiguous(), lowrank[0][1])])
    with pytest.raises(ValueError, match="beta"):
        conv_step_in_place(qkv, wq, wk, wv, pool, rows, H, K, beta=wide[:, :Hb].t())


@interpreted_only
@pytest.mark.parametrize("H,K,B", [(3, 8, 2), (4, 128, 1)])
def test_interpreted_kernel_masks_and_blocks(H, K, B):
    """H*K = 24 (a block of 32, masked) and 512 (two blocks of 256 per q, k, v); contiguous projections."""
    check_against_reference(B, H, K, 4, torch.bfloat16, torch.bfloat16, pad=0, rows=[5, 1][:B])


@interpreted_only
def test_interpreted_padding_rows_touch_only_the_scratch_row():
    """Rows 1 and 3 pad the batch on the scratch row 0 (programs racing on it): the real rows' outputs and tails are
    exact, every other pool row untouched."""
    H, K, W = 2, 16, 4
    qkv, wq, wk, wv, pool = random_inputs(4, H, K, W, torch.float32, torch.float32, pad=4)
    rows = torch.tensor([3, 0, 5, 0])
    want, _, after = reference(qkv[[0, 2]], (wq, wk, wv), pool, rows[[0, 2]])
    q, k, v = conv_step_in_place(qkv, wq, wk, wv, pool, rows, H, K)
    got = torch.cat([q, k, v], dim=2).flatten(2)[[0, 2]]
    assert rel_err(got, want) < 1e-6
    assert torch.equal(pool[1:], after[1:])


@interpreted_only
@pytest.mark.parametrize("family,fuse", [("k3", False), ("kimi-linear", False), ("kimi-linear", True)])
def test_interpreted_static_step_runs_the_kernel_and_equals_the_general_path(family, fuse, fake_fla, conv_kernel_only,
                                                                             monkeypatch):
    """tests/model/test_kda_fused_routing.py's ragged serve (fla's stand-ins; prefills, requests joining and one
    leaving) with the conv kernel in the static decode steps: their logits equal the reference chain's general path
    (fp32), the kernel ran once per KDA layer and step, with the gate's low-rank products (f_b, and Kimi-Linear's
    g_b) at every batch size, and the static steps gathered no conv tails. With the fused projections (`fuse`) beta
    is a view of their output, and the kernel copies it contiguous at more than one row."""
    views = []
    original = SlotPool.view
    monkeypatch.setattr(SlotPool, "view", lambda self, *a, **k: views.append(k) or original(self, *a, **k))
    routing.test_fused_routing_equals_the_reference_chain(family, fake_fla, monkeypatch, fuse=fuse)
    kda_layers = small_model(family, seed=3).config.layer_types.count("kda")
    assert len(conv_kernel_only) == kda_layers * 6  # 6 decode steps
    assert all(len(k["lowrank"]) == (2 if family == "kimi-linear" else 1) for _, k in conv_kernel_only)
    assert max(B for B, _ in conv_kernel_only) > 1  # (the static step pads to its batch buckets)
    assert all((k["beta"] is not None) == (fuse and B > 1) for B, k in conv_kernel_only)
    gathered = [k for k in views if k.get("gather")]
    assert gathered and all(k.get("gather_conv") is False for k in gathered)


@interpreted_only
def test_interpreted_verification_and_the_step_after_its_rollback(fake_fla, conv_kernel_only, monkeypatch):
    """The verification keeping every token's state keeps the PyTorch conv (its rollback re-reads the tails); the
    decode step after the rollback runs the kernel: both equal the general round (tests/model/test_kda_fused_routing
    .py)."""
    routing.test_a_verification_keeping_every_state_rolls_back_by_a_copy("k3", fake_fla, monkeypatch)
    assert conv_kernel_only


@cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 64])
def test_kernel_equals_the_pytorch_chain_on_gpu(dtype, B):
    """kimi-linear-1.5b's shapes (H 16, K 128, W 4) on CUDA: the projections a strided view, rows shuffled (the
    scratch row 0 among them)."""
    rows = random.Random(B).sample(range(2 * B + 1), B)
    if 0 not in rows:
        rows[-1] = 0
    check_against_reference(B, 16, 128, 4, dtype, dtype, pad=2 * 16 * 128, rows=rows, device="cuda")


@cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 16, 64])
def test_lowrank_products_and_beta_on_gpu(dtype, B):
    """kimi-linear-1.5b's gate products (two pairs, R 128 -> N 2048) and beta (16 heads), all views of one wide
    output as the fused projections give them: each product within a rounding of the fp64 product (the tensor
    cores' tiles at B > 1), beta copied exactly, the conv as without them."""
    H, K, W, R, N, Hb = 16, 128, 4, 128, 2048, 16
    qkv, wq, wk, wv, pool = random_inputs(B, H, K, W, dtype, dtype, N=B + 2, device="cuda", seed=B)
    g = torch.Generator().manual_seed(B)
    wide = torch.randn(B, 2 * R + Hb + 40, generator=g).to(dtype).cuda()
    lowrank = [(wide[:, i * R:(i + 1) * R], (torch.randn(N, R, generator=g) * R ** -0.5).to(dtype).cuda())
               for i in range(2)]
    beta = wide[:, 2 * R + 40:]
    rows = torch.randperm(B + 2, generator=g)[:B].cuda()
    plain_pool = pool.clone()
    plain = conv_step_in_place(qkv, wq, wk, wv, plain_pool, rows, H, K)
    q, k, v, yf, yg, beta_out = conv_step_in_place(qkv, wq, wk, wv, pool, rows, H, K, lowrank=lowrank, beta=beta)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), plain)) and torch.equal(pool, plain_pool)
    assert torch.equal(beta_out[:, 0], beta) and beta_out.is_contiguous()
    for y, (x, w) in zip((yf, yg), lowrank):
        want = torch.nn.functional.linear(x.double(), w.double())
        assert rel_err(y, want) < (1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps)


@cuda
@needs_triton
@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed on new projections: the outputs and the pool as an eager call gives them."""
    H, K, W = 16, 128, 4
    qkv, wq, wk, wv, pool = random_inputs(8, H, K, W, torch.bfloat16, torch.bfloat16, N=20, device="cuda")
    rows = torch.arange(8, device="cuda") * 2 + 1
    eager_pool = pool.clone()
    conv_step_in_place(qkv, wq, wk, wv, pool, rows, H, K)  # compile outside the capture
    conv_step_in_place(qkv, wq, wk, wv, eager_pool, rows, H, K)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = conv_step_in_place(qkv, wq, wk, wv, pool, rows, H, K)
    fresh = random_inputs(8, H, K, W, torch.bfloat16, torch.bfloat16, N=20, device="cuda", seed=9)[0]
    qkv.copy_(fresh)
    graph.replay()
    want = conv_step_in_place(qkv, wq, wk, wv, eager_pool, rows, H, K)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert torch.equal(pool, eager_pool)
