"""Quantile Balancing (spec 4.1): the toy case, convergence on a skewed router, histogram vs exact."""

import pytest
import torch
import torch.distributed as dist

from openk3.train.balance import (QuantileHistogram, balance_residuals, expert_load, load_stats, quantile_balance_exact,
                                  route, sign_update)


def skewed_scores(m: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """Router scores where expert j's logit carries an offset from -3 (starved) to +3 (flooded)."""
    offset_N = torch.linspace(-3.0, 3.0, n)
    return torch.sigmoid(torch.randn(m, n, generator=generator) + offset_N)


def test_toy_case_from_the_spec():
    # m=8 tokens, n=4 experts, k=1. With zero bias the top-1 choices give loads (4, 3, 1, 0);
    # one update must give every expert q = m k / n = 2 tokens. Scores are distinct within each
    # row, and the new routing wins every token by at least 0.08, so no tie decides the result.
    scores = torch.tensor([
        [0.90, 0.79, 0.88, 0.40],
        [0.71, 0.13, 0.10, 0.59],
        [0.83, 0.73, 0.60, 0.23],
        [0.31, 0.85, 0.29, 0.11],
        [0.95, 0.76, 0.48, 0.41],
        [0.09, 0.81, 0.42, 0.62],
        [0.36, 0.93, 0.94, 0.45],
        [0.21, 0.93, 0.63, 0.23],
    ])
    bias = torch.zeros(4)
    assert expert_load(route(scores, bias, k=1), 4).tolist() == [4, 3, 1, 0]
    new_bias = quantile_balance_exact(scores, bias, k=1)
    assert abs(float(new_bias.sum())) < 1e-6
    assert expert_load(route(scores, new_bias, k=1), 4).tolist() == [2, 2, 2, 2]
    top2 = (scores + new_bias).topk(2, dim=1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 0.07


def test_exact_bias_counts_q_residuals_below_it():
    # For whole q, b_j (before centring) is the order statistic at position q: at most q of the
    # r_.j lie below it and at least q + 1 at or below it. NOTE: r has an atom at the old bias
    # (r_ij = bias_j wherever j is token i's (k+1)-th choice), so "exactly q below" needs no ties.
    g = torch.Generator().manual_seed(1)
    m, n, k = 301, 7, 2                                      # q = 86
    scores = torch.rand(m, n, generator=g)
    bias = 0.1 * torch.randn(n, generator=g)
    r = balance_residuals(scores, bias, k)
    b = quantile_balance_exact(scores, bias, k)
    b_uncentred = r.sort(dim=0).values[m * k // n]
    assert torch.allclose(b, b_uncentred - b_uncentred.mean(), atol=1e-6)
    assert ((r < b_uncentred).sum(0) <= m * k // n).all()
    assert ((r <= b_uncentred).sum(0) >= m * k // n + 1).all()


def test_exact_fractional_q_interpolates_between_order_statistics():
    g = torch.Generator().manual_seed(2)
    m, n, k = 10, 4, 1                                        # q = 2.5
    scores = torch.rand(m, n, generator=g)
    bias = torch.zeros(n)
    r_sorted = balance_residuals(scores, bias, k).sort(dim=0).values
    expected = 0.5 * (r_sorted[2] + r_sorted[3])
    assert torch.allclose(quantile_balance_exact(scores, bias, k), expected - expected.mean(), atol=1e-6)


def test_skewed_router_balances_in_a_few_updates_and_sign_update_does_not():
    g = torch.Generator().manual_seed(0)
    m, n, k, updates = 16384, 16, 4, 6
    exact_bias, hist_bias, sign_bias = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for _ in range(updates):
        scores = skewed_scores(m, n, g)                       # fresh tokens every step
        exact_bias = quantile_balance_exact(scores, exact_bias, k)
        hist = QuantileHistogram(hist_bias, k)
        hist.update(scores[:5000])                            # two micro-batches
        hist.update(scores[5000:])
        hist_bias = hist.bias()
        sign_bias = sign_update(sign_bias, expert_load(route(scores, sign_bias, k), n))
    scores = skewed_scores(m, n, g)
    start = load_stats(expert_load(route(scores, torch.zeros(n), k), n))
    assert start["max_over_mean"] > 3.0
    for bias in (exact_bias, hist_bias):
        stats = load_stats(expert_load(route(scores, bias, k), n))
        assert stats["max_over_mean"] < 1.1
        assert stats["dead"] == 0
    assert load_stats(expert_load(route(scores, sign_bias, k), n))["max_over_mean"] > 3.0


def exact_quantiles(scores, bias, k):
    """b before centring, straight from the definition: r_.j sorted, read at position q."""
    m, n = scores.shape
    r_sorted = balance_residuals(scores, bias, k).sort(dim=0).values.double()
    q = m * k / n
    lo = int(q)
    return r_sorted[lo] + (q - lo) * (r_sorted[lo + 1] - r_sorted[lo])


@pytest.mark.parametrize("m, n, k", [(4096, 12, 3), (5003, 10, 3)])   # q whole, q fractional
def test_histogram_matches_exact_within_a_bin(m, n, k):
    g = torch.Generator().manual_seed(3)
    scores = skewed_scores(m, n, g)
    bias = 0.5 * torch.randn(n, generator=g)
    hist = QuantileHistogram(bias, k, bins=1000)
    hist.update(scores)
    exact_b = exact_quantiles(scores, bias, k)
    assert torch.allclose(quantile_balance_exact(scores, bias, k), (exact_b - exact_b.mean()).float(),
                          atol=1e-6)
    # compared before centring: centring would mix the errors of all experts
    err = (hist.quantiles() - exact_b).abs().max()
    assert err < hist.bin_width
    assert err > 1e-4 * hist.bin_width                      # the histogram really quantised
    assert (hist.bias() - quantile_balance_exact(scores, bias, k)).abs().max() < 2 * hist.bin_width


def test_histogram_interpolates_inside_the_bin():
    # Dense data (about 40 r values per bin per expert): interpolating the cumulative count
    # lands far closer than a bin's middle would (which averages a quarter of a bin off).
    g = torch.Generator().manual_seed(3)
    m, n, k = 4096, 12, 3
    scores = skewed_scores(m, n, g)
    bias = 0.5 * torch.randn(n, generator=g)
    hist = QuantileHistogram(bias, k, bins=100)
    hist.update(scores)
    err_in_bins = (hist.quantiles() - exact_quantiles(scores, bias, k)).abs() / hist.bin_width
    assert float(err_in_bins.mean()) < 0.1


def test_histogram_reading_is_in_the_exact_order_statistics_bin():
    # Whole q, coarse bins: the reading lies in the bin of the exact order statistic.
    g = torch.Generator().manual_seed(4)
    m, n, k = 999, 9, 2                                       # q = 222
    scores = torch.rand(m, n, generator=g)
    bias = 0.3 * torch.randn(n, generator=g)
    hist = QuantileHistogram(bias, k, bins=50)
    hist.update(scores)
    bin_of_exact = ((exact_quantiles(scores, bias, k) - hist.lo) / hist.bin_width).floor()
    bin_of_reading = ((hist.quantiles() - hist.lo) / hist.bin_width).floor()
    assert torch.equal(bin_of_reading, bin_of_exact)


def test_histogram_accumulates_over_calls():
    g = torch.Generator().manual_seed(5)
    n, k = 8, 2
    bias = 0.2 * torch.randn(n, generator=g)
    first, second = torch.rand(333, n, generator=g), torch.rand(170, n, generator=g)
    split = QuantileHistogram(bias, k, bins=64)
    split.update(first)
    split.update(second)
    whole = QuantileHistogram(bias, k, bins=64)
    whole.update(torch.cat([first, second]))
    assert split.counts.dtype == torch.int64
    assert torch.equal(split.counts, whole.counts)
    assert int(split.counts.sum()) == (333 + 170) * n
    assert torch.equal(split.bias(), whole.bias())


def test_histogram_all_reduce_runs_on_a_process_group(tmp_path):
    # One gloo rank: the all-reduce must accept the int64 counts and leave them as they are.
    g = torch.Generator().manual_seed(8)
    hist = QuantileHistogram(torch.randn(6, generator=g), k=2, bins=32)
    hist.update(torch.rand(77, 6, generator=g))
    before = hist.counts.clone()
    hist.all_reduce_()                                        # no process group yet: a no-op
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        hist.all_reduce_()
    finally:
        dist.destroy_process_group()
    assert torch.equal(hist.counts, before)


def test_histogram_range_covers_every_residual():
    # r = alpha - s lies in [beta - 1, beta + 1], beta the (k+1)-th largest bias, edges included:
    # saturated fp32 sigmoids give scores of exactly 0 and 1, which reach both edges.
    g = torch.Generator().manual_seed(6)
    m, n, k = 2000, 6, 2
    scores = torch.sigmoid(40 * torch.randn(m, n, generator=g))
    assert (scores == 0).any() and (scores == 1).any()
    bias = 3 * torch.randn(n, generator=g)
    beta = float(bias.sort(descending=True).values[k])
    r = balance_residuals(scores, bias, k)
    hist = QuantileHistogram(bias, k)
    assert (hist.lo, hist.hi) == (beta - 1, beta + 1)
    assert float(r.min()) == pytest.approx(hist.lo, abs=1e-6)
    assert float(r.max()) == pytest.approx(hist.hi, abs=1e-6)
    assert float(r.min()) >= hist.lo - 1e-6 and float(r.max()) <= hist.hi + 1e-6
    hist.update(scores)
    assert int(hist.counts.sum()) == m * n


def test_sign_update_moves_each_bias_by_the_rate():
    bias = torch.tensor([0.5, -0.25, 0.0, 1.0])
    loads = torch.tensor([10.0, 2.0, 6.0, 6.0])               # mean 6
    new = sign_update(bias, loads, rate=1e-3)
    assert torch.allclose(new - bias, torch.tensor([-1e-3, 1e-3, 0.0, 0.0]))


def test_expert_load_and_stats():
    idx = torch.tensor([[0, 2], [2, 3], [0, 2]])
    counts = expert_load(idx, 5)
    assert counts.tolist() == [2, 0, 3, 1, 0]
    stats = load_stats(counts)
    assert stats["max_over_mean"] == pytest.approx(3 / 1.2)
    assert stats["min_over_mean"] == 0.0
    assert stats["dead"] == 2
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        expert_load(idx, 3)


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="k=4"):
        quantile_balance_exact(torch.rand(5, 4), torch.zeros(4), k=4)
    with pytest.raises(ValueError, match=r"\[3\]"):
        quantile_balance_exact(torch.rand(5, 3), torch.zeros(4), k=1)
    with pytest.raises(ValueError, match="empty"):
        QuantileHistogram(torch.zeros(4), k=1).bias()
