"""Overhead of the FSDP2 wrapper: training throughput of the same model unsharded and under `apply_fsdp` at world 1.

    python bench/parallel_fsdp.py --preset k3-1b --device cuda --batch 8 --seq 2048      # the H200 run (NCCL)
    python bench/parallel_fsdp.py --preset tiny --device cpu --batch 8 --seq 256          # the CPU run (gloo)

Both variants run the same steps (forward, backward, gradient clipping, Muon + AdamW step) on the same random
packed batches; the first `--warmup` steps are not timed. Prints a table, writes JSON (default
bench/results/parallel_fsdp_<preset>_<device>.json), and states the hardware. At world 1 FSDP2 still all-gathers
(a copy) and reduce-scatters (a copy) every layer and Muon still calls full_tensor: the difference is the wrapper's
cost, not communication.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openk3.config import get_config  # noqa: E402
from openk3.model import K3ForCausalLM  # noqa: E402
from openk3.parallel.fsdp import apply_fsdp  # noqa: E402
from openk3.parallel.mesh import DistEnv, ParallelDims, build_mesh  # noqa: E402
from openk3.train.optim import build_optimizer  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(model: K3ForCausalLM, batches: list, args, device: torch.device) -> float:
    c = model.config
    opt = build_optimizer(model, lr=1e-3, head_dims={"kda": c.linear_attn_config.head_dim,
                                                      "mla_q": c.qk_nope_head_dim + c.qk_rope_head_dim,
                                                      "mla_kv": c.qk_nope_head_dim + c.v_head_dim})
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for i, (ids, cu) in enumerate(batches):
        if i == args.warmup:
            sync(device)
            t0 = time.perf_counter()
        with amp:
            loss = model(ids, labels=ids.roll(-1, 1), cu_seqlens=cu, loss_chunk=4096).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        opt.step()
        opt.zero_grad()
    sync(device)
    return args.batch * args.seq * (len(batches) - args.warmup) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    device = torch.device(args.device)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29533")):
        os.environ.setdefault(key, value)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    config = get_config(args.preset)
    with torch.device(device):
        plain = K3ForCausalLM(config)
    sharded = copy.deepcopy(plain)
    apply_fsdp(sharded, build_mesh(ParallelDims(), DistEnv(0, 1, 0, device)))
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
        cu = torch.arange(0, args.batch * args.seq + 1, args.seq // 4)  # 4 documents a row
        batches.append((ids.to(device), cu.to(device)))
    rows = {"unsharded": run(plain, batches, args, device), "fsdp2_world1": run(sharded, batches, args, device)}
    hardware = torch.cuda.get_device_name(0) if device.type == "cuda" else f"{platform.processor() or 'cpu'}, " \
        f"{torch.get_num_threads()} threads"
    print(f"{args.preset}, {args.batch} x {args.seq} tokens a step, {hardware}, torch {torch.__version__}")
    for name, tok_s in rows.items():
        print(f"  {name:14s} {tok_s:12,.0f} tokens/s")
    print(f"  FSDP2 overhead at world 1: {100 * (1 - rows['fsdp2_world1'] / rows['unsharded']):.1f}%")
    out = Path(args.out or Path(__file__).parent / "results" / f"parallel_fsdp_{args.preset}_{device.type}.json")
    out.write_text(json.dumps({"preset": args.preset, "batch": args.batch, "seq": args.seq, "steps": args.steps,
                               "warmup": args.warmup, "hardware": hardware, "torch": torch.__version__, "fla_autotune": os.environ.get("OPENK3_FLA_AUTOTUNE", "3"),
                               "tokens_per_s": rows}, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
