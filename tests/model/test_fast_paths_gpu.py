"""The GPU-only fast paths of the model against their references, forward and backward.

- MLA on packed documents: torch's varlen flash kernel (v zero-padded to the qk width) vs SDPA with the dense
  block-diagonal mask, and the cuDNN-first SDPA order vs the math kernel in fp32, on one GatedMLA layer; at
  inference a prompt's first chunk through the varlen kernel.
- fla's tuned kernel configs written by openk3/ops/kda/tuned.py parse with fla's own reader, keyed as fla keys them.
"""

import importlib.util
import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from openk3.config import tiny
from openk3.model.model import GatedMLA, document_causal_mask
from openk3.model.state import MLAState
from tests.helpers import rel_norm_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def grads_of(layer, x, **kw):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y = layer(x, **kw)
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
    return y.float(), x.grad.float(), {n: p.grad.float() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_mla_varlen_matches_dense_mask(dtype):
    torch.manual_seed(0)
    c = tiny().replace(num_attention_heads=4, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
    layer = GatedMLA(c).cuda().to(dtype)
    B, T = 2, 300
    cu = torch.tensor([0, 37, 300, 301, 480, 600], device="cuda")  # a one-token document, a row-long one
    x = torch.randn(B, T, c.hidden_size, device="cuda", dtype=dtype)
    max_len = int((cu[1:] - cu[:-1]).max())
    y, gx, gp = grads_of(layer, x, varlen=(cu.to(torch.int32), max_len))
    ref_layer = GatedMLA(c).cuda()
    ref_layer.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    with sdpa_kernel([SDPBackend.MATH]):
        y_ref, gx_ref, gp_ref = grads_of(ref_layer, x.float(), mask=document_causal_mask(cu, B, T))
    assert rel_norm_err(y, y_ref) < 2e-2
    assert rel_norm_err(gx, gx_ref) < 3e-2
    for n in gp_ref:
        assert rel_norm_err(gp[n], gp_ref[n]) < 3e-2, n


def test_mla_causal_sdpa_order_matches_math():
    """Unpacked causal MLA through the CUDA SDPA order (cuDNN first) vs the math kernel, bf16 vs fp32."""
    torch.manual_seed(1)
    c = tiny().replace(num_attention_heads=4, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    layer = GatedMLA(c).cuda().to(torch.bfloat16)
    x = torch.randn(2, 256, c.hidden_size, device="cuda", dtype=torch.bfloat16)
    y, gx, gp = grads_of(layer, x)
    ref_layer = GatedMLA(c).cuda()
    ref_layer.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    with sdpa_kernel([SDPBackend.MATH]):
        y_ref, gx_ref, gp_ref = grads_of(ref_layer, x.float())
    assert rel_norm_err(y, y_ref) < 2e-2
    assert rel_norm_err(gx, gx_ref) < 3e-2
    for n in gp_ref:
        assert rel_norm_err(gp[n], gp_ref[n]) < 3e-2, n


def test_mla_first_chunk_at_inference_runs_varlen_and_matches_math(monkeypatch):
    """At inference a plain causal chunk (no cache) runs the varlen flash kernel, not SDPA's cuDNN-first order (a
    plan build per new length): bf16 against the fp32 layer on the math kernel. An fp32 layer under bf16 autocast
    with an fp32 cache (its k_pe keeps the cache's dtype, so the keys come out fp32) runs it too, keys and values
    cast to q's dtype. A step that needs a gradient keeps SDPA."""
    import openk3.model.model as m
    key_dtypes = []
    varlen = m.varlen_causal_attention
    monkeypatch.setattr(m, "varlen_causal_attention",
                        lambda *a, **kw: key_dtypes.append(a[1].dtype) or varlen(*a, **kw))
    torch.manual_seed(2)
    c = tiny().replace(num_attention_heads=4, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    ref = GatedMLA(c).cuda()
    layer = GatedMLA(c).cuda().to(torch.bfloat16)
    layer.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    x = torch.randn(2, 300, c.hidden_size, device="cuda")
    with torch.no_grad():
        with sdpa_kernel([SDPBackend.MATH]):
            y_ref = ref(x)
        y = layer(x.to(torch.bfloat16))
        assert key_dtypes == [torch.bfloat16]
        assert rel_norm_err(y.float(), y_ref) < 2e-2
        cache = MLAState(latent=torch.zeros(2, 320, c.kv_lora_rank + c.qk_rope_head_dim, device="cuda"))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y_autocast = ref(x, state=cache)
        assert key_dtypes == [torch.bfloat16] * 2
        assert rel_norm_err(y_autocast.float(), y_ref) < 2e-2
    grads_of(layer, x.to(torch.bfloat16))
    assert len(key_dtypes) == 2


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention")
def test_dumped_fla_configs_parse_with_fla(tmp_path):
    import triton
    from fla.ops.kda import chunk_kda
    from fla.ops.utils.cache import AutotuneKey, KernelConfigFile

    from openk3.ops.kda.tuned import dump_fla_configs

    B, T, H, K = 1, 256, 2, 64
    q, k, v = (torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = -torch.rand(B, T, H, K, device="cuda") * 0.1
    beta = torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16)
    chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    names = dump_fla_configs(tmp_path, triton.__version__)
    assert names, "no fla kernel was tuned by a chunk_kda call"
    for name in names:
        path = tmp_path / f"{name}.json"
        parsed = KernelConfigFile.from_file(path)
        assert parsed is not None and parsed.default_config is not None, name
        for h, entry in json.loads(path.read_text())["autotune_entries"].items():
            assert AutotuneKey.key_hash(tuple(entry["autotune_key"])) == h, name


@pytest.mark.parametrize("T, S, scale", [(300, 1000, 1.0), (257, 4353, 1.0), (64, 80, 30.0)])
def test_cached_chunk_through_cudnn_matches_math_and_varlen(T, S, scale, monkeypatch):
    """A cached chunk's attention (query t sees keys 0..S-T+t) as cuDNN's two merged parts, bf16, at MLA's head
    widths (qk 192, v 128), against the fp32 math kernel with the lower-right mask and the varlen flash kernel;
    scale 30 makes the softmax nearly one-hot (log-sum-exps far apart across the two parts)."""
    from openk3.model.model import (cudnn_attention_runs, lower_right_causal_mask, prefix_causal_attention,
                                    varlen_causal_attention)
    torch.manual_seed(T)
    B, H = 2, 4
    q = scale * torch.randn(B, H, T, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, H, 192, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # the model's layouts
    v = torch.randn(B, S, H, 256, device="cuda", dtype=torch.bfloat16)[..., 64:192].transpose(1, 2)
    assert not cudnn_attention_runs(q, v)  # opt-in
    monkeypatch.setenv("OPENK3_CUDNN_PREFIX_ATTENTION", "1")
    if not cudnn_attention_runs(q, v):
        pytest.skip("cuDNN's fused attention is used on Hopper (sm90) only")
    assert not cudnn_attention_runs(q.requires_grad_(), v)  # its log-sum-exp has no gradient
    q = q.detach()
    o = prefix_causal_attention(q, k, v, 192 ** -0.5)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=lower_right_causal_mask(T, S, "cuda"), scale=192 ** -0.5)
    cu_q = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device="cuda")
    cu_k = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
    flash = varlen_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cu_q, T, 192 ** -0.5,
                                    keys=(cu_k, S)).transpose(1, 2)
    assert o.shape == (B, H, T, 128) and o.dtype == torch.bfloat16
    assert rel_norm_err(o, ref) < 1e-2
    assert rel_norm_err(o, ref) <= 1.5 * rel_norm_err(flash, ref) + 2e-3
