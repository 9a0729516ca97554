"""Helpers shared by the tests: error metrics (computed in float64), the Triton-interpreter child run."""

import torch


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
