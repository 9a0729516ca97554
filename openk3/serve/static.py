"""The engine's fast decode path (docs/engine.md "Fast decode path"): one decode step of the whole running batch
with static shapes, so that on CUDA it can be captured once per batch bucket as a CUDA graph and replayed.

    SlotPool       the decode batch's KDA states, preallocated: for S slots, every KDA layer's recurrent states in
                   one tensor [L * R, H, K, K] fp32 and conv tails in one [L * R, W-1, 3*H*K] (R = S + 1 + spare
                   rows; layer l's slot s at row l * R + s); a request joining the batch takes a slot (its
                   prefilled state is copied in once), one leaving gives it back. Slot 0 is a scratch slot for the
                   rows that pad a batch to its bucket (zeroed again after every step, see `SlotKDAState`). The
                   spare rows hold a speculative verification's state after each of its tokens (below).
    StaticMLA      one MLA layer's cache for the step: writes the new latent of every row into its page and reads
                   the pool through a fixed-width page table [B, P] (padded with the zero page) plus each row's
                   length (the mask): where the paged Triton kernel runs (CUDA, openk3/ops/mla_decode.py), in place
                   (`append_paged`), else with one batched gather (`append`); no per-row copy either way.
    StaticDecoder  the step: copies the host's inputs (last tokens, slots, page tables, lengths, sampling
                   parameters) into static buffers of the bucket (B rounded up to BATCH_BUCKETS, P to a power of
                   two), runs the model forward for T = 1 and `sample_batch`, and hands back tokens, logprobs and a
                   finite flag per row in one device-to-host copy, the step's only host sync. `launch` queues the
                   step and that copy without waiting (the next step may feed its tokens on the device, unread) and
                   `collect` waits for it, so the host can prepare the next step meanwhile (docs/engine.md
                   "Overlapping the host with the device"); `step` is the two at once. With `graphs` (CUDA),
                   each (B, P, greedy-only) bucket is captured the first time it is met, after a warmup on a side
                   stream, and replayed from then on; on the CPU the same step runs eagerly. With `compile`, the
                   step is `torch.compile`d first (fusing its small ops; the KDA layers then keep their reference
                   chain, see model.py `KimiDeltaAttention.forward`). Off by default, as its first use compiles: on
                   the H200 32 s and 44 s, and then it decoded kimi-linear-1.5b 13% faster than the default at
                   batch 1 and no faster at batch 16 and 64 (docs/engine_h200_log.md "On the H200 (2026-12-02,
                   third session)").

A speculative round of greedy rows (engine.py `_speculate_static`) runs on the same kind of buffers with T tokens a
row (`StepBuffers`, T = k + 1), in three static runs and one host sync: the draft's `draft` (its k + 1 greedy steps
in one run, each step's token fed to the next on the device, the states after steps 1..k kept for
`SlotPool.restore`), the target's `verify` (one forward over the pending token and the k drafts, read from the
draft's output on the device; with fla's kernels and spare rows the KDA layers write the state after every token to
its own pool row, else they keep their per-token inputs; its read-back is the round's sync) and its `rollback`
(every row's KDA states back to its kept tokens: a copy of the state after its last kept token, or cache.py
`rollback_kda` over the kept inputs). With `graphs` each is
captured per (B, P, T) bucket as the step is; the rollback the first time a verification of its bucket is rolled
back, as a graph that reads the verification graph's kept tensors.

The reference is the engine's general path (runner.py `ModelRunner.forward` over `paged_cache`, then
`sample_tokens`; for a speculative round, the forward keeping the KDA inputs and `rollback_kda`);
tests/serve/test_static.py checks that both give the same logits for ragged batches whose requests join and leave
between steps, and after a verification and its rollback.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from openk3.config import K3Config
from openk3.model.fused import FusedProjections, applied
from openk3.model.model import K3ForCausalLM
from openk3.model.state import K3Cache, KDAState, SlotKDAState
from openk3.ops import graph_capture, select_kda_backend, select_moe_backend
from openk3.ops.greedy import greedy_pick, greedy_pick_applies
from openk3.ops.kda.conv_step import conv_step_supported
from openk3.ops.mla_decode import select_paged_attention
from openk3.serve.cache import (PagedSeq, PagePool, device_tensor, kept_conv_tail, pinned_copies, rollback_kda,
                                upload)
from openk3.serve.sampler import SamplingParams, sample_batch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def kda_in_place(device, compile: bool | str = False) -> bool:
    """Whether the static runs on `device` update the slot pool's recurrent rows in place with fla's kernels: with
    fla (CUDA), not compiled (`StaticDecoder.in_place`; a verification then keeps every token's state in the pool's
    spare rows, which the runner sizes by this)."""
    return select_kda_backend(device).fused and not compile


def capture_problem(model: K3ForCausalLM) -> str | None:
    """Why the decode step of `model` cannot be captured as a CUDA graph, or None if it can. NOTE: the routed experts'
    grouped matmul is capturable only as the fused kernel (bf16 on sm90+); for other dtypes and GPUs
    `torch._grouped_mm` loops over the experts on the host, and the loop backend syncs too (openk3/ops/moe.py)."""
    weight = model.lm_head.weight
    if weight.device.type != "cuda":
        return f"the model is on {weight.device}, CUDA graphs need CUDA"
    if not model.moe_layers():
        return None
    backend = select_moe_backend(weight.device.type, weight.dtype)
    major, _ = torch.cuda.get_device_capability(weight.device)
    if backend.name != "grouped" or weight.dtype != torch.bfloat16 or major < 9:
        return (f"the routed experts run {weight.dtype} on sm_{major}x with the {backend.name!r} MoE backend, which "
                f"syncs with the host (only bf16 grouped matmuls on sm90+ are capturable)")
    return None


def batch_bucket(n: int) -> int:
    """The CUDA-graph batch size a batch of n rows runs at: the smallest of BATCH_BUCKETS that holds it, beyond
    them the next multiple of the largest."""
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    top = BATCH_BUCKETS[-1]
    return -(-n // top) * top


def page_bucket(n: int) -> int:
    """The page-table width a batch whose longest row needs n pages runs at: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


class SlotPool:
    """Preallocated KDA states for up to `slots` running sequences, per KDA layer (module docstring).

    All layers' states of a kind live in one tensor, layer l's slot s at row l * R + s (R = S + 1 + spare rows):
    the recurrent states [L * R, H, K, K] fp32 and the conv tails [L * R, W-1, 3*H*K]. So the static step reads all
    layers' rows with one gather and resets all scratch slots with one fill, instead of an op per layer for each, and
    every write of a layer's rows (an `index_copy_`, fla's in-place decode kernel, the conv kernel) goes into one of
    those two tensors by row number, not into a view of it (the exception: `clear_scratch`'s strided fill): under
    torch.compile each is then one graph input that the step mutates, with no aliased inputs (docs/engine.md "Fast
    decode path").
    `spare`: rows after the slots (layer l's at l * R + S + 1 ...) where a speculative verification keeps the
    recurrent state after each of its tokens but the last (`view(tokens=)`), B * (T - 1) of them for B rows of T
    tokens. The conv pool has them too (one row numbering for both kinds), unused: a conv tail is W-1 raw inputs,
    kimi-linear-1.5b's 37 KB a layer against the recurrent state's 1 MB."""

    def __init__(self, config: K3Config, slots: int, device, dtype: torch.dtype, spare: int = 0):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots={slots!r}: must be a positive integer")
        if not isinstance(spare, int) or spare < 0:
            raise ValueError(f"spare={spare!r}: must be a non-negative integer")
        lac = config.linear_attn_config
        H, K, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
        n = config.layer_types.count("kda")
        R = self.stride = slots + 1 + spare
        self.recurrent_all = torch.zeros(n * R, H, K, K, device=device)
        self.conv_all = torch.zeros(n * R, W - 1, 3 * H * K, device=device, dtype=dtype)
        # per-layer views [R, ...], for the host's copies (`take_rows`) and for reading
        self.recurrent = list(self.recurrent_all.view(n, R, H, K, K).unbind(0))
        self.conv = list(self.conv_all.view(n, R, W - 1, 3 * H * K).unbind(0))
        self.layer_rows = torch.arange(n, device=device)[:, None] * R  # [L, 1]: layer l's slot 0
        self.size, self.spare = slots, spare
        self.free = list(range(slots, 0, -1))  # a stack; slot 0 is the scratch slot

    def take_rows(self, *parts: list[KDAState]) -> list[int]:
        """A free slot for every row of every part (each one state per KDA layer, a batch of rows), holding that row:
        one concatenation and one `index_copy_` of each kind and one upload of the rows for all of them (a prefill
        group's rows, the requests joining the decode batch together), not those a row. -> the slots, part by part,
        row by row."""
        B = sum(p[0].recurrent.shape[0] for p in parts)
        if len(self.free) < B:
            raise RuntimeError(f"{B} KDA slots wanted, {len(self.free)} of {self.size} free")
        slots = [self.free.pop() for _ in range(B)]
        rows = self.rows(device_tensor(slots, self.layer_rows.device)).view(-1)  # layer by layer, B rows each
        layers = range(len(parts[0]))
        conv = torch.cat([p[i].conv for i in layers for p in parts])
        self.recurrent_all.index_copy_(0, rows, torch.cat([p[i].recurrent for i in layers for p in parts]))
        self.conv_all.index_copy_(0, rows, conv.to(self.conv_all.dtype))
        return slots

    def read(self, slots: list[int], states: list[KDAState]) -> None:
        """Set `states` (one per KDA layer, a batch of len(slots) rows) to the slots' states, row b from slots[b]:
        two gathers, then views of them (the conv tails in the states' own dtype)."""
        rows = self.rows(device_tensor(slots, self.layer_rows.device))  # [L, B]
        recurrent = self.recurrent_all.index_select(0, rows.view(-1)).view(*rows.shape, *self.recurrent_all.shape[1:])
        conv = self.conv_all.index_select(0, rows.view(-1)).view(*rows.shape, *self.conv_all.shape[1:])
        for s, r, c in zip(states, recurrent.unbind(0), conv.unbind(0)):
            s.recurrent, s.conv = r, c.to(s.conv.dtype)

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def view(self, slots: Tensor, gather: bool = False, gather_recurrent: bool = True, gather_conv: bool = True,
             chunked: bool = False, tokens: int | None = None) -> list[SlotKDAState]:
        """The states of the rows at `slots` [B], one `SlotKDAState` per KDA layer. `gather`: read every layer's
        rows now, in one op per kind (for a forward that reads each layer's state once, as a decode step does);
        `gather_recurrent=False` leaves the recurrent rows out of it (fla's decode kernel updates them in the pool
        in place; at batch 64 the gather alone copied 0.8 GB a step, 1.6 GB read and written), `gather_conv=False`
        the conv tails (ops/kda/conv_step.py updates them in the pool in place at one token a row). `chunked`: see
        `KDAState.chunked`. `tokens` (T): a verification over T tokens a row that keeps every token's state
        (`SlotKDAState.token_rows`): row b's state after token t < T - 1 goes to spare row b * (T - 1) + t, after
        the last token to its slot (`fits_tokens`)."""
        rows = self.rows(slots)
        L, B = rows.shape
        conv = rec = token_rows = [None] * L
        accepted = None
        if gather and gather_conv:
            conv = self.conv_all.index_select(0, rows.view(-1)).view(*rows.shape, *self.conv_all.shape[1:]).unbind(0)
        if gather and gather_recurrent:
            rec = self.recurrent_all.index_select(0, rows.view(-1)).view(*rows.shape, *self.recurrent_all.shape[1:]) \
                .unbind(0)
        if tokens is not None:
            if not self.fits_tokens(B, tokens):
                raise ValueError(f"{B} rows of {tokens} tokens need {B * (tokens - 1)} spare rows, the pool has "
                                 f"{self.spare}")
            spare = self.size + 1 + torch.arange(B * (tokens - 1), device=slots.device).view(1, B, tokens - 1)
            token_rows = torch.cat([self.layer_rows[:, :, None] + spare, rows[:, :, None]], dim=2).unbind(0)
            accepted = torch.full((B,), tokens, dtype=torch.int32, device=slots.device)
        return [SlotKDAState(self.recurrent_all, self.conv_all, i, r, c, chunked, t, accepted)
                for i, r, c, t in zip(rows.unbind(0), rec, conv, token_rows)]

    def fits_tokens(self, B: int, T: int) -> bool:
        """Whether the spare rows hold a verification's states after each of T tokens of B rows but the last."""
        return B * (T - 1) <= self.spare

    def rows(self, slots: Tensor) -> Tensor:
        """[L, B]: the rows in the pools of the slots [B], layer by layer."""
        return self.layer_rows + slots[None, :]

    def snapshot(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """A copy of every layer's rows at `slots` [B]: (recurrent [L * B, H, K, K], conv [L * B, W-1, 3*H*K]), layer
        by layer (a speculative draft's states after one of its steps, for `restore`)."""
        rows = self.rows(slots).view(-1)
        return self.recurrent_all.index_select(0, rows), self.conv_all.index_select(0, rows)

    def restore(self, slots: Tensor, snapshot: tuple[Tensor, Tensor], batch_rows: Tensor) -> None:
        """Write rows `batch_rows` of a `snapshot` (taken of a batch of B rows) back to their slots `slots`
        (len(batch_rows) of them), every layer."""
        L = self.layer_rows.shape[0]
        rows = self.rows(slots).view(-1)
        for pool, snap in zip((self.recurrent_all, self.conv_all), snapshot):
            pool.index_copy_(0, rows, snap.view(L, -1, *snap.shape[1:])[:, batch_rows].flatten(0, 1))

    def clear_scratch(self) -> None:
        """Slot 0 of every layer back to the zero state, after a step whose padding rows wrote there."""
        self.recurrent_all[::self.stride].zero_()
        self.conv_all[::self.stride].zero_()


class StaticMLA:
    """One MLA layer's paged cache for a static step (the `MLAState.append` protocol, T tokens a row): its pages
    through the page table [B, P], the new tokens' (page, offset) [B, T] each, and the mask [B, 1, T, P*page_size].
    `visible` [B] (the keys each row's last new token sees) where the step runs the paged kernel: then `paged` is
    True and `GatedMLA` calls `append_paged` instead of `append` when it attends in latent space."""

    def __init__(self, pool: PagePool, mla_index: int, table: Tensor, write_page: Tensor, write_offset: Tensor,
                 mask: Tensor, visible: Tensor | None = None):
        self.pool, self.index, self.mask, self.visible = pool, mla_index, mask, visible
        self.table, self.write_page, self.write_offset = table, write_page, write_offset
        self.paged = visible is not None

    def write(self, lat_BTC: Tensor) -> None:
        """Write each row's new latents at their (page, offset).
        NOTE: padding rows write their latents into the zero page (offset 0), unmasked: real rows read the zero page
        only where their mask is False, where the softmax weight is exactly 0 and 0 * a finite latent adds nothing
        (the paged kernel does not read them at all); `StaticDecoder` zeroes the page again after the forward, so
        between steps it is zero (cache.py)."""
        mla = self.pool.mla
        mla[self.write_page, self.index, self.write_offset] = lat_BTC.to(mla.dtype)

    def append(self, lat_BTC: Tensor) -> tuple[Tensor, Tensor]:
        """`write`, then read every row's pages through the table with one gather.
        -> latents [B, P*page_size, C] and the mask (`StepBuffers.mask`)."""
        self.write(lat_BTC)
        return self.pool.mla[self.table, self.index].flatten(1, 2), self.mask

    def append_paged(self, lat_BTC: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`write`, then hand over the pages for the kernel to read in place (openk3/ops/mla_decode.py
        `paged_latent_attention`). -> (this layer's pages [num_pages, page_size, C] (a view of the pool), the table
        [B, P], visible [B])."""
        self.write(lat_BTC)
        return self.pool.mla[:, self.index], self.table, self.visible


class StepBuffers:
    """The static inputs of one (batch, pages, tokens) bucket: B rows of T new tokens each (T = 1 a decode step,
    T = k + 1 a speculative verification). The integer inputs live in one tensor [3 T + 7, B] and the floats in
    one [2, B], so the host fills them with three copies (those two and the page table)."""

    PER_TOKEN = ("ids", "write_page", "write_offset")  # T rows each, read as [B, T] views
    # `carry`: 1 + the row of the step before whose sampled token the row feeds (`StaticDecoder.launch`); 0: `ids`
    PER_ROW = ("slots", "lengths", "top_k", "seed", "counter", "keep", "carry")

    def __init__(self, B: int, P: int, page_size: int, device, T: int = 1):
        self.B, self.P, self.T = B, P, T
        self.ints = torch.zeros(len(self.PER_TOKEN) * T + len(self.PER_ROW), B, dtype=torch.long, device=device)
        self.floats = torch.zeros(2, B, dtype=torch.float64, device=device)  # temperature, top_p
        self.table = torch.zeros(B, P, dtype=torch.long, device=device)
        self.key_pos = torch.arange(P * page_size, device=device)
        # named views of `ints` (a padding row: all zero)
        per_token = self.ints[:len(self.PER_TOKEN) * T].view(len(self.PER_TOKEN), T, B).transpose(1, 2)
        self.ids, self.write_page, self.write_offset = per_token.unbind(0)  # [B, T] each
        (self.slots, self.lengths, self.top_k, self.seed, self.counter, self.keep,
         self.carry) = self.ints[len(self.PER_TOKEN) * T:]  # `lengths`: each row's cached tokens before the step
        self.temperature, self.top_p = self.floats

    def clear(self) -> None:
        """Every row a padding row: scratch slot 0, the zero page, length 0 (what warmup and capture run on)."""
        self.ints.zero_()
        self.floats.zero_()
        self.table.zero_()

    def mask(self, token: int | None = None) -> Tensor:
        """[B, 1, T, P * page_size] bool: new token t of a row (at position length + t) sees keys 0..length + t.
        `token`: only that one of the T ([B, 1, 1, P * page_size]; a draft loop's step, `StaticDecoder._draft_run`)."""
        pos = self.lengths[:, None]  # [B, T]: the new tokens' positions (a decode step: no op for T = 1)
        if token is not None and token > 0:
            pos = pos + token
        elif token is None and self.T > 1:
            pos = pos + torch.arange(self.T, device=pos.device)
        return (self.key_pos[None, None, :] <= pos[:, :, None])[:, None]

    def fill(self, seqs: list[PagedSeq], slots: list[int], tokens: list[list[int]], page_size: int,
             per_row: dict[str, list] | None = None, floats: list[list[float]] | None = None) -> None:
        """Copy a step's inputs in: row b appends tokens[b] (T of them) after its seqs[b].length cached tokens,
        its KDA state in slot slots[b]; `per_row` the other PER_ROW inputs by name (missing ones 0), `floats`
        [temperatures, top_ps]. Rows past len(seqs) pad the bucket."""
        n, T, ps, B = len(seqs), self.T, page_size, self.B
        # NOTE: built in numpy, a few array ops in one block, then one upload of it (and the table's). On the H200's
        # host the torch version of this (torch.tensor of the ids, then stack / gather / cat / reshape on CPU
        # tensors) took 6-23 ms for a prefill chunk of 64 rows x 512 tokens, which the device idled through
        # (bench/results/decode_probe/eighteenth); torch.tensor of 32K Python ints alone took ~3 ms on this repo's
        # 2-core CPU, np.array ~0.4 ms.
        short = [b for b, s in enumerate(seqs) if len(s.pages) * ps < s.length + T]
        if short:  # (the engine grows the page tables first: `_launch`)
            raise ValueError(f"row {short[0]}'s {len(seqs[short[0]].pages)} pages do not cover positions up to "
                             f"{seqs[short[0]].length + T - 1} (page size {ps})")
        lengths = np.array([s.length for s in seqs], dtype=np.int64)
        table = np.zeros((B, self.P), dtype=np.int64)
        for b, s in enumerate(seqs):
            table[b, :len(s.pages)] = s.pages
        block = np.zeros((len(self.PER_TOKEN) * T + len(self.PER_ROW), B), dtype=np.int64)  # `ints`' layout
        pos = lengths[:, None] + np.arange(T)  # [n, T]: each new token's position; padding rows stay all zero
        block[:T, :n] = np.array(tokens, dtype=np.int64).reshape(n, T).T
        block[T:2 * T, :n] = np.take_along_axis(table[:n], pos // ps, 1).T
        block[2 * T:3 * T, :n] = (pos % ps).T
        rows = dict(per_row or {}, slots=slots, lengths=lengths)
        for i, name in enumerate(self.PER_ROW):
            if name in rows:
                block[3 * T + i, :n] = rows[name]
        # through pinned memory on CUDA: a plain copy would wait for the step in flight (cache.py `upload`)
        upload(self.ints, torch.from_numpy(block))
        upload(self.table, torch.from_numpy(table))
        if floats is not None:
            host = np.zeros((len(floats), B), dtype=np.float64)
            host[:, :n] = floats
            upload(self.floats, torch.from_numpy(host))


@dataclass
class Launched:
    """A decode step queued on the device (`StaticDecoder.launch`): its sampled tokens [B] (long) on the device for a
    later step to feed, copied out of the step's output (None where no step will); its logits [B, V] (`_run`; graph
    memory: read before the next replay of any graph of the decoder); its output [3, B] (token, logprob, finite) on
    its way to the host (pinned on CUDA), the event recorded after that copy (None on the CPU: copies there are done
    when they return); its n real rows."""

    tokens: Tensor | None
    logits: Tensor
    host: Tensor
    copied: torch.cuda.Event | None
    n: int


class StaticDecoder:
    """The fast decode step of one model over its page pool and KDA slot pool (module docstring)."""

    def __init__(self, model: K3ForCausalLM, pool: PagePool, slots: SlotPool, graphs: bool = False,
                 compile: bool | str = False, fused: FusedProjections | None = None):
        """compile: False, True (torch.compile's default backend, Inductor) or a torch.compile backend name.
        fused: the model's fused input projections (openk3/model/fused.py), refreshed before every step."""
        self.model, self.pool, self.slots, self.fused = model, pool, slots, fused
        self.device = pool.device
        problem = capture_problem(model) if graphs else None
        if problem is not None:
            raise ValueError(f"cannot capture the decode step as CUDA graphs: {problem}")
        self.graphs = graphs
        self.layer_types = model.config.layer_types
        self.buffers: dict[tuple[int, int, int], StepBuffers] = {}
        # keyed by (kind, B, P, T, greedy_only), kind "decode", "prefill", "draft" or "verify" (`_launch`)
        self.captured: dict[tuple[str, int, int, int, bool], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.rollbacks: dict[tuple[str, int, int, int, bool], torch.cuda.CUDAGraph] = {}  # per verify bucket
        self._verified: tuple | None = None  # the last `verify`'s (bucket key, buffers, saved), for `rollback`
        self.mempool = torch.cuda.graph_pool_handle() if graphs else None
        self.counters = dict(static_steps=0, graph_captures=0, graph_replays=0)
        # fla's decode kernel updates the pool's recurrent rows in place (model.py `forward_fused` with
        # `recurrent`; eager only), and at one token a row the conv kernel its conv tails (ops/kda/conv_step.py)
        self.in_place = kda_in_place(self.device, compile)
        self.conv_in_place = self.in_place and conv_step_supported(self.device, slots.conv_all.dtype)
        # the MLA layers' latent-space attention: the paged Triton kernel (openk3/ops/mla_decode.py) where it runs;
        # a compiled step keeps the gather (the kernel under torch.compile is not tried)
        self.mla_kernel, self.mla_reason = select_paged_attention(self.device, pool.dtype)
        if self.mla_kernel and compile:
            self.mla_kernel, self.mla_reason = False, "the step is compiled: the pages are gathered, then scored " \
                                                      "in PyTorch"
        self.run = self._run
        if compile:
            # NOTE: dynamic=None: the first shape compiles static, a second one recompiles with dynamic sizes, so
            # the buckets do not each cost a compile
            self.run = torch.compile(self._run, backend="inductor" if compile is True else compile, dynamic=None)

    def forget_graphs(self) -> None:
        """Drop the captured graphs; each bucket is captured again when next met. For a weight change of a QAT
        model: a graph replays the kernels Python chose at capture, and `Experts.on_mxfp4_grid` (model.py) chose
        there whether the expert weights are fake-quantised at all (new weights off the grid must be again)."""
        self.captured.clear()
        self.rollbacks.clear()

    # ---- the steps as the device runs them (captured or eager)
    def _cache(self, buf: StepBuffers, kda: list[SlotKDAState], token: int | None = None) -> K3Cache:
        """The model's cache for a step over the buffers' T tokens a row (`token`: only that one of them): the KDA
        layers' slot states in order, a `StaticMLA` per MLA layer."""
        cols = slice(None) if token is None else slice(token, token + 1)
        # the keys the last new token sees: the row's cached tokens and the T new ones (`token`: up to that one)
        visible = buf.lengths + (buf.T if token is None else token + 1) if self.mla_kernel else None
        where = (buf.table, buf.write_page[:, cols], buf.write_offset[:, cols], buf.mask(token), visible)
        kda, layers, mla_index = iter(kda), [], 0
        for kind in self.layer_types:
            if kind == "kda":
                layers.append(next(kda))
            else:
                layers.append(StaticMLA(self.pool, mla_index, *where))
                mla_index += 1
        return K3Cache(layers)

    def _reset_padding(self, rows: int) -> None:
        """The padding rows wrote into the scratch slots and the zero page: one reset of each per step of a bucket of
        `rows` rows, not a mask of the padding rows' writes per layer (docs/engine.md "Fast decode path"). A bucket of
        one row has no padding row (a step has a request): nothing to reset (the reset took ~11 us a step on the
        H200, kimi-linear-1.5b, `decode_probe.py timeline:1`, eleventh session)."""
        if rows > 1:
            self.clear_padding()

    def clear_padding(self) -> None:
        """The scratch slots and the zero page back to zeros (`_reset_padding`; after a capture, whose warmup and
        capture ran on padding rows only, eagerly)."""
        self.slots.clear_scratch()
        self.pool.mla[0].zero_()

    def _gathered(self, buf: StepBuffers, tokens: int, chunked: bool = False) -> list[SlotKDAState]:
        """The batch's slot states for a forward of `tokens` new tokens a row, every layer's rows gathered in one op
        per kind, except what the in-place kernels update where the pool keeps it at one token a row (the recurrent
        rows with fla's decode kernel, the conv tails with the conv kernel)."""
        one = tokens == 1
        return self.slots.view(buf.slots, gather=True, gather_recurrent=not (self.in_place and one),
                               gather_conv=not (self.conv_in_place and one), chunked=chunked)

    def _run(self, buf: StepBuffers, greedy_only: bool) -> tuple[Tensor, Tensor]:
        """Model forward (T = 1) + sampler over the static buffers -> ([3, B] float64: token, logprob, finite;
        the logits [B, V]: fp32, or the model's dtype where a greedy-only step picks in one kernel)."""
        kda = self._gathered(buf, tokens=1)
        logits = self.model(buf.ids, cache=self._cache(buf, kda), validate=False).logits[:, -1]
        self._reset_padding(buf.ids.shape[0])
        if greedy_only and greedy_pick_applies(logits):  # one kernel (ops/greedy.py) for the chain below
            tokens, logprobs, finite = greedy_pick(logits)
        else:
            logits = logits.float()
            top_p = buf.top_p if greedy_only else buf.top_p.float()  # a greedy-only step reads no top_p: no cast
            tokens, logprobs = sample_batch(logits, buf.temperature, buf.top_k, top_p, buf.seed, buf.counter,
                                            greedy_only=greedy_only)
            finite = torch.isfinite(logits).all(-1)
        # one op for the three rows, cast into float64 by the stack itself (exact: token ids < 2**53)
        out = torch.empty(3, logits.shape[0], dtype=torch.float64, device=logits.device)
        return torch.stack([tokens, logprobs, finite], out=out), logits

    def _verify_run(self, buf: StepBuffers, greedy_only: bool = True) -> tuple[Tensor, Tensor, tuple]:
        """Model forward over T tokens a row (a speculative verification), keeping what `_rollback_run` needs ->
        ([4, B, T] float64: the greedy token after each position, its logprob, whether the row's logits were all
        finite, the token fed there; the fp32 logits [B, T, V]; (the layers' slot states, their committed states,
        their per-token inputs)). With fla (the in-place decode kernel) and spare rows enough in the slot pool
        (`SlotPool.fits_tokens`), the KDA layers run fla's token-by-token kernel writing the state after every
        token to its own pool row (`SlotPool.view(tokens=)`): the committed states are then None, and the inputs
        the raw projections and the conv tails before them. Else they run the reference chain (`keep_inputs`), from
        every layer's rows gathered in one op: those gathered rows are the committed states."""
        if self.in_place and self.slots.fits_tokens(buf.B, buf.T):
            kda = self.slots.view(buf.slots, gather=True, gather_recurrent=False, tokens=buf.T)
            committed = None
        else:
            kda = self.slots.view(buf.slots, gather=True)
            committed = [KDAState(s.recurrent, s.conv) for s in kda]
        logits = self.model(buf.ids, cache=self._cache(buf, kda), keep_inputs=True, validate=False).logits.float()
        self._reset_padding(buf.ids.shape[0])
        tokens = logits.argmax(-1)
        logprobs = logits.gather(-1, tokens[..., None])[..., 0] - logits.logsumexp(-1)
        finite = torch.isfinite(logits).flatten(1).all(-1, keepdim=True).expand_as(tokens)
        out = torch.empty(4, *tokens.shape, dtype=torch.float64, device=logits.device)
        out = torch.stack([tokens, logprobs, finite, buf.ids], out=out)
        return out, logits, (kda, committed, [s.inputs for s in kda])

    def _prefill_run(self, buf: StepBuffers, greedy_only: bool = True) -> Tensor:
        """Model forward over T prompt tokens a row (a piece of a prefill chunk, `prefill`) -> the fp32 logits of each
        row's last token [B, V]. Its KDA layers run fla's chunked kernel over more than RECURRENT_SEGMENT_TOKENS
        tokens (`KDAState.chunked`): captured, it costs no host time."""
        # a one-token piece with fla updates the pool's rows in place, as a decode step (`_run`)
        kda = self._gathered(buf, tokens=buf.T, chunked=True)
        logits = self.model(buf.ids, cache=self._cache(buf, kda), logits_to_keep=1, validate=False).logits[:, -1]
        self._reset_padding(buf.ids.shape[0])
        return logits.float()

    def _draft_run(self, buf: StepBuffers, greedy_only: bool = True) -> tuple[Tensor, list]:
        """A speculative round's T = k + 1 greedy draft steps in one run, with no token read back in between: step
        i feeds the token step i - 1 chose (step 0 the pending token, `buf.ids[:, 0]`) at position length + i.
        The last step only feeds d_k, so the draft's cache covers every verified token. -> (the drafted tokens
        [B, k]; the batch's states after steps 1..k, `SlotPool.snapshot` each)."""
        tokens, drafted, snapshots = buf.ids[:, :1], [], []
        for i in range(buf.T):
            kda = self._gathered(buf, tokens=1)
            logits = self.model(tokens, cache=self._cache(buf, kda, token=i), validate=False).logits[:, -1]
            self._reset_padding(buf.ids.shape[0])
            if i == buf.T - 1:
                break
            tokens = logits.argmax(-1, keepdim=True)
            drafted.append(tokens)
            snapshots.append(self.slots.snapshot(buf.slots))
        return torch.cat(drafted, dim=1), snapshots

    def _rollback_run(self, buf: StepBuffers, saved: tuple) -> None:
        """After `_verify_run`: every layer's rows back to their committed state plus the first `buf.keep[b]` tokens
        of the verified ones (keep >= 1 where the verification kept every token's state: a copy of the state after
        token keep - 1 for every layer in one op, and the conv tail re-read, cache.py `kept_conv_tail`; else
        cache.py `rollback_kda`, written into the pool by row). A padding row (keep 0) writes its scratch slot."""
        states, committed, inputs = saved
        if committed is None:
            token_rows = torch.stack([s.token_rows for s in states])  # [L, B, T]
            last = (buf.keep - 1).clamp(min=0)[None, :, None].expand(token_rows.shape[0], -1, 1)
            pool = self.slots.recurrent_all
            kept_states = pool.index_select(0, token_rows.gather(2, last).flatten())
            pool.index_copy_(0, token_rows[..., -1].flatten(), kept_states)
            for state, kept in zip(states, inputs):
                state.conv = kept_conv_tail(kept["conv"], kept["qkv"], buf.keep)
        else:
            for state, before, kept in zip(states, committed, inputs):
                rollback_kda(state, before, kept, buf.keep)
        self.slots.clear_scratch()

    def _capture(self, run, buf: StepBuffers, greedy_only: bool) -> tuple[torch.cuda.CUDAGraph, tuple]:
        """Warm up `run(buf, greedy_only)` on a side stream (lazy inits, Triton autotuning), then capture it once.
        -> the graph and what the captured call returned (its outputs, rewritten in place by every replay).
        NOTE: all graphs share `self.mempool`, so a graph's outputs may lie where a graph captured before it keeps
        its temporaries: read them before the next replay of any graph, or copy them out (`launch`)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run(buf, greedy_only)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, pool=self.mempool):
            out = run(buf, greedy_only)
        self.counters["graph_captures"] += 1
        return graph, out

    # ---- the steps as the engine calls them
    def _launch(self, kind: str, run, seqs: list[PagedSeq], slots: list[int], tokens: list[list[int]],
                greedy_only: bool, per_row: dict[str, list] | None = None, floats: list[list[float]] | None = None,
                device_ids: Tensor | None = None, after: Tensor | None = None):
        """Run `run` (`_run`, `_prefill_run`, `_verify_run` or `_draft_run`, named by `kind`) for a batch whose row b
        appends tokens[b] to seqs[b] (its KDA state in slot slots[b]): grow the page tables, pick the bucket, capture it
        the first time (graphs), copy the inputs in, replay (or run eagerly). `device_ids` [n, t]: the last t tokens of
        every row, already on the device (a draft's tokens), copied over those of `tokens` without a host round
        trip. `after`: the tokens [B'] the decode step before sampled (`Launched.tokens`), which the rows with a
        `carry` in `per_row` feed (`launch`). -> (the bucket's key, its buffers, what `run` returned). The lengths
        are left to the caller."""
        T = len(tokens[0])
        for s in seqs:
            s.grow(self.pool, s.length + T)
        B, P = batch_bucket(len(seqs)), page_bucket(max(len(s.pages) for s in seqs))
        buf = self.buffers.get((B, P, T))
        if buf is None:
            buf = self.buffers[(B, P, T)] = StepBuffers(B, P, self.pool.page_size, self.device, T)
        key = (kind, B, P, T, greedy_only)
        # NOTE: the fused projections are refreshed here, before capture and replay, never inside the graph or the
        # compiled step: a replay reads the stacked weights at their captured addresses, which refresh writes in place
        with applied(self.fused):
            if self.graphs and key not in self.captured:
                buf.clear()  # warmup and capture run on padding rows only: they write the scratch slot and zero page
                self.captured[key] = self._capture(run, buf, greedy_only)
                self.clear_padding()  # (a one-row bucket's step does not reset them)
            buf.fill(seqs, slots, tokens, self.pool.page_size, per_row, floats)
            if device_ids is not None:
                buf.ids[:len(seqs), T - device_ids.shape[1]:].copy_(device_ids)
            if after is not None:
                carried = after[(buf.carry - 1).clamp(min=0)]
                buf.ids[:, 0] = torch.where(buf.carry > 0, carried, buf.ids[:, 0])
            if self.graphs:
                graph, result = self.captured[key]
                graph.replay()
                self.counters["graph_replays"] += 1
            else:
                result = run(buf, greedy_only)
        self.counters["static_steps"] += 1
        return key, buf, result

    def launch(self, seqs: list[PagedSeq], slots: list[int], tokens: list[int], params: list[SamplingParams],
               seeds: list[int], counters: list[int], after: Launched | None = None,
               carry: list[int | None] | None = None, fed: bool = True) -> Launched:
        """Start decoding one token for every row, without waiting for the device: row b appends tokens[b] to
        seqs[b] (its KDA state in slot slots[b]) and samples with params[b], seeds[b] and counters[b] (the index of
        the token drawn, for `sample_batch`). `after`, `carry`: a row with carry[b] not None feeds instead the token
        that row carry[b] of the step `after` sampled, taken on the device (that step need not be read yet);
        `fed=False`: no later launch will feed this step's tokens (`step`), which saves their copy.
        Grows the page tables and advances the lengths. Read the result with `collect`."""
        per_row = dict(top_k=[p.top_k for p in params], seed=seeds, counter=counters,
                       carry=[0 if c is None else c + 1 for c in carry or [None] * len(seqs)])
        floats = [[p.temperature for p in params], [p.top_p for p in params]]
        _, _, (out, logits) = self._launch("decode", self.run, seqs, slots, [[t] for t in tokens],
                                           all(p.greedy for p in params), per_row, floats,
                                           after=None if all(c is None for c in carry or ()) else after.tokens)
        for s in seqs:
            s.length += 1
        # NOTE: `out` is graph memory, and the decoder's graphs share one memory pool (`_capture`): a graph captured
        # later may hold its outputs where one captured earlier keeps its temporaries, so a replay of any other
        # graph (a static prefill's, before the next step) may overwrite `out` (as a replay of this one does). What
        # is read of it later is copied out now, in stream order: the tokens for the next step to feed (a prefill
        # between two overlapped steps fed garbage tokens on the H200, docs/engine.md "Overlapping the host with
        # the device") and the result for the host.
        tokens = out[0].long() if fed else None
        pinned = pinned_copies(self.device)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=pinned)
        host.copy_(out, non_blocking=pinned)
        copied = None
        if pinned:
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.device))
        return Launched(tokens, logits, host, copied, len(seqs))

    def collect(self, launched: Launched) -> tuple[list[int], list[float], list[bool]]:
        """Wait for a launched step's result -> (tokens, fp32 logprobs, whether the row's logits were all finite);
        a row that was not finite got a meaningless token."""
        if launched.copied is not None:
            launched.copied.synchronize()  # the step's one host sync
        result = launched.host[:, :launched.n].tolist()
        return [int(t) for t in result[0]], result[1], [f > 0 for f in result[2]]

    def step(self, seqs: list[PagedSeq], slots: list[int], tokens: list[int], params: list[SamplingParams],
             seeds: list[int], counters: list[int], with_logits: bool = False) -> tuple:
        """`launch` then `collect`: one decode step, waited for. `with_logits` adds the logits [n, V] in fp32 (a copy,
        on the device) as a fourth element, for tests."""
        launched = self.launch(seqs, slots, tokens, params, seeds, counters, fed=False)
        logits = launched.logits[:launched.n].to(torch.float32, copy=True) if with_logits else None
        sampled = self.collect(launched)
        return (*sampled, logits) if with_logits else sampled

    def prefill(self, seqs: list[PagedSeq], slots: list[int], tokens: list[list[int]]) -> Tensor:
        """A prefill chunk of T tokens a row (row b appends tokens[b] to seqs[b], its KDA state in slot slots[b]) as
        static runs over the power-of-two pieces of T, largest first (T = 257: 256, then 1), so that the graphs of
        log2(T) bucket lengths serve every chunk length without a padding token (which the KDA recurrence and conv
        would take in). Grows the page tables and advances the lengths by T. -> the fp32 logits of every row's last
        token [n, 1, V] (a copy). NOTE: a piece of 2^i tokens over a 32K-token context is one bucket (B, P, 2^i) per
        page width P: a 257-token turn after a 32K prefix hit ran eagerly as ~1,000 kernel launches, host-bound
        (docs/engine.md "Host time of a prefill and of a prefix hit")."""
        T, start, logits = len(tokens[0]), 0, None
        for i in reversed(range(T.bit_length())):
            if not T >> i & 1:
                continue
            piece = [row[start:start + (1 << i)] for row in tokens]
            _, _, logits = self._launch("prefill", self._prefill_run, seqs, slots, piece, True)
            for s in seqs:
                s.length += 1 << i
            start += 1 << i
        return logits[:len(seqs), None].clone()

    def draft(self, seqs: list[PagedSeq], slots: list[int], pending: list[int], k: int) -> tuple[Tensor, list]:
        """A speculative round's k + 1 greedy draft steps for every row (row b feeds pending[b], then its own k
        drafts), as one run without a host sync (`_draft_run`). Grows the page tables and advances the lengths by
        k + 1. -> (the drafted tokens [n, k] on the device, for `verify`; the states after steps 1..k, for
        `SlotPool.restore`: each the snapshot of the bucket's B rows, of which the first n are the batch)."""
        _, _, (drafted, snapshots) = self._launch("draft", self._draft_run, seqs, slots,
                                                  [[t] * (k + 1) for t in pending], True)
        for s in seqs:
            s.length += k + 1
        return drafted[:len(seqs)], snapshots

    def verify(self, seqs: list[PagedSeq], slots: list[int], tokens: list[list[int]], drafted: Tensor | None = None,
               with_logits: bool = False) -> tuple:
        """A greedy speculative verification: row b appends tokens[b] (its pending token, then the drafted ones; T
        each) to seqs[b]; `drafted` [n, T - 1] on the device (from `draft`) stands in for the drafted ones. Grows
        the page tables and advances the lengths by T; the KDA states then hold all T tokens until `rollback`.
        -> (per row the T tokens it was fed, the greedy token after each of them, their fp32 logprobs, whether the
        row's logits were all finite), with one host sync; `with_logits` adds the fp32 logits [n, T, V] (a copy, on
        the device), for tests."""
        n, T = len(seqs), len(tokens[0])
        key, buf, (out, logits, saved) = self._launch("verify", self._verify_run, seqs, slots, tokens, True,
                                                      device_ids=drafted)
        self._verified = (key, buf, saved)
        result = out[:, :n].cpu().tolist()  # the verification's one host sync
        for s in seqs:
            s.length += T
        fed, argmax = ([[int(t) for t in row] for row in result[i]] for i in (3, 0))
        verified = fed, argmax, result[1], [row[0] > 0 for row in result[2]]
        return (*verified, logits[:n].clone()) if with_logits else verified

    def rollback(self, keep: list[int]) -> None:
        """After `verify`: row b's KDA states back to its state before the verification plus its first keep[b]
        tokens (the engine rolls the lengths back; the MLA latents past a row's length are never read). Captured
        per bucket the first time. NOTE: its warmup really runs the rollback (twice) on this round's rows, and that is
        harmless: it reads only the verification's kept tensors (committed states, per-token inputs, or the spare
        rows of every token's state) and `keep`, and the only row it writes that it also reads is the slot of a row
        that kept every token, which it copies onto itself: every run writes the same states."""
        if min(keep) < 1:
            raise ValueError(f"rollback keep={keep}: every row keeps its first verified token (the pending one)")
        key, buf, saved = self._verified
        rows = torch.zeros(buf.B, dtype=torch.long)
        rows[:len(keep)] = torch.tensor(keep)
        buf.keep.copy_(rows)
        if not self.graphs:
            self._rollback_run(buf, saved)
            return
        if key not in self.rollbacks:
            self.rollbacks[key], _ = self._capture(lambda b, _: self._rollback_run(b, saved), buf, True)
        self.rollbacks[key].replay()
        self.counters["graph_replays"] += 1
