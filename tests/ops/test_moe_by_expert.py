"""The by-expert Triton experts (openk3/ops/moe_by_expert.py) against the loop reference, and how calls reach them.

As tests/ops/test_moe_gemv.py: on the CPU the kernels run in Triton's interpreter, in a child pytest started with
TRITON_INTERPRET=1 (the `test_interpreted_*` tests); skipped without triton. The GPU tests run the real kernels.
"""

import pytest
import torch

import openk3.ops as ops
from openk3.ops import moe_by_expert
from openk3.ops.moe import expert_order, moe_experts_grouped, moe_experts_loop
from openk3.ops.moe_by_expert import BY_EXPERT_MAX_SLOTS, by_expert_applies, expert_rows, moe_experts_by_expert
from openk3.ops.moe_gemv import GEMV_MAX_SLOTS
from openk3.ops.situ import swiglu
from tests.helpers import INTERPRETED, cuda, interpreted_only, interpreter_child_test, needs_triton, rel_norm_err
from tests.ops.test_moe_gemv import (KIMI_LINEAR_EXPERTS, TOLERANCE, compile_for_sm90, random_moe, shared_expert,
                                     situ_k3, situ_other)


test_kernels_under_the_interpreter = interpreter_child_test(__file__)


def run_both(inputs, act, **kw):
    with torch.no_grad():
        return moe_experts_by_expert(*inputs, act, **kw), moe_experts_loop(*inputs, act)


@interpreted_only
@pytest.mark.parametrize("T, K, E, act", [(1, 1, 3, situ_k3), (5, 4, 4, swiglu),  # E = K: every expert, every token
                                          (17, 2, 6, situ_other), (23, 3, 5, swiglu), (40, 4, 7, situ_k3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_interpreted_by_expert_matches_loop(T, K, E, act, dtype):
    D, F = 48, 40  # not powers of two: the tiles (capped at 64) end in masked tails
    inputs = random_moe(T, D, F, E, K, dtype, seed=T * 10 + K)
    y, y_loop = run_both(inputs, act)
    assert y.dtype == dtype and y.shape == (T, D)
    assert rel_norm_err(y, y_loop) < TOLERANCE[dtype]


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_by_expert_with_empty_experts(dtype):
    """3 tokens top-2 over 12 experts: at least 6 experts get no slot (their programs store nothing)."""
    inputs = random_moe(3, 32, 24, 12, 2, dtype, seed=5)
    assert torch.unique(inputs[1]).numel() <= 6
    y, y_loop = run_both(inputs, swiglu)
    assert rel_norm_err(y, y_loop) < TOLERANCE[dtype]


@interpreted_only
@pytest.mark.parametrize("K, dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_interpreted_by_expert_one_expert_takes_every_slot(K, dtype):
    """37 tokens all on expert 2 (and, at K = 2, all on expert 0 too): a group of 37 rows walked in chunks of 16
    (BLOCK_M forced to 16), the last chunk masked; the other experts empty."""
    x, _, w, w1, w2, w3 = random_moe(37, 48, 40, 5, K, dtype, seed=K)
    idx = torch.tensor([2, 0][:K]).repeat(37, 1)
    inputs = (x, idx, w, w1, w2, w3)
    y, y_loop = run_both(inputs, situ_k3, blocks=(16, 16, 16, 16, 16))
    assert rel_norm_err(y, y_loop) < TOLERANCE[dtype]
    y_default, _ = run_both(inputs, situ_k3)  # the default tiles (BLOCK_M 16 here, the others capped at 64)
    assert rel_norm_err(y_default, y_loop) < TOLERANCE[dtype]


@interpreted_only
def test_interpreted_chunks_cover_every_row_once():
    """`_chunk` through a probe kernel, over hand-picked and random group sizes (empty groups, exact multiples of
    BLOCK_M, one group taking every slot, E not a power of two, E > S) and shared rows: every routed program's rows lie
    in its expert's group, no chunk is longer than BLOCK_M, the programs past the last chunk get no rows, the shared
    programs the shared rows, and every row is some program's exactly once."""
    import itertools

    import triton
    import triton.language as tl

    @triton.jit
    def probe(offs_ptr, out_ptr, E, S, T, R, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        p = tl.program_id(0)
        e, start, end = moe_by_expert._chunk(offs_ptr, p, E, S, T, R, BLOCK_M, BLOCK_E)
        tl.store(out_ptr + 3 * p, e)
        tl.store(out_ptr + 3 * p + 1, start)
        tl.store(out_ptr + 3 * p + 2, end)

    rng = torch.Generator().manual_seed(0)
    cases = [([17, 1, 1, 1, 33], 16, 0), ([0, 0, 5], 16, 5), ([64, 0, 16, 15], 16, 40), ([1] * 7, 16, 1),
             ([100], 32, 0), ([0, 3, 0, 0, 0, 0, 0, 0, 0, 0], 16, 3)]
    for E, B in [(3, 16), (5, 32), (32, 16), (33, 64)]:
        for S in (1, 40, 256):
            ids = torch.randint(0, E, (S,), generator=rng)
            ids[: S // 2] = ids[0]  # skewed: half the slots on one expert
            cases.append((torch.bincount(ids, minlength=E).tolist(), B, S % 7))
    for sizes, B, T in cases:
        E, S = len(sizes), sum(sizes)
        R = moe_by_expert.chunk_programs(S, E, B)
        programs = R + -(-T // B)
        offs = torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32)
        out = torch.full((programs, 3), -1, dtype=torch.int32)
        probe[(programs,)](offs, out, E, S, T, R, BLOCK_M=B, BLOCK_E=triton.next_power_of_2(E))
        chunks = sum(-(-n // B) for n in sizes)
        assert chunks <= R
        seen = torch.zeros(S + T, dtype=torch.int32)
        for p, (e, start, end) in enumerate(out.tolist()):
            assert end - start <= B, (sizes, p)
            if p >= R:  # the shared expert's
                assert e == E and S <= start < end <= S + T, (sizes, p)
            elif p >= chunks:
                assert start == end, (sizes, p)
            else:
                assert 0 <= e < E and offs[e] - sizes[e] <= start < end <= offs[e], (sizes, p)
            seen[start:end] += 1
        assert torch.equal(seen, torch.ones_like(seen)), sizes


@interpreted_only
@pytest.mark.parametrize("shared", [False, True])
def test_interpreted_by_expert_fills_a_grid_of_as_many_chunks_as_it_bounds(shared):
    """Groups of 17, 1, 1, 1 and 33 rows in chunks of 16: 2 + 1 + 1 + 1 + 3 = 8 chunks, exactly the grid's bound for
    the routed rows (S // BLOCK_M + min(E, S) = 3 + 5 = 8 programs, no spare one), each a program of its own; with a
    shared expert its 53 rows follow in 4 more programs. A chunk mapped to the wrong rows or left out fails."""
    x, _, w, w1, w2, w3 = random_moe(53, 48, 40, 5, 1, torch.float32, seed=7)
    order = torch.randperm(53, generator=torch.Generator().manual_seed(3))
    idx = torch.tensor([0] * 17 + [1] + [2] + [3] + [4] * 33)[order]
    inputs = (x, idx[:, None], w, w1, w2, w3)
    with torch.no_grad():
        if shared:
            (s1, s2, s3), one_idx, one_w = shared_expert(53, 48, 40, torch.float32, seed=8)
            y = moe_experts_by_expert(*inputs, situ_k3, blocks=(16, 16, 16, 16, 16), shared=(s1[0], s2[0], s3[0]))
            reference = moe_experts_loop(*inputs, situ_k3) + moe_experts_loop(x, one_idx, one_w, s1, s2, s3, situ_k3)
        else:
            y = moe_experts_by_expert(*inputs, situ_k3, blocks=(16, 16, 16, 16, 16))
            reference = moe_experts_loop(*inputs, situ_k3)
    assert rel_norm_err(y, reference) < TOLERANCE[torch.float32]


@interpreted_only
@pytest.mark.parametrize("T, K, E, block_m", [(5, 4, 4, None), (23, 2, 6, None), (37, 3, 5, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_by_expert_with_a_shared_expert(T, K, E, block_m, dtype):
    """`shared`: the routed experts' output plus the shared expert's, each in x's dtype (MoE.forward's add), the
    shared rows in chunks of BLOCK_M (37 tokens: three chunks of 16, the last masked): against the loop reference of
    both and their add; the output less the routed call's is the shared expert's (up to the sum's rounding)."""
    D, F = 48, 40
    x, idx, w, w1, w2, w3 = random_moe(T, D, F, E, K, dtype, seed=T + K)
    (s1, s2, s3), one_idx, one_w = shared_expert(T, D, F, dtype, seed=T + K + 1)
    blocks = None if block_m is None else (block_m, 16, 16, 16, 16)
    with torch.no_grad():
        y = moe_experts_by_expert(x, idx, w, w1, w2, w3, swiglu, blocks=blocks, shared=(s1[0], s2[0], s3[0]))
        routed = moe_experts_by_expert(x, idx, w, w1, w2, w3, swiglu, blocks=blocks)
        alone = moe_experts_loop(x, one_idx, one_w, s1, s2, s3, swiglu)
        reference = moe_experts_loop(x, idx, w, w1, w2, w3, swiglu) + alone
    assert rel_norm_err(y, reference) < TOLERANCE[dtype]
    assert rel_norm_err(y.double() - routed.double(), alone) < 4 * TOLERANCE[dtype]
    with pytest.raises(ValueError, match="shared expert's weights"):
        moe_experts_by_expert(x, idx, w, w1, w2, w3, swiglu, shared=(s1[0], s2[0], s3[0, :-1]))


@interpreted_only
@pytest.mark.parametrize("D, F", [(50, 37), (70, 45)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_by_expert_tiles_with_tails(D, F, dtype):
    """Tiles of 16 everywhere: every reduction loops and ends in a masked tail, the row tiles too; non-contiguous
    x and w2 (strided views), and BLOCK_M 32 over groups of ~8 rows (a chunk mostly masked)."""
    x, idx, w, w1, w2, w3 = random_moe(19, D, F, 5, 2, dtype, seed=D + F)
    x_strided = torch.stack([x, x], dim=-1).flatten(1)[:, ::2]  # the same values, stride 2
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)  # [E, D, F] with F-major storage
    assert not x_strided.is_contiguous() and torch.equal(x_strided, x) and torch.equal(w2_t, w2)
    with torch.no_grad():
        y = moe_experts_by_expert(x_strided, idx, w, w1, w2_t, w3, swiglu, blocks=(32, 16, 16, 16, 16))
        y_loop = moe_experts_loop(x, idx, w, w1, w2, w3, swiglu)
    assert rel_norm_err(y, y_loop) < TOLERANCE[dtype]


@interpreted_only
def test_interpreted_by_expert_saturated_activations():
    """Large inputs: SiTU's clamps and swiglu's sigmoid saturate; nothing may overflow."""
    for act in (situ_k3, swiglu):
        inputs = random_moe(9, 24, 20, 4, 2, torch.float32, seed=3, scale=60.0)
        y, y_loop = run_both(inputs, act)
        assert torch.isfinite(y).all() and rel_norm_err(y, y_loop) < 1e-5


@interpreted_only
@pytest.mark.parametrize("T, K, E", [(1, 1, 1), (50, 3, 7), (37, 8, 40), (300, 4, 32)])
def test_interpreted_expert_rows_is_a_stable_sort(T, K, E):
    """The ordering kernel against moe.expert_order (a stable sort and searchsorted): the same order and group ends;
    row_S is order_S's inverse. S = 3 .. 1200, not multiples of BLOCK_ORDER, with more experts than slots."""
    idx = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(T))
    order, row, offs = expert_rows(idx, E)
    order_ref, offs_ref = expert_order(idx.view(-1), E)
    assert order.dtype == row.dtype == offs.dtype == torch.int32
    assert torch.equal(order.long(), order_ref) and torch.equal(offs, offs_ref)
    assert torch.equal(row.long()[order.long()], torch.arange(T * K))


@interpreted_only
def test_interpreted_expert_rows_clamps_ids():
    """An id outside 0..E-1 joins the nearest expert (as the GEMV kernels clamp): never a row no program writes."""
    order, row, offs = expert_rows(torch.tensor([[5, -1], [0, 9]]), 3)
    assert offs.tolist() == [2, 2, 4]
    assert order.tolist() == [1, 2, 0, 3]


@interpreted_only
def test_interpreted_by_expert_refuses_what_it_cannot_do():
    inputs = random_moe(2, 16, 8, 3, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="moe_experts_by_expert does not know the activation"):
        moe_experts_by_expert(*inputs, lambda g, u: g * u)
    with pytest.raises(ValueError, match="takes no weight_fn"):
        moe_experts_by_expert(*inputs, swiglu, weight_fn=torch.neg)
    with pytest.raises(ValueError, match="forward only"):
        moe_experts_by_expert(inputs[0].clone().requires_grad_(), *inputs[1:], swiglu)
    assert moe_experts_by_expert(inputs[0][:0], inputs[1][:0], inputs[2][:0], *inputs[3:], swiglu).shape == (0, 16)


@interpreted_only
def test_interpreted_moe_experts_runs_by_expert_between_the_thresholds(monkeypatch):
    """Through `moe_experts` on the interpreted CPU backend: 70 slots (past GEMV_MAX_SLOTS) run the by-expert
    kernels and match the loop."""
    ops.forget_moe_backends()
    monkeypatch.delenv("OPENK3_MOE_GEMV", raising=False)
    backend = ops.select_moe_backend("cpu", torch.float32)
    assert backend.by_expert is moe_experts_by_expert and "by-expert" in backend.reason
    calls = []
    monkeypatch.setattr(ops, "moe_experts_by_expert",
                        lambda *a: calls.append(a[1].numel()) or moe_experts_by_expert(*a))
    monkeypatch.setattr(ops, "_CHOSEN", {})
    inputs = random_moe(GEMV_MAX_SLOTS // 2 + 3, 32, 24, 6, 2, torch.float32, seed=6)
    with torch.no_grad():
        y = ops.moe_experts(*inputs, situ_k3)
    assert calls == [GEMV_MAX_SLOTS + 6]
    assert rel_norm_err(y, moe_experts_loop(*inputs, situ_k3)) < 1e-5
    monkeypatch.setenv("OPENK3_MOE_GEMV", "0")
    assert ops.select_moe_backend("cpu", torch.float32).by_expert is None
    ops.forget_moe_backends()


def test_moe_experts_picks_the_path_by_slot_count(monkeypatch):
    """S <= GEMV_MAX_SLOTS: the GEMV kernels; up to BY_EXPERT_MAX_SLOTS: the by-expert kernels; above: the backend's
    inference path; with grad or a weight_fn: the backend itself."""
    calls = []

    def path(name):
        return lambda *a, weight_fn=None: calls.append((name, a[1].numel())) or a[0]
    backend = ops.MoEBackend("grouped", "test", path("fn"), small=path("gemv"), by_expert=path("by_expert"),
                             inference=path("inference"))
    monkeypatch.setattr(ops, "_CHOSEN", {})  # NOTE: moe_experts reads _CHOSEN before _select
    monkeypatch.setattr(ops, "_select", lambda *key: backend)
    K = 4
    tokens = [1, GEMV_MAX_SLOTS // K, GEMV_MAX_SLOTS // K + 1, BY_EXPERT_MAX_SLOTS // K, BY_EXPERT_MAX_SLOTS // K + 1]
    with torch.no_grad():
        for T in tokens:
            ops.moe_experts(*random_moe(T, 16, 16, 4, K, torch.float32, seed=T), swiglu)
        ops.moe_experts(*random_moe(100, 16, 16, 4, K, torch.float32, seed=0), swiglu, weight_fn=torch.neg)
    inputs = random_moe(100, 16, 16, 4, K, torch.float32, seed=0)
    ops.moe_experts(inputs[0].requires_grad_(), *inputs[1:], swiglu)
    assert calls == [("gemv", 4), ("gemv", GEMV_MAX_SLOTS), ("by_expert", GEMV_MAX_SLOTS + K),
                     ("by_expert", BY_EXPERT_MAX_SLOTS), ("inference", BY_EXPERT_MAX_SLOTS + K),
                     ("inference", 400), ("fn", 400)]


def test_by_expert_applies_only_to_gradient_free_calls_up_to_its_limit():
    inputs = random_moe(BY_EXPERT_MAX_SLOTS // 4, 16, 8, 4, 4, torch.float32, seed=1)
    assert by_expert_applies(*inputs, swiglu)
    assert not by_expert_applies(*random_moe(BY_EXPERT_MAX_SLOTS // 4 + 1, 16, 8, 4, 4, torch.float32, seed=1),
                                 swiglu)
    assert not by_expert_applies(*inputs, lambda g, u: g * u)
    assert not by_expert_applies(*inputs, swiglu, weight_fn=torch.neg)
    assert not by_expert_applies(inputs[0].clone().requires_grad_(), *inputs[1:], swiglu)


@needs_triton
@pytest.mark.skipif(INTERPRETED, reason="the interpreter compiles nothing")
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("act", ["swiglu", "situ"])
def test_kernels_compile_for_sm90_pipelined_without_spills(block_m, act):
    """What the interpreter cannot check: Triton compiles the kernels for sm_90 at kimi-linear-1.5b's shapes with the
    module's tiles, as a launch specialises them (unit strides, 16-divisible pointers and strides), with no register
    spills, and the reduction loops' loads are pipelined (async copies): loads in flight while the dots run."""
    s = KIMI_LINEAR_EXPERTS
    types = {**{n: "*bf16" for n in ("x_ptr", "w1_ptr", "w3_ptr", "w1s_ptr", "w3s_ptr", "h_ptr", "w2_ptr", "w2s_ptr",
                                     "out_ptr")},
             "order_ptr": "*i32", "offs_ptr": "*i32", "idx_ptr": "*i64", "row_ptr": "*i32",
             "beta": "fp32", "linear_beta": "fp32"}
    common = {"F": s["F"], "D": s["D"], "PRECISION": "tf32", "UPCAST": False, "BLOCK_M": block_m,
              "BLOCK_E": moe_by_expert.triton.next_power_of_2(s["E"])}
    ttgir = []
    gate_up = compile_for_sm90(moe_by_expert._gate_up_kernel, types,
                               {**common, "K": s["K"], "SITU": act == "situ", "stride_xd": 1, "stride_wd": 1,
                                "BLOCK_F": moe_by_expert.BLOCK_F, "BLOCK_D": moe_by_expert.BLOCK_D1},
                               divisible=("stride_xt", "stride_we", "stride_wf"), ttgir=ttgir)
    down = compile_for_sm90(moe_by_expert._down_kernel, types,
                            {**common, "stride_wf": 1, "BLOCK_D": moe_by_expert.BLOCK_D,
                             "BLOCK_F": moe_by_expert.BLOCK_F2}, divisible=("stride_we", "stride_wd"), ttgir=ttgir)
    order = compile_for_sm90(moe_by_expert._order_kernel, types, {"S_MAX": 256, "BLOCK": moe_by_expert.BLOCK_ORDER})
    for usage in (gate_up, down, order):
        assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
    assert all("async_copy_global_to_local" in ir for ir in ttgir)


# ------------------------------------------------------------------------------------------ GPU


@cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 256])  # S = 256, 1024
@pytest.mark.parametrize("act", [swiglu, situ_k3])
def test_by_expert_matches_grouped_on_gpu(T, act):
    """bf16 at kimi-linear-1.5b's shapes against the grouped path and the loop: the same roundings, only the fp32
    sums' order differs; and what `moe_experts` runs at these sizes."""
    s = KIMI_LINEAR_EXPERTS
    inputs = random_moe(T, s["D"], s["F"], s["E"], s["K"], torch.bfloat16, seed=T, device="cuda")
    with torch.no_grad():
        y = moe_experts_by_expert(*inputs, act)
        y_grouped = moe_experts_grouped(*inputs, act)
        y_loop = moe_experts_loop(*inputs, act)
        y_exact = moe_experts_loop(*[t.double() if t.is_floating_point() else t for t in inputs], act)
        ops.forget_moe_backends()
        y_dispatched = ops.moe_experts(*inputs, act)
    assert rel_norm_err(y, y_grouped) < 5e-3
    assert rel_norm_err(y, y_loop) < 5e-3
    assert rel_norm_err(y, y_exact) <= 1.5 * rel_norm_err(y_grouped, y_exact) + 1e-3
    assert torch.equal(y, y_dispatched)


@cuda
@needs_triton
@pytest.mark.gpu
def test_by_expert_replays_in_a_cuda_graph():
    """Captured at S = 256 and replayed on fresh routing (other group sizes, the same grid): equal to eager."""
    s = KIMI_LINEAR_EXPERTS
    static = random_moe(64, s["D"], s["F"], s["E"], s["K"], torch.bfloat16, seed=1, device="cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compile the kernels) off the capture
            for _ in range(2):
                moe_experts_by_expert(*static, swiglu)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_experts_by_expert(*static, swiglu)
        fresh = random_moe(64, s["D"], s["F"], s["E"], s["K"], torch.bfloat16, seed=2, device="cuda")
        fresh[1][:32] = 3  # skewed: every slot of the first 32 tokens on expert 3, a group of 128 rows or more
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe_experts_by_expert(*fresh, swiglu))


@cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("T", [5, 16, 64])
def test_by_expert_with_a_shared_expert_on_gpu(T):
    """The routed and shared experts in one call, bf16 at kimi-linear-1.5b's shapes, against the loop reference of
    both and their add; the output less the routed call's is the shared expert's (up to the sum's rounding)."""
    s = KIMI_LINEAR_EXPERTS
    x, idx, w, w1, w2, w3 = random_moe(T, s["D"], s["F"], s["E"], s["K"], torch.bfloat16, seed=T, device="cuda")
    (s1, s2, s3), one_idx, one_w = shared_expert(T, s["D"], s["F"], torch.bfloat16, seed=T + 1, device="cuda")
    with torch.no_grad():
        y = moe_experts_by_expert(x, idx, w, w1, w2, w3, situ_k3, shared=(s1[0], s2[0], s3[0]))
        routed = moe_experts_by_expert(x, idx, w, w1, w2, w3, situ_k3)
        alone = moe_experts_loop(x, one_idx, one_w, s1, s2, s3, situ_k3)
        reference = moe_experts_loop(x, idx, w, w1, w2, w3, situ_k3) + alone
    assert rel_norm_err(y, reference) < 5e-3
    assert rel_norm_err(y.double() - routed.double(), alone) < 2e-2
