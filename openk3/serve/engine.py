"""The openk3 inference engine (K3_SPEC section 7): continuous batching over a paged cache, chunked prefill,
sampling, the hybrid prefix cache and speculative decoding; and the `generate` / `chat` commands.

    engine = Engine(model, EngineConfig(page_size=64), draft=None)
    req = engine.submit(prompt_ids, SamplingParams(max_tokens=64, temperature=0.0))
    while engine.has_work():
        for out in engine.step():        # StepOutput(request_id, token_ids, logprobs, finish_reason)
            ...                          # stream out.token_ids to the client of out.request_id
    engine.cancel(req.id); engine.stats()

A server runs `step()` in one thread (a loop or a background thread); `submit` and `cancel` may be called from any
thread, they only append to queues that the next step drains. One `step()`:
  1. takes in submitted requests and cancellations;
  2. admits waiting requests in arrival order while the batch has room and the pool can promise each its worst
     case (prompt + max_tokens tokens of pages, less what the prefix cache shares), evicting cached prefixes if
     needed. An admitted request starts at its deepest prefix hit: shared MLA pages, a copy of the KDA checkpoint;
  3. prefills at most `prefill_chunk` prompt tokens (forwards that write the latents into the requests' pages;
     chunks also end at KDA checkpoint boundaries); requests at the head of the queue whose chunks have the same
     length run as one batched forward. A request whose prompt is done samples its first token and joins the
     decode batch;
  4. decodes one token for every running request in one batched forward over the ragged batch (absorbed MLA
     reading the pages, recurrent KDA), or with a draft model one speculative round: k draft tokens, one target
     forward over k + 1 tokens, rejection sampling, KDA rollback from the kept per-token inputs. With
     `EngineConfig.overlap` (the fast path) the step is launched before the one before it is read, which is read
     then: the device decodes while the host works, and tokens arrive one step later.

Sampling (the parameters, top-k/top-p, speculative acceptance) is in sampler.py; running the model (the forward
over a ragged batch of paged sequences, the decode batch's KDA states, the speculative rollback) in runner.py, one
`ModelRunner` for the target and one for the draft. This file is the scheduler.
"""

from __future__ import annotations

import argparse
import itertools
import json
import secrets
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from openk3.model.checkpoint import load_for_inference
from openk3.model.model import RECURRENT_SEGMENT_TOKENS, K3ForCausalLM
from openk3.serve.cache import Match, PagedSeq, PagePool, PrefixCache, PrefixPath, cat_kda_states, split_kda_rows
from openk3.serve.runner import ModelRunner
from openk3.serve.sampler import SamplingParams, accept_draft, filtered_probs, sample_tokens
from openk3.serve.static import Launched, capture_problem
from openk3.text.chat import (EFFORTS, END, IdOutputParser, chat_format_for, chat_stop_ids, encode_segments,
                              render)
from openk3.vision.preprocess import batch_images


# ------------------------------------------------------------------------------------------ requests

@dataclass
class EngineConfig:
    """Engine settings. Pages: `num_pages` pages of `page_size` tokens each (page 0 is a reserved zero page);
    they hold running requests' MLA latents and the prefix cache's blocks and KDA checkpoints alike.
    Prefix cache: a hash every `hash_interval` tokens; KDA checkpoints every `checkpoint_interval` prompt tokens
    (a multiple of hash_interval; None = only at the ends of prompts and turns). NOTE: a request resumes only at
    a checkpoint before its last prompt token (any hash boundary for a model without KDA layers), so a prompt
    shorter than `checkpoint_interval` sent twice gets `cached_tokens == 0`; one that extends an earlier prompt
    or turn resumes at its end (see `PrefixCache`, docs/engine.md). `prefill_chunk`: prompt tokens
    per step (bounds the decode stall a long prompt causes). `max_batch`: requests prefilling or decoding at once.
    `num_draft_tokens`: tokens a draft model proposes per speculative round. On the fast path with fla's kernels the
    target's slot pool keeps that many spare KDA states per batch row (max_batch rounded up to its CUDA-graph
    bucket), where a verification keeps the state after each token: 13.0 MB a state for kimi-linear-1.5b, 434 MB
    for kimi-k3 (docs/engine.md "Speculative decoding").
    `fast_decode`: decode through the static step (static.py, docs/engine.md "Fast decode path": KDA slot pool,
    fixed-width page tables, batched device sampler); None = on CUDA only. `cuda_graphs`: capture that step as
    CUDA graphs per batch bucket; None = whenever it can be (`capture_problem`; `stats()["decode_path"]` says
    what runs). `compile_decode`: torch.compile that step first (fast path only, not with a draft model; off by
    default: every batch bucket compiles on first use; measured in docs/engine.md). `fuse_projections`: compute each
    module's input projections with one matmul over a stacked copy of their weights (fewer kernel launches a step;
    the copies cost 12% of kimi-linear-1.5b's parameters again; openk3/model/fused.py); None = on CUDA only.
    `overlap`: on the fast path, launch each decode step before reading the one before it, so that the host's work
    between steps runs while the device decodes (docs/engine.md "Overlapping the host with the device"); the same
    tokens, each delivered one `step()` later (a prefill's first token is not delayed); not with a draft (a
    speculative round reads every result before the next). None = on where the fast path runs with CUDA graphs and
    no draft (the hard gate passes with it on the H200, `test_the_gate_on_cuda_on_the_fast_path`)."""

    page_size: int = 64
    num_pages: int = 1024
    max_batch: int = 32
    prefill_chunk: int = 512
    prefix_cache: bool = True
    hash_interval: int = 64
    checkpoint_interval: int | None = 2048
    num_draft_tokens: int = 4
    fast_decode: bool | None = None
    cuda_graphs: bool | None = None
    compile_decode: bool = False
    fuse_projections: bool | None = None
    overlap: bool | None = None

    def __post_init__(self) -> None:
        for name in ("page_size", "max_batch", "prefill_chunk", "hash_interval", "num_draft_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineConfig.{name}={v!r}: must be a positive integer")
        if not isinstance(self.num_pages, int) or self.num_pages < 2:
            raise ValueError(f"EngineConfig.num_pages={self.num_pages!r}: must be at least 2")
        for name in ("fuse_projections", "overlap"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r}: must be None, True or False")
        ci = self.checkpoint_interval
        if ci is not None and (not isinstance(ci, int) or ci < 1 or ci % self.hash_interval):
            raise ValueError(f"EngineConfig.checkpoint_interval={ci!r}: must be None or a positive multiple of "
                             f"hash_interval={self.hash_interval}")


@dataclass(eq=False)
class Request:
    """One generation request. The caller reads `output` (generated ids, the stop token included), `logprobs`
    (fp32 log-probability of each under the target model's raw logits), `finish_reason` ("stop", "length",
    "cancelled", "error" or None while running; `error` then says why), `cached_tokens` (prompt tokens taken from the prefix cache) and the
    timestamps; everything below `status` is the engine's."""

    id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    submitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    status: str = "waiting"  # waiting -> prefilling -> running -> finished
    stop: frozenset = frozenset()
    seq: PagedSeq = field(default_factory=PagedSeq)
    draft_seq: PagedSeq = field(default_factory=PagedSeq)
    kda: list | None = None  # own KDA states while prefilling (batch 1); in the batch tensors once running
    draft_kda: list | None = None
    prefix: PrefixPath | None = None
    generator: torch.Generator | None = None
    sample_seed: int = 0  # fast path: the seed of `sample_batch` (the request's seed, else a random one)
    # Images (K3ForConditionalGeneration): preprocessed, in the order of their `<|media_pad|>` slots; their vision
    # vectors, computed once at the first prefill chunk that needs them; and the prompt as the prefix cache hashes
    # it, each slot standing for its image's pixel digest (so two images never share a cache entry).
    images: list | None = None
    vision: Tensor | None = None
    cache_tokens: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def completion_ids(self) -> list[int]:
        """The output without a final stop token (what a client shows)."""
        return self.output[:-1] if self.finish_reason == "stop" else list(self.output)


@dataclass
class StepOutput:
    """What one step produced for one request: new tokens (possibly several with speculative decoding), their
    logprobs, and the finish reason if the request ended in this step."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


# ------------------------------------------------------------------------------------------ the engine

class Engine:
    """Continuous batching over a paged cache for one target model (and optionally a draft model with the same
    vocabulary); see the module docstring. `model` and `draft` are used as they are (device, dtype)."""

    def __init__(self, model: K3ForCausalLM, config: EngineConfig | None = None, draft: K3ForCausalLM | None = None):
        self.cfg = config = config or EngineConfig()
        device = model.lm_head.weight.device
        self.fast = config.fast_decode if config.fast_decode is not None else device.type == "cuda"
        problem = capture_problem(model) if self.fast else "the general decode path is not captured"
        graphs = config.cuda_graphs if config.cuda_graphs is not None else problem is None
        if graphs and problem is not None:
            raise ValueError(f"EngineConfig.cuda_graphs=True: cannot capture the decode step ({problem}; "
                             f"fast_decode={config.fast_decode})")
        # what decodes, and why not more (stats() reports it; a benchmark records it)
        self.decode_path = ("fast, CUDA graphs" if graphs else f"fast, eager ({problem})") if self.fast else "general"
        self.overlap = config.overlap if config.overlap is not None else self.fast and graphs and draft is None
        if self.overlap and (not self.fast or draft is not None):
            raise ValueError(f"EngineConfig.overlap=True overlaps the fast decode path's steps: it needs fast_decode "
                             f"(fast_decode={config.fast_decode}, model on {device}) and no draft model (a "
                             f"speculative round reads every result before the next)")
        if self.overlap:
            self.decode_path += ", overlapped"
        slots = config.max_batch if self.fast else None
        if config.compile_decode and not self.fast:
            raise ValueError("EngineConfig.compile_decode=True compiles the fast decode path's step; it needs "
                             f"fast_decode (fast_decode={config.fast_decode}, model on {device})")
        if config.compile_decode and draft is not None:
            # with a draft every decode is a speculative round, which never runs the compiled step: a sampled
            # batch's round goes through `_forward`, a greedy batch's through the static draft, verify and rollback
            # runs (static.py: CUDA graphs where they can be, never compiled)
            raise ValueError("EngineConfig.compile_decode=True with a draft model: speculative decoding does not run "
                             "the compiled decode step; drop one of the two")
        fuse = config.fuse_projections if config.fuse_projections is not None else device.type == "cuda"
        # greedy rounds on the fast path run as static runs while the verification's k + 1 tokens run the KDA
        # recurrence token by token (`_speculate`); each verifies keeping every token's KDA state (`_verify_run`)
        self.static_rounds = self.fast and config.num_draft_tokens + 1 <= RECURRENT_SEGMENT_TOKENS
        spec_tokens = config.num_draft_tokens if draft is not None and self.static_rounds else 0
        self.target = ModelRunner(model, config.num_pages, config.page_size, slots=slots, graphs=graphs,
                                  compile=config.compile_decode, fuse=fuse, spec_tokens=spec_tokens)
        self.model, self.pool = self.target.model, self.target.pool
        self.device, self.dtype = self.target.device, self.target.dtype
        self.prefix = PrefixCache(self.pool, config.hash_interval) if config.prefix_cache else None
        # where prefill chunks stop for a KDA checkpoint (none without a prefix cache to keep them in)
        self.checkpoint_interval = config.checkpoint_interval if self.prefix is not None else None
        self.drafter: ModelRunner | None = None
        self.draft = self.draft_pool = None
        if draft is not None:
            if draft.config.vocab_size != model.config.vocab_size:
                raise ValueError(f"draft vocab_size={draft.config.vocab_size} != target vocab_size="
                                 f"{model.config.vocab_size}: a draft must share the target's tokenizer")
            if draft.lm_head.weight.device != self.device:
                raise ValueError(f"draft is on {draft.lm_head.weight.device}, target on {self.device}")
            # on the fast path a greedy batch's draft steps are its static steps (captured where the draft can
            # be), a sampled batch's go through `_forward`. Its own fusion (an early-exit draft's modules are its
            # own, reading the target's parameter tensors).
            draft_problem = capture_problem(draft) if graphs else None
            self.drafter = ModelRunner(draft, config.num_pages, config.page_size, slots=slots, fuse=fuse,
                                       graphs=graphs and draft_problem is None)
            if draft_problem is not None:  # said, not silently slower (STYLE rule 10)
                self.decode_path += f"; the draft's steps eager ({draft_problem})"
            self.draft, self.draft_pool = self.drafter.model, self.drafter.pool
        # Positions a speculative round may write past the last kept token (its worst case is reserved too).
        self.lookahead = config.num_draft_tokens if draft is not None else 0

        self._inbox: deque[Request] = deque()  # submit() and cancel() only append here (thread-safe)
        self._cancels: deque[str] = deque()
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []  # the decode batch; row b of the runners' batch states is running[b]
        # overlap: the fast path's decode step launched and not read yet, with the requests of its rows
        self._in_flight: tuple[list[Request], Launched] | None = None
        self.counters = dict(steps=0, prefill_tokens=0, prefill_forwards=0, decode_tokens=0, prefill_seconds=0.0,
                             decode_seconds=0.0, spec_rounds=0, draft_tokens=0, accepted_tokens=0, finished=0,
                             images_encoded=0)

    # ---- the API a server uses
    def submit(self, prompt: list[int], params: SamplingParams | None = None, *, cache_salt: str | None = None,
               request_id: str | None = None, images: list | None = None) -> Request:
        """Queue a request; it starts at a later `step()`. Raises ValueError for a prompt the engine cannot run.
        images: `openk3.vision.preprocess.ImageInput`s for a multimodal model, in prompt order; the prompt holds
        each image's `<|media_pad|>` once per vision vector (`openk3.vision.model.expand_media_pads`)."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        V = self.model.config.vocab_size
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} outside the vocabulary [0, {V})")
        need = len(prompt) + params.max_tokens + self.lookahead
        if need > self.pool.capacity_tokens:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) needs {need} "
                             f"tokens of cache, more than the pool holds ({self.pool.capacity_tokens}: "
                             f"num_pages={self.cfg.num_pages} x page_size={self.cfg.page_size}, less the zero page)")
        stop = params.stop_token_ids if params.stop_token_ids is not None else (self.model.config.eos_token_id,)
        generator, sample_seed = None, 0
        if not params.greedy:
            sample_seed = params.seed if params.seed is not None else secrets.randbits(62)
            generator = torch.Generator(device=self.device)
            if params.seed is not None:
                generator.manual_seed(params.seed)
            else:
                generator.seed()
        req = Request(id=request_id if request_id is not None else f"req-{next(self._ids)}", prompt=prompt,
                      params=params, cache_salt=cache_salt, submitted_at=time.perf_counter(),
                      stop=frozenset(t for t in stop if t is not None), generator=generator, sample_seed=sample_seed)
        if images:
            req.images, req.cache_tokens = images, image_cache_tokens(self.model.config, prompt, images)
        self._inbox.append(req)
        return req

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step (a disconnected client); its finish_reason becomes "cancelled"."""
        self._cancels.append(request_id)

    def has_work(self) -> bool:
        return bool(self._inbox or self.waiting or self.prefilling or self.running)

    def stats(self) -> dict:
        """Counters for monitoring: queue depth, batch, pool pages, prefix-cache counters, speculative counters."""
        s = dict(self.counters, decode_path=self.decode_path,
                 queue_depth=len(self._inbox) + len(self.waiting), prefilling=len(self.prefilling),
                 running=len(self.running), free_pages=len(self.pool.free), reserved_pages=self.pool.reserved)
        if self.prefix is not None:
            s.update(self.prefix.counters())
        return s

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[Request]:
        """Submit every prompt and step until all are done (a convenience for scripts and tests)."""
        if not isinstance(params, list):
            params = [params] * len(prompts)
        reqs = [self.submit(p, sp, cache_salt=cache_salt) for p, sp in zip(prompts, params)]
        while not all(r.finished for r in reqs):
            self.step()
        return reqs

    # ---- for post-training: weight updates and scoring
    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Copy new weights into the target model in place (RL syncs the trained policy here each iteration) and
        drop the whole prefix cache: its latents and KDA checkpoints were computed by the old weights. Only
        between requests. NOTE: a draft model keeps its own weights (an early-exit draft shares the target's)."""
        if self.has_work():
            raise RuntimeError("load_weights while requests are running: finish or cancel them first")
        self._drain([])  # a step still in flight serves only ended requests (no output); done before its graph goes
        self.model.load_state_dict(state_dict)
        if self.target.decoder is not None and self.model.qat:  # NOTE: graphs froze the MXFP4 grid decision
            self.target.decoder.forget_graphs()
        if self.prefix is not None:
            while self.prefix.evict_one():
                pass
            if self.prefix.nodes:
                raise RuntimeError(f"{len(self.prefix.nodes)} prefix-cache blocks stayed pinned after a weight change")
        self.counters["weight_loads"] = self.counters.get("weight_loads", 0) + 1

    @torch.inference_mode()
    def score(self, tokens: list[int]) -> list[float]:
        """fp32 log-probabilities of tokens[1:], each given the tokens before it, under the target's raw logits (a
        teacher's view of another model's sample; vLLM's prompt logprobs). Runs at once, outside the schedule,
        as B = 1 chunked prefills into pages of its own that are freed afterwards."""
        if len(tokens) < 2:
            raise ValueError(f"score needs at least 2 tokens, got {len(tokens)}")
        V = self.model.config.vocab_size
        bad = [t for t in tokens if not 0 <= t < V]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {V})")
        need = self.pool.pages_for(len(tokens))
        if not self._make_room(need):
            raise ValueError(f"{len(tokens)} tokens need {need} pages; the pool has {self.pool.available} free")
        self.pool.reserve(need)
        seq, states, out = PagedSeq(reserved=need), self.target.new_states(), []
        try:
            for start in range(0, len(tokens) - 1, self.cfg.prefill_chunk):
                chunk = tokens[start:min(start + self.cfg.prefill_chunk, len(tokens) - 1)]
                logp = torch.log_softmax(self._forward(self.model, self.pool, [seq], states, [chunk])[0], -1)
                nxt = torch.tensor(tokens[start + 1:start + 1 + len(chunk)], device=logp.device)
                out += logp.gather(1, nxt[:, None])[:, 0].tolist()
        finally:
            seq.free(self.pool)
        return out

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One scheduling step (module docstring); returns the tokens produced in it, per request."""
        outputs: list[StepOutput] = []
        self._take_inbox(outputs)
        self._admit()
        t0 = time.perf_counter()
        if self.prefilling:
            self._prefill(outputs)
        t1 = time.perf_counter()
        if self.running:
            if self.draft is not None:
                self._speculate(outputs)
            else:
                self._decode(outputs)
            self.counters["decode_seconds"] += time.perf_counter() - t1
        self.counters["prefill_seconds"] += t1 - t0
        self.counters["steps"] += 1
        return outputs

    # ---- admission
    def _take_inbox(self, outputs: list[StepOutput]) -> None:
        while self._inbox:
            self.waiting.append(self._inbox.popleft())
        cancelled = set()
        while self._cancels:
            cancelled.add(self._cancels.popleft())
        if not cancelled:
            return
        for req in [r for r in self.waiting if r.id in cancelled]:
            self.waiting.remove(req)
            self._end(req, "cancelled", outputs)
        for req in [r for r in self.prefilling if r.id in cancelled]:
            self.prefilling.remove(req)
            self._end(req, "cancelled", outputs)
        rows = [b for b, r in enumerate(self.running) if r.id in cancelled]
        for b in rows:
            self._end(self.running[b], "cancelled", outputs)
        self._leave(rows)

    def _make_room(self, pages: int) -> bool:
        """Evict cached prefixes until `pages` pages are available; False if that is impossible."""
        while self.pool.available < pages:
            if self.prefix is None or not self.prefix.evict_one():
                return False
        return True

    def _admit(self) -> None:
        while self.waiting and len(self.prefilling) + len(self.running) < self.cfg.max_batch:
            if not self._try_admit(self.waiting[0]):
                return
            req = self.waiting.popleft()
            req.status = "prefilling"
            self.prefilling.append(req)

    def _try_admit(self, req: Request) -> bool:
        pool, n = self.pool, len(req.prompt)
        total = n + req.params.max_tokens + self.lookahead
        match = self.prefix.lookup(cache_key(req), req.cache_salt) if self.prefix is not None else Match([], 0)
        need = pool.pages_for(total) - match.length // pool.page_size  # shared pages cost nothing
        draft_need = self.draft_pool.pages_for(total) if self.draft_pool is not None else 0
        if self.prefix is not None:
            self.prefix.pin(match)  # so that making room cannot evict the match itself
        if not self._make_room(need) or (self.draft_pool is not None and self.draft_pool.available < draft_need):
            if self.prefix is not None:
                self.prefix.unpin(match)
            return False
        pool.reserve(need)
        req.seq = PagedSeq(reserved=need)
        states = None
        if self.prefix is not None:
            req.prefix, states = self.prefix.use(match, n, req.cache_salt, req.seq)
        req.cached_tokens = match.length
        req.kda = states if states is not None else self.target.new_states()
        if self.draft is not None:
            self.draft_pool.reserve(draft_need)
            req.draft_seq = PagedSeq(reserved=draft_need)
            req.draft_kda = self.drafter.new_states()
        return True

    # ---- forwards
    def _forward(self, model: K3ForCausalLM, pool: PagePool, seqs: list[PagedSeq], kda: list,
                 tokens: list[list[int]], logits_to_keep: int = 0,
                 image_features: list[Tensor] | None = None) -> Tensor:
        """`ModelRunner.forward` of `model`'s runner (target or draft; `pool` is that runner's pool).
        NOTE: every forward of the engine goes through this one method, so a test or a server can wrap it
        (e.g. to make one row's logits NaN) without knowing the runners."""
        runner = self.target if model is self.model else self.drafter
        return runner.forward(seqs, kda, tokens, logits_to_keep, image_features)

    def _image_slots(self, req: Request, start: int, end: int) -> list[Tensor] | None:
        """The vision vectors of the media slots in prompt[start:end] (None for a request without images). The
        request's images go through the tower once, at the first chunk with a slot (a prefix hit that covers every
        slot never runs it)."""
        if req.images is None:
            return None
        pad = self.model.config.media_placeholder_token_id
        a = req.prompt[:start].count(pad)
        b = a + req.prompt[start:end].count(pad)
        if a == b:
            return []
        if req.vision is None:
            pixel_values, grid_thws = batch_images(req.images)
            features = self.model.image_features(pixel_values.to(self.device), grid_thws.to(self.device))
            req.vision = torch.cat(features)
            self.counters["images_encoded"] += len(req.images)
        return [req.vision[a:b]]

    def _chunk_end(self, req: Request, budget: int) -> int:
        """Where this step's prefill chunk of `req` ends: at most `budget` tokens on, and never past the next KDA
        checkpoint boundary (the state exists only there)."""
        ci = self.checkpoint_interval
        n, start = len(req.prompt), req.seq.length
        end = min(n, start + budget)
        if ci is not None and (start // ci + 1) * ci < end:
            end = (start // ci + 1) * ci
        return end

    def _prefill_group(self, budget: int) -> tuple[list[Request], int]:
        """The requests at the head of the prefill queue that run as one forward, and their chunk length T: the first,
        and after it every next one whose chunk has the same length while the budget lasts (one forward of [G, T]
        instead of G forwards of [1, T]). That groups equal-length prompts that fit the budget together (and chunks
        cut at the same checkpoint boundary), not long prompts: the first one's chunk takes the whole budget. A
        request with images runs alone."""
        head = self.prefilling[0]
        T = self._chunk_end(head, budget) - head.seq.length
        group = [head]
        if head.images:
            return group, T
        for req in self.prefilling[1:]:
            if (budget - len(group) * T < T or req.images
                    or self._chunk_end(req, budget - len(group) * T) - req.seq.length != T):
                break
            group.append(req)
        return group, T

    def _prefill(self, outputs: list[StepOutput]) -> None:
        budget = self.cfg.prefill_chunk
        while self.prefilling and budget > 0:
            group, T = self._prefill_group(budget)
            req = group[0]
            start = req.seq.length
            end = start + T
            try:
                slots = self._image_slots(req, start, end)
            except torch.OutOfMemoryError:
                # NOTE: an image within the request limits can still exhaust memory in the tower; that fails this
                # request alone (finish_reason "error"), as non-finite logits do, instead of every running one.
                req.error = f"the vision tower ran out of memory on this request's {len(req.images)} image(s)"
                self._end(req, "error", outputs)
                self.prefilling.pop(0)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            images = {} if slots is None else {"image_features": slots}  # (a text request calls _forward as before)
            # one forward for the group: its rows' KDA states side by side, split back to each request after
            states = req.kda if len(group) == 1 else cat_kda_states(*(r.kda for r in group))
            logits = self._forward(self.model, self.pool, [r.seq for r in group], states,
                                   [r.prompt[r.seq.length:r.seq.length + T] for r in group], logits_to_keep=1,
                                   **images)
            if len(group) > 1:
                for r, rows in zip(group, split_kda_rows(states)):
                    r.kda = rows
            # the group's last logits read back once: whether each row is finite, and the greedy token and its
            # logprob for the rows whose prompt ends here (one host sync a group, not two a request)
            last = logits[:, -1]
            argmax = last.argmax(-1, keepdim=True)
            logprob = torch.log_softmax(last, -1).gather(-1, argmax)
            finite_argmax_logprob = torch.stack([torch.isfinite(last).all(-1).double(), argmax[:, 0].double(),
                                                 logprob[:, 0].double()]).tolist()
            finite = [bool(f) for f in finite_argmax_logprob[0]]
            self._fail_rows(group, finite, outputs)  # before their states reach the prefix cache
            budget -= T * len(group)
            self.counters["prefill_tokens"] += T * len(group)
            self.counters["prefill_forwards"] += 1
            done = {id(r) for r, ok in zip(group, finite) if not ok}
            for b, (req, ok) in enumerate(zip(group, finite)):
                first = (int(finite_argmax_logprob[1][b]), finite_argmax_logprob[2][b])
                if ok and self._prefilled(req, last[b], first, outputs):
                    done.add(id(req))
            self.prefilling = [r for r in self.prefilling if id(r) not in done]

    def _prefilled(self, req: Request, logits_V: Tensor, greedy: tuple[int, float], outputs: list[StepOutput]) -> bool:
        """After a prefill chunk of `req` (its last logits `logits_V`; `greedy`: their argmax and its logprob, read
        back with the group's): publish it to the prefix cache, and if it was the prompt's last chunk, sample the
        first token and move the request to the decode batch (or end it). -> whether the request's prefill is over."""
        n, end, ci = len(req.prompt), req.seq.length, self.checkpoint_interval
        if self.prefix is not None:
            if ci is not None and end % ci == 0 and end < n:
                self.prefix.checkpoint(req.prefix, cache_key(req), req.seq, req.kda, 0, self._make_room)
            else:
                self.prefix.publish_blocks(req.prefix, cache_key(req), end, req.seq)
        if end < n:
            return False
        req.images = req.vision = None  # every slot is in the latents and states now: free the pixels and vectors
        if self.draft is not None:  # the draft has no prefix cache: it reads the whole prompt
            for s in range(0, n, self.cfg.prefill_chunk):
                self._forward(self.draft, self.draft_pool, [req.draft_seq], req.draft_kda,
                              [req.prompt[s:s + self.cfg.prefill_chunk]], logits_to_keep=1)
        if self.prefix is not None:  # always a checkpoint at the end of a prompt
            self.prefix.checkpoint(req.prefix, cache_key(req), req.seq, req.kda, 0, self._make_room)
        token, logprob = greedy
        if not req.params.greedy:
            token = sample_tokens(logits_V[None], [req])[0]
            logprob = float(torch.log_softmax(logits_V, -1)[token])
        self._emit(req, [token], [logprob], outputs)
        if req.finished:
            self._end(req, req.finish_reason, outputs, states=req.kda, row=0, emitted=True)
            return True
        req.status = "running"
        self.running.append(req)
        self.target.join(req.kda)
        if self.drafter is not None:
            self.drafter.join(req.draft_kda)
        req.kda = req.draft_kda = None
        return True

    def _decode(self, outputs: list[StepOutput]) -> None:
        if self.fast:
            self._decode_static(outputs)
            return
        logits = self._forward(self.model, self.pool, [r.seq for r in self.running], self.target.kda,
                               [[r.output[-1]] for r in self.running])[:, -1]
        finite = self._finite(logits, self.running, outputs)
        if not all(finite):
            self._leave([b for b, ok in enumerate(finite) if not ok])
            logits = logits[torch.tensor(finite, device=self.device)]
        reqs = self.running
        if not reqs:
            return
        tokens = sample_tokens(logits, reqs)
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens, device=self.device)[:, None])
        for r, t, lp in zip(reqs, tokens, logprobs[:, 0].tolist()):
            self._emit(r, [t], [lp], outputs)
        self.counters["decode_tokens"] += len(reqs)
        self._retire(outputs)

    def _decode_static(self, outputs: list[StepOutput]) -> None:
        """`_decode` through the fast path's static step: sampling happens on the device (`sample_batch`, seeded by
        the request's `sample_seed` and the token's index), one host sync for the whole batch. With `overlap`, step
        n + 1 is launched before step n is read, and stays in flight while the host reads step n, emits, retires
        and then (the next `step()`) admits and prefills: the device decodes meanwhile."""
        before, self._in_flight = self._in_flight, self._launch_static(self._in_flight)
        if before is not None:
            self._collect_static(before, outputs)
        if not self.overlap:
            self._drain(outputs)

    def _launch_static(self, before: tuple[list[Request], Launched] | None) -> tuple[list[Request], Launched] | None:
        """Launch the decode step of every running request with a token left to draw, the step `before` still
        unread: a row that was in it feeds the token it sampled there, on the device; a row that joined since feeds
        its last output token. -> (the step's requests, the launched step), or None when no row has a token left.
        NOTE: a row that stopped in `before` runs once more here; that token is dropped at `_collect_static`, and
        its turn's prefix-cache checkpoint (`_end`) then covers its stop token, as its seq.length and KDA slot do
        (the checkpoint is copied out of the slot after this step, in stream order)."""
        unread = {r: b for b, r in enumerate(before[0])} if before is not None else {}
        # a request's next token is its len(output) + (1 if a step of it is unread)'th: the sampler's counter
        drawn = {r: len(r.output) + (r in unread) for r in self.running}
        batch = [b for b, r in enumerate(self.running) if drawn[r] < r.params.max_tokens]
        if not batch:
            return None
        reqs = [self.running[b] for b in batch]
        launched = self.target.launch_decode(
            batch, [r.seq for r in reqs], [r.output[-1] for r in reqs], [r.params for r in reqs],
            [r.sample_seed for r in reqs], [drawn[r] for r in reqs], None if before is None else before[1],
            [unread.get(r) for r in reqs], fed=self.overlap)
        return reqs, launched

    def _collect_static(self, in_flight: tuple[list[Request], Launched], outputs: list[StepOutput]) -> None:
        """Read a launched decode step: emit each row's token, fail its non-finite rows, retire finished requests.
        A request that ended since the launch (stopped in the step before, cancelled, failed) is skipped: its row's
        token was computed and is dropped.
        NOTE: a slot or pages freed while a step is in flight may be taken at once (a joining request's state
        copy, its prefill): every use is queued on the same CUDA stream after that step, so runs after it has read
        and written them."""
        reqs, launched = in_flight
        tokens, logprobs, finite = self.target.collect(launched)
        rows = [b for b, r in enumerate(reqs) if not r.finished]
        self._fail_rows([reqs[b] for b in rows], [finite[b] for b in rows], outputs)
        for b in rows:
            if finite[b]:
                self._emit(reqs[b], [tokens[b]], [logprobs[b]], outputs)
        failed = {reqs[b] for b in rows if not finite[b]}
        self._leave([b for b, r in enumerate(self.running) if r in failed])
        self.counters["decode_tokens"] += len(rows) - len(failed)
        self._retire(outputs)

    def _drain(self, outputs: list[StepOutput]) -> None:
        """Read the decode step in flight, if any."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            self._collect_static(in_flight, outputs)

    def _speculate_static(self, outputs: list[StepOutput]) -> None:
        """`_speculate` on the fast path, for a batch of greedy rows, with one host sync: the draft's k + 1 steps
        as one static run (captured as a CUDA graph where the draft can be) that hands its tokens to the target's
        verification on the device, one static step of the target over k + 1 tokens a row, then the target's KDA
        rollback, one more (static.py `StaticDecoder.draft`, `verify`, `rollback`); the draft's states go back to
        the copy taken after the right draft step (`ModelRunner.restore`). The same tokens as the general round:
        greedy acceptance keeps the drafts up to the first that differs from the target's argmax, then the target's
        own token."""
        reqs, k = self.running, self.cfg.num_draft_tokens
        pending = [r.output[-1] for r in reqs]
        drafted, snapshots = self.drafter.draft([r.draft_seq for r in reqs], pending, k)
        fed, argmax, logprobs, finite = self.target.verify([r.seq for r in reqs], pending, drafted)
        self._fail_rows(reqs, finite, outputs)
        keep = []
        for b, r in enumerate(reqs):
            if not finite[b]:
                keep.append(k + 1)  # (the row leaves the batch below; its states are not read again)
                continue
            emitted = accept_draft(fed[b][1:], None, None, argmax[b], None)
            keep.append(self._emit(r, emitted, logprobs[b][:len(emitted)], outputs))
            self.counters["accepted_tokens"] += len(emitted) - 1
            self.counters["decode_tokens"] += keep[-1]
        self._end_round(reqs, keep, k)
        if min(keep) < k + 1:
            self.target.rollback_verified(keep)
            self.drafter.restore(snapshots, keep)
        self._leave([b for b, ok in enumerate(finite) if not ok])
        self._retire(outputs)

    def _end_round(self, reqs: list[Request], keep: list[int], k: int) -> None:
        """A speculative round's counters, and both sequences' lengths back to the round's kept tokens (row b:
        keep[b] of its k + 1, the pending token + the accepted drafts, fewer if a stop came)."""
        self.counters["spec_rounds"] += 1
        self.counters["draft_tokens"] += len(reqs) * k
        for r, n in zip(reqs, keep):
            r.seq.length -= k + 1 - n
            r.draft_seq.length -= k + 1 - n

    def _speculate(self, outputs: list[StepOutput]) -> None:
        """One speculative round for the whole batch (module docstring, step 4). On the fast path a batch of greedy
        rows runs static steps (`_speculate_static`) while k + 1 tokens run the KDA recurrence token by token
        (model.py RECURRENT_SEGMENT_TOKENS): a longer verification would put the chunked kernel in the captured
        step, which no test has captured."""
        if self.static_rounds and all(r.params.greedy for r in self.running):
            self._speculate_static(outputs)
            return
        reqs, k = self.running, self.cfg.num_draft_tokens
        committed = self.target.begin_speculation()
        draft_committed = self.drafter.begin_speculation()
        draft_inputs: list[list[dict]] = [[] for _ in self.drafter.kda]  # per layer, per draft forward
        drafted: list[list[int]] = [[] for _ in reqs]
        q_probs: list[list[Tensor]] = [[] for _ in reqs]
        tokens = [[r.output[-1]] for r in reqs]
        # k + 1 draft forwards: the last one only feeds d_k, so the draft's cache covers every verified token.
        for i in range(k + 1):
            logits = self._forward(self.draft, self.draft_pool, [r.draft_seq for r in reqs], self.drafter.kda,
                                   tokens)[:, -1]
            for j, s in enumerate(self.drafter.kda):
                draft_inputs[j].append(s.inputs)
            if i == k:
                break
            greedy = logits.argmax(-1).tolist()
            draft_finite = torch.isfinite(logits).all(-1).tolist()
            for b, r in enumerate(reqs):
                if r.params.greedy:
                    drafted[b].append(greedy[b])
                elif not draft_finite[b]:
                    # a draft that produced NaN proposes token 0 for sure (q one-hot): acceptance then still emits
                    # exactly the target's distribution; multinomial on NaN would raise and stop every request
                    q_probs[b].append(F.one_hot(torch.tensor(0, device=self.device), logits.shape[-1]).float())
                    drafted[b].append(0)
                else:
                    q = filtered_probs(logits[b], r.params)
                    q_probs[b].append(q)
                    drafted[b].append(int(torch.multinomial(q, 1, generator=r.generator)))
            tokens = [[d[-1]] for d in drafted]

        verify = [[r.output[-1]] + d for r, d in zip(reqs, drafted)]
        logits = self._forward(self.model, self.pool, [r.seq for r in reqs], self.target.kda, verify)  # [B, k+1, V]
        finite = self._finite(logits.flatten(1), reqs, outputs)  # a row failing at any position fails alone
        logprobs = torch.log_softmax(logits, -1)
        argmax = logits.argmax(-1).tolist()
        keep = []
        for b, r in enumerate(reqs):
            if not finite[b]:
                keep.append(k + 1)  # (the row leaves the batch below; its states are not read again)
                continue
            if r.params.greedy:
                emitted = accept_draft(drafted[b], logits[b], None, argmax[b], None)
            else:
                p = torch.stack([filtered_probs(logits[b, i], r.params) for i in range(k + 1)])
                emitted = accept_draft(drafted[b], p, torch.stack(q_probs[b]), argmax[b], r.generator)
            positions = torch.arange(len(emitted), device=self.device)
            lps = logprobs[b, positions, torch.tensor(emitted, device=self.device)].tolist()
            keep.append(self._emit(r, emitted, lps, outputs))
            self.counters["accepted_tokens"] += len(emitted) - 1
            self.counters["decode_tokens"] += keep[-1]
        # Roll both models back to the kept tokens.
        self._end_round(reqs, keep, k)
        if min(keep) < k + 1:
            keep_B = torch.tensor(keep, device=self.device)
            self.target.rollback(committed, [s.inputs for s in self.target.kda], keep_B)
            self.drafter.rollback(draft_committed, [{name: torch.cat([p[name] for p in parts], dim=1)
                                                     for name in parts[0]} for parts in draft_inputs], keep_B)
        self.target.end_speculation()
        self.drafter.end_speculation()
        self._leave([b for b, ok in enumerate(finite) if not ok])
        self._retire(outputs)

    # ---- outputs and endings
    def _finite(self, logits_BV: Tensor, reqs: list[Request], outputs: list[StepOutput]) -> list[bool]:
        """Per row, whether its logits are all finite. A row that is not fails its request alone (finish_reason
        "error"): NaN logits cannot be sampled (multinomial raises, which would stop every request) and greedy
        would emit garbage. The caller takes the failed rows out of its batch."""
        finite = torch.isfinite(logits_BV).all(-1).tolist()
        self._fail_rows(reqs, finite, outputs)
        return finite

    def _fail_rows(self, reqs: list[Request], finite: list[bool], outputs: list[StepOutput]) -> None:
        """End the requests whose row was not finite (see `_finite`)."""
        for r, ok in zip(reqs, finite):
            if not ok:
                r.error = (f"the model produced NaN or infinite logits at position {len(r.prompt) + len(r.output)} "
                           f"(after {len(r.output)} generated tokens)")
                self._end(r, "error", outputs)

    def _emit(self, req: Request, tokens: list[int], logprobs: list[float], outputs: list[StepOutput]) -> int:
        """Append tokens to the request up to (and including) the first stop token or the max_tokens limit;
        returns how many were kept."""
        kept = 0
        for t in tokens:
            req.output.append(t)
            req.logprobs.append(logprobs[kept])
            kept += 1
            if t in req.stop:
                req.finish_reason = "stop"
                break
            if len(req.output) >= req.params.max_tokens:
                req.finish_reason = "length"
                break
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        outputs.append(StepOutput(req.id, tokens[:kept], logprobs[:kept], req.finish_reason))
        return kept

    def _retire(self, outputs: list[StepOutput]) -> None:
        """Finish the running requests that stopped in this step and take them out of the batch."""
        done = [b for b, r in enumerate(self.running) if r.finished]
        for b in done:
            r = self.running[b]
            self._end(r, r.finish_reason, outputs, states=self.target.kda, row=b, emitted=True)
        self._leave(done)

    def _leave(self, rows: list[int]) -> None:
        if not rows:
            return
        gone = set(rows)
        stay = [b for b in range(len(self.running)) if b not in gone]
        self.running = [self.running[b] for b in stay]
        self.target.keep_rows(stay)
        if self.drafter is not None:
            self.drafter.keep_rows(stay)

    def _end(self, req: Request, reason: str, outputs: list[StepOutput], states: list | None = None,
             row: int = 0, emitted: bool = False) -> None:
        """Release a request's pages and pins. A turn that ended normally first publishes its whole conversation
        so far, with a KDA checkpoint at its end (the next turn resumes there)."""
        if self.prefix is not None and req.prefix is not None and reason in ("stop", "length"):
            tokens = cache_key(req) + req.output
            self.prefix.checkpoint(req.prefix, tokens, req.seq, states, row, self._make_room)
        if self.prefix is not None and req.prefix is not None:
            self.prefix.release(req.prefix)
        req.seq.free(self.pool)
        if self.draft_pool is not None:
            req.draft_seq.free(self.draft_pool)
        req.kda = req.draft_kda = None
        req.images = req.vision = None  # (a request cancelled mid-prefill still held its pixels and vectors)
        req.finish_reason, req.status, req.finished_at = reason, "finished", time.perf_counter()
        self.counters["finished"] += 1
        if not emitted:
            outputs.append(StepOutput(req.id, [], [], reason))


def cache_key(req: Request) -> list[int]:
    """The prompt as the prefix cache hashes it: `cache_tokens` for a request with images, else the prompt."""
    return req.cache_tokens if req.cache_tokens is not None else req.prompt


def image_cache_tokens(config, prompt: list[int], images: list) -> list[int]:
    """`prompt` with each media slot replaced by a negative id drawn from its image's pixel digest (no token id is
    negative), so prefixes hash equal exactly when their tokens AND their images' pixels are equal. Raises
    ValueError when the images do not fit the prompt's slots or the model takes no images."""
    if config.vision_config is None:
        raise ValueError("this model has no vision tower: it takes no images")
    pad = config.media_placeholder_token_id
    want = [im.num_tokens for im in images]
    if prompt.count(pad) != sum(want):
        raise ValueError(f"the prompt has {prompt.count(pad)} <|media_pad|> slots; its {len(images)} image(s) need "
                         f"{want} (one per vision vector)")
    # the sum alone would let [1-slot run, 6-slot run] pass for images of [6, 1] vectors, each image's vectors then
    # filling parts of two slots: every run of pads must hold whole images
    k, pos = 0, 0
    while pos < len(prompt):
        if prompt[pos] != pad:
            pos += 1
            continue
        run = next((e for e in range(pos, len(prompt)) if prompt[e] != pad), len(prompt)) - pos
        got = 0
        while got < run:
            got, k = got + want[k], k + 1
        if got != run:
            raise ValueError(f"a run of {run} <|media_pad|> slots at position {pos} does not hold whole images "
                             f"(the images need {want} slots, in order)")
        pos += run
    marks = [-1 - int(im.digest[:15], 16) for im in images for _ in range(im.num_tokens)]
    out, k = [], 0
    for t in prompt:
        if t == pad:
            out.append(marks[k])
            k += 1
        else:
            out.append(t)
    return out


def early_exit_draft(model: K3ForCausalLM, n_layers: int) -> K3ForCausalLM:
    """A draft model made of the target's first `n_layers` decoder layers plus its embedding, output mix, norm and
    lm_head (self-speculation by early exit, as in LayerSkip): a smaller openk3 model with the same tokenizer that
    needs no training. It shares the target's parameter tensors (no copy)."""
    c = model.config
    if not 1 <= n_layers < c.num_hidden_layers:
        raise ValueError(f"n_layers={n_layers}: a draft needs between 1 and {c.num_hidden_layers - 1} layers")
    lac = c.linear_attn_config
    full = [i for i in lac.full_attn_layers if i <= n_layers]
    if not full:
        raise ValueError(f"n_layers={n_layers}: the first MLA layer is {min(lac.full_attn_layers)}; the engine's "
                         f"page pool needs at least one MLA layer in the draft")
    config = c.replace(num_hidden_layers=n_layers, linear_attn_config={
        "kda_layers": [i for i in lac.kda_layers if i <= n_layers], "full_attn_layers": full})
    with torch.device("meta"):
        draft = K3ForCausalLM(config)
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers}
    draft.load_state_dict(state, assign=True)
    return draft.eval()


# ------------------------------------------------------------------------------------------ commands

def add_engine_args(parser: argparse.ArgumentParser, chat: bool = False) -> None:
    """The arguments of `openk3 generate` (chat=False) and `openk3 chat` (chat=True)."""
    parser.add_argument("--model", required=True, help="model directory or run directory (its latest checkpoint)")
    if chat:
        parser.add_argument("--system", default=None, help="a system message to start the conversation with")
        parser.add_argument("--effort", choices=EFFORTS, default=None,
                            help="thinking effort (K3's XTML format: writes the thinking-effort system message)")
        parser.add_argument("--no-thinking", action="store_true",
                            help="K3's XTML format: no think channel; the model answers at once")
    else:
        parser.add_argument("--prompt", required=True, help="text to continue (after [BOS])")
        parser.add_argument("--json", action="store_true", help="print JSON: token ids, text, finish reason, timing")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-prefix-cache", action="store_true", help="turn the hybrid prefix cache off")
    parser.add_argument("--draft", default=None,
                        help="a smaller openk3 model (same tokenizer) for speculative decoding")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--cache-tokens", type=int, default=65536, help="size of the page pool, in tokens")
    add_compile_arg(parser)
    add_threads_arg(parser)


def add_compile_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile-decode", action="store_true",
                        help="torch.compile the fast decode step (faster decode, measured in docs/engine.md; the "
                             "first step of each batch size compiles first)")


def compile_settings(args: argparse.Namespace) -> dict:
    """EngineConfig fields for --compile-decode: the compiled step is the fast path's, so it turns that on too (the
    CPU's default is the general path)."""
    return dict(fast_decode=True, compile_decode=True) if args.compile_decode else {}


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    # NOTE: 1 by default, as `openk3 train` (measured there): a small model's ops are too small to split across
    # threads, which then wait on each other. Raise it for bigger models on CPU.
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")


def set_threads(threads: int) -> None:
    if threads < 1:
        raise ValueError(f"--threads={threads}: must be >= 1")
    torch.set_num_threads(threads)


def register_commands(sub: argparse._SubParsersAction) -> None:
    """Register `generate` and `chat` on an argparse sub-parser set (their one-line help is in openk3/cli.py)."""
    p = sub.add_parser("generate")
    add_engine_args(p)
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("chat")
    add_engine_args(p, chat=True)
    p.set_defaults(fn=cmd_chat)


def _engine_from_args(args: argparse.Namespace):
    set_threads(args.threads)
    model, tokenizer, _ = load_for_inference(args.model, args.device)
    draft = None
    if args.draft is not None:
        draft, draft_tokenizer, _ = load_for_inference(args.draft, args.device)
        if draft_tokenizer.fingerprint() != tokenizer.fingerprint():
            raise ValueError(f"--draft {args.draft} has a different tokenizer from --model {args.model}")
    if args.cache_tokens < args.page_size:
        raise ValueError(f"--cache-tokens={args.cache_tokens} is smaller than one page (--page-size={args.page_size})")
    config = EngineConfig(page_size=args.page_size, num_pages=args.cache_tokens // args.page_size + 1,
                          prefix_cache=not args.no_prefix_cache, num_draft_tokens=args.num_draft_tokens,
                          **compile_settings(args))
    return Engine(model, config, draft), tokenizer


def _params(args: argparse.Namespace, stop: tuple[int, ...]) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop_token_ids=stop)


def _stream(engine: Engine, req: Request, tokenizer, write) -> None:
    """Step the engine until `req` is done, writing its text as it grows (whole characters only)."""
    shown = ""
    while not req.finished:
        engine.step()
        text = tokenizer.decode(req.completion_ids if req.finished else req.output, skip_special=True)
        if not text.endswith("\ufffd"):  # an incomplete multi-byte character waits for its next token
            write(text[len(shown):])
            shown = text


def cmd_generate(args: argparse.Namespace) -> None:
    """`openk3 generate --model DIR --prompt TEXT [--json]`: one completion of [BOS] + prompt."""
    engine, tokenizer = _engine_from_args(args)
    prompt = [tokenizer.bos_id] + tokenizer.encode(args.prompt)
    req = engine.submit(prompt, _params(args, (tokenizer.eos_id,)))
    if args.json:
        while not req.finished:
            engine.step()
        if req.error is not None:
            sys.exit(f"openk3 generate: error: {req.error}")
        ids = req.completion_ids
        print(json.dumps({"prompt": args.prompt, "prompt_tokens": len(prompt), "token_ids": ids,
                          "text": tokenizer.decode(ids, skip_special=True), "finish_reason": req.finish_reason,
                          "cached_tokens": req.cached_tokens,
                          "time_to_first_token_s": req.first_token_at - req.submitted_at,
                          "total_s": req.finished_at - req.submitted_at,
                          "engine": {k: v for k, v in engine.stats().items() if isinstance(v, int)}}))
        return
    sys.stdout.write(args.prompt)
    _stream(engine, req, tokenizer, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    sys.stdout.write("\n")
    if req.error is not None:
        sys.exit(f"openk3 generate: error: {req.error}")


def _chat_options(args: argparse.Namespace, fmt: str) -> dict:
    if fmt == "k2":
        if args.effort is not None or args.no_thinking:
            raise ValueError("--effort and --no-thinking need a model speaking K3's XTML chat format; this one "
                             "speaks K2's")
        return {}
    if args.effort is not None and args.no_thinking:
        raise ValueError("--effort guides the thinking channel; it cannot go with --no-thinking")
    return {"thinking": not args.no_thinking}


def cmd_chat(args: argparse.Namespace, read=input) -> None:
    """`openk3 chat --model DIR`: multi-turn chat in the model's chat format (`chat_format_for`: K3's XTML or K2's);
    the conversation is kept as token ids (the assistant's exactly as generated), so each turn's prompt extends the
    last and the prefix cache resumes at the end of that turn. Reasoning is shown before the answer."""
    engine, tokenizer = _engine_from_args(args)
    fmt = chat_format_for(tokenizer)
    options = _chat_options(args, fmt)
    stops = chat_stop_ids(tokenizer)
    end = tokenizer.token_id(END if fmt == "xtml" else "<|im_end|>")

    def encode(messages: list[dict], **kw) -> list[int]:
        return encode_segments(tokenizer, render(fmt, messages, **kw))

    history = encode([{"role": "system", "content": args.system}], add_generation_prompt=False) if args.system else []
    if args.effort is not None:  # the thinking-effort system message comes before the conversation
        history = encode([], effort=args.effort, add_generation_prompt=False) + history
    print("openk3 chat: an empty line, Ctrl-D or Ctrl-C ends the conversation.")
    try:
        while True:
            try:
                line = read("you> ")
            except EOFError:
                break
            if not line.strip():
                break
            prompt = history + encode([{"role": "user", "content": line}], **options)
            req = engine.submit(prompt, _params(args, stops))
            sys.stdout.write("k3> ")
            _stream_chat(engine, req, IdOutputParser(tokenizer, fmt, **options))
            if req.error is not None:  # the conversation goes on without this turn
                print(f"\n[error: {req.error}]")
                continue
            print(f"\n[{req.cached_tokens}/{len(prompt)} prompt tokens from the prefix cache, {len(req.output)} "
                  f"generated, {req.finish_reason}]")
            # the turn closes with the message end, whichever stop token (message end or eos) ended it
            history = prompt + req.completion_ids + [end]
    except KeyboardInterrupt:  # Ctrl-C while typing or while the model writes: leave as a shell program does
        print("\nopenk3 chat: interrupted")
        sys.exit(130)  # 128 + SIGINT


def _stream_chat(engine: Engine, req: Request, parser: IdOutputParser) -> None:
    """Step the engine until `req` is done, writing its reasoning (in brackets), answer and tool calls as parsed."""
    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    seen, state = 0, "start"
    while not req.finished:
        engine.step()
        ids = req.completion_ids if req.finished else req.output
        parsed = parser.feed(ids[seen:])
        seen = len(ids)
        if req.finished:
            parsed += parser.finish()
        if parsed.reasoning_content:
            write(("[thinking] " if state == "start" else "") + parsed.reasoning_content)
            state = "thinking"
        if parsed.content:
            write(("\n[answer] " if state == "thinking" else "") + parsed.content)
            state = "answer"
        for call in parsed.tool_calls:
            write(f"\n[tool call] {call['function']['name']}({call['function']['arguments']})")
            state = "answer"
