"""Block Attention Residuals: the softmax mixture of residual sources (K3 spec section 3).

Each decoder layer reads, instead of a single residual stream, a mixture of S sources
(the banked block summaries plus the running sum of the current block):

    key_j   = V_j * rsqrt(mean_d(V_j^2) + eps)           # weightless RMS normalisation
    logit_j = sum_d key_jd * norm_weight_d * proj_weight_d  # no 1/sqrt(D) temperature
    out     = sum_j softmax_j(logit) * V_j                  # mixes the RAW sources, not the keys

independently for every token. ``proj_weight`` is the pseudo-query; it is zero-initialised, so a
fresh layer starts as the uniform average of its sources.

Precision: sources and both weight vectors are cast to fp32 on entry (float64 stays float64, for
gradcheck); keys, logits, softmax and the weighted sum all run there, and only the mixed output
is cast back to the sources' dtype.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def attnres_mix(
    sources: Sequence[Tensor] | Tensor,
    norm_weight: Tensor,
    proj_weight: Tensor,
    eps: float,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mix S residual sources with a per-token softmax over sources.

    sources: a list of S tensors [..., D] (same shape and dtype) or one stacked tensor [S, ..., D].
    norm_weight: [D]. proj_weight: [D] or [1, D] (the checkpoint stores [1, D]).
    eps: the RMS-normalisation epsilon (``rms_norm_eps``).
    Returns out [..., D] in the sources' dtype; with ``return_weights=True`` also the softmax
    weights [S, ...] in fp32 (what training logs as "AttnRes depth weights").
    """
    if isinstance(sources, Tensor):
        if sources.dim() < 2:
            raise ValueError(f"stacked sources must be [S, ..., D], got shape {tuple(sources.shape)}")
        in_dtype = sources.dtype
        dtype = torch.promote_types(in_dtype, torch.float32)
        V_SxD = sources.to(dtype)
    else:
        if len(sources) == 0:
            raise ValueError("attnres_mix needs at least one source, got an empty list")
        shapes = {tuple(s.shape) for s in sources}
        dtypes = {s.dtype for s in sources}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(f"all sources must share one shape and dtype, got shapes {shapes} and dtypes {dtypes}")
        in_dtype = sources[0].dtype
        dtype = torch.promote_types(in_dtype, torch.float32)
        # Cast each source before stacking so the stack itself is already fp32.
        V_SxD = torch.stack([s.to(dtype) for s in sources])
    D = V_SxD.shape[-1]
    if norm_weight.shape != (D,):
        raise ValueError(f"norm_weight must be [{D}], got {tuple(norm_weight.shape)}")
    if proj_weight.shape not in ((D,), (1, D)):
        raise ValueError(f"proj_weight must be [{D}] or [1, {D}], got {tuple(proj_weight.shape)}")

    key_SxD = F.rms_norm(V_SxD, (D,), eps=eps)  # V * rsqrt(mean(V^2) + eps): RMSNorm without its weight
    query_D = norm_weight.to(dtype) * proj_weight.reshape(D).to(dtype)
    logit_Sx = key_SxD @ query_D
    weight_Sx = torch.softmax(logit_Sx, dim=0)
    out_xD = (weight_Sx.unsqueeze(-1) * V_SxD).sum(0).to(in_dtype)
    if return_weights:
        return out_xD, weight_Sx
    return out_xD
