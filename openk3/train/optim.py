"""Optimisation for openk3 (spec section 5): Muon with Per-Head Muon, AdamW, the schedule, QK-Clip.

Which optimiser trains which parameter is decided by name and shape in `assign_param_groups`:

    group              optimiser  decay  parameters
    muon               Muon       yes    every other 2-D hidden matrix, incl. the router gate [E, D],
                                         and each expert's slice of the stacked experts.w1/w2/w3
    muon_kda_heads     Muon       yes    KDA q_proj, k_proj, v_proj, one block per head   [inferred]
    muon_mla_q_heads   Muon       yes    MLA q_b_proj (q_proj without q-LoRA), per head   [inferred]
    muon_mla_kv_heads  Muon       yes    MLA kv_b_proj, one [k_nope | v] block per head   [inferred]
    adamw_decay        AdamW      yes    embed_tokens, lm_head; the vision tower's input embedding
                                         (patch_embed.proj [D, 3, 14, 14], patch_embed.pos_emb [64, 64, D])
    adamw_no_decay     AdamW      no     norms, biases, A_log, dt_bias, conv1d filters, AttnRes
                                         vectors (*_res_norm, *_res_proj), anything 1-D

Choices (the spec names the two sets but not every border case):
- The router gate weight is a 2-D matrix acting on the hidden state, so Muon trains it, as Moonlight
  and K2 train every hidden matrix. The spec's AdamW list names gates' *biases*; the router's
  e_score_correction_bias is a buffer set by balance.py, not a parameter.
- Weight decay 0.1 on matrices (Muon groups, embeddings, lm_head); 0 on the AdamW vectors: decay
  would pull norm gains towards 0 instead of their init 1, and drag A_log / dt_bias, which set the
  KDA decay rates. Depthwise conv filters count as vectors here (4 taps per channel).
- Per-Head Muon [inferred]: a head block is the head's rows of the projection (head h owns rows
  [h dh, (h+1) dh)); for kv_b_proj that block holds the head's k_nope and v rows together. Other
  2-D matrices with head-shaped rows (f_b_proj, g_proj, b_proj) stay whole-matrix Muon.
- Muon and AdamW share one learning rate: the 0.2 sqrt(max(rows, cols)) scale makes Muon's update
  RMS match AdamW's (Moonlight, "Muon is Scalable for LLM Training"), which is its point.

Precision: parameters, gradients, momentum and AdamW moments stay in the parameter dtype (fp32
masters); Newton-Schulz runs in bf16, as Keller Jordan's Muon, Moonlight and torch.optim.Muon do.

Speed (issue #11): on plain tensors Muon's step is batched: one Newton-Schulz per block shape over every
parameter and group (`batch_plan`, cut at MAX_BATCH_BYTES), momentum, decay and update as torch._foreach_*
ops; `Muon(batched=False)` keeps the per-parameter step as the reference. AdamW takes torch's fused kernel
when every parameter is a plain CUDA tensor (`adamw_fused`).

Sharded parameters (FSDP2 DTensors, openk3/parallel/fsdp.py): Newton-Schulz needs each whole matrix
(or whole head block / expert slice). Each such parameter is assigned to one rank (`owners_by_cost`:
largest Newton-Schulz cost first, to the least-loaded rank), and `orthogonalize_sharded` moves the
work with two all-to-alls per step for all of them: every rank sends its rows of each update to the
parameter's owner, the owner orthogonalises the whole parameter, and sends every rank its rows of the
result back. So the Newton-Schulz FLOPs are divided by the world size (not repeated on every rank),
and each rank receives about one whole update's worth instead of all of them (an all-gather). The
updates travel in bf16, the dtype Newton-Schulz starts with: the bits are those of one process.
Momentum stays sharded. Expert stacks split by expert (FSDP2 rows of [E, F, D], or expert
parallelism) are the exception: each shard holds whole experts, so each rank orthogonalises its own,
with no exchange. AdamW and QK-Clip act elementwise (per row), so they work on the shards directly.
"""

import math
import re
from collections.abc import Mapping

import torch
from torch import Tensor, nn
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
# Cap of one batched Newton-Schulz's bf16 input (`batch_plan`). 512 MiB holds hundreds of matrices of the largest
# Muon shapes (341 expert slices of [512, 1536]), enough that launches no longer matter (kimi-linear-1.5b: 232 Muon
# tensors, 2287 matrices, 15 batches), while a batch's transient peak (about 5x the cap, 2.5 GiB) stays below what
# the per-parameter step already held: every fp32 update at once, 5.6 GB for that model's 1.39e9 Muon parameters.
# [inferred: counted, not measured on a GPU]
MAX_BATCH_BYTES = 512 * 2**20


# --------------------------------------------------------------------------------------------
# Muon
# --------------------------------------------------------------------------------------------

def orthogonalize(m_BRC: Tensor, steps: int = NS_STEPS) -> Tensor:
    """Approximate U V^T for each matrix of a batch (U S V^T its SVD), in bf16: [B, R, C] -> [B, R, C].

    Quintic Newton-Schulz X <- a X + (b X X^T + c (X X^T)^2) X with (a, b, c) = NS_COEFFICIENTS,
    started from X / ||X||_F (so every singular value is <= 1). The coefficients trade exact
    convergence for speed: after 5 steps the singular values sit roughly in [0.68, 1.14] (the
    tests see that on random matrices), which Muon tolerates. Wide orientation (R <= C) keeps the Gram matrix X X^T the small one.
    """
    a, b, c = NS_COEFFICIENTS
    x_BRC = m_BRC.bfloat16()
    tall = x_BRC.shape[-2] > x_BRC.shape[-1]
    if tall:
        x_BRC = x_BRC.mT
    x_BRC = x_BRC / x_BRC.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram_BRR = x_BRC @ x_BRC.mT
        poly_BRR = torch.baddbmm(gram_BRR, gram_BRR, gram_BRR, beta=b, alpha=c)
        x_BRC = torch.baddbmm(x_BRC, poly_BRR, x_BRC, beta=a)
    return x_BRC.mT if tall else x_BRC


def rms_match_scale(rows: int, cols: int) -> float:
    """0.2 sqrt(max(rows, cols)): an orthogonal [rows, cols] matrix has RMS 1/sqrt(max(rows, cols)),
    so this gives Muon's update the RMS 0.2 of a typical AdamW update (Moonlight's rule)."""
    return 0.2 * math.sqrt(max(rows, cols))


def matrix_blocks(x: Tensor, head_dim: int | None) -> Tensor:
    """View a Muon parameter (or its gradient) as the batch [B, R, C] of matrices Muon orthogonalises.

    2-D [R, C], head_dim None  -> [1, R, C]          the whole matrix
    2-D [H*dh, C], head_dim dh -> [H, dh, C]         Per-Head Muon: head h owns rows [h dh, (h+1) dh)
    3-D [E, F, D]              -> [E, F, D]          stacked experts: each expert's slice
    """
    if x.ndim == 3 and head_dim is None:
        return x
    if x.ndim != 2:
        raise ValueError(f"Muon trains 2-D matrices or 3-D stacks of them (without head_dim), "
                         f"got shape {tuple(x.shape)} with head_dim={head_dim}")
    if head_dim is None:
        return x[None]
    rows, cols = x.shape
    if head_dim <= 0 or rows % head_dim:
        raise ValueError(f"head_dim={head_dim} must divide the {rows} rows of a per-head matrix "
                         f"of shape {tuple(x.shape)}")
    return x.view(rows // head_dim, head_dim, cols)


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update, applied to each matrix of a batch (expert slices, head blocks).

    Per parameter, with momentum mu, learning rate lr and weight decay wd (a group setting each):

        buf    <- mu buf + (1 - mu) grad                    momentum as an EMA (torch's form)
        update =  (1 - mu) grad + mu buf                    Nesterov
        O      =  orthogonalize(matrix_blocks(update))      per block, see `matrix_blocks`
        p      <- (1 - lr wd) p - lr 0.2 sqrt(max(R, C)) O  R, C: the shape of one block

    For a plain 2-D matrix this equals torch.optim.Muon(adjust_lr_fn="match_rms_adamw", nesterov=True)
    step for step. What K3 adds is the group key `head_dim` (Per-Head Muon: each head's row block
    is orthogonalised on its own, so heads with large gradients do not dominate the update of the
    others) and 3-D expert stacks. [inferred] A head block's scale uses the block's own shape,
    0.2 sqrt(max(dh, C)): that keeps the update RMS at 0.2 in every block, as for whole matrices.
    The EMA form of momentum differs from Moonlight's mu buf + grad only by the factor (1 - mu),
    which orthogonalisation removes.

    batched (default): plain (non-DTensor) parameters take `_step_batched`, one Newton-Schulz per block shape
    (R, C) over every group, cut at max_batch_bytes of bf16 input (`batch_plan`, MAX_BATCH_BYTES); issue #11: the
    per-parameter step spent 203-229 ms of an H200 step on kimi-linear-1.5b, in thousands of small launches (the
    batched one 81 ms).
    batched=False is the per-parameter step, the reference the tests compare it with. DTensor parameters
    (FSDP2, expert parallelism) always take the per-parameter path with its sharded Newton-Schulz.
    """

    def __init__(self, params, lr: float, weight_decay: float = 0.1, momentum: float = 0.95,
                 head_dim: int | None = None, batched: bool = True, max_batch_bytes: int = MAX_BATCH_BYTES):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if max_batch_bytes <= 0:
            raise ValueError(f"max_batch_bytes must be > 0, got {max_batch_bytes}")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "head_dim": head_dim}
        super().__init__(params, defaults)
        # not group keys: a batch mixes groups, and the state dict stays the per-parameter step's
        self.batched, self.max_batch_bytes = batched, max_batch_bytes
        for group in self.param_groups:
            for p in group["params"]:
                matrix_blocks(torch.empty(p.shape, device="meta"), group["head_dim"])  # shape check only (p may be sharded)

    def __getstate__(self) -> dict:
        # torch.optim pickles (and deep-copies) only defaults, state and param_groups
        return {**super().__getstate__(), "batched": self.batched, "max_batch_bytes": self.max_batch_bytes}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = []  # (parameter, group, update): every update first, so the sharded ones travel together
        plain = []  # (parameter, group): the plain tensors of a batched step
        for group in self.param_groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                if self.batched and not isinstance(p.grad, DTensor):
                    plain.append((p, group))
                    continue
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                todo.append((p, group, p.grad.lerp(buf, momentum)))
        sharded = [i for i, (_, group, u) in enumerate(todo)
                   if isinstance(u, DTensor) and not _whole_matrices_per_shard(u, group["head_dim"])]
        orthogonal = dict(zip(sharded, orthogonalize_sharded([todo[i][2] for i in sharded],
                                                             [todo[i][1]["head_dim"] for i in sharded])))
        for i, (p, group, update) in enumerate(todo):
            head_dim = group["head_dim"]
            if i in orthogonal:
                o = orthogonal[i]
            elif isinstance(update, DTensor):
                local = update.to_local()  # an expert stack split by expert: each rank's experts are whole
                o_BRC = orthogonalize(local) if local.shape[0] else local
                o = DTensor.from_local(o_BRC, update.device_mesh, update.placements, run_check=False,
                                       shape=update.shape, stride=update.stride())  # shards may be uneven
            else:
                o = orthogonalize(matrix_blocks(update, head_dim)).reshape(update.shape)
            decay, alpha = step_factors(group, *block_shape(update.shape, head_dim))
            p.mul_(decay)
            p.add_(o, alpha=alpha)
        self._step_batched(plain)
        return loss

    def _step_batched(self, todo: list[tuple[Tensor, dict]]) -> None:
        """The step of these plain-tensor parameters (the per-parameter one's arithmetic, bit for bit on the CPU),
        batched: their matrix blocks grouped by shape and cut into batches by `batch_plan`; per batch, the momentum
        and Nesterov update with `torch._foreach_*` written straight into one [B, R, C] tensor, ONE `orthogonalize`,
        the result copied back into it (so a batch's transient memory is one fp32 copy plus Newton-Schulz's bf16
        ones), then weight decay and the scaled update with `_foreach_mul_` / `_foreach_add_`.

        A parameter whose blocks straddle two batches is updated through views of those blocks, each exactly once."""
        grads = [matrix_blocks(p.grad, group["head_dim"]) for p, group in todo]
        bufs = [matrix_blocks(self.state[p]["momentum_buffer"], group["head_dim"]) for p, group in todo]
        params = [matrix_blocks(p, group["head_dim"]) for p, group in todo]
        keys = [(tuple(g.shape[1:]), g.dtype, g.device) for g in grads]
        for batch in batch_plan([(key, g.shape[0]) for key, g in zip(keys, grads)], self.max_batch_bytes):
            rows, cols = keys[batch[0][0]][0]
            x_BRC = grads[batch[0][0]].new_empty((sum(stop - start for _, start, stop in batch), rows, cols))
            update = list(x_BRC.split([stop - start for _, start, stop in batch]))
            grad, buf, param = ([t[i][start:stop] for i, start, stop in batch] for t in (grads, bufs, params))
            groups = [todo[i][1] for i, _, _ in batch]
            for momentum, js in _positions_by([g["momentum"] for g in groups]).items():
                # the EMA and Nesterov of the per-parameter step: buf.lerp_(grad, 1 - mu); grad.lerp(buf, mu)
                torch._foreach_lerp_(_pick(buf, js), _pick(grad, js), 1 - momentum)
                torch._foreach_copy_(_pick(update, js), _pick(grad, js))
                torch._foreach_lerp_(_pick(update, js), _pick(buf, js), momentum)
            x_BRC.copy_(orthogonalize(x_BRC))
            for (decay, alpha), js in _positions_by([step_factors(g, rows, cols) for g in groups]).items():
                ps = _pick(param, js)
                # NOTE: torch 2.13's CPU _foreach_mul_ rounds a Python scalar to the tensors' dtype first: in bf16 a
                # decay of 0.999 is 1.0 (none) and 0.998 is 0.99609 (twice the decay). Narrower parameters take the
                # per-parameter step's mul_, which multiplies in fp32 opmath.
                wide = [p for p in ps if p.dtype in (torch.float32, torch.float64)]
                if wide:
                    torch._foreach_mul_(wide, decay)
                for p in ps:
                    if p.dtype not in (torch.float32, torch.float64):
                        p.mul_(decay)
                torch._foreach_add_(ps, _pick(update, js), alpha=alpha)


def step_factors(group: dict, rows: int, cols: int) -> tuple[float, float]:
    """(decay, alpha) of Muon's step p <- decay p + alpha O for a block of shape [rows, cols] in this param group:
    decay = 1 - lr wd, alpha = -lr 0.2 sqrt(max(rows, cols)) (see `Muon`)."""
    lr = group["lr"]
    return 1 - lr * group["weight_decay"], -lr * rms_match_scale(rows, cols)


def batch_plan(blocks: list[tuple[object, int]], max_batch_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Batches for one `orthogonalize` each. blocks[i] = (key, n): parameter i has n matrix blocks, key =
    ((R, C), dtype, device) of one block. Returns the batches as lists of (i, start, stop), parameter i's blocks
    [start, stop): each batch holds blocks of one key only, in parameter order, at most
    max(1, max_batch_bytes // (2 R C)) of them (2: the bf16 bytes Newton-Schulz works in), so a group of one key
    larger than that is cut into several batches, if need be inside a parameter.

    NOTE: max_batch_bytes bounds the bf16 input of one Newton-Schulz; a batch's peak is about 5x that (its fp32
    update 2x, Newton-Schulz's current and next bf16 iterate 2x, the Gram matrices), see MAX_BATCH_BYTES.
    """
    by_key: dict[object, list[tuple[int, int]]] = {}
    for i, (key, n) in enumerate(blocks):
        by_key.setdefault(key, []).append((i, n))
    batches = []
    for (shape, _, _), members in by_key.items():
        cap = max(1, max_batch_bytes // (2 * shape[0] * shape[1]))
        batch, size = [], 0
        for i, n in members:
            start = 0
            while start < n:
                stop = min(n, start + cap - size)
                batch.append((i, start, stop))
                size += stop - start
                start = stop
                if size == cap:
                    batches.append(batch)
                    batch, size = [], 0
        if batch:
            batches.append(batch)
    return batches


def _positions_by(values: list) -> dict[object, list[int]]:
    """{value: the positions holding it}, in order of first appearance."""
    positions: dict[object, list[int]] = {}
    for j, v in enumerate(values):
        positions.setdefault(v, []).append(j)
    return positions


def _pick(xs: list, js: list[int]) -> list:
    return [xs[j] for j in js]


def block_shape(shape: torch.Size, head_dim: int | None) -> tuple[int, int]:
    """(rows, cols) of one of the matrices `matrix_blocks` cuts a parameter of this shape into."""
    return tuple(matrix_blocks(torch.empty(shape, device="meta"), head_dim).shape[-2:])


def newton_schulz_cost(shape: torch.Size, head_dim: int | None) -> int:
    """Multiply-adds of `orthogonalize` on a parameter of this shape (its blocks), per iteration: with r <= c the
    block's short and long side, X X^T (r r c), the quintic's Gram square (r r r) and its product with X (r r c)."""
    blocks = matrix_blocks(torch.empty(shape, device="meta"), head_dim)
    r, c = sorted(blocks.shape[-2:])
    return blocks.shape[0] * r * r * (2 * c + r)


def owners_by_cost(costs: list[int], world: int) -> list[int]:
    """The rank that orthogonalises each matrix: in decreasing cost (ties in list order), each goes to the rank
    with the least work so far (ties: the lowest rank). Deterministic, so every rank computes the same plan."""
    load = [0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owners[i] = min(range(world), key=lambda r: load[r])
        load[owners[i]] += costs[i]
    return owners


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows each rank holds of a Shard(0) DTensor with `rows` rows (torch.chunk's split: ceil(rows / world) each
    while they last, so the last ranks may hold fewer or none)."""
    per = -(-rows // world)
    return [max(0, min(per, rows - r * per)) for r in range(world)]


def orthogonalize_sharded(updates: list[DTensor], head_dims: list[int | None]) -> list[DTensor]:
    """`orthogonalize(matrix_blocks(u.full_tensor(), head_dim))` of each row-sharded update, laid out like u, with
    each parameter orthogonalised on one rank only (see the module docstring). Collective over the updates' 1-D
    mesh (FSDP2's): every rank calls it with the same parameters in the same order. Two all-to-alls in all."""
    if not updates:
        return []
    mesh = updates[0].device_mesh
    for u in updates:
        if u.device_mesh is not mesh or mesh.ndim != 1 or tuple(u.placements) != (Shard(0),):
            raise ValueError(f"Muon's sharded Newton-Schulz takes FSDP2's layout, Shard(0) over one 1-D mesh; got "
                             f"{tuple(u.placements)} on a {u.device_mesh.ndim}-D mesh")
    group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    owners = owners_by_cost([newton_schulz_cost(u.shape, h) for u, h in zip(updates, head_dims)], world)
    rows = [shard_rows(u.shape[0], world) for u in updates]
    row_numel = [u.shape[1:].numel() for u in updates]
    local = [u.to_local() for u in updates]
    for u, n, x in zip(updates, rows, local):
        if x.shape[0] != n[me]:  # NOTE: shard_rows must agree with DTensor's own split
            raise RuntimeError(f"a Shard(0) update of shape {tuple(u.shape)} holds {x.shape[0]} rows on rank {me}, "
                               f"expected {n[me]}")
    mine = [i for i, o in enumerate(owners) if o == me]

    # 1. my rows of every update go to its owner; I receive every rank's rows of mine (bf16: what NS starts from)
    send = torch.cat([local[i].bfloat16().flatten() for d in range(world) for i in range(len(updates))
                      if owners[i] == d])
    send_sizes = [sum(rows[i][me] * row_numel[i] for i in range(len(updates)) if owners[i] == d)
                  for d in range(world)]
    recv_sizes = [sum(rows[i][s] * row_numel[i] for i in mine) for s in range(world)]
    recv = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    pieces = [list(chunk.split([rows[i][s] * row_numel[i] for i in mine]))
              for s, chunk in enumerate(recv.split(recv_sizes))]
    results = {}
    for k, i in enumerate(mine):
        full = torch.cat([pieces[s][k] for s in range(world)]).view(updates[i].shape)
        results[i] = orthogonalize(matrix_blocks(full, head_dims[i])).reshape(full.shape)

    # 2. every rank's rows of my results go back to it
    send = torch.cat([results[i][sum(rows[i][:d]):sum(rows[i][:d + 1])].flatten() for d in range(world)
                      for i in mine]) if mine else send.new_empty(0)
    send_sizes = [sum(rows[i][d] * row_numel[i] for i in mine) for d in range(world)]
    recv_sizes = [sum(rows[i][me] * row_numel[i] for i in range(len(updates)) if owners[i] == s)
                  for s in range(world)]
    recv = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    out = [None] * len(updates)
    for s, chunk in enumerate(recv.split(recv_sizes)):
        from_s = [i for i in range(len(updates)) if owners[i] == s]
        for i, piece in zip(from_s, chunk.split([rows[i][me] * row_numel[i] for i in from_s])):
            out[i] = DTensor.from_local(piece.view(local[i].shape), mesh, updates[i].placements, run_check=False,
                                        shape=updates[i].shape, stride=updates[i].stride())
    return out


# --------------------------------------------------------------------------------------------
# Parameter groups and the combined optimiser
# --------------------------------------------------------------------------------------------

def _whole_matrices_per_shard(x: DTensor, head_dim: int | None) -> bool:
    """Whether every shard of x holds whole Muon matrices: a 3-D expert stack [E, F, D] split only along E (FSDP2
    rows or expert parallelism). Then each rank orthogonalises its own experts and nothing is gathered."""
    return x.ndim == 3 and head_dim is None and all(
        pl.is_replicate() or (pl.is_shard() and pl.dim == 0) for pl in x.placements)


def like_placements(full: Tensor, like: DTensor) -> DTensor:
    """The whole tensor `full` (the same on every rank) as a DTensor laid out like `like`: each rank keeps its own
    shard, a local slice (Replicate -> Shard needs no communication)."""
    return DTensor.from_local(full, like.device_mesh, [Replicate()] * like.device_mesh.ndim,
                              run_check=False).redistribute(like.device_mesh, like.placements)


# Per-Head Muon roles; `build_optimizer(head_dims=...)` gives the rows each head owns in each.
PER_HEAD_ROLES = {
    "kda": "KDA q/k/v_proj: head_dim (128 for K3)",
    "mla_q": "MLA q_b_proj or q_proj: qk_nope_head_dim + qk_rope_head_dim (192 for K3)",
    "mla_kv": "MLA kv_b_proj: qk_nope_head_dim + v_head_dim (256 for K3)",
}
_HEAD_GROUPS = {f"muon_{role}_heads": role for role in PER_HEAD_ROLES}
_EXPERT_STACK = re.compile(r"(^|\.)experts\.w[123]$")


def _per_head_role(name: str, names: set[str]) -> str | None:
    """Which Per-Head Muon role a 2-D weight plays, from its name; None if it is no Q/K/V projection.

    NOTE: KDA and MLA-without-q-LoRA both call their query weight `self_attn.q_proj`; an MLA layer
    is recognised by its sibling `kv_b_proj`.
    """
    module, _, param = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if param != "weight":
        return None
    if proj == "q_b_proj":
        return "mla_q"
    if proj == "kv_b_proj":
        return "mla_kv"
    if proj == "q_proj":
        return "mla_q" if f"{parent}.kv_b_proj.weight" in names else "kda"
    if proj in ("k_proj", "v_proj"):
        return "kda"
    return None


def param_group_name(name: str, shape: torch.Size, names: set[str], per_head: bool) -> str:
    """The group (see the module docstring's table) of the parameter `name` of this shape.

    names: every trainable parameter name of the model (to tell MLA's q_proj from KDA's).
    """
    module, _, param = name.rpartition(".")
    module_leaf = module.rpartition(".")[2]
    if module_leaf in ("embed_tokens", "lm_head") or ".patch_embed." in f".{module}.":
        return "adamw_decay"
    if (len(shape) < 2 or param in ("bias", "A_log", "dt_bias") or module_leaf.endswith("norm")
            or module_leaf.endswith(("_res_norm", "_res_proj")) or module_leaf.endswith("conv1d")):
        return "adamw_no_decay"
    if len(shape) == 3 and _EXPERT_STACK.search(name):
        return "muon"
    if len(shape) == 2:
        role = _per_head_role(name, names) if per_head else None
        return "muon" if role is None else f"muon_{role}_heads"
    raise ValueError(f"no optimiser rule for parameter {name} of shape {tuple(shape)}: only 2-D "
                     f"matrices, experts.w1/w2/w3 stacks and the AdamW names have one")


def assign_param_groups(model: nn.Module,
                        per_head: bool = True) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """{group name: [(parameter name, parameter), ...]} for every trainable parameter of `model`."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = {n for n, _ in named}
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in named:
        groups.setdefault(param_group_name(name, p.shape, names, per_head), []).append((name, p))
    return groups


class MuonAdamW:
    """The one optimiser object the training loop holds: a Muon and an AdamW over disjoint groups.

    param_groups lists every group of both (Muon's first); each carries "name" and "base_lr", and
    `set_lr_scale(f)` sets lr = base_lr * f in all of them (the schedule's multiplier).
    `state_dict()` / `load_state_dict()` round-trip both optimisers exactly, and refuse a state whose
    parameter names differ from this model's. `optimizers` is the tuple torch.distributed.checkpoint
    (get_optimizer_state_dict) accepts.
    """

    def __init__(self, muon: Muon | None, adamw: torch.optim.AdamW | None):
        self._by_name = {name: opt for name, opt in (("muon", muon), ("adamw", adamw))
                         if opt is not None}
        if not self._by_name:
            raise ValueError("MuonAdamW needs at least one of muon and adamw")
        self.optimizers = tuple(self._by_name.values())

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def set_lr_scale(self, multiplier: float) -> None:
        for group in self.param_groups:
            group["lr"] = group["base_lr"] * multiplier

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self._by_name.items()}

    def load_state_dict(self, state_dict: Mapping) -> None:
        if set(state_dict) != set(self._by_name):
            raise ValueError(f"optimiser state holds {sorted(state_dict)}, this optimiser is "
                             f"{sorted(self._by_name)}")
        for name, opt in self._by_name.items():
            saved = [g["param_names"] for g in state_dict[name]["param_groups"]]
            current = [g["param_names"] for g in opt.param_groups]
            if saved != current:
                raise ValueError(f"{name} state was saved for parameters {saved}, "
                                 f"this model has {current}")
            opt.load_state_dict(state_dict[name])


def model_head_dims(config) -> dict[str, int]:
    """`build_optimizer`'s head_dims for a K3Config: rows per head of KDA, MLA's q and MLA's kv projections."""
    return {"kda": config.linear_attn_config.head_dim, "mla_q": config.qk_nope_head_dim + config.qk_rope_head_dim,
            "mla_kv": config.qk_nope_head_dim + config.v_head_dim}


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    muon_momentum: float = 0.95, per_head: bool = True,
                    head_dims: Mapping[str, int] | None = None, muon_batched: bool = True) -> MuonAdamW:
    """Muon + AdamW over `model`'s trainable parameters, grouped as in the module docstring.

    head_dims: rows per head for each Per-Head Muon role present in the model, keys from
    PER_HEAD_ROLES, e.g. for K3 {"kda": 128, "mla_q": 192, "mla_kv": 256}. Needed when per_head.
    Every group starts at lr (its "base_lr"); AdamW uses betas and eps, and torch's fused kernel where
    `adamw_fused` says it applies. muon_batched: `Muon`'s batched step (False: the per-parameter reference).
    """
    groups = assign_param_groups(model, per_head)
    muon_groups, adamw_groups = [], []
    for group_name, named in groups.items():
        group = {"params": named, "name": group_name, "lr": lr, "base_lr": lr}
        if group_name == "muon":
            muon_groups.append({**group, "weight_decay": weight_decay, "head_dim": None})
        elif group_name in _HEAD_GROUPS:
            role = _HEAD_GROUPS[group_name]
            if head_dims is None or role not in head_dims:
                raise ValueError(f"per_head=True needs head_dims[{role!r}] ({PER_HEAD_ROLES[role]}) "
                                 f"for {named[0][0]}, got head_dims={head_dims}")
            muon_groups.append({**group, "weight_decay": weight_decay, "head_dim": head_dims[role]})
        else:
            decay = weight_decay if group_name == "adamw_decay" else 0.0
            adamw_groups.append({**group, "weight_decay": decay})
    muon = Muon(muon_groups, lr=lr, momentum=muon_momentum, batched=muon_batched) if muon_groups else None
    adamw_params = [p for group in adamw_groups for _, p in group["params"]]
    adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps,
                              fused=True if adamw_fused(adamw_params) else None) if adamw_groups else None
    return MuonAdamW(muon, adamw)


def adamw_fused(params: list[Tensor]) -> bool:
    """Whether `build_optimizer`'s AdamW takes torch's fused kernel (one launch for all parameters): when every
    parameter is a plain (non-DTensor) CUDA tensor. Otherwise torch's default stays: the for-loop on the CPU, where
    the trainer's bit-exact resume tests were measured, and whatever torch picks for DTensors (FSDP2).
    NOTE: a loaded optimizer state brings its own "fused" group setting, as torch.optim does."""
    return bool(params) and all(p.is_cuda and not isinstance(p, DTensor) for p in params)


# --------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------

def cosine_schedule(step: int, total_steps: int, warmup_frac: float = 0.01,
                    min_ratio: float = 0.1) -> float:
    """Learning-rate multiplier for the 0-based `step`: linear warmup, then cosine down to min_ratio.

    warmup = max(1, round(warmup_frac * total_steps)) steps, step s < warmup gets (s + 1) / warmup
    (so the first step already trains); then the cosine runs from 1 at s = warmup to min_ratio at
    s = total_steps - 1, the last step, and stays there after.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 0 <= warmup_frac < 1:
        raise ValueError(f"warmup_frac must be in [0, 1), got {warmup_frac}")
    if not 0 <= min_ratio <= 1:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
    warmup = max(1, round(warmup_frac * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------------------------
# QK-Clip
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def qk_clip_mla_(q_weight: Tensor, kv_b_weight: Tensor, max_logit_H: Tensor, tau: float, *,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int) -> Tensor:
    """QK-Clip (Kimi K2, "MuonClip") for one MLA layer, in place; returns gamma [H] fp32.

    q_weight:    q_b_proj (or q_proj) weight [H * (nope + rope), in]; head h's rows are
                 [q_nope (nope rows) | q_pe (rope rows)]
    kv_b_weight: kv_b_proj weight [H * (nope + v), kv_lora]; head h's rows are [k_nope | v]
    max_logit_H: each head's largest pre-softmax logit of the step (after the 1/sqrt(192) scale),
                 already max-reduced over all ranks
    tau:         the threshold (K2 used 100; K3's is unpublished)

    For each head with max_logit > tau, gamma = tau / max_logit (else 1), and as K2 describes it
    for MLA: q_nope and k_nope rows are scaled by sqrt(gamma), q_pe rows by gamma, and the shared
    k_pe (rows [kv_lora:] of kv_a_proj_with_mqa) is left alone, because scaling it would touch
    every head. Every logit of head h, q_nope.k_nope + q_pe.k_pe, is then multiplied by gamma_h,
    so its max lands exactly on tau. v rows are untouched. K2 applies this after the optimizer
    step and leaves the Muon momentum as it is.
    KDA layers need none of this: their q and k are L2-normalised, which bounds the logits.
    """
    H = max_logit_H.numel()
    qk_dim, kv_dim = qk_nope_head_dim + qk_rope_head_dim, qk_nope_head_dim + v_head_dim
    if q_weight.ndim != 2 or q_weight.shape[0] != H * qk_dim:
        raise ValueError(f"q_weight must be [H * (nope + rope), in] = [{H * qk_dim}, in] for {H} heads, "
                         f"got {tuple(q_weight.shape)}")
    if kv_b_weight.ndim != 2 or kv_b_weight.shape[0] != H * kv_dim:
        raise ValueError(f"kv_b_weight must be [H * (nope + v), kv_lora] = [{H * kv_dim}, kv_lora] "
                         f"for {H} heads, got {tuple(kv_b_weight.shape)}")
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    max_logit_H = max_logit_H.float().flatten()
    gamma_H = torch.where(max_logit_H > tau, tau / max_logit_H, torch.ones_like(max_logit_H))
    sqrt_gamma_H1 = gamma_H.sqrt()[:, None]
    # one multiplier per weight row, so that a row-sharded (FSDP2) weight is scaled shard by shard
    q_rows = torch.cat([sqrt_gamma_H1.expand(H, qk_nope_head_dim),
                        gamma_H[:, None].expand(H, qk_rope_head_dim)], dim=1).reshape(-1, 1)
    kv_rows = torch.cat([sqrt_gamma_H1.expand(H, qk_nope_head_dim),
                         torch.ones(H, v_head_dim, device=gamma_H.device)], dim=1).reshape(-1, 1)
    for weight, rows in ((q_weight, q_rows), (kv_b_weight, kv_rows)):
        rows = rows.to(weight.dtype)
        weight.mul_(like_placements(rows.expand(weight.shape).contiguous(), weight)
                    if isinstance(weight, DTensor) else rows)
    return gamma_H
