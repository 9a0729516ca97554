"""Regional torch.compile of a K3 model for training, applied from outside the single-device model (issue #11).

    compile_layers(model, backend="inductor")    # after activation checkpointing, before FSDP (torchtitan's order)

What is compiled: every `DecoderLayer`'s forward (its norms and their bf16 <-> fp32 casts, the residual and AttnRes
adds and mixes, the router's sigmoid / top-k / gather, the MoE's sort / gather / scatter, MLA's cat / expand and
the sigmoid gates: the elementwise chains a profile of the eager bf16 step on the H200 spends most of its time in,
docs/training.md), and `K3ForCausalLM.head`: the final norm, lm_head and the fp32 cross-entropy, the chunked one too.
The embedding and the layer loop stay eager.

How (each choice is checked on the CPU by tests/train/test_compile.py):
- Each region's `forward` (`head`) is replaced by its compiled form as an attribute of the module instance, not by
  wrapping the module: parameter and state_dict names stay the same (no `_orig_mod.`), and module hooks (FSDP2's,
  which `fully_shard` adds after this) still run eagerly around the compiled code.
- `fullgraph=False`: the KDA kernels (fla's, or the CPU's chunked reference) of a forward without a cache run
  outside the graphs (`model.outside_graph`), as do the router records (`ForwardContext.add_router`) and, in fp32,
  the grouped MoE matmul (torch.compile traces torch._grouped_mm in bf16 only: `ops.moe_experts`); each is a graph
  break.
- `dynamic=None` (not False): a region compiles for the shapes it first sees, and when one changes (a packed batch's
  number of documents, its longest document on CUDA, a --seq-len-schedule phase) compiles once more with that size
  symbolic. NOTE: dynamic=False would compile again for every new packing.
- The code of all layers is one function (`DecoderLayer.forward`), so its compiled graphs share one cache (with
  every other model of the process): layers that differ in what dynamo guards on (KDA or MLA, dense or MoE, the
  AttnRes bank's length and block start) get a graph each, layers that do not share one. Counted on narrow
  stand-ins with the presets' 16-layer structure (docs/training.md): `kimi-linear-1.5b`'s compiles 12 graphs in
  all, `k3-1.5b`'s (Block AttnRes) up to one variant of `DecoderLayer.forward` per layer. The recompile limit is
  raised to cover the layers (`compile_layers`): with torch's default (8) the function would run eagerly past it.
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from openk3.model.model import K3ForCausalLM

BACKENDS = ("inductor", "aot_eager", "eager")


def compile_layers(model: K3ForCausalLM, backend: str = "inductor", *, dynamic: bool | None = None,
                   fullgraph: bool = False) -> dict:
    """torch.compile every decoder layer's forward and the model's `head` (final norm + lm_head + loss), in place.

    backend: "inductor" (fused kernels; needs a C++ compiler on the CPU, Triton on CUDA), "aot_eager" (traces forward
    and backward through AOTAutograd without generating code: checks the graphs, fuses nothing) or "eager".
    Returns {"regions": number of compiled regions, "recompile_limit": the limit now in force}. Calling it twice on
    the same model is an error (the second would compile the compiled forwards).
    NOTE: the compiled forwards are bound to these module instances: a copy.deepcopy of the compiled model would run
    the original's modules. Copy first, then compile each copy."""
    if backend not in BACKENDS:
        raise ValueError(f"compile backend {backend!r}: expected one of {BACKENDS}")
    layers = list(model.model.layers)
    if getattr(model, "_compiled_regions", None) is not None:
        raise ValueError("compile_layers: this model's layers are compiled already")
    options = dict(backend=backend, dynamic=dynamic, fullgraph=fullgraph)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, **options)
    model.head = torch.compile(model.head, **options)
    # NOTE: the limit counts compiled variants per function (all layers share DecoderLayer.forward's), and a change
    # of shape can add a dynamic variant of each: two per layer covers every layer being different. A global
    # setting (torch has no per-function one); raised, never lowered.
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(layers) + 2)
    torch._dynamo.config.recompile_limit = limit
    model._compiled_regions = len(layers) + 1
    return {"regions": model._compiled_regions, "recompile_limit": limit}


def compiled_graphs() -> int:
    """The number of graphs dynamo has compiled in this process so far (all functions; a recompile adds one): read it
    before and after a step to see whether that step compiled anything."""
    return counters["stats"]["unique_graphs"]
