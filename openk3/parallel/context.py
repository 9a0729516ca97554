"""Context parallelism: one packed sequence split into contiguous segments over a CP group (K3_SPEC section 8).

    y = kda_context_parallel(attn, x_local, cu_seqlens, group)    # a KimiDeltaAttention layer
    y = mla_context_parallel(attn, x_local, cu_seqlens, group)    # a GatedMLA layer

Rank r of R holds tokens [r L, (r+1) L) of each of B packed rows of R L tokens; every rank gets the *global*
`cu_seqlens` (document starts over the flattened B R L tokens, every row start one of them: the model's convention;
cheap to share) and its own x [B, L, D]. The result equals the layer's forward on the unsplit rows, restricted to
this rank's tokens, forward and backward.
This is the torch reference of the method (it runs on the CPU with gloo, and on the GPU with fla's local kernel);
with OPENK3_CP_KDA=fla on CUDA, `kda_context_parallel` runs fla's `cp_context` (the same method in Triton) instead:
`kda_context_parallel_fla`, compared with the torch fold by tests/parallel/test_gpu.py (run on one GPU only, at
world 1). `apply_context_parallel` (bottom) puts these forms into a whole model
for the trainer's `--cp`: each rank holds a contiguous slice of every row of the batch (B rows, `local_rows`).

KDA. The delta rule is affine in the incoming state: a segment maps S_in to S_out = M S_in + S_ext (M [K, K] per
head, the product of the segment's transitions; S_ext [K, V] the state it builds from zero). One kernel call gives
both: the kernel runs on v augmented by K zero columns from the initial state [0 | I] (for the segment's first
document piece when it continues a document of the previous rank, else zeros), so the state's extra columns evolve
as X_t = A_t X_{t-1}: the final state is [S_ext | M] in fp32. A document that starts inside the segment restarts
from zero, which makes M = 0 by itself. All ranks all-gather their [S_ext | M] (fixed size, independent of L), and
rank r folds the earlier ones, S <- M_j S + S_ext_j for j < r, into its true initial state S_in. The same augmented
run also holds each token's X_t^T q_t in the extra output columns, so the true output is
o_t = o_t(from zero) + (X_t^T q_t) S_in: no second kernel call. The short conv needs the W-1 pre-conv inputs before
the segment: a halo all-gathered from the previous rank (positions inside the document mask it where a document
starts). Backward: the all-gathers are differentiable, so the gradient of S_in flows back through the fold to the
earlier ranks' (M, S_ext) (the fold with M^T) and from there into their segments.

MLA. Each rank all-gathers the 576-wide (K3) latents [c | k_pe] of every token (cheap), and attends its own queries
to the whole row with the block-diagonal causal mask of the packed documents, shifted to its offset.
"""

from __future__ import annotations

import os

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from openk3.model.model import GatedMLA, KimiDeltaAttention, segment_positions
from openk3.ops.kda import select_kda_backend



# NOTE: torch 2.13 renamed `all_gather_tensor_autograd` (deprecated there, with a warning per call) to
# `all_gather_single_autograd`; torch 2.11 has only the old name (it failed on the H200 this way).
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def all_gather(x: Tensor, world: int, group) -> list[Tensor]:
    """Every rank's x (same shape on all), differentiable: the backward sums each rank's gradients home."""
    out = _all_gather_autograd(x.contiguous(), 0, group or dist.group.WORLD)
    return list(funcol.wait_tensor(out).chunk(world))


def _segment(cu_seqlens: Tensor, B: int, L: int, rank: int, world: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """This rank's view of the global packing of B rows of world x L tokens each (cu_seqlens over the flattened
    B world L tokens, every row start one of them): (positions inside the document [B, L], the local cu_seqlens
    [P+1] of its document pieces over the flattened B L tokens, each row's "continues a document" flag of every
    segment [B, world], the index of each row's first piece [B])."""
    cu = cu_seqlens.to(torch.long).cpu()
    T = L * world
    row_starts = torch.arange(0, B * T, T)
    if (int(cu[0]) != 0 or int(cu[-1]) != B * T or bool((cu[1:] <= cu[:-1]).any())
            or not bool(torch.isin(row_starts, cu).all())):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to the {B} rows' {B * T} tokens ({world} ranks x "
                         f"{L} a row) and contain every row start, got {cu.tolist()}")
    pos = segment_positions(cu, B * T).view(B, T)
    mine = pos[:, rank * L:(rank + 1) * L]
    starts = mine == 0
    starts[:, 0] = True  # a row's slice starts a piece even inside a document (the fold carries its state in)
    flat = starts.flatten()
    local = torch.cat([flat.nonzero()[:, 0], torch.tensor([B * L])])
    first_piece = flat.cumsum(0)[torch.arange(B) * L] - 1
    continues = pos[:, torch.arange(world) * L] > 0
    return mine, local, continues, first_piece


def local_rows(input_ids: Tensor, labels: Tensor, cu_seqlens: Tensor, rank: int, world: int
               ) -> tuple[Tensor, Tensor, Tensor]:
    """CP rank `rank`'s contiguous slice of every row of a packed batch: input_ids, labels [B, T] ->
    [B, T / world] each, and the cu_seqlens of the slices as the model validates them (every row start, and every
    document start inside the slices, over the flattened B T / world tokens). Labels were aligned before slicing,
    so the last token of a slice keeps its target, the first token of the next slice."""
    B, T = input_ids.shape
    if T % world:
        raise ValueError(f"rows of {T} tokens do not split into {world} equal context-parallel slices")
    L = T // world
    _, local, _, _ = _segment(cu_seqlens, B, L, rank, world)
    cols = slice(rank * L, (rank + 1) * L)
    return input_ids[:, cols], labels[:, cols], local.to(input_ids.device)


def kda_context_parallel(attn: KimiDeltaAttention, x: Tensor, cu_seqlens: Tensor, group=None) -> Tensor:
    """`attn(x_full, cu_seqlens=cu_seqlens, pos=...)` restricted to this rank's slice x [B, L, D] of every row
    (rows of R L tokens, `cu_seqlens` the global packing over the B R L tokens) -> [B, L, D] (see the module
    docstring): the torch fold (`kda_context_parallel_torch`, the reference; its local kernel is the device's KDA
    backend, fla on CUDA). With OPENK3_CP_KDA=fla (CUDA), fla's own `cp_context` runs the delta rule instead
    (`kda_context_parallel_fla`).
    NOTE: opt-in until tests/parallel/test_gpu.py's comparison of the two has passed on 2 GPUs: it was written from
    fla 0.6's source, and has run on one H200 only (world 1, twentieth session: the output and the input and
    parameter gradients equal to the torch fold's)."""
    choice = os.environ.get("OPENK3_CP_KDA", "torch")
    if choice not in ("torch", "fla"):
        raise ValueError(f"OPENK3_CP_KDA={choice!r}: expected torch or fla")
    if choice == "fla":
        return kda_context_parallel_fla(attn, x, cu_seqlens, group)
    return kda_context_parallel_torch(attn, x, cu_seqlens, group)


def _kda_inputs(attn: KimiDeltaAttention, x: Tensor, cu_seqlens: Tensor, group):
    """The delta rule's inputs of this rank's slice (conv with the previous rank's halo), and `_segment`'s view."""
    if x.dim() != 3:
        raise ValueError(f"context parallelism splits packed rows: x must be [B, L, D], got {tuple(x.shape)}")
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    B, L, W = x.shape[0], x.shape[1], attn.W
    if L < W - 1:
        raise ValueError(f"each rank needs at least the conv halo of {W - 1} tokens, got {L}")
    segment = _segment(cu_seqlens, B, L, rank, R)
    qkv = attn.qkv_proj(x)
    # the W-1 conv inputs before my slice: the previous rank's last ones (masked by pos where a document starts)
    halos = all_gather(qkv[:, -(W - 1):], R, group)
    # NOTE: every gathered tensor must stay in every rank's graph (rank 0's halo as zeros), else that rank skips
    # the all-gather's backward collective while the others wait in it
    tail = halos[rank - 1] if rank > 0 else 0 * halos[-1]
    return attn.kernel_inputs(x, qkv, segment[0].to(x.device), tail), segment


def kda_context_parallel_torch(attn: KimiDeltaAttention, x: Tensor, cu_seqlens: Tensor, group=None) -> Tensor:
    """`kda_context_parallel` by the torch fold of the module docstring, around the device's KDA chunk kernel."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    B, L, H, K = x.shape[0], x.shape[1], attn.H, attn.K
    (q, k, v, g, beta), (_, local_cu, continues, first_piece) = _kda_inputs(attn, x, cu_seqlens, group)
    device = x.device

    # one kernel call on [v | 0]: the state's extra K columns start at I for a row's continuing first piece
    pieces = local_cu.numel() - 1
    init = q.new_zeros(pieces, H, K, K + K, dtype=torch.float32)
    init[first_piece[continues[:, rank]], :, :, K:] = torch.eye(K, device=device)
    v_aug = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1)
    kernel = select_kda_backend(device).chunk
    o_aug, final = kernel(*(t.flatten(0, 1)[None] for t in (q, k, v_aug, g, beta)), scale=K ** -0.5,
                          initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
                          cu_seqlens=local_cu.to(device))
    o_zero, readout = o_aug.float().view(B, L, H, K + K).split([K, K], dim=-1)  # readout_t = X_t^T q_t

    # all-gather every row's [S_ext | M] of its last piece (fp32, [B, H, K, V + K]) and fold the earlier ones
    last_piece = torch.cat([first_piece[1:] - 1, torch.tensor([pieces - 1])])
    pairs = all_gather(final[last_piece.to(device)], R, group)
    S_in = final.new_zeros(B, H, K, K)
    for j in range(R):
        S_ext, M = pairs[j].split([K, K], dim=-1)
        S_in = M @ S_in + S_ext if j < rank else S_in + 0 * pairs[j][..., :K]  # (the NOTE above)
    o = o_zero + torch.einsum("bthk,bhkv->bthv", readout, S_in)  # X_t = 0 after a document start
    return attn.output(o.to(q.dtype), x)


def kda_context_parallel_fla(attn: KimiDeltaAttention, x: Tensor, cu_seqlens: Tensor, group=None) -> Tensor:
    """`kda_context_parallel` with fla's own context parallelism for the delta rule (CUDA, NCCL; fla >= 0.6):
    `chunk_kda(..., cp_context=build_cp_context(row's global cu_seqlens, group))` computes each rank's (M, S_ext)
    over its chunks, all-gathers them, folds the earlier ranks' into its initial state and mirrors that in backward,
    inside its Triton kernels. The conv and its halo stay openk3's (fla's CP conv is its own conv layer).
    NOTE: fla's contiguous layout is one packed row split over the group, so each of the B rows is one call.
    NOTE: the backend is chosen first, as every fla caller in openk3 does, so that fla runs with openk3's kernel
    configs and its autotuning cut to a few candidates (ops/kda/tuned.py). Without that, tests/parallel/test_gpu.py's
    worker, fla's first use in its process, autotuned 12 kernels over every candidate (222 timed configs) for 235 s
    of its 246 s on the H200, beside other GPU tests (twentieth session); the test gives the worker 300 s, and under
    the 6-worker GPU suite (nineteenth session) it did not finish in them. Choosing the backend first: 51 s."""
    backend = select_kda_backend(x.device)
    if backend.name != "fla":
        raise RuntimeError(f"fla's context parallelism (OPENK3_CP_KDA=fla) needs fla's KDA backend; here: {backend}")
    from fla.ops.cp import build_cp_context
    from fla.ops.kda import chunk_kda

    from openk3.ops.kda.backend import _fla_arguments

    R = dist.get_world_size(group)
    B, L, K = x.shape[0], x.shape[1], attn.K
    (q, k, v, g, beta), _ = _kda_inputs(attn, x, cu_seqlens, group)
    cu = cu_seqlens.to(torch.long).cpu()
    T = R * L
    outs = []
    for b in range(B):
        row = cu[(cu >= b * T) & (cu <= (b + 1) * T)] - b * T  # this row's documents over its T tokens
        context = build_cp_context(row.to(x.device), group=group or dist.group.WORLD, cu_seqlens_cpu=row)
        args = _fla_arguments(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], K ** -0.5, None, False,
                              True, None)
        o, _ = chunk_kda(**args, cp_context=context)
        outs.append(o)
    return attn.output(torch.cat(outs).to(q.dtype), x)


def mla_context_parallel(attn: GatedMLA, x: Tensor, cu_seqlens: Tensor, group=None) -> Tensor:
    """`attn(x_full, mask=the packed block-diagonal causal mask)` restricted to this rank's slice x [B, L, D] of
    every row."""
    if x.dim() != 3:
        raise ValueError(f"context parallelism splits packed rows: x must be [B, L, D], got {tuple(x.shape)}")
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    B, L = x.shape[:2]
    _segment(cu_seqlens, B, L, rank, R)  # validates the packing
    lat = torch.cat(all_gather(attn.latent(x), R, group), dim=1)  # [B, T, r + rope]
    o = attn.attend_expanded(attn.query(x), lat, packed_mask(cu_seqlens, B, L, rank, R).to(x.device), causal=False)
    return attn.output(o, x)


def packed_mask(cu_seqlens: Tensor, B: int, L: int, rank: int, world: int) -> Tensor:
    """[B, 1, L, T] bool: which of its row's T = world L tokens each of this rank's L tokens attends to (same
    document, not later): the rows of the packed block-diagonal causal mask that belong to this rank."""
    T = L * world
    cu = cu_seqlens.to(torch.long).cpu()
    doc = torch.zeros(B * T, dtype=torch.long)
    doc[cu[1:-1]] = 1
    doc = doc.cumsum(0).view(B, T)
    rows = torch.arange(rank * L, (rank + 1) * L)
    cols = torch.arange(T)
    return ((doc[:, rows, None] == doc[:, None, :]) & (cols[None, None, :] <= rows[None, :, None]))[:, None]


class ContextParallel:
    """A model whose KDA and MLA layers run their context-parallel forms, applied from outside (torchtitan's way:
    the model never knows). `apply_context_parallel(model, group)` builds it.

        cp = apply_context_parallel(model, cp_group)
        ids, labels, cu = local_rows(batch.input_ids, batch.labels, batch.cu_seqlens, cp.rank, cp.world)
        with cp.packing(batch.cu_seqlens):      # this micro-batch's global packing, for forward AND backward
            model(ids, labels=labels, cu_seqlens=cu).loss.backward()

    Inside `packing` every token mixer ignores the packing the model derives from its local slice (its
    cu_seqlens / pos / mask only know the slice) and runs `kda_context_parallel` / `mla_context_parallel` with the
    global one. Outside it the mixers run their ordinary forward: validation, where every rank evaluates whole rows.
    Everything else in a decoder layer (norms, AttnRes, MoE) is per token and needs nothing.
    NOTE: the packing stays set through backward because activation checkpointing recomputes the mixers there."""

    def __init__(self, model, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.cu_seqlens: Tensor | None = None  # the global packing while inside `packing`
        for layer in model.model.layers:
            attn = layer.self_attn
            # an instance attribute shadows the class's forward; nn.Module.__call__ (and so FSDP2's and
            # checkpoint's hooks around it) runs it like the original
            attn.forward = self._kda_forward(attn) if isinstance(attn, KimiDeltaAttention) else self._mla_forward(attn)

    @contextlib.contextmanager
    def packing(self, cu_seqlens: Tensor):
        """Run the mixers context-parallel over rows packed as `cu_seqlens` (global, over the flattened B T
        tokens) inside the block."""
        self.cu_seqlens = cu_seqlens
        try:
            yield
        finally:
            self.cu_seqlens = None

    def _kda_forward(self, attn: KimiDeltaAttention):
        plain = attn.forward

        def forward(x: Tensor, cu_seqlens: Tensor | None = None, pos: Tensor | None = None, state=None,
                    keep_inputs: bool = False) -> Tensor:
            if self.cu_seqlens is None:
                return plain(x, cu_seqlens=cu_seqlens, pos=pos, state=state, keep_inputs=keep_inputs)
            if state is not None:
                raise ValueError("a decode cache cannot be combined with context parallelism")
            return kda_context_parallel(attn, x, self.cu_seqlens, self.group)
        return forward

    def _mla_forward(self, attn: GatedMLA):
        plain = attn.forward

        def forward(x: Tensor, mask: Tensor | None = None, state=None, absorb: bool | None = None,
                    varlen: tuple[Tensor, int] | None = None) -> Tensor:
            if self.cu_seqlens is None:
                return plain(x, mask=mask, state=state, absorb=absorb, varlen=varlen)
            if state is not None:
                raise ValueError("a decode cache cannot be combined with context parallelism")
            return mla_context_parallel(attn, x, self.cu_seqlens, self.group)
        return forward

    def mla_keys(self, attn: GatedMLA, x: Tensor) -> tuple[Tensor, Tensor] | None:
        """Inside `packing`: the whole rows' latents [B, T, r + rope] and this rank's mask rows [B, 1, L, T], what
        its queries attend to (QK-Clip's max logit needs every query-key pair); None outside."""
        if self.cu_seqlens is None:
            return None
        B, L = x.shape[:2]
        lat = torch.cat(all_gather(attn.latent(x), self.world, self.group), dim=1)
        return lat, packed_mask(self.cu_seqlens, B, L, self.rank, self.world).to(x.device)


def apply_context_parallel(model, group) -> ContextParallel:
    """Wrap every token mixer of `model` (a K3ForCausalLM) for context parallelism over `group`; see
    ContextParallel."""
    return ContextParallel(model, group)
