import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from openk3.ops.moe import (COUNT_ORDER_MAX_SLOTS, expert_order, grouped_mm_supported, moe_experts_grouped,
                            moe_experts_loop)
from openk3.ops.mxfp import fake_quant_mxfp4
from openk3.ops.situ import situ_glu, swiglu
from tests.helpers import rel_norm_err


def random_moe(T: int, D: int, F: int, E: int, K: int, used_experts: list[int], dtype=torch.float32, seed: int = 0):
    """Random tokens, expert weights and routing; only ``used_experts`` receive tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).to(dtype)
    w1 = (torch.randn(E, F, D, generator=gen) / D**0.5).to(dtype)
    w3 = (torch.randn(E, F, D, generator=gen) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, F, generator=gen) / F**0.5).to(dtype)
    scores = torch.rand(T, len(used_experts), generator=gen)
    topk_w, slot = scores.topk(K, dim=-1)
    topk_idx = torch.tensor(used_experts)[slot]
    topk_w = topk_w / topk_w.sum(-1, keepdim=True)
    return x, topk_idx, topk_w, w1, w2, w3


def hand_computed(x, topk_idx, topk_w, w1, w2, w3, act):
    """Per token, per chosen expert, in float64."""
    x, w1, w2, w3, topk_w = (t.double() for t in (x, w1, w2, w3, topk_w))
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            h = act(w1[e] @ x[t], w3[e] @ x[t])
            y[t] += topk_w[t, k] * (w2[e] @ h)
    return y


@pytest.mark.parametrize("act", [situ_glu, swiglu])
def test_loop_matches_per_token_hand_computation(act):
    inputs = random_moe(T=7, D=12, F=20, E=5, K=2, used_experts=[0, 2, 3, 4])
    x = inputs[0] * 3  # push the activations out of their near-linear range
    y = moe_experts_loop(x, *inputs[1:], act)
    assert y.dtype == torch.float32 and y.shape == (7, 12)
    assert rel_norm_err(y, hand_computed(x, *inputs[1:], act)) < 1e-6


CASES = [
    # T, E, K, used experts (the others get no tokens, including ones in the middle and at the end)
    (37, 6, 2, [0, 1, 3, 4]),
    (1, 5, 3, [1, 2, 4]),
    (50, 4, 1, [0, 1, 2, 3]),
]


@pytest.mark.parametrize("T, E, K, used", CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_matches_loop_forward_and_backward(T, E, K, used, dtype, tol):
    D, F = 16, 24
    inputs = random_moe(T, D, F, E, K, used, dtype=dtype, seed=T)
    grad_y = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for fn in (moe_experts_loop, moe_experts_grouped):
        leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        y = fn(*leaves, situ_glu)
        y.backward(grad_y)
        results.append((y, [t.grad for t in leaves if t.is_floating_point()]))
    (y_loop, grads_loop), (y_grouped, grads_grouped) = results
    assert y_grouped.dtype == dtype
    assert rel_norm_err(y_grouped, y_loop) < tol
    names = ["x", "topk_w", "w1", "w2", "w3"]
    for name, g_grouped, g_loop in zip(names, grads_grouped, grads_loop):
        assert rel_norm_err(g_grouped, g_loop) < tol, name
    # Experts that received no tokens get exactly zero weight gradient from both.
    unused = [e for e in range(E) if e not in used]
    for g in grads_grouped[2:]:
        assert (g[unused] == 0).all() and (g[used] != 0).any()


def test_weight_fn_is_applied_to_all_three_weights():
    x, topk_idx, topk_w, w1, w2, w3 = random_moe(T=19, D=32, F=64, E=4, K=2, used_experts=[0, 1, 3])
    y_loop = moe_experts_loop(x, topk_idx, topk_w, w1, w2, w3, swiglu, weight_fn=fake_quant_mxfp4)
    y_grouped = moe_experts_grouped(x, topk_idx, topk_w, w1, w2, w3, swiglu, weight_fn=fake_quant_mxfp4)
    quantized = [fake_quant_mxfp4(w) for w in (w1, w2, w3)]
    y_prequantized = moe_experts_loop(x, topk_idx, topk_w, *quantized, swiglu)
    assert rel_norm_err(y_loop, y_prequantized) < 1e-6
    assert rel_norm_err(y_grouped, y_prequantized) < 1e-5
    assert rel_norm_err(y_loop, moe_experts_loop(x, topk_idx, topk_w, w1, w2, w3, swiglu)) > 1e-2


def test_grouped_mm_support_is_reported_not_silently_replaced():
    assert grouped_mm_supported("cpu", torch.float32)[0]
    assert grouped_mm_supported("cpu", torch.bfloat16)[0]
    ok, reason = grouped_mm_supported("cpu", torch.float64)
    assert not ok and "torch.float64" in reason
    inputs = random_moe(T=5, D=8, F=8, E=3, K=2, used_experts=[0, 1, 2], dtype=torch.float64)
    with pytest.raises(ValueError, match="torch.float64.*moe_experts_loop"):
        moe_experts_grouped(*inputs, swiglu)
    # bf16 needs D and F to be multiples of 8 (16-byte strides).
    inputs = random_moe(T=5, D=16, F=12, E=3, K=2, used_experts=[0, 1, 2], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 8.*F=12"):
        moe_experts_grouped(*inputs, swiglu)


def test_bad_inputs_raise():
    x, topk_idx, topk_w, w1, w2, w3 = random_moe(T=5, D=8, F=12, E=3, K=2, used_experts=[0, 1, 2])
    with pytest.raises(ValueError, match=r"w2 must be \[3, 8, 12\]"):
        moe_experts_loop(x, topk_idx, topk_w, w1, w2.transpose(1, 2), w3, swiglu)
    with pytest.raises(ValueError, match="ids in 0..2, got min 0, max 3"):
        moe_experts_loop(x, torch.where(topk_idx == 2, 3, topk_idx), topk_w, w1, w2, w3, swiglu)
    with pytest.raises(ValueError, match="share one dtype"):
        moe_experts_grouped(x, topk_idx, topk_w, w1.bfloat16(), w2, w3, swiglu)


def test_moe_experts_follows_the_environment_without_being_told(monkeypatch):
    """The backend `moe_experts` runs is chosen again when OPENK3_MOE_BACKEND / OPENK3_MOE_GEMV change, even after a
    first call cached a choice (it is keyed on them), and a bad value is an error naming it."""
    from openk3 import ops
    moe = random_moe(5, 16, 8, 4, 2, [0, 1, 2, 3])
    monkeypatch.delenv("OPENK3_MOE_BACKEND", raising=False)
    monkeypatch.delenv("OPENK3_MOE_GEMV", raising=False)
    want = ops.moe_experts(*moe, swiglu)  # the default choice, now cached
    calls = []

    def loop_spy(*args, **kw):
        calls.append(1)
        return moe_experts_loop(*args, **kw)
    monkeypatch.setattr(ops, "moe_experts_loop", loop_spy)
    monkeypatch.setenv("OPENK3_MOE_BACKEND", "loop")
    assert rel_norm_err(ops.moe_experts(*moe, swiglu), want) < 1e-6 and calls == [1]
    monkeypatch.setenv("OPENK3_MOE_GEMV", "bogus")
    with pytest.raises(ValueError, match="OPENK3_MOE_GEMV='bogus'"):
        ops.moe_experts(*moe, swiglu)


def sorted_order(expert_S: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What moe_experts_grouped did before `expert_order`: a stable sort, then searchsorted for the end rows."""
    sorted_S, order_S = torch.sort(expert_S, stable=True)
    return order_S, torch.searchsorted(sorted_S, torch.arange(E), right=True, out_int32=True)


def assert_same_order(expert_S: torch.Tensor, E: int) -> None:
    order_S, offs_E = expert_order(expert_S, E)
    want_order, want_offs = sorted_order(expert_S, E)
    assert order_S.dtype == torch.int64 and offs_E.dtype == torch.int32
    assert torch.equal(order_S, want_order) and torch.equal(offs_E, want_offs)


@pytest.mark.parametrize("ids, E", [
    ([3], 5),  # S = 1
    ([2] * 9, 4),  # every slot on one expert, the others empty
    ([4, 0, 4, 1, 0, 4, 4, 1], 6),  # ties (kept in slot order), experts 2, 3 and 5 empty
    ([1, -1, 5, 0, 1, 7, -1], 5),  # ids outside 0..E-1, as the sort places them (no expert's, or expert 0's rows)
])
def test_expert_order_by_counting_equals_the_stable_sort(ids, E):
    assert_same_order(torch.tensor(ids), E)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.lists(st.integers(0, 39), min_size=1, max_size=300))
def test_expert_order_equals_the_stable_sort_for_random_ids(E, ids):
    """Random ids (many experts left without tokens), up to 300 slots: the counting path equals the sort."""
    assert_same_order(torch.tensor(ids) % E, E)


def test_expert_order_counts_up_to_the_limit_and_sorts_above(monkeypatch):
    """COUNT_ORDER_MAX_SLOTS slots are counted, one more sorted (torch.sort called once), both as the sort gives."""
    ids = torch.randint(0, 8, (COUNT_ORDER_MAX_SLOTS + 1,), generator=torch.Generator().manual_seed(0))
    lengths = (COUNT_ORDER_MAX_SLOTS, COUNT_ORDER_MAX_SLOTS + 1)
    want = [sorted_order(ids[:n], 8) for n in lengths]
    real, calls = torch.sort, []
    monkeypatch.setattr(torch, "sort", lambda x, **k: calls.append(x.numel()) or real(x, **k))
    for n, (order, offs) in zip(lengths, want):
        got_order, got_offs = expert_order(ids[:n], 8)
        assert torch.equal(got_order, order) and torch.equal(got_offs, offs)
    assert calls == [COUNT_ORDER_MAX_SLOTS + 1]
