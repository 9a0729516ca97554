"""Per-rank load of expert parallelism on a deliberately skewed router: the plain all-to-all against MoonEP.

    python bench/parallel_ep.py --ranks 4 --tokens 256 --experts 32 --topk 8 --skew 2.0     # gloo, CPU processes

Every rank routes `--tokens` tokens top-k over `--experts` experts with scores whose expert j gets a bonus
skew * (1 - j / E) (the first experts, all homed on rank 0, win most tokens). Prints the rows each rank computes
under each plan (max / mean = the load imbalance), MoonEP's replicas per rank, and the time of a forward+backward
(gloo on this CPU: communication-bound, not a GPU number). Writes bench/results/parallel_ep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openk3.ops.situ import situ_glu  # noqa: E402
from openk3.parallel.expert import PLANS, ep_moe_experts, load_imbalance  # noqa: E402


def act(gate, up):
    return situ_glu(gate, up, 4.0, 25.0)


def worker(rank: int, args, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    E, per, D, F = args.experts, args.experts // args.ranks, args.dim, args.inter
    g = torch.Generator().manual_seed(rank)
    scores = torch.rand(args.tokens, E, generator=g) + args.skew * (1 - torch.arange(E) / E)
    idx = scores.topk(args.topk, dim=1).indices
    w = torch.rand(args.tokens, args.topk, generator=g)
    x = torch.randn(args.tokens, D, generator=g, requires_grad=True)
    w1, w2, w3 = ((torch.randn(per, *s, generator=g) * 0.1).requires_grad_() for s in ((F, D), (D, F), (F, D)))
    result = {}
    for plan in PLANS:
        stats = {}
        for i in range(args.repeats + 1):
            if i == 1:
                dist.barrier()
                t0 = time.perf_counter()
            y = ep_moe_experts(x, idx, w, w1, w2, w3, act, plan=plan, stats=stats)
            y.square().sum().backward()
        dist.barrier()
        result[plan] = {**stats, "imbalance": load_imbalance(stats["received"]),
                        "ms_fwd_bwd": 1e3 * (time.perf_counter() - t0) / args.repeats}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--skew", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ep.json")
        mp.start_processes(worker, args=(args, 29600 + os.getpid() % 1000, out), nprocs=args.ranks,
                           start_method="spawn")
        result = json.loads(Path(out).read_text())
    print(f"{args.ranks} ranks x {args.tokens} tokens, top-{args.topk} of {args.experts} experts, skew {args.skew}; "
          f"gloo on {platform.processor() or 'cpu'}, torch {torch.__version__}")
    print(f"{'plan':8s} {'rows per rank':32s} {'max/mean':>9s} {'replicas':>12s} {'fwd+bwd ms':>11s}")
    for plan, r in result.items():
        print(f"{plan:8s} {str(r['received']):32s} {r['imbalance']:9.2f} {str(r['replicas']):>12s} "
              f"{r['ms_fwd_bwd']:11.1f}")
    path = Path(__file__).parent / "results" / "parallel_ep.json"
    path.write_text(json.dumps({"settings": vars(args), "torch": torch.__version__, "plans": result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
