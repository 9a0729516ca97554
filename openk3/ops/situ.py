"""Gated activations for the MLPs: SiTU-GLU (Kimi K3) and SwiGLU (Kimi-Linear).

Both take the two halves of a GLU, ``gate = x @ W1.T`` and ``up = x @ W3.T`` (any shape,
the two shapes equal), and return ``act(gate) * up`` of the same shape.

SiTU-GLU (K3 spec section 4):

    situ(g, u) = beta tanh(g / beta) sigmoid(g)  *  linear_beta tanh(u / linear_beta)

with beta = 4 and linear_beta = 25 in K3. Each factor is a soft clamp: the gate factor lies in
(-beta, beta) and the up factor in (-linear_beta, linear_beta), so |situ| < beta * linear_beta
(100 for K3) whatever the inputs. Near zero, beta tanh(g / beta) = g - g^3 / (3 beta^2) + ...,
so situ(g, u) = g sigmoid(g) u + O(|g| (g^2 + u^2)): SwiGLU to first order.

Precision: both inputs are cast to fp32 (float64 stays float64, for gradcheck) and the
result is cast back to the inputs' dtype.
"""

import torch
from torch import Tensor


def _compute_dtype(gate: Tensor, up: Tensor) -> torch.dtype:
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up must have the same dtype, got {gate.dtype} and {up.dtype}")
    if not gate.is_floating_point():
        raise ValueError(f"gate and up must be floating point, got {gate.dtype}")
    return torch.promote_types(gate.dtype, torch.float32)


def situ_glu(gate: Tensor, up: Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    """SiTU-GLU: ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)``.

    gate, up: [...] same shape and dtype. Returns [...] in that dtype; computed in fp32.
    NOTE: mathematically |out| < beta * linear_beta, but in fp32 tanh and sigmoid round to
    exactly 1 for large inputs, so the bound reached in floating point is <=, not <.
    """
    if not (beta > 0 and linear_beta > 0):
        raise ValueError(f"beta and linear_beta must be positive, got beta={beta}, linear_beta={linear_beta}")
    dtype = _compute_dtype(gate, up)
    g, u = gate.to(dtype), up.to(dtype)
    gate_factor = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    up_factor = linear_beta * torch.tanh(u / linear_beta)
    return (gate_factor * up_factor).to(gate.dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU: ``silu(g) * u = g * sigmoid(g) * u``.

    gate, up: [...] same shape and dtype. Returns [...] in that dtype; computed in fp32.
    """
    dtype = _compute_dtype(gate, up)
    return (torch.nn.functional.silu(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)
