"""The Triton GEMV experts (openk3/ops/moe_gemv.py) against the loop reference, and how calls reach them.

On the CPU the kernels run in Triton's interpreter, in a child pytest started with TRITON_INTERPRET=1 (the
`test_interpreted_*` tests). Skipped without triton (CI has none). The GPU tests run the real kernels.
"""

import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import openk3.ops as ops
from openk3.config import get_config, tiny
from openk3.model import K3ForCausalLM
from openk3.model.model import glu_activation
from openk3.ops import moe_gemv
from openk3.ops.moe import grouped_expert_outputs, moe_experts_grouped, moe_experts_loop
from openk3.ops.moe_by_expert import BY_EXPERT_MAX_SLOTS
from openk3.ops.moe_gemv import GEMV_MAX_SLOTS, GLUSpec, gemv_applies, glu_spec
from openk3.ops.mxfp import fake_quant_mxfp4
from openk3.ops.situ import situ_glu, swiglu
from tests.helpers import INTERPRETED, cuda, interpreted_only, interpreter_child_test, needs_triton, rel_norm_err


def situ_k3(gate, up):
    return situ_glu(gate, up, 4.0, 25.0)


def situ_other(gate, up):  # constants other than situ_glu's defaults, to see the kernel takes them
    return situ_glu(gate, up, 2.5, 7.0)


situ_k3.glu = GLUSpec("situ", 4.0, 25.0)
situ_other.glu = GLUSpec("situ", 2.5, 7.0)


test_kernels_under_the_interpreter = interpreter_child_test(__file__)


def random_moe(T, D, F, E, K, dtype, seed, scale=1.0, device="cpu"):
    """Random tokens and weights; routing by a random top-k, so tokens share experts and some experts get none."""
    gen = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(T, D, generator=gen)).to(dtype)
    w1 = (torch.randn(E, F, D, generator=gen) / D**0.5).to(dtype)
    w3 = (torch.randn(E, F, D, generator=gen) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, F, generator=gen) / F**0.5).to(dtype)
    topk_w, topk_idx = torch.rand(T, E, generator=gen).topk(K, dim=-1)
    return [t.to(device) for t in (x, topk_idx, topk_w.to(dtype), w1, w2, w3)]


def shared_expert(T, D, F, dtype, seed, device="cpu"):
    """A shared expert for T tokens: its weights as one expert [1, F, D], [1, D, F], [1, F, D] and the one-expert
    routing (every token to expert 0, weight 1) its own call takes (as MLP.gemv runs it)."""
    _, _, _, s1, s2, s3 = random_moe(T, D, F, 1, 1, dtype, seed=seed, device=device)
    one_idx = torch.zeros(T, 1, dtype=torch.int64, device=device)
    return (s1, s2, s3), one_idx, torch.ones(T, 1, dtype=dtype, device=device)


# fp32 and fp16 round as the GPU does: the kernels match the loop to the order of the fp32 sums (fp16: at most
# 3.3e-5 on these cases; leaving out the kernels' roundings of gate/up or of the expert output to x's dtype gave
# 6.1e-4 and 4.0e-4). NOTE: the interpreter's fp32 -> bf16 cast truncates (the GPU rounds to nearest), a bias of
# ~2^-9 per rounding, three roundings deep: its bf16 bound is loose; the GPU tests below hold bf16 tight.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 4e-2}


@interpreted_only
@pytest.mark.parametrize("T, K, E, act", [(1, 1, 3, situ_k3), (3, 2, 5, situ_other), (7, 4, 6, swiglu),
                                          (2, 4, 4, situ_k3)])  # E = K: every token uses every expert
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_interpreted_gemv_matches_loop(T, K, E, act, dtype):
    D, F = 48, 40  # not powers of two (with the default tiles each reduction runs once, without a masked tail)
    inputs = random_moe(T, D, F, E, K, dtype, seed=T * 10 + K)
    with torch.no_grad():
        y = moe_gemv.moe_experts_gemv(*inputs, act)
        y_loop = moe_experts_loop(*inputs, act)
    assert y.dtype == dtype and y.shape == (T, D)
    assert rel_norm_err(y, y_loop) < TOLERANCE[dtype]


@interpreted_only
@pytest.mark.parametrize("D, F", [(50, 37), (70, 45)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_gemv_tiles_with_tails(D, F, dtype):
    """Small tiles (4 F rows x 16 of D in kernel 1, 8 D rows x 16 of F in kernel 2): every reduction loops several
    times and ends in a masked tail, and the row tiles too; non-contiguous x and weights (strided views)."""
    x, idx, w, w1, w2, w3 = random_moe(3, D, F, 5, 2, dtype, seed=D + F)
    x_strided = torch.stack([x, x], dim=-1).flatten(1)[:, ::2]  # the same values, stride 2
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)  # [E, D, F] with F-major storage
    assert not x_strided.is_contiguous() and torch.equal(x_strided, x) and torch.equal(w2_t, w2)
    with torch.no_grad():
        y = moe_gemv.moe_experts_gemv(x_strided, idx, w, w1, w2_t, w3, swiglu, blocks=(4, 16, 8, 16))
        y_loop = moe_experts_loop(x, idx, w, w1, w2, w3, swiglu)
    assert rel_norm_err(y, y_loop) < TOLERANCE[dtype]


@interpreted_only
@pytest.mark.parametrize("act", [situ_k3, situ_other, swiglu])
def test_interpreted_gemv_saturated_activations(act):
    """Large inputs: tanh and sigmoid at +-1 (SiTU's clamps), exp(-2|x|) underflowing; nothing may overflow."""
    inputs = random_moe(5, 24, 20, 4, 2, torch.float32, seed=3, scale=60.0)
    y = moe_gemv.moe_experts_gemv(*inputs, act)
    y_loop = moe_experts_loop(*inputs, act)
    assert torch.isfinite(y).all()
    assert rel_norm_err(y, y_loop) < 1e-5


@interpreted_only
@pytest.mark.parametrize("act", [situ_k3, situ_other])
def test_interpreted_situ_is_accurate_element_by_element(act):
    """SiTU's tanh (the Taylor series below 1/8, the exp form above) and sigmoid, from 1e-8 to 1e3 of either sign:
    one expert with F = 1 whose gate and up rows pick x_t's two entries, and w2 = 1, so y[t, 0] = act(x_t0, x_t1)."""
    gate = torch.cat([torch.logspace(-8, 3, 23), -torch.logspace(-8, 3, 23), torch.tensor([0.124, 0.126, -0.5])])
    up = torch.cat([torch.logspace(-8, 3, 16), -torch.logspace(-8, 3, 16), torch.tensor([30.0])])
    up = up[torch.randperm(up.numel(), generator=torch.Generator().manual_seed(0))].repeat(2)[: gate.numel()]
    T = gate.numel()
    x = torch.stack([gate, up], 1)
    w1 = torch.tensor([1.0, 0.0]).view(1, 1, 2)
    w3 = torch.tensor([0.0, 1.0]).view(1, 1, 2)
    w2 = torch.tensor([1.0, 0.0]).view(1, 2, 1)
    y = moe_gemv.moe_experts_gemv(x, torch.zeros(T, 1, dtype=torch.int64), torch.ones(T, 1), w1, w2, w3, act)
    expected = act(gate.double(), up.double())
    assert (y[:, 1] == 0).all()
    normal = expected.abs() > 1e-30  # far out the sigmoid's tail underflows fp32 (in the reference too)
    assert normal.sum() > 0.8 * T
    assert ((y[:, 0].double() - expected).abs() / expected.abs())[normal].max() < 1e-5
    assert (y[:, 0].abs()[~normal] < 1e-29).all()


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, K", [(1, 2), (3, 2), (4, 3)])
def test_interpreted_gemv_with_a_shared_expert_is_routed_plus_shared(T, K, dtype):
    """`shared`: the routed experts' output plus the shared expert's, each in x's dtype, added as MoE.forward adds
    them: bit-equal to the two calls it replaces (the shared expert as a one-expert call, as MLP.gemv runs it) and
    their add (fp32 and fp16 round here as on the GPU; the interpreter's bf16 truncates)."""
    D, F, E = 48, 40, 5
    x, idx, w, w1, w2, w3 = random_moe(T, D, F, E, K, dtype, seed=11 + T)
    (s1, s2, s3), one_idx, one_w = shared_expert(T, D, F, dtype, seed=12 + T)
    with torch.no_grad():
        y = moe_gemv.moe_experts_gemv(x, idx, w, w1, w2, w3, swiglu, shared=(s1[0], s2[0], s3[0]))
        routed = moe_gemv.moe_experts_gemv(x, idx, w, w1, w2, w3, swiglu)
        shared = moe_gemv.moe_experts_gemv(x, one_idx, one_w, s1, s2, s3, swiglu)
        reference = moe_experts_loop(x, idx, w, w1, w2, w3, swiglu) + moe_experts_loop(x, one_idx, one_w, s1, s2, s3,
                                                                                          swiglu)
    assert torch.equal(y, routed + shared)
    assert rel_norm_err(y, reference) < TOLERANCE[dtype]
    with pytest.raises(ValueError, match="shared expert's weights"):
        moe_gemv.moe_experts_gemv(x, idx, w, w1, w2, w3, swiglu, shared=(s1[0, :-1], s2[0, :, :-1], s3[0, :-1]))


@interpreted_only
def test_interpreted_kernels_round_fp32_routing_weights_to_x_dtype():
    """fp32 routing weights (the router's) give what the same weights rounded to x's dtype give (Experts.forward
    rounds them before every backend; MoE.experts_with_shared leaves it to the kernels): fp16 rounds here as on the
    GPU."""
    from openk3.ops.moe_by_expert import moe_experts_by_expert
    x, idx, w, w1, w2, w3 = random_moe(9, 48, 40, 5, 2, torch.float16, seed=4)
    w32 = torch.rand(w.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for fn in (moe_gemv.moe_experts_gemv, moe_experts_by_expert):
            assert torch.equal(fn(x, idx, w32, w1, w2, w3, swiglu), fn(x, idx, w32.half(), w1, w2, w3, swiglu))


@interpreted_only
@pytest.mark.parametrize("T", [3, 9])
def test_interpreted_plain_moe_runs_routed_and_shared_experts_in_one_call(T, monkeypatch, fresh_backend_choice):
    """A plain MoE (the Kimi-Linear family) under no_grad: one call for its routed and shared experts together
    (`MoE.experts_with_shared`): at 3 tokens (6 slots) the GEMV kernels', bit-equal to the routed call, the shared
    expert's and the add (the same forward with that path off); at 9 tokens (18 slots) the by-expert kernels', whose
    shared rows are tl.dot tiles where the path off runs cuBLAS (fp32 sums apart). A LatentMoE (K3) and a forward
    under autograd keep their own calls."""
    from openk3.model.model import MoE
    from openk3.ops import moe_by_expert
    from tests.model.test_model import kimi_linear_tiny
    torch.manual_seed(0)
    moe = MoE(kimi_linear_tiny())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(T, moe.experts.w1.shape[2])
    calls = []

    def spy(real, name):
        def call(*args, **kwargs):
            calls.append((name, "shared" if kwargs.get("shared") is not None else args[3].shape[0]))
            return real(*args, **kwargs)
        return call
    gemv = spy(moe_gemv.moe_experts_gemv, "gemv")
    by_expert = spy(moe_by_expert.moe_experts_by_expert, "by_expert")
    monkeypatch.setattr(ops, "moe_experts_gemv", gemv)
    monkeypatch.setattr(ops, "moe_experts_by_expert", by_expert)
    monkeypatch.delenv("OPENK3_MOE_GEMV", raising=False)
    E = moe.experts.w1.shape[0]
    kind = "gemv" if T == 3 else "by_expert"
    with torch.no_grad():
        y = moe(x)
        assert calls == [(kind, "shared")]
        monkeypatch.setattr(MoE, "experts_with_shared", lambda self, *args: None)
        y_apart = moe(x)
    # then the routed experts' call and (at 3 tokens; at 9 cuBLAS) the shared expert's one-expert GEMV
    assert calls[1:] == [(kind, E)] + ([("gemv", 1)] if T == 3 else [])
    if T == 3:
        assert torch.equal(y, y_apart)
    else:
        assert rel_norm_err(y, y_apart) < 1e-6
    n = len(calls)
    y_grad = moe(x)  # under autograd: no kernel
    assert rel_norm_err(y_grad, y) < 1e-5 and len(calls) == n
    latent = MoE(tiny())  # a LatentMoE adds its shared experts after its up projection: never merged
    del calls[:]
    with torch.no_grad():
        latent(torch.randn(T, latent.gate.weight.shape[1]))
    assert latent.latent and calls and all(shared != "shared" for _, shared in calls)


@interpreted_only
def test_interpreted_gemv_refuses_what_it_cannot_do():
    inputs = random_moe(2, 16, 8, 3, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="does not know the activation"):
        moe_gemv.moe_experts_gemv(*inputs, lambda g, u: g * u)
    with pytest.raises(ValueError, match="takes no weight_fn"):
        moe_gemv.moe_experts_gemv(*inputs, swiglu, weight_fn=torch.neg)
    x = inputs[0].clone().requires_grad_()
    with pytest.raises(ValueError, match="forward only"):
        moe_gemv.moe_experts_gemv(x, *inputs[1:], swiglu)
    with pytest.raises(ValueError, match="float64"):
        moe_gemv.moe_experts_gemv(*[t.double() if t.is_floating_point() else t for t in inputs], swiglu)


@interpreted_only
def test_interpreted_model_forward_runs_the_kernels_and_matches(monkeypatch, fresh_backend_choice):
    """The tiny K3 (LatentMoE, SiTU-GLU) under no_grad: 3 tokens are 6 slots, so every MoE layer runs the kernels;
    the logits match the same forward with OPENK3_MOE_GEMV=0 (the grouped matmul)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(tiny()).eval()
    ids = torch.randint(0, 2048, (1, 3))
    calls = []
    real = moe_gemv.moe_experts_gemv

    def spy(*args):
        calls.append(args[3].shape[0])  # the experts a call has: 1 for a dense MLP's (model.py `MLP.gemv`)
        return real(*args)
    monkeypatch.setattr(ops, "moe_experts_gemv", spy)
    monkeypatch.delenv("OPENK3_MOE_GEMV", raising=False)
    with torch.no_grad():
        logits = model(ids).logits
        monkeypatch.setenv("OPENK3_MOE_GEMV", "0")
        ops.forget_moe_backends()
        logits_grouped = model(ids).logits
    assert calls.count(model.config.num_experts) == len(model.moe_layers())
    assert rel_norm_err(logits, logits_grouped) < 1e-5


@interpreted_only
@pytest.mark.parametrize("T, K, E", [(1, 1, 3), (9, 2, 5), (23, 4, 6), (5, 4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_interpreted_grouped_combined_matches_grouped_and_loop(T, K, E, dtype):
    """The grouped matmuls then `combine_slots` (in D tiles of 32 with a masked tail: D = 48) against the grouped path's
    index_add and the loop: the same fp32 sum of each token's K terms, in k order."""
    inputs = random_moe(T, 48, 40, E, K, dtype, seed=T + K + E)
    with torch.no_grad():
        out_SD, order_S, _ = grouped_expert_outputs(inputs[0], inputs[1], *inputs[3:], swiglu)
        y = moe_gemv.combine_slots(out_SD, order_S, inputs[2], block_d=32)
        y_default = moe_gemv.moe_experts_grouped_combined(*inputs, situ_k3)
        y_grouped = moe_experts_grouped(*inputs, swiglu)
        y_loop = moe_experts_loop(*inputs, swiglu)
    assert y.dtype == dtype and y.shape == (T, 48)
    # the fp32 sums' order; fp16: one rounding of the sum; bf16: the interpreter's cast truncates (module docstring)
    exact = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel_norm_err(y, y_grouped) < exact
    assert rel_norm_err(y, y_loop) < TOLERANCE[dtype]
    assert rel_norm_err(y_default, moe_experts_loop(*inputs, situ_k3)) < TOLERANCE[dtype]


@interpreted_only
def test_interpreted_combine_slots_reads_every_row_once():
    """Each token gets exactly its own K rows: rows that are one-hot in D, a permuted order, weights 1 .. K."""
    T, K = 6, 3
    order = torch.randperm(T * K, generator=torch.Generator().manual_seed(1))
    out = torch.zeros(T * K, T * K)
    out[torch.arange(T * K), order] = 1.0  # row i is one-hot at the slot it belongs to
    w = torch.arange(1, K + 1, dtype=torch.float32).repeat(T, 1)
    y = moe_gemv.combine_slots(out, order, w, block_d=8)
    expected = torch.zeros(T, T * K)
    for t in range(T):
        for k in range(K):
            expected[t, t * K + k] = k + 1
    assert torch.equal(y, expected)
    with pytest.raises(ValueError, match="T\\*K = 18 rows"):
        moe_gemv.combine_slots(out[:-1], order[:-1], w)


@interpreted_only
def test_interpreted_moe_experts_combines_forwards_without_grad(monkeypatch, fresh_backend_choice):
    """Past BY_EXPERT_MAX_SLOTS (and below it with a weight_fn) a forward without grad runs the grouped matmuls and
    `combine_slots`; with grad, or with OPENK3_MOE_GEMV=0, the grouped path's index_add, which the backward needs."""
    monkeypatch.delenv("OPENK3_MOE_GEMV", raising=False)
    backend = ops.select_moe_backend("cpu", torch.float32)
    assert backend.inference is moe_gemv.moe_experts_grouped_combined and "one Triton kernel" in backend.reason
    calls = []
    real = moe_gemv.combine_slots
    monkeypatch.setattr(moe_gemv, "combine_slots", lambda *a: calls.append(a[0].shape) or real(*a))
    inputs = random_moe(BY_EXPERT_MAX_SLOTS // 2 + 3, 16, 8, 5, 2, torch.float32, seed=4)
    with torch.no_grad():
        y = ops.moe_experts(*inputs, swiglu)
    assert calls == [(BY_EXPERT_MAX_SLOTS + 6, 16)]
    x = inputs[0].clone().requires_grad_()
    y_grad = ops.moe_experts(x, *inputs[1:], swiglu)
    y_grad.sum().backward()
    assert len(calls) == 1 and x.grad is not None and rel_norm_err(y, y_grad.detach()) < 1e-6
    qat = random_moe(BY_EXPERT_MAX_SLOTS // 2 + 3, 64, 32, 5, 2, torch.float32, seed=5)  # MX blocks of 32 along D and F
    with torch.no_grad():  # QAT's fake quantisation reaches the combined path too, and is applied there
        y_qat = ops.moe_experts(*qat, swiglu, weight_fn=fake_quant_mxfp4)
        y_plain = ops.moe_experts(*qat, swiglu)
    assert len(calls) == 3
    assert rel_norm_err(y_qat, moe_experts_loop(*qat, swiglu, weight_fn=fake_quant_mxfp4)) < 1e-5
    assert rel_norm_err(y_qat, y_plain) > 1e-3
    monkeypatch.setenv("OPENK3_MOE_GEMV", "0")
    assert ops.select_moe_backend("cpu", torch.float32).inference is None


def compile_for_sm90(kernel, types: dict, constexprs: dict, divisible: tuple[str, ...] = (), ttgir: list | None = None):
    """Compile a Triton kernel for an H100/H200 (sm_90) without a GPU; returns its resource usage line.
    divisible: the integer arguments to mark multiples of 16, with every pointer, as a launch marks them (a unit
    stride, which a launch specialises to 1, goes in constexprs); ttgir: a list the kernel's TTGIR is appended to."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in divisible or (divisible and n not in constexprs and signature[n].startswith("*"))}
    compiled = moe_gemv.triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                       target=GPUTarget("cuda", 90, 32))
    if ttgir is not None:
        ttgir.append(compiled.asm["ttgir"])
    cubin = compiled.asm["cubin"]
    tool = Path(moe_gemv.triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return next(line.strip() for line in usage.splitlines() if "REG:" in line)


@needs_triton
@pytest.mark.skipif(INTERPRETED, reason="the interpreter compiles nothing")
@pytest.mark.parametrize("act", ["swiglu", "situ"])
def test_kernels_compile_for_sm90_without_spills(act):
    """What the interpreter cannot check: that Triton compiles the kernels for the GPU the lead runs (kimi-linear-1.5b
    shapes, the module's tiles), and that no thread spills registers to local memory."""
    s = KIMI_LINEAR_EXPERTS
    shape = {"F": s["F"], "D": s["D"], "K": s["K"]}
    ptrs = {n: "*bf16" for n in ("x_ptr", "w1_ptr", "w3_ptr", "w1s_ptr", "w3s_ptr", "h_ptr", "topk_w_ptr", "w2_ptr",
                                 "w2s_ptr", "y_ptr")}
    types = {**ptrs, "idx_ptr": "*i64", "beta": "fp32", "linear_beta": "fp32"}
    tiles = {"BLOCK_F": moe_gemv.BLOCK_F, "BLOCK_D": moe_gemv.BLOCK_D1}
    gate_up = compile_for_sm90(moe_gemv._gate_up_kernel, types, {**shape, "SITU": act == "situ", **tiles})
    down = [compile_for_sm90(moe_gemv._down_kernel, types, {**shape, "SHARED": shared, "BLOCK_D": moe_gemv.BLOCK_D,
                                                            "BLOCK_F": moe_gemv.BLOCK_F2}) for shared in (False, True)]
    for usage in (gate_up, *down):  # spilled registers show as a stack frame (64 x 512 tiles: STACK:4984)
        assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage


def test_gemv_applies_only_to_small_gradient_free_calls():
    inputs = random_moe(3, 16, 8, 4, 2, torch.float32, seed=1)
    assert gemv_applies(*inputs, swiglu)
    assert not gemv_applies(*inputs, lambda g, u: g * u)  # no GLUSpec: the kernels cannot compute it
    assert not gemv_applies(*inputs, swiglu, weight_fn=torch.neg)
    big = random_moe(GEMV_MAX_SLOTS // 2 + 1, 16, 8, 4, 2, torch.float32, seed=1)
    assert not gemv_applies(*big, swiglu)
    w1 = inputs[3].clone().requires_grad_()
    assert not gemv_applies(*inputs[:3], w1, *inputs[4:], swiglu)
    with torch.no_grad():
        assert gemv_applies(*inputs[:3], w1, *inputs[4:], swiglu)


def test_model_activations_carry_their_spec():
    situ = glu_activation(get_config("tiny"))
    assert glu_spec(situ) == GLUSpec("situ", 4.0, 25.0)
    assert glu_spec(glu_activation(get_config("kimi-linear-1.5b"))) == GLUSpec("swiglu")
    assert glu_spec(swiglu) == GLUSpec("swiglu") and glu_spec(situ_glu) == GLUSpec("situ", 4.0, 25.0)
    with pytest.raises(ValueError, match="'gelu'"):
        GLUSpec("gelu")


def test_moe_experts_sends_only_decode_sized_forwards_to_the_small_path(monkeypatch):
    calls = []
    backend = ops.MoEBackend("grouped", "test", lambda *a, weight_fn=None: calls.append("fn") or a[0],
                             small=lambda *a: calls.append("small") or a[0])
    # NOTE: moe_experts reads _CHOSEN before _select: an earlier test's CPU fp32 choice would bypass the patch
    monkeypatch.setattr(ops, "_CHOSEN", {})
    monkeypatch.setattr(ops, "_select", lambda *key: backend)
    small = random_moe(2, 16, 8, 4, 4, torch.float32, seed=2)
    big = random_moe(GEMV_MAX_SLOTS // 4 + 1, 16, 8, 4, 4, torch.float32, seed=2)
    with torch.no_grad():
        ops.moe_experts(*small, swiglu)
        ops.moe_experts(*big, swiglu)
        ops.moe_experts(*small, swiglu, weight_fn=torch.neg)
    ops.moe_experts(small[0].requires_grad_(), *small[1:], swiglu)
    assert calls == ["small", "fn", "fn", "fn"]


@pytest.fixture
def fresh_backend_choice():
    ops.forget_moe_backends()
    yield
    ops.forget_moe_backends()


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs the kernels on the CPU")
def test_backend_choice_says_whether_it_has_the_small_path(monkeypatch, fresh_backend_choice):
    monkeypatch.delenv("OPENK3_MOE_GEMV", raising=False)
    cpu = ops.select_moe_backend("cpu", torch.float32)
    assert cpu.small is None and "no GEMV path" in cpu.reason
    for value, error, match in [("yes", ValueError, "OPENK3_MOE_GEMV='yes'"),
                                ("1", RuntimeError, "OPENK3_MOE_GEMV=1 but the GEMV kernels cannot run here")]:
        monkeypatch.setenv("OPENK3_MOE_GEMV", value)
        ops.forget_moe_backends()
        with pytest.raises(error, match=match):
            ops.select_moe_backend("cpu", torch.bfloat16)
    monkeypatch.setenv("OPENK3_MOE_GEMV", "0")
    ops.forget_moe_backends()
    assert "OPENK3_MOE_GEMV=0" in ops.select_moe_backend("cpu", torch.float32).reason


# ------------------------------------------------------------------------------------------ GPU

KIMI_LINEAR_EXPERTS = dict(E=32, F=512, D=1536, K=4)  # kimi-linear-1.5b's routed experts


@cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("act", [swiglu, situ_k3])
def test_gemv_matches_grouped_and_loop_on_gpu(T, act):
    s = KIMI_LINEAR_EXPERTS
    inputs = random_moe(T, s["D"], s["F"], s["E"], s["K"], torch.bfloat16, seed=T, device="cuda")
    with torch.no_grad():
        y = moe_gemv.moe_experts_gemv(*inputs, act)
        y_loop = moe_experts_loop(*inputs, act)
        y_grouped = moe_experts_grouped(*inputs, act)
        y_exact = moe_experts_loop(*[t.double() if t.is_floating_point() else t for t in inputs], act)
    # bf16 rounds the same values at the same places as the reference: only the fp32 sums' order differs
    assert rel_norm_err(y, y_loop) < 5e-3
    assert rel_norm_err(y, y_grouped) < 5e-3
    assert rel_norm_err(y, y_exact) <= 1.5 * rel_norm_err(y_grouped, y_exact) + 1e-3


@cuda
@needs_triton
@pytest.mark.gpu
def test_gemv_is_what_moe_experts_runs_at_decode_and_replays_in_a_cuda_graph(fresh_backend_choice):
    s = KIMI_LINEAR_EXPERTS
    inputs = random_moe(4, s["D"], s["F"], s["E"], s["K"], torch.bfloat16, seed=7, device="cuda")
    assert ops.select_moe_backend("cuda", torch.bfloat16).small is moe_gemv.moe_experts_gemv
    static = [t.clone() for t in inputs]
    with torch.no_grad():
        eager = ops.moe_experts(*inputs, situ_k3)
        assert torch.equal(eager, moe_gemv.moe_experts_gemv(*inputs, situ_k3))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compile the kernels) off the capture, as PyTorch's notes ask
            for _ in range(2):
                ops.moe_experts(*static, situ_k3)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.moe_experts(*static, situ_k3)
        fresh = random_moe(4, s["D"], s["F"], s["E"], s["K"], torch.bfloat16, seed=8, device="cuda")
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ops.moe_experts(*fresh, situ_k3))


@cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("act", [swiglu, situ_k3])
def test_gemv_with_a_shared_expert_on_gpu(T, act):
    """The routed and shared experts in one pair of launches, bf16 at kimi-linear-1.5b's shapes: bit-equal to the
    routed call plus the shared expert's one-expert call (MoE.forward's add)."""
    s = KIMI_LINEAR_EXPERTS
    x, idx, w, w1, w2, w3 = random_moe(T, s["D"], s["F"], s["E"], s["K"], torch.bfloat16, seed=T, device="cuda")
    (s1, s2, s3), one_idx, one_w = shared_expert(T, s["D"], s["F"], torch.bfloat16, seed=T + 1, device="cuda")
    with torch.no_grad():
        y = moe_gemv.moe_experts_gemv(x, idx, w, w1, w2, w3, act, shared=(s1[0], s2[0], s3[0]))
        apart = moe_gemv.moe_experts_gemv(x, idx, w, w1, w2, w3, act) + moe_gemv.moe_experts_gemv(
            x, one_idx, one_w, s1, s2, s3, act)
    assert torch.equal(y, apart)


@cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("T", [257, 2048])
def test_grouped_combined_matches_grouped_on_gpu(T):
    """The grouped matmuls and `combine_slots` in bf16 at kimi-linear-1.5b's shapes (decode batch 257, past the
    by-expert kernels' BY_EXPERT_MAX_SLOTS; a prefill chunk)
    against the grouped path's index_add: only the fp32 sums' order differs before the one rounding to bf16; what
    `moe_experts` runs without grad."""
    s = KIMI_LINEAR_EXPERTS
    inputs = random_moe(T, s["D"], s["F"], s["E"], s["K"], torch.bfloat16, seed=T, device="cuda")
    with torch.no_grad():
        y = moe_gemv.moe_experts_grouped_combined(*inputs, situ_k3)
        y_grouped = moe_experts_grouped(*inputs, situ_k3)
        y_dispatched = ops.moe_experts(*inputs, situ_k3)
    assert rel_norm_err(y, y_grouped) < 2e-3
    assert torch.equal(y, y_dispatched)
