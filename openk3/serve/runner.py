"""Model execution for the inference engine: one model, its page pool and the decode batch's KDA states.

The engine (engine.py) decides what runs; a `ModelRunner` runs it. The engine owns one for the target model and,
with speculative decoding, one for the draft:

    runner = ModelRunner(model, num_pages=1024, page_size=64)
    states = runner.new_states()                          # a prefilling request's own KDA states (batch 1)
    logits = runner.forward([seq], states, [prompt_ids])  # fp32 [1, T, V]; writes the latents, advances seq
    runner.join(states)                                   # the request joins the decode batch (a new last row)
    logits = runner.forward(seqs, runner.kda, [[t] for t in last_tokens])
    runner.keep_rows([0, 2])                              # rows 1 and 3 left the batch

Running requests' KDA states live batch-contiguous (one `KDAState` per layer with a row per request, row b of
`kda` is the engine's running[b]), rebuilt only when requests join or leave; their MLA latents live in the pool.
With the fast decode path (`slots=`, static.py) they live in a preallocated `SlotPool` instead, row b of `kda`
reading slot `rows[b]` in place; joining and leaving only assign slots, and `decode` runs the static step:

    runner = ModelRunner(model, num_pages=1024, page_size=64, slots=32, graphs=True)
    tokens, logprobs, finite = runner.decode(seqs, last_tokens, params, seeds, counters)

or, to overlap the host's work with the device's, `launch_decode` (the next step may feed this one's tokens on the
device, unread) and later `collect`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from openk3.model.fused import FusedProjections, applied, fuse_projections
from openk3.model.model import K3ForCausalLM
from openk3.serve.cache import (KDAState, PagedSeq, PagePool, cat_kda_states, device_tensor, new_kda_states,
                                paged_cache, rollback_kda, select_kda_rows)
from openk3.serve.sampler import SamplingParams
from openk3.serve.static import Launched, SlotPool, StaticDecoder, batch_bucket, kda_in_place

# The longest prefill chunk (tokens a row) the fast path runs as static runs (`ModelRunner(static_prefill=)`): the
# engine's default `prefill_chunk`, so a short prompt or the new tokens of a turn after a prefix hit run captured
STATIC_PREFILL_TOKENS = 512


class ModelRunner:
    """Runs `model` (on its own device and dtype) over ragged batches of paged sequences.

    The runner leaves the model's train/eval mode alone (it is the caller's; `load_for_inference` returns eval): every
    forward runs under the engine's inference mode, and no K3 module behaves differently in train mode (no dropout,
    no batch statistics; `recomputed` checks torch.is_grad_enabled(), not the mode)."""

    def __init__(self, model: K3ForCausalLM, num_pages: int, page_size: int, slots: int | None = None,
                 graphs: bool = False, compile: bool | str = False, fuse: bool = False,
                 static_prefill: bool | None = None, spec_tokens: int = 0):
        """slots: run the fast decode path with a KDA slot pool for that many running sequences (None: the
        general path); graphs: capture its steps as CUDA graphs (CUDA only); compile: torch.compile the step
        first (True, or a torch.compile backend name; `StaticDecoder`); fuse: compute each module's input
        projections with one matmul over a stacked copy of their weights (openk3/model/fused.py), refreshed before
        every forward so that in-place weight updates (RL, `Engine.load_weights`) are seen; static_prefill: run
        prefill chunks of at most STATIC_PREFILL_TOKENS tokens as static runs on the fast path (`forward`); None =
        where they are captured (`graphs`): eagerly they only cost more forwards; spec_tokens: the draft tokens k
        of the speculative rounds this runner verifies (fast path): with fla's kernels (not compiled) the slot pool
        then keeps spare rows for the state after each verified token but the last, batch_bucket(slots) * k of them
        (`SlotPool(spare=)`), and a verification's rollback is a copy (`StaticDecoder._verify_run`)."""
        self.model = model
        self.fused: FusedProjections | None = fuse_projections(model) if fuse else None
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.pool = PagePool(model.config, num_pages, page_size, self.device, self.dtype)
        spare = batch_bucket(slots) * spec_tokens if slots is not None and kda_in_place(self.device, compile) else 0
        self.slots = SlotPool(model.config, slots, self.device, self.dtype, spare) if slots is not None else None
        self.decoder = StaticDecoder(model, self.pool, self.slots, graphs, compile, self.fused) \
            if slots is not None else None
        self.static_prefill = self.decoder is not None and (graphs if static_prefill is None else static_prefill)
        self._rows: list[int] = []  # fast path: the slot of each row of the decode batch (slot ids, not pool rows)
        self._kda: list = new_kda_states(model.config, 0, self.device, self.dtype)  # the decode batch
        self._joining: list[list[KDAState]] = []  # the states of requests that joined since the batch was last used
        if self.slots is not None:
            self._view()
        self.speculating = False  # between begin_speculation and end_speculation: forwards keep the KDA inputs

    def new_states(self) -> list[KDAState]:
        """Zero KDA states for one sequence (batch 1), one per KDA layer."""
        return new_kda_states(self.model.config, 1, self.device, self.dtype)

    def forward(self, seqs: list[PagedSeq], kda: list[KDAState], tokens: list[list[int]],
                logits_to_keep: int = 0, image_features: list[Tensor] | None = None) -> Tensor:
        """One forward of a ragged batch: row b appends tokens[b] (all rows the same count T) after its cached
        seqs[b].length tokens. Updates the KDA states in place and the lengths. -> fp32 logits [B, T or kept, V].
        While speculating, each KDA state's `inputs` holds this forward's per-token inputs (for `rollback`).
        image_features: the vision vectors of the `<|media_pad|>` slots among `tokens` (K3ForConditionalGeneration).
        NOTE: `tokens` must lie in the vocabulary; they are not checked here (the engine checks them at submit)."""
        T = len(tokens[0])
        # NOTE: `slots.free` may still count slots that pending joins (`join`) will take: the chunk gives its slots
        # back before they do
        if (self.static_prefill and logits_to_keep == 1 and image_features is None and T <= STATIC_PREFILL_TOKENS
                and not self.speculating and len(self.slots.free) >= len(seqs)):
            return self._prefill_static(seqs, kda, tokens)
        cache = paged_cache(self.pool, kda, seqs, T)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        images = {} if image_features is None else {"image_features": image_features}
        # fused projections refreshed first: the weights may have changed in place since the last forward.
        # validate=False: the model's id range check reads min and max back (two host syncs a forward, every
        # prefill chunk and general decode step); the engine checks prompts at submit and `score` its tokens, and
        # samples every other id inside the vocabulary (docs/engine.md "Host time of a prefill and of a prefix hit")
        with applied(self.fused):
            logits = self.model(ids, cache=cache, logits_to_keep=logits_to_keep, keep_inputs=self.speculating,
                                validate=False, **images).logits
        for s in seqs:
            s.length += T
        return logits.float()

    def _prefill_static(self, seqs: list[PagedSeq], kda: list[KDAState], tokens: list[list[int]]) -> Tensor:
        """`forward` of a prefill chunk (the last token's logits kept) through the fast path's static runs
        (`StaticDecoder.prefill`): the rows' KDA states go into free slots of the pool for the chunk and come back
        out after it (two copies of each kind)."""
        slots = self.slots.take_rows(kda)
        try:
            logits = self.decoder.prefill(seqs, slots, tokens)
            self.slots.read(slots, kda)
        finally:
            for slot in slots:
                self.slots.give(slot)
        return logits

    # ---- the decode batch's KDA states
    def join(self, states: list[KDAState]) -> None:
        """A request's states become the batch's last row (fast path: they are copied into a free slot). Deferred to
        the batch's next use (`rows`, `kda`), so that the requests a prefill group ends join in one copy per kind
        instead of two copies, a view rebuild and two host-to-device copies each (64 of them at batch 64)."""
        self._joining.append(states)

    @property
    def rows(self) -> list[int]:
        """Fast path: the slot of each row of the decode batch."""
        self._join_pending()
        return self._rows

    @property
    def kda(self) -> list:
        """The decode batch's KDA states, one per KDA layer (fast path: views of the slot pool at `rows`)."""
        self._join_pending()
        return self._kda

    def _join_pending(self) -> None:
        if not self._joining:
            return
        if self.slots is None:
            self._kda = cat_kda_states(self._kda, *self._joining)
        else:
            self._rows += self.slots.take_rows(*self._joining)  # (if it raises, the joins stay pending)
            self._view()
        self._joining = []

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows stay, in this order (requests left the batch; fast path: their slots are freed)."""
        if self.slots is None:
            self._kda = select_kda_rows(self.kda, rows)
            return
        for b in set(range(len(self.rows))) - set(rows):
            self.slots.give(self.rows[b])
        self._rows = [self.rows[b] for b in rows]
        self._view()

    def _view(self) -> None:
        """`kda` for the fast path: the slot pool's states at the batch's slots (rebuilt on join and leave only;
        the objects persist between them, as speculation's kept inputs must)."""
        self._kda = self.slots.view(device_tensor(self._rows, self.device))  # (not waiting for a step in flight)

    def decode(self, seqs: list[PagedSeq], tokens: list[int], params: list[SamplingParams], seeds: list[int],
               counters: list[int], with_logits: bool = False) -> tuple:
        """The fast path's decode step for the whole batch (row b = seqs[b], slot rows[b]); see
        `StaticDecoder.step`."""
        if self.decoder is None:
            raise RuntimeError("decode is the fast path's step: build the runner with slots=")
        return self.decoder.step(seqs, self.rows, tokens, params, seeds, counters, with_logits)

    def launch_decode(self, batch: list[int], seqs: list[PagedSeq], tokens: list[int], params: list[SamplingParams],
                      seeds: list[int], counters: list[int], after: Launched | None = None,
                      carry: list[int | None] | None = None, fed: bool = True) -> Launched:
        """The fast path's decode step for rows `batch` of the decode batch (seqs[i] is row batch[i]'s), queued
        without waiting for it; `after`, `carry`: rows that feed a token of the step `after` (not read yet); `fed`:
        whether a later step may. See `StaticDecoder.launch`; read it with `collect`."""
        if self.decoder is None:
            raise RuntimeError("launch_decode is the fast path's step: build the runner with slots=")
        return self.decoder.launch(seqs, [self.rows[b] for b in batch], tokens, params, seeds, counters, after, carry,
                                   fed)

    def collect(self, launched: Launched) -> tuple[list[int], list[float], list[bool]]:
        """Wait for a step of `launch_decode` -> (tokens, fp32 logprobs, finite) per row (`StaticDecoder.collect`)."""
        return self.decoder.collect(launched)

    # ---- speculative decoding on the fast path (static steps; greedy rows)
    def draft(self, seqs: list[PagedSeq], pending: list[int], k: int) -> tuple[Tensor, list]:
        """The fast path's k + 1 greedy draft steps of a speculative round for the whole batch, without a host
        sync (row b = seqs[b], slot rows[b], its pending token pending[b]); see `StaticDecoder.draft`."""
        if self.decoder is None:
            raise RuntimeError("draft is the fast path's step: build the runner with slots=")
        return self.decoder.draft(seqs, self.rows, pending, k)

    def verify(self, seqs: list[PagedSeq], pending: list[int], drafted: Tensor) -> tuple:
        """The fast path's speculative verification for the whole batch: row b = seqs[b], slot rows[b], fed its
        pending token then drafted[b] (on the device, from `draft`); see `StaticDecoder.verify`, then
        `rollback_verified`."""
        if self.decoder is None:
            raise RuntimeError("verify is the fast path's step: build the runner with slots=")
        k = drafted.shape[1]
        return self.decoder.verify(seqs, self.rows, [[t] * (k + 1) for t in pending], drafted)

    def rollback_verified(self, keep: list[int]) -> None:
        """After `verify`: row b keeps the KDA state of its first keep[b] verified tokens (`StaticDecoder.rollback`)."""
        self.decoder.rollback(keep)

    def restore(self, snapshots: list[tuple[Tensor, Tensor]], keep: list[int]) -> None:
        """Fast path: row b's KDA states back to snapshots[keep[b] - 1] wherever keep[b] <= len(snapshots) (a
        draft's states after its first keep[b] tokens of a speculative round; the other rows stay)."""
        for n in sorted(set(keep)):
            if n > len(snapshots):
                continue
            batch = [b for b, x in enumerate(keep) if x == n]
            self.slots.restore(torch.tensor([self.rows[b] for b in batch], dtype=torch.long, device=self.device),
                               snapshots[n - 1], torch.tensor(batch, dtype=torch.long, device=self.device))

    # ---- speculative decoding (the general path; and the fast path's sampled rows)
    def begin_speculation(self) -> list[KDAState]:
        """The committed states; this runner's forwards ask the model for the per-token KDA inputs from now on (for
        `rollback`). The committed states are the tensors the layers hold now; forwards replace them, so no copy is
        needed."""
        self.speculating = True
        return [KDAState(s.recurrent, s.conv) for s in self.kda]

    def rollback(self, committed: list[KDAState], inputs: list[dict[str, Tensor]], keep_B: Tensor) -> None:
        """Set each layer's batch state to its committed state + the first keep_B[b] tokens of the round, from
        that layer's per-token inputs of the round (`rollback_kda`)."""
        for s, c, x in zip(self.kda, committed, inputs):
            rollback_kda(s, c, x, keep_B)

    def end_speculation(self) -> None:
        self.speculating = False
        for s in self.kda:
            s.inputs = None
