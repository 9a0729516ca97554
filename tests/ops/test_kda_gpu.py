"""The fla KDA backend (flash-linear-attention's Triton kernels) against the fp32 naive reference.

Needs CUDA and the `fla` package (flash-linear-attention >= 0.4); skipped cleanly otherwise.
Inputs are bf16 as in training; the reference runs in fp32 on the same bf16 values.
"""

import importlib.util

import pytest
import torch

from openk3.ops.kda import chunk_kda_torch, naive_recurrent_kda, select_kda_backend
from openk3.ops.kda.backend import BACKEND_ENV
from tests.ops.test_kda import assert_matches, make_inputs, rel_err, run_with_grads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                       reason="needs flash-linear-attention (import name fla)"),
]

SHAPE_HKV = (4, 64, 64)


@pytest.fixture
def fla_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "fla")
    backend = select_kda_backend("cuda")
    assert backend.name == "fla"
    return backend


def fp32(inputs: dict) -> dict:
    return {name: x.float() for name, x in inputs.items()}


def test_default_backend_on_cuda_is_fla(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    backend = select_kda_backend(torch.device("cuda", 0))
    assert backend.name == "fla" and "fla" in backend.reason


@pytest.mark.parametrize("T", [63, 500, 1000])
@pytest.mark.parametrize("decay", ["bounded", "unbounded"])
def test_fla_chunk_matches_naive(fla_backend, T, decay):
    inputs = make_inputs(B=2, T=T, decay=decay, dtype=torch.bfloat16, seed=T,
                         shape_HKV=SHAPE_HKV, device="cuda")
    actual = run_with_grads(fla_backend.chunk, inputs)
    assert actual[0].dtype == torch.bfloat16 and actual[1].dtype == torch.float32
    assert_matches(actual, run_with_grads(naive_recurrent_kda, fp32(inputs)), 2e-2, 5e-2)


def test_fla_chunk_l2norm_flag(fla_backend):
    inputs = make_inputs(B=2, T=300, dtype=torch.bfloat16, normalise_qk=False, seed=5,
                         shape_HKV=SHAPE_HKV, device="cuda")
    assert_matches(run_with_grads(fla_backend.chunk, inputs, use_qk_l2norm_in_kernel=True),
                   run_with_grads(naive_recurrent_kda, fp32(inputs), use_qk_l2norm_in_kernel=True),
                   2e-2, 5e-2)


@pytest.mark.parametrize("cuts", [[0, 15, 100, 300, 1000], [0, 1, 64, 65, 500]])
def test_fla_chunk_varlen_matches_naive(fla_backend, cuts):
    inputs = make_inputs(B=1, T=cuts[-1], N=len(cuts) - 1, dtype=torch.bfloat16, seed=len(cuts),
                         shape_HKV=SHAPE_HKV, device="cuda")
    cu_seqlens = torch.tensor(cuts, device="cuda")
    assert_matches(run_with_grads(fla_backend.chunk, inputs, cu_seqlens=cu_seqlens),
                   run_with_grads(naive_recurrent_kda, fp32(inputs), cu_seqlens=cu_seqlens),
                   2e-2, 5e-2)


@pytest.mark.parametrize("T", [1, 63, 500])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fla_recurrent_matches_naive(fla_backend, T, dtype, tol):
    inputs = make_inputs(B=2, T=T, decay="unbounded", dtype=dtype, seed=T, shape_HKV=SHAPE_HKV,
                         device="cuda")
    with torch.no_grad():
        o, state = fla_backend.recurrent(**inputs, output_final_state=True)
        o_ref, state_ref = naive_recurrent_kda(**fp32(inputs), output_final_state=True)
    assert o.dtype == dtype and state.dtype == torch.float32
    assert rel_err(o, o_ref) < tol and rel_err(state, state_ref) < tol


def test_fla_recurrent_varlen_matches_naive(fla_backend):
    cuts = [0, 3, 4, 40, 100]
    inputs = make_inputs(B=1, T=cuts[-1], N=len(cuts) - 1, dtype=torch.bfloat16, seed=1,
                         shape_HKV=SHAPE_HKV, device="cuda")
    cu_seqlens = torch.tensor(cuts, device="cuda")
    with torch.no_grad():
        o, state = fla_backend.recurrent(**inputs, output_final_state=True, cu_seqlens=cu_seqlens)
        o_ref, state_ref = naive_recurrent_kda(**fp32(inputs), output_final_state=True,
                                               cu_seqlens=cu_seqlens)
    assert rel_err(o, o_ref) < 2e-2 and rel_err(state, state_ref) < 2e-2


def test_fla_recurrent_refuses_to_drop_gradients(fla_backend):
    inputs = make_inputs(B=1, T=4, shape_HKV=SHAPE_HKV, device="cuda")
    inputs["v"].requires_grad_()
    with pytest.raises(RuntimeError, match="no backward"):
        fla_backend.recurrent(**inputs)


def test_torch_chunk_on_cuda_at_model_head_size():
    inputs = make_inputs(B=2, T=1000, decay="unbounded", seed=2, shape_HKV=(2, 128, 128),
                         device="cuda")
    assert_matches(run_with_grads(chunk_kda_torch, inputs),
                   run_with_grads(naive_recurrent_kda, inputs), 1e-3)
