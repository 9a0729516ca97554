"""The router's kernels (openk3/ops/router_topk.py) against `Router.forward`'s eager chain: the selection from
given scores, and the whole router from its input (`router_forward`).

On the CPU the kernel runs in Triton's interpreter, in a child pytest started with TRITON_INTERPRET=1 (the
`test_interpreted_*` tests); skipped without triton (CI has none). The GPU tests run the real kernel.
"""


import pytest
import torch

from openk3.config import tiny
from openk3.model.model import Router
from openk3.ops import router_topk
from openk3.ops.moe import route
from openk3.ops.router_topk import route_kernel_applies, route_topk, router_forward, router_kernel_applies
from tests.helpers import INTERPRETED, cuda, interpreted_only, interpreter_child_test, needs_triton


def eager_chain(logits, bias, k, renorm, scale):
    """Router.forward after its matmul, as written there without the kernel."""
    s = torch.sigmoid(logits)
    idx = route(s, bias, k)
    w = s.gather(-1, idx)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return idx, w * scale if scale != 1 else w, s


def check_against_eager(device, T, E, k, renorm, scale, saturate=False):
    g = torch.Generator().manual_seed(1000 * E + 10 * k + T)
    logits = torch.randn(T, E, generator=g) * 3
    if saturate:  # the sigmoid's ends: half a row at exactly 1.0 in fp32 (the bias alone orders them), a row ~1e-13
        logits[0, : E // 2] = 200.0
        logits[-1] = -30.0 + torch.rand(E, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    logits, bias = logits.to(device), bias.to(device)
    ref_idx, ref_w, s = eager_chain(logits, bias, k, renorm, scale)
    assert route_kernel_applies(s, k)
    idx, w = route_topk(s, bias, k, renorm, scale)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w, rtol=4e-7, atol=0)


CASES = [(1, 32, 4, True, 1.0), (5, 32, 4, False, 2.5), (3, 8, 2, True, 1.0), (2, 896, 16, True, 1.0),
         (4, 63, 5, True, 0.7)]


test_kernels_under_the_interpreter = interpreter_child_test(__file__)


@interpreted_only
@pytest.mark.parametrize("T,E,k,renorm,scale", CASES)
def test_interpreted_kernel_equals_eager_chain(T, E, k, renorm, scale):
    check_against_eager("cpu", T, E, k, renorm, scale)


@interpreted_only
def test_interpreted_saturated_scores():
    check_against_eager("cpu", 3, 32, 4, True, 1.0, saturate=True)


@interpreted_only
def test_interpreted_router_module_uses_kernel_without_grad_only():
    """Router.forward: the kernel's result under no_grad equals the eager chain's (autograd, which runs it), and
    under autograd the scores keep their graph to the router weight."""
    cfg = tiny()
    torch.manual_seed(0)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.normal_(0, 0.05)
    x = torch.randn(6, cfg.hidden_size)
    idx, w, s = router(x)  # grad on: the eager chain
    assert s.requires_grad and not route_kernel_applies(s, router.k)
    assert not router_kernel_applies(x, router.weight, router.k)  # the weight wants a gradient
    with torch.no_grad():
        assert router_kernel_applies(x, router.weight, router.k)  # so the comparison below is the kernel's
        idx2, w2, s2 = router(x)
    # the kernel's own fp32 dot products and sigmoid: not bit-equal to cuBLAS's and torch's (module docstring)
    assert torch.equal(idx2, idx)
    torch.testing.assert_close(s2, s.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(w2, w.detach(), rtol=4e-6, atol=0)


def check_router_against_eager(device, T, E, D, k, renorm, scale, dtype=torch.float32, strided=False,
                               saturate=False, blocks=None):
    """`router_forward` from x against the eager chain from the matmul (`eager_chain`, fp32 math), twice (the
    second call counts its programs in the counters the first reset)."""
    g = torch.Generator().manual_seed(100 * E + D + T)
    x = torch.randn(T, 2 * D if strided else D, generator=g)[:, :D]  # strided: rows 2D apart
    weight = torch.randn(E, D, generator=g) * D ** -0.5 * 3
    if saturate:  # sigmoid at both ends for token 0: expert 0's score exactly 1.0 in fp32, expert 1's below 1e-30
        weight[0], weight[1] = x[0].sign() * 40, -x[0].sign() * 40
    bias = torch.randn(E, generator=g) * 0.1
    x, weight, bias = x.to(device, dtype), weight.to(device, dtype), bias.to(device)
    ref_idx, ref_w, ref_s = eager_chain(x.float() @ weight.float().T, bias, k, renorm, scale)
    assert router_kernel_applies(x, weight, k)
    for _ in range(2):
        idx, w, s = router_forward(x, weight, bias, k, renorm, scale, blocks=blocks)
        assert idx.dtype == torch.int64 and w.dtype == s.dtype == torch.float32
        torch.testing.assert_close(s, ref_s, rtol=2e-6, atol=1e-7)
        assert torch.equal(idx, ref_idx)
        torch.testing.assert_close(w, ref_w, rtol=4e-6, atol=0)
    if saturate:
        assert (s[0, 0] == 1.0).item() and s[0, 1].item() < 1e-30


# (T, E, D, k, renorm, scale): the selection by rank up to RANK_MAX_EXPERTS, one pick after the other above
ROUTER_CASES = [(1, 32, 96, 4, True, 1.0), (5, 32, 100, 4, False, 2.5), (3, 300, 64, 8, True, 1.0),
                (2, 8, 48, 2, True, 0.7)]


@interpreted_only
@pytest.mark.parametrize("T,E,D,k,renorm,scale", ROUTER_CASES)
def test_interpreted_router_equals_eager_chain(T, E, D, k, renorm, scale):
    check_router_against_eager("cpu", T, E, D, k, renorm, scale)


@interpreted_only
@pytest.mark.parametrize("E,k", [(32, 4), (100, 6)])
def test_interpreted_router_one_expert_a_program(E, k):
    """Every expert's score from its own program, D read in six steps: the last of a token's E programs selects."""
    check_router_against_eager("cpu", 3, E, 96, k, True, 1.0, blocks=(1, 16))


@interpreted_only
def test_interpreted_router_bf16_strided_saturated():
    check_router_against_eager("cpu", 3, 32, 64, 4, True, 1.0, dtype=torch.bfloat16, strided=True)
    check_router_against_eager("cpu", 2, 32, 64, 4, True, 1.0, saturate=True)


def test_router_kernel_applies_only_where_it_can_run(monkeypatch):
    x, weight = torch.randn(4, 64), torch.randn(32, 64)
    if not INTERPRETED:
        assert not router_kernel_applies(x, weight, 4)  # the CPU without the interpreter
    # the rest where the kernel runs (the interpreter's CPU: the flag alone is read here, no kernel runs), each
    # against a call it takes
    monkeypatch.setattr(router_topk, "INTERPRET", True)
    assert router_kernel_applies(x, weight, 4) == (router_topk.triton is not None)
    assert router_kernel_applies(torch.randn(2 ** 24 // 64 // 32, 64), weight, 4) == (router_topk.triton is not None)
    assert not router_kernel_applies(x, weight.requires_grad_(), 4)
    weight.requires_grad_(False)
    assert not router_kernel_applies(x.double(), weight, 4)
    assert not router_kernel_applies(x, weight.t().contiguous().t(), 4)  # a non-contiguous weight
    assert not router_kernel_applies(x, weight[:, :32], 4)  # D does not match
    assert not router_kernel_applies(x, weight, 33)
    assert not router_kernel_applies(torch.randn(2 ** 24 // 64 // 32 + 1, 64), weight, 4)  # past MAX_SCORE_MACS


def test_tickets_keep_every_buffer_they_made():
    """A larger count makes a larger counter buffer, and the smaller one stays alive (CUDA graphs captured with it
    keep using it); a smaller count reuses the largest."""
    device = torch.device("cpu")
    router_topk._TICKETS.pop(device, None)
    small = router_topk.tickets(device, 10)
    large = router_topk.tickets(device, 1000)
    assert small.numel() == 64 and large.numel() >= 1000 and (large == 0).all()
    assert any(t is small for t in router_topk._TICKETS[device])
    assert router_topk.tickets(device, 100) is large
    router_topk._TICKETS.pop(device)


@needs_triton
@pytest.mark.skipif(INTERPRETED, reason="the interpreter compiles nothing")
@pytest.mark.parametrize("E,D,k", [(32, 1536, 4), (896, 7168, 16)])
def test_router_kernel_compiles_for_sm90_without_spills(E, D, k):
    """What the interpreter cannot check: Triton compiles the router kernel (its ticket, the selection branch) for
    the H200 at kimi-linear-1.5b's and K3's shapes with the default tiles, with no register spilled."""
    from tests.ops.test_moe_gemv import compile_for_sm90
    types = {"x_ptr": "*bf16", "weight_ptr": "*bf16", "scores_ptr": "*fp32", "bias_ptr": "*fp32", "idx_ptr": "*i64",
             "w_ptr": "*fp32", "tickets_ptr": "*i32", "scale": "fp32"}
    block_e = min(1 << ((router_topk.TILE // D).bit_length() - 1) if D < router_topk.TILE else 1,
                  router_topk.MAX_ROWS)
    block_all = 1 << (E - 1).bit_length()
    usage = compile_for_sm90(router_topk._router_kernel, types, {
        "D": D, "K": k, "BLOCK_E": block_e, "BLOCK_D": min(2048, router_topk.CHUNK // block_e),
        "BLOCK_ALL": block_all, "BLOCK_K": k, "RANK": block_all <= router_topk.RANK_MAX_EXPERTS, "RENORM": True})
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage


def test_applies_only_where_it_can_run(monkeypatch):
    logits = torch.randn(2, 32)
    if not INTERPRETED:
        assert not route_kernel_applies(logits, 4)  # the CPU without the interpreter
    monkeypatch.setattr(router_topk, "INTERPRET", True)  # as above: where it runs
    assert route_kernel_applies(logits, 4) == (router_topk.triton is not None)
    assert not route_kernel_applies(logits.double(), 4)
    assert not route_kernel_applies(logits, 33)
    assert not route_kernel_applies(logits.requires_grad_(), 4)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,renorm,scale", CASES + [(64, 32, 4, True, 1.0), (8192, 32, 4, True, 1.0)])
def test_gpu_kernel_equals_eager_chain(T, E, k, renorm, scale):
    check_against_eager("cuda", T, E, k, renorm, scale)


@cuda
@pytest.mark.gpu
def test_gpu_saturated_scores():
    check_against_eager("cuda", 3, 32, 4, True, 1.0, saturate=True)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T,E,D,k", [(1, 32, 1536, 4), (64, 32, 1536, 4), (1, 896, 7168, 16), (2, 896, 7168, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_router_equals_eager_chain(T, E, D, k, dtype):
    check_router_against_eager("cuda", T, E, D, k, True, 1.0, dtype=dtype)
    check_router_against_eager("cuda", T, E, D, k, True, 1.0, dtype=dtype, blocks=(1, 256))
    check_router_against_eager("cuda", 2, E, D, k, True, 1.0, dtype=dtype, saturate=True)
