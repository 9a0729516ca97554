"""The CUDA-graph training step (train/graphed.py, issue #11): replays equal eager steps; the optimizers it needs are
made capturable."""

import copy

import pytest
import torch

from openk3.model import K3ForCausalLM
from openk3.train.graphed import GraphedStep, make_capturable
from openk3.train.optim import build_optimizer, model_head_dims
from openk3.train.precision import BF16Compute, MasterStep

from .test_train import small_config


def test_make_capturable_reaches_adamw_inside_muon_adamw_and_wrappers():
    model = K3ForCausalLM(small_config())
    opt = build_optimizer(model, lr=1e-3, head_dims=model_head_dims(model.config))
    adamw = opt._by_name["adamw"]
    assert not any(g["capturable"] for g in adamw.param_groups)

    make_capturable(MasterStep(BF16Compute(model), opt))  # the wrapper holds the optimizer as `.opt`
    assert all(g["capturable"] for g in adamw.param_groups)
    assert all("capturable" not in g for g in opt._by_name["muon"].param_groups)  # Muon: nothing to switch


def _steps(model, runs, opt, ids, labels, n, graphed, before_step=None):
    def whole_step():
        loss = runs(ids, labels=labels, validate=False).loss
        loss.backward()
        opt.step()
        return loss
    if not graphed:
        losses = []
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            losses.append(float(whole_step().detach()))
        return losses
    make_capturable(opt)
    # one warm-up step (a real one; the capture only records), then n - 1 replays: n steps in all
    graph = GraphedStep(whole_step, lambda: opt.zero_grad(set_to_none=True), warmup=1)
    return [float(graph.replay()) for _ in range(n - 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", [False, True])
def test_graph_replays_equal_eager_steps(recipe):
    """6 steps eager against 1 warm-up step + 5 replays, from the same weights: the same losses and weights
    within bf16 run-to-run noise (the MoE's backward adds with atomics). recipe: fp32 masters, a bf16 copy, Muon +
    AdamW (train/precision.py); else bf16 weights and fused AdamW."""
    torch.manual_seed(0)
    base = K3ForCausalLM(small_config().replace(vocab_size=512)).cuda()
    base.reset_parameters(seed=0)
    if not recipe:
        base.cast(torch.bfloat16)
    g = torch.Generator("cuda").manual_seed(1)
    ids = torch.randint(0, 512, (2, 64), device="cuda", generator=g)
    labels = ids.roll(-1, 1)
    results = []
    for graphed in (False, True):
        model = copy.deepcopy(base)
        if recipe:
            bf16 = BF16Compute(model)
            runs = bf16.model
            opt = MasterStep(bf16, build_optimizer(model, lr=1e-3, head_dims=model_head_dims(model.config)))
        else:
            runs = model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        losses = _steps(model, runs, opt, ids, labels, 6, graphed)
        results.append((losses, model))
    (eager_losses, eager), (graph_losses, graphed) = results
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses[1:]), rtol=2e-3, atol=2e-3)
    for (name, a), b in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-3, msg=name)
    assert graph_losses[-1] < graph_losses[0]  # it trained: the replays update the weights
