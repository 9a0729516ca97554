"""Sampling for the inference engine: a request's `SamplingParams`, the distribution it draws from
(`filtered_probs`), one token per batch row (`sample_tokens`) and speculative sampling's acceptance rule
(`accept_draft`). Pure functions of logits and a request's generator; the engine (engine.py) calls them.

The fast decode path (docs/engine.md) samples the whole batch at once on the device instead: `batch_filtered_probs`
(`filtered_probs` with per-row temperature / top-k / top-p tensors) and `sample_batch`, whose randomness is a
counter-based hash of (request seed, token index, vocabulary id), so a seeded request draws the same tokens
whatever shares its batch, with no generator object and no host sync (it can be captured in a CUDA graph)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 is greedy; otherwise softmax(logits / temperature), restricted to
    the top_k most likely tokens (0 = all), then to the smallest set whose probability reaches top_p.
    `stop_token_ids`: generation ends after one of them (it is part of the output); None = the model's eos.
    `seed` makes the request's sampling reproducible whatever else shares the batch."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be a positive integer")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be a non-negative integer (0 = off)")
        # NOTE: the fast decode path carries the seed in an int64 tensor (`sample_batch`): a larger one would fail
        # in the middle of a batch's step, not here (the server's bound is the same)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed={self.seed!r}: must be an integer in [0, 2**63) or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probs(logits_V: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a sampled (temperature > 0) request draws from, fp32 [V]: softmax(logits / temperature),
    kept to the top_k most likely tokens, then to the smallest most-likely set whose mass reaches top_p."""
    # NOTE: float64 and the max subtracted first: a tiny temperature (1e-300 is 0 in fp32) would otherwise give inf/inf
    logits_V = logits_V.double()
    probs = torch.softmax((logits_V - logits_V.max()) / params.temperature, dim=-1).float()
    if params.top_k == 0 and params.top_p >= 1:
        return probs
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if params.top_k:
        keep[params.top_k:] = False
    sorted_p = sorted_p * keep
    sorted_p = sorted_p / sorted_p.sum()
    # a token stays if the mass of the tokens before it is still below top_p (so the first always stays)
    keep &= (sorted_p.cumsum(0) - sorted_p) < params.top_p
    keep[0] = True  # NOTE: a tiny top_p (1e-300 is 0 in fp32) must still keep the most likely token
    sorted_p = sorted_p * keep
    return torch.zeros_like(probs).scatter(0, order, sorted_p / sorted_p.sum())


def batch_filtered_probs(logits_BV: Tensor, temperature_B: Tensor, top_k_B: Tensor, top_p_B: Tensor) -> Tensor:
    """`filtered_probs` of every row at once, fp32 [B, V], with per-row temperature (float64: a tiny temperature
    must not round to 0), top_k (int, 0 = all) and top_p tensors [B]. Rows with temperature 0 (greedy) get the
    distribution of temperature 1; `sample_batch` takes their argmax instead."""
    logits_BV = logits_BV.double()
    t = torch.where(temperature_B > 0, temperature_B.double(), 1.0)[:, None]
    probs = torch.softmax((logits_BV - logits_BV.max(-1, keepdim=True).values) / t, dim=-1).float()
    V = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    k = torch.where(top_k_B > 0, top_k_B, V)[:, None]
    keep = torch.arange(V, device=probs.device)[None, :] < k
    sorted_p = sorted_p * keep
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    # as filtered_probs: a token stays if the mass before it is still below top_p; the first always stays
    keep &= (sorted_p.cumsum(-1) - sorted_p) < top_p_B[:, None]
    keep[:, 0] = True
    sorted_p = sorted_p * keep
    return torch.zeros_like(probs).scatter(-1, order, sorted_p / sorted_p.sum(-1, keepdim=True))


_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (two rounds of xorshift-multiply, multiplier 0x45d9f3b) on int64 tensors holding
    values < 2**32. NOTE: the multiplier is below 2**27, so no product overflows int64."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def counter_uniform(seed_B: Tensor, counter_B: Tensor, V: int) -> Tensor:
    """Uniform numbers in (0, 1), float64 [B, V], a pure function of (seed, counter, column): row b's numbers
    depend on its own seed_B[b] (int64, all 64 bits) and counter_B[b] (int64, taken mod 2**32) only."""
    col = torch.arange(V, device=seed_B.device, dtype=torch.long)[None, :]
    # NOTE: both halves of the seed: seeds that differ only above bit 31 (rollout seeds are 63-bit hashes) must
    # not share a stream
    seed = _mix32(_mix32(seed_B & _MASK32) ^ ((seed_B >> 32) & _MASK32))
    h = _mix32(seed ^ (counter_B & _MASK32))
    x = _mix32(_mix32(h[:, None] ^ col) ^ 0x9E3779B9)
    return (x.double() + 0.5) / 2.0 ** 32


def sample_batch(logits_BV: Tensor, temperature_B: Tensor, top_k_B: Tensor, top_p_B: Tensor, seed_B: Tensor,
                 counter_B: Tensor, greedy_only: bool = False) -> tuple[Tensor, Tensor]:
    """One token per row on the device, no Python loop over rows and no host sync: argmax for rows with
    temperature 0, else an exact draw from `batch_filtered_probs` by the exponential race (argmax p_v / E_v with
    E_v = -log U_v, U from `counter_uniform(seed, counter)`; the engine passes the request's sampling seed and the
    index of the token being drawn). `greedy_only` skips the sampling work when the caller knows every row is
    greedy. -> (tokens [B] int64, fp32 log-probabilities of them under the raw logits [B])."""
    logits_BV = logits_BV.float()
    tokens = logits_BV.argmax(-1)
    if not greedy_only:
        p = batch_filtered_probs(logits_BV, temperature_B, top_k_B, top_p_B)
        race = p.double() / -counter_uniform(seed_B, counter_B, p.shape[-1]).log()
        tokens = torch.where(temperature_B > 0, race.argmax(-1), tokens)
    logprobs = torch.log_softmax(logits_BV, -1).gather(1, tokens[:, None])[:, 0]
    return tokens, logprobs


def sample_tokens(logits_BV: Tensor, reqs: list) -> list[int]:
    """One token per row: argmax for greedy requests, else a draw from `filtered_probs` with the request's own
    generator (the general decode path and every prefill's first token; the fast path uses `sample_batch`).
    reqs: the engine's `Request`s of the rows (their `.params` and `.generator` are read)."""
    tokens = logits_BV.argmax(-1).tolist()
    for b, r in enumerate(reqs):
        if not r.params.greedy:
            tokens[b] = int(torch.multinomial(filtered_probs(logits_BV[b], r.params), 1, generator=r.generator))
    return tokens


def accept_draft(drafted: list[int], p_KV: Tensor, q_KV: Tensor | None, target_argmax: list[int],
                 generator: torch.Generator | None) -> list[int]:
    """Speculative sampling for one request (Leviathan et al. 2023; Chen et al. 2023): the tokens it emits.

    drafted: the k draft tokens; p_KV: target probabilities at the k + 1 verify positions [k+1, V]; q_KV: the
    draft's probabilities [k, V] for the drafted tokens (None for greedy requests); target_argmax: argmax of the
    target logits at each position. Draft token i is accepted with probability min(1, p_i(d) / q_i(d)); at the
    first rejection a token is drawn from normalise(max(p_i - q_i, 0)) and the round ends; if all k are accepted
    a bonus token is drawn from p_k. The emitted tokens are then distributed exactly as the target's own samples.
    Greedy requests (q_KV None) accept exactly the draft tokens equal to the target's argmax."""
    out = []
    for i, d in enumerate(drafted):
        if q_KV is None:
            if d != target_argmax[i]:
                return out + [target_argmax[i]]
        else:
            u = float(torch.rand(1, generator=generator, device=p_KV.device))
            if not u * float(q_KV[i, d]) < float(p_KV[i, d]):
                residual = (p_KV[i] - q_KV[i]).clamp_min(0)
                total = float(residual.sum())
                residual = residual / total if total > 0 else p_KV[i]
                return out + [int(torch.multinomial(residual, 1, generator=generator))]
        out.append(d)
    if q_KV is None:
        return out + [target_argmax[-1]]
    return out + [int(torch.multinomial(p_KV[-1], 1, generator=generator))]
