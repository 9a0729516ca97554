"""KDA ops on CPU: the naive reference against the spec formula, the chunked version against the
reference (forward and backward), and the backend choice."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from openk3.ops.kda import KDABackend, chunk_kda_torch, naive_recurrent_kda, select_kda_backend
from openk3.ops.kda.backend import BACKEND_ENV
from openk3.ops.kda.naive import l2norm
from tests.helpers import rel_err

H, K, V = 2, 16, 12


def make_inputs(B: int, T: int, N: int | None = None, decay: str = "bounded", dtype=torch.float32,
                normalise_qk: bool = True, seed: int = 0, shape_HKV: tuple = (H, K, V),
                device: str = "cpu") -> dict:
    """Fresh random KDA inputs with heads, key and value dims shape_HKV; N state rows (default B).

    decay="bounded" is K3's g = -5 sigmoid(.) in (-5, 0); "unbounded" is Kimi-Linear's
    g = -exp(A) softplus(.), with A alternating log(0.5) and log(60) over heads, so every other
    head decays by tens to hundreds per step. The state is always fp32.
    """
    heads, key_dim, value_dim = shape_HKV
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, heads, key_dim, generator=gen)
    k = torch.randn(B, T, heads, key_dim, generator=gen)
    if normalise_qk:
        q, k = l2norm(q), l2norm(k)
    f = torch.randn(B, T, heads, key_dim, generator=gen) * 2
    if decay == "bounded":
        g = -5 * torch.sigmoid(f)
    else:
        A = torch.tensor([0.5, 60.0]).repeat(heads)[:heads]
        g = -A[:, None] * F.softplus(f + 1)
    inputs = dict(
        q=q.to(dtype), k=k.to(dtype), v=torch.randn(B, T, heads, value_dim, generator=gen).to(dtype),
        g=g.to(dtype), beta=torch.rand(B, T, heads, generator=gen).to(dtype),
        initial_state=torch.randn(B if N is None else N, heads, key_dim, value_dim, generator=gen),
    )
    return {name: x.to(device) for name, x in inputs.items()}


def run_with_grads(fn, inputs: dict, **kwargs) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Run fn on leaf copies of inputs; backprop fixed random weights of o and the final state.

    Returns o, the final state, and the gradient of every input.
    """
    leaves = {name: x.detach().clone().requires_grad_() for name, x in inputs.items()}
    o, state = fn(**leaves, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(123)
    loss = (o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum()
    loss = loss + (state * torch.randn(state.shape, generator=gen).to(o.device)).sum()
    loss.backward()
    return o.detach(), state.detach(), {name: x.grad for name, x in leaves.items()}


def assert_matches(actual: tuple, expected: tuple, tol: float, grad_tol: float | None = None):
    """Compare (o, state, grads) from run_with_grads; grad_tol defaults to tol."""
    (o, state, grads), (o_ref, state_ref, grads_ref) = actual, expected
    grad_tol = tol if grad_tol is None else grad_tol
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert rel_err(o, o_ref) < tol, f"o: {rel_err(o, o_ref):.2e}"
    assert rel_err(state, state_ref) < tol, f"final state: {rel_err(state, state_ref):.2e}"
    for name, grad_ref in grads_ref.items():
        assert torch.isfinite(grads[name]).all(), f"d{name} is not finite"
        err = rel_err(grads[name], grad_ref)
        assert err < grad_tol, f"d{name}: {err:.2e}"


# ---- the reference itself ----------------------------------------------------------------------

def test_naive_matches_the_spec_formula_unrolled_by_hand():
    inputs = make_inputs(B=1, T=2)
    q, k, v, g, beta, S = (inputs[name][0] for name in ("q", "k", "v", "g", "beta", "initial_state"))
    scale = 0.7
    outputs = []
    for t in range(2):  # S_t = (I - b k k^T) Diag(exp g) S_{t-1} + b k v^T;  o_t = S_t^T (scale q_t)
        S = torch.stack([
            (torch.eye(K) - beta[t, h] * torch.outer(k[t, h], k[t, h])) @ torch.diag(g[t, h].exp()) @ S[h]
            + beta[t, h] * torch.outer(k[t, h], v[t, h])
            for h in range(H)])
        outputs.append(torch.stack([S[h].T @ (scale * q[t, h]) for h in range(H)]))

    o, state = naive_recurrent_kda(**inputs, scale=scale, output_final_state=True)
    assert rel_err(o[0], torch.stack(outputs)) < 1e-6
    assert rel_err(state[0], S) < 1e-6


def test_naive_l2norm_flag_is_the_spec_normalisation():
    inputs = make_inputs(B=2, T=9, normalise_qk=False)
    o_flag, _ = naive_recurrent_kda(**inputs, use_qk_l2norm_in_kernel=True)
    by_hand = {**inputs,
               "q": inputs["q"] / torch.sqrt((inputs["q"] ** 2).sum(-1, keepdim=True) + 1e-6),
               "k": inputs["k"] / torch.sqrt((inputs["k"] ** 2).sum(-1, keepdim=True) + 1e-6)}
    o_hand, _ = naive_recurrent_kda(**by_hand)
    o_raw, _ = naive_recurrent_kda(**inputs)
    assert rel_err(o_flag, o_hand) < 1e-6
    assert rel_err(o_raw, o_hand) > 1e-2  # the flag does something


def test_naive_default_scale_and_dtypes():
    inputs = make_inputs(B=1, T=5, dtype=torch.bfloat16)
    o, state = naive_recurrent_kda(**inputs, output_final_state=True)
    o_scaled, _ = naive_recurrent_kda(**inputs, scale=K ** -0.5)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert torch.equal(o, o_scaled)
    assert naive_recurrent_kda(**inputs)[1] is None


# ---- chunked against the reference -------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 63, 100, 257])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_chunk_matches_naive_forward_and_backward(T, dtype, tol):
    inputs = make_inputs(B=2, T=T, dtype=dtype, seed=T)
    expected = run_with_grads(naive_recurrent_kda, inputs)
    actual = run_with_grads(chunk_kda_torch, inputs)
    assert actual[0].dtype == dtype and actual[1].dtype == torch.float32
    assert_matches(actual, expected, tol)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 32, 128])
def test_chunk_sizes(chunk_size):
    inputs = make_inputs(B=1, T=100, seed=chunk_size)
    assert_matches(run_with_grads(chunk_kda_torch, inputs, chunk_size=chunk_size),
                   run_with_grads(naive_recurrent_kda, inputs), 1e-4)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_unbounded_decay_is_finite_and_matches(chunk_size):
    inputs = make_inputs(B=2, T=150, decay="unbounded", seed=7)
    assert inputs["g"].min() < -200  # the decay that would overflow exp(+G) is really there
    assert_matches(run_with_grads(chunk_kda_torch, inputs, chunk_size=chunk_size),
                   run_with_grads(naive_recurrent_kda, inputs), 1e-4)


def test_chunk_l2norm_flag():
    inputs = make_inputs(B=2, T=70, normalise_qk=False, seed=3)
    assert_matches(run_with_grads(chunk_kda_torch, inputs, use_qk_l2norm_in_kernel=True),
                   run_with_grads(naive_recurrent_kda, inputs, use_qk_l2norm_in_kernel=True), 1e-4)


def test_chunk_without_initial_state():
    inputs = make_inputs(B=2, T=40, seed=4)
    del inputs["initial_state"]
    assert_matches(run_with_grads(chunk_kda_torch, inputs, chunk_size=16),
                   run_with_grads(naive_recurrent_kda, inputs), 1e-4)


# ---- packed sequences and carried state --------------------------------------------------------

@pytest.mark.parametrize("cuts", [[0, 5, 70, 100], [0, 0, 37, 37, 100]])
@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda_torch])
def test_cu_seqlens_equals_each_sequence_alone(cuts, fn):
    N = len(cuts) - 1
    inputs = make_inputs(B=1, T=cuts[-1], N=N, decay="unbounded", seed=N)
    packed = run_with_grads(fn, inputs, cu_seqlens=torch.tensor(cuts))

    def one_by_one(q, k, v, g, beta, initial_state, output_final_state):
        outputs, states = [], []
        for n, (start, end) in enumerate(zip(cuts, cuts[1:])):
            if start == end:  # an empty sequence passes its state through
                states.append(initial_state[n])
                continue
            piece = dict(q=q, k=k, v=v, g=g, beta=beta)
            o, state = naive_recurrent_kda(**{name: x[:, start:end] for name, x in piece.items()},
                                           initial_state=initial_state[n:n + 1],
                                           output_final_state=output_final_state)
            outputs.append(o)
            states.append(state[0])
        return torch.cat(outputs, dim=1), torch.stack(states)

    assert_matches(packed, run_with_grads(one_by_one, inputs), 1e-4)


@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda_torch])
def test_splitting_a_sequence_and_carrying_the_state(fn):
    inputs = make_inputs(B=2, T=90, seed=11)
    o_full, state_full = fn(**inputs, output_final_state=True)
    first = {name: x[:, :41] if name != "initial_state" else x for name, x in inputs.items()}
    second = {name: x[:, 41:] for name, x in inputs.items() if name != "initial_state"}
    o_1, state_1 = fn(**first, output_final_state=True)
    o_2, state_2 = fn(**second, initial_state=state_1, output_final_state=True)
    assert rel_err(torch.cat([o_1, o_2], dim=1), o_full) < 1e-5
    assert rel_err(state_2, state_full) < 1e-5


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda_torch])
def test_bad_inputs_are_refused(fn):
    inputs = make_inputs(B=2, T=10, N=2)
    with pytest.raises(ValueError, match="batch size 1"):
        fn(**inputs, cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(ValueError, match="initial_state"):
        fn(**{**inputs, "initial_state": inputs["initial_state"][:1]})
    with pytest.raises(ValueError, match="beta"):
        fn(**{**inputs, "beta": inputs["beta"][..., :1]})
    packed = make_inputs(B=1, T=10, N=2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        fn(**packed, cu_seqlens=torch.tensor([0, 6, 9]))


def test_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_torch(**make_inputs(B=1, T=4), chunk_size=0)


# ---- backend choice ----------------------------------------------------------------------------

def test_backend_default_on_cpu_is_torch(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    backend = select_kda_backend("cpu")
    assert isinstance(backend, KDABackend)
    assert backend.name == "torch" and "'cpu'" in backend.reason
    assert backend.chunk is chunk_kda_torch and backend.recurrent is naive_recurrent_kda
    assert "torch" in str(backend) and backend.reason in str(backend)


def test_backend_default_on_cuda_without_fla(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("fla is installed here; tests/ops/test_kda_gpu.py covers that case")
    backend = select_kda_backend(torch.device("cuda", 0))
    assert backend.name == "torch" and "fla" in backend.reason


@pytest.mark.parametrize("name,chunk", [("naive", naive_recurrent_kda), ("torch", chunk_kda_torch)])
def test_backend_env_override(monkeypatch, name, chunk):
    monkeypatch.setenv(BACKEND_ENV, name)
    backend = select_kda_backend("cpu")
    assert backend.name == name and BACKEND_ENV in backend.reason
    assert backend.chunk is chunk and backend.recurrent is naive_recurrent_kda


def test_backend_fla_on_cpu_is_an_error(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "fla")
    with pytest.raises(RuntimeError, match="'cpu'"):
        select_kda_backend("cpu")


def test_backend_unknown_name_is_an_error(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")
    with pytest.raises(ValueError, match="triton"):
        select_kda_backend("cpu")


@pytest.mark.parametrize("has_gate_args", [True, False], ids=["fla-0.6", "older-fla"])
def test_fused_path_only_with_an_fla_that_names_the_in_kernel_gate(monkeypatch, has_gate_args):
    """The fused KDA path passes chunk_kda the in-kernel gate's arguments; an fla whose chunk_kda does not name them
    (it takes **kwargs, so it would ignore them and decay by the raw gate input) keeps the reference chains."""
    import sys
    import types

    from openk3.ops.kda.backend import FUSED_ARGUMENTS, _select

    def chunk_kda(q, k, v, g, beta, scale=None, use_gate_in_kernel=False, safe_gate=False, lower_bound=None,
                  **kwargs):
        raise AssertionError("never called")

    def old_chunk_kda(q, k, v, g, beta, scale=None, **kwargs):
        raise AssertionError("never called")

    fla = types.ModuleType("fla")
    fla.__version__ = "0.0-test"
    kda = types.ModuleType("fla.ops.kda")
    kda.chunk_kda = chunk_kda if has_gate_args else old_chunk_kda
    for name, module in [("fla", fla), ("fla.ops", types.ModuleType("fla.ops")), ("fla.ops.kda", kda)]:
        monkeypatch.setitem(sys.modules, name, module)
    _select.cache_clear()
    try:
        backend = _select("cuda", None, True)
        off = _select("cuda", None, False)
    finally:
        _select.cache_clear()
    assert backend.name == "fla" and backend.fused == has_gate_args
    assert has_gate_args or all(a in backend.reason for a in FUSED_ARGUMENTS)
    assert off.name == "fla" and not off.fused


def test_forget_kda_backends_chooses_again(monkeypatch):
    """select_kda_backend keeps its choices in a plain dict in front of the cached _select (for dynamo), so a choice
    stays until forget_kda_backends clears both (clearing _select's cache alone would leave it in the dict)."""
    import openk3.ops.kda.backend as backend_module

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    backend_module.forget_kda_backends()
    try:
        monkeypatch.setattr(backend_module, "_why_fla_cannot_run", lambda device_type: "reason one")
        assert backend_module.select_kda_backend("cpu").reason.startswith("reason one")
        monkeypatch.setattr(backend_module, "_why_fla_cannot_run", lambda device_type: "reason two")
        assert backend_module.select_kda_backend("cpu").reason.startswith("reason one")  # still the first choice
        backend_module.forget_kda_backends()
        assert backend_module.select_kda_backend("cpu").reason.startswith("reason two")
    finally:
        backend_module.forget_kda_backends()
