"""Muon's Newton-Schulz divided over the ranks: the per-rank plan and the time of one `Muon` step on FSDP2 shards;
and in one process, the batched step against the per-parameter one.

    python bench/parallel_muon.py --preset tiny --world 2          # CPU, gloo: 1 process unsharded vs 2 FSDP2 ranks
    python bench/parallel_muon.py --preset k3-1b --plan-only        # the plan alone (meta device, nothing allocated)
    python bench/parallel_muon.py --preset kimi-linear-1.5b --layers 4 --one-process   # batched vs per-parameter

Plan: every Muon parameter that FSDP2 splits across rows of its matrices (all of them except the expert stacks,
whose shards hold whole experts) is assigned to one rank by `optim.owners_by_cost`; the table gives, for world sizes
2, 4 and 8, the busiest rank's Newton-Schulz multiply-adds against the ideal total / world. Timing: the same random
gradients, `Muon.step` (the Muon groups only: AdamW is elementwise), the median of `--steps` steps after one warm-up:
in one process on the whole model, both batched (the default) and per-parameter (`Muon(batched=False)`, the
reference; issue #11) on two copies of the model, their steps alternating; and unless --one-process, on `--world`
gloo ranks on FSDP2 shards (the slowest rank's time).
`--layers N` keeps the preset's first N layers (its KDA/MLA pattern cut there): the shapes of the full model at a
size the CPU can step.
Prints a table, writes JSON (bench/results/parallel_muon_<preset>[_<N>layers].json), and states the hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openk3.config import K3Config, get_config  # noqa: E402
from openk3.model import K3ForCausalLM  # noqa: E402
from openk3.parallel.fsdp import apply_fsdp  # noqa: E402
from openk3.parallel.mesh import DistEnv, ParallelDims, build_mesh  # noqa: E402
from openk3.train.optim import build_optimizer, model_head_dims, newton_schulz_cost, owners_by_cost  # noqa: E402


def bench_config(preset: str, layers: int | None) -> K3Config:
    """The preset, cut to its first `layers` layers (None: all of them)."""
    config = get_config(preset)
    if layers is None:
        return config
    if not 1 <= layers <= config.num_hidden_layers:
        raise ValueError(f"--layers must be in [1, {config.num_hidden_layers}] for {preset}, got {layers}")
    attn = config.linear_attn_config
    return config.replace(num_hidden_layers=layers, linear_attn_config={
        **dataclasses.asdict(attn), "kda_layers": [i for i in attn.kda_layers if i <= layers],
        "full_attn_layers": [i for i in attn.full_attn_layers if i <= layers]})


def plan_balance(config: K3Config, worlds=(2, 4, 8)) -> list[dict]:
    """Busiest rank's NS cost / (total / world) of the row-sharded Muon matrices of `config`."""
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    opt = build_optimizer(model, lr=1e-3, head_dims=model_head_dims(config))
    muon = opt.optimizers[0]
    costs = []
    for group in muon.param_groups:
        for p in group["params"]:
            if not (p.ndim == 3 and group["head_dim"] is None):  # expert stacks: whole experts a shard, no plan
                costs.append(newton_schulz_cost(p.shape, group["head_dim"]))
    rows = []
    for world in worlds:
        owners = owners_by_cost(costs, world)
        load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
        rows.append({"world": world, "matrices": len(costs), "max_over_ideal": max(load) / (sum(costs) / world)})
    return rows


def muon_step_seconds(models: list[K3ForCausalLM], steps: int, batched: list[bool]) -> list[float]:
    """The median seconds of one `Muon.step` of each model, its own optimiser batched or not. The models' steps
    alternate, so a load that comes and goes on a shared CPU falls on all of them alike."""
    muons = []
    for model, flag in zip(models, batched, strict=True):
        muon = build_optimizer(model, lr=1e-3, head_dims=model_head_dims(model.config), muon_batched=flag).optimizers[0]
        gen = torch.Generator().manual_seed(0)
        for p in (p for g in muon.param_groups for p in g["params"]):
            full = torch.randn(p.shape, generator=gen)
            p.grad = (torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements)
                      if isinstance(p, torch.distributed.tensor.DTensor) else full)
        muon.step()  # warm-up: momentum buffers
        muons.append(muon)
    seconds = [[] for _ in muons]
    for _ in range(steps):
        for muon, times in zip(muons, seconds):
            t0 = time.perf_counter()
            muon.step()
            times.append(time.perf_counter() - t0)
    return [statistics.median(times) for times in seconds]


def _rank(rank: int, world: int, port: int, preset: str, layers: int | None, steps: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = K3ForCausalLM(bench_config(preset, layers))
    apply_fsdp(model, build_mesh(ParallelDims(), DistEnv(rank, world, rank, torch.device("cpu"))))
    seconds = torch.tensor(muon_step_seconds([model], steps, [True])[0])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": float(seconds)}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="keep the preset's first N layers")
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--one-process", action="store_true", help="no FSDP ranks: batched vs per-parameter only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    config = bench_config(args.preset, args.layers)
    name = args.preset if args.layers is None else f"{args.preset}_{args.layers}layers"
    result = {"preset": args.preset, "layers": config.num_hidden_layers,
              "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
                          f"torch {torch.__version__}", "plan": plan_balance(config)}
    print(f"{name}: Newton-Schulz plan over the row-sharded Muon matrices")
    print("| world | matrices | busiest rank / ideal |\n|---|---|---|")
    for row in result["plan"]:
        print(f"| {row['world']} | {row['matrices']} | {row['max_over_ideal']:.3f} |")
    if not args.plan_only:
        torch.set_num_threads(1)
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(K3ForCausalLM(config))
        one = dict(zip(("per_parameter", "batched"), muon_step_seconds(models, args.steps, [False, True])))
        del models
        result.update(one_process_s=one["batched"], one_process_per_parameter_s=one["per_parameter"])
        print(f"Muon.step in one process, 1 thread: {one['per_parameter'] * 1e3:.0f} ms per parameter, "
              f"{one['batched'] * 1e3:.0f} ms batched ({one['per_parameter'] / one['batched']:.2f}x)")
    if not (args.plan_only or args.one_process):
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        tmp = Path(f"/tmp/parallel_muon_{os.getpid()}.json")
        mp.start_processes(_rank, args=(args.world, port, args.preset, args.layers, args.steps, str(tmp)),
                           nprocs=args.world, start_method="spawn")
        sharded = json.loads(tmp.read_text())["seconds"]
        tmp.unlink()
        result.update(world=args.world, sharded_s=sharded)
        print(f"Muon.step, 1 thread a process: {one['batched'] * 1e3:.0f} ms in one process (batched), "
              f"{sharded * 1e3:.0f} ms on {args.world} FSDP2 ranks (slowest rank)")
    out = Path(args.out or Path(__file__).parent / "results" / f"parallel_muon_{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"hardware: {result['hardware']}; wrote {out}")


if __name__ == "__main__":
    main()
