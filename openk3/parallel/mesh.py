"""The process group and device mesh of a distributed run (K3_SPEC section 8: data parallelism first).

    torchrun --nproc-per-node 2 -m openk3.cli train ...        # RANK, WORLD_SIZE, MASTER_ADDR set by torchrun
    dims = ParallelDims(dp=2)
    dist_env = init_distributed("cpu")                           # gloo on CPU, NCCL on CUDA; None without torchrun
    mesh = build_mesh(dims, dist_env)                            # a 1-D mesh named "dp"
    ep_mesh = build_ep_mesh(ParallelDims(dp=4, ep=2), dist_env)  # ("dp_rep", "ep") = (2, 2), for --ep 2
    cp_mesh = build_cp_mesh(ParallelDims(dp=2, cp=2), dist_env)  # ("dp", "cp") = (2, 2), for --cp 2

World = dp x cp. A CP group is cp consecutive ranks (rank = dp_rank x cp + cp_rank): its ranks read the same rows
and each takes a contiguous slice of every row (context.py). FSDP2 shards over all dp x cp ranks (torchtitan's
"dp_shard_cp"): the CP ranks compute on disjoint tokens exactly as data-parallel ranks do, so FSDP's gradient
average over every rank, with the trainer's token-count loss weighting, is the gradient of the whole batch. With
`--ep`, expert parallelism groups ep consecutive ranks of that same world.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its global rank, the world size, its local rank (GPU index on its node), and the
    device it computes on."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, metrics, plots and the non-sharded parts of checkpoints."""
        return self.rank == 0


@dataclass(frozen=True)
class ParallelDims:
    """The mesh description of `openk3 train --dp N --cp C --ep M`. dp = None means "the world size / cp".

    The world is dp x cp (context-parallel groups of cp consecutive ranks inside each data-parallel replica).
    Expert parallelism borrows its ranks from the dp x cp ones (as torchtitan does): they form world / ep groups of
    ep consecutive ranks; each group splits the routed experts, and the groups replicate one another."""

    dp: int | None = None
    ep: int = 1
    cp: int = 1

    def resolve(self, world: int) -> ParallelDims:
        """These dims with dp filled in; a ValueError naming the flag when they do not fit `world`."""
        if self.cp < 1 or world % self.cp:
            raise ValueError(f"--cp={self.cp} must be a positive divisor of the number of processes ({world})")
        dp = world // self.cp if self.dp is None else self.dp
        if dp < 1:
            raise ValueError(f"--dp={dp}: must be a positive integer")
        if dp * self.cp != world:
            raise ValueError(f"--dp={dp} x --cp={self.cp} must equal the number of processes ({world}): data and "
                             f"context parallelism (with expert parallelism inside them) are the mesh the trainer "
                             f"applies (docs/parallel.md)")
        if self.ep < 1 or world % self.ep:
            raise ValueError(f"--ep={self.ep} must be a positive divisor of the {world} data x context-parallel "
                             f"ranks")
        return ParallelDims(dp=dp, ep=self.ep, cp=self.cp)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or any launcher that sets the env:// variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device_type: str) -> DistEnv | None:
    """Join the process group torchrun describes (env://), once; None when not launched by torchrun.

    Backend: NCCL for CUDA (each process takes the GPU of its LOCAL_RANK), gloo for the CPU."""
    if not under_torchrun():
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return DistEnv(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank, device=device)


def build_mesh(dims: ParallelDims, env: DistEnv) -> DeviceMesh:
    """FSDP2's 1-D mesh ("dp") over every rank: the dp x cp ranks (see the module docstring)."""
    dims.resolve(env.world)
    return init_device_mesh(env.device.type, (env.world,), mesh_dim_names=("dp",))


def build_ep_mesh(dims: ParallelDims, env: DistEnv) -> DeviceMesh:
    """The 2-D mesh ("dp_rep", "ep") of shape (world / ep, ep) over the same ranks: "ep" groups consecutive
    ranks."""
    dims = dims.resolve(env.world)
    return init_device_mesh(env.device.type, (env.world // dims.ep, dims.ep), mesh_dim_names=("dp_rep", "ep"))


def build_cp_mesh(dims: ParallelDims, env: DistEnv) -> DeviceMesh:
    """The 2-D mesh ("dp", "cp") of shape (dp, cp): "cp" groups consecutive ranks, which read the same rows
    (`mesh["dp"].get_local_rank()` picks them) and split every row (`mesh["cp"]`'s group runs context.py)."""
    dims = dims.resolve(env.world)
    return init_device_mesh(env.device.type, (dims.dp, dims.cp), mesh_dim_names=("dp", "cp"))


def rows_of_rank(batch_size: int, rank: int, world: int) -> range:
    """The rows of a global batch that `rank` of `world` data-parallel ranks reads: a contiguous, disjoint block.
    `--batch-size` stays the global batch, so it must divide evenly."""
    if batch_size % world:
        raise ValueError(f"--batch-size={batch_size} is the global batch and must be divisible by the "
                         f"{world} data-parallel ranks")
    per = batch_size // world
    return range(rank * per, (rank + 1) * per)
