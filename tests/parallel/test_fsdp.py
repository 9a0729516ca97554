"""Activation checkpointing applied from outside changes memory, not math: bit-equal loss, router records and
gradients on the CPU."""

import torch

from openk3.model.model import K3ForCausalLM
from openk3.parallel.fsdp import apply_activation_checkpointing
from tests.train.test_train import small_config


def loss_and_grads(model: K3ForCausalLM, ids: torch.Tensor, cu: torch.Tensor):
    out = model(ids, labels=ids.roll(-1, 1), cu_seqlens=cu, record=True)
    out.loss.backward()
    return out.loss.detach(), out.router, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_is_exact():
    config = small_config()
    plain = K3ForCausalLM(config)
    plain.reset_parameters(seed=1)
    wrapped = K3ForCausalLM(config)
    wrapped.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(wrapped)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]  # names kept
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 23))
    cu = torch.tensor([0, 9, 23, 30, 46])
    calls = []
    for model in (plain, wrapped):  # count the KDA projections of layer 0: a recompute calls them again
        attn = model.model.layers[0].self_attn
        attn.qkv_proj = (lambda f, tag: lambda x: calls.append(tag) or f(x))(attn.qkv_proj, model is wrapped)
    loss_a, router_a, grads_a = loss_and_grads(plain, ids, cu)
    loss_b, router_b, grads_b = loss_and_grads(wrapped, ids, cu)
    assert calls.count(False) == 1 and calls.count(True) == 2
    assert torch.equal(loss_a, loss_b)
    assert len(router_a) == len(router_b)  # the MoE is not recomputed: its records are not doubled
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
