"""Expert parallelism: MoonEP balanced dispatch (K3_SPEC section 8) and the plain all-to-all baseline.

    y_TD = ep_moe_experts(x_TD, topk_idx_TK, topk_w_TK, w1_home, w2_home, w3_home, act, group=ep_group)

Same signature and result as `openk3.ops.moe.moe_experts_loop` (the reference) on this rank's tokens, except that
the expert stacks are this rank's *home* experts only: R ranks of the EP group each own E/R consecutive experts
(rank r owns experts [r E/R, (r+1) E/R)). Every rank must route the same number S of tokens with the same K.

MoonEP, step by step (one forward; every step but the collectives is computed identically on every rank):
  1. counts [R, E]: how many of each rank's S*K (token, expert) pairs chose each expert: ONE all-gather of a
     fixed-size [E] histogram (its column sums are the global load histogram).
  2. `plan_slots`: every rank gets exactly S*K slots. An expert's load first fills its home rank; what overflows
     the home rank's S*K goes to replicas on the ranks with the most free slots (largest first). The pairs of
     expert e are numbered globally (by source rank, then by position), and each piece of the plan takes a
     consecutive run of those numbers, so each source knows where each of its pairs goes without asking.
  3. replica weights: a home rank sends the weights of its replicated experts to the replica ranks (all-to-all).
  4. dispatch: all-to-all of the token rows; every rank receives exactly S*K rows (a fixed-size buffer), already
     grouped by local expert slot (home experts, then replicas).
  5. the local experts run (`moe_experts`, the grouped or loop backend) on their rows.
  6. combine: the reverse all-to-all; the source weights each pair's output by its routing weight and sums the K.
All collectives are torch.distributed's differentiable functional ones, so backward is the mirror image: the
gradient of a replica's weights returns through the reverse of step 3 and is summed into its home expert's
gradient, before any optimizer sees it.

`plan="plain"` is the unbalanced baseline: every pair goes to its home rank, so a rank receives as many rows as
its experts were chosen (variable, up to R S K). It uses the same counts and the same code path.

In the trainer (`openk3 train --nproc N --ep M`), `apply_expert_parallel` swaps every MoE's `Experts` for
`ExpertParallelExperts`: its stacks become DTensors holding this rank's home experts (Shard(0) over the mesh's
"ep" dimension, Replicate over "dp_rep"), FSDP leaves them alone, and `finish_expert_gradients_` turns their
gradients into the global-batch mean that FSDP's average gives the other parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from openk3.model.model import Experts, K3ForCausalLM
from openk3.ops import moe_experts
from openk3.ops.moe import Activation, WeightFn

PLANS = ("moonep", "plain")


@dataclass(frozen=True)
class Piece:
    """`count` consecutive pairs of expert `expert` (global numbers [start, start + count)) computed on `rank`."""

    expert: int
    rank: int
    start: int
    count: int


@dataclass(frozen=True)
class SlotPlan:
    """Where every (token, expert) pair of one MoE forward is computed.

    pieces:  sorted by (expert, start); an expert's pieces cover [0, its global load)
    slots:   per rank, the experts it computes, in its buffer order: its home experts, then its replicas
             (sorted by home rank, then expert)
    received: per rank, the number of rows it receives (S*K for every rank under MoonEP)"""

    pieces: list[Piece]
    slots: list[list[int]]
    received: list[int]

    def replicas(self, rank: int, experts_per_rank: int) -> list[int]:
        return self.slots[rank][experts_per_rank:]


def home_rank(expert: int, experts_per_rank: int) -> int:
    return expert // experts_per_rank


def plan_slots(counts_RE: Tensor, plan: str = "moonep") -> SlotPlan:
    """The slot plan from every rank's per-expert counts [R, E] (see the module docstring)."""
    if plan not in PLANS:
        raise ValueError(f"plan={plan!r}: expected one of {PLANS}")
    R, E = counts_RE.shape
    if E % R:
        raise ValueError(f"{E} experts cannot be split evenly over {R} expert-parallel ranks")
    per = E // R
    load = [int(x) for x in counts_RE.sum(0)]
    per_rank_pairs = counts_RE.sum(1)
    if plan == "plain":
        pieces = [Piece(e, home_rank(e, per), 0, load[e]) for e in range(E) if load[e]]
    else:
        if not bool((per_rank_pairs == per_rank_pairs[0]).all()):
            raise ValueError(f"MoonEP needs the same S*K pairs on every rank, got {per_rank_pairs.tolist()}")
        capacity = int(per_rank_pairs[0])
        used = [0] * R
        pieces, overflow = [], []
        for e in range(E):  # home ranks first, in expert order
            h = home_rank(e, per)
            n = min(load[e], capacity - used[h])
            if n:
                pieces.append(Piece(e, h, 0, n))
            used[h] += n
            if load[e] > n:
                overflow.append((e, n))
        for e, start in overflow:  # the rest to the ranks with the most free slots (ties: the lowest rank)
            while start < load[e]:
                q = max(range(R), key=lambda r: (capacity - used[r], -r))
                n = min(load[e] - start, capacity - used[q])
                pieces.append(Piece(e, q, start, n))
                used[q] += n
                start += n
    pieces.sort(key=lambda p: (p.expert, p.start))
    slots = [list(range(r * per, (r + 1) * per)) for r in range(R)]
    for r in range(R):
        slots[r] += sorted({p.expert for p in pieces if p.rank == r and home_rank(p.expert, per) != r},
                           key=lambda e: (home_rank(e, per), e))
    received = [sum(p.count for p in pieces if p.rank == r) for r in range(R)]
    return SlotPlan(pieces, slots, received)


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def ep_moe_experts(x_TD: Tensor, topk_idx_TK: Tensor, topk_w_TK: Tensor, w1_EFD: Tensor, w2_EDF: Tensor,
                   w3_EFD: Tensor, act: Activation, weight_fn: WeightFn | None = None, *, group=None,
                   plan: str = "moonep", stats: dict | None = None) -> Tensor:
    """Routed experts over the expert-parallel `group` (see the module docstring). w1/w2/w3: this rank's home
    experts [E/R, ...]; topk_idx_TK holds global expert ids in [0, E). Returns y_TD [T, D] for this rank's tokens.
    stats, when given, gets "received" (rows each rank computes) and "replicas" (replica experts per rank)."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    per = w1_EFD.shape[0]
    E = per * R
    T, K = topk_idx_TK.shape
    device = x_TD.device

    # 1. every rank's per-expert counts: one all-gather of a fixed-size histogram
    idx_P = topk_idx_TK.reshape(-1)
    counts_E = torch.bincount(idx_P, minlength=E)
    if counts_E.numel() != E:
        raise ValueError(f"expert ids must lie in [0, {E}) for {R} ranks of {per} experts, got {counts_E.numel() - 1}")
    gathered = [torch.empty_like(counts_E) for _ in range(R)]
    dist.all_gather(gathered, counts_E, group=group)
    counts_RE = torch.stack(gathered).cpu()
    sp = plan_slots(counts_RE, plan)
    if stats is not None:
        stats["received"] = sp.received
        stats["replicas"] = [len(sp.replicas(r, per)) for r in range(R)]
    offsets_RE = torch.cat([torch.zeros(1, E, dtype=torch.long), counts_RE.cumsum(0)[:-1]])  # global numbering
    big = int(counts_RE.sum()) + 1  # > any global pair number: (expert, number) keys as one int64

    # 2. where each of my pairs goes: piece -> (rank, slot in that rank's buffer)
    slot_of = [{e: s for s, e in enumerate(sl)} for sl in sp.slots]
    piece_key = torch.tensor([p.expert * big + p.start for p in sp.pieces], dtype=torch.long)
    piece_rank = torch.tensor([p.rank for p in sp.pieces], dtype=torch.long)
    piece_slot = torch.tensor([slot_of[p.rank][p.expert] for p in sp.pieces], dtype=torch.long)
    order_P = torch.argsort(idx_P.cpu(), stable=True)
    first_of_expert = torch.cat([torch.zeros(1, dtype=torch.long), counts_E.cpu().cumsum(0)[:-1]])
    within_P = torch.empty_like(order_P)
    within_P[order_P] = torch.arange(idx_P.numel()) - first_of_expert[idx_P.cpu()[order_P]]
    global_P = offsets_RE[rank][idx_P.cpu()] + within_P
    piece_P = torch.searchsorted(piece_key, idx_P.cpu() * big + global_P, right=True) - 1
    dest_P, slot_P = piece_rank[piece_P], piece_slot[piece_P]
    send_order = torch.argsort((dest_P * (E + 1) + slot_P) * big + global_P)
    send_split = torch.bincount(dest_P, minlength=R).tolist()

    # what I receive, from each source in turn, grouped by my slots
    recv_slot, recv_split = [], []
    for r in range(R):
        n_from_r = 0
        for s, e in enumerate(sp.slots[rank]):
            lo, hi = int(offsets_RE[r, e]), int(offsets_RE[r, e] + counts_RE[r, e])
            n = sum(_overlap(p.start, p.start + p.count, lo, hi) for p in sp.pieces
                    if p.expert == e and p.rank == rank)
            recv_slot += [s] * n
            n_from_r += n
        recv_split.append(n_from_r)

    # 3. replica weights from their home ranks (differentiable: replica gradients flow home)
    w1, w2, w3 = _local_experts(w1_EFD, w2_EDF, w3_EFD, sp, rank, R, per, group)

    # 4. dispatch the token rows
    token_P = torch.arange(T * K) // K
    x_send = x_TD[token_P[send_order].to(device)]
    x_recv = all_to_all(x_send, recv_split, send_split, group)

    # 5. the local experts, one row per (token, expert) pair
    slots_N1 = torch.tensor(recv_slot, dtype=torch.long, device=device)[:, None]
    out_recv = moe_experts(x_recv, slots_N1, torch.ones(slots_N1.shape, dtype=x_TD.dtype, device=device), w1, w2,
                           w3, act, weight_fn=weight_fn)

    # 6. combine: back to the sources, weighted by the routing weights, summed over the K experts (fp32)
    out_send = all_to_all(out_recv, send_split, recv_split, group)
    out_P = torch.empty_like(out_send).index_copy(0, send_order.to(device), out_send)
    acc = torch.promote_types(x_TD.dtype, torch.float32)
    y = (out_P.view(T, K, -1).to(acc) * topk_w_TK.to(acc)[..., None]).sum(1)
    return y.to(x_TD.dtype)


def all_to_all(x: Tensor, recv_split: list[int], send_split: list[int], group) -> Tensor:
    """Differentiable all-to-all of the rows of x (its backward is the reverse all-to-all)."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), recv_split, send_split, group or dist.group.WORLD)
    return funcol.wait_tensor(out)


def _local_experts(w1: Tensor, w2: Tensor, w3: Tensor, sp: SlotPlan, rank: int, R: int, per: int,
                   group) -> tuple[Tensor, Tensor, Tensor]:
    """[home experts, then replicas] stacks of w1, w2, w3 for this rank: each home rank sends the flattened
    weights of its replicated experts to the ranks that hold the replicas (one all-to-all)."""
    sizes = [w1[0].numel(), w2[0].numel(), w3[0].numel()]
    flat_home = torch.cat([w1.flatten(1), w2.flatten(1), w3.flatten(1)], dim=1)  # [per, sum(sizes)]
    send_experts = [e for q in range(R) for e in sp.replicas(q, per) if home_rank(e, per) == rank]
    send_split = [sum(1 for e in sp.replicas(q, per) if home_rank(e, per) == rank) * flat_home.shape[1]
                  for q in range(R)]
    mine = sp.replicas(rank, per)
    recv_split = [sum(1 for e in mine if home_rank(e, per) == h) * flat_home.shape[1] for h in range(R)]
    if not any(sp.replicas(r, per) for r in range(R)):  # the same answer on every rank: all skip, or none
        return w1, w2, w3
    send = flat_home[[e - rank * per for e in send_experts]].reshape(-1)
    recv = all_to_all(send, recv_split, send_split, group)
    flat = torch.cat([flat_home, recv.view(len(mine), flat_home.shape[1])])
    a, b, c = flat.split(sizes, dim=1)
    return a.view(-1, *w1.shape[1:]), b.view(-1, *w2.shape[1:]), c.view(-1, *w3.shape[1:])


class ExpertParallelExperts(Experts):
    """`Experts` whose stacks hold only this rank's home experts (DTensors: Shard(0) over "ep", Replicate over
    "dp_rep"); its forward is `ep_moe_experts` over the EP group. Made by `apply_expert_parallel`."""

    ep_group: object
    plan: str

    def forward(self, z: Tensor, idx: Tensor, w: Tensor, act, weight_fn=None) -> Tensor:
        z = self.autocast_input(z)  # as Experts.forward: the recipe's fp32 experts compute in bf16 under autocast
        w1, w2, w3 = (p.to_local().to(z.dtype) for p in (self.w1, self.w2, self.w3))
        return ep_moe_experts(z, idx, w.to(z.dtype), w1, w2, w3, act, weight_fn, group=self.ep_group, plan=self.plan)


def apply_expert_parallel(model: K3ForCausalLM, mesh: DeviceMesh, plan: str = "moonep") -> list[nn.Parameter]:
    """Split every MoE layer's routed experts over the mesh's "ep" dimension (in place; before FSDP, which must
    ignore the returned parameters). Each rank keeps experts [r E/R, (r+1) E/R) of the full stacks it holds now."""
    if plan not in PLANS:
        raise ValueError(f"plan={plan!r}: expected one of {PLANS}")
    ep = mesh["ep"]
    R, r = ep.size(), ep.get_local_rank()
    params = []
    for moe in model.moe_layers():
        experts = moe.experts
        E = experts.w1.shape[0]
        if E % R:
            raise ValueError(f"--ep={R}: the {E} routed experts of a layer cannot be split evenly over {R} ranks")
        per = E // R
        for name in ("w1", "w2", "w3"):
            local = getattr(experts, name).detach()[r * per:(r + 1) * per].clone()
            p = nn.Parameter(DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False))
            setattr(experts, name, p)
            params.append(p)
        experts.__class__ = ExpertParallelExperts
        experts.ep_group, experts.plan = ep.get_group(), plan
    return params


@torch.no_grad()
def finish_expert_gradients_(params: list[nn.Parameter], mesh: DeviceMesh, world: int) -> None:
    """After backward: sum the expert gradients over the "dp_rep" replicas (the EP all-to-all already summed those
    of the EP group) and divide by the data-parallel world size, as FSDP's gradient average does for the rest."""
    rep = mesh["dp_rep"]
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.to_local()
        if rep.size() > 1:
            dist.all_reduce(g, group=rep.get_group())
        g.div_(world)


def load_imbalance(received: list[int]) -> float:
    """max / mean rows computed per rank: 1.0 is perfectly balanced."""
    mean = sum(received) / len(received)
    return max(received) / mean if mean else 1.0
