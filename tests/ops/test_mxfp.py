import pytest
import torch

from openk3.ops.mxfp import (
    E2M1_VALUES,
    dequantize_mxfp4,
    fake_quant_mxfp4,
    fake_quant_mxfp8,
    pack_e2m1,
    quantize_mxfp4,
    unpack_e2m1,
)
from tests.helpers import rel_norm_err

NAN = float("nan")
INF = float("inf")


def one_block(values: list[float], fill: float = 0.0) -> torch.Tensor:
    """A [1, 32] block starting with ``values``, padded with ``fill``."""
    return torch.tensor([values + [fill] * (32 - len(values))], dtype=torch.float32)


def gaussian_with_block_magnitudes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian values whose 32-blocks span magnitudes 2^-20 .. 2^20."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    block_scale = 2.0 ** (20 * (2 * torch.rand(*shape[:-1], shape[-1] // 32, 1, generator=gen) - 1))
    return (w.reshape(*shape[:-1], -1, 32) * block_scale).reshape(shape)


@pytest.mark.parametrize("scale_byte", [0, 1, 60, 127, 200, 252])
def test_every_code_round_trips(scale_byte):
    codes = torch.cat([torch.arange(16), torch.arange(16).flip(0)]).to(torch.uint8).reshape(1, 32)
    scales = torch.tensor([[scale_byte]], dtype=torch.uint8)
    values = dequantize_mxfp4(codes, scales)
    expected = E2M1_VALUES[codes.long()].double() * 2.0 ** (scale_byte - 127)
    assert torch.equal(values.double(), expected)
    assert values[0, 8].item() == 0.0 and values[0, 8].signbit()  # code 8 is -0
    codes_again, scales_again = quantize_mxfp4(values)
    assert torch.equal(codes_again, codes)
    assert torch.equal(scales_again, scales)


def test_pack_layout_low_nibble_is_even_column():
    codes = torch.tensor([1, 15, 0xA, 0x3, 8, 0], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [0xF1, 0x3A, 0x08]
    assert torch.equal(unpack_e2m1(packed), codes)
    gen = torch.Generator().manual_seed(0)
    many = torch.randint(0, 16, (3, 5, 64), generator=gen).to(torch.uint8)
    assert pack_e2m1(many).shape == (3, 5, 32)
    assert torch.equal(unpack_e2m1(pack_e2m1(many)), many)


def test_rounding_ties_to_even_at_unit_scale():
    # 4.0 pins the block's scale exponent to 0 (byte 127), so values map to the grid unscaled.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    near = [0.26, 0.74, 1.26, 1.74, 2.49, 2.51, 3.49, 3.51, 4.99, 5.01]
    expected_near = [0.5, 0.5, 1.5, 1.5, 2.0, 3.0, 3.0, 4.0, 4.0, 6.0]
    w = one_block([4.0] + ties + [-t for t in ties] + near)
    codes, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[127]]
    out = dequantize_mxfp4(codes, scales)[0, : 1 + 2 * len(ties) + len(near)]
    assert out.tolist() == [4.0] + expected + [-e for e in expected] + expected_near


def test_saturation_above_six():
    # amax 7.9 -> floor(log2) = 2 -> scale exponent 0: 6.5 and 7.9 are above the grid.
    w = one_block([7.9, -6.5, 6.0, 5.9])
    codes, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[127]]
    assert codes[0, :4].tolist() == [7, 15, 7, 7]
    assert dequantize_mxfp4(codes, scales)[0, :4].tolist() == [6.0, -6.0, 6.0, 6.0]


def test_quantized_value_is_a_nearest_grid_point():
    w = gaussian_with_block_magnitudes((7, 96), seed=1)
    codes, scales = quantize_mxfp4(w)
    q = dequantize_mxfp4(codes, scales).double()
    scale = (2.0 ** (scales.double() - 127)).repeat_interleave(32, dim=-1)
    grid = E2M1_VALUES.double()[None, None, :] * scale[..., None]  # [7, 96, 16]
    nearest = (w.double()[..., None] - grid).abs().amin(-1)
    assert torch.equal((w.double() - q).abs(), nearest)


def test_scale_exponent_edge_cases():
    below_8 = torch.nextafter(torch.tensor(8.0), torch.tensor(0.0)).item()
    fp32_max = torch.finfo(torch.float32).max
    # (amax, expected scale byte, expected dequantised amax)
    cases = [
        (4.0, 127, 4.0),  # amax exactly 2^2 -> e = 0
        (8.0, 128, 8.0),  # exactly 2^3 -> e = 1
        (below_8, 127, 6.0),  # just below a power of two: floor(log2) must not round up
        (2.0**-125, 0, 2.0**-125),  # smallest unclamped exponent: e = -127
        (2.0**-126, 0, 2.0**-126),  # e would be -128: clamped to byte 0 (2^-126 = 2 * 2^-127)
        (2.0**-149, 0, 0.0),  # the smallest fp32 subnormal: far below the smallest scale
        (2.0**127, 252, 2.0**127),  # e = 125
        (fp32_max, 252, 6 * 2.0**125),  # just below 2^128: saturates, stays finite
    ]
    for amax, byte, expected in cases:
        w = one_block([amax, -amax / 3, amax / 7])
        codes, scales = quantize_mxfp4(w)
        assert scales.item() == byte, (amax, scales.item())
        q = dequantize_mxfp4(codes, scales)
        assert torch.isfinite(q).all()
        assert q[0, 0].item() == expected, (amax, q[0, 0].item())
    # Below the smallest scale, elements under 2^-129 are lost: 2^-129 is a tie (0.25) -> 0.
    codes, scales = quantize_mxfp4(one_block([2.0**-128, 2.0**-129, 3 * 2.0**-130]))
    assert dequantize_mxfp4(codes, scales)[0, :3].tolist() == [2.0**-128, 0.0, 2.0**-128]


def test_all_zero_blocks():
    w = torch.cat([torch.zeros(1, 32), -torch.zeros(1, 32), torch.randn(1, 32)], dim=0)
    codes, scales = quantize_mxfp4(w)
    assert scales[:2].tolist() == [[0], [0]]
    assert (codes[0] == 0).all() and (codes[1] == 8).all()
    q = dequantize_mxfp4(codes, scales)
    assert (q[:2] == 0).all() and not q[0].signbit().any() and q[1].signbit().all()


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nan_and_inf_make_the_block_nan(bad):
    w = torch.randn(2, 64)
    w[1, 40] = bad
    codes, scales = quantize_mxfp4(w)
    assert scales[1, 1].item() == 0xFF
    assert (scales[[0, 0, 1], [0, 1, 0]] != 0xFF).all()
    assert (codes[1, 32:] == 0).all()
    q = dequantize_mxfp4(codes, scales)
    assert q[1, 32:].isnan().all()
    assert torch.isfinite(q[0]).all() and torch.isfinite(q[1, :32]).all()
    assert fake_quant_mxfp4(w)[1, 32:].isnan().all()
    assert fake_quant_mxfp8(w)[1, 32:].isnan().all() and torch.isfinite(fake_quant_mxfp8(w)[1, :32]).all()


def test_gaussian_relative_error():
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(2))
    err = rel_norm_err(fake_quant_mxfp4(w), w)
    # Round-to-nearest on this grid gives about 0.12 for Gaussian blocks of 32.
    assert 0.05 < err < 0.15


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_is_idempotent_and_keeps_dtype(dtype):
    w = gaussian_with_block_magnitudes((5, 3, 128), seed=3).to(dtype)
    once = fake_quant_mxfp4(w)
    assert once.dtype == dtype
    assert not torch.equal(once, w)
    assert torch.equal(fake_quant_mxfp4(once), once)
    codes, scales = quantize_mxfp4(w)
    assert torch.equal(once, dequantize_mxfp4(codes, scales, dtype=dtype))


@pytest.mark.parametrize("fake_quant", [fake_quant_mxfp4, fake_quant_mxfp8])
def test_straight_through_gradient_is_identity(fake_quant):
    w = torch.randn(3, 64, dtype=torch.float32).requires_grad_()
    grad = torch.randn(3, 64)
    (fake_quant(w) * grad).sum().backward()
    assert torch.equal(w.grad, grad)


def test_mxfp8_error_bound_and_saturation():
    x = gaussian_with_block_magnitudes((16, 256), seed=4)
    q = fake_quant_mxfp8(x)
    assert q.dtype == torch.float32
    # About 0.03: three mantissa bits, plus saturation of the top of each block.
    assert 0.01 < rel_norm_err(q, x) < 0.04
    # With p = 2^floor(log2(block amax)), elements are scaled by 2^8 / p. Those in [p/64, 1.75p]
    # land on E4M3 normals (relative error <= 2^-4); those above 1.75p saturate to +-1.75p.
    amax = x.reshape(16, -1, 32).abs().amax(-1, keepdim=True).repeat_interleave(32, -1).reshape(16, 256)
    p = 2.0 ** (torch.frexp(amax)[1] - 1).float()
    normal = (x.abs() >= p / 64) & (x.abs() <= 1.75 * p)
    saturated = x.abs() > 1.75 * p
    assert normal.float().mean() > 0.8 and saturated.any()
    assert ((q - x).abs() <= 2.0**-4 * x.abs())[normal].all()
    assert torch.equal(q[saturated], (1.75 * p * x.sign())[saturated])
    assert torch.equal(fake_quant_mxfp8(q), q)
    # amax 1.9 -> scale exponent -8 -> 1.9 * 2^8 = 486.4 saturates to 448 -> 1.75.
    block = one_block([1.9, -1.8, 1.0, 0.5])
    assert fake_quant_mxfp8(block)[0, :4].tolist() == [1.75, -1.75, 1.0, 0.5]
    bf16 = fake_quant_mxfp8(x.bfloat16())
    assert bf16.dtype == torch.bfloat16


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"multiple of 32.*\(2, 48\)"):
        quantize_mxfp4(torch.randn(2, 48))
    with pytest.raises(ValueError, match=r"multiple of 32.*\(5,\)"):
        fake_quant_mxfp8(torch.randn(5))
    codes, scales = quantize_mxfp4(torch.randn(2, 64))
    with pytest.raises(ValueError, match="unpack_e2m1"):
        dequantize_mxfp4(pack_e2m1(codes).repeat(1, 2), scales)
    with pytest.raises(ValueError, match=r"must be \(2, 2\), got \(2, 1\)"):
        dequantize_mxfp4(codes, scales[:, :1])
    with pytest.raises(ValueError, match="even last dimension"):
        pack_e2m1(codes[:, :3])
