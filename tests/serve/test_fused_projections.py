"""The engine with fused input projections (EngineConfig.fuse_projections, openk3/model/fused.py): the same greedy
output as without, on the general and the fast decode path, with speculation (a draft sharing the target's modules or
tensors) and after `load_weights`."""

import random
from contextlib import nullcontext

import pytest
import torch

from openk3.serve.engine import Engine, EngineConfig, SamplingParams, early_exit_draft
from openk3.serve.runner import ModelRunner
from tests.model.test_fused import CountMatmuls
from tests.serve.test_cache import small_model
from tests.serve.test_static import ragged_decode

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=())


def prompts(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in (3, 9, 14)]


def generate(model, fuse, fast, draft=None, load=None, count=False):
    """Greedy outputs and logprobs of an engine over `model` (after `load_weights(load)` when given), the engine,
    and with `count` how many matmuls it ran (else None)."""
    engine = Engine(model, EngineConfig(page_size=4, num_pages=200, max_batch=2, prefill_chunk=5, hash_interval=4,
                                        checkpoint_interval=8, num_draft_tokens=3, fast_decode=fast,
                                        fuse_projections=fuse), draft=draft)
    assert (engine.target.fused is not None) == fuse and (engine.target.fused is None or engine.target.fused.numel)
    if load is not None:
        engine.load_weights(load)
    counter = CountMatmuls() if count else nullcontext()
    with counter:
        reqs = engine.generate(prompts(), GREEDY)
    return [r.output for r in reqs], torch.tensor([r.logprobs for r in reqs]), engine, counter.mm if count else None


@pytest.mark.parametrize("fast", [False, True], ids=["general", "fast"])
@pytest.mark.parametrize("family", ["k3", "kimi-linear"])
def test_fused_engine_matches_unfused(family, fast):
    model = small_model(family)
    want, want_lp, _, plain = generate(model, False, fast, count=True)
    got, got_lp, engine, fewer = generate(model, True, fast, count=True)
    assert got == want and fewer < plain * 0.7  # the engine's forwards ran the stacks
    assert (got_lp - want_lp).abs().max() < 1e-4
    # outside the engine's forwards the copies are never read
    assert not any(s.active for _, s in engine.target.fused.stacks)


@pytest.mark.parametrize("fast", [False, True], ids=["general", "fast"])
def test_speculation_and_load_weights_with_fusion(fast):
    """An early-exit draft (its own modules over the target's tensors) and the target as its own draft (the same
    modules fused twice); then `load_weights` of other weights: both the target's and the draft's copies follow."""
    model, other = small_model("k3"), small_model("k3", seed=1)
    want, *_ = generate(other, False, fast, draft=early_exit_draft(other, 3))
    got, _, engine, _ = generate(model, True, fast, draft=early_exit_draft(model, 3), load=other.state_dict())
    assert got == want and engine.stats()["spec_rounds"] > 0
    # greedy speculation keeps the target's tokens whatever the draft proposes, so the tokens alone would not show a
    # stale draft: both fusions' copies must be current (the draft's parameters share the target's version counters)
    for fused in (engine.target.fused, engine.drafter.fused):
        assert fused.refresh() == 0 and all(torch.equal(s.weight, torch.cat(s.sources())) for _, s in fused.stacks)
    same, *_ = generate(model, True, fast, draft=model)
    assert same == want


def test_fusion_is_off_on_the_cpu_by_default_and_checked():
    assert Engine(small_model("kimi-linear"), EngineConfig(num_pages=8)).target.fused is None
    with pytest.raises(ValueError, match="fuse_projections='yes'"):
        EngineConfig(fuse_projections="yes")


@pytest.mark.slow
def test_compiled_fast_step_with_fusion():
    """The torch.compile'd static step reading the stacks (their `active` flag and weight are attributes it guards
    on) traces whole and equals the eager unfused step, across recompiles for new buckets (aot_eager, as
    tests/serve/test_static.py's compiled-step test, which says why; bf16 for the MoE's grouped matmul)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = small_model("k3", seed=3).cast(torch.bfloat16)
    runners = [ModelRunner(model, num_pages=200, page_size=4, slots=8),
               ModelRunner(model, num_pages=200, page_size=4, slots=8, compile="aot_eager", fuse=True)]
    ragged_decode(model, runners, steps=6, tol=3e-2, exact=False)
    assert runners[1].decoder.counters["static_steps"] == 6
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_the_refreshed_stacks():
    """On CUDA (fusion on by default there): the captured steps read the stacks at their addresses, so weights
    updated in place after capture are seen by the next replay, without capturing again. fp32 dense model (capturable,
    `capture_problem`), greedy tokens against an unfused eager engine."""
    model = small_model("k3", dense=True).cuda()

    def outputs(**cfg):
        # no prefix cache: the second run must not resume from KDA checkpoints of the old weights
        engine = Engine(model, EngineConfig(page_size=4, num_pages=200, max_batch=2, fast_decode=True,
                                            prefix_cache=False, **cfg))
        return [r.output for r in engine.generate(prompts(), GREEDY)], engine

    fused, engine = outputs()
    assert engine.target.fused is not None and engine.decode_path == "fast, CUDA graphs, overlapped"
    assert fused == outputs(fuse_projections=False, cuda_graphs=False)[0]
    captures = engine.target.decoder.counters["graph_captures"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(torch.randn_like(p) * 0.05)
    again = [r.output for r in engine.generate(prompts(), GREEDY)]
    assert engine.target.decoder.counters["graph_captures"] == captures
    assert again == outputs(fuse_projections=False, cuda_graphs=False)[0] != fused
