"""MoonViT-V2, the vision tower of Kimi K3, and its `patchmergerv2` projector (K3_SPEC section 10).

    pixel_values [L, 3, 14, 14]   every patch of every image, packed image after image (no padding to a square)
    grid_thws    [N, 3]           each image's (frames, patch rows, patch columns); L = sum of t * h * w
        -> patch_embed (conv 14x14, no bias) + divided position embedding (learned [64, 64, D] spatial grid,
           bilinearly interpolated to each image's h x w; fixed sin-cos time part for video frames)
        -> 27 pre-norm blocks: x += wo(attention(wqkv(norm0(x)))); x += fc1(gelu_tanh(fc0(norm1(x))))
           attention runs inside each frame only (`cu_seqlens` boundaries: one segment per frame)
        -> final_layernorm
        -> 2x2 patch merge with temporal pooling (`sd2_tpool`): [h/2 * w/2, 4, D] per image (frames averaged)
        -> mm_projector: proj.0 [4D, 4D], GELU, proj.2 [text, 4D], post_norm (RMSNorm)  -> [N_i, text width]

Parameter names are the release's without the `vision_tower.` / `mm_projector.` prefix (checkpoint.py adds
nothing: K3ForConditionalGeneration holds these modules under exactly those names).

[inferred] The spec publishes names and shapes, not every detail: the tower's RMSNorm eps (1e-5, as the text
model and the projector), that `post_norm` is an RMSNorm (one [7168] tensor; the config's `projector_ln_eps` could
also mean a weight-only LayerNorm), that a still image gets no time embedding (only frames of a video chunk do), and
the sin-cos formula of the time part (MAE's 1-D form). NOTE: the temporal half of the factorised video
attention is not implemented: frames of a video attend within themselves and meet only in the temporal pooling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from openk3.config import VisionConfig
from openk3.model.model import RMSNorm

TOWER_NORM_EPS = 1e-5  # [inferred]


def check_grids(grid_thws: Tensor, config: VisionConfig) -> list[tuple[int, int, int]]:
    """grid_thws [N, 3] as a list of (t, h, w), with a clear error for a grid the tower cannot take."""
    if grid_thws.dim() != 2 or grid_thws.shape[1] != 3:
        raise ValueError(f"grid_thws must be [images, 3] (frames, patch rows, patch columns), got shape "
                         f"{tuple(grid_thws.shape)}")
    kh, kw = config.merge_kernel_size
    grids = [tuple(int(v) for v in g) for g in grid_thws.tolist()]
    for i, (t, h, w) in enumerate(grids):
        if t < 1 or h < 1 or w < 1 or h % kh or w % kw:
            raise ValueError(f"image {i}: grid (t, h, w)={(t, h, w)} must be positive with h a multiple of {kh} "
                             f"and w of {kw} (the patch merge)")
        if t > config.init_pos_emb_time:
            raise ValueError(f"image {i}: {t} frames, more than init_pos_emb_time={config.init_pos_emb_time} "
                             f"(the time embedding's length)")
    return grids


def sincos_1d(dim: int, n: int, device=None) -> Tensor:
    """Fixed sin-cos embedding of positions 0..n-1: [n, dim] = [sin(p * w_i) | cos(p * w_i)], w_i = 10000^(-2i/dim)
    (MAE's 1-D form), in fp32."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64, device=device) / (dim / 2))
    angles = torch.arange(n, dtype=torch.float64, device=device)[:, None] * omega[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


def interpolate_pos_emb(weight_HWD: Tensor, h: int, w: int) -> Tensor:
    """The learned [H0, W0, D] grid resized to [h, w, D]: bilinear, align_corners=False (the grid's cells are
    stretched over the image, corners not pinned); the grid itself when the size already matches."""
    if weight_HWD.shape[:2] == (h, w):
        return weight_HWD
    x = weight_HWD.permute(2, 0, 1)[None].float()
    return F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)[0].permute(1, 2, 0).to(weight_HWD.dtype)


class DividedPosEmb(nn.Module):
    """`divided_fixed`: a learned spatial grid (`weight` [H0, W0, D]) plus, for video frames, a fixed sin-cos time
    embedding over at most `init_pos_emb_time` frames (computed, not stored: the release stores only the grid)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.init_pos_emb_height, config.init_pos_emb_width,
                                               config.vt_hidden_size))

    def forward(self, grids: list[tuple[int, int, int]]) -> Tensor:
        """[L, D] position embedding of the packed patches (frame-major, then rows, then columns)."""
        D = self.weight.shape[-1]
        out = []
        for t, h, w in grids:
            spatial = interpolate_pos_emb(self.weight, h, w).reshape(h * w, D)
            if t == 1:
                out.append(spatial)
            else:
                time = sincos_1d(D, t, self.weight.device).to(spatial.dtype)
                out.append((spatial[None] + time[:, None]).reshape(t * h * w, D))
        return torch.cat(out)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        p = config.patch_size
        self.patch_size = p
        self.proj = nn.Conv2d(3, config.vt_hidden_size, kernel_size=p, stride=p, bias=False)
        self.pos_emb = DividedPosEmb(config)

    def forward(self, pixel_values: Tensor, grids: list[tuple[int, int, int]]) -> Tensor:
        """pixel_values [L, 3, p, p] -> [L, D]."""
        p = self.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be patches [L, 3, {p}, {p}], got shape {tuple(pixel_values.shape)}")
        L = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != L:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thws says {L}")
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)  # [L, D, 1, 1] -> [L, D]
        return x + self.pos_emb(grids)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: list[int]) -> Tensor:
    """Bidirectional attention inside each segment [cu_seqlens[i], cu_seqlens[i+1]) of packed tokens, nothing
    across segments. q, k, v [L, H, hd] -> [L, H, hd]. One SDPA call per segment: no padding and no [L, L] mask,
    the CPU counterpart of flash-attention's varlen kernel."""
    out = torch.empty_like(q)
    # NOTE: 4-D [1, H, n, hd], not 3-D: on the CPU, torch 2.x sends 3-D inputs to the math kernel, which builds the
    # [H, n, n] scores (n = 16,384 patches, 2 heads: 4.8 GB peak and 4.5x the time; the 4-D flash kernel: 0.24 GB)
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                                                  v[s:e].transpose(0, 1)[None])[0].transpose(0, 1)
    return out


class VisionMLP(nn.Module):
    """`mlp2`: fc1(gelu_tanh(fc0(x))), no biases."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(config.vt_hidden_size, config.vt_intermediate_size, bias=False)
        self.fc1 = nn.Linear(config.vt_intermediate_size, config.vt_hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm transformer block; q, k, v are qkv_hidden_size wide (12 x 128 = 1536 in the release)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        D = config.vt_hidden_size
        self.H, self.hd = config.vt_num_attention_heads, config.head_dim
        self.norm0 = RMSNorm(D, TOWER_NORM_EPS)
        self.norm1 = RMSNorm(D, TOWER_NORM_EPS)
        self.wqkv = nn.Linear(D, 3 * config.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(config.qkv_hidden_size, D, bias=False)
        self.mlp = VisionMLP(config)

    def forward(self, x: Tensor, cu_seqlens: list[int]) -> Tensor:
        q, k, v = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.H, self.hd)).unbind(1)
        x = x + self.wo(varlen_attention(q, k, v, cu_seqlens).flatten(1))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(config.vt_hidden_size, TOWER_NORM_EPS)

    def forward(self, x: Tensor, cu_seqlens: list[int]) -> Tensor:
        for block in self.blocks:
            x = block(x, cu_seqlens)
        return self.final_layernorm(x)


def frame_cu_seqlens(grids: list[tuple[int, int, int]]) -> list[int]:
    """Segment boundaries over the packed patches, one segment per frame (spatial attention within a frame)."""
    cu = [0]
    for t, h, w in grids:
        cu += [cu[-1] + (f + 1) * h * w for f in range(t)]
    return cu


def tpool_patch_merge(x: Tensor, grids: list[tuple[int, int, int]], kernel: list[int]) -> list[Tensor]:
    """`sd2_tpool`: per image, average the frames, then gather each kh x kw window of patches.
    x [L, D] -> one [h/kh * w/kw, kh * kw, D] per image; window (i, j) holds patches (i*kh + a, j*kw + b) in
    row-major (a, b) order."""
    kh, kw = kernel
    D = x.shape[-1]
    out, start = [], 0
    for t, h, w in grids:
        n = t * h * w
        img = x[start:start + n].view(t, h // kh, kh, w // kw, kw, D).mean(0)
        out.append(img.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, D))
        start += n
    return out


class MoonViT(nn.Module):
    """The tower up to the merge. forward(pixel_values, grid_thws) -> one [N_i, kh*kw, D] per image."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.encoder = VisionEncoder(config)

    def forward(self, pixel_values: Tensor, grid_thws: Tensor) -> list[Tensor]:
        grids = check_grids(grid_thws, self.config)
        x = self.patch_embed(pixel_values, grids)
        x = self.encoder(x, frame_cu_seqlens(grids))
        return tpool_patch_merge(x, grids, self.config.merge_kernel_size)


class PatchMergerMLPV2(nn.Module):
    """`patchmergerv2`: the kh*kw merged features side by side (4 x 1024 = 4096) -> Linear 4096 -> GELU ->
    Linear to the text width -> RMSNorm (`post_norm`, eps projector_ln_eps). [N, kh*kw, D] -> [N, text width]."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        d = config.merged_dim
        self.proj = nn.Sequential(nn.Linear(d, d, bias=False), nn.GELU(),
                                  nn.Linear(d, config.text_hidden_size, bias=False))
        self.post_norm = RMSNorm(config.text_hidden_size, config.projector_ln_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.post_norm(self.proj(x.flatten(-2)))


def vision_tokens(grid_thw: tuple[int, int, int], config: VisionConfig) -> int:
    """How many vision vectors (<|media_pad|> slots) an image of this patch grid fills: (h/kh) * (w/kw)."""
    _, h, w = grid_thw
    kh, kw = config.merge_kernel_size
    return (h // kh) * (w // kw)
