"""Run a function on a gloo process group of N CPU processes spawned from inside pytest.

    spawn(2, worker, tmp_path, extra)              # worker(rank, world, tmp_path, extra) in each process
    results = spawn_results(2, worker, tmp_path)   # worker(rank, world, out): rank 0 torch.saves its results to out

Each call gets its own free port. Workers return results through files (rank 0 usually writes them): spawned
processes share nothing with the test process.
"""

import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        fn(rank, world, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world: int, fn, *args, timeout_s: float = 300) -> None:
    """fn(rank, world, *args) in `world` fresh processes with env:// set for torch.distributed (not initialised:
    the code under test joins the group itself, or `init_gloo` does). Raises if any process fails, and kills them
    all after `timeout_s` (a collective that one rank never joins would otherwise hang the test run)."""
    context = mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, start_method="spawn",
                                 join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{fn.__name__} on {world} processes did not finish within {timeout_s} s")


def spawn_results(world: int, fn, folder, *, weights_only: bool = True):
    """spawn(world, fn, out) with out a file in `folder` that fn's rank 0 torch.saves its results to; returns them
    (the module-scoped fixtures' pattern: one spawn of a test group, its results read by every test)."""
    out = Path(folder) / f"{fn.__name__}.pt"
    spawn(world, fn, out)
    return torch.load(out, weights_only=weights_only)


def init_gloo() -> None:
    dist.init_process_group("gloo")


def init_nccl() -> None:
    """One GPU per rank (LOCAL_RANK), NCCL: the tests marked gpu."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
