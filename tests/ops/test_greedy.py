"""The greedy pick kernel (openk3/ops/greedy.py) against the PyTorch chain it replaces in the fast decode step
(argmax, log_softmax at the token, isfinite / all over the fp32 logits).

On the CPU the kernel runs in Triton's interpreter, in a child pytest started with TRITON_INTERPRET=1 (the
`test_interpreted_*` tests); skipped without triton (CI has none). The GPU tests run the real kernel.
"""

import pytest
import torch

from openk3.ops import greedy as greedy_module
from openk3.ops.greedy import greedy_pick, greedy_pick_applies
from tests.helpers import INTERPRETED, cuda, interpreted_only, interpreter_child_test, needs_triton


test_kernels_under_the_interpreter = interpreter_child_test(__file__)


def chain(logits):
    """The fast decode step's greedy sampler without the kernel (serve/sampler.py `sample_batch`, static.py)."""
    x = logits.float()
    tokens = x.argmax(-1)
    return tokens, torch.log_softmax(x, -1).gather(1, tokens[:, None])[:, 0], torch.isfinite(x).all(-1)


def check(logits, block=None):
    want_tokens, want_logprobs, want_finite = chain(logits)
    assert greedy_pick_applies(logits)
    for _ in range(2):  # the second call counts its programs in the counters the first reset
        tokens, logprobs, finite = greedy_pick(logits, block)
        assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32 and finite.dtype == torch.bool
        assert torch.equal(finite, want_finite)
        ok = want_finite
        assert torch.equal(tokens[ok], want_tokens[ok])
        torch.testing.assert_close(logprobs[ok], want_logprobs[ok], rtol=2e-6, atol=2e-6)


def random_logits(B, V, dtype, seed, device="cpu", scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, V, generator=g) * scale).to(device, dtype)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, V, block", [(1, 5000, None), (3, 777, 64), (2, 64, 64), (4, 300, 16)])
def test_interpreted_pick_equals_chain(B, V, block, dtype):
    """Slices of `block` logits (the last partial, and with a power-of-two count of slices, empty ones after it)."""
    check(random_logits(B, V, dtype, seed=B * V), block)


@interpreted_only
def test_interpreted_ties_non_finite_and_saturated_rows():
    """The largest logit repeated in several slices: the first index (torch.argmax's); a row with a NaN, one with
    an inf: not finite, the other rows exact; a row of one dominant logit (log-probability ~0) and one at the
    largest fp32 magnitudes that do not overflow exp's argument."""
    x = random_logits(6, 700, torch.float32, seed=1)
    x[0, [650, 90, 300]] = 50.0  # ties across three slices of 64: the first index wins
    x[1, 5] = float("nan")
    x[2, 699] = float("inf")
    x[3, 400] = 1e4
    x[4] = x[4] * 1e30
    x[5, 0] = -float("inf")  # -inf alone is not finite either
    check(x, block=64)
    tokens, logprobs, finite = greedy_pick(x, 64)
    assert tokens[0].item() == 90 and finite.tolist() == [True, False, False, True, True, False]
    assert logprobs[3].item() == 0.0


@needs_triton
@pytest.mark.skipif(INTERPRETED, reason="the interpreter compiles nothing")
def test_kernel_compiles_for_sm90_without_spills():
    """What the interpreter cannot check: Triton compiles the kernel for the H200 (bf16 logits, 16 slices of 2,048),
    with no register spilled."""
    from tests.ops.test_moe_gemv import compile_for_sm90
    types = {"logits_ptr": "*bf16", "part_ptr": "*fp32", "tickets_ptr": "*i32", "token_ptr": "*i64",
             "logprob_ptr": "*fp32", "finite_ptr": "*i1"}
    usage = compile_for_sm90(greedy_module._greedy_kernel, types, {"BLOCK": greedy_module.BLOCK, "SPLITS": 16})
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage


def test_applies_only_where_it_can_run(monkeypatch):
    x = torch.randn(2, 100)
    if not INTERPRETED:
        assert not greedy_pick_applies(x)  # the CPU without the interpreter
    monkeypatch.setattr(greedy_module, "INTERPRET", True)  # as in the interpreter: where it runs
    assert greedy_pick_applies(x) == (greedy_module.triton is not None)
    assert not greedy_pick_applies(x.double())
    assert not greedy_pick_applies(x.t())  # rows not contiguous
    assert not greedy_pick_applies(x[0])
    assert not greedy_pick_applies(x.clone().requires_grad_())


@cuda
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_pick_equals_chain(B, dtype):
    """kimi-linear-1.5b's vocabulary (32,000: 16 slices) and K3's (163,840)."""
    for V in (32000, 163840):
        check(random_logits(B, V, dtype, seed=B + V, device="cuda"))
    x = random_logits(B, 32000, torch.float32, seed=3, device="cuda")
    x[0, [31999, 7, 20000]] = 40.0
    x[-1, 3] = float("nan")
    check(x)
