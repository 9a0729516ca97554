"""MoonViT-V2 (K3_SPEC section 10): release names and shapes, the divided position embedding, packed variable-resolution
batches, the 2x2 merge with temporal pooling and the patchmergerv2 projector against hand computations."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from openk3.cli import main
from openk3.config import VisionConfig, kimi_k3
from openk3.model.checkpoint import name_map
from openk3.vision.model import count_vision_params
from openk3.vision.tower import (MoonViT, PatchMergerMLPV2, frame_cu_seqlens, interpolate_pos_emb, sincos_1d,
                                 tpool_patch_merge, varlen_attention)
from tests.helpers import rel_err


def small_vision(**changes) -> VisionConfig:
    base = dict(vt_hidden_size=32, vt_num_hidden_layers=2, vt_num_attention_heads=2, vt_intermediate_size=48,
                qkv_hidden_size=40, init_pos_emb_height=5, init_pos_emb_width=7, mm_hidden_size=32,
                text_hidden_size=24)
    return VisionConfig(**{**base, **changes})


def randomised(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return module


# ------------------------------------------------------------------------------------------ the release

RELEASE_VISION = {  # K3_SPEC section 10: name -> shape, for one block of 27
    "vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
    "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
    "vision_tower.encoder.blocks.0.norm0.weight": (1024,),
    "vision_tower.encoder.blocks.0.norm1.weight": (1024,),
    "vision_tower.encoder.blocks.0.wqkv.weight": (4608, 1024),
    "vision_tower.encoder.blocks.0.wo.weight": (1024, 1536),
    "vision_tower.encoder.blocks.0.mlp.fc0.weight": (4096, 1024),
    "vision_tower.encoder.blocks.0.mlp.fc1.weight": (1024, 4096),
    "vision_tower.encoder.final_layernorm.weight": (1024,),
    "mm_projector.proj.0.weight": (4096, 4096),
    "mm_projector.proj.2.weight": (7168, 4096),
    "mm_projector.post_norm.weight": (7168,),
}


def test_release_vision_names_and_shapes():
    """The release config's table (meta device, nothing allocated) holds exactly the spec's vision tensors, stored
    as they are (not quantised, the model's dtype), unprefixed, after every text tensor (the last shards)."""
    entries = name_map(kimi_k3())
    stored = {s.name: s for e in entries for s in e.stored}
    vision = {n: s for n, s in stored.items() if n.startswith(("vision_tower.", "mm_projector."))}
    for name, shape in RELEASE_VISION.items():
        assert vision[name].shape == shape and vision[name].dtype is None, name
    per_block = [n.split(".", 4)[-1] for n in vision if n.startswith("vision_tower.encoder.blocks.0.")]
    assert sorted(per_block) == sorted(["norm0.weight", "norm1.weight", "wqkv.weight", "wo.weight", "mlp.fc0.weight",
                                        "mlp.fc1.weight"])
    assert {int(n.split(".")[3]) for n in vision if ".blocks." in n} == set(range(27))
    assert len(vision) == 3 + 27 * 6 + 3
    names = [s.name for e in entries for s in e.stored]
    first_vision = min(i for i, n in enumerate(names) if n in vision)
    assert all(n in vision for n in names[first_vision:])
    assert not any(n.startswith("language_model.vision") for n in names)


def test_release_vision_parameter_count(capsys):
    counts = count_vision_params(kimi_k3().vision_config)
    assert round(counts["vision_params"] / 1e6) == 401  # spec: ~401M
    # by hand: patch conv + pos grid + 27 x (qkv, out, two MLP matrices, two norms) + final norm
    D, Q, F_ = 1024, 1536, 4096
    tower = D * 3 * 14 * 14 + 64 * 64 * D + 27 * (3 * Q * D + D * Q + 2 * F_ * D + 2 * D) + D
    assert counts["vision_params"] == tower
    assert counts["projector_params"] == 4096 * 4096 + 7168 * 4096 + 7168
    main(["info", "--config", "kimi-k3", "--json"])
    info = json.loads(capsys.readouterr().out)
    assert (info["vision_params"], info["projector_params"]) == (tower, counts["projector_params"])


@pytest.mark.parametrize("field,value", [("merge_type", "sd2"), ("norm_type", "layernorm"), ("qkv_hidden_size", 41),
                                         ("mm_hidden_size", 16), ("merge_kernel_size", [2]), ("patch_size", 0),
                                         ("projector_ln_eps", "small")])
def test_bad_vision_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"vision_config.{field}"):
        small_vision(**{field: value})


def test_text_width_must_match():
    with pytest.raises(ValueError, match="text_hidden_size"):
        kimi_k3().replace(vision_config={"text_hidden_size": 1024})


# ------------------------------------------------------------------------------ position embedding


def bilinear_by_hand(grid, h, w):
    """align_corners=False bilinear resize written out: source coordinate (i + 0.5) * H0 / h - 0.5, clamped."""
    H0, W0, D = grid.shape
    out = torch.empty(h, w, D, dtype=torch.float64)
    g = grid.double()
    for i in range(h):
        y = min(max((i + 0.5) * H0 / h - 0.5, 0.0), H0 - 1)
        y0 = math.floor(y); y1 = min(y0 + 1, H0 - 1); fy = y - y0
        for j in range(w):
            x = min(max((j + 0.5) * W0 / w - 0.5, 0.0), W0 - 1)
            x0 = math.floor(x); x1 = min(x0 + 1, W0 - 1); fx = x - x0
            out[i, j] = ((1 - fy) * ((1 - fx) * g[y0, x0] + fx * g[y0, x1])
                         + fy * ((1 - fx) * g[y1, x0] + fx * g[y1, x1]))
    return out


@pytest.mark.parametrize("h,w", [(9, 4), (13, 11), (3, 2), (5, 7)])
def test_pos_emb_interpolation_is_bilinear(h, w):
    grid = torch.randn(5, 7, 6)
    got = interpolate_pos_emb(grid, h, w)
    assert got.shape == (h, w, 6)
    assert rel_err(got, bilinear_by_hand(grid, h, w)) < 1e-6
    if (h, w) == (5, 7):
        assert torch.equal(got, grid)  # the grid itself at its own size


def test_video_frames_get_the_fixed_time_embedding():
    torch.manual_seed(0)
    v = small_vision()
    tower = randomised(MoonViT(v))
    pos = tower.patch_embed.pos_emb
    still, video = pos([(1, 4, 6)]), pos([(3, 4, 6)]).view(3, 24, -1)
    time = sincos_1d(32, 3)
    assert torch.allclose(time[0], torch.cat([torch.zeros(16), torch.ones(16)]))
    for f in range(3):
        assert rel_err(video[f], still + time[f]) < 1e-6
    with pytest.raises(ValueError, match="frames"):
        tower(torch.randn(5 * 4 * 6, 3, 14, 14), torch.tensor([[5, 4, 6]]))


# ------------------------------------------------------------------------------------- packed batches


def test_packed_images_equal_one_at_a_time_forward_and_backward():
    """Three images of different grids (one at the grid's own size, two interpolated, one a 2-frame video) packed
    with cu_seqlens boundaries give what each gives alone, in the outputs and in every parameter's gradient."""
    torch.manual_seed(0)
    tower = randomised(MoonViT(small_vision()))
    grids = [(1, 6, 4), (1, 2, 10), (2, 4, 4), (1, 6, 8)]
    pixels = [torch.randn(t * h * w, 3, 14, 14) for t, h, w in grids]
    weights = [torch.randn(h // 2 * w // 2, 4, 32) for _, h, w in grids]

    packed = tower(torch.cat(pixels), torch.tensor(grids))
    loss = sum((o * wt).sum() for o, wt in zip(packed, weights))
    grads_packed = torch.autograd.grad(loss, list(tower.parameters()))

    alone = [tower(p, torch.tensor([g]))[0] for p, g in zip(pixels, grids)]
    loss = sum((o * wt).sum() for o, wt in zip(alone, weights))
    grads_alone = torch.autograd.grad(loss, list(tower.parameters()))
    for a, b in zip(packed, alone):
        assert rel_err(a, b) < 1e-5
    for a, b in zip(grads_packed, grads_alone):
        assert rel_err(a, b) < 1e-5


def test_images_do_not_see_each_other():
    torch.manual_seed(1)
    tower = randomised(MoonViT(small_vision()))
    grids = torch.tensor([[1, 4, 4], [1, 2, 6]])
    a, b = torch.randn(16, 3, 14, 14), torch.randn(12, 3, 14, 14)
    out1 = tower(torch.cat([a, b]), grids)
    out2 = tower(torch.cat([a, torch.randn_like(b)]), grids)
    assert torch.equal(out1[0], out2[0]) and not torch.allclose(out1[1], out2[1])


def test_varlen_attention_is_per_segment_attention():
    """Against a single masked attention over everything with a block-diagonal mask, written out in float64."""
    torch.manual_seed(0)
    L, H, d = 23, 3, 8
    q, k, v = (torch.randn(L, H, d, dtype=torch.float64) for _ in range(3))
    cu = [0, 5, 6, 17, 23]
    seg = torch.repeat_interleave(torch.arange(4), torch.tensor([5, 1, 11, 6]))
    scores = torch.einsum("lhd,mhd->hlm", q, k) / math.sqrt(d)
    scores = scores.masked_fill(seg[None, :, None] != seg[None, None, :], float("-inf"))
    expected = torch.einsum("hlm,mhd->lhd", scores.softmax(-1), v)
    assert rel_err(varlen_attention(q, k, v, cu), expected) < 1e-12
    assert frame_cu_seqlens([(1, 2, 3), (2, 2, 2)]) == [0, 6, 10, 14]


def test_varlen_attention_takes_the_cpu_flash_kernel():
    """Not the math kernel, which builds each frame's [H, n, n] scores: 206 GB for one 65,536-patch image of the
    release. torch picks the flash kernel on the CPU only for 4-D inputs."""
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(10, 2, 8, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        varlen_attention(q, q, q, [0, 4, 10]).sum().backward()
    names = {e.name for e in prof.events()}
    assert any("flash_attention" in n and "backward" not in n for n in names), sorted(n for n in names if "attn" in n
                                                                                      or "attention" in n)
    assert not any("_math" in n for n in names)


def test_bad_grids_are_refused():
    tower = MoonViT(small_vision())
    with pytest.raises(ValueError, match="multiple of 2"):
        tower(torch.randn(15, 3, 14, 14), torch.tensor([[1, 3, 5]]))
    with pytest.raises(ValueError, match="grid_thws says 16"):
        tower(torch.randn(15, 3, 14, 14), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match=r"\[L, 3, 14, 14\]"):
        tower(torch.randn(16, 3, 16, 16), torch.tensor([[1, 4, 4]]))


# ------------------------------------------------------------------------------- merge and projector


def test_merge_gathers_2x2_windows_and_averages_frames():
    t, h, w, D = 2, 4, 6, 3
    x = torch.randn(t * h * w, D, dtype=torch.float64)
    (merged,) = tpool_patch_merge(x, [(t, h, w)], [2, 2])
    assert merged.shape == (h // 2 * w // 2, 4, D)
    frames = x.view(t, h * w, D)
    for i in range(h // 2):
        for j in range(w // 2):
            for a in range(2):
                for b in range(2):
                    p = (2 * i + a) * w + (2 * j + b)
                    assert torch.allclose(merged[i * (w // 2) + j, 2 * a + b], frames[:, p].mean(0))


def test_projector_by_hand():
    torch.manual_seed(0)
    v = small_vision()
    proj = randomised(PatchMergerMLPV2(v)).double()
    x = torch.randn(7, 4, 32, dtype=torch.float64)
    w0, w2, g = proj.proj[0].weight, proj.proj[2].weight, proj.post_norm.weight
    flat = x.reshape(7, 128)  # the four merged patches side by side
    hid = flat @ w0.T
    hid = 0.5 * hid * (1 + torch.erf(hid / math.sqrt(2)))  # exact GELU
    y = hid @ w2.T
    y = y / torch.sqrt((y * y).mean(-1, keepdim=True) + v.projector_ln_eps) * g
    assert rel_err(proj(x), y) < 1e-6


def test_mlp_uses_tanh_gelu():
    from openk3.vision.tower import VisionMLP

    torch.manual_seed(0)
    mlp = randomised(VisionMLP(small_vision())).double()
    x = torch.randn(5, 32, dtype=torch.float64)
    h = x @ mlp.fc0.weight.T
    h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    assert rel_err(mlp(x), h @ mlp.fc1.weight.T) < 1e-12
    assert not torch.allclose(mlp(x), mlp.fc1(F.gelu(mlp.fc0(x))), rtol=0, atol=1e-9)
