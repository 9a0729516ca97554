"""Sampling for the inference engine: a request's `SamplingParams`, the distribution it draws from
(`filtered_probs`), one token per batch row (`sample_tokens`) and speculative sampling's acceptance rule
(`accept_draft`). Pure functions of logits and a request's generator; the engine (engine.py) calls them."""

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


def sample_tokens(logits_BV: Tensor, reqs: list) -> list[int]:
    """One token per row: argmax for greedy requests, else a draw from `filtered_probs` with the request's own
    generator. reqs: the engine's `Request`s of the rows (their `.params` and `.generator` are read)."""
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
