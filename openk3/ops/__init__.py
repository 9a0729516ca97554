"""Kernels next to their references. Backends are chosen here, once per (device type, dtype), with a
reason that `openk3 info --backends` prints; call sites never try/except.

- KDA: `select_kda_backend(device)` (fla on CUDA when installed, else the chunked PyTorch version;
  env OPENK3_KDA_BACKEND=naive|torch|fla overrides).
- MoE experts: `torch._grouped_mm` when it runs on the device and dtype, else the per-expert loop
  (env OPENK3_MOE_BACKEND=grouped|loop overrides; asking for `grouped` where it cannot run is an error).
  On top of either, decode-sized forwards (T*K <= moe_gemv.GEMV_MAX_SLOTS slots, no grad) run the Triton GEMV
  kernels of moe_gemv.py where they run (CUDA with triton installed), forwards of up to
  moe_by_expert.BY_EXPERT_MAX_SLOTS slots its by-expert kernels (moe_by_expert.py), and the grouped backend's other
  forwards without grad end in moe_gemv's `combine_slots` kernel; env OPENK3_MOE_GEMV=0 turns all three off (the
  old path, for comparison), =1 makes it an error when they cannot run. At the call (`moe_experts`) three tests
  remain: those size tests, whether a gradient is needed, and, inside torch.compile, whether a non-bf16 grouped
  matmul must run outside the graph.
- CUDA graphs: `graph_capture`, torch.cuda.graph with Python's cyclic garbage collector paused (why: its docstring).
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from openk3.ops.kda import KDABackend, select_kda_backend
from openk3.ops.moe import grouped_mm_supported, moe_experts_grouped, moe_experts_loop
from openk3.ops.moe_by_expert import BY_EXPERT_MAX_SLOTS, by_expert_applies, moe_experts_by_expert
from openk3.ops.moe_gemv import gemv_applies, gemv_supported, moe_experts_gemv, moe_experts_grouped_combined, needs_grad

__all__ = ["KDABackend", "MoEBackend", "forget_moe_backends", "graph_capture", "moe_experts", "select_kda_backend",
           "select_moe_backend"]


@contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool=None):
    """`torch.cuda.graph(graph, pool=pool)` with Python's cyclic garbage collector paused for the capture.
    NOTE: torch no longer collects before a capture (`torch.compiler.config.force_cudagraph_gc`, off by default), so
    an automatic collection could run inside one. If it frees a dead CUDA graph (an engine dropped in a reference
    cycle), the graph's destruction is a CUDA call that a global-mode capture forbids: the capture is invalidated
    and the op being captured fails (an fp32 Linear's `CUBLAS_STATUS_EXECUTION_FAILED` on the H200, with torch's
    warning "operation not permitted when stream is capturing" from CUDAGraph's reset; docs/engine.md). Collection
    resumes after the capture, so the cycle is freed then."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield graph
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class MoEBackend:
    """`fn` runs every call but the decode-sized ones that `small` (None = none) takes, the somewhat larger ones that
    `by_expert` takes and, where `inference` is not None, those that need no gradient: see `moe_experts`."""

    name: str
    reason: str
    fn: object
    small: object = None
    by_expert: object = None
    inference: object = None


MOE_ENV, GEMV_ENV = "OPENK3_MOE_BACKEND", "OPENK3_MOE_GEMV"

# NOTE: the backends chosen so far, the one cache of `_select`: a plain dict, not functools.cache, because
# moe_experts runs inside compiled layers (train/compile.py, the compiled decode step) and dynamo traces the body of a
# functools.cache'd function (its CUDA capability query) on every call; a dict lookup it traces to a constant.
_CHOSEN: dict[tuple, MoEBackend] = {}


def forget_moe_backends() -> None:
    """Choose again on the next call (tests that replace the choice)."""
    _CHOSEN.clear()


def select_moe_backend(device_type: str, dtype: torch.dtype) -> MoEBackend:
    """The MoE backend for this device type and dtype under the environment's overrides (module docstring)."""
    key = (device_type, dtype, os.environ.get(MOE_ENV), os.environ.get(GEMV_ENV))
    backend = _CHOSEN.get(key)
    if backend is None:
        backend = _CHOSEN[key] = _select(*key)
    return backend


def _select(device_type: str, dtype: torch.dtype, requested: str | None, gemv_requested: str | None) -> MoEBackend:
    if requested not in (None, "", "grouped", "loop"):
        raise ValueError(f"{MOE_ENV}={requested!r}: expected 'grouped' or 'loop'")
    if gemv_requested not in (None, "", "0", "1"):
        raise ValueError(f"{GEMV_ENV}={gemv_requested!r}: expected '0' (off) or '1' (required)")
    ok, why = grouped_mm_supported(torch.device(device_type), dtype)
    if requested == "loop":
        name, reason, fn = "loop", f"{MOE_ENV}=loop", moe_experts_loop
    elif requested == "grouped" and not ok:
        raise RuntimeError(f"{MOE_ENV}=grouped but grouped matmuls cannot run here: {why}")
    elif ok:
        name, reason, fn = "grouped", why, moe_experts_grouped
    else:
        name, reason, fn = "loop", why, moe_experts_loop
    gemv_ok, gemv_why = gemv_supported(torch.device(device_type), dtype)
    if gemv_requested == "0":
        return MoEBackend(name, f"{reason}; {GEMV_ENV}=0: no GEMV path", fn)
    if gemv_requested == "1" and not gemv_ok:
        raise RuntimeError(f"{GEMV_ENV}=1 but the GEMV kernels cannot run here: {gemv_why}")
    by_expert_why = f"calls of up to {BY_EXPERT_MAX_SLOTS} slots without grad run the by-expert Triton kernels"
    if gemv_ok and fn is moe_experts_grouped:
        return MoEBackend(name, f"{reason}; {gemv_why}; {by_expert_why}; other calls without grad sum the expert "
                                "outputs back to their tokens in one Triton kernel", fn, small=moe_experts_gemv,
                          by_expert=moe_experts_by_expert, inference=moe_experts_grouped_combined)
    if gemv_ok:
        return MoEBackend(name, f"{reason}; {gemv_why}; {by_expert_why}", fn, small=moe_experts_gemv,
                          by_expert=moe_experts_by_expert)
    return MoEBackend(name, f"{reason}; no GEMV path: {gemv_why}", fn)


def moe_experts(x_TD: Tensor, topk_idx_TK: Tensor, topk_w_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor,
                w3_EFD: Tensor, act, weight_fn=None) -> Tensor:
    """Routed experts through the backend chosen for this device and dtype (see `select_moe_backend`); a
    decode-sized forward (`moe_gemv.gemv_applies`) through its GEMV kernels where it has them, a somewhat larger one
    (`moe_by_expert.by_expert_applies`) through its by-expert kernels, another forward without grad through
    `backend.inference` where there is one."""
    backend = select_moe_backend(x_TD.device.type, x_TD.dtype)
    args = (x_TD, topk_idx_TK, topk_w_TK, w1_EFD, w2_EDF, w3_EFD, act)
    kernel = small_experts_kernel(*args, weight_fn=weight_fn)
    if kernel is not None:
        return kernel(*args)
    if backend.fn is moe_experts_grouped and x_TD.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        # NOTE: torch.compile traces torch._grouped_mm in bf16 only (ops/moe.py); a compiled fp32 model (the CPU's,
        # train/compile.py) runs the same grouped kernel outside the graph (a graph break), not a different backend
        return _grouped_outside_graph(*args, weight_fn=weight_fn)
    if backend.inference is not None and not needs_grad(x_TD, topk_w_TK, w1_EFD, w2_EDF, w3_EFD):
        return backend.inference(*args, weight_fn=weight_fn)
    return backend.fn(*args, weight_fn=weight_fn)


def small_experts_kernel(x_TD: Tensor, topk_idx_TK: Tensor, topk_w_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor,
                         w3_EFD: Tensor, act, weight_fn=None):
    """The kernel `moe_experts` runs these arguments through where it is one of the backend's decode-sized ones
    (`backend.small`: the GEMV kernels, or `backend.by_expert`), else None; both take a `shared` expert (model.py
    `MoE.experts_with_shared`). Shapes and flags only: no sync."""
    backend = select_moe_backend(x_TD.device.type, x_TD.dtype)
    args = (x_TD, topk_idx_TK, topk_w_TK, w1_EFD, w2_EDF, w3_EFD, act)
    if backend.small is not None and gemv_applies(*args, weight_fn=weight_fn):
        return backend.small
    if backend.by_expert is not None and by_expert_applies(*args, weight_fn=weight_fn):
        return backend.by_expert
    return None


_grouped_outside_graph = torch.compiler.disable(moe_experts_grouped)
