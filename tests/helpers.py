"""Helpers shared by the tests: error metrics (computed in float64); the Triton kernels' markers and their
interpreter child run."""

import pytest
import torch

from openk3.ops import gemv as _any_kernel_module  # every kernel module imports triton (or not) the same way

# The kernel test files run their kernels on the CPU in Triton's interpreter, in a child pytest started with
# TRITON_INTERPRET=1 (`interpreter_child_test`); in that child INTERPRETED is True (the variable is read when the
# kernel modules, and triton, are imported).
TRITON = _any_kernel_module.triton is not None
INTERPRETED = _any_kernel_module.INTERPRET
needs_triton = pytest.mark.skipif(not TRITON, reason="triton is not installed")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
interpreted_only = pytest.mark.skipif(not INTERPRETED,
                                      reason="runs in the child that test_kernels_under_the_interpreter starts")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: the worst element against the scale of the reference."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


def rel_norm_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||: the error of the whole tensor (for quantizers and sums of many terms)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return ((actual - expected).norm() / expected.norm()).item()


def run_interpreted_child(test_file: str) -> None:
    """Run the `test_interpreted_*` tests of `test_file` in a child pytest with TRITON_INTERPRET=1 and assert they all
    passed. NOTE: a child process, because the variable must be set before triton itself is imported
    (triton.language's own helpers, tl.zeros and the rest, are jit functions decorated then), and the rest of the
    session imported it without."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "interpreted_",
                            test_file], env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout, child.stdout[-2000:]


def interpreter_child_test(test_file: str):
    """A test file's `test_kernels_under_the_interpreter` (assign it to that name in the file): its `test_interpreted_*`
    tests in a child pytest with TRITON_INTERPRET=1 (`run_interpreted_child`); skipped without triton and in the
    child itself."""
    @needs_triton
    @pytest.mark.skipif(INTERPRETED, reason="this is the child")
    def test_kernels_under_the_interpreter():
        run_interpreted_child(test_file)
    return test_kernels_under_the_interpreter
