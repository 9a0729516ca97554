"""The routing of the fused KDA paths on the CPU, with fla's kernels replaced by PyTorch stand-ins (issue #12).

On CUDA with fla, a KDA forward from a cache of at most RECURRENT_MAX_TOKENS tokens runs fla's token-by-token kernel
(`recurrent_gated`, in place in the engine's slot pool at T = 1), a longer one fla's chunked kernel (`chunk_gated`),
and every inference norm fla's one-kernel norm. The GPU tests check fla's kernels (tests/model/test_kda_backends_gpu.py,
tests/ops/test_kda_fused_kernels.py); this checks, wherever the suite runs, what openk3 does around them: which path
runs, the arguments handed over (the stand-ins refuse what fla's bare kernels would misread: non-contiguous
inputs), the slot pool's in-place rows, against the reference chain of the CPU backend. The stand-ins compute what
fla's kernels compute, from openk3's own references, in fp32.
"""

import random
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import openk3.model.model as model_module
import openk3.serve.static as static_module
from openk3.model.model import causal_conv_silu, kda_decay
from openk3.ops.kda import KDABackend, chunk_kda_torch, naive_recurrent_kda
from openk3.ops.kda import fused as kda_fused
from openk3.ops.kda.conv_chunk import conv_chunk_applies
from openk3.serve.runner import ModelRunner
from tests.helpers import rel_err
from tests.serve.test_cache import small_model
from tests.serve.test_static import SYNCING_OPS, OpNames, greedy_step_logits, prefill_and_join, verify_both_ways


def contiguous(**tensors):
    for name, t in tensors.items():
        assert t.is_contiguous(), f"{name} is not contiguous: a bare fla kernel would read the wrong elements"


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, inplace_final_state,
                            output_final_state=False, ssm_state_indices=None, num_accepted_tokens=None,
                            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                            lower_bound=None, out=None):
    contiguous(q=q, k=k, v=v, g=g, beta=beta)
    assert out is not None and out.shape == v.shape
    assert use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel
    g, beta = kda_decay(g, A_log, dt_bias, lower_bound), torch.sigmoid(beta.float())
    if ssm_state_indices is not None and ssm_state_indices.ndim == 2:
        # fla's speculative-decoding mode: row n's state read at [n, accepted[n] - 1], the state after token t
        # written to [n, t] (every row's reads before any write, as each of the kernel's programs reads first)
        contiguous(ssm_state_indices=ssm_state_indices)
        assert inplace_final_state and num_accepted_tokens.dtype == torch.int32
        idx = ssm_state_indices
        h = initial_state[idx.gather(1, num_accepted_tokens.long()[:, None] - 1)[:, 0]]
        for t in range(q.shape[1]):
            o, h = naive_recurrent_kda(*(x[:, t:t + 1] for x in (q, k, v, g, beta)), scale=scale, initial_state=h,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
            out[:, t:t + 1] = o
            initial_state[idx[:, t]] = h
        return out, initial_state
    assert num_accepted_tokens is None
    h0 = initial_state[ssm_state_indices] if ssm_state_indices is not None else initial_state
    o, ht = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    if inplace_final_state:
        assert q.shape[1] == 1 and ssm_state_indices is not None
        initial_state[ssm_state_indices] = ht
        return out.copy_(o), initial_state
    return out.copy_(o), ht if output_final_state else None


class FusedRecurrentKernel:
    """fla's bare kernel as `recurrent_pool_step` launches it (the slot pool's in-place mode, one token a row): checks
    the launch (the grid of V / BV x N x HV programs, contiguous inputs, the pool as both states, every other argument
    as fla's wrapper passes it in that mode) and computes it as the wrapper's stand-in above; each launch recorded in
    `calls`."""

    # fla 0.6's kernel's arguments (`recurrent_pool_step` falls back to the wrapper where they differ)
    arg_names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "o", "h0", "ht", "cu_seqlens", "ssm_state_indices",
                 "num_accepted_tokens", "lower_bound", "scale", "N", "T", "H", "HV", "K", "V", "BK", "BV",
                 "stride_init_state_token", "stride_final_state_token", "stride_indices_seq", "stride_indices_tok",
                 "USE_INITIAL_STATE", "INPLACE_FINAL_STATE", "IS_BETA_HEADWISE", "USE_QK_L2NORM_IN_KERNEL",
                 "IS_VARLEN", "IS_CONTINUOUS_BATCHING", "IS_SPEC_DECODING", "STORE_FINAL_STATE", "HAS_A", "HAS_BIAS",
                 "USE_GATE_IN_KERNEL", "USE_LOWER_BOUND", "APPLY_BETA_SIGMOID", "ALLOW_NEG_EIGVAL", "STATE_V_FIRST",
                 "num_stages"]

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        def launch(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, ssm_state_indices, scale, lower_bound, N, T, H, HV,
                   K, V, BK, BV, INPLACE_FINAL_STATE, USE_QK_L2NORM_IN_KERNEL, USE_GATE_IN_KERNEL, APPLY_BETA_SIGMOID,
                   STATE_V_FIRST, IS_BETA_HEADWISE, stride_init_state_token, stride_final_state_token, **rest):
            assert grid == (-(-V // BV) * N * HV,) and h0 is ht and INPLACE_FINAL_STATE and not STATE_V_FIRST
            assert stride_init_state_token == stride_final_state_token == h0.stride(0) and not IS_BETA_HEADWISE
            assert (N, T, H, HV, K, V) == (*q.shape[:3], v.shape[2], q.shape[3], v.shape[3]) and T == 1
            assert BK >= K and BK & (BK - 1) == 0 and BV & (BV - 1) == 0
            assert rest == {"cu_seqlens": None, "num_accepted_tokens": None, "stride_indices_seq": 1,
                            "stride_indices_tok": 1, "ALLOW_NEG_EIGVAL": False, "num_warps": rest["num_warps"],
                            "num_stages": 2}
            contiguous(ssm_state_indices=ssm_state_indices, o=o)
            self.calls.append("fused_recurrent_kda_fwd_kernel")
            fused_recurrent_kda_fwd(q, k, v, g, beta, A_log, dt_bias, scale, h0, True,
                                    ssm_state_indices=ssm_state_indices,
                                    use_qk_l2norm_in_kernel=USE_QK_L2NORM_IN_KERNEL,
                                    use_gate_in_kernel=USE_GATE_IN_KERNEL,
                                    use_beta_sigmoid_in_kernel=APPLY_BETA_SIGMOID, lower_bound=lower_bound, out=o)
        return launch


def chunk_kda(q, k, v, g, beta, scale, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
              use_gate_in_kernel=False, A_log=None, dt_bias=None, safe_gate=False, lower_bound=None):
    assert use_qk_l2norm_in_kernel and use_gate_in_kernel and safe_gate == (lower_bound is not None)
    o, ht = chunk_kda_torch(q, k, v, kda_decay(g, A_log, dt_bias, lower_bound), beta.float(), scale=scale,
                            initial_state=initial_state, output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=True)
    return o.to(q.dtype), ht


def causal_conv1d(x, weight, activation, initial_state=None):
    assert activation == "silu"
    C, W = weight.shape
    # fla's conv state [B, C, W]: the last W inputs, newest at index W-1, index 0 never read
    tail = None if initial_state is None else initial_state[..., 1:].transpose(1, 2)
    return causal_conv_silu(x, weight[:, None, :], None, tail).to(x.dtype), None


def rms_norm_gated(o, gate, weight, bias, activation, eps):
    assert activation == "sigmoid" and bias is None
    return (F.rms_norm(o.float(), (o.shape[-1],), weight.float(), eps) * torch.sigmoid(gate.float())).to(o.dtype)


def layer_norm_fwd(x, weight, bias, eps, residual=None, out_dtype=None, is_rms_norm=False):
    contiguous(x=x)
    assert x.ndim == 2 and is_rms_norm and bias is None
    h = x if residual is None else residual + x  # fla's kernel: the fp32 sum, normed as it is
    y = F.rms_norm(h.float(), (x.shape[-1],), weight.float(), eps).to(out_dtype or x.dtype)
    return y, None, None, h


@pytest.fixture
def fake_fla(monkeypatch):
    """fla's modules as the stand-ins above, and a backend that says fla's fused path runs; the calls recorded."""
    calls = []

    def recorded(fn):
        def call(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return call
    modules = {"fla": {}, "fla.ops": {}, "fla.ops.kda": {"chunk_kda": chunk_kda},
               "fla.ops.kda.fused_recurrent": {"fused_recurrent_kda_fwd": fused_recurrent_kda_fwd,
                                              "fused_recurrent_kda_fwd_kernel": FusedRecurrentKernel(calls)},
               "fla.modules": {}, "fla.modules.causal_conv1d": {"causal_conv1d": causal_conv1d},
               "fla.modules.norm": {}, "fla.modules.norm.fused_norm_gate": {"rms_norm_gated": rms_norm_gated},
               "fla.modules.norm.layernorm": {"layer_norm_fwd": layer_norm_fwd}}
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        for key, fn in attrs.items():
            setattr(module, key, recorded(fn) if callable(fn) else fn)
        monkeypatch.setitem(sys.modules, name, module)
    backend = KDABackend("fla", "stand-ins (tests)", chunk_kda_torch, naive_recurrent_kda, fused=True)
    for module in (model_module, static_module):
        monkeypatch.setattr(module, "select_kda_backend", lambda device: backend)
    return calls


def reference_backend(monkeypatch):
    backend = KDABackend("torch", "reference (tests)", chunk_kda_torch, naive_recurrent_kda)
    for module in (model_module, static_module):
        monkeypatch.setattr(module, "select_kda_backend", lambda device: backend)


def serve(runner, prompts, joins, steps):
    """Prefill prompts[i] (batch 1) and join it before decode step joins[i]; decode `steps` greedy steps (the fast
    path's static step when the runner has one, else the general forward); the request of row 0 leaves after step
    2. -> the fp32 logits of every step."""
    out, seqs, last = [], [], []
    with torch.inference_mode():
        for step in range(steps):
            for prompt, at in zip(prompts, joins):
                if at != step:
                    continue
                seq, logits = prefill_and_join(runner, prompt, len(prompt) + steps + 1)
                seqs.append(seq)
                last.append(int(logits.argmax()))
            n = len(seqs)
            logits = greedy_step_logits(runner, seqs, last)
            out.append(logits.float().clone())
            last = logits.argmax(-1).tolist()
            if step == 2:
                seqs[0].free(runner.pool)
                runner.keep_rows(list(range(1, n)))
                seqs, last = seqs[1:], last[1:]
    return out


@pytest.mark.parametrize("family", ["k3", "kimi-linear"])
def test_fused_routing_equals_the_reference_chain(family, fake_fla, monkeypatch, fuse=False):
    """Prompts prefilled from a cache token by token (<= RECURRENT_MAX_TOKENS, cut to 8 here) and chunked (longer),
    then ragged decode steps through the fast path's static step, its KDA rows updated in place in the slot pool,
    with requests joining and one leaving: every step's logits equal the reference chain's general path (fp32).
    A decode step's one-token conv runs `conv_silu_one_token`, not fla's conv. Every norm ran fla's one-kernel norm,
    on contiguous rows (GatedMLA's latent norm gets a split view). `fuse`: the fast path's projections from stacked
    weights (openk3/model/fused.py), whose outputs are views of one matmul's."""
    monkeypatch.setattr(model_module, "RECURRENT_MAX_TOKENS", 8)
    model = small_model(family, seed=3)
    rng = random.Random(0)
    V = model.config.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 13, 7)]
    joins, steps = (0, 0, 3), 6
    paths = []
    for name in ("recurrent_gated", "chunk_gated"):
        fn = getattr(kda_fused, name)
        monkeypatch.setattr(kda_fused, name, lambda q, *a, _fn=fn, _n=name, **k:
                            paths.append((_n, q.shape[1])) or _fn(q, *a, **k))
    fused = serve(ModelRunner(model, num_pages=64, page_size=4, slots=4, fuse=fuse), prompts, joins, steps)
    kda_layers = model.config.layer_types.count("kda")
    assert {("recurrent_gated", 5), ("chunk_gated", 13), ("recurrent_gated", 7),
            ("recurrent_gated", 1)} == set(paths)
    assert paths.count(("recurrent_gated", 1)) == kda_layers * steps
    assert fake_fla.count("fused_recurrent_kda_fwd") == kda_layers * 2  # the prefills of 5 and 7 tokens
    assert fake_fla.count("fused_recurrent_kda_fwd_kernel") == kda_layers * steps  # the pool's decode steps
    # the prefills (decode's conv is PyTorch's or conv_step.py's), where ops/kda/conv_chunk.py's kernel does not run
    chunk_kernel = conv_chunk_applies(torch.zeros(1, 1, 3), None)  # (the CPU: under Triton's interpreter)
    assert fake_fla.count("causal_conv1d") == (0 if chunk_kernel else kda_layers * len(prompts))
    assert fake_fla.count("layer_norm_fwd") > 0 and "chunk_kda" in fake_fla
    reference_backend(monkeypatch)
    want = serve(ModelRunner(model, num_pages=64, page_size=4), prompts, joins, steps)
    for step, (a, b) in enumerate(zip(fused, want)):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5, (step, rel_err(a, b))


@pytest.mark.parametrize("family", ["k3", "kimi-linear"])
def test_a_verification_keeping_every_state_rolls_back_by_a_copy(family, fake_fla, monkeypatch):
    """With fla's kernels and spare rows in the slot pool (`ModelRunner(spec_tokens=)`), the static verification of
    k + 1 = 4 tokens a row runs fla's token-by-token kernel once per KDA layer, writing the state after every token
    to its own pool row, and its rollback copies each row's state after its last kept token: the verification's
    logits and the next step's after the rollback equal the general round's (the reference chain keeping the
    per-token inputs, then `rollback_kda`) for rows keeping 1, some and all of the tokens (fp32), with no host sync
    in either run and the scratch slots zero after each."""
    indices = []
    fn = kda_fused.recurrent_gated
    monkeypatch.setattr(kda_fused, "recurrent_gated", lambda *a, _fn=fn, **k:
                        indices.append((a[0].shape[1], None if len(a) < 11 else tuple(a[10].shape))) or _fn(*a, **k))
    both = verify_both_ways(small_model(family, seed=3), keep=[1, 3, 4], spec_tokens=3)
    (gen_logits, gen_after, _), (fast_logits, fast_after, runner) = both["general"], both["fast"]
    assert rel_err(fast_logits, gen_logits) < 1e-5
    assert rel_err(fast_after, gen_after) < 1e-5
    kda_layers = runner.model.config.layer_types.count("kda")
    assert indices.count((4, (4, 4))) == kda_layers  # the verification: [B bucket 4, T 4] pool rows
    decoder = runner.decoder
    assert decoder.slots.spare == 8 * 3 and decoder._verified[2][1] is None  # slots=8: rolled back by the copy

    # no host sync in the verification and its rollback; the padding row (3 rows in a bucket of 4) wrote only
    # its scratch slot, zero again after each run
    (buf,) = [b for (B, P, T), b in decoder.buffers.items() if T > 1]
    pool = decoder.slots
    with torch.inference_mode(), OpNames() as ops:
        _, _, saved = decoder._verify_run(buf)
        scratch = [pool.recurrent_all[::pool.stride].clone(), pool.conv_all[::pool.stride].clone()]
        decoder._rollback_run(buf, saved)
        scratch += [pool.recurrent_all[::pool.stride].clone(), pool.conv_all[::pool.stride].clone()]
    assert saved[1] is None
    assert not sorted({n for n in ops.names if n in SYNCING_OPS})
    assert not any(t.any() for t in scratch)


def test_a_kernel_of_other_arguments_falls_back_to_fla_s_wrapper(fake_fla, monkeypatch):
    """A decode step over the slot pool launches fla's bare kernel where it takes `recurrent_pool_step`'s arguments by
    name, and else (another fla version) runs fla's wrapper, with the same result."""
    g = torch.Generator().manual_seed(0)
    B, H, K = 3, 2, 8
    q, k, v, f = (torch.randn(B, 1, H, K, generator=g) for _ in range(4))
    beta, A_log = torch.randn(B, 1, H, generator=g), torch.randn(H, generator=g)
    dt_bias = torch.randn(H * K, generator=g)
    pool = torch.randn(B + 2, H, K, K, generator=g)
    rows = torch.tensor([4, 0, 2])
    results = []
    for names in (FusedRecurrentKernel.arg_names, ["q", "k", "v"]):
        monkeypatch.setattr(FusedRecurrentKernel, "arg_names", names)
        fake_fla.clear()
        p = pool.clone()
        o, final = kda_fused.recurrent_gated(q, k, v, f, beta, A_log, dt_bias, None, K ** -0.5, p, rows)
        assert final is None
        results.append((o, p))
        launched = "fused_recurrent_kda_fwd_kernel" if len(names) > 3 else "fused_recurrent_kda_fwd"
        assert fake_fla == [launched], fake_fla
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][1], pool)


def test_the_slot_pool_names_too_few_spare_rows(fake_fla):
    """A verification of more rows or tokens than the spare rows hold is refused with the numbers; a runner without
    them (no spec_tokens) verifies through the reference chain and `rollback_kda`, fla or not."""
    from openk3.serve.static import SlotPool
    config = small_model("k3", seed=0).config
    pool = SlotPool(config, 4, "cpu", torch.float32, spare=6)
    assert pool.fits_tokens(2, 4) and not pool.fits_tokens(4, 3)
    with pytest.raises(ValueError, match="4 rows of 3 tokens need 8 spare rows, the pool has 6"):
        pool.view(torch.tensor([1, 2, 3, 4]), tokens=3)
    with pytest.raises(ValueError, match="spare=-1"):
        SlotPool(config, 4, "cpu", torch.float32, spare=-1)
    both = verify_both_ways(small_model("k3", seed=3), keep=[1, 3, 4])  # spec_tokens=0: no spare rows
    runner = both["fast"][2]
    assert runner.slots.spare == 0 and runner.decoder._verified[2][1] is not None  # committed states kept
    assert rel_err(both["fast"][1], both["general"][1]) < 1e-5


def test_a_speculative_engine_keeping_every_state_emits_the_plain_tokens(fake_fla):
    """The engine on the fast path with fla's kernels (stand-ins) and a draft (the target perturbed, so that some
    drafts are accepted and some rejected): its target keeps spare rows and every greedy round verifies into them
    and rolls back by a copy; six prompts of different lengths through max_batch 6 (bucket 8: two padding rows),
    requests joining as others finish, emit the plain engine's greedy tokens, and the scratch slots end zero."""
    import copy

    from openk3.serve.engine import Engine, EngineConfig, SamplingParams
    target = small_model("k3", seed=1, dense=True)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std())
    rng = random.Random(0)
    V = target.config.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 9, 3, 7, 11, 4)]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (12, 6, 16, 9, 14, 8)]
    cfg = dict(page_size=4, num_pages=300, max_batch=6, prefix_cache=False, fast_decode=True)
    plain = [r.output for r in Engine(target, EngineConfig(**cfg)).generate(prompts, params)]
    engine = Engine(target, EngineConfig(num_draft_tokens=3, **cfg), draft=draft)
    rounds = []
    run = engine.target.decoder._rollback_run
    engine.target.decoder._rollback_run = lambda buf, saved: rounds.append(saved[1] is None) or run(buf, saved)
    assert [r.output for r in engine.generate(prompts, params)] == plain
    assert engine.target.slots.spare == 8 * 3 and engine.drafter.slots.spare == 0
    assert 0 < engine.counters["accepted_tokens"] < engine.counters["draft_tokens"]  # accepted and rejected
    assert rounds and all(rounds)  # every rollback was the copy
    pool = engine.target.slots
    assert not pool.recurrent_all[::pool.stride].any() and not pool.conv_all[::pool.stride].any()
