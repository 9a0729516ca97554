"""bf16 compute over fp32 master weights without autocast: a bf16 copy of the model runs forward and backward
(issue #11, `openk3 train --dtype bf16 --bf16-mode copy`, the default for a text model in one process).

    bf16 = BF16Compute(model)            # model: the fp32 masters (optimizer, checkpoints, QK-Clip, balancing)
    out = bf16.model(ids, labels=...)    # the bf16 copy computes
    out.loss.backward()
    bf16.accumulate_grads()              # after every micro-batch: the copy's gradients into the masters' fp32 .grad
    opt.step(); opt.zero_grad()          # the optimizer steps the masters
    bf16.refresh()                       # the masters, rounded, into the copy

Why: autocast keeps fp32 parameters and casts each weight to bf16 in every forward, inside every compiled region,
and the activations between its bf16 matmuls stay fp32. On one H200 (kimi-linear-1.5b, 8 x 2048 tokens,
bench/vs_transformers.py) the autocast recipe's compiled forward took 134 ms against 80 ms for the same model with
bf16 weights (docs/training.md). A bf16 copy makes the recipe's forward and backward the bf16-weights run's.
Measured as a whole compiled recipe step in one process: 373 ms with the copy against 380 ms under autocast (the
autocast forward's penalty came and went between steps there; docs/training.md).

What is the same as autocast: the optimizer steps fp32 masters with fp32 gradients; a matmul's weight gradient is
a bf16 product either way (autocast's cast back to fp32 does not add precision), and micro-batches accumulate in
fp32 here as there. What differs: the activations between matmuls and the norm / embedding weights are bf16
(the bf16-weights run's numerics; the release's fp32 tensors, `model.FP32_TENSORS`, stay fp32 and are shared).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from openk3.model.model import K3ForCausalLM, keeps_fp32


class BF16Compute:
    """A bf16 copy of `model` (a K3ForCausalLM with fp32 parameters, on its device) that runs the forward and
    backward, and moves gradients and weights between the two.

    Tensors that stay fp32 in a bf16 model (`keeps_fp32`: the release's fp32 tensors, the router's correction bias)
    are the SAME tensors in both: their gradients land in the masters' `.grad` directly and the balancer's bias
    updates need no copy. Every other parameter has a bf16 copy; `pairs` lists (master, copy).
    NOTE: apply activation checkpointing and torch.compile to `self.model` (the copy), not to the masters: the
    copy is what runs; build this first (compile_layers refuses a deep copy of compiled layers)."""

    def __init__(self, model: K3ForCausalLM, dtype: torch.dtype = torch.bfloat16):
        if type(model) is not K3ForCausalLM:
            raise ValueError(f"BF16Compute takes a text model (K3ForCausalLM), got {type(model).__name__}")
        if getattr(model, "_compiled_regions", None) is not None:
            raise ValueError("BF16Compute: build it before compiling; compile the copy (`.model`) instead")
        wrong = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
        if wrong:
            raise ValueError(f"BF16Compute needs fp32 master parameters; {wrong[0]} is "
                             f"{model.get_parameter(wrong[0]).dtype}")
        # the module tree is copied, the tensors are not (the memo maps each to itself): a copy then replaces the
        # parameters it computes in bf16, so the fp32 masters are never duplicated in memory
        memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
        self.model = copy.deepcopy(model, memo)
        self.masters = model
        copies: dict[int, nn.Parameter] = {}  # by id of the master: a tensor two modules share stays shared
        for module_name, module in self.model.named_modules():
            for leaf, p in module._parameters.items():
                name = f"{module_name}.{leaf}" if module_name else leaf
                if p is None or keeps_fp32(name):
                    continue
                if id(p) not in copies:
                    copies[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[leaf] = copies[id(p)]
        masters = {id(p): p for p in model.parameters()}
        self.pairs: list[tuple[Tensor, Tensor]] = [(masters[i], c) for i, c in copies.items()]

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add the copy's gradients to the masters' fp32 `.grad` (set it where it is None) and free the copy's: call
        after every backward, so micro-batches accumulate in fp32 as autocast's do."""
        add_to, add = [], []
        for m, c in self.pairs:
            if c.grad is None:
                continue
            if m.grad is None:
                m.grad = c.grad.to(m.dtype)
            else:
                add_to.append(m.grad)
                add.append(c.grad)
            c.grad = None
        if add_to:
            torch._foreach_add_(add_to, add)

    @torch.no_grad()
    def refresh(self) -> None:
        """Round the masters into the copy (after each optimizer step, QK-Clip, and after loading masters)."""
        if self.pairs:
            torch._foreach_copy_([c for _, c in self.pairs], [m for m, _ in self.pairs])


class MasterStep:
    """An optimizer over the masters seen from the copy's side, for a loop of one micro-batch a step (the benchmark,
    `GraphedStep`): `step()` moves the copy's gradients into the masters, steps `opt` (built over the masters) and
    rounds the masters back into the copy. The trainer calls the three itself: it accumulates after every
    micro-batch and applies QK-Clip and the balancer before the refresh."""

    def __init__(self, bf16: BF16Compute, opt):
        self.bf16, self.opt = bf16, opt  # `opt`: the name graphed.make_capturable looks for

    def step(self) -> None:
        self.bf16.accumulate_grads()
        self.opt.step()
        self.bf16.refresh()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)
