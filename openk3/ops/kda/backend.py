"""Which KDA implementation runs: chosen once per device type, with a reason that can be printed.

    naive  the fp32 loop of naive.py for both prefill and decode (slow; for checking)
    torch  chunk_kda_torch for prefill/training, the naive loop for decode (a few tokens)
    fla    flash-linear-attention's Triton kernels (chunk_kda, fused_recurrent_kda); CUDA only

Default: fla when the device is CUDA and `fla.ops.kda` imports, else torch. The environment
variable OPENK3_KDA_BACKEND (naive | torch | fla) overrides it; asking for fla where it cannot
run is an error, never a quiet fallback. With fla, the KDA layer also runs its conv, gate and output norm in fla's
kernels (ops/kda/fused.py; from a cache over few tokens, fla's token-by-token kernel with the gate inside), and every
inference RMSNorm of the model is fla's one-kernel norm; OPENK3_KDA_FUSED=0 keeps the reference chains around fla's
chunk_kda and fused_recurrent_kda, and the norms in PyTorch.

Every `chunk` and `recurrent` function takes the same arguments as `naive_recurrent_kda`:
(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
use_qk_l2norm_in_kernel=False, cu_seqlens=None) -> (o in q's dtype, final state [N, H, K, V] fp32).
"""

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from openk3.ops.kda.chunk import chunk_kda_torch
from openk3.ops.kda.naive import check_kda_inputs, naive_recurrent_kda
from openk3.ops.kda.tuned import autotune_candidates, limit_fla_autotuning, use_shipped_fla_configs

BACKEND_ENV = "OPENK3_KDA_BACKEND"
FUSED_ENV = "OPENK3_KDA_FUSED"
BACKEND_NAMES = ("naive", "torch", "fla")


@dataclass(frozen=True)
class KDABackend:
    """A KDA implementation: `chunk` for prefill and training, `recurrent` for decoding."""

    name: str
    reason: str
    chunk: Callable[..., tuple[Tensor, Tensor | None]]
    recurrent: Callable[..., tuple[Tensor, Tensor | None]]
    # the KDA layer runs its elementwise chains inside fla's kernels too (ops/kda/fused.py) when it has no cache;
    # fla only, on unless OPENK3_KDA_FUSED=0 (which keeps the reference chains around fla's chunk_kda)
    fused: bool = False

    def __str__(self) -> str:
        return f"KDA backend '{self.name}': {self.reason}"


# NOTE: the backends chosen so far, looked up before `_select`: a compiled decode step (serve/static.py) calls
# select_kda_backend in every KDA layer, and dynamo traces the body of a functools.cache'd function, whose CUDA branch
# imports fla (a graph break per call); a plain dict lookup it traces to the constant object.
_CHOSEN: dict[tuple, "KDABackend"] = {}


def select_kda_backend(device: torch.device | str) -> KDABackend:
    """The KDA backend for `device`, honouring OPENK3_KDA_BACKEND; see the module docstring."""
    requested = os.environ.get(BACKEND_ENV, "").strip().lower() or None
    fused = os.environ.get(FUSED_ENV, "1").strip()
    if fused not in ("0", "1"):
        raise ValueError(f"{FUSED_ENV}={fused!r}: expected 0 or 1")
    # checked here, on every device, not only where fla runs (inside `_select` on CUDA): a typo is named wherever it
    # is made, and `_select` (cached) never half-runs its fla set-up before raising
    autotune_candidates()
    key = (torch.device(device).type, requested, fused == "1")
    backend = _CHOSEN.get(key)
    if backend is None:
        backend = _CHOSEN[key] = _select(*key)
    return backend


def forget_kda_backends() -> None:
    """Choose again on the next `select_kda_backend` (tests that change what `_select` sees: its cache and `_CHOSEN`
    both; clearing `_select`'s cache alone would leave the old choice in `_CHOSEN`)."""
    _CHOSEN.clear()
    _select.cache_clear()


@functools.cache
def _select(device_type: str, requested: str | None, fused: bool) -> KDABackend:
    if requested is not None and requested not in BACKEND_NAMES:
        raise ValueError(f"{BACKEND_ENV}={requested!r} is not one of {BACKEND_NAMES}")
    if requested == "naive":
        return KDABackend("naive", f"{BACKEND_ENV}=naive", naive_recurrent_kda, naive_recurrent_kda)
    if requested == "torch":
        return KDABackend("torch", f"{BACKEND_ENV}=torch", chunk_kda_torch, naive_recurrent_kda)

    # before fla's first import (in _why_fla_cannot_run): fla reads where its configs are when it is imported
    tuning = _fla_tuning() if device_type == "cuda" and torch.cuda.is_available() else ""
    problem = _why_fla_cannot_run(device_type)
    if problem is None and tuning:
        limit_fla_autotuning()
        keep = autotune_candidates()
        tuning += (f"; other shapes autotune over at most {keep} candidates per kernel (OPENK3_FLA_AUTOTUNE=full: "
                   f"all)" if keep else "; other shapes autotune over every candidate (OPENK3_FLA_AUTOTUNE=full)")
    if problem is None and fused and (missing := _missing_fused_arguments()):
        fused, tuning = False, f"{tuning}; fla's chunk_kda lacks {missing}: only chunk_kda runs in fla"
    if requested == "fla":
        if problem is not None:
            raise RuntimeError(f"{BACKEND_ENV}=fla, but {problem}")
        return KDABackend("fla", f"{BACKEND_ENV}=fla; {tuning}", chunk_kda_fla, recurrent_kda_fla, fused)
    if problem is None:
        version = importlib.import_module("fla").__version__
        return KDABackend("fla", f"device is cuda and fla {version} imports; {tuning}", chunk_kda_fla,
                          recurrent_kda_fla, fused)
    return KDABackend("torch", f"{problem}; using the chunked PyTorch version", chunk_kda_torch,
                      naive_recurrent_kda)


def _fla_tuning() -> str:
    """Before fla's first import, point it at openk3's shipped kernel configs for this GPU (tuned.py); say which
    configs fla will use."""
    name = torch.cuda.get_device_name(0)
    if use_shipped_fla_configs(name) is not None:
        return f"kernel configs shipped for {name} (no autotuning for known shapes)"
    if os.environ.get("FLA_CACHE_MODE"):
        return f"kernel configs from FLA_CONFIG_DIR={os.environ.get('FLA_CONFIG_DIR')!r}"
    return f"no shipped kernel configs for {name}: fla autotunes each kernel on first use (Triton caches the result)"


# chunk_kda's arguments that ops/kda/fused.py relies on (fla 0.6; A_log and dt_bias travel in its **kwargs)
FUSED_ARGUMENTS = ("use_gate_in_kernel", "safe_gate", "lower_bound")


def _missing_fused_arguments() -> list[str]:
    """The FUSED_ARGUMENTS this fla's chunk_kda does not name.
    NOTE: chunk_kda takes **kwargs, so an older fla would silently ignore the in-kernel gate's arguments and run
    the delta rule on the raw gate input: checked by name, before the fused path is handed out."""
    import inspect

    from fla.ops.kda import chunk_kda

    params = inspect.signature(chunk_kda).parameters
    return [a for a in FUSED_ARGUMENTS if a not in params]


def _why_fla_cannot_run(device_type: str) -> str | None:
    """None if fla's KDA kernels can run on this device type, else the reason they cannot."""
    if device_type != "cuda":
        return f"device type is {device_type!r} and fla's Triton kernels need 'cuda'"
    try:
        importlib.import_module("fla.ops.kda")
    except ImportError as error:
        return f"fla.ops.kda does not import ({error}); install flash-linear-attention >= 0.6"
    return None


def chunk_kda_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """fla's `chunk_kda` (forward and backward) behind our signature; CUDA only.

    fla picks its own chunk size (64). Dtypes as fla's own KDA layer passes them: k, v and beta in
    q's dtype, g in fp32 (a bf16 g would lose small decays in the cumulative sum), the state in
    fp32 (fla asserts it).
    """
    # NOTE: fla is optional: imported here so CPU-only installs never touch it. This function is
    # only handed out by select_kda_backend after `fla.ops.kda` imported.
    from fla.ops.kda import chunk_kda

    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    o, final_state = chunk_kda(**_fla_arguments(q, k, v, g, beta, scale, initial_state,
                                                output_final_state, use_qk_l2norm_in_kernel,
                                                cu_seqlens))
    return o.to(q.dtype), (final_state.float() if output_final_state else None)


def recurrent_kda_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """fla's `fused_recurrent_kda` behind our signature: forward only, for decoding; CUDA only."""
    from fla.ops.kda import fused_recurrent_kda

    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    # NOTE: fused_recurrent_kda has no backward in any fla version; recent ones are not even an
    # autograd.Function, so gradients would silently stop here. Refuse instead.
    inputs = (q, k, v, g, beta, initial_state)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        raise RuntimeError("fla's fused_recurrent_kda has no backward: use backend.chunk for "
                           "training, or run decoding under torch.no_grad()")
    o, final_state = fused_recurrent_kda(**_fla_arguments(q, k, v, g, beta, scale, initial_state,
                                                          output_final_state,
                                                          use_qk_l2norm_in_kernel, cu_seqlens))
    return o.to(q.dtype), (final_state.float() if output_final_state else None)


def _fla_arguments(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
                   initial_state: Tensor | None, output_final_state: bool,
                   use_qk_l2norm_in_kernel: bool, cu_seqlens: Tensor | None) -> dict:
    """Keyword arguments that fla 0.4 to 0.6 accept alike for chunk_kda and fused_recurrent_kda."""
    return dict(
        q=q.contiguous(),
        k=k.to(q.dtype).contiguous(),
        v=v.to(q.dtype).contiguous(),
        g=g.float().contiguous(),
        beta=beta.to(q.dtype).contiguous(),
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=None if initial_state is None else initial_state.float().contiguous(),
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(q.device, torch.long),
    )
