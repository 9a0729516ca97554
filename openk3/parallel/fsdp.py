"""FSDP2 and activation checkpointing, applied from outside the single-device model (torchtitan's order).

    apply_activation_checkpointing(model)            # optional, first: it wraps modules FSDP then shards
    apply_fsdp(model, mesh, param_dtype=None)        # fully_shard each decoder layer, then the root

Sharding units: every `DecoderLayer` is one FSDP group (its parameters are all-gathered just before its forward and
freed after it, and again for its backward); the root group holds what is left: the embedding, the final norm,
lm_head and the AttnRes output vectors. Keeping the embedding and lm_head in the root (not in groups of their own)
is deliberate: `K3ForCausalLM.forward` reads `lm_head.weight` directly (its dtype, and the chunked loss), which is
only a plain unsharded tensor inside the forward of the group that owns it.

Mixed precision (`param_dtype=torch.bfloat16`): parameters are all-gathered in bf16 for compute while the sharded
fp32 parameters stay the optimizer's masters and gradients are reduce-scattered in fp32 (`reduce_dtype`). The
tensors the release keeps in fp32 (model.FP32_TENSORS: KDA A_log, dt_bias, conv filters, o_norm) stay fp32: each
KDA mixer is its own fp32 group with its linear projections in nested bf16 groups. The fp32 residual stream is
never cast (cast_forward_inputs=False): the model casts to the compute dtype where it means to.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_module
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from openk3.model.model import K3ForCausalLM, KimiDeltaAttention


def apply_activation_checkpointing(model: K3ForCausalLM) -> None:
    """Recompute every token mixer (KDA / MLA) and dense MLP in backward instead of keeping its activations.

    NOTE: the MoE blocks are not checkpointed: their forward appends router records (scores, choices) to the
    forward's lists, and a recompute in backward would append them a second time."""
    for layer in model.model.layers:
        checkpoint_module(layer.self_attn)
        if hasattr(layer, "mlp"):
            checkpoint_module(layer.mlp)


def apply_fsdp(model: K3ForCausalLM, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True, ignored_params: set | None = None) -> K3ForCausalLM:
    """Shard `model` in place over the 1-D `mesh` (FSDP2): one group per decoder layer, then the root. Returns it.

    param_dtype: None = compute in the parameters' own dtype (fp32 on the CPU: bit-comparable with one process);
    torch.bfloat16 = bf16 compute with fp32 masters and fp32 gradient reduction (see the module docstring).
    reshard_after_forward: free each layer's gathered parameters after its forward (ZeRO-3) or keep them until
    backward (ZeRO-2, less communication, more memory).
    ignored_params: parameters FSDP leaves alone (the expert-parallel experts, already split by expert)."""
    # NOTE: FSDP2 warns that a decoder layer returns a view (the AttnRes bank carries the embedding output on): an
    # in-place op on it would skip the pre-backward all-gather. The model never changes its outputs in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    keep_fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                     cast_forward_inputs=False)
    for layer in model.model.layers:
        attn = layer.self_attn
        if param_dtype not in (None, torch.float32) and isinstance(attn, KimiDeltaAttention):
            for child in attn.children():
                if isinstance(child, nn.Linear):
                    fully_shard(child, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
            fully_shard(attn, mesh=mesh, mp_policy=keep_fp32, reshard_after_forward=reshard_after_forward)
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored_params)
    # the root's parameters are needed again right at the end of backward: no point resharding them after forward
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False, ignored_params=ignored_params)
    return model


@torch.no_grad()
def clip_grad_norm_sharded_(params, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ for gradients that are DTensors on different meshes (FSDP's on the dp mesh,
    the expert-parallel experts' on the ("dp_rep", "ep") mesh): each gradient's squared norm is summed over the mesh
    dimensions it is sharded on (one all-reduce per kind of layout), never over those it is replicated on.
    Returns the total norm before clipping."""
    buckets: dict = {}
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        local, key = g, None
        if isinstance(g, DTensor):
            local = g.to_local()
            key = (id(g.device_mesh), tuple(i for i, pl in enumerate(g.placements) if pl.is_shard()))
            buckets.setdefault(key, [g.device_mesh, []])
        else:
            buckets.setdefault(key, [None, []])
        buckets[key][1].append(torch.linalg.vector_norm(local.float()) ** 2)
    total_sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for key, (mesh, squares) in buckets.items():
        s = torch.stack(squares).sum()
        for dim in (key[1] if key is not None else ()):
            torch.distributed.all_reduce(s, group=mesh.get_group(dim))
        total_sq = total_sq + s.to(total_sq.device)
    total = total_sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.device))
    return float(total)
