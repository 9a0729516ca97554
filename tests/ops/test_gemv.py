"""The decode-size linear kernel (openk3/ops/gemv.py) against F.linear, and where the model's `Linear` takes it.

On the CPU the kernel runs in Triton's interpreter, in a child pytest started with TRITON_INTERPRET=1 (the
`test_interpreted_*` tests); skipped without triton. The GPU tests run the real kernel.
"""

import pytest
import torch
import torch.nn.functional as F

from openk3.model.model import Linear
from openk3.ops import gemv as gemv_module
from openk3.ops.gemv import GEMV_MAX_ROWS, gemv, gemv_applies
from tests.helpers import INTERPRETED, cuda, interpreted_only, interpreter_child_test, rel_norm_err


test_kernels_under_the_interpreter = interpreter_child_test(__file__)


def check(device, shape, K, N, dtype, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, 2 * K if strided else K, generator=g)[..., :K]
    w = torch.randn(N, K, generator=g) * K ** -0.5
    x, w = x.to(device, dtype), w.to(device, dtype)
    assert gemv_applies(x, w)
    y = gemv(x, w)
    ref = F.linear(x.double(), w.double())
    assert y.shape == (*shape, N) and y.dtype == dtype
    # fp32: the summation order; half precision: one rounding of the fp32 sum (the interpreter's bf16 cast truncates)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2 if device == "cuda" else 2e-2}[dtype]
    assert rel_norm_err(y, ref) < tol


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K,N", [(128, 40), (96, 33), (2048, 24), (1536, 9)])
def test_interpreted_gemv_equals_linear(K, N, dtype):
    check("cpu", (1, 1), K, N, dtype, seed=K + N)
    check("cpu", (1,), K, N, dtype, seed=K + N + 1, strided=True)


@interpreted_only
def test_interpreted_linear_module_takes_the_kernel_only_without_grad(monkeypatch):
    layer = Linear(64, 48, bias=False)
    x = torch.randn(1, 1, 64)
    calls = []
    monkeypatch.setattr("openk3.model.model.gemv", lambda *a: calls.append(1) or gemv(*a))
    y = layer(x)  # grad wanted: F.linear
    assert y.requires_grad and not calls
    with torch.no_grad():
        torch.testing.assert_close(layer(x), y.detach(), rtol=1e-6, atol=1e-6)
        assert calls == [1]
        layer(torch.randn(2, 64))  # two rows: F.linear
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)  # autocast: F.linear in the autocast dtype
    assert calls == [1]


def test_applies_only_where_it_can_run(monkeypatch):
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    if not INTERPRETED:
        assert not gemv_applies(x, w)  # the CPU without the interpreter
    # the rest where the kernel runs (the interpreter's CPU: the flag alone is read here, no kernel runs), each
    # against a call it takes
    monkeypatch.setattr(gemv_module, "INTERPRET", True)
    assert gemv_applies(x, w) == (gemv_module.triton is not None)
    assert not gemv_applies(torch.randn(GEMV_MAX_ROWS + 1, 64), w)
    assert not gemv_applies(x.double(), w.double())
    assert not gemv_applies(x, w.bfloat16())
    assert not gemv_applies(x, w.t().contiguous().t())
    assert not gemv_applies(x[:, :32], w)
    assert not gemv_applies(x, w.requires_grad_())


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("K,N", [(2048, 1536), (128, 2048), (1536, 1024), (512, 1536), (4096, 1536), (100, 77),
                                 (2048, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_gemv_equals_linear(K, N, dtype):
    check("cuda", (1, 1), K, N, dtype, seed=K)
    check("cuda", (1,), K, N, dtype, seed=N, strided=True)


def test_larger_weights_stay_on_cublas(monkeypatch):
    """Past GEMV_MAX_WEIGHT elements (KDA's stacked input projection, the lm_head) cuBLAS was faster on the H200."""
    monkeypatch.setattr(gemv_module, "INTERPRET", True)  # where the kernel runs (the flag alone; no kernel runs)
    x = torch.randn(1, 1536)
    assert gemv_applies(x, torch.empty(4096, 1536)) == (gemv_module.triton is not None)  # the dense down projection
    assert not gemv_applies(x, torch.empty(6416, 1536))
    assert not gemv_applies(x, torch.empty(32000, 1536))
