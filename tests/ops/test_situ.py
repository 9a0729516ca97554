import pytest
import torch

from openk3.ops.situ import situ_glu, swiglu
from tests.helpers import rel_norm_err


def situ_reference(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    g, u = g.double(), u.double()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * linear_beta * torch.tanh(u / linear_beta)


def test_situ_matches_float64_formula():
    torch.manual_seed(0)
    g, u = 6 * torch.randn(2, 37, 53), 40 * torch.randn(2, 37, 53)
    assert rel_norm_err(situ_glu(g, u), situ_reference(g, u, 4.0, 25.0)) < 1e-6
    assert rel_norm_err(situ_glu(g, u, beta=1.5, linear_beta=7.0), situ_reference(g, u, 1.5, 7.0)) < 1e-6


@pytest.mark.parametrize("beta, linear_beta", [(4.0, 25.0), (2.0, 3.0)])
def test_situ_output_is_bounded(beta, linear_beta):
    torch.manual_seed(1)
    signs_g = torch.randint(0, 2, (4, 129)) * 2 - 1
    signs_u = torch.randint(0, 2, (4, 129)) * 2 - 1
    magnitude = torch.logspace(1, 30, 129)
    g, u = signs_g * magnitude, signs_u * magnitude.flip(0)
    out = situ_glu(g, u, beta, linear_beta)
    assert torch.isfinite(out).all()
    # NOTE: <= rather than <: tanh and sigmoid round to exactly 1.0 in fp32 for large inputs.
    assert out.abs().max() <= beta * linear_beta
    # The bound is approached (large positive gate, large |up|), so it is tight, not loose.
    assert out.abs().max() > 0.999 * beta * linear_beta
    inf = torch.tensor([float("inf"), -float("inf")])
    assert torch.isfinite(situ_glu(inf, inf.flip(0), beta, linear_beta)).all()


def test_situ_matches_swiglu_to_first_order_near_zero():
    torch.manual_seed(2)
    g, u = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    err_coarse = rel_norm_err(situ_glu(0.1 * g, 0.1 * u), swiglu(0.1 * g, 0.1 * u))
    err_fine = rel_norm_err(situ_glu(0.01 * g, 0.01 * u), swiglu(0.01 * g, 0.01 * u))
    # The difference is third order, so the relative error shrinks like the scale squared.
    assert err_fine < 1e-4
    assert err_fine < 0.02 * err_coarse
    # Far from zero they differ: SiTU clamps.
    assert rel_norm_err(situ_glu(20 * g, 20 * u), swiglu(20 * g, 20 * u)) > 0.3


@pytest.mark.parametrize("fn", [situ_glu, swiglu])
def test_gradients_by_finite_differences(fn):
    torch.manual_seed(3)
    g = (3 * torch.randn(5, 7, dtype=torch.float64)).requires_grad_()
    u = (30 * torch.randn(5, 7, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(fn, (g, u))


@pytest.mark.parametrize("fn", [situ_glu, swiglu])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_computed_in_fp32(fn, dtype):
    torch.manual_seed(4)
    g, u = (4 * torch.randn(3, 61)).to(dtype), (20 * torch.randn(3, 61)).to(dtype)
    out = fn(g, u)
    assert out.dtype == dtype
    assert torch.equal(out, fn(g.float(), u.float()).to(dtype))


def test_bad_inputs_raise():
    g = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"\(3, 4\) and \(3, 5\)"):
        situ_glu(g, torch.randn(3, 5))
    with pytest.raises(ValueError, match="float32 and torch.bfloat16"):
        swiglu(g, g.bfloat16())
    with pytest.raises(ValueError, match="beta=0"):
        situ_glu(g, g, beta=0.0)
