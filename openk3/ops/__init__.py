"""Kernels next to their references. Backends are chosen here, once per (device type, dtype), with a
reason that `openk3 info --backends` prints; call sites never try/except.

- KDA: `select_kda_backend(device)` (fla on CUDA when installed, else the chunked PyTorch version;
  env OPENK3_KDA_BACKEND=naive|torch|fla overrides).
- MoE experts: `torch._grouped_mm` when it runs on the device and dtype, else the per-expert loop
  (env OPENK3_MOE_BACKEND=grouped|loop overrides; asking for `grouped` where it cannot run is an error).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from openk3.ops.kda import KDABackend, select_kda_backend
from openk3.ops.moe import grouped_mm_supported, moe_experts_grouped, moe_experts_loop

__all__ = ["KDABackend", "MoEBackend", "moe_experts", "select_kda_backend", "select_moe_backend"]


@dataclass(frozen=True)
class MoEBackend:
    name: str
    reason: str
    fn: object


_CHOSEN: dict[tuple, MoEBackend] = {}  # what moe_experts has looked up so far (see the NOTE there)


@functools.cache
def select_moe_backend(device_type: str, dtype: torch.dtype) -> MoEBackend:
    requested = os.environ.get("OPENK3_MOE_BACKEND")
    if requested not in (None, "", "grouped", "loop"):
        raise ValueError(f"OPENK3_MOE_BACKEND={requested!r}: expected 'grouped' or 'loop'")
    ok, why = grouped_mm_supported(torch.device(device_type), dtype)
    if requested == "loop":
        return MoEBackend("loop", "OPENK3_MOE_BACKEND=loop", moe_experts_loop)
    if requested == "grouped" and not ok:
        raise RuntimeError(f"OPENK3_MOE_BACKEND=grouped but grouped matmuls cannot run here: {why}")
    if ok:
        return MoEBackend("grouped", why, moe_experts_grouped)
    return MoEBackend("loop", why, moe_experts_loop)


def moe_experts(x_TD: Tensor, topk_idx_TK: Tensor, topk_w_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor,
                w3_EFD: Tensor, act, weight_fn=None) -> Tensor:
    """Routed experts through the backend chosen for this device and dtype (see `select_moe_backend`)."""
    # NOTE: a plain dict lookup first: dynamo traces the body of the functools.cache'd select_moe_backend (and its
    # CUDA capability query) on every call from a compiled layer (train/compile.py); a dict lookup traces to a constant
    key = (x_TD.device.type, x_TD.dtype)
    backend = _CHOSEN.get(key)
    if backend is None:
        backend = _CHOSEN[key] = select_moe_backend(*key)
    if backend.fn is moe_experts_grouped and x_TD.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        # NOTE: torch.compile traces torch._grouped_mm in bf16 only (ops/moe.py); a compiled fp32 model (the CPU's,
        # train/compile.py) runs the same grouped kernel outside the graph (a graph break), not a different backend
        return _grouped_outside_graph(x_TD, topk_idx_TK, topk_w_TK, w1_EFD, w2_EDF, w3_EFD, act, weight_fn=weight_fn)
    return backend.fn(x_TD, topk_idx_TK, topk_w_TK, w1_EFD, w2_EDF, w3_EFD, act, weight_fn=weight_fn)


_grouped_outside_graph = torch.compiler.disable(moe_experts_grouped)
