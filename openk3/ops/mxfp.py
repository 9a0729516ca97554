"""OCP Microscaling (MX) formats: MXFP4 weights and MXFP8 activations (K3 spec section 5).

An MX block is 32 consecutive values along the last dimension sharing one E8M0 scale: a byte b
meaning 2^(b - 127), with b = 0xFF meaning NaN for the whole block (OCP MX v1.0).

MXFP4 (routed-expert weights, QAT and checkpoint storage). Elements are E2M1 codes c in 0..15:
bit 3 is the sign, c & 7 indexes the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; code 8 is -0.
Quantising one block:
  - scale exponent e = floor(log2(amax)) - 2, with amax the block's max |w|, so amax / 2^e lies
    in [4, 8) and the largest element lands at the top of the E2M1 range (max 6 = 1.5 * 2^2);
    the stored byte is e + 127 clamped into [0, 254];
  - each element w / 2^e is rounded to the nearest E2M1 value, ties to the even mantissa
    (which is the even code), values above 6 saturate to 6; the sign is kept, so -0.0 and
    negatives that round to zero give code 8 (-0).
Choices where OCP leaves freedom (all tested):
  - all-zero block: scale byte 0 (2^-127) and codes 0 (or 8 for -0.0): dequantises to zeros.
  - NaN anywhere in the block: scale byte 0xFF (the whole block dequantises to NaN), codes 0.
  - +-inf anywhere in the block: treated like NaN (scale 0xFF, codes 0). OCP MX v1.0 leaves the
    conversion of inf implementation-defined; saturating would instead pick the largest scale and
    flush every finite neighbour to zero, hiding a diverged weight behind plausible numbers.
  - blocks too small for the smallest scale (amax < 2^-125) keep byte 0 and lose the elements
    at or below 2^-129 (they round to zero), as any fixed-range format must.

MXFP8 (activations into the experts): elements E4M3 (torch.float8_e4m3fn, max normal
448 = 1.75 * 2^8), so the scale exponent is floor(log2(amax)) - 8; elements are rounded to
nearest even by the fp8 cast after clamping to +-448 (the clamp makes saturation explicit
rather than relying on the cast's own overflow behaviour). NaN/inf blocks become NaN, as above.

Precision: quantisation runs in fp32 (the input is cast there; bf16 and fp16 are exact in fp32).
Dividing by a power of two is exact, so the only rounding is the one onto the element grid.
"""

import torch
from torch import Tensor

MX_BLOCK = 32
E8M0_NAN = 0xFF

# E2M1 value of each 4-bit code; index 8 is -0.0.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
E4M3_MAX = 448.0

# Midpoints between neighbouring E2M1 magnitudes, split by which way a tie goes. A value exactly
# on a midpoint goes to the neighbour with the even mantissa bit (the code's lowest bit):
# 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1 (code 2), 1.75 -> 2 (code 4),
# 2.5 -> 2 (code 4), 3.5 -> 4 (code 6), 5 -> 4 (code 6).
_TIES_ROUND_DOWN = torch.tensor([0.25, 1.25, 2.5, 5.0], dtype=torch.float32)
_TIES_ROUND_UP = torch.tensor([0.75, 1.75, 3.5], dtype=torch.float32)

# 2^(b - 127) for every E8M0 byte b, NaN for 0xFF. Built in float64 and cast: every entry,
# including 2^-127 (an fp32 subnormal), is exact in fp32.
_E8M0_VALUES = torch.tensor([2.0 ** (b - 127) for b in range(255)] + [float("nan")], dtype=torch.float64).float()


def _check_blocks(x: Tensor, what: str) -> None:
    if x.dim() == 0 or x.shape[-1] % MX_BLOCK != 0:
        raise ValueError(
            f"{what} needs a last dimension that is a multiple of {MX_BLOCK} (one MX block per "
            f"{MX_BLOCK} values), got shape {tuple(x.shape)}"
        )
    if not x.is_floating_point():
        raise ValueError(f"{what} needs a floating-point tensor, got {x.dtype}")


def _block_scale(x_NB: Tensor, elem_emax: int) -> tuple[Tensor, Tensor]:
    """Shared E8M0 scale of each block.

    x_NB: [..., nblocks, 32] fp32. elem_emax: exponent of the element format's largest power
    of two (2 for E2M1, 8 for E4M3). Returns (scale bytes uint8 [..., nblocks], scale values
    fp32 [..., nblocks, 1]; NaN where the block holds NaN or +-inf).
    """
    amax = x_NB.abs().amax(-1)
    # frexp gives amax = m * 2^k with m in [0.5, 1), so floor(log2(amax)) = k - 1 exactly
    # (torch.log2 can round up just below a power of two).
    _, k = torch.frexp(amax)
    byte = (k.to(torch.int32) - 1 - elem_emax + 127).clamp(0, 254)
    byte = torch.where(amax == 0, 0, byte)
    byte = torch.where(amax.isfinite(), byte, E8M0_NAN).to(torch.uint8)
    return byte, _E8M0_VALUES.to(x_NB.device)[byte.long()].unsqueeze(-1)


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise to MXFP4 along the last dimension.

    w: [..., n] floating point, n a multiple of 32.
    Returns (codes uint8 [..., n] with values 0..15, scales uint8 [..., n // 32] E8M0 bytes).
    """
    _check_blocks(w, "quantize_mxfp4")
    w_NB = w.float().reshape(*w.shape[:-1], w.shape[-1] // MX_BLOCK, MX_BLOCK)
    scale_byte, scale = _block_scale(w_NB, elem_emax=2)
    magnitude = (w_NB / scale).abs()
    # Count the midpoints below each value: that count is its E2M1 magnitude index. Ties on
    # round-down midpoints are not counted (right=False), ties on round-up ones are (right=True).
    # Anything above 5 gets index 7 (6.0), which is the saturation.
    index = torch.bucketize(magnitude, _TIES_ROUND_DOWN.to(w.device), right=False) + torch.bucketize(
        magnitude, _TIES_ROUND_UP.to(w.device), right=True
    )
    codes = index.to(torch.uint8) | (w_NB.signbit().to(torch.uint8) << 3)
    # NaN blocks: magnitude is NaN and the codes meaningless; store zeros.
    codes = torch.where(scale_byte.unsqueeze(-1) == E8M0_NAN, 0, codes)
    return codes.reshape(w.shape), scale_byte


def dequantize_mxfp4(codes: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode MXFP4: value = E2M1(code) * 2^(scale - 127); scale 0xFF gives NaN.

    codes: uint8 [..., n] with values 0..15 (unpacked; see unpack_e2m1). scales: uint8 [..., n // 32].
    Returns [..., n] in ``dtype`` (decoded exactly in fp32, then cast).
    NOTE: scale byte 253 with a code value of magnitude >= 4, or 254 with >= 2, exceeds the fp32
    range and decodes to inf; quantize_mxfp4 never writes them (finite fp32 gives bytes <= 252).
    """
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % MX_BLOCK != 0:
        raise ValueError(f"codes need a last dimension that is a multiple of {MX_BLOCK}, got {tuple(codes.shape)}")
    expected = (*codes.shape[:-1], codes.shape[-1] // MX_BLOCK)
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales for codes {tuple(codes.shape)} must be {expected}, got {tuple(scales.shape)}")
    if codes.numel() > 0 and int(codes.max()) > 15:
        raise ValueError(
            f"E2M1 codes must be in 0..15, got a maximum of {int(codes.max())}; "
            "packed bytes must go through unpack_e2m1 first"
        )
    return _decode_mxfp4(codes, scales).to(dtype)


def _decode_mxfp4(codes: Tensor, scales: Tensor) -> Tensor:
    """dequantize_mxfp4 without the checks (which sync with the GPU), in fp32."""
    values = E2M1_VALUES.to(codes.device)[codes.long()]
    values_NB = values.reshape(*codes.shape[:-1], codes.shape[-1] // MX_BLOCK, MX_BLOCK)
    scale = _E8M0_VALUES.to(codes.device)[scales.long()].unsqueeze(-1)
    return (values_NB * scale).reshape(codes.shape)


def pack_e2m1(codes: Tensor) -> Tensor:
    """Two E2M1 codes per byte: the even column in the low nibble, the odd one in the high nibble.

    codes: uint8 [..., n] with values 0..15, n even. Returns uint8 [..., n // 2].
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_e2m1 needs an even last dimension, got shape {tuple(codes.shape)}")
    if codes.numel() > 0 and int(codes.max()) > 15:
        raise ValueError(f"E2M1 codes must be in 0..15, got a maximum of {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: Tensor) -> Tensor:
    """Inverse of pack_e2m1. packed: uint8 [..., m]. Returns codes uint8 [..., 2m]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("packed codes must have at least one dimension")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantised tensor. Backward: the incoming gradient unchanged.

    NOTE: written as a Function rather than ``w + (q - w).detach()``, which is not bit-exact
    (w + (q - w) can differ from q by an ulp) and would break idempotence.
    """

    @staticmethod
    def forward(ctx, x: Tensor, quantized: Tensor) -> Tensor:
        return quantized

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def fake_quant_mxfp4(w: Tensor) -> Tensor:
    """MXFP4 quantise-dequantise with a straight-through (identity) gradient, for QAT.

    w: [..., n], n a multiple of 32. Returns [..., n] in w's dtype.
    """
    with torch.no_grad():
        codes, scales = quantize_mxfp4(w)
        quantized = _decode_mxfp4(codes, scales).to(w.dtype)
    return _StraightThrough.apply(w, quantized)


def fake_quant_mxfp8(x: Tensor) -> Tensor:
    """MXFP8 (E4M3 elements, E8M0 scale per 32) quantise-dequantise, straight-through gradient.

    x: [..., n], n a multiple of 32. Returns [..., n] in x's dtype.
    """
    _check_blocks(x, "fake_quant_mxfp8")
    with torch.no_grad():
        x_NB = x.float().reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
        _, scale = _block_scale(x_NB, elem_emax=8)
        elements = (x_NB / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        quantized = (elements.float() * scale).reshape(x.shape).to(x.dtype)
    return _StraightThrough.apply(x, quantized)
