"""Inference caches (K3_SPEC section 7): per-sequence KDA state, the paged MLA latent pool, the hybrid prefix cache.

Every sequence carries two caches. Its KDA layers keep a fixed-size state: the recurrent state [H, K, V] in fp32
and the conv tail [W-1, 3*H*K] (the last W-1 raw q|k|v projections). Its MLA layers keep a growing latent cache:
[c | k_pe] = kv_lora + rope values per token per MLA layer (576 for K3), nothing else.

    PagePool      one preallocated pool of equal pages. A page holds `page_size` tokens of latents for every MLA
                  layer, or a slice of a KDA checkpoint; the two kinds share one free list, so memory moves
                  between them as the workload asks. Pages are reference-counted; a sequence reaches its
                  latents through a page table (`PagedSeq`).
    PagedMLA      one MLA layer's view of the pool during one forward, for a ragged batch: it implements
                  `MLAState.append`, the only thing `GatedMLA` asks of a cache.
    rollback_kda  speculative decoding: set a KDA state back to "committed state + the first a_b tokens of the
                  segment" by recomputing from the segment's per-token inputs (no state copy per draft token).
    PrefixCache   the hybrid prefix cache: hashes every `hash_interval` tokens, KDA checkpoints at some of those
                  boundaries and at the ends of turns, LRU eviction.

Precision: latents are stored in the model's dtype; KDA checkpoints are stored in fp32 (the recurrent state is
fp32 anyway; the conv tail is widened, which is exact, and narrowed back on restore).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from openk3.config import K3Config
from openk3.model.state import K3Cache, KDAState
from openk3.ops.kda import select_kda_backend


# ------------------------------------------------------------------------------------------ host to device

def pinned_copies(device) -> bool:
    """Whether host-device copies on `device` go through pinned host memory with non_blocking=True: on CUDA only.
    NOTE: `cuda_tensor.copy_(cpu_tensor)` (non_blocking=False) synchronizes the stream, so an input copy between
    two decode steps would wait for the step in flight (docs/engine.md "Overlapping the host with the device"); on
    the CPU there is nothing to overlap, and pinning needs CUDA."""
    return torch.device(device).type == "cuda"


def upload(dst: Tensor, src: Tensor) -> Tensor:
    """dst.copy_(src) of a host tensor, queued behind the device's work without waiting for it (`pinned_copies`).
    NOTE: each call pins a fresh copy of `src`; PyTorch's caching host allocator hands that block out again only
    once the copy queued from it has run (it records an event on the stream for every non_blocking copy from
    pinned memory), so the host never rewrites memory a pending copy still reads."""
    if pinned_copies(dst.device):
        return dst.copy_(src.pin_memory(), non_blocking=True)
    return dst.copy_(src)


def device_tensor(values: list, device) -> Tensor:
    """torch.tensor(values, device=device) through `upload`: without waiting for the device's queued work."""
    src = torch.tensor(values)
    return upload(torch.empty(src.shape, dtype=src.dtype, device=device), src)


# ------------------------------------------------------------------------------------------ KDA state

def new_kda_states(config: K3Config, batch: int, device, dtype: torch.dtype) -> list[KDAState]:
    """Zero KDA states, one per KDA layer in layer order: recurrent [B, H, K, K] fp32, conv tail [B, W-1, 3*H*K].
    Every layer's state is a view of one zeroed tensor per kind (two fills for a request, not two a layer)."""
    L = config.layer_types.count("kda")
    if batch == 0 or L == 0:
        return [KDAState.zeros(config, batch, device, dtype) for _ in range(L)]
    whole = KDAState.zeros(config, L * batch, device, dtype)
    return [KDAState(r, c) for r, c in zip(whole.recurrent.split(batch), whole.conv.split(batch))]


def cat_kda_states(*parts: list[KDAState]) -> list[KDAState]:
    """The rows of every part one after another, layer by layer (a request joining the decode batch; requests
    prefilled together)."""
    return [KDAState(torch.cat([s.recurrent for s in layer]), torch.cat([s.conv for s in layer]))
            for layer in zip(*parts)]


def select_kda_rows(states: list[KDAState], rows: list[int]) -> list[KDAState]:
    """Only the given rows, in that order (requests leaving the decode batch)."""
    if not states:
        return []
    idx = torch.tensor(rows, dtype=torch.long, device=states[0].recurrent.device)
    return [KDAState(s.recurrent.index_select(0, idx), s.conv.index_select(0, idx)) for s in states]


def split_kda_rows(states: list[KDAState]) -> list[list[KDAState]]:
    """Every row's own batch-1 states (requests prefilled together going their own ways): views of the batch's
    tensors, no copy. Each row's view is its own memory, so one request's in-place updates never touch another's."""
    if not states:
        return []
    return [[KDAState(s.recurrent[b:b + 1], s.conv[b:b + 1]) for s in states] for b in range(len(states[0].recurrent))]


def rollback_kda(state: KDAState, committed: KDAState, inputs: dict[str, Tensor], keep_B: Tensor) -> None:
    """Speculative-decoding rollback of one KDA layer, in place on `state`.

    `committed` is the state before a segment of T tokens, `inputs` the segment's per-token inputs (the
    `KDAState.inputs` the layer kept: qkv [B, T, 3HK], k, v [B, T, H, K], g [B, T, H, K], beta [B, T, H]) and
    `keep_B` (int, in [0, T]) how many of its tokens each row keeps. The recurrence is recomputed from the committed
    state over the segment with the dropped tokens made inert (beta = 0 writes nothing, g = 0 decays nothing), so
    one batched call serves every row; the conv tail is re-read from the committed tail and the kept raw inputs.
    NOTE: `committed` is just the tensors the state held before the segment; the layer replaces (never mutates)
    them, so keeping a reference costs no copy."""
    k, v, g, beta, qkv = inputs["k"], inputs["v"], inputs["g"], inputs["beta"], inputs["qkv"]
    T = k.shape[1]
    live_BT = torch.arange(T, device=k.device)[None, :] < keep_B[:, None]
    g = g * live_BT[:, :, None, None]
    beta = beta * live_BT[:, :, None]
    # A segment is a few tokens (k + 1): the token-by-token kernel beats padding them to a chunk.
    # The state does not depend on q; k stands in for it, and the output is thrown away.
    recurrent = select_kda_backend(k.device).recurrent
    _, state.recurrent = recurrent(k, k, v, g, beta, scale=k.shape[-1] ** -0.5, initial_state=committed.recurrent,
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    state.conv = kept_conv_tail(committed.conv, qkv, keep_B)


def kept_conv_tail(tail: Tensor, qkv: Tensor, keep_B: Tensor) -> Tensor:
    """The conv tail after the first keep_B[b] of a segment's raw inputs qkv [B, T, 3HK], from the tail before the
    segment [B, W-1, 3HK]: the W-1 inputs before the first dropped one, in the tail's dtype."""
    W1 = tail.shape[1]
    full = torch.cat([tail, qkv.to(tail.dtype)], dim=1)  # [B, W-1+T, 3HK]
    idx_BW = keep_B[:, None] + torch.arange(W1, device=tail.device)[None, :]
    return full.gather(1, idx_BW[:, :, None].expand(-1, -1, full.shape[-1]))


# ------------------------------------------------------------------------------------------ the page pool

class PagePool:
    """A preallocated pool of `num_pages` equal pages on one device, shared by MLA latents and KDA checkpoints.

    As MLA storage the pool reads [num_pages, n_mla_layers, page_size, kv_lora + rope] in the model's dtype, so one
    page holds `page_size` tokens of every MLA layer. As checkpoint storage the same bytes read [num_pages, F] fp32;
    a KDA checkpoint (every KDA layer's recurrent state and conv tail) fills `checkpoint_pages` pages.
    Page 0 is never handed out: it is zero between forwards and pads page tables (see `PagedLayout`); the static
    decode step's padding rows write into it and zero it again after their forward (serve/static.py `StaticMLA`).

    Accounting: `refs[p]` counts the holders of page p (page tables, prefix-cache entries); at 0 it returns to the
    free list. `reserved` pages are promised to running sequences (their worst case), so a running sequence never
    waits for memory: admission control happens once, when a request is admitted."""

    def __init__(self, config: K3Config, num_pages: int, page_size: int, device, dtype: torch.dtype):
        self.mla_layers = [i for i, kind in enumerate(config.layer_types) if kind == "mla"]
        self.kda_layers = [i for i, kind in enumerate(config.layer_types) if kind == "kda"]
        if not self.mla_layers:
            raise ValueError("the engine's page pool is sized by MLA pages; this config has no MLA layer "
                             f"(full_attn_layers={config.linear_attn_config.full_attn_layers})")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size={page_size!r}: must be a positive integer")
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages={num_pages!r}: need at least 2 (page 0 is the zero page)")
        self.config = config
        self.page_size, self.num_pages, self.dtype = page_size, num_pages, dtype
        self.device = torch.device(device)
        self.width = config.kv_lora_rank + config.qk_rope_head_dim
        self.page_bytes = len(self.mla_layers) * page_size * self.width * dtype.itemsize
        if self.page_bytes % 4:
            raise ValueError(f"a page of {self.page_bytes} bytes cannot hold fp32 checkpoint data; use an even "
                             f"page_size (got {page_size})")
        # NOTE: zero-filled, and every page is zeroed again when handed out: masked attention still multiplies
        # the padding by a zero weight, and 0 * NaN (checkpoint bytes read as bf16 can be NaN) would be NaN.
        self.storage = torch.zeros(num_pages, self.page_bytes, dtype=torch.uint8, device=self.device)
        self.mla = self.storage.view(dtype).view(num_pages, len(self.mla_layers), page_size, self.width)
        self.f32 = self.storage.view(torch.float32)  # [num_pages, page_bytes / 4]

        lac = config.linear_attn_config
        H, K, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
        self.state_shapes = ((H, K, K), (W - 1, 3 * H * K))
        self.checkpoint_numel = len(self.kda_layers) * (H * K * K + (W - 1) * 3 * H * K)
        self.checkpoint_pages = math.ceil(self.checkpoint_numel * 4 / self.page_bytes)

        self.refs = [0] * num_pages
        self.free = list(range(num_pages - 1, 0, -1))  # a stack; page 0 is never free
        self.reserved = 0

    # ---- accounting
    @property
    def available(self) -> int:
        """Free pages not promised to a running sequence."""
        return len(self.free) - self.reserved

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can hold (every page but the zero page)."""
        return (self.num_pages - 1) * self.page_size

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, n: int, from_reserve: bool = False) -> list[int]:
        """Take n free pages (zeroed, one reference each); `from_reserve` spends a sequence's reservation."""
        if (len(self.free) if from_reserve else self.available) < n:
            raise RuntimeError(f"page pool exhausted: asked for {n} pages, {self.available} available "
                               f"({len(self.free)} free, {self.reserved} reserved)")
        if from_reserve:
            self.reserved -= n
        pages = [self.free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        # without waiting for the device's queued work (a decode step in flight): the page ids through `upload`, and
        # index_fill_ (`storage[ids] = 0` copies its 0 to the device and waits; torch.tensor(pages, device=) too:
        # two waits an alloc, 384 in a batch-64 run of bench/decode_probe.py run:64)
        self.storage.index_fill_(0, device_tensor(pages, self.device), 0)
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def reserve(self, n: int) -> None:
        if self.available < n:
            raise RuntimeError(f"cannot reserve {n} pages: {self.available} available")
        self.reserved += n

    def copy_page(self, src: int, from_reserve: bool = False) -> int:
        """A private copy of page `src` (copy-on-write of a shared, partly matched page)."""
        (dst,) = self.alloc(1, from_reserve)
        self.storage[dst] = self.storage[src]
        return dst

    # ---- KDA checkpoints
    def write_checkpoint(self, states: list[KDAState], row: int, pages: list[int]) -> None:
        """Store row `row` of every KDA layer's state into `pages` (fp32: the conv tail is widened exactly)."""
        parts = []
        for s in states:
            parts += [s.recurrent[row].reshape(-1).float(), s.conv[row].reshape(-1).float()]
        flat = torch.cat(parts)
        per_page = self.f32.shape[1]
        flat = torch.nn.functional.pad(flat, (0, len(pages) * per_page - flat.numel()))
        self.f32[device_tensor(pages, self.device)] = flat.view(len(pages), per_page)

    def read_checkpoint(self, pages: list[int]) -> list[KDAState]:
        """A fresh batch-1 copy of the checkpoint in `pages` (checkpoints are immutable: requests extend copies)."""
        flat = self.f32[torch.tensor(pages, device=self.device)].reshape(-1)  # advanced indexing copies
        (rec_shape, conv_shape) = self.state_shapes
        n_rec, n_conv = math.prod(rec_shape), math.prod(conv_shape)
        states, at = [], 0
        for _ in self.kda_layers:
            rec = flat[at:at + n_rec].view(1, *rec_shape)
            conv = flat[at + n_rec:at + n_rec + n_conv].view(1, *conv_shape).to(self.dtype)
            states.append(KDAState(rec, conv))
            at += n_rec + n_conv
        return states


@dataclass
class PagedSeq:
    """One sequence's place in a pool: its page table, how many tokens its cache holds, and the pages it may still
    allocate without asking (its reservation)."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    reserved: int = 0

    def grow(self, pool: PagePool, tokens: int) -> None:
        """Make the page table cover `tokens` positions, from the reservation."""
        need = pool.pages_for(tokens) - len(self.pages)
        if need > self.reserved:
            raise RuntimeError(f"sequence needs {need} more pages but has {self.reserved} reserved")
        if need > 0:
            self.pages += pool.alloc(need, from_reserve=True)
            self.reserved -= need

    def free(self, pool: PagePool) -> None:
        pool.release(self.pages)
        pool.reserved -= self.reserved
        self.pages, self.reserved = [], 0


@dataclass
class PagedLayout:
    """Where one forward's new tokens go in the pool and what each query may see; shared by every MLA layer.

    write_page, write_offset: [B*T] slot of every new token; read_pages: [B, P] page tables padded with the zero
    page; keys: the longest row's cached + new tokens; mask: [B, 1, T, P*page_size], True where query t of row b
    (position lengths[b] + t) may see the key, or None when every row holds the same number of tokens (always so for
    the engine's batch-1 prefill): then the first `keys` keys of every row are exactly its history and the new
    tokens, lower-right causal (the `MLAState.append` protocol), and no dense mask is built (at an 8K chunk after
    56K cached tokens it would be 512 MB)."""

    write_page: Tensor
    write_offset: Tensor
    read_pages: Tensor
    keys: int
    mask: Tensor | None

    @classmethod
    def build(cls, seqs: list[PagedSeq], T: int, page_size: int, device) -> "PagedLayout":
        """For rows that each append T tokens after their `length` (the page tables must already cover them)."""
        wp, wo = [], []
        for s in seqs:
            # position pos goes to page s.pages[pos // page_size] at offset pos % page_size, written per run of
            # positions inside one page: O(pages) Python steps, not O(T) (an 8,192-token chunk: 0.46 -> 0.15 ms)
            pos, end = s.length, s.length + T
            while pos < end:
                page, offset = divmod(pos, page_size)
                n = min(page_size - offset, end - pos)
                wp += [s.pages[page]] * n
                wo += range(offset, offset + n)
                pos += n
        keys = max(s.length for s in seqs) + T
        P = -(-keys // page_size)
        table = [p for s in seqs for p in s.pages[:P] + [0] * (P - min(P, len(s.pages)))]
        # one host-to-device copy for all three: a copy from pageable memory waits for the device's stream
        flat = torch.tensor(wp + wo + table, dtype=torch.long, device=device)
        n = len(wp)
        mask = None
        if len({s.length for s in seqs}) > 1:
            lengths = torch.tensor([s.length for s in seqs], device=device)
            key_pos = torch.arange(P * page_size, device=device)
            query_pos = lengths[:, None] + torch.arange(T, device=device)[None, :]  # [B, T]
            mask = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]
        return cls(flat[:n], flat[n:2 * n], flat[2 * n:].view(len(seqs), P), keys, mask)


class PagedMLA:
    """One MLA layer's paged latent cache for one forward of a ragged batch (the `MLAState.append` protocol)."""

    def __init__(self, pool: PagePool, mla_index: int, layout: PagedLayout):
        self.pool, self.index, self.layout = pool, mla_index, layout

    def append(self, lat_BTC: Tensor) -> tuple[Tensor, Tensor | None]:
        """Write the T new latents of every row into its pages, then gather each row's whole history.
        -> latents [B, P*page_size, C] (padding is masked) and the mask [B, 1, T, P*page_size]; for rows of one
        length, latents [B, S, C] cut to the S = length + T real keys (the pages pad beyond) and no mask."""
        lay, mla = self.layout, self.pool.mla
        mla[lay.write_page, self.index, lay.write_offset] = lat_BTC.reshape(-1, lat_BTC.shape[-1]).to(mla.dtype)
        lat = mla[lay.read_pages, self.index].flatten(1, 2)
        return (lat, lay.mask) if lay.mask is not None else (lat[:, :lay.keys], None)


def paged_cache(pool: PagePool, kda: list[KDAState], seqs: list[PagedSeq], T: int) -> K3Cache:
    """The per-layer caches one forward of `seqs` (T new tokens each) hands the model: the batch's KDA states and a
    `PagedMLA` view per MLA layer. Grows every page table to cover the new tokens first."""
    for s in seqs:
        s.grow(pool, s.length + T)
    layout = PagedLayout.build(seqs, T, pool.page_size, pool.device)
    layers, kda_it, mla_index = [], iter(kda), 0
    for kind in pool.config.layer_types:
        if kind == "kda":
            layers.append(next(kda_it))
        else:
            layers.append(PagedMLA(pool, mla_index, layout))
            mla_index += 1
    return K3Cache(layers)


# ------------------------------------------------------------------------------------------ prefix cache

@dataclass(eq=False)
class Node:
    """A published prefix: the tokens [start, end) after its parent's prefix (a full hash block, or a shorter
    turn-end tail), the pages holding their latents, and optionally the KDA checkpoint at `end`."""

    key: bytes
    parent_key: bytes
    parent: "Node | None"
    start: int
    end: int
    pages: list[int]  # page ids for page indices start // page_size .. (end - 1) // page_size
    checkpoint: list[int] | None = None
    children: int = 0
    pins: int = 0  # running requests whose page tables rely on this node
    checkpoint_pins: int = 0  # admissions about to restore this checkpoint
    used: int = 0  # LRU clock of the last time this prefix was used
    checkpoint_used: int = 0  # ... and of the last time its checkpoint was restored


@dataclass
class Match:
    """The reusable part of a prompt: `nodes` root to deepest (the deepest holds the checkpoint), `length` tokens."""

    nodes: list[Node]
    length: int


@dataclass
class PrefixPath:
    """What the prefix cache tracks for one request: the full-block nodes along its tokens so far (pinned until the
    request ends) and any pinned turn-end tails."""

    root: bytes
    blocks: list[Node] = field(default_factory=list)
    tails: list[Node] = field(default_factory=list)


class PrefixCache:
    """The hybrid prefix cache (K3_SPEC section 7, report section 5.4).

    Prefixes are hashed every `hash_interval` tokens as a chain (block i's key hashes block i-1's key and its
    tokens), starting from a root key that hashes the optional cache salt, so tenants with different salts never
    share anything. Each published block is a `Node` holding references to the pages with its latents. A node may
    also hold a KDA checkpoint (every KDA layer's state at its end, in `checkpoint_pages` pool pages), written at
    the checkpoint interval and at the end of every prompt and every finished turn; a turn that ends between
    boundaries gets a "tail" node for its last partial block.

    Rules, each with the line that enforces it:
      - a match is used only up to the deepest node with a checkpoint (every KDA layer restored at once) and
        leaves at least one prompt token to compute (`lookup`);
      - checkpoints are immutable; `PagePool.read_checkpoint` hands the request a copy;
      - a checkpoint's pages are allocated, pinned and freed as one unit, and a block is evicted only when it has
        no children, so evicting any part of a prefix also drops everything that depended on it (`_drop`);
      - nodes used by a running request are pinned and never evicted;
      - eviction is LRU over checkpoints and childless blocks; a hit refreshes only the blocks up to the point it
        resumed at and the one checkpoint it restored (`use`);
      - a node is published after its latents are written, and its checkpoint attached after it is written
        (`publish_blocks`, `checkpoint`): a lookup never sees a half-written state.
    Counters: queries, query_tokens, hit_tokens, evictions (blocks + checkpoints).

    NOTE: granularity. A hit resumes only at a usable node that ends before the prompt's last token: for a hybrid
    (KDA) model a node with a checkpoint, i.e. a multiple of the checkpoint interval, or the end of an earlier
    prompt or finished turn that is a strict prefix of this prompt; for an all-MLA model any multiple of
    `hash_interval`. So the same prompt sent twice reuses nothing below the first checkpoint interval (its own
    end checkpoint is at its last token, which must be recomputed), and an all-MLA prompt of at most
    `hash_interval` tokens never hits. A conversation's next turn, which extends the last one, does hit."""

    def __init__(self, pool: PagePool, hash_interval: int):
        if not isinstance(hash_interval, int) or hash_interval < 1:
            raise ValueError(f"hash_interval={hash_interval!r}: must be a positive integer")
        self.pool, self.h = pool, hash_interval
        self.nodes: dict[bytes, Node] = {}
        self.tail_lengths: dict[bytes, Counter] = {}  # parent key -> lengths of the tails hanging off it
        self.clock = 0
        self.queries = self.query_tokens = self.hit_tokens = 0
        self.evicted_blocks = self.evicted_checkpoints = 0

    @property
    def evictions(self) -> int:
        return self.evicted_blocks + self.evicted_checkpoints

    def counters(self) -> dict:
        return {"queries": self.queries, "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens,
                "evictions": self.evictions, "evicted_blocks": self.evicted_blocks,
                "evicted_checkpoints": self.evicted_checkpoints, "cached_blocks": len(self.nodes),
                "cached_checkpoints": sum(n.checkpoint is not None for n in self.nodes.values())}

    # ---- hashing
    @staticmethod
    def root_key(salt: str | None) -> bytes:
        return hashlib.blake2b(b"openk3-prefix\0" + (salt or "").encode("utf-8"), digest_size=16).digest()

    @staticmethod
    def chain(key: bytes, tokens: list[int]) -> bytes:
        return hashlib.blake2b(key + array("q", tokens).tobytes(), digest_size=16).digest()

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _usable(self, node: Node) -> bool:
        # A model without KDA layers needs no checkpoint: every block boundary is a resume point.
        return node.checkpoint is not None or not self.pool.kda_layers

    # ---- lookup and use
    def lookup(self, tokens: list[int], salt: str | None) -> Match:
        """The deepest reusable prefix of `tokens` (length 0 when nothing matches). Changes nothing."""
        limit = len(tokens) - 1  # the last prompt token is always computed: its logits give the first output
        key, pos, best = self.root_key(salt), 0, None
        blocks: list[Node] = []
        while True:
            for r in self.tail_lengths.get(key, ()):
                if pos + r <= limit:
                    tail = self.nodes.get(self.chain(key, tokens[pos:pos + r]))
                    if tail is not None and self._usable(tail) and (best is None or tail.end > best.end):
                        best = tail
            if pos + self.h > limit:
                break
            node = self.nodes.get(self.chain(key, tokens[pos:pos + self.h]))
            if node is None:
                break
            blocks.append(node)
            key, pos = node.key, node.end
            if self._usable(node):
                best = node
        if best is None:
            return Match([], 0)
        path = []
        node = best
        while node is not None:
            path.append(node)
            node = node.parent
        return Match(path[::-1], best.end)

    def pin(self, match: Match) -> None:
        """Pin a match's blocks and the checkpoint it resumes from together, before the admission makes room."""
        for n in match.nodes:
            n.pins += 1
        if match.nodes:
            match.nodes[-1].checkpoint_pins += 1

    def unpin(self, match: Match) -> None:
        """Undo `pin` (an admission that could not get its pages)."""
        for n in match.nodes:
            n.pins -= 1
        if match.nodes:
            match.nodes[-1].checkpoint_pins -= 1

    def use(self, match: Match, prompt_len: int, salt: str | None, seq: PagedSeq) -> tuple[PrefixPath, list | None]:
        """Start a request on a pinned `match`: give `seq` the matched latents (pages wholly inside the prefix are
        shared; a page the prefix ends inside is copied, from the reservation) and return the request's
        `PrefixPath` and a private copy of the checkpoint (None on a miss). Counts the query and refreshes the LRU
        clock of exactly what is used."""
        self.queries += 1
        self.query_tokens += prompt_len
        self.hit_tokens += match.length
        path = PrefixPath(self.root_key(salt))
        if not match.nodes:
            return path, None
        match.nodes[-1].checkpoint_pins -= 1  # copied below, before anything else can run
        ps, L = self.pool.page_size, match.length
        table: dict[int, int] = {}
        now = self._tick()
        # NOTE: when hash_interval is not a multiple of page_size, a page straddles two nodes, and each node's
        # publisher wrote it up to its own end only: the deeper node's copy is the one valid for the whole prefix.
        for n in match.nodes:
            n.used = now
            for j, p in enumerate(n.pages, start=n.start // ps):
                table[j] = p
            (path.tails if n.end - n.start < self.h else path.blocks).append(n)
        full = L // ps
        shared = [table[j] for j in range(full)]
        self.pool.retain(shared)
        seq.pages = shared + ([self.pool.copy_page(table[full], from_reserve=True)] if L % ps else [])
        seq.reserved -= len(seq.pages) - full
        seq.length = L
        last = match.nodes[-1]
        states = None
        if self.pool.kda_layers:
            last.checkpoint_used = now
            states = self.pool.read_checkpoint(last.checkpoint)
        return path, states

    # ---- publish
    def publish_blocks(self, path: PrefixPath, tokens: list[int], upto: int, seq: PagedSeq) -> None:
        """Publish every full block of tokens[:upto] the request has not yet published (their latents are written:
        upto <= seq.length). Existing nodes are joined; new ones take references to the request's pages."""
        ps = self.pool.page_size
        while (len(path.blocks) + 1) * self.h <= upto:
            start = len(path.blocks) * self.h
            parent = path.blocks[-1] if path.blocks else None
            parent_key = parent.key if parent else path.root
            key = self.chain(parent_key, tokens[start:start + self.h])
            node = self.nodes.get(key)
            if node is None:
                node = self._add(key, parent_key, parent, start, start + self.h,
                                 seq.pages[start // ps:(start + self.h - 1) // ps + 1])
            node.pins += 1
            path.blocks.append(node)

    def checkpoint(self, path: PrefixPath, tokens: list[int], seq: PagedSeq, states: list[KDAState], row: int,
                   make_room) -> None:
        """Publish the prefix tokens[:seq.length] with a KDA checkpoint of `states[...][row]` at its end (a full
        block node, or a tail node when the end falls between boundaries). `make_room(n)` frees n pages (by
        eviction) or returns False, in which case the checkpoint is skipped: a cache may always decline."""
        end = seq.length
        self.publish_blocks(path, tokens, end, seq)
        r = end % self.h
        if r == 0:
            if not path.blocks:
                return
            node = path.blocks[-1]
            if node.checkpoint is not None or not self.pool.kda_layers:
                return
        else:
            parent = path.blocks[-1] if path.blocks else None
            parent_key = parent.key if parent else path.root
            key = self.chain(parent_key, tokens[end - r:end])
            node = self.nodes.get(key)
            if node is not None and (node.checkpoint is not None or not self.pool.kda_layers):
                return
            if node is not None and node not in path.tails:  # pinned, so making room cannot evict it
                node.pins += 1
                path.tails.append(node)
        need = self.pool.checkpoint_pages
        if need and not make_room(need):
            return
        pages = self.pool.alloc(need) if need else None
        if pages:
            self.pool.write_checkpoint(states, row, pages)
        if r and node is None:
            ps = self.pool.page_size
            node = self._add(key, parent_key, parent, end - r, end, seq.pages[(end - r) // ps:(end - 1) // ps + 1])
            node.pins += 1
            path.tails.append(node)
        node.checkpoint = pages  # attached only now that it is written
        node.checkpoint_used = self._tick()

    def _add(self, key: bytes, parent_key: bytes, parent: Node | None, start: int, end: int,
             pages: list[int]) -> Node:
        self.pool.retain(pages)
        node = Node(key, parent_key, parent, start, end, pages, used=self._tick())
        self.nodes[key] = node
        if parent is not None:
            parent.children += 1
        if end - start < self.h:
            self.tail_lengths.setdefault(parent_key, Counter())[end - start] += 1
        return node

    def release(self, path: PrefixPath) -> None:
        """The request is done: unpin everything it pinned."""
        for n in path.blocks + path.tails:
            n.pins -= 1
        path.blocks, path.tails = [], []

    # ---- eviction
    def evict_one(self) -> bool:
        """Evict the least recently used item; False when nothing can be evicted. Items are checkpoints (any node)
        and whole childless, unpinned nodes (latents and checkpoint together). A childless node that cannot resume
        anything (no checkpoint, KDA model) goes first: it is dead weight."""
        best, best_rank = None, None
        for node in self.nodes.values():
            if node.children == 0 and node.pins == 0:
                rank = (0 if not self._usable(node) else 1, node.used, 1)
                if best_rank is None or rank < best_rank:
                    best, best_rank = (node, "node"), rank
            if node.checkpoint is not None and node.checkpoint_pins == 0 and (node.children > 0 or node.pins > 0):
                rank = (1, node.checkpoint_used, 0)
                if best_rank is None or rank < best_rank:
                    best, best_rank = (node, "checkpoint"), rank
        if best is None:
            return False
        node, what = best
        if what == "checkpoint":
            self.pool.release(node.checkpoint)
            node.checkpoint = None
            self.evicted_checkpoints += 1
        else:
            self._drop(node)
        return True

    def _drop(self, node: Node) -> None:
        if node.checkpoint is not None:
            self.pool.release(node.checkpoint)
            node.checkpoint = None
            self.evicted_checkpoints += 1
        self.pool.release(node.pages)
        del self.nodes[node.key]
        if node.parent is not None:
            node.parent.children -= 1
        if node.end - node.start < self.h:
            lengths = self.tail_lengths[node.parent_key]
            lengths[node.end - node.start] -= 1
            if lengths[node.end - node.start] == 0:
                del lengths[node.end - node.start]
            if not lengths:
                del self.tail_lengths[node.parent_key]
        self.evicted_blocks += 1


# ------------------------------------------------------------------------------------------ sizes

def cache_bytes_per_token(config: K3Config, dtype_bytes: int = 2) -> dict:
    """Decode-cache sizes of `config` and of two same-shaped baselines (every layer MLA; every layer plain
    multi-head attention with the MLA head dims, K = nope + rope and V = v_head_dim per head).

    -> {"mla_bytes_per_token", "kda_state_bytes" (fixed per sequence: fp32 state + conv tail), "all_mla_bytes_per_
    token", "all_mha_bytes_per_token"}."""
    n = config.num_hidden_layers
    n_kda = config.layer_types.count("kda")
    lac = config.linear_attn_config
    H, K, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    mha = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    return {
        "mla_bytes_per_token": (n - n_kda) * latent * dtype_bytes,
        "kda_state_bytes": n_kda * (H * K * K * 4 + (W - 1) * 3 * H * K * dtype_bytes),
        "all_mla_bytes_per_token": n * latent * dtype_bytes,
        "all_mha_bytes_per_token": n * mha * dtype_bytes,
    }
