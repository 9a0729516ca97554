"""Training throughput and model FLOPs utilisation of a K3-shaped model, per KDA backend, side by side.

    python bench/train_throughput.py --preset k3-1b --device cuda --backends fla,torch

Each backend runs the same steps (forward, backward, Muon+AdamW step) on random tokens in packed documents;
prints a table, writes JSON (default bench/results/train_throughput.json) after every backend, and states the
hardware. MFU counts 6 x active non-embedding parameters per token (lm_head included) plus causal MLA attention
(6 * H * (qk + v) * L/2 per token per MLA layer, L = the document length, T/4) and the KDA recurrence
(3 * 8 * H * K * V per token per KDA layer), against the H200's dense bf16 peak of 989 TFLOP/s (datasheet).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from openk3.config import get_config
from openk3.model import K3ForCausalLM, count_params
from openk3.ops import select_kda_backend
from openk3.train.optim import build_optimizer

PEAK_BF16 = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12}


def flops_per_token(config, doc_len: int) -> float:
    """Model FLOPs per trained token; MLA attention is causal within a document of doc_len tokens (the masked-out
    work across documents is not counted)."""
    counts = count_params(config)
    dense = 6 * counts["active_params"]
    lac = config.linear_attn_config
    n = config.num_hidden_layers
    n_kda = config.layer_types.count("kda")
    qd = config.qk_nope_head_dim + config.qk_rope_head_dim
    mla = (n - n_kda) * 6 * config.num_attention_heads * (qd + config.v_head_dim) * doc_len / 2
    kda = n_kda * 3 * 8 * lac.num_heads * lac.head_dim * lac.head_dim
    return dense + mla + kda


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_backend(name: str, config, args) -> dict:
    os.environ["OPENK3_KDA_BACKEND"] = name
    device = torch.device(args.device)
    backend = select_kda_backend(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = K3ForCausalLM(config)
    lac = config.linear_attn_config
    opt = build_optimizer(model, lr=1e-3, head_dims={
        "kda": lac.head_dim, "mla_q": config.qk_nope_head_dim + config.qk_rope_head_dim,
        "mla_kv": config.qk_nope_head_dim + config.v_head_dim})
    B, T = args.batch_size, args.seq_len
    # documents of 1/4 of a row: the varlen path that real packed training takes
    cu = torch.arange(0, B * T + 1, T // 4, device=device)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": [], "step": []}

    def step() -> tuple[float, tuple[float, ...]]:
        ids = torch.randint(0, config.vocab_size, (B, T), device=device)

        def forward_loss():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                return model(ids, labels=ids.roll(-1, 1), cu_seqlens=cu, loss_chunk=args.loss_chunk).loss
        return timed_step(forward_loss, opt, device)

    for i in range(args.warmup + args.steps):
        loss, dts = step()
        print(f"  [{name}] step {i} {dts[-1] * 1e3:.0f} ms (forward {dts[0] * 1e3:.0f}, backward {dts[1] * 1e3:.0f}, "
              f"optimizer {dts[2] * 1e3:.0f}) loss {loss:.3f}", flush=True)
        if i >= args.warmup:
            for key, dt in zip(phases, dts):
                phases[key].append(dt)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step()
        sort = "cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        path = Path(args.out).with_suffix(f".{name}.profile.txt")
        path.write_text(table + "\n")
        print(f"  [{name}] profile of one step (top 30 by {sort}) -> {path}")
    times = phases["step"]
    step_s = sorted(times)[len(times) // 2]
    tok_s = B * T / step_s
    fpt = flops_per_token(config, T // 4)
    peak = PEAK_BF16.get(torch.cuda.get_device_name(device) if device.type == "cuda" else "", None)
    res = {"backend": name, "reason": backend.reason, "median_step_s": step_s, "tokens_per_s": tok_s,
           **{f"median_{k}_s": sorted(v)[len(v) // 2] for k, v in phases.items() if k != "step"},
           "model_tflops_per_s": fpt * tok_s / 1e12, "mfu": fpt * tok_s / peak if peak else None,
           "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None}
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return res


def timed_step(forward_loss, opt, device) -> tuple[float, tuple[float, float, float, float]]:
    """One training step, synchronised around each phase: (loss, (forward, backward, optimizer, whole) seconds)."""
    sync(device)
    t0 = time.perf_counter()
    loss = forward_loss()
    sync(device)
    t1 = time.perf_counter()
    loss.backward()
    sync(device)
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    t3 = time.perf_counter()
    return loss.item(), (t1 - t0, t2 - t1, t3 - t2, t3 - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-1b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", default="fla,torch")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--loss-chunk", type=int, default=4096, help="tokens per loss chunk (recomputed logits), 0 = off")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile one more step and write the top-30 ops next to --out")
    ap.add_argument("--out", default="bench/results/train_throughput.json")
    args = ap.parse_args()
    config = get_config(args.preset)
    counts = count_params(config)
    hw = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or platform.machine()
    header = {"preset": args.preset, **counts, "hardware": hw, "torch": torch.__version__,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "dtype": args.dtype,
              "fla_autotune": os.environ.get("OPENK3_FLA_AUTOTUNE", "3"), "doc_len": args.seq_len // 4,
              "flops_per_token": flops_per_token(config, args.seq_len // 4)}
    print(json.dumps(header))
    results = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.backends.split(","):
        results.append(run_backend(name, config, args))
        out.write_text(json.dumps({**header, "results": results}, indent=2))
        print(f"{'backend':8} {'step s':>8} {'fwd s':>7} {'bwd s':>7} {'opt s':>7} {'tokens/s':>10} {'TFLOP/s':>8} "
              f"{'MFU':>6} {'mem GiB':>8}")
        for r in results:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
            print(f"{r['backend']:8} {r['median_step_s']:8.3f} {r['median_forward_s']:7.3f} "
                  f"{r['median_backward_s']:7.3f} {r['median_optimizer_s']:7.3f} {r['tokens_per_s']:10.0f} "
                  f"{r['model_tflops_per_s']:8.1f} {mfu:>6} {mem:>8}", flush=True)


if __name__ == "__main__":
    main()
