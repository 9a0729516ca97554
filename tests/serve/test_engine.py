"""The inference engine: ragged continuous batching against full forwards, sampling, stops, cancellation, the prefix
cache at turn ends, speculative decoding, the cold / cached / speculative agreement gate, chat encoding, the CLI."""

import argparse
import json
import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from openk3.model import K3ForCausalLM
from openk3.model.checkpoint import save_pretrained
from openk3.serve.cache import PagePool
from openk3.serve.engine import Engine, EngineConfig, SamplingParams, early_exit_draft, register_commands
from openk3.serve.sampler import accept_draft, filtered_probs
from openk3.text.chat import chat_stop_ids, encode_segments, render
from openk3.text.tokenizer import train_bpe
from tests.serve.test_cache import small_config, small_model

GREEDY = dict(temperature=0.0, stop_token_ids=())


def check_against_full_forward(model: K3ForCausalLM, req, greedy: bool = True, tol: float = 1e-4) -> None:
    """The request's logprobs (and, greedy, its tokens) equal those of one full forward over prompt + output."""
    ids = torch.tensor([req.prompt + req.output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)[len(req.prompt) - 1:-1]
    if greedy:
        assert logp.argmax(-1).tolist() == req.output, req.id
    want = logp.gather(1, torch.tensor(req.output)[:, None])[:, 0]
    assert (want - torch.tensor(req.logprobs)).abs().max() < tol, req.id


@pytest.mark.parametrize("fast, overlap", [(False, False), (True, False), (True, True)],
                         ids=["general", "fast", "fast-overlapped"])
@pytest.mark.parametrize("family", ["k3", "kimi-linear"])
def test_ragged_continuous_batching_equals_full_forward(family, fast, overlap):
    """Requests of different lengths join and leave the batch between steps (max_batch forces some to wait),
    prompts are prefilled in chunks that cross checkpoint boundaries: every token and logprob is the full
    forward's, on the general decode path and the fast one (static step, KDA slots, batched sampler), its steps
    overlapped with the host's work or not."""
    model = small_model(family)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=300, max_batch=3, prefill_chunk=4, hash_interval=4,
                                        checkpoint_interval=8, fast_decode=fast, overlap=overlap))
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 13, 6, 22, 9)]
    max_tokens = [3, 9, 5, 7, 4]
    reqs = [engine.submit(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in zip(prompts[:2], max_tokens)]
    sizes = []
    for _ in range(2):
        engine.step()
        sizes.append(len(engine.running))
    reqs += [engine.submit(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in zip(prompts[2:], max_tokens[2:])]
    while engine.has_work():
        assert len(engine.running) + len(engine.prefilling) <= 3
        engine.step()
        sizes.append(len(engine.running))
    assert len(set(sizes)) >= 3  # the decode batch really changed size
    for r, m in zip(reqs, max_tokens):
        assert r.finish_reason == "length" and len(r.output) == m
        check_against_full_forward(model, r)
    assert engine.pool.reserved == 0 and engine.stats()["running"] == 0


def staggered_run(model, prompts, params, overlap: bool, cancel: int | None = None, engine: Engine | None = None):
    """Two requests submitted at once, the rest two steps later (max_batch 3: some wait), on the fast path;
    `cancel`: that request is cancelled once it has 2 tokens. -> (the requests, the engine)."""
    engine = engine or Engine(model, EngineConfig(page_size=4, num_pages=300, max_batch=3, prefill_chunk=4,
                                                  hash_interval=4, checkpoint_interval=8, fast_decode=True,
                                                  overlap=overlap))
    reqs = [engine.submit(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    engine.step()
    engine.step()
    reqs += [engine.submit(p, sp) for p, sp in zip(prompts[2:], params[2:])]
    while engine.has_work():
        if cancel is not None and len(reqs[cancel].output) == 2 and not reqs[cancel].finished:
            if overlap:  # mid-flight: the step launched last holds it, unread
                assert reqs[cancel] in engine._in_flight[0]
            engine.cancel(reqs[cancel].id)
        engine.step()
    return reqs, engine


def test_overlapped_steps_emit_the_same_tokens():
    """The fast path's steps overlapped with the host's work (each launched before the one before it is read, its
    rows' tokens fed on the device) emit the tokens and logprobs of the plain fast path, for a ragged batch of greedy
    and sampled rows that join (staggered) and leave (max_tokens, stop tokens met mid-batch, a cancel mid-flight),
    and on the next turn after prefix-cache hits as cold. A turn that stopped was decoded once more in flight (that
    token dropped): its checkpoint then covers its stop token, and a hit there gives the cold tokens."""
    model = small_model("k3", seed=1)
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 13, 6, 11, 9)]
    sampled = dict(temperature=0.9, top_k=40, seed=7)
    shapes = [(6, GREEDY), (9, sampled), (12, GREEDY), (7, GREEDY), (5, sampled)]
    free = [SamplingParams(max_tokens=m, **dict(kw, stop_token_ids=())) for m, kw in shapes]
    # stop tokens that end requests 1 (sampled) and 3 (greedy) early: their third token (sampling is seeded per
    # request and token index, so every run draws the same)
    first, _ = staggered_run(model, prompts, free, overlap=False)
    stops = {1: first[1].output[2], 3: first[3].output[2]}
    params = [SamplingParams(max_tokens=m, **dict(kw, stop_token_ids=(stops[b],) if b in stops else ()))
              for b, (m, kw) in enumerate(shapes)]
    runs = {overlap: staggered_run(model, prompts, params, overlap, cancel=2) for overlap in (False, True)}
    (plain, plain_engine), (over, over_engine) = runs[False], runs[True]
    assert over_engine.stats()["decode_path"].endswith(", overlapped")
    assert [r.finish_reason for r in over] == ["length", "stop", "cancelled", "stop", "length"]
    done = [0, 1, 3, 4]
    for b in done:
        assert plain[b].output == over[b].output and plain[b].finish_reason == over[b].finish_reason
        assert max(abs(x - y) for x, y in zip(plain[b].logprobs, over[b].logprobs)) < 1e-5
    assert plain[2].output == over[2].output and len(over[2].output) == 2  # (its step in flight dropped)
    for e in (plain_engine, over_engine):
        assert e.pool.reserved == 0 and not e.running and len(e.target.slots.free) == 3
        assert e.counters["finished"] == 5

    # the next turn: each conversation so far + 3 user tokens, resumed from the prefix cache
    turn2 = [over[b].prompt + over[b].output + [3, 4, 5] for b in done]
    params2 = [free[b] for b in done]
    cold = Engine(model, EngineConfig(page_size=4, num_pages=300, fast_decode=True, prefix_cache=False))
    want = cold.generate(turn2, params2)
    for overlap, engine in ((False, plain_engine), (True, over_engine)):
        got, _ = staggered_run(model, turn2, params2, overlap, engine=engine)
        for r, w, first_turn in zip(got, want, [over[b] for b in done]):
            assert r.output == w.output and max(abs(x - y) for x, y in zip(r.logprobs, w.logprobs)) < 1e-4
            # resumed at the end of the first turn, whose last token was never fed; overlapped, a turn whose stop
            # was read had its step after the stop launched already, and its checkpoint may hold the stop token too
            full = len(first_turn.prompt) + len(first_turn.output)
            stopped = overlap and first_turn.finish_reason == "stop"
            assert r.cached_tokens in ((full - 1, full) if stopped else (full - 1,)), overlap


def test_filtered_probs_follow_temperature_top_k_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(50) * 3
    p = filtered_probs(logits, SamplingParams(temperature=0.7))
    assert torch.allclose(p, torch.softmax(logits / 0.7, -1))
    p = filtered_probs(logits, SamplingParams(temperature=0.7, top_k=5))
    top = logits.topk(5).indices
    assert set(p.nonzero()[:, 0].tolist()) == set(top.tolist())
    assert torch.allclose(p[top], torch.softmax(logits[top] / 0.7, -1))
    full = torch.softmax(logits, -1)
    sorted_p, order = full.sort(descending=True)
    n = int((sorted_p.cumsum(0) < 0.8).sum()) + 1  # the smallest most-likely set with mass >= 0.8
    p = filtered_probs(logits, SamplingParams(top_p=0.8))
    assert set(p.nonzero()[:, 0].tolist()) == set(order[:n].tolist())
    assert torch.allclose(p[order[:n]], sorted_p[:n] / sorted_p[:n].sum())
    assert filtered_probs(logits, SamplingParams(top_p=1e-6)).max() == 1.0  # the most likely token always stays
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    for seed in (2 ** 63, -1, 1.5, True):  # the fast path's int64 seed tensor would fail mid-step instead
        with pytest.raises(ValueError, match=f"seed={seed!r}"):
            SamplingParams(seed=seed)


@pytest.mark.parametrize("fast", [False, True], ids=["general", "fast"])
def test_seeded_sampling_does_not_depend_on_the_batch(fast):
    model = small_model()
    prompt = list(range(10, 20))
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, top_p=0.95, seed=7, stop_token_ids=())
    alone = Engine(model, EngineConfig(page_size=4, num_pages=100, fast_decode=fast)).generate([prompt], params)[0]
    engine = Engine(model, EngineConfig(page_size=4, num_pages=100, fast_decode=fast))
    others = [engine.submit([5, 6, 7], SamplingParams(max_tokens=n, temperature=1.0, seed=n)) for n in (3, 20)]
    crowded = engine.submit(prompt, params)
    while engine.has_work():
        engine.step()
    assert crowded.output == alone.output and all(o.finished for o in others)
    other_seed = Engine(model, EngineConfig(page_size=4, num_pages=100, fast_decode=fast)).generate(
        [prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=8, stop_token_ids=()))[0]
    assert other_seed.output != alone.output
    check_against_full_forward(model, crowded, greedy=False)


def test_stop_tokens_and_max_tokens():
    model = small_model()
    engine = Engine(model, EngineConfig(page_size=4, num_pages=100))
    free = engine.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=10, **GREEDY))[0].output
    stop = free[3]
    cut = free.index(stop) + 1
    req = engine.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=10, temperature=0.0,
                                                             stop_token_ids=(stop,)))[0]
    assert req.output == free[:cut] and req.finish_reason == "stop" and req.completion_ids == free[:cut - 1]
    req = engine.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert req.output == free[:2] and req.finish_reason == "length"
    assert engine.submit([1], SamplingParams()).stop == frozenset({model.config.eos_token_id})  # the default


def test_cancel_and_counters():
    model = small_model()
    engine = Engine(model, EngineConfig(page_size=4, num_pages=100, max_batch=2))
    free_at_start = len(engine.pool.free)
    reqs = [engine.submit([1, 2, 3, i], SamplingParams(max_tokens=40, **GREEDY)) for i in range(3)]
    assert engine.stats()["queue_depth"] == 3
    engine.step()
    engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["queue_depth"] == 1
    engine.cancel(reqs[0].id)  # running
    engine.cancel(reqs[2].id)  # still waiting
    outs = engine.step()
    ended = {o.request_id: o.finish_reason for o in outs if o.finish_reason}
    assert ended == {reqs[0].id: "cancelled", reqs[2].id: "cancelled"}
    assert reqs[0].output and not reqs[2].output and engine.stats()["running"] == 1
    while engine.has_work():
        engine.step()
    assert reqs[1].finish_reason == "length"
    check_against_full_forward(model, reqs[1])
    # every page is back: free, or held by the prefix cache
    held = {p for n in engine.prefix.nodes.values() for p in n.pages + (n.checkpoint or [])}
    assert len(engine.pool.free) + len(held) == free_at_start and engine.pool.reserved == 0
    stats = engine.stats()
    assert stats["queries"] == 2 and stats["finished"] == 3 and stats["queue_depth"] == 0


def test_prefix_hits_resume_at_prompt_and_turn_ends():
    """Turn 2 of a conversation resumes exactly where turn 1's generation stopped (its last token is the only one
    not yet in the cache); another continuation of turn 1's prompt resumes at that prompt's end; the outputs equal a
    cold engine's; a different cache salt gets nothing."""
    model = small_model()
    cfg = dict(page_size=4, num_pages=400, hash_interval=8)
    engine, cold = Engine(model, EngineConfig(**cfg)), Engine(model, EngineConfig(prefix_cache=False, **cfg))
    p1 = list(range(30, 49))  # 19 tokens: the prompt ends between hash boundaries
    t1 = engine.generate([p1], SamplingParams(max_tokens=5, **GREEDY), cache_salt="a")[0]
    p2 = p1 + t1.output + [7, 8, 9]
    p3 = p1 + [1, 2]
    t2, t3 = engine.generate([p2, p3], SamplingParams(max_tokens=6, **GREEDY), cache_salt="a")
    assert t1.cached_tokens == 0 and t2.cached_tokens == len(p1) + 5 - 1 and t3.cached_tokens == len(p1)
    for hot, c in zip((t2, t3), cold.generate([p2, p3], SamplingParams(max_tokens=6, **GREEDY))):
        assert hot.output == c.output
        assert max(abs(a - b) for a, b in zip(hot.logprobs, c.logprobs)) < 1e-4
    assert engine.generate([p2], SamplingParams(max_tokens=1, **GREEDY), cache_salt="b")[0].cached_tokens == 0
    stats = engine.stats()
    assert stats["hit_tokens"] == t2.cached_tokens + t3.cached_tokens and stats["queries"] == 4


def test_prefix_is_published_only_as_far_as_it_is_written():
    """During a chunked prefill a lookup of the same prompt never reaches past what has been computed."""
    model = small_model()
    engine = Engine(model, EngineConfig(page_size=4, num_pages=400, prefill_chunk=4, hash_interval=4,
                                        checkpoint_interval=8))
    prompt = list(range(60, 90))
    req = engine.submit(prompt, SamplingParams(max_tokens=1, **GREEDY))
    seen = []
    while not req.finished:
        engine.step()
        done = req.seq.length if not req.finished else len(prompt)
        reach = engine.prefix.lookup(prompt + [0], None).length  # a longer prompt could use everything
        assert reach <= done
        seen.append(reach)
    # 4 tokens a step; checkpoints at 8, 16, 24 appear once written, then the one at the prompt's end (30)
    assert seen == [0, 8, 8, 16, 16, 24, 24, 30]


def test_speculative_decoding_with_the_target_as_draft_accepts_everything():
    model = small_model()
    prompts = [[5, 6, 7, 8, 9], list(range(40, 51))]
    engine = Engine(model, EngineConfig(page_size=4, num_pages=200, num_draft_tokens=3), draft=model)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=9, **GREEDY))
    stats = engine.stats()
    assert stats["accepted_tokens"] == stats["draft_tokens"] > 0
    for r in reqs:
        check_against_full_forward(model, r)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_fast_speculation_accepts_what_the_general_round_accepts(device):
    """A separate draft model (the target with its weights perturbed, so that it agrees only partly): the fast
    path's greedy rounds (static draft steps, static verification; CUDA graphs on CUDA) emit the general round's
    tokens and accept as many drafts. A draft a token ahead of or behind its prompt would still emit the target's
    tokens, but accept far fewer. (On CUDA fla's fp32 is TF32: a near-tie may flip, so 10% of the drafts may differ.)"""
    import copy

    target = small_model("k3", seed=1, dense=True).to(device)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g).to(device) * 0.3 * p.std())
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(9)] for _ in range(3)]
    counts = {}
    for fast in (False, True):
        engine = Engine(target, EngineConfig(page_size=4, num_pages=200, num_draft_tokens=3, fast_decode=fast,
                                             prefix_cache=False), draft=draft)
        outputs = [r.output for r in engine.generate(prompts, SamplingParams(max_tokens=16, **GREEDY))]
        counts[fast] = (outputs, engine.counters["accepted_tokens"], engine.counters["draft_tokens"])
    (general, accepted, drafted), (fast_out, fast_accepted, _) = counts[False], counts[True]
    assert 0 < accepted < drafted  # the draft agrees only partly: the count says something
    if device == "cpu":
        assert fast_out == general and fast_accepted == accepted
    else:
        assert abs(fast_accepted - accepted) <= 0.1 * drafted, (fast_accepted, accepted, drafted)


def test_fast_speculation_with_sampled_rows_and_requests_joining_between_rounds():
    """On the fast path with a draft, a batch with a sampled row runs the general round over the slot pools and an
    all-greedy batch the static one; requests join between rounds (prompts of different lengths, small prefill
    chunks) and leave mid-round (max_tokens). Both kinds of round alternate on the same slots, and every request's
    tokens and logprobs equal the general path's (fp32, CPU: the sampled row draws from its own generator in both)."""
    model = small_model("k3", seed=1)
    draft = early_exit_draft(model, 3)
    prompts = [list(range(3, 10)), list(range(40, 43)), list(range(60, 75)), list(range(90, 95))]
    params = [SamplingParams(max_tokens=14, **GREEDY), SamplingParams(max_tokens=5, temperature=0.9, seed=7,
                                                                           stop_token_ids=()),
              SamplingParams(max_tokens=9, **GREEDY), SamplingParams(max_tokens=11, **GREEDY)]
    results, counts = {}, {}
    for fast in (False, True):
        engine = Engine(model, EngineConfig(page_size=4, num_pages=200, num_draft_tokens=3, prefill_chunk=4,
                                            fast_decode=fast, prefix_cache=False), draft=draft)
        reqs = [engine.submit(p, sp) for p, sp in zip(prompts[:3], params[:3])]
        for _ in range(6):
            engine.step()
        reqs.append(engine.submit(prompts[3], params[3]))  # joins while the others are mid-decode
        while engine.has_work():
            engine.step()
        results[fast] = [(r.output, r.logprobs, r.finish_reason) for r in reqs]
        counts[fast] = engine.counters["accepted_tokens"], engine.counters["draft_tokens"]
        if fast:
            verifications = engine.target.decoder.counters["static_steps"]
            assert 0 < verifications < engine.counters["spec_rounds"]  # both kinds of round ran
            assert engine.pool.reserved == 0 and len(engine.target.slots.free) == len(engine.drafter.slots.free)
    for (out, lps, reason), (fast_out, fast_lps, fast_reason) in zip(results[False], results[True]):
        assert fast_out == out and fast_reason == reason == "length"
        assert max(abs(a - b) for a, b in zip(lps, fast_lps)) < 1e-4
    assert counts[True] == counts[False] and 0 < counts[True][0] < counts[True][1]  # the draft's states agree too


def test_rejection_sampling_keeps_the_target_distribution():
    """The first emitted token of a speculative round is distributed as the target's p, whatever the draft's q."""
    g = torch.Generator().manual_seed(0)
    V = 6
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(1, V, generator=g) * 1.5, -1)
    counts = torch.zeros(V)
    n = 20000
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=g))
        counts[accept_draft([d], p, q, p.argmax(-1).tolist(), g)[0]] += 1
    assert (counts / n - p[0]).abs().max() < 0.015
    # greedy: exact match with the target's argmax, then the target's own token
    best = [3, 1, 4]
    assert accept_draft([3, 1], p, None, best, None) == [3, 1, 4]
    assert accept_draft([3, 2], p, None, best, None) == [3, 1]
    assert accept_draft([0, 1], p, None, best, None) == [3]


def test_speculative_sampling_reports_target_logprobs():
    model = small_model()
    draft = early_exit_draft(model, 3)
    assert draft.config.num_hidden_layers == 3
    assert draft.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()  # shared, not copied
    engine = Engine(model, EngineConfig(page_size=4, num_pages=200, num_draft_tokens=4), draft=draft)
    reqs = engine.generate([[1, 2, 3], list(range(20, 37))],
                           SamplingParams(max_tokens=10, temperature=0.8, top_k=30, seed=3, stop_token_ids=()))
    for r in reqs:
        assert len(r.output) == 10
        check_against_full_forward(model, r, greedy=False)
    with pytest.raises(ValueError, match="vocab_size"):
        Engine(model, draft=K3ForCausalLM(small_config().replace(vocab_size=300)))


def run_conversations(engine: Engine, convs: list[list[list[int]]], max_tokens: list[list[int]]):
    """Turn by turn, all conversations at once: prompt = history + user tokens; history += prompt + output."""
    histories = [[] for _ in convs]
    turns = []
    for t in range(len(convs[0])):
        prompts = [h + conv[t] for h, conv in zip(histories, convs)]
        reqs = engine.generate(prompts, [SamplingParams(max_tokens=m[t], **GREEDY) for m in max_tokens])
        histories = [p + r.output for p, r in zip(prompts, reqs)]
        turns.append(reqs)
    return turns


def gate(data, fast: bool, device: str = "cpu", tol: float = 1e-4, dense: bool = False,
         overlap: bool | None = None) -> list[str]:
    """The hard gate's body (below) on `device`, with the engines' decode path chosen by `fast` and `overlap` (the
    speculative engine's: never overlapped); logprobs within `tol`; `dense`: a model without MoE layers. -> the
    engines' decode paths."""
    page_size = data.draw(st.sampled_from([2, 4, 6]), "page_size")
    hash_interval = data.draw(st.sampled_from([4, 6, 8]), "hash_interval")
    checkpoint_every = data.draw(st.sampled_from([None, 1, 2]), "checkpoint_every")
    n_conv = data.draw(st.integers(1, 3), "conversations")
    n_turns = data.draw(st.integers(1, 3), "turns")
    rng = random.Random(data.draw(st.integers(0, 2 ** 16), "seed"))
    convs = [[[rng.randrange(256) for _ in range(rng.randint(1, 12))] for _ in range(n_turns)] for _ in range(n_conv)]
    max_tokens = [[rng.randint(1, 6) for _ in range(n_turns)] for _ in range(n_conv)]
    k = rng.randint(1, 4)

    model = small_model(seed=1, dense=dense).to(device)
    longest = max(sum(len(u) for u in c) + sum(m) for c, m in zip(convs, max_tokens)) + k
    ckpt_pages = PagePool(model.config, 2, page_size, "meta", torch.float32).checkpoint_pages
    tiny_pool = -(-longest // page_size) + 1 + ckpt_pages + ckpt_pages // 2  # one request and about one checkpoint
    shared = dict(page_size=page_size, hash_interval=hash_interval, prefill_chunk=rng.randint(2, 9),
                  checkpoint_interval=checkpoint_every and checkpoint_every * hash_interval)
    cold = Engine(model, EngineConfig(page_size=4, num_pages=200, prefix_cache=False, fast_decode=fast,
                                      overlap=overlap))
    cached = Engine(model, EngineConfig(num_pages=tiny_pool, fast_decode=fast, overlap=overlap, **shared))
    spec = Engine(model, EngineConfig(num_pages=tiny_pool, num_draft_tokens=k, fast_decode=fast, **shared),
                  draft=early_exit_draft(model, 3))
    if fast:  # prefill chunks as static runs (by default only where captured), but the cold engine's, its reference
        for runner in (cached.target, spec.target, spec.drafter):
            runner.static_prefill = True
        cold.target.static_prefill = False
    results = [run_conversations(e, convs, max_tokens) for e in (cold, cached, spec)]
    for t, turn in enumerate(zip(*results)):
        for i, (c, h, s) in enumerate(zip(*turn)):
            where = f"turn {t}, conversation {i} (cached tokens: prefix hit {h.cached_tokens}, speculative " \
                    f"{s.cached_tokens})"
            assert c.output == h.output == s.output, f"{where}: cold {c.output}, prefix hit {h.output}, " \
                                                     f"speculative {s.output}"
            assert max(abs(a - b) for a, b in zip(c.logprobs, h.logprobs)) < tol, where
            assert max(abs(a - b) for a, b in zip(c.logprobs, s.logprobs)) < tol, where
    for e in (cached, spec):
        assert e.pool.reserved == 0 and not e.running
    if fast and spec.counters["spec_rounds"]:  # greedy rounds on the fast path: static verifications and draft steps
        assert any(T == k + 1 for (_, _, T) in spec.target.decoder.buffers)
        assert spec.drafter.decoder.counters["static_steps"] > 0
        # with fla the verifications keep every token's KDA state in spare rows (a rollback is then a copy)
        from openk3.ops import select_kda_backend
        assert (spec.target.slots.spare > 0) == select_kda_backend(device).fused
    return [e.decode_path for e in (cold, cached, spec)]


@pytest.mark.parametrize("fast, overlap", [(False, None), (True, None), (True, True)],
                         ids=["general", "fast", "fast-overlapped"])
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cold_cached_and_speculative_decoding_agree(data, fast, overlap):
    """The hard gate: on random multi-turn conversations (several at once), decoding cold, after prefix-cache hits
    in a pool so small that it must evict, and speculatively (early-exit draft, so some drafts are accepted and
    some rolled back) gives identical greedy tokens and logprobs within 1e-4; on the general decode path and on
    the fast one (static step; speculation then runs over the KDA slot pool), its steps overlapped with the host's
    work or not (the cold and cached engines; a turn that stopped then checkpoints its stop token too)."""
    gate(data, fast, overlap=overlap)


@pytest.mark.parametrize("overlap", [None, True], ids=["plain", "overlapped"])
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_gate_with_graphs_sharing_a_pool(data, overlap, pooled_graphs):
    """The hard gate on the fast path with its static runs as graphs that share a memory pool, as on CUDA
    (`pooled_graphs`: a graph's outputs are overwritten by a replay of a graph captured before it): no output of
    one is read after another's replay (overlapped: the tokens a step in flight hands the next, with static
    prefills between them; speculative: the draft's snapshots, the verification's kept inputs)."""
    gate(data, fast=True, overlap=overlap)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dense, overlap", [(True, False), (True, None), (False, None), (False, True)],
                         ids=["dense-graphs", "dense-graphs-overlapped", "moe-eager", "moe-eager-overlapped"])
# NOTE: no shrinking phase: each example on the GPU takes seconds (three engines, their graph captures), and
# hypothesis shrank a failing one for minutes on the H200 before it reported (the nineteenth session; the eighteenth's
# runs of the case returned nothing within their limits); the first failing example is reported as drawn.
# NOTE: the dense overlapped case passed on the H200 in the seventeenth session and FAILS in the nineteenth's (pages
# of 6 only: `test_the_gate_example_that_failed_on_the_h200`, docs/engine_h200_log.md). Edit this test's docstring
# or body and its derandomised examples change (hypothesis seeds from the function's source): keep notes here.
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_the_gate_on_cuda_on_the_fast_path(data, dense, overlap):
    """The hard gate on CUDA with the engines' default there, the fast path (prefill chunks as static runs): with
    CUDA graphs for a dense-FFN model, eagerly for the MoE one (fp32 routed experts cannot be captured,
    `capture_problem`); each with and without its steps overlapped with the host's work (pinned input copies, the
    result read one step late, each step's tokens fed to the next on the device: the default with CUDA graphs, so
    the dense case turns it off, the MoE case on). The speculative engine's verifications keep every token's KDA
    state in spare slot-pool rows (fla's kernel) and roll back by a copy. NOTE: the overlapped dense case failed on
    the H200 once (other greedy tokens with 3 conversations, and a device-side assert in some example): a static
    prefill's graph overwrote the output of the step in flight in the shared pool, since fixed (on the CPU
    `test_the_gate_with_graphs_sharing_a_pool` checks it; all four cases passed on the H200 after the fix).
    NOTE: with fla, Triton computes fp32 dot products in TF32 on Hopper, so its chunked prefill and its decode step
    differ by ~1e-3 in fp32 (measured on the H200, bench/engine_bench.py's device check): the logprobs are held to
    1e-2 there."""
    from openk3.ops import select_kda_backend
    paths = gate(data, fast=True, device="cuda", tol=1e-2 if select_kda_backend("cuda").name == "fla" else 1e-4,
                 dense=dense, overlap=overlap)
    assert all(p.startswith("fast, CUDA graphs" if dense else "fast, eager") for p in paths)
    assert all(p.endswith(", overlapped") == (overlap is not False if dense else bool(overlap)) for p in paths[:2])


class FixedDraws:
    """Stands in for hypothesis' `data` in `gate`: its draws, in order."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy, label=None):
        return self.values.pop(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gate_example_that_failed_on_the_h200():
    """The dense-graphs-overlapped case's first failing example on the H200 (nineteenth session): pages of 6, a hash
    and a KDA checkpoint every 6 tokens, 2 conversations of 3 turns, seed 45947. The speculative engine's
    conversation 1 (counting from 0) gave [227, 12, 221, 3] in turn 1 where the others gave [227, 12, 221, 205];
    the same with the steps synchronised, with CUDA graphs off, with fla's kernels off, without spare rows and
    without fused projections, but not with the MLA layers' pages gathered (OPENK3_MLA_KERNEL=0) instead of the
    paged kernel (docs/engine_h200_log.md). On the CPU, and with the kernel in Triton's interpreter, it passes."""
    from openk3.ops import select_kda_backend
    gate(FixedDraws(6, 6, 1, 2, 3, 45947), fast=True, device="cuda", dense=True,
         tol=1e-2 if select_kda_backend("cuda").name == "fla" else 1e-4)


def test_the_gate_sees_hits_and_evictions():
    """The gate's setting really exercises the cache: hits on later turns, and evictions forced by the tiny pool."""
    model = small_model(seed=1)
    rng = random.Random(5)
    convs = [[[rng.randrange(256) for _ in range(9)] for _ in range(3)] for _ in range(3)]
    ckpt_pages = PagePool(model.config, 2, 4, "meta", torch.float32).checkpoint_pages
    engine = Engine(model, EngineConfig(page_size=4, hash_interval=4, num_pages=20 + ckpt_pages * 2))
    turns = run_conversations(engine, convs, [[4, 4, 4]] * 3)
    stats = engine.stats()
    assert stats["evictions"] > 0 and stats["hit_tokens"] > 0
    assert any(r.cached_tokens > 0 for r in turns[2])


def test_submit_rejects_what_cannot_run():
    engine = Engine(small_model(), EngineConfig(page_size=4, num_pages=10))
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="token id 256"):
        engine.submit([1, 256], SamplingParams())
    with pytest.raises(ValueError, match="more than the pool holds"):
        engine.submit([1] * 30, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="checkpoint_interval=6"):
        EngineConfig(hash_interval=4, checkpoint_interval=6)


# ------------------------------------------------------------------------------------------ chat and CLI

@pytest.fixture(scope="module")
def tokenizer():
    texts = ["the quick brown fox jumps over the lazy dog", "hello world, hello K3", "def f(x): return x + 1"] * 20
    return train_bpe(texts, vocab_size=300)


def test_chat_encoding(tokenizer):
    """A trained BPE has both name sets; `openk3 chat` speaks K3's XTML with it and stops at <|end_of_msg|>."""
    ids = encode_segments(tokenizer, render(tokenizer, [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Hi <|end_of_msg|>"}]))
    text = tokenizer.decode(ids)
    assert text == ('<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
                    '<|open|>message role="user"<|sep|>Hi <|end_of_msg|><|close|>message<|sep|><|end_of_msg|>'
                    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    # the special-token string typed by the user stays text: only two real <|end_of_msg|> ids
    assert ids.count(tokenizer.token_id("<|end_of_msg|>")) == 2
    assert set(chat_stop_ids(tokenizer)) == {tokenizer.token_id("<|end_of_msg|>"), tokenizer.eos_id}
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        render(tokenizer, [{"role": "robot", "content": "x"}])


def test_cli_generate_and_chat(tokenizer, tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    config = small_config().replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                    eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    model = K3ForCausalLM(config)
    save_pretrained(model, tmp_path)
    tokenizer.save(tmp_path)
    parser = argparse.ArgumentParser()
    register_commands(parser.add_subparsers(dest="command"))

    args = parser.parse_args(["generate", "--model", str(tmp_path), "--prompt", "hello", "--max-tokens", "6",
                              "--temperature", "0", "--json", "--device", "cpu"])
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        args.fn(args)
        assert torch.get_num_threads() == 1  # the --threads default, as `openk3 train`'s, not torch's core count
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="--threads=0"):
        args.fn(parser.parse_args(["generate", "--model", str(tmp_path), "--prompt", "x", "--threads", "0"]))
    out = json.loads(capsys.readouterr().out)
    from openk3.model.checkpoint import load_for_inference
    loaded, _, _ = load_for_inference(tmp_path)
    want = Engine(loaded, EngineConfig(prefix_cache=False)).generate(
        [[tokenizer.bos_id] + tokenizer.encode("hello")],
        SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(tokenizer.eos_id,)))[0]
    assert out["token_ids"] == want.completion_ids and out["text"] == tokenizer.decode(want.completion_ids,
                                                                                        skip_special=True)
    assert out["prompt_tokens"] == 1 + len(tokenizer.encode("hello"))

    args = parser.parse_args(["chat", "--model", str(tmp_path), "--max-tokens", "4", "--temperature", "0",
                              "--device", "cpu"])
    lines = ["hello world", "the lazy dog"]

    def read(prompt: str) -> str:
        if not lines:
            raise EOFError
        return lines.pop(0)

    args.fn(args, read=read)
    shown = capsys.readouterr().out
    cached = [int(line.split("[")[1].split("/")[0]) for line in shown.splitlines() if "prefix cache" in line]
    assert cached[0] == 0 and cached[1] > 0

    # a model whose logits are NaN: a one-line error naming the cause, not a RuntimeError traceback
    forward = Engine._forward
    monkeypatch.setattr(Engine, "_forward", lambda self, *a, **k: forward(self, *a, **k) * float("nan"))
    args = parser.parse_args(["generate", "--model", str(tmp_path), "--prompt", "hello", "--device", "cpu"])
    with pytest.raises(SystemExit, match="openk3 generate: error: the model produced NaN"):
        args.fn(args)


def test_prefix_cache_granularity_as_documented():
    """docs/engine.md, "Granularity": the same short prompt twice reuses nothing (its end checkpoint is at its
    last token, which is always recomputed); a prompt extending it resumes at its end."""
    model = small_model()
    engine = Engine(model, EngineConfig(page_size=4, num_pages=256, hash_interval=8, checkpoint_interval=16))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    prompt = list(range(1, 11))  # 10 tokens: below the checkpoint interval
    assert [engine.generate([prompt], params)[0].cached_tokens for _ in range(2)] == [0, 0]
    assert engine.generate([prompt + [11]], params)[0].cached_tokens == 10
    long = list(range(20, 40))  # 20 tokens: the checkpoint at 16 is reused by the same prompt sent again
    assert [engine.generate([long], params)[0].cached_tokens for _ in range(2)] == [0, 16]


def test_chat_ctrl_c_exits_130_without_a_traceback(tokenizer, tmp_path, capsys):
    config = small_config().replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                    eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    save_pretrained(K3ForCausalLM(config), tmp_path)
    tokenizer.save(tmp_path)
    parser = argparse.ArgumentParser()
    register_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chat", "--model", str(tmp_path), "--max-tokens", "2", "--device", "cpu"])
    lines = ["hello world"]

    def read(prompt: str) -> str:  # one turn, then Ctrl-C at the prompt
        if not lines:
            raise KeyboardInterrupt
        return lines.pop(0)

    with pytest.raises(SystemExit) as e:
        args.fn(args, read=read)
    assert e.value.code == 130
    shown = capsys.readouterr().out
    assert "prefix cache" in shown and shown.rstrip().endswith("openk3 chat: interrupted")


def test_extreme_sampling_parameters_stay_finite():
    """A tiny temperature is the greedy limit and a tiny top_p keeps the most likely token: no NaN, no empty set."""
    from openk3.serve.sampler import SamplingParams, filtered_probs

    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 5
    for params in (SamplingParams(temperature=1e-300), SamplingParams(top_p=1e-300),
                   SamplingParams(temperature=1e-300, top_p=1e-300, top_k=3)):
        p = filtered_probs(logits, params)
        assert torch.isfinite(p).all() and p.sum().item() == pytest.approx(1.0)
        assert p.argmax().item() == logits.argmax().item() and p.max().item() == pytest.approx(1.0)


def poison(engine: Engine, victim, after: int) -> None:
    """Make the target model's logits NaN for `victim`'s row once it has `after` output tokens (0: its prefill)."""
    forward = engine._forward

    def poisoned(model, pool, seqs, kda, tokens, logits_to_keep=0):
        logits = forward(model, pool, seqs, kda, tokens, logits_to_keep)
        for b, s in enumerate(seqs):
            if s is victim.seq and len(victim.output) >= after:
                logits[b] = float("nan")
        return logits

    engine._forward = poisoned


@pytest.mark.parametrize("lengths", [(4, 3, 5), (4, 4, 4)], ids=["ragged", "one-prefill-group"])
@pytest.mark.parametrize("after", [0, 3])
def test_nan_logits_fail_only_their_request(after, lengths):
    """NaN logits in one row (at prefill or mid-decode) end that request with finish_reason "error" and a reason;
    the batch around it decodes on exactly as without it, and the engine takes new requests. Equal lengths: the
    three prompts prefill as one forward, the poisoned row inside it."""
    model = small_model("k3")
    engine = Engine(model, EngineConfig(page_size=4, num_pages=300, max_batch=4, prefill_chunk=16))
    prompts = [list(range(5 + 10 * i, 5 + 10 * i + n)) for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1, stop_token_ids=())  # sampled: NaN would raise
    clean = [r.output for r in Engine(model, EngineConfig(page_size=4, num_pages=300)).generate(prompts, params)]
    reqs = [engine.submit(p, params) for p in prompts]
    poison(engine, reqs[1], after)
    while engine.has_work():
        engine.step()
    assert engine.counters["prefill_forwards"] == (1 if len(set(lengths)) == 1 else 3)
    assert reqs[1].finish_reason == "error" and "NaN" in reqs[1].error and len(reqs[1].output) == after
    assert [reqs[0].output, reqs[2].output] == [clean[0], clean[2]]
    assert engine.pool.reserved == 0 and not engine.running
    assert engine.generate([prompts[0]], params)[0].output == clean[0]


@pytest.mark.parametrize("poisoned", ["target", "draft"])
def test_nan_logits_in_a_sampled_speculative_round(poisoned):
    """The general speculative round with sampled rows: NaN target logits (at any of the k + 1 verified positions)
    end that request alone with finish_reason "error", its neighbours decoding as without it; NaN draft logits
    stop nothing (the row proposes token 0 for sure, which acceptance handles exactly) and the request runs to its
    length. Before, torch.multinomial raised on either and stopped every request."""
    model = small_model("k3")
    prompts = [list(range(5 + 10 * i, 9 + 10 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1, stop_token_ids=())

    def engine():
        return Engine(model, EngineConfig(page_size=4, num_pages=300, num_draft_tokens=3, fast_decode=False),
                      draft=early_exit_draft(model, 3))
    clean = [r.output for r in engine().generate(prompts, params)]
    eng = engine()
    reqs = [eng.submit(p, params) for p in prompts]
    forward = eng._forward

    def poisoned_forward(model, pool, seqs, kda, tokens, logits_to_keep=0):
        logits = forward(model, pool, seqs, kda, tokens, logits_to_keep)
        seq = reqs[1].seq if poisoned == "target" else reqs[1].draft_seq
        for b, s in enumerate(seqs):
            if s is seq and len(reqs[1].output) >= 2 and logits.shape[1] > 1 - (poisoned == "draft"):
                logits[b] = float("nan")
        return logits
    eng._forward = poisoned_forward
    while eng.has_work():
        eng.step()
    if poisoned == "target":
        assert reqs[1].finish_reason == "error" and "NaN" in reqs[1].error
        assert [reqs[0].output, reqs[2].output] == [clean[0], clean[2]]
    else:
        assert reqs[1].finish_reason == "length" and len(reqs[1].output) == 8
    assert eng.pool.reserved == 0 and not eng.running


@pytest.mark.parametrize("fast", [False, True], ids=["general", "fast"])
def test_equal_length_chunks_prefill_as_one_forward(fast):
    """Prompts whose prefill chunks have the same length run as one [G, T] forward (a group), also when their cached
    lengths differ (a prefix hit beside a cold prompt) and with T above the absorbed-MLA limit (the expanded form
    with a cache): every token and logprob is still the full forward's, and there are fewer forwards than chunks."""
    model = small_model("k3")
    engine = Engine(model, EngineConfig(page_size=4, num_pages=400, max_batch=8, prefill_chunk=64, hash_interval=4,
                                        checkpoint_interval=None, fast_decode=fast))
    rng = random.Random(3)
    first = engine.generate([[rng.randrange(256) for _ in range(24)]], SamplingParams(max_tokens=2, **GREEDY))[0]
    forwards = engine.counters["prefill_forwards"]
    hit = first.prompt + [rng.randrange(256) for _ in range(20)]  # resumes at its cached 24 tokens: a 20-token chunk
    cold = [[rng.randrange(256) for _ in range(20)] for _ in range(2)]
    reqs = engine.generate([hit] + cold, SamplingParams(max_tokens=4, **GREEDY))
    assert reqs[0].cached_tokens == 24 and engine.counters["prefill_forwards"] - forwards == 1
    for r in reqs:
        check_against_full_forward(model, r)
    # KDA checkpoints written from a group's rows: four 20-token prompts prefill together, cut at the checkpoint
    # boundaries 8 and 16 (three forwards); each, extended, resumes at its own checkpoint at 20
    ckpt = Engine(model, EngineConfig(page_size=4, num_pages=400, max_batch=8, prefill_chunk=64, hash_interval=4,
                                      checkpoint_interval=8, fast_decode=fast))
    firsts = ckpt.generate([[rng.randrange(256) for _ in range(20)] for _ in range(4)],
                           SamplingParams(max_tokens=1, **GREEDY))
    assert ckpt.counters["prefill_forwards"] == 3
    reqs = ckpt.generate([r.prompt + [rng.randrange(256) for _ in range(5)] for r in firsts],
                         SamplingParams(max_tokens=3, **GREEDY))
    assert [r.cached_tokens for r in reqs] == [20] * 4
    for r in reqs:
        check_against_full_forward(model, r)
    # eight 8-token prompts fill the 64-token budget: one forward; eight 10-token ones take four (6 x 10, the 7th's
    # first 4 tokens with what is left of the budget, then the 7th's last 6 and the 8th's 10 apart: unequal chunks)
    for n, want in ((8, 1), (10, 4)):
        forwards = engine.counters["prefill_forwards"]
        reqs = engine.generate([[rng.randrange(256) for _ in range(n)] for _ in range(8)],
                               SamplingParams(max_tokens=2, **GREEDY))
        assert engine.counters["prefill_forwards"] - forwards == want
    for r in reqs:
        check_against_full_forward(model, r)


def test_compile_decode_flag_compiles_the_fast_step():
    """`--compile-decode` (generate, chat, serve) builds an engine on the fast path with its step compiled, on any
    device (the CPU's default path is the general one); without it nothing is compiled."""
    from openk3.serve.engine import add_engine_args, compile_settings
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flags, compiled in (([], False), (["--compile-decode"], True)):
        ns = parser.parse_args(["--model", "m", "--prompt", "p", *flags])
        engine = Engine(small_model("k3"), EngineConfig(page_size=4, num_pages=50, **compile_settings(ns)))
        assert engine.fast == compiled
        if compiled:
            assert engine.target.decoder.run is not engine.target.decoder._run
    with pytest.raises(ValueError, match="draft model"):
        Engine(small_model("k3"), EngineConfig(page_size=4, num_pages=50, **compile_settings(ns)), draft=small_model("k3"))
