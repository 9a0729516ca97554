"""Quantile Balancing: the router bias update of K3's MoE, and load statistics.

Spec section 4.1. The router picks experts by `topk(s + bias, k)` with s the fp32 sigmoid scores;
the bias only steers selection and gets no gradient. Once per optimizer step the bias is set, with
no learning rate, so that each expert would have received its fair share q = m k / n of the step's
m tokens:

    alpha_i = (k+1)-th largest of (s_i + bias)     token i's cutoff: the best expert it did not pick
    r_ij    = alpha_i - s_ij                       the bias expert j needs to win token i
    b_j     = the value with exactly q of r_.j below it
    bias    = b - mean(b)                          only differences between biases route anything

Two ways to get b:
- `quantile_balance_exact` sorts the r of every token: a reference for one process and the tests.
- `QuantileHistogram` counts r into fixed bins. Counts add up over micro-batches and over ranks
  (one integer all-reduce per layer per step), and the quantile is read off the cumulative counts.

`sign_update` is DeepSeek-V3's rule (bias_j += rate * sign(mean load - load_j)), kept as the
baseline the tests compare against.

Precision: scores and biases are cast to fp32 here (the router already produces fp32 scores, spec 4);
quantile arithmetic that involves token counts runs in fp64 so that m k / n is exact for any
realistic m.
"""

import torch
from torch import Tensor

from openk3.ops.moe import route  # noqa: F401  (the selection the bias steers; the model's Router calls it too)


def _check_router_inputs(scores_MN: Tensor, bias_N: Tensor, k: int) -> None:
    if scores_MN.ndim != 2 or scores_MN.shape[0] == 0:
        raise ValueError(f"scores must be [tokens, experts] with at least one token, "
                         f"got shape {tuple(scores_MN.shape)}")
    n = scores_MN.shape[1]
    if bias_N.shape != (n,):
        raise ValueError(f"bias must be [experts] = [{n}], got shape {tuple(bias_N.shape)}")
    if not 1 <= k < n:
        raise ValueError(f"k must be in [1, n_experts) = [1, {n}), got k={k}: balancing needs the "
                         f"(k+1)-th best expert of every token")


def balance_residuals(scores_MN: Tensor, bias_N: Tensor, k: int) -> Tensor:
    """r [M, N] fp32: r_ij = alpha_i - s_ij, the bias expert j would need to win token i.

    alpha_i is the (k+1)-th largest of s_i + bias. Expert j is in token i's top-k exactly when
    bias_j > r_ij (ties aside), so counting the r_.j below a candidate bias counts its tokens.
    """
    _check_router_inputs(scores_MN, bias_N, k)
    s_MN = scores_MN.float()
    alpha_M = (s_MN + bias_N.float()).topk(k + 1, dim=1).values[:, -1]
    return alpha_M[:, None] - s_MN


def target_load(m: int, n: int, k: int) -> float:
    """q = m k / n, the tokens each expert gets in a perfectly balanced step (may be fractional)."""
    return m * k / n


def quantile_balance_exact(scores_MN: Tensor, bias_N: Tensor, k: int) -> Tensor:
    """The new bias [N] fp32 from all M tokens of a step (padding removed), by sorting.

    scores_MN: raw router sigmoid scores; bias_N: the bias used to route them; k: experts per token.

    b_j is the order statistic at 0-based position q of r_.j sorted ascending: for whole q that is
    the (q+1)-th smallest, which has exactly q values below it when there are no ties
    (spec 4.1: "-(q+1)-th largest of s_.j - alpha"). A fractional q interpolates linearly between
    the order statistics at floor(q) and floor(q) + 1.
    NOTE: r has ties by construction: r_ij = bias_j (up to rounding) wherever j is token i's
    (k+1)-th choice. An expert that is already balanced has its order statistic at q on that atom,
    so its bias stays put. And at whole q the token at position q sits exactly on expert j's
    cutoff; which side it lands on after the update depends on how the other biases moved.
    """
    r_MN = balance_residuals(scores_MN, bias_N, k)
    m, n = r_MN.shape
    q = target_load(m, n, k)
    below = min(int(q), m - 1)
    above = min(below + 1, m - 1)
    frac = q - below
    r_sorted_MN = r_MN.sort(dim=0).values
    b_N = r_sorted_MN[below].double() * (1 - frac) + r_sorted_MN[above].double() * frac
    return (b_N - b_N.mean()).float()


class QuantileHistogram:
    """Per-expert histograms of r for one layer and one optimizer step, read out as a new bias.

    The bias must be the one the step routes with: it fixes both r and the histogram range, so
    build a fresh histogram for every step. `update` may be called once per micro-batch; `counts`
    [N, bins] is int64 so that ranks can sum it exactly with one all-reduce (`all_reduce_`).

    Range: s lies in [0, 1] (an fp32 sigmoid can round to exactly 0 or 1), so s_l + bias_l lies
    in [bias_l, bias_l + 1] for every expert l, and its (k+1)-th largest, alpha, in
    [beta, beta + 1] with beta the (k+1)-th largest bias. Hence r = alpha - s lies in
    [beta - 1, beta + 1], edges included. The spec's [min(bias) - 1, max(bias) + 1] contains this;
    the tighter range always has width 2, so a bin stays 2 / bins wide however far the biases
    spread. NOTE: fp32 rounding of r can step just past an edge; such values are clamped into the
    edge bin. `test_histogram_range_covers_every_residual` checks the range and that it is tight.

    Error: for whole q the reading lies in the same bin as the exact order statistic, so
    `quantiles()` is within one bin width of the exact b before centring (the centred biases
    within two). For fractional q the exact value interpolates towards the next order statistic,
    which adds at most the gap between neighbouring r values.
    """

    def __init__(self, bias_N: Tensor, k: int, bins: int = 1000):
        if bias_N.ndim != 1 or bias_N.numel() < 2:
            raise ValueError(f"bias must be [experts] with at least 2 experts, "
                             f"got shape {tuple(bias_N.shape)}")
        if bins < 1:
            raise ValueError(f"bins must be at least 1, got {bins}")
        if not 1 <= k < bias_N.numel():
            raise ValueError(f"k must be in [1, n_experts) = [1, {bias_N.numel()}), got k={k}")
        self.bias_N = bias_N.detach().float().clone()
        self.k = k
        self.bins = bins
        beta = float(self.bias_N.sort(descending=True).values[k])
        self.lo = beta - 1.0
        self.hi = beta + 1.0
        self.bin_width = (self.hi - self.lo) / bins
        n = bias_N.numel()
        self.counts = torch.zeros(n, bins, dtype=torch.int64, device=bias_N.device)

    def update(self, scores_MN: Tensor) -> None:
        """Count the r of M more tokens (scores [M, N] from routing with this histogram's bias)."""
        r_MN = balance_residuals(scores_MN, self.bias_N, self.k)
        n = r_MN.shape[1]
        # fp64 so that a bin index agrees with the fp64 edges lo + t * width used by quantiles()
        bin_MN = ((r_MN.double() - self.lo) / self.bin_width).floor().long().clamp_(0, self.bins - 1)
        flat_MN = bin_MN + torch.arange(n, device=bin_MN.device) * self.bins
        self.counts += torch.bincount(flat_MN.flatten(), minlength=n * self.bins).view(n, self.bins)

    def all_reduce_(self, group=None) -> None:
        """Sum the counts over the ranks of `group` (a no-op when torch.distributed is not running)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.counts, group=group)

    def quantiles(self) -> Tensor:
        """b [N] fp64 before centring: where each expert's count of r below reaches q.

        With C(e) the number of r below bin edge e, take for each expert the bin t with
        C(e_t) <= q < C(e_t+1) (it holds the order statistic at position q) and interpolate
        linearly inside it: b = e_t + (q - C(e_t)) / count_t * width.
        """
        m = int(self.counts[0].sum())
        if m == 0:
            raise ValueError("the histogram is empty: call update() with the step's scores first")
        n = self.counts.shape[0]
        q = target_load(m, n, self.k)
        upper_cum_NB = self.counts.cumsum(dim=1)
        # first bin whose upper cumulative count exceeds q; q < m so it always exists
        q_N1 = torch.full((n, 1), q, dtype=torch.float64, device=self.counts.device)
        t_N1 = torch.searchsorted(upper_cum_NB.double(), q_N1, right=True)
        count_N1 = self.counts.gather(1, t_N1).double()
        below_N1 = upper_cum_NB.gather(1, t_N1).double() - count_N1
        return (self.lo + (t_N1.double() + (q_N1 - below_N1) / count_N1) * self.bin_width).squeeze(1)

    def bias(self) -> Tensor:
        """The new bias [N] fp32: `quantiles()` minus their mean."""
        b_N = self.quantiles()
        return (b_N - b_N.mean()).float()


def all_reduce_histograms_(hists: list[QuantileHistogram], group=None) -> None:
    """Sum the counts of every layer's histogram over the ranks of `group` with ONE integer all-reduce (the layers'
    counts are concatenated), so a step of a data-parallel run costs one collective for balancing however many MoE
    layers there are. A no-op when torch.distributed is not running."""
    if not hists or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    flat = torch.cat([h.counts.flatten() for h in hists])
    torch.distributed.all_reduce(flat, group=group)
    for h, counts in zip(hists, flat.split([h.counts.numel() for h in hists])):
        h.counts.copy_(counts.view_as(h.counts))


def sign_update(bias_N: Tensor, loads_N: Tensor, rate: float = 1e-3) -> Tensor:
    """DeepSeek-V3's bias update: bias_j + rate * sign(mean(load) - load_j), as a new fp32 tensor."""
    if loads_N.shape != bias_N.shape:
        raise ValueError(f"loads must have the bias's shape {tuple(bias_N.shape)}, "
                         f"got {tuple(loads_N.shape)}")
    loads_N = loads_N.double()
    return (bias_N.double() + rate * torch.sign(loads_N.mean() - loads_N)).float()


def expert_load(topk_idx: Tensor, n: int) -> Tensor:
    """Tokens per expert, int64 [n], from selected expert indices of any shape (e.g. [M, k])."""
    counts_N = torch.bincount(topk_idx.flatten().long(), minlength=n)
    if counts_N.numel() != n:
        raise ValueError(f"expert indices must lie in [0, {n}), "
                         f"got one as large as {counts_N.numel() - 1}")
    return counts_N


def load_stats(counts_N: Tensor) -> dict[str, float]:
    """Balance summary of one layer's loads: max/mean, min/mean, coefficient of variation, dead count."""
    counts_N = counts_N.double()
    mean = counts_N.mean()
    if mean == 0:
        raise ValueError("load_stats needs at least one routed token, got all-zero loads")
    return {
        "max_over_mean": float(counts_N.max() / mean),
        "min_over_mean": float(counts_N.min() / mean),
        "cv": float(counts_N.std(correction=0) / mean),
        "dead": int((counts_N == 0).sum()),
    }
