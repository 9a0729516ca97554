"""Decode caches, passed explicitly to `K3ForCausalLM.forward` (STYLE rule 5): the KDA recurrent state and conv
tail, the MLA latent cache, and `K3Cache`, one of them per layer for a batch of equal-length sequences.

The engine's paged, ragged cache (openk3/serve/cache.py) builds on the same per-layer pieces."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from openk3.config import K3Config


@dataclass
class KDAState:
    """Per-layer KDA decode state: the recurrent state [B, H, K, V] fp32 and the conv tail
    [B, W-1, 3*H*K] (the last W-1 projected q|k|v inputs, before the conv).

    A forward called with `keep_inputs=True` also leaves its per-token inputs in `inputs` (any other forward
    leaves None there): "qkv" (the raw projections
    [B, T, 3*H*K] that feed the conv tail), "k" [B, T, H, K] and "v" [B, T, H, V] (after conv and SiLU), "g"
    [B, T, H, K] and "beta" [B, T, H] (fp32). Speculative decoding rolls the state back by recomputing an accepted
    prefix from them instead of copying the state per draft token (openk3/serve/cache.py `rollback_kda`)."""

    recurrent: Tensor
    conv: Tensor
    inputs: dict[str, Tensor] | None = None
    # a forward from this state over more than RECURRENT_SEGMENT_TOKENS new tokens runs fla's chunked kernel, also
    # where a cached forward of that length runs the token-by-token one (model.py RECURRENT_MAX_TOKENS): that choice
    # saves chunk_kda's host time, which a forward captured in a CUDA graph does not pay (serve/static.py `prefill`)
    chunked: bool = False

    @classmethod
    def zeros(cls, config: K3Config, batch: int, device=None, dtype=torch.float32) -> "KDAState":
        """The state before any token: recurrent [B, H, K, K] fp32, conv tail [B, W-1, 3*H*K] in `dtype`."""
        lac = config.linear_attn_config
        H, K, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
        return cls(recurrent=torch.zeros(batch, H, K, K, device=device),
                   conv=torch.zeros(batch, W - 1, 3 * H * K, device=device, dtype=dtype))


@dataclass
class MLAState:
    """Per-layer MLA latent cache: [B, max_len, kv_lora + rope] ([c | k_pe], normed c), filled up to `length`.

    `GatedMLA` uses a cache only through `append`, so the engine's paged cache for ragged batches
    (openk3/serve/cache.py `PagedMLA`) can stand in for it. The protocol: `append(lat [B, T, C])` writes the new
    latents and returns (every latent the new queries attend to [B, S, C], mask), where the mask is [B or 1, 1, T, S]
    bool (True = may attend) for rows with different histories, or None when every row's S keys are exactly its
    S - T cached tokens then the T new ones: query t sees keys 0..S - T + t (lower-right causal), which lets a
    prefill chunk attend through a flash kernel without a dense mask. A cache with a true `paged` attribute (the
    fast decode step's, serve/static.py `StaticMLA`) also offers `append_paged`, which `GatedMLA` calls instead when
    it attends in latent space: its pages are then read in place by a kernel (openk3/ops/mla_decode.py)."""

    latent: Tensor
    length: int = 0

    def append(self, lat_BTC: Tensor) -> tuple[Tensor, None]:
        """Write T new latents after the cached ones. Returns every latent the new queries attend to [B, S, C]
        (S = the length after the write) and None for the mask: every row holds the same tokens, so query t sits
        at position length + t and sees keys 0..length + t."""
        T = lat_BTC.shape[1]
        P = self.length
        if P + T > self.latent.shape[1]:
            raise ValueError(f"MLA cache full: {P} + {T} tokens > max_len {self.latent.shape[1]}")
        self.latent[:, P:P + T] = lat_BTC.to(self.latent.dtype)
        self.length = P + T
        return self.latent[:, :P + T], None


@dataclass
class K3Cache:
    """Decode caches for a batch of equal-length sequences, one entry per layer.

    The engine's paged, ragged cache builds on the same per-layer pieces."""

    layers: list = field(default_factory=list)

    @classmethod
    def empty(cls, config: K3Config, batch: int, max_len: int, device=None, dtype=torch.float32) -> "K3Cache":
        layers = []
        for kind in config.layer_types:
            if kind == "kda":
                layers.append(KDAState.zeros(config, batch, device, dtype))
            else:
                width = config.kv_lora_rank + config.qk_rope_head_dim
                layers.append(MLAState(latent=torch.zeros(batch, max_len, width, device=device, dtype=dtype)))
        return cls(layers)

    @property
    def length(self) -> int:
        for s in self.layers:
            if isinstance(s, MLAState):
                return s.length
        raise ValueError("cache has no MLA layer to read the length from")


class SlotKDAState:
    """Per-layer KDA decode state of a batch whose rows live in preallocated pools, addressed by row: the engine's
    fast decode path (docs/engine.md "Fast decode path"). It reads like a `KDAState` (the model only gets and sets
    `recurrent` and `conv` and sets `inputs`), but getting gathers the batch's rows out of the pools
    [N, H, K, K] fp32 and [N, W-1, 3*H*K], and setting writes them back in place (`index_copy_`), so requests join
    and leave by slot assignment and no batch tensor is ever rebuilt. (serve/static.py `SlotPool` keeps every
    layer's rows in one pool of each kind; `rows` are this layer's rows of the batch there.)

    `recurrent` and `conv` (optional): the rows already gathered (the static step gathers every layer's rows in one
    op, serve/static.py `SlotPool.view`); gets return them until a set writes the pool.
    `token_rows` (optional, [B, T], column T - 1 = `rows`): a speculative verification over T tokens a row that
    keeps the state after every token, the one after token t in pool row token_rows[b, t] (fla's kernel writes them,
    model.py `forward_fused`); its rollback is then a copy of one row (serve/static.py `StaticDecoder.rollback`).
    NOTE: rows that only pad a batch to its CUDA-graph bucket point at a scratch slot and write what they computed
    there; whoever pads (the static step) zeroes the scratch slot again after its forward (`SlotPool.clear_scratch`)."""

    def __init__(self, recurrent_pool: Tensor, conv_pool: Tensor, rows: Tensor, recurrent: Tensor | None = None,
                 conv: Tensor | None = None, chunked: bool = False, token_rows: Tensor | None = None,
                 accepted: Tensor | None = None):
        self.recurrent_pool, self.conv_pool, self.rows = recurrent_pool, conv_pool, rows
        self._gathered = {"recurrent": recurrent, "conv": conv}
        self.inputs: dict[str, Tensor] | None = None
        self.chunked = chunked  # see KDAState.chunked
        self.token_rows, self.accepted = token_rows, accepted  # accepted: [B] int32, all T (`pool_token_rows`)

    def pool_rows(self) -> tuple[Tensor, Tensor]:
        """(the recurrent pool [N, H, K, K] fp32, the batch's rows in it [B]) for a kernel that updates the rows in
        place (ops/kda/fused.py `recurrent_gated`); rows gathered before are stale after it."""
        self._gathered["recurrent"] = None
        return self.recurrent_pool, self.rows

    def conv_pool_rows(self) -> tuple[Tensor, Tensor]:
        """(the conv pool [N, W-1, 3*H*K], the batch's rows in it [B]) for a kernel that updates the conv tails in
        place (ops/kda/conv_step.py `conv_step_in_place`); tails gathered before are stale after it."""
        self._gathered["conv"] = None
        return self.conv_pool, self.rows

    def pool_token_rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """`pool_rows` for a verification that keeps every token's state (`token_rows`): (the pool, token_rows
        [B, T], `accepted` [B] int32, all T: the kernel reads row b's state from token_rows[b, T - 1])."""
        self._gathered["recurrent"] = None
        return self.recurrent_pool, self.token_rows, self.accepted

    def _read(self, name: str, pool: Tensor) -> Tensor:
        rows = self._gathered[name]
        return pool.index_select(0, self.rows) if rows is None else rows

    def _write(self, name: str, pool: Tensor, value: Tensor) -> None:
        self._gathered[name] = None  # stale now
        pool.index_copy_(0, self.rows, value.to(pool.dtype))

    @property
    def recurrent(self) -> Tensor:
        return self._read("recurrent", self.recurrent_pool)

    @recurrent.setter
    def recurrent(self, value: Tensor) -> None:
        self._write("recurrent", self.recurrent_pool, value)

    @property
    def conv(self) -> Tensor:
        return self._read("conv", self.conv_pool)

    @conv.setter
    def conv(self, value: Tensor) -> None:
        self._write("conv", self.conv_pool, value)
