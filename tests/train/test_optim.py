"""Muon (plain, per-head, expert stacks), parameter groups, state round trip, schedule, QK-Clip."""

import copy
import io

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from openk3.train import optim
from openk3.train.optim import (Muon, MuonAdamW, adamw_fused, assign_param_groups, batch_plan, build_optimizer,
                                cosine_schedule, orthogonalize, qk_clip_mla_)
from tests.helpers import rel_norm_err


def fake_model(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> nn.Module:
    """An nn.Module whose named_parameters() are exactly `shapes` (dotted HF-style names)."""
    g = torch.Generator().manual_seed(seed)
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.randn(shape, generator=g)))
    return root


# A two-layer hybrid with every kind of parameter the model has, at toy sizes:
# D=24, KDA 3 heads x 4, MLA 2 heads with nope 4, rope 2, v 3, q_lora 10, kv_lora 6; 4 experts.
D, DL, F, E = 24, 12, 8, 4
TOY_SHAPES = {
    "model.embed_tokens.weight": (50, D),
    "lm_head.weight": (50, D),
    "model.norm.weight": (D,),
    "model.output_attn_res_norm.weight": (D,),
    "model.output_attn_res_proj.weight": (1, D),
    # layer 0: KDA + dense MLP
    "model.layers.0.input_layernorm.weight": (D,),
    "model.layers.0.post_attention_layernorm.weight": (D,),
    "model.layers.0.self_attention_res_norm.weight": (D,),
    "model.layers.0.self_attention_res_proj.weight": (1, D),
    "model.layers.0.mlp_res_norm.weight": (D,),
    "model.layers.0.mlp_res_proj.weight": (1, D),
    "model.layers.0.self_attn.q_proj.weight": (12, D),
    "model.layers.0.self_attn.k_proj.weight": (12, D),
    "model.layers.0.self_attn.v_proj.weight": (12, D),
    "model.layers.0.self_attn.q_conv1d.weight": (12, 1, 4),
    "model.layers.0.self_attn.k_conv1d.weight": (12, 1, 4),
    "model.layers.0.self_attn.v_conv1d.weight": (12, 1, 4),
    "model.layers.0.self_attn.f_a_proj.weight": (4, D),
    "model.layers.0.self_attn.f_b_proj.weight": (12, 4),
    "model.layers.0.self_attn.b_proj.weight": (3, D),
    "model.layers.0.self_attn.dt_bias": (12,),
    "model.layers.0.self_attn.A_log": (3,),
    "model.layers.0.self_attn.o_norm.weight": (4,),
    "model.layers.0.self_attn.g_proj.weight": (12, D),
    "model.layers.0.self_attn.o_proj.weight": (D, 12),
    "model.layers.0.mlp.gate_proj.weight": (40, D),
    "model.layers.0.mlp.up_proj.weight": (40, D),
    "model.layers.0.mlp.down_proj.weight": (D, 40),
    # layer 1: MLA + MoE
    "model.layers.1.input_layernorm.weight": (D,),
    "model.layers.1.self_attn.q_a_proj.weight": (10, D),
    "model.layers.1.self_attn.q_a_layernorm.weight": (10,),
    "model.layers.1.self_attn.q_b_proj.weight": (12, 10),
    "model.layers.1.self_attn.kv_a_proj_with_mqa.weight": (8, D),
    "model.layers.1.self_attn.kv_a_layernorm.weight": (6,),
    "model.layers.1.self_attn.kv_b_proj.weight": (14, 6),
    "model.layers.1.self_attn.g_proj.weight": (6, D),
    "model.layers.1.self_attn.o_proj.weight": (D, 6),
    "model.layers.1.block_sparse_moe.gate.weight": (E, D),
    "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight": (DL, D),
    "model.layers.1.block_sparse_moe.routed_expert_norm.weight": (DL,),
    "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight": (D, DL),
    "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight": (16, D),
    "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight": (16, D),
    "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight": (D, 16),
    "model.layers.1.block_sparse_moe.experts.w1": (E, F, DL),
    "model.layers.1.block_sparse_moe.experts.w3": (E, F, DL),
    "model.layers.1.block_sparse_moe.experts.w2": (E, DL, F),
}
TOY_HEAD_DIMS = {"kda": 4, "mla_q": 6, "mla_kv": 7}


def toy_model() -> nn.Module:
    model = fake_model(TOY_SHAPES)
    gate = model.get_submodule("model.layers.1.block_sparse_moe.gate")
    gate.register_buffer("e_score_correction_bias", torch.zeros(E))     # a buffer: no optimiser
    return model


def set_random_grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_newton_schulz_is_near_orthogonal():
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 24, 40), (2, 41, 23), (1, 17, 300)]:          # wide, tall, very wide
        m = torch.randn(shape, generator=g) * 1e-3                   # scale must not matter
        sv = torch.linalg.svdvals(orthogonalize(m).float())
        assert sv.shape == (shape[0], min(shape[1:]))
        assert 0.65 < float(sv.min()) and float(sv.max()) < 1.2


def test_newton_schulz_keeps_singular_vectors():
    # NS only maps singular values, O = U f(S) V^T: in M's singular bases O is diagonal.
    g = torch.Generator().manual_seed(1)
    m = torch.randn(20, 33, generator=g)
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    o_in_bases = u.T @ orthogonalize(m[None])[0].float() @ vh.T
    assert rel_norm_err(o_in_bases, torch.diag(o_in_bases.diagonal())) < 0.02


@pytest.mark.parametrize("batched", [True, False])
def test_muon_step_equals_torch_muon(batched):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 80, generator=g)
    ours, ref = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    opt = Muon([ours], lr=0.02, weight_decay=0.1, momentum=0.95, batched=batched)
    ref_opt = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                               adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        grad = torch.randn(48, 80, generator=g)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    assert rel_norm_err(ours - w, ref - w) < 1e-5
    assert rel_norm_err(ours, w) > 1e-3                                    # the step moved something


def test_muon_update_rms_matches_adamw_scale():
    # An orthogonal [R, C] block has RMS 1/sqrt(max(R, C)); times 0.2 sqrt(max(R, C)) gives 0.2.
    g = torch.Generator().manual_seed(3)
    p = nn.Parameter(torch.randn(30, 70, generator=g))
    start = p.detach().clone()
    opt = Muon([p], lr=1.0, weight_decay=0.0)
    p.grad = torch.randn(30, 70, generator=g)
    opt.step()
    rms = float((p.detach() - start).pow(2).mean().sqrt())
    assert 0.15 < rms < 0.21


def test_per_head_muon_is_each_head_block_on_its_own():
    g = torch.Generator().manual_seed(4)
    heads, dh, cols = 3, 5, 8                                         # rows of all heads > cols > dh
    w = torch.randn(heads * dh, cols, generator=g)
    per_head = nn.Parameter(w.clone())
    separate = [nn.Parameter(w[h * dh:(h + 1) * dh].clone()) for h in range(heads)]
    whole = nn.Parameter(w.clone())
    opt_per_head = Muon([{"params": [per_head], "head_dim": dh}], lr=0.05)
    opt_separate = Muon(separate, lr=0.05)
    opt_whole = Muon([whole], lr=0.05)
    for _ in range(2):
        grad = torch.randn(heads * dh, cols, generator=g)
        grad[:dh] *= 50                                               # one head with a huge gradient
        per_head.grad, whole.grad = grad.clone(), grad.clone()
        for h, p in enumerate(separate):
            p.grad = grad[h * dh:(h + 1) * dh].clone()
        for opt in (opt_per_head, opt_separate, opt_whole):
            opt.step()
    assert rel_norm_err(per_head - w, torch.cat(list(separate)) - w) < 1e-5
    assert rel_norm_err(per_head - w, whole - w) > 0.1


def test_expert_stack_is_each_expert_on_its_own():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 7, 11, generator=g)
    stacked = nn.Parameter(w.clone())
    separate = [nn.Parameter(w[e].clone()) for e in range(3)]
    opt_stacked, opt_separate = Muon([stacked], lr=0.05), Muon(separate, lr=0.05)
    for _ in range(2):
        grad = torch.randn(3, 7, 11, generator=g)
        stacked.grad = grad.clone()
        for e, p in enumerate(separate):
            p.grad = grad[e].clone()
        opt_stacked.step()
        opt_separate.step()
    assert rel_norm_err(stacked - w, torch.stack(separate) - w) < 1e-5


# A model-like Muon set in three groups: per-head 2-D (KDA-like heads of [4, 24]; MLA-like heads of [6, 10]),
# expert stacks wide [4, 8, 12] and tall [4, 12, 8], whole matrices tall [40, 24] and wide [24, 40], a gate [4, 24]
# whose block shape equals the KDA heads' (another group, another lr: one batch, two step factors), and odd sizes.
# Every shape but the odd ones appears more than once, so batching groups.
MUON_SET = {
    "heads": ({"head_dim": 4, "lr": 0.03, "momentum": 0.9, "weight_decay": 0.05}, [(12, 24), (12, 24), (12, 24)]),
    "mla_heads": ({"head_dim": 6, "lr": 0.02}, [(12, 10), (18, 10)]),
    "whole": ({"head_dim": None, "lr": 0.02},
              [(4, 8, 12), (4, 8, 12), (4, 12, 8), (40, 24), (40, 24), (24, 40), (24, 40), (4, 24), (13, 7)]),
}


def muon_set_steps(steps: int = 4, device: str = "cpu",
                   **muon_kwargs) -> tuple[list[nn.Parameter], Muon, list[tuple[int, ...]]]:
    """`steps` Muon steps on MUON_SET from fixed random weights and gradients; the last parameter has no gradient
    in step 1 (skipped, as torch.optim skips it). Returns the parameters, the optimiser, and the shape of every
    batch `orthogonalize` was called with."""
    g = torch.Generator().manual_seed(11)
    params, groups = [], []
    for settings, shapes in MUON_SET.values():
        group = [nn.Parameter(torch.randn(shape, generator=g).to(device)) for shape in shapes]
        params += group
        groups.append({"params": group, **settings})
    opt = Muon(groups, lr=0.01, weight_decay=0.1, **muon_kwargs)
    calls = []
    orthogonalize_ = optim.orthogonalize
    optim.orthogonalize = lambda m, *a: calls.append(tuple(m.shape)) or orthogonalize_(m, *a)
    try:
        for step in range(steps):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=g) * (step + 1)).to(device)
            if step == 1:
                params[-1].grad = None
            opt.step()
    finally:
        optim.orthogonalize = orthogonalize_
    return params, opt, calls


def test_batched_muon_step_equals_the_per_parameter_step():
    """One Newton-Schulz per block shape instead of one per parameter, with the same result. Measured on this CPU:
    bit-equal weights and momentum (the batched bmm and norm compute each matrix as the per-matrix ones do)."""
    batched, opt, calls = muon_set_steps(batched=True)
    reference, ref_opt, ref_calls = muon_set_steps(batched=False)
    for i, (p, q) in enumerate(zip(batched, reference)):
        assert torch.equal(p, q), i
        assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"]), i
    # 7 block shapes: (4, 24), (6, 10), (8, 12), (12, 8), (40, 24), (24, 40), (13, 7); the odd one skips step 1
    assert calls[:7] == [(10, 4, 24), (5, 6, 10), (8, 8, 12), (4, 12, 8), (2, 40, 24), (2, 24, 40), (1, 13, 7)]
    assert len(calls) == 7 * 4 - 1
    assert len(ref_calls) == 14 * 4 - 1


def test_batched_muon_step_of_bf16_parameters_equals_the_per_parameter_step():
    """bf16 parameters: the weight decay 1 - lr wd = 0.998 is applied as the per-parameter step's mul_ does, in fp32
    opmath. NOTE: torch 2.13's CPU _foreach_mul_ rounds a Python scalar to the tensors' dtype first (0.998 -> 0.99609
    in bf16, twice the decay), which the batched step did (measured here). Wide blocks only: for a tall block the
    per-parameter step adds the transposed (non-contiguous) Newton-Schulz output, and torch's bf16 add_ rounds that
    layout 1 ulp apart from a contiguous one, so there bit equality is not the per-parameter step's to give."""
    def steps(batched: bool) -> tuple[list[nn.Parameter], Muon]:
        g = torch.Generator().manual_seed(5)
        params = [nn.Parameter(torch.randn(shape, generator=g).bfloat16()) for shape in [(8, 12), (3, 6, 10), (12, 24)]]
        opt = Muon([{"params": params[:2]}, {"params": params[2:], "head_dim": 4, "lr": 0.04}], lr=0.02,
                   weight_decay=0.1, batched=batched)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).bfloat16()
            opt.step()
        return params, opt

    (batched, opt), (reference, ref_opt) = steps(True), steps(False)
    for i, (p, q) in enumerate(zip(batched, reference)):
        assert torch.equal(p, q), i
        assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"]), i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_muon_step_on_cuda_is_the_per_parameter_step():
    """On CUDA the batched bmm may take other kernels than the per-matrix ones, so the bits may differ.
    NOTE: not measured yet (no GPU where this was written): 2e-2 is about 5 bf16 epsilons of the weights' total
    change, a bound that catches a wrong block, scale or momentum (errors of order 1); the measured error is printed
    (pytest -s) to set it just above."""
    batched, _, _ = muon_set_steps(device="cuda", batched=True)
    reference, _, _ = muon_set_steps(device="cuda", batched=False)
    start, _, _ = muon_set_steps(steps=0)
    errors = [rel_norm_err(p - w.cuda(), q - w.cuda()) for p, q, w in zip(batched, reference, start)]
    print(f"batched vs per-parameter Muon on CUDA, max relative error of the weight change: {max(errors):.3e}")
    assert max(errors) < 2e-2


def test_batch_cap_smaller_than_a_group_gives_the_same_step():
    """A cap of 4 blocks of [4, 24] (bf16: 768 bytes) cuts the 10 blocks of that shape into 4 + 4 + 2, inside the
    second and third head matrices; larger blocks than the cap go one at a time. Same result, bit for bit."""
    capped, _, calls = muon_set_steps(batched=True, max_batch_bytes=4 * 4 * 24 * 2)
    reference, _, _ = muon_set_steps(batched=False)
    for i, (p, q) in enumerate(zip(capped, reference)):
        assert torch.equal(p, q), i
    assert calls[:3] == [(4, 4, 24), (4, 4, 24), (2, 4, 24)]
    assert all(b * r * c * 2 <= 768 or b == 1 for b, r, c in calls)
    assert (1, 40, 24) in calls


def test_batch_plan_cuts_groups_of_one_block_shape_at_the_cap():
    a, b, big = ((3, 5), torch.float32, "cpu"), ((5, 3), torch.float32, "cpu"), ((100, 100), torch.float32, "cpu")
    cap = 4 * 3 * 5 * 2                                # 4 blocks of a in bf16
    assert batch_plan([(a, 3), (b, 2), (a, 4), (big, 2)], cap) == [
        [(0, 0, 3), (2, 0, 1)], [(2, 1, 4)],          # a: 3 + 1 blocks, then the rest of parameter 2
        [(1, 0, 2)],                                   # b: its own batch, in parameter order after a
        [(3, 0, 1)], [(3, 1, 2)]]                      # a block over the cap: one at a time
    assert batch_plan([(a, 3), (a, 1)], cap) == [[(0, 0, 3), (1, 0, 1)]]
    bf16 = ((3, 5), torch.bfloat16, "cpu")             # another dtype (or device) is another batch
    assert batch_plan([(a, 1), (bf16, 1)], cap) == [[(0, 0, 1)], [(1, 0, 1)]]
    with pytest.raises(ValueError, match="max_batch_bytes"):
        Muon([nn.Parameter(torch.randn(3, 5))], lr=0.1, max_batch_bytes=0)
    clone = copy.deepcopy(Muon([nn.Parameter(torch.randn(3, 5))], lr=0.1, batched=False, max_batch_bytes=7))
    assert (clone.batched, clone.max_batch_bytes) == (False, 7)


def test_adamw_is_fused_exactly_when_every_parameter_is_a_plain_cuda_tensor():
    cpu_adamw = build_optimizer(toy_model(), lr=1e-3, head_dims=TOY_HEAD_DIMS).optimizers[1]
    assert cpu_adamw.defaults["fused"] is None and cpu_adamw.defaults["foreach"] is None  # torch's CPU default
    with FakeTensorMode(), torch.device("cuda"):       # fake CUDA tensors: devices and shapes, no GPU needed
        cuda_model = fake_model(TOY_SHAPES)
        cuda_adamw = build_optimizer(cuda_model, lr=1e-3, head_dims=TOY_HEAD_DIMS).optimizers[1]
        assert cuda_adamw.defaults["fused"] is True
        assert not adamw_fused([cuda_model.lm_head.weight, nn.Parameter(torch.randn(3, device="cpu"))])
    assert not adamw_fused([])


def test_parameter_groups_of_a_hybrid_layer_stack():
    model = toy_model()
    groups = {name: sorted(n for n, _ in named) for name, named in assign_param_groups(model).items()}
    layer0, layer1 = "model.layers.0.", "model.layers.1."
    assert groups["muon_kda_heads"] == sorted(f"{layer0}self_attn.{x}_proj.weight" for x in "qkv")
    assert groups["muon_mla_q_heads"] == [f"{layer1}self_attn.q_b_proj.weight"]
    assert groups["muon_mla_kv_heads"] == [f"{layer1}self_attn.kv_b_proj.weight"]
    assert groups["adamw_decay"] == ["lm_head.weight", "model.embed_tokens.weight"]
    moe, attn0, attn1 = f"{layer1}block_sparse_moe.", f"{layer0}self_attn.", f"{layer1}self_attn."
    for name in [f"{moe}gate.weight", f"{moe}experts.w1", f"{moe}experts.w2",
                 f"{moe}routed_expert_up_proj.weight", f"{attn1}kv_a_proj_with_mqa.weight",
                 f"{attn0}b_proj.weight", f"{attn0}f_b_proj.weight", f"{layer0}mlp.down_proj.weight"]:
        assert name in groups["muon"], name
    for name in [f"{attn0}A_log", f"{attn0}dt_bias", f"{attn0}q_conv1d.weight", f"{attn0}o_norm.weight",
                 f"{layer0}self_attention_res_proj.weight", f"{layer0}mlp_res_norm.weight",
                 f"{attn1}q_a_layernorm.weight", "model.norm.weight",
                 "model.output_attn_res_proj.weight", f"{moe}routed_expert_norm.weight"]:
        assert name in groups["adamw_no_decay"], name
    every = [n for names in groups.values() for n in names]
    assert sorted(every) == sorted(TOY_SHAPES)          # each parameter exactly once, and no buffer

    plain = assign_param_groups(model, per_head=False)
    assert set(plain) == {"muon", "adamw_decay", "adamw_no_decay"}


def test_mla_q_proj_without_q_lora_is_told_apart_from_kda():
    shapes = {"layers.0.self_attn.q_proj.weight": (12, 8), "layers.1.self_attn.q_proj.weight": (12, 8),
              "layers.1.self_attn.kv_b_proj.weight": (14, 6)}
    assigned = assign_param_groups(fake_model(shapes))
    groups = {name: [n for n, _ in named] for name, named in assigned.items()}
    assert groups["muon_kda_heads"] == ["layers.0.self_attn.q_proj.weight"]
    assert groups["muon_mla_q_heads"] == ["layers.1.self_attn.q_proj.weight"]


def test_build_optimizer_settings_and_errors():
    model = toy_model()
    opt = build_optimizer(model, lr=3e-3, head_dims=TOY_HEAD_DIMS)
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["muon_mla_kv_heads"]["head_dim"] == 7
    assert by_name["muon"]["head_dim"] is None
    assert by_name["muon"]["weight_decay"] == 0.1 and by_name["adamw_decay"]["weight_decay"] == 0.1
    assert by_name["adamw_no_decay"]["weight_decay"] == 0.0
    opt.set_lr_scale(0.5)
    assert all(g["lr"] == pytest.approx(1.5e-3) for g in opt.param_groups)
    with pytest.raises(ValueError, match="mla_kv"):
        build_optimizer(model, lr=1e-3, head_dims={"kda": 4, "mla_q": 6})
    with pytest.raises(ValueError, match="head_dim=5"):
        build_optimizer(model, lr=1e-3, head_dims={**TOY_HEAD_DIMS, "kda": 5})
    with pytest.raises(ValueError, match=r"model\.odd\.weight"):
        build_optimizer(fake_model({"model.odd.weight": (2, 3, 4)}), lr=1e-3)


def test_state_dict_round_trip_gives_identical_steps():
    model = toy_model()
    opt = build_optimizer(model, lr=1e-2, head_dims=TOY_HEAD_DIMS)
    for step in range(3):
        set_random_grads(model, seed=step)
        opt.set_lr_scale(cosine_schedule(step, 10, warmup_frac=0.2))
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    resumed = toy_model()
    resumed.load_state_dict(saved["model"])
    resumed_opt = build_optimizer(resumed, lr=1e-2, head_dims=TOY_HEAD_DIMS)
    resumed_opt.load_state_dict(saved["optim"])
    for step in range(3, 6):
        for m, o in ((model, opt), (resumed, resumed_opt)):
            set_random_grads(m, seed=step)
            o.set_lr_scale(cosine_schedule(step, 10, warmup_frac=0.2))
            o.step()
    for (name, a), (_, b) in zip(model.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name

    fresh = toy_model()
    fresh_opt = build_optimizer(fresh, lr=1e-2, head_dims=TOY_HEAD_DIMS)
    set_random_grads(fresh, seed=3)
    fresh_opt.step()                                  # without the loaded state the step differs
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight)

    # the batched step keeps the per-parameter step's state: a reference optimiser resumes it exactly
    buffer.seek(0)
    saved = torch.load(buffer)                        # NOTE: afresh: loading shares tensors, the steps above moved them
    reference = toy_model()
    reference.load_state_dict(saved["model"])
    reference_opt = build_optimizer(reference, lr=1e-2, head_dims=TOY_HEAD_DIMS, muon_batched=False)
    reference_opt.load_state_dict(saved["optim"])
    assert reference_opt.optimizers[0].batched is False
    for step in range(3, 6):
        set_random_grads(reference, seed=step)
        reference_opt.set_lr_scale(cosine_schedule(step, 10, warmup_frac=0.2))
        reference_opt.step()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def test_load_state_dict_refuses_another_model():
    model = toy_model()
    opt = build_optimizer(model, lr=1e-2, per_head=False)
    set_random_grads(model, seed=0)
    opt.step()
    other = fake_model({**TOY_SHAPES, "model.extra.weight": (3, D)})
    other_opt = build_optimizer(other, lr=1e-2, per_head=False)
    with pytest.raises(ValueError, match="model.extra.weight"):
        other_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert isinstance(opt, MuonAdamW) and len(opt.optimizers) == 2


def test_cosine_schedule_endpoints():
    total = 1000                                        # warmup = 10 steps
    assert cosine_schedule(0, total) == pytest.approx(0.1)
    assert cosine_schedule(9, total) == pytest.approx(1.0)
    assert cosine_schedule(10, total) == pytest.approx(1.0)
    mid = 10 + (total - 1 - 10) / 2
    assert cosine_schedule(int(mid), total) == pytest.approx(0.55, abs=2e-3)
    assert cosine_schedule(total - 1, total) == pytest.approx(0.1)
    assert cosine_schedule(total + 50, total) == pytest.approx(0.1)
    assert cosine_schedule(0, 1) == 1.0                 # warmup is at least one step
    values = [cosine_schedule(s, 137, warmup_frac=0.05) for s in range(137)]
    peak = values.index(max(values))
    assert all(a <= b for a, b in zip(values[:peak], values[1:peak + 1]))
    assert all(a >= b for a, b in zip(values[peak:], values[peak + 1:]))
    with pytest.raises(ValueError, match="total_steps"):
        cosine_schedule(0, 0)


def mla_logits(q_weight, kv_b_weight, q_latent_TQ, c_TL, k_pe_TR, heads, nope, rope, v):
    """Pre-softmax logits [H, T, T] of a toy MLA (no causal mask needed for the max)."""
    T = q_latent_TQ.shape[0]
    q_THD = (q_latent_TQ @ q_weight.T).view(T, heads, nope + rope)
    kv_THD = (c_TL @ kv_b_weight.T).view(T, heads, nope + v)
    k_THD = torch.cat([kv_THD[..., :nope], k_pe_TR[:, None, :].expand(T, heads, rope)], dim=-1)
    return torch.einsum("shd,thd->hst", q_THD, k_THD) * (nope + rope) ** -0.5


def test_qk_clip_brings_exactly_the_offending_heads_to_tau():
    g = torch.Generator().manual_seed(7)
    heads, nope, rope, v, q_lora, kv_lora, T = 4, 5, 3, 6, 9, 7, 11
    q_weight = torch.randn(heads * (nope + rope), q_lora, generator=g)
    q_weight.view(heads, nope + rope, q_lora)[1::2] *= 4              # heads 1 and 3 run hot
    kv_b_weight = torch.randn(heads * (nope + v), kv_lora, generator=g)
    q_latent, c = torch.randn(T, q_lora, generator=g), torch.randn(T, kv_lora, generator=g)
    k_pe = torch.randn(T, rope, generator=g)
    dims = dict(heads=heads, nope=nope, rope=rope, v=v)
    logits = mla_logits(q_weight, kv_b_weight, q_latent, c, k_pe, **dims)
    max_logit = logits.amax(dim=(1, 2))
    tau = float(max_logit.sort().values[1] + max_logit.sort().values[2]) / 2   # two heads above
    over = max_logit > tau
    assert int(over.sum()) == 2

    q_clipped, kv_clipped = q_weight.clone(), kv_b_weight.clone()
    gamma = qk_clip_mla_(q_clipped, kv_clipped, max_logit, tau,
                         qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)
    new_logits = mla_logits(q_clipped, kv_clipped, q_latent, c, k_pe, **dims)
    new_max = new_logits.amax(dim=(1, 2))
    assert torch.allclose(new_max[over], torch.full_like(new_max[over], tau), rtol=1e-5)
    assert torch.equal(new_max[~over], max_logit[~over])
    assert torch.equal(gamma[~over], torch.ones(2))
    # every logit of a clipped head scales by gamma, not just the largest
    assert rel_norm_err(new_logits, logits * gamma[:, None, None]) < 1e-5
    # v rows are left alone; k_nope rows of clipped heads shrink by sqrt(gamma)
    kv_old, kv_new = kv_b_weight.view(heads, nope + v, -1), kv_clipped.view(heads, nope + v, -1)
    assert torch.equal(kv_old[:, nope:], kv_new[:, nope:])
    assert torch.allclose(kv_new[:, :nope], kv_old[:, :nope] * gamma.sqrt()[:, None, None])
    q_old, q_new = q_weight.view(heads, nope + rope, -1), q_clipped.view(heads, nope + rope, -1)
    assert torch.allclose(q_new[:, nope:], q_old[:, nope:] * gamma[:, None, None])


def test_qk_clip_checks_shapes():
    with pytest.raises(ValueError, match=r"\[16, in\]"):
        qk_clip_mla_(torch.randn(15, 4), torch.randn(10, 3), torch.ones(2), 1.0,
                     qk_nope_head_dim=5, qk_rope_head_dim=3, v_head_dim=0)
