"""Horizontal fusion of the input projections, for inference (issue #12; docs/engine.md "Fused input projections").

A batch-1 decode step on the GPU is bound by kernel launches: every projection that reads the same input is its own
GEMV of a few MB. This stacks, per module, the weights of the Linear submodules that read one input, so that the
module computes them with one matmul and a split (`model.fused_outputs`):

    KimiDeltaAttention  q_proj | k_proj | v_proj (key "qkv"), f_a_proj, b_proj, g_a_proj (g_proj with a full-rank gate)
    GatedMLA            q_a_proj (or q_proj), kv_a_proj_with_mqa, g_proj (with the output gate)
    MoE (LatentMoE)     routed_expert_down_proj, shared_experts.gate_proj, shared_experts.up_proj
    MLP                 gate_proj, up_proj (dense layers; a plain MoE's shared experts)

The router stays separate (fp32 by design), and so do the projections of other inputs (f_b_proj, g_b_proj, q_b_proj,
kv_b_proj, the output projections).

    fused = fuse_projections(model)   # allocates every stacked weight once and attaches it, inactive
    with fused.applied():             # around every forward that may use them: refresh, then active
        model(ids, cache=cache)       # (outside autograd: under autograd the modules run)
    fused.unfuse()                    # detaches them

NOTE: the stacked weights are COPIES: they cost the size of those weights again (kimi-linear-1.5b: 176.8e6 elements
in 32 stacks, 337 MiB in bf16, 11.9% of its 1.49e9 parameters; `FusedProjections.numel`). Copies rather than
parameters that are views into one stacked tensor, so that training (FSDP2, the optimizer, checkpoints) sees exactly
the modules' own parameters. The engine shares its model with RL training, where the optimizer updates the weights in
place between engine steps, and a CUDA graph captured once replays reading a stack's address; so `refresh` copies
INTO the same tensor, for each stack whose sources' (data_ptr, _version) changed (the `Experts.on_mxfp4_grid`
idiom): a `load_state_dict`, an optimizer step or any in-place write under no_grad bumps `_version`. NOTE: a write
through `p.data` (`p.data.add_(...)`) does not: `.data` has a version counter of its own; `refresh(force=True)`
after one. The stacks are read only inside `applied()` (which refreshes them first) and outside autograd
(`torch.is_grad_enabled()` False): any other forward of the model, and every forward under autograd, runs the
modules, so it never reads a copy that may be stale, and gradients reach the parameters as without fusion.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from openk3.model.model import MLP, FusedLinears, GatedMLA, KimiDeltaAttention, MoE


def fusable_parts(module: nn.Module) -> list[tuple[str, list[nn.Linear]]]:
    """The (key, Linear modules stacked for it) of the input projections `module` computes in one matmul, in the
    stacked weight's order; [] for a module with nothing to fuse (fewer than two of them)."""
    if isinstance(module, KimiDeltaAttention):
        gate = "g_proj" if module.full_rank_gate else "g_a_proj"
        parts = [("qkv", [module.q_proj, module.k_proj, module.v_proj]), ("f_a_proj", [module.f_a_proj]),
                 ("b_proj", [module.b_proj]), (gate, [getattr(module, gate)])]
    elif isinstance(module, GatedMLA):
        q = "q_a_proj" if hasattr(module, "q_a_proj") else "q_proj"
        parts = [(q, [getattr(module, q)]), ("kv_a_proj_with_mqa", [module.kv_a_proj_with_mqa])]
        if module.use_gate:
            parts.append(("g_proj", [module.g_proj]))
    elif isinstance(module, MoE) and module.latent:
        parts = [("routed_expert_down_proj", [module.routed_expert_down_proj])]
        if hasattr(module, "shared_experts"):
            shared = module.shared_experts
            parts += [("gate_proj", [shared.gate_proj]), ("up_proj", [shared.up_proj])]
    elif isinstance(module, MLP):
        parts = [("gate_proj", [module.gate_proj]), ("up_proj", [module.up_proj])]
    else:
        return []
    return parts if len(parts) > 1 else []


@dataclass
class FusedStack(FusedLinears):
    """One module's stacked weight (what the module reads, `FusedLinears`) and the Linear modules whose weights it
    copies, in order. NOTE: the weights are read from the modules at every refresh, so a parameter replaced by
    another tensor (`load_state_dict(assign=True)`, `.data =`) is followed too."""

    linears: list[nn.Linear] = field(default_factory=list)
    key: tuple | None = None  # the sources' (data_ptr, _version) at the last copy

    def sources(self) -> list[Tensor]:
        # NOTE: `_parameters` rather than `lin.weight`: nn.Module's __getattr__ costs ~0.8 us a call on this CPU,
        # and refresh reads every source before every forward (kimi-linear-1.5b: 147 weights; docs/engine.md)
        return [lin._parameters["weight"] for lin in self.linears]

    def source_key(self) -> tuple:
        """A new dtype or device is a new tensor, so a new data_ptr: (data_ptr, _version) sees every change that
        (data_ptr, _version, dtype, device) would, at half the cost (`refresh` checks dtype and device when it
        copies)."""
        return tuple((w.data_ptr(), w._version) for w in self.sources())


@dataclass
class FusedProjections:
    """The stacked weights `fuse_projections` attached to one model's modules (module docstring)."""

    stacks: list[tuple[nn.Module, FusedStack]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements held by the copies (their memory cost, in the model's dtype), each stack counted once."""
        return sum(s.weight.numel() for s in {id(s): s for _, s in self.stacks}.values())

    @torch.no_grad()
    def refresh(self, force: bool = False) -> int:
        """Copy the source weights into every stack whose sources changed since its last copy (all with `force`),
        into the same tensor (a captured CUDA graph reads its address). Python only when nothing changed. Run it
        outside any CUDA graph replay or compiled region. -> how many stacks were copied."""
        copied = 0
        for _, stack in self.stacks:
            key = stack.source_key()
            if key == stack.key and not force:
                continue
            buf, sources = stack.weight, stack.sources()
            for w in sources:
                if w.dtype != buf.dtype or w.device != buf.device:
                    raise RuntimeError(f"a fused weight's source became {w.dtype} on {w.device} (the copy is "
                                       f"{buf.dtype} on {buf.device}): unfuse and fuse the model again after a cast")
            torch.cat(sources, dim=0, out=buf)
            stack.key = key
            copied += 1
        return copied

    @contextmanager
    def applied(self):
        """Within this block the modules read their stacks (outside autograd), refreshed at its start. Enter it
        outside any CUDA graph replay or compiled region; a graph captured inside it replays the stacks' addresses."""
        self.refresh()
        for _, stack in self.stacks:
            stack.active = True
        try:
            yield self
        finally:
            for _, stack in self.stacks:
                stack.active = False

    def unfuse(self) -> None:
        """Detach every stacked weight from its module: the modules compute their projections one by one again.
        NOTE: a CUDA graph captured over the stacks still replays reading their addresses, freed once nothing else
        holds them: forget such graphs (`StaticDecoder.forget_graphs`) first; the engine itself never unfuses."""
        for module, stack in self.stacks:
            if getattr(module, "fused_linears", None) is stack:
                del module.fused_linears
        self.stacks = []


def applied(fused: FusedProjections | None):
    """`fused.applied()`, or a no-op context for a model that is not fused (None)."""
    return fused.applied() if fused is not None else nullcontext()


def fuse_projections(model: nn.Module) -> FusedProjections:
    """Attach a stacked copy of the input projections to every module of `model` that has some (`fusable_parts`),
    allocated once and filled by a first `refresh`, inactive until `applied()`. A module fused before (a draft model
    that shares the target's modules) keeps its stack, which both fusions then refresh (the second finds it
    current): fusing twice is harmless; after a cast or a move of the model it gets a new one. The model must not be sharded (FSDP/TP): the copies are whole tensors."""
    fp = FusedProjections()
    # a LatentMoE's shared experts are stacked with its down projection, not on their own
    in_moe = {id(m.shared_experts) for m in model.modules() if isinstance(m, MoE) and fusable_parts(m)
              and hasattr(m, "shared_experts")}
    for module in model.modules():
        parts = fusable_parts(module) if id(module) not in in_moe else []
        if not parts:
            continue
        linears = [lin for _, lins in parts for lin in lins]
        if any(lin.weight.is_inference() for lin in linears):
            raise ValueError(f"fuse_projections: the weights of {type(module).__name__} are inference tensors (the "
                             "model was built or loaded under torch.inference_mode), which keep no version counter "
                             "to refresh the copies by: build the model outside inference_mode, or pass "
                             "EngineConfig(fuse_projections=False)")
        stack, first = getattr(module, "fused_linears", None), linears[0].weight
        # NOTE: a stack left by an earlier fusion is reused only while it can hold the weights: after a cast or a
        # move (which the earlier fusion's refresh refuses) this fusion gets a stack of its own
        if not (isinstance(stack, FusedStack) and stack.linears == linears and stack.weight.dtype == first.dtype
                and stack.weight.device == first.device):
            # NOTE: a normal tensor even when called under inference_mode: refresh writes into it in place, which an
            # inference tensor refuses outside inference mode
            with torch.inference_mode(False):
                weight = torch.empty(sum(lin.weight.shape[0] for lin in linears), first.shape[1], dtype=first.dtype,
                                     device=first.device)
            sizes = tuple(sum(lin.weight.shape[0] for lin in lins) for _, lins in parts)
            stack = FusedStack(tuple(k for k, _ in parts), sizes, weight, linears=linears)
        fp.stacks.append((module, stack))
        module.fused_linears = stack
    fp.refresh()
    return fp
