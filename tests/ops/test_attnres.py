import math

import pytest
import torch

from openk3.ops.attnres import attnres_mix
from tests.helpers import rel_norm_err


def random_inputs(S: int, shape: tuple[int, ...], dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    D = shape[-1]
    # Sources of very different magnitudes, as the embedding and deep block sums are.
    scales = torch.logspace(-1, 2, S).reshape(S, *[1] * len(shape))
    sources = (scales * torch.randn(S, *shape, generator=gen)).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(D, generator=gen)).to(dtype)
    proj_weight = (0.5 * torch.randn(D, generator=gen)).to(dtype)
    return sources, norm_weight, proj_weight


def test_matches_hand_computation():
    S, T, D, eps = 3, 2, 5, 1e-5
    sources, norm_weight, proj_weight = random_inputs(S, (T, D))
    out, weights = attnres_mix(list(sources), norm_weight, proj_weight, eps, return_weights=True)
    V, nw, pw = sources.tolist(), norm_weight.tolist(), proj_weight.tolist()
    for t in range(T):
        logits = []
        for j in range(S):
            rms = math.sqrt(sum(v * v for v in V[j][t]) / D + eps)
            logits.append(sum(V[j][t][d] / rms * nw[d] * pw[d] for d in range(D)))
        top = max(logits)
        exps = [math.exp(z - top) for z in logits]
        probs = [e / sum(exps) for e in exps]
        expected = [sum(probs[j] * V[j][t][d] for j in range(S)) for d in range(D)]
        assert rel_norm_err(out[t], torch.tensor(expected)) < 1e-6
        assert rel_norm_err(weights[:, t], torch.tensor(probs)) < 1e-6


def test_zero_pseudo_query_gives_uniform_average():
    sources, norm_weight, _ = random_inputs(4, (3, 7, 33))
    out, weights = attnres_mix(sources, norm_weight, torch.zeros(1, 33), 1e-5, return_weights=True)
    assert torch.equal(weights, torch.full_like(weights, 0.25))
    assert rel_norm_err(out, sources.mean(0)) < 1e-6


def test_list_and_stacked_sources_agree_and_proj_shapes_agree():
    sources, norm_weight, proj_weight = random_inputs(5, (2, 9, 40))
    stacked = attnres_mix(sources, norm_weight, proj_weight, 1e-5)
    listed = attnres_mix(list(sources), norm_weight, proj_weight.reshape(1, 40), 1e-5)
    assert stacked.shape == (2, 9, 40)
    assert torch.equal(stacked, listed)


def test_weights_are_a_softmax_over_sources_and_ignore_source_scale():
    sources, norm_weight, proj_weight = random_inputs(6, (11, 24))
    _, weights = attnres_mix(sources, norm_weight, proj_weight, 1e-8, return_weights=True)
    assert weights.shape == (6, 11) and weights.dtype == torch.float32
    assert rel_norm_err(weights.sum(0), torch.ones(11)) < 1e-6
    # Keys are RMS-normalised, so rescaling one source changes the output but not its weight.
    rescaled = sources.clone()
    rescaled[2] *= 1000.0
    out_rescaled, weights_rescaled = attnres_mix(rescaled, norm_weight, proj_weight, 1e-8, return_weights=True)
    assert rel_norm_err(weights_rescaled, weights) < 1e-5
    assert rel_norm_err(out_rescaled, attnres_mix(sources, norm_weight, proj_weight, 1e-8)) > 1.0


def test_gradients_by_finite_differences():
    sources, norm_weight, proj_weight = random_inputs(3, (2, 6), dtype=torch.float64, seed=1)
    inputs = tuple(t.clone().requires_grad_() for t in (sources, norm_weight, proj_weight))
    assert torch.autograd.gradcheck(lambda v, n, p: attnres_mix(v, n, p, 1e-5), inputs)
    assert torch.autograd.gradcheck(
        lambda v, n, p: attnres_mix(list(v), n, p, 1e-5, return_weights=True)[1], inputs
    )


def test_bf16_inputs_are_mixed_in_fp32():
    sources, norm_weight, proj_weight = random_inputs(4, (5, 64), dtype=torch.bfloat16, seed=2)
    out, weights = attnres_mix(sources, norm_weight, proj_weight, 1e-5, return_weights=True)
    assert out.dtype == torch.bfloat16 and weights.dtype == torch.float32
    out_fp32 = attnres_mix(sources.float(), norm_weight.float(), proj_weight.float(), 1e-5)
    assert torch.equal(out, out_fp32.to(torch.bfloat16))


def test_bad_inputs_raise():
    sources, norm_weight, proj_weight = random_inputs(2, (3, 8))
    with pytest.raises(ValueError, match="empty"):
        attnres_mix([], norm_weight, proj_weight, 1e-5)
    with pytest.raises(ValueError, match="shapes"):
        attnres_mix([sources[0], sources[1, :2]], norm_weight, proj_weight, 1e-5)
    with pytest.raises(ValueError, match=r"norm_weight must be \[8\], got \(7,\)"):
        attnres_mix(sources, norm_weight[:7], proj_weight, 1e-5)
    with pytest.raises(ValueError, match=r"proj_weight must be \[8\] or \[1, 8\], got \(2, 8\)"):
        attnres_mix(sources, norm_weight, torch.randn(2, 8), 1e-5)
