"""`MLP.gemv` (openk3/model/model.py): a dense MLP at a few tokens through the routed experts' GEMV kernels, against
the MLP's own Linear calls; and where a forward takes it.

On the CPU the kernels run in Triton's interpreter, in a child pytest started with TRITON_INTERPRET=1 (the
`test_interpreted_*` tests); skipped without triton. The GPU test runs the real kernels.
"""

import pytest
import torch

from openk3.config import get_config, tiny
from openk3.model import model as model_module
from openk3.model.model import GEMV_MLP_TOKENS, MLP
from tests.helpers import cuda, interpreted_only, interpreter_child_test, rel_norm_err


test_kernels_under_the_interpreter = interpreter_child_test(__file__)


def random_mlp(config, hidden, inter, dtype, device, seed):
    torch.manual_seed(seed)
    mlp = MLP(config, hidden, inter)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=hidden ** -0.5)
    return mlp.to(device, dtype)


def check_gemv(config, hidden, inter, dtype, device, T, seed=0):
    mlp = random_mlp(config, hidden, inter, dtype, device, seed)
    x = torch.randn(2, T, hidden, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)[:, :T]
    with torch.no_grad():
        y = mlp.gemv(x)
        assert y is not None and y.shape == x.shape and y.dtype == dtype
        ref = mlp.down_proj(mlp.act(mlp.gate_proj(x), mlp.up_proj(x)))  # the Linear calls
    # same rounding points; only the summation order differs (fp32: ~1e-6; bf16: an ulp of the roundings, more under
    # the interpreter, which casts fp32 to bf16 by truncation where the GPU and torch round to nearest)
    assert rel_norm_err(y, ref) < (2e-6 if dtype == torch.float32 else 1e-2 if device == "cuda" else 3e-2)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["swiglu", "situ"])
def test_interpreted_gemv_equals_the_linear_calls(dtype, family):
    config = tiny() if family == "situ" else tiny().replace(hidden_act="silu")
    for T in (1, GEMV_MLP_TOKENS // 2):  # x [2, T, D]: 2T tokens
        check_gemv(config, 64, 96, dtype, "cpu", T)


@interpreted_only
def test_interpreted_forward_takes_gemv_only_where_it_applies(monkeypatch):
    mlp = random_mlp(tiny(), 64, 96, torch.float32, "cpu", 3)
    calls = []
    gemv = MLP.gemv
    monkeypatch.setattr(MLP, "gemv", lambda self, x: calls.append(x.shape) or gemv(self, x))
    small, big = torch.randn(1, 3, 64), torch.randn(1, GEMV_MLP_TOKENS + 1, 64)
    with torch.no_grad():
        assert mlp.gemv(small) is not None and mlp.gemv(big) is None
        mlp(small)
    assert mlp.gemv(small) is None  # grad enabled: the Linear calls (autograd)
    assert mlp(small).requires_grad
    assert mlp(small, outs={"gate_proj": mlp.gate_proj(small), "up_proj": mlp.up_proj(small)}) is not None
    assert calls[-2:] == [small.shape, small.shape]  # the caller's `outs` skips it


@interpreted_only
def test_interpreted_autocast_keeps_the_linear_calls():
    """Under autocast the Linear calls compute in the autocast dtype (as the routed experts and `Linear`'s GEMV
    honour it): `MLP.gemv` steps aside instead of running the fp32 weights in fp32 and returning fp32."""
    mlp = random_mlp(tiny(), 64, 96, torch.float32, "cpu", 4)
    x = torch.randn(1, 1, 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert mlp.gemv(x) is None
        y = mlp(x)
        ref = mlp.down_proj(mlp.act(mlp.gate_proj(x), mlp.up_proj(x)))
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)


def test_one_expert_route_is_kept_per_device_and_dtype():
    x = torch.randn(3, 8)
    idx, w = model_module.one_expert_route(x)
    assert idx.tolist() == [[0]] * 3 and w.tolist() == [[1.0]] * 3 and w.dtype == x.dtype
    idx2, _ = model_module.one_expert_route(x[:1])
    assert idx2.data_ptr() == idx.data_ptr()  # made once


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, GEMV_MLP_TOKENS // 2])
def test_gpu_gemv_equals_the_linear_calls(T):
    config = get_config("kimi-linear-1.5b")
    check_gemv(config, 1536, 512, torch.bfloat16, "cuda", T)   # the shared expert
    check_gemv(config, 1536, 4096, torch.bfloat16, "cuda", T)  # the dense first layer
    check_gemv(config, 1536, 512, torch.float32, "cuda", T)
