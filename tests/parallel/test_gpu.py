"""The parallel equality tests on CUDA with NCCL at world size 1 (item 7 of issue 13; skipped without CUDA).

    PYTHONPATH=$PWD python -m pytest -q -m gpu tests/parallel/test_gpu.py

`test_fla_cp_context_equals_the_torch_fold` runs on 2 GPUs when there are 2 (else on 1): fla's `cp_context`
(`kda_context_parallel_fla`) against openk3's torch fold, forward and backward.

One spawned NCCL process runs: FSDP2 training steps against the unsharded model, FSDP2 with the bf16 parameter
policy (fp32 islands kept), MoonEP / plain EP against the loop MoE, and KDA / MLA context parallelism (KDA through
fla when it is installed) against the unsplit row. It writes relative errors; the tests check them.
NOTE: NCCL refuses two ranks on one GPU, so a 2-process run needs 2 GPUs (`--nproc 2` on the training command).
"""

import copy
import importlib.util
import traceback

import pytest
import torch

from openk3.model.model import K3ForCausalLM
from openk3.ops.moe import moe_experts_loop
from openk3.parallel.expert import PLANS, ep_moe_experts
from openk3.parallel.fsdp import apply_fsdp
from openk3.parallel.mesh import DistEnv, ParallelDims, build_mesh
from openk3.train.optim import build_optimizer
from tests.helpers import rel_err, rel_norm_err
from tests.parallel import test_context as cp_case
from tests.parallel.dist import init_nccl, spawn_results
from tests.train.test_train import small_config

pytestmark = pytest.mark.gpu


def _train_steps(model, steps: int, ids) -> list[float]:
    c = model.config
    opt = build_optimizer(model, lr=3e-3, head_dims={"kda": c.linear_attn_config.head_dim,
                                                      "mla_q": c.qk_nope_head_dim + c.qk_rope_head_dim,
                                                      "mla_kv": c.qk_nope_head_dim + c.v_head_dim})
    losses = []
    for _ in range(steps):
        out = model(ids, labels=ids.roll(-1, 1))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    return losses


def _first_gradients(model, ids) -> dict:
    """Each parameter's gradient of one forward and backward (whole tensors, also from FSDP's shards), then
    cleared."""
    model(ids, labels=ids.roll(-1, 1)).loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _fsdp(env: DistEnv, dev: torch.device) -> dict:
    torch.manual_seed(0)
    config = small_config()
    ids = torch.randint(0, config.vocab_size, (4, 64), device=dev)
    plain = K3ForCausalLM(config).to(dev)
    plain.reset_parameters(seed=0)
    init = copy.deepcopy(plain)
    sharded = copy.deepcopy(plain)
    apply_fsdp(sharded, build_mesh(ParallelDims(), env))
    g_plain, g_sharded = _first_gradients(plain, ids), _first_gradients(sharded, ids)
    grads = max(rel_norm_err(g_sharded[n], g) for n, g in g_plain.items() if g.norm() > 0)
    a, b = _train_steps(plain, 3, ids), _train_steps(sharded, 3, ids)
    full = {n: p.full_tensor() for n, p in sharded.named_parameters()}
    start = dict(init.named_parameters())
    delta = {n: p - start[n] for n, p in plain.named_parameters()}  # what the unsharded steps did
    moved = [(n, d) for n, d in delta.items() if d.norm() > 0]
    still = [n for n, d in delta.items() if d.norm() == 0]
    res = {"fsdp_loss": max(abs(x - y) / abs(x) for x, y in zip(a, b)),
           "fsdp_weights": max(rel_err(full[n], p) for n, p in plain.named_parameters() if p.abs().max() > 0),
           "fsdp_updates": max(rel_norm_err(full[n] - start[n], d) for n, d in moved), "moved": len(moved),
           "fsdp_still": max(((full[n] - start[n]).abs().max().item() for n in still), default=0.0),
           "still": len(still), "fsdp_grads": grads, "graded": len(g_plain) == len(g_sharded)}
    bf16 = copy.deepcopy(init)
    apply_fsdp(bf16, build_mesh(ParallelDims(), env), param_dtype=torch.bfloat16)
    seen = {}
    bf16.model.layers[0].self_attn.register_forward_pre_hook(lambda m, args: seen.update(A_log=m.A_log.dtype))
    loss_bf16 = _train_steps(bf16, 1, ids)[0]
    res["bf16_islands"] = seen["A_log"] == torch.float32
    res["bf16_loss"] = abs(loss_bf16 - a[0]) / abs(a[0])  # the first step: same weights, bf16 compute
    return res


def _ep(dev: torch.device) -> dict:
    from tests.parallel.test_expert import act, case

    res = {}
    for router in ("balanced", "skewed"):
        x, idx, w, w1, w2, w3, _ = (t.to(dev) for t in case(router))
        ref = moe_experts_loop(x, idx, w, w1, w2, w3, act)
        for plan in PLANS:
            res[f"ep_{router}_{plan}"] = rel_err(ep_moe_experts(x, idx, w, w1, w2, w3, act, plan=plan), ref)
    return res


def _fla_config():
    # fla's kernels as in training: bf16 inputs and KDA heads of 64 (the fla tests' shape)
    return small_config().replace(linear_attn_config={"num_heads": 2, "head_dim": 64, "kda_layers": [1, 2],
                                                      "full_attn_layers": [3]})


def _cp(dev: torch.device) -> dict:
    config = _fla_config()
    res = {}
    for kind in cp_case.LAYERS:
        layer, x, _ = cp_case.layer_and_inputs(kind, config)
        layer, x = layer.to(dev, torch.bfloat16), x.to(dev, torch.bfloat16)
        fn = cp_case.kda_context_parallel if kind == "kda" else cp_case.mla_context_parallel
        with torch.no_grad():
            res[f"cp_{kind}"] = rel_err(fn(layer, x, cp_case.CU), cp_case.full_forward(layer, kind, x))
    return res


def _worker(rank: int, world: int, out) -> None:
    init_nccl()
    dev = torch.device("cuda", 0)
    env = DistEnv(rank, world, 0, dev)
    res = {}
    for name, part in (("fsdp", lambda: _fsdp(env, dev)), ("ep", lambda: _ep(dev)), ("cp", lambda: _cp(dev))):
        try:  # each part on its own: one failing part fails its tests only, with its traceback
            res.update(part())
        except Exception:
            res[f"{name}_error"] = traceback.format_exc()
    torch.save(res, out)


def _no_error(results: dict, part: str) -> None:
    assert f"{part}_error" not in results, results.get(f"{part}_error")


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory) -> dict:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return spawn_results(1, _worker, tmp_path_factory.mktemp("gpu"))


def test_fsdp_world_1_equals_unsharded(gpu_results):
    """The FSDP2-wrapped model at world 1 against the unsharded model: every parameter's gradient of the first step
    (relative in norm), the losses of 3 training steps (Muon), and what those steps did to each parameter (its
    update, new - initial, relative in norm).
    NOTE: not bit-equal on the GPU, and the updates are a loose check. On the H200 (twentieth session) the first
    step's gradients were equal (bitwise), its loss too, and the later losses within 2.4e-6 to 5.4e-6; two unsharded
    runs gave equal weights. After 3 steps the FSDP model's worst weight (relative to the tensor's largest) was 0.0069
    off in two processes and 0.0194 in two others (the nineteenth session's among them, where the bound on it was
    1e-2), its worst update 0.019 and 0.051 (relative norm). So the difference enters at the optimizer's steps on
    the sharded parameters (not located further; most likely Muon's Newton-Schulz, which weighs every direction of
    a gradient alike, amplifies small differences there). Muon is blind to a gradient's scale, so the gradients
    are checked before it; an update not applied (or applied twice) is off by 1 or more. The parameters the unsharded
    steps leave exactly unchanged (they get no gradient: layer 0's attention-residual norm and projection, which
    have no earlier block to weigh) must stay exactly unchanged under FSDP too (on the CPU with gloo: 2 such, moved
    by 0). That catches a write to a parameter without a gradient (a bad reshard, a re-initialisation), not a zero
    gradient in place of None (these two start at zero or take no weight decay, so Muon/AdamW leave them alone)."""
    _no_error(gpu_results, "fsdp")
    print({k: gpu_results[k] for k in ("fsdp_grads", "fsdp_loss", "fsdp_weights", "fsdp_updates", "moved",
                                         "fsdp_still", "still")})
    assert gpu_results["graded"] and gpu_results["moved"] > 0 and gpu_results["still"] > 0
    assert gpu_results["fsdp_still"] == 0
    assert gpu_results["fsdp_grads"] < 1e-3
    assert gpu_results["fsdp_loss"] < 1e-4 and gpu_results["fsdp_updates"] < 0.25


def test_fsdp_bf16_parameters_keep_the_fp32_islands(gpu_results):
    _no_error(gpu_results, "fsdp")
    assert gpu_results["bf16_islands"] and gpu_results["bf16_loss"] < 5e-2


@pytest.mark.parametrize("key", [f"ep_{r}_{p}" for r in ("balanced", "skewed") for p in PLANS])
def test_expert_parallel_world_1(gpu_results, key):
    _no_error(gpu_results, "ep")
    assert gpu_results[key] < 1e-5


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_context_parallel_world_1(gpu_results, kind):
    _no_error(gpu_results, "cp")
    assert gpu_results[f"cp_{kind}"] < 2e-2  # bf16 through fla's kernels, the fold in fp32, against the whole row


def _fla_cp_worker(rank: int, world: int, out) -> None:
    """Each rank's slice of test_context's two packed rows through fla's cp_context and through the torch fold (with
    fla's chunk kernel inside): the worst relative error over the ranks of the output, the input gradient and every
    parameter gradient."""
    import torch.distributed as dist

    from openk3.parallel.context import kda_context_parallel_fla, kda_context_parallel_torch

    init_nccl()
    dev = torch.device("cuda", rank)
    layer, x, dy = cp_case.layer_and_inputs("kda", _fla_config())
    layer, x, dy = layer.to(dev, torch.bfloat16), x.to(dev, torch.bfloat16), dy.to(dev, torch.bfloat16)
    L = x.shape[1] // world
    cols = slice(rank * L, (rank + 1) * L)
    got = {}
    for name, fn in (("fla", kda_context_parallel_fla), ("torch", kda_context_parallel_torch)):
        layer.zero_grad()
        xr = x[:, cols].clone().requires_grad_()
        y = fn(layer, xr, cp_case.CU)
        (y.float() * dy[:, cols].float()).sum().backward()
        got[name] = (y.detach(), xr.grad, {n: p.grad.clone() for n, p in layer.named_parameters()})
    (y_f, dx_f, g_f), (y_t, dx_t, g_t) = got["fla"], got["torch"]
    errs = torch.tensor([rel_err(y_f, y_t), rel_norm_err(dx_f, dx_t),
                         max(rel_norm_err(g_f[n], g_t[n]) for n in g_t)], device=dev)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)  # parameter gradients: each rank's share of the sum
    if rank == 0:
        torch.save({"y": float(errs[0]), "dx": float(errs[1]), "grads": float(errs[2]), "world": world}, out)


def test_fla_cp_context_equals_the_torch_fold(tmp_path):
    if not torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
        pytest.skip("needs CUDA and fla")
    world = 2 if torch.cuda.device_count() >= 2 else 1
    got = spawn_results(world, _fla_cp_worker, tmp_path)
    print(f"fla cp_context vs the torch fold at world {world}: {got}")
    assert got["y"] < 2e-2 and got["dx"] < 2e-2 and got["grads"] < 2e-2, got
