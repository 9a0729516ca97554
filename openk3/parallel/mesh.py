"""The process group and device mesh of a distributed run (K3_SPEC section 8: data parallelism first).

    torchrun --nproc-per-node 2 -m openk3.cli train ...        # RANK, WORLD_SIZE, MASTER_ADDR set by torchrun
    dims = ParallelDims(dp=2)
    dist_env = init_distributed("cpu")                           # gloo on CPU, NCCL on CUDA; None without torchrun
    mesh = build_mesh(dims, dist_env)                            # a 1-D mesh named "dp"
    ep_mesh = build_ep_mesh(ParallelDims(dp=4, ep=2), dist_env)  # ("dp_rep", "ep") = (2, 2), for --ep 2

The trainer applies data parallelism (FSDP2) over every rank (`dp` must equal the world size) and, with `--ep`,
expert parallelism inside it. Context parallelism (context.py) is a standalone layer with its own process group.
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
    """The mesh description of `openk3 train --dp N --ep M`. dp = None means "every rank", the world size.

    Expert parallelism borrows its ranks from data parallelism (as torchtitan does): the dp ranks form dp / ep
    groups of ep consecutive ranks; each group splits the routed experts, and the groups replicate one another."""

    dp: int | None = None
    ep: int = 1

    def resolve(self, world: int) -> ParallelDims:
        """These dims with dp filled in; a ValueError naming the flag when they do not fit `world`."""
        dp = world if self.dp is None else self.dp
        if dp < 1:
            raise ValueError(f"--dp={dp}: must be a positive integer")
        if dp != world:
            raise ValueError(f"--dp={dp} must equal the number of processes ({world}): data parallelism (with "
                             f"expert parallelism inside it) is the only mesh the trainer applies (docs/parallel.md)")
        if self.ep < 1 or dp % self.ep:
            raise ValueError(f"--ep={self.ep} must be a positive divisor of the {dp} data-parallel ranks")
        return ParallelDims(dp=dp, ep=self.ep)


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
    """The 1-D data-parallel mesh ("dp") over every rank."""
    dims = dims.resolve(env.world)
    return init_device_mesh(env.device.type, (dims.dp,), mesh_dim_names=("dp",))


def build_ep_mesh(dims: ParallelDims, env: DistEnv) -> DeviceMesh:
    """The 2-D mesh ("dp_rep", "ep") of shape (dp / ep, ep) over the same ranks: "ep" groups consecutive ranks."""
    dims = dims.resolve(env.world)
    return init_device_mesh(env.device.type, (dims.dp // dims.ep, dims.ep), mesh_dim_names=("dp_rep", "ep"))


def rows_of_rank(batch_size: int, rank: int, world: int) -> range:
    """The rows of a global batch that `rank` of `world` data-parallel ranks reads: a contiguous, disjoint block.
    `--batch-size` stays the global batch, so it must divide evenly."""
    if batch_size % world:
        raise ValueError(f"--batch-size={batch_size} is the global batch and must be divisible by the "
                         f"{world} data-parallel ranks")
    per = batch_size // world
    return range(rank * per, (rank + 1) * per)
