"""The K3 network: wiring, MLA forms, caches, packed documents, both config families."""

import pytest
import torch

from openk3.config import tiny
from openk3.model import GatedMLA, K3Cache, K3ForCausalLM, segment_positions
from openk3.model.model import ABSORB_MAX_TOKENS, lower_right_causal_mask
from openk3.model.state import MLAState
from tests.helpers import rel_err


def kimi_linear_tiny():
    """A tiny config of the Kimi-Linear family: no K3 field set."""
    return tiny().replace(
        hidden_act="silu", attn_res_block_size=None, routed_expert_hidden_size=None, latent_moe_use_norm=False,
        q_lora_rank=None, mla_use_output_gate=False, routed_scaling_factor=2.446, quantization_config=None,
        linear_attn_config={"use_full_rank_gate": False, "gate_lower_bound": None})


def randomise_attnres(model: K3ForCausalLM, seed: int = 0) -> None:
    """Zero-initialised pseudo-queries give a uniform average; draw them so the wiring test sees real softmaxes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "_res_norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))


def family_model(family: str, seed: int):
    """A random tiny model of the K3 or the Kimi-Linear family, with non-uniform AttnRes; seeds torch for the test."""
    c = tiny() if family == "k3" else kimi_linear_tiny()
    torch.manual_seed(seed)
    model = K3ForCausalLM(c)
    randomise_attnres(model)
    return c, model


def test_attnres_wiring_by_hand():
    """3 layers, block size 2, against the spec's pseudo-code written out with explicit sources."""
    c = tiny().replace(num_hidden_layers=3, attn_res_block_size=2,
                       linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2]})
    torch.manual_seed(0)
    model = K3ForCausalLM(c)
    randomise_attnres(model)
    ids = torch.randint(0, c.vocab_size, (2, 9))
    eps = c.rms_norm_eps

    def mix(sources, norm_w, proj_w):
        V = torch.stack([s.double() for s in sources])  # [S, B, T, D]
        key = V / torch.sqrt((V ** 2).mean(-1, keepdim=True) + eps)
        logit = (key * norm_w.double() * proj_w.double().view(-1)).sum(-1)
        w = torch.softmax(logit, dim=0)
        return (w.unsqueeze(-1) * V).sum(0).float()

    L = model.model.layers

    def attn(i, h):
        return L[i].self_attn(L[i].input_layernorm(h)).float()

    def ffn(i, h):
        return L[i].ffn(L[i].post_attention_layernorm(h)).float()

    def res(i, kind):
        n = getattr(L[i], f"{kind}_res_norm").weight
        p = getattr(L[i], f"{kind}_res_proj").weight
        return n, p

    with torch.no_grad():
        e = model.model.embed_tokens(ids).float()
        # layer 0: bank empty -> h = e; block start: bank = [e]
        a0 = attn(0, e)
        m0 = ffn(0, mix([e, a0], *res(0, "mlp")))
        p1 = a0 + m0
        # layer 1: same block
        a1 = attn(1, mix([e, p1], *res(1, "self_attention")))
        p1 = p1 + a1
        m1 = ffn(1, mix([e, p1], *res(1, "mlp")))
        p1 = p1 + m1
        # layer 2: h mixes [e, p1], then p1 is banked and a new block starts
        a2 = attn(2, mix([e, p1], *res(2, "self_attention")))
        m2 = ffn(2, mix([e, p1, a2], *res(2, "mlp")))
        p2 = a2 + m2
        h = mix([e, p1, p2], model.output_attn_res_norm.weight, model.output_attn_res_proj.weight)
        want = model.lm_head(model.model.norm(h))
        got = model(ids).logits
    assert rel_err(got, want) < 1e-5


def test_plain_residual_when_no_block_size():
    c = kimi_linear_tiny().replace(num_hidden_layers=2, linear_attn_config={"kda_layers": [1], "full_attn_layers": [2]})
    torch.manual_seed(1)
    model = K3ForCausalLM(c)
    ids = torch.randint(0, c.vocab_size, (1, 7))
    L = model.model.layers
    with torch.no_grad():
        h = model.model.embed_tokens(ids)
        for layer in L:
            h = h + layer.self_attn(layer.input_layernorm(h))
            h = h + layer.ffn(layer.post_attention_layernorm(h))
        want = model.lm_head(model.model.norm(h))
        assert rel_err(model(ids).logits, want) < 1e-5
    assert not hasattr(model, "output_attn_res_norm")


@pytest.mark.parametrize("q_lora, gate", [(64, True), (None, False)])
def test_absorbed_mla_equals_expanded(q_lora, gate):
    c = tiny().replace(q_lora_rank=q_lora, mla_use_output_gate=gate)
    torch.manual_seed(2)
    mla = GatedMLA(c)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 37, c.hidden_size)
    with torch.no_grad():
        assert rel_err(mla(x, absorb=True), mla(x, absorb=False)) < 1e-5
        # with a packed-document mask too
        pos = segment_positions(torch.tensor([0, 10, 37, 50, 74]), 74).view(2, 37)
        seg = (pos == 0).long().view(-1).cumsum(0).view(2, 37)
        mask = ((seg[:, :, None] == seg[:, None, :]) & torch.ones(37, 37, dtype=torch.bool).tril())[:, None]
        assert rel_err(mla(x, mask=mask, absorb=True), mla(x, mask=mask, absorb=False)) < 1e-5


@pytest.mark.parametrize("family", ["k3", "kimi-linear"])
def test_cached_decode_equals_full_forward(family):
    c, model = family_model(family, seed=3)
    ids = torch.randint(0, c.vocab_size, (2, 21))
    with torch.no_grad():
        full = model(ids).logits
        cache = K3Cache.empty(c, batch=2, max_len=32)
        parts = [model(ids[:, :13], cache=cache).logits]  # prefill
        for t in range(13, 21):  # one token at a time (recurrent KDA, absorbed MLA)
            parts.append(model(ids[:, t:t + 1], cache=cache).logits)
    assert cache.length == 21
    assert rel_err(torch.cat(parts, dim=1), full) < 1e-4


@pytest.mark.parametrize("family", ["k3", "kimi-linear"])
def test_packed_documents_equal_separate_forwards(family):
    c, model = family_model(family, seed=4)
    ids = torch.randint(0, c.vocab_size, (2, 24))
    cu = torch.tensor([0, 5, 24, 31, 48])  # row 0: docs [0,5) [5,24); row 1: [0,7) [7,24)
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu).logits.view(48, -1)
        flat = ids.view(-1)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(flat[s:e][None]).logits[0]
            assert rel_err(packed[s:e], alone) < 1e-4


def test_backward_reaches_every_parameter_but_not_the_router_bias():
    c, model = family_model("k3", 5)
    ids = torch.randint(0, c.vocab_size, (2, 16))
    out = model(ids, labels=torch.roll(ids, -1, 1))
    out.loss.backward()
    # the router's selection bias is a buffer: selection only, no gradient
    assert all(not b.requires_grad for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    # with 2-of-8 routing on 32 tokens some experts may stay idle; everything else must get a gradient, except
    # layer 0's self_attention_res_*: the bank is empty there, so the spec never mixes (the release still stores them)
    unused = ("model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight")
    missing = [n for n, p in model.named_parameters() if p.grad is None and "experts.w" not in n and n not in unused]
    assert not missing, missing
    assert torch.isfinite(out.loss)


def test_chunked_loss_equals_full_loss_and_gradients():
    c, model = family_model("k3", 7)
    ids = torch.randint(0, c.vocab_size, (2, 24))
    labels = torch.roll(ids, -1, 1)
    labels[0, :5] = -100  # ignored positions count in neither the sum nor the mean
    grads = []
    for chunk in (0, 7):  # 7 does not divide 48: the last chunk is short
        model.zero_grad()
        out = model(ids, labels=labels, loss_chunk=chunk)
        out.loss.backward()
        assert (out.logits is None) == (chunk > 0)
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (full, g_full), (chunked, g_chunked) = grads
    assert rel_err(chunked, full) < 1e-6
    assert g_full.keys() == g_chunked.keys()
    for n in g_full:
        assert rel_err(g_chunked[n], g_full[n]) < 1e-5, n


def test_router_bias_changes_selection_not_weights():
    c = tiny()
    torch.manual_seed(6)
    model = K3ForCausalLM(c)
    moe = model.moe_layers()[0]
    x = torch.randn(10, c.hidden_size)
    idx0, w0, s0 = moe.gate(x)
    bias = torch.zeros(c.num_experts)
    bias[3] = 10.0  # expert 3 now always selected
    moe.gate.e_score_correction_bias.copy_(bias)
    idx1, w1, s1 = moe.gate(x)
    assert (idx1 == 3).any(-1).all()
    assert torch.equal(s0, s1)
    # weights are the raw scores of the selected experts, renormalised: the bias never enters them
    want = s1.gather(-1, idx1)
    assert torch.allclose(w1, want / want.sum(-1, keepdim=True) * c.routed_scaling_factor)


def test_bad_inputs_name_the_value():
    model = K3ForCausalLM(tiny())
    with pytest.raises(ValueError, match="token id 5000"):
        model(torch.tensor([[1, 5000]]))
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        model(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.tensor([[1, 2, 3, 4]]), cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="loss_chunk must be >= 0, got -1"):
        model(torch.tensor([[1, 2]]), labels=torch.tensor([[2, 3]]), loss_chunk=-1)


def test_meta_build_allocates_nothing():
    from openk3.config import kimi_k3
    with torch.device("meta"):
        model = K3ForCausalLM(kimi_k3())
    assert all(p.device.type == "meta" for p in model.parameters())


def module_attributes(model: K3ForCausalLM) -> dict:
    """Every module's attributes (the objects themselves) and every state_dict tensor's storage."""
    attrs = {name: dict(vars(m)) for name, m in model.named_modules()}
    tensors = {name: (t.data_ptr(), t.shape) for name, t in model.state_dict().items()}
    return {"attrs": attrs, "tensors": tensors}


def assert_unchanged(before: dict, after: dict) -> None:
    assert before["tensors"] == after["tensors"]
    assert before["attrs"].keys() == after["attrs"].keys()
    for name, attrs in before["attrs"].items():
        assert attrs.keys() == after["attrs"][name].keys(), name
        for k, v in attrs.items():
            assert after["attrs"][name][k] is v, f"{name}.{k} was replaced by a forward"
            if isinstance(v, dict):  # _parameters, _buffers, _modules, hooks: same contents
                assert dict(v) == dict(after["attrs"][name][k]), f"{name}.{k}"


def test_record_returns_router_stats_and_leaves_no_state():
    """record=True returns, per MoE layer, exactly the scores and the selection `route` gives for that layer's input;
    record_attnres=True every mix's mean weights. No forward (recording or not) leaves anything on a module."""
    from openk3.ops.moe import route

    c = tiny()
    torch.manual_seed(7)
    model = K3ForCausalLM(c)
    randomise_attnres(model)
    moes = model.moe_layers()
    assert moes
    with torch.no_grad():
        for m in moes:
            m.gate.e_score_correction_bias.normal_(std=0.1)  # a bias that changes the selection
    ids = torch.randint(0, c.vocab_size, (2, 9))
    before = module_attributes(model)
    inputs = []
    handles = [m.gate.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach())) for m in moes]
    out = model(ids, record=True, record_attnres=True)
    for h in handles:
        h.remove()
    assert out.router is not None and len(out.router) == len(moes) == len(inputs)
    for m, x, (scores, idx) in zip(moes, inputs, out.router):
        want_scores = torch.sigmoid(x.float() @ m.gate.weight.float().T)
        assert torch.equal(scores, want_scores)
        assert torch.equal(idx, route(want_scores, m.gate.e_score_correction_bias, c.num_experts_per_token))
        assert not scores.requires_grad and idx.shape == (ids.numel(), c.num_experts_per_token)
    names = [f"{l.i}.{n}" for l in model.model.layers for n in ("attn", "mlp") if l.i > 0 or n == "mlp"]
    assert list(out.attnres) == names + ["output"]
    for w in out.attnres.values():
        assert torch.allclose(w.sum(), torch.tensor(1.0), atol=1e-5)
    assert_unchanged(before, module_attributes(model))

    plain = model(ids)
    assert plain.router is None and plain.attnres is None
    assert torch.equal(plain.logits, out.logits)  # recording changes no number
    assert_unchanged(before, module_attributes(model))


def test_mxfp4_experts_on_grid_skip_fake_quant_exactly(monkeypatch):
    """Inference on MXFP4 weights skips the (identity) weight fake-quant; off the grid, or once the weights change
    in place, it fake-quantises again, so the output always equals the fake-quantised forward."""
    import openk3.model.model as mm
    from openk3.ops.mxfp import fake_quant_mxfp4

    torch.manual_seed(3)
    model = K3ForCausalLM(tiny(), qat=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    experts = [m.experts for m in model.moe_layers()]
    calls = []

    def counting(t):
        calls.append(1)
        return fake_quant_mxfp4(t)

    with torch.no_grad():
        off_grid = model(ids).logits  # random weights: not on the grid, quantised every forward
        assert not any(e._on_grid for e in experts)
        for e in experts:  # what loading an MXFP4 checkpoint gives: weights already on the grid
            for p in (e.w1, e.w2, e.w3):
                p.copy_(fake_quant_mxfp4(p))
        on_grid = model(ids).logits
        assert all(e._on_grid for e in experts)
        assert torch.equal(on_grid, off_grid)  # fake-quant is idempotent: same logits, bit for bit
        monkeypatch.setattr(mm, "fake_quant_mxfp4", counting)
        model(ids)
        assert calls == []  # on the grid, unchanged weights: no weight is fake-quantised
        experts[0].w1.add_(0.01)  # an in-place write (a weight load, an optimizer step) makes it check again
        again = model(ids).logits
        assert calls and not experts[0]._on_grid
        monkeypatch.undo()
        assert torch.equal(again, model(ids).logits)


def test_varlen_causal_keyword_follows_the_torch_version():
    """torch 2.10's varlen_attn takes is_causal, later ones window_size (and refuse is_causal): the MLA varlen path
    asks each for causal attention its own way (the GPU box runs another torch than CI)."""
    from openk3.model.model import varlen_causal_kwargs

    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None,
                   scale=None):
        pass

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)):
        pass

    assert varlen_causal_kwargs(torch_2_10) == {"is_causal": True}
    assert varlen_causal_kwargs(torch_2_11) == {"window_size": (-1, 0)}


@pytest.mark.parametrize("family", ["k3", "kimi-linear"])
def test_cached_chunked_prefill_equals_full_forward(family):
    """A prompt prefilled with a cache in chunks longer than ABSORB_MAX_TOKENS (the expanded MLA form, lower-right
    causal over cached + new keys without a mask), then decoded: the logits of one uncached forward."""
    c, model = family_model(family, seed=5)
    ids = torch.randint(0, c.vocab_size, (2, 70))
    with torch.no_grad():
        full = model(ids).logits
        cache = K3Cache.empty(c, batch=2, max_len=80)
        parts = [model(ids[:, s:e], cache=cache).logits for s, e in [(0, 17), (17, 40), (40, 67)]]
        parts += [model(ids[:, t:t + 1], cache=cache).logits for t in range(67, 70)]
    assert cache.length == 70
    assert rel_err(torch.cat(parts, dim=1), full) < 2e-5


@pytest.mark.parametrize("T", [1, 5, 16, 17, 40])
def test_cached_mla_forms_agree_and_default_by_chunk_length(T, monkeypatch):
    """With a cache (23 tokens cached), absorbed and expanded attention agree; absorb=None picks the absorbed form
    up to ABSORB_MAX_TOKENS new tokens and the expanded one above."""
    c = tiny()
    torch.manual_seed(6)
    mla = GatedMLA(c)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.1)
    width = c.kv_lora_rank + c.qk_rope_head_dim
    prefix = torch.randn(3, 23, width)
    x = torch.randn(3, T, c.hidden_size)
    used = []
    for form in ("attend_absorbed", "attend_expanded"):
        real = getattr(GatedMLA, form)
        monkeypatch.setattr(GatedMLA, form, lambda self, *a, real=real, form=form, **k: used.append(form) or
                            real(self, *a, **k))

    def run(absorb):
        state = MLAState(latent=torch.zeros(3, 64, width))
        state.append(prefix)
        out = mla(x, state=state, absorb=absorb)
        assert state.length == 23 + T
        return out

    with torch.no_grad():
        absorbed, expanded, default = run(True), run(False), run(None)
    assert used[:2] == ["attend_absorbed", "attend_expanded"]
    assert used[2] == ("attend_absorbed" if T <= ABSORB_MAX_TOKENS else "attend_expanded")
    assert rel_err(absorbed, expanded) < 1e-5
    assert torch.equal(default, absorbed if T <= ABSORB_MAX_TOKENS else expanded)


def test_lower_right_causal_mask_by_hand():
    """2 new tokens after 3 cached: the first sees keys 0..3, the second 0..4."""
    want = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(lower_right_causal_mask(2, 5, "cpu")[0, 0], want)
    assert torch.equal(lower_right_causal_mask(4, 4, "cpu")[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())


def random_cached_mla(device, dtype, cached: int, batch: int, seed: int) -> tuple[GatedMLA, torch.Tensor]:
    """A GatedMLA of K3's head widths (qk 192, v 128, latent 512 + 64; 4 heads) with random weights, and random
    latents [batch, cached, 576] for its cache."""
    c = tiny().replace(hidden_size=256, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=512,
                       qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    torch.manual_seed(seed)
    mla = GatedMLA(c).to(device)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.05)
    mla = mla.to(dtype)
    return mla, torch.randn(batch, cached, c.kv_lora_rank + c.qk_rope_head_dim, device=device, dtype=dtype)


def cached_mla(mla: GatedMLA, prefix: torch.Tensor, x: torch.Tensor, absorb: bool | None) -> torch.Tensor:
    state = MLAState(latent=torch.zeros(prefix.shape[0], prefix.shape[1] + x.shape[1], prefix.shape[2],
                                        device=x.device, dtype=x.dtype))
    state.append(prefix)
    return mla(x, state=state, absorb=absorb)


@pytest.mark.parametrize("T", [1, 3])
def test_absorbed_mla_precision(T):
    """attend_absorbed (issue #12): in fp32 it agrees with the expanded form to fp32 rounding; a bf16 module (bf16
    matmuls, fp32 scores and softmax) stays within bf16 rounding of the fp32 computation on the same bf16 weights
    and inputs. Random latents, queries and a random mask (key 0 always visible, ~30% of the others hidden)."""
    mla, lat = random_cached_mla("cpu", torch.float32, cached=70, batch=3, seed=9)
    g = torch.Generator().manual_seed(9)
    q = 2 * torch.randn(3, T, 4, 192, generator=g)
    mask = torch.rand(3, 1, T, 70, generator=g) > 0.3
    mask[..., 0] = True
    with torch.no_grad():
        absorbed = mla.attend_absorbed(q, lat, mask)
        assert absorbed.dtype == torch.float32
        assert rel_err(absorbed, mla.attend_expanded(q, lat, mask, causal=False)) < 1e-5
        mla, q, lat = mla.to(torch.bfloat16), q.bfloat16(), lat.bfloat16()
        low = mla.attend_absorbed(q, lat, mask)
        reference = mla.float().attend_absorbed(q.float(), lat.float(), mask)
    assert low.dtype == torch.bfloat16
    assert rel_err(low, reference) < 1.5e-2


def test_cached_expanded_varlen_glue_is_bottom_right_causal(monkeypatch):
    """The CUDA half-precision route of a cached chunk (torch's varlen flash kernel, one document per row with more
    keys than queries), run on the CPU through a stand-in for varlen_attn with flash's documented semantics
    (causal aligned to the last key): the packing of rows into cu_seqlens, the padded v and the cut-back output
    agree with the absorbed form."""
    import openk3.model.model as model_module

    def flash_semantics(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        assert window_size == (-1, 0) and max_q == int((cu_q[1:] - cu_q[:-1]).max())
        out = []
        for i in range(len(cu_q) - 1):
            qi, ki, vi = (t[a:b].transpose(0, 1) for t, a, b in ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]),
                                                                    (v, cu_k[i], cu_k[i + 1])))
            mask = lower_right_causal_mask(qi.shape[1], ki.shape[1], q.device)[0]
            out.append(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
                       .transpose(0, 1))
        return torch.cat(out)

    calls = []
    monkeypatch.setattr(model_module, "varlen_attn", lambda *a, **k: calls.append(1) or flash_semantics(*a, **k))
    monkeypatch.setattr(model_module, "VARLEN_CAUSAL", {"window_size": (-1, 0)})
    monkeypatch.setattr(model_module, "varlen_attention_runs", lambda q: True)
    mla, prefix = random_cached_mla("cpu", torch.float32, cached=29, batch=2, seed=7)
    x = torch.randn(2, 21, 256)
    with torch.no_grad():
        assert rel_err(cached_mla(mla, prefix, x, absorb=False), cached_mla(mla, prefix, x, absorb=True)) < 1e-5
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,bound,cudnn", [(torch.bfloat16, 2e-2, True), (torch.bfloat16, 2e-2, False),
                                               (torch.float32, 1e-4, True)])
def test_cached_expanded_mla_on_cuda_equals_absorbed(dtype, bound, cudnn, monkeypatch):
    """Issue #12 on the GPU: a 200-token chunk after 300 cached tokens (2 rows) in the expanded form, through cuDNN's
    kernel in two merged parts (bf16 on sm90, opted in), the varlen flash kernel (bf16, the default) or
    SDPA's memory-efficient kernel with torch's lower-right causal bias (fp32; no dense mask), against the absorbed
    form over the explicit mask (its scores and softmax in fp32)."""
    import openk3.model.model as model_module

    calls = []
    for name in ("varlen_causal_attention", "prefix_causal_attention"):
        real = getattr(model_module, name)
        monkeypatch.setattr(model_module, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    if cudnn:  # opt-in (model_module.CUDNN_PREFIX_ENV); the default is the varlen flash kernel
        monkeypatch.setenv(model_module.CUDNN_PREFIX_ENV, "1")
    mla, prefix = random_cached_mla("cuda", dtype, cached=300, batch=2, seed=8)
    x = torch.randn(2, 200, 256, device="cuda", dtype=dtype)
    with torch.no_grad():
        expanded = cached_mla(mla, prefix, x, absorb=None)
        absorbed = cached_mla(mla, prefix, x, absorb=True)
    half = dtype == torch.bfloat16
    if half and cudnn and torch.cuda.get_device_capability()[0] == 9:
        assert calls == ["prefix_causal_attention"]
    else:
        assert calls == (["varlen_causal_attention"] if half and model_module.varlen_attn is not None else [])
    assert rel_err(expanded, absorbed) < bound


def test_routed_experts_compute_in_the_autocast_dtype(monkeypatch):
    """fp32 parameters under bf16 autocast (the training recipe): the routed experts run in bf16 like a Linear would,
    not as fp32 matmuls (autocast does not cover torch._grouped_mm), and agree with the fp32 result."""
    import openk3.model.model as m
    torch.manual_seed(0)
    experts = m.Experts(4, 16, 24)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    z = torch.randn(10, 16)
    idx = torch.randint(0, 4, (10, 2))
    w = torch.rand(10, 2)
    act = m.glu_activation(tiny())
    seen = []
    real = m.moe_experts

    def spy(x, *args, **kwargs):
        seen.append(x.dtype)
        return real(x, *args, **kwargs)
    monkeypatch.setattr(m, "moe_experts", spy)
    ref = experts(z, idx, w, act)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(z, idx, w, act)
    assert seen == [torch.float32, torch.bfloat16] and out.dtype == torch.bfloat16
    assert rel_err(out.float(), ref) < 2e-2


def test_two_attentions_merged_by_log_sum_exp_equal_one():
    """`merge_attention` of the cached keys' part (no mask) and the new keys' part (causal) equals one attention with
    the lower-right causal mask (fp32, CPU); the parts' log-sum-exps far apart too (scores scaled by 40)."""
    from openk3.model.model import merge_attention

    def part(q, k, v, mask):
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ v, scores.logsumexp(-1)
    for scale in (1.0, 40.0):
        gen = torch.Generator().manual_seed(int(scale))
        B, H, T, S = 2, 3, 7, 19
        q = scale * torch.randn(B, H, T, 8, generator=gen)
        k, v = torch.randn(B, H, S, 8, generator=gen), torch.randn(B, H, S, 5, generator=gen)
        ref, _ = part(q, k, v, lower_right_causal_mask(T, S, "cpu"))
        P = S - T
        (o1, l1), (o2, l2) = part(q, k[:, :, :P], v[:, :, :P], None), part(
            q, k[:, :, P:], v[:, :, P:], torch.ones(T, T, dtype=torch.bool).tril())
        assert rel_err(merge_attention(o1, l1, o2, l2), ref) < 1e-6
