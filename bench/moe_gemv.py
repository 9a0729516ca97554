"""Routed experts at decode sizes on CUDA: the grouped matmul, the Triton GEMV and by-expert kernels (issue #12).

    python bench/moe_gemv.py                             # kimi-linear-1.5b experts, T = 1, 4, 16, 64, 256
    python bench/moe_gemv.py --tokens 1 4 --blocks 8,256,8,512 16,128,8,256 --layers 15
    python bench/moe_gemv.py --tokens 16 64 256 --by-expert-blocks 16,32,128,64,128 32,16,256,32,256,4,4

For each token count T (S = T*K slots), one MoE layer's routed experts (E experts, top-K, F x D; default
kimi-linear-1.5b's 32 / 4 / 512 x 1536; bf16, the dtype the grouped matmul is one capturable kernel in) with a
random router's choice (K distinct experts per token) run as `moe_experts_grouped`, as
`moe_experts_grouped_combined` (the grouped matmuls then `combine_slots`: what inference runs above the kernels'
limits), as `moe_experts_gemv` (once per `--blocks` tile set: BLOCK_F,BLOCK_D1,BLOCK_D,BLOCK_F2 of
openk3/ops/moe_gemv.py) and as `moe_experts_by_expert` (once per `--by-expert-blocks` tile set:
BLOCK_M,BLOCK_F,BLOCK_D1,BLOCK_D,BLOCK_F2 of openk3/ops/moe_by_expert.py). Each is timed two ways, in
microseconds per call: eager (launches included) and replayed from a CUDA graph of `--calls` back-to-back calls
(as the engine's decode step runs them). The table also gives each path's error against the grouped result and the
read bandwidth over the distinct experts' weights (3 x F x D each), the floor the kernels aim at, and marks (*)
the path `openk3.ops.moe_experts` takes at that S. Writes bench/results/moe_gemv.json (atomically) with the
hardware. Where the GEMV and the by-expert rows cross is what `moe_gemv.GEMV_MAX_SLOTS` should be, where the
by-expert and the grouped-combined rows cross `moe_by_expert.BY_EXPERT_MAX_SLOTS`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openk3.ops import moe_gemv  # noqa: E402
from openk3.ops.moe import moe_experts_grouped  # noqa: E402
from openk3.ops.moe_by_expert import BY_EXPERT_MAX_SLOTS, moe_experts_by_expert  # noqa: E402
from openk3.ops.moe_gemv import GEMV_MAX_SLOTS, GLUSpec, moe_experts_gemv, moe_experts_grouped_combined  # noqa: E402
from openk3.ops.situ import situ_glu, swiglu  # noqa: E402


def situ(gate, up):
    return situ_glu(gate, up, 4.0, 25.0)


situ.glu = GLUSpec("situ", 4.0, 25.0)


def parse_blocks(text: str, tiles: int = 4, flag: str = "--blocks", example: str = "8,256,8,512",
                 stages: bool = False) -> tuple[int, ...]:
    """`tiles` tile sizes and optionally the two kernels' warps (powers of two), and with `stages` then optionally
    their software-pipelining stages (1 or more)."""
    parts = text.split(",")
    counts = (tiles, tiles + 2, tiles + 4) if stages else (tiles, tiles + 2)
    pow2 = all(p.isdigit() and int(p) > 0 and int(p) & (int(p) - 1) == 0 for p in parts[:tiles + 2])
    if len(parts) not in counts or not pow2 or not all(p.isdigit() and int(p) > 0 for p in parts[tiles + 2:]):
        more = ", then optionally their two stage counts" if stages else ""
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected {tiles} (or {tiles + 2}, with the two kernels' "
                                         f"warps{more}) powers of two, e.g. {example} or {example},4,4")
    return tuple(int(p) for p in parts)


def parse_by_expert_blocks(text: str) -> tuple[int, ...]:
    """BLOCK_M,BLOCK_F,BLOCK_D1,BLOCK_D,BLOCK_F2[,WARPS1,WARPS2[,STAGES1,STAGES2]]; tl.dot needs every tile to be 16
    or more."""
    blocks = parse_blocks(text, 5, "--by-expert-blocks", "16,32,128,64,128", stages=True)
    if min(blocks[:5]) < 16:
        raise argparse.ArgumentTypeError(f"--by-expert-blocks {text!r}: every tile must be 16 or more (tl.dot)")
    return blocks


def dispatched(slots: int) -> str:
    """The path label `openk3.ops.moe_experts` takes at this many slots (no grad, the model's activation)."""
    if slots <= GEMV_MAX_SLOTS:
        return "gemv"
    return "by-expert" if slots <= BY_EXPERT_MAX_SLOTS else "grouped+combine"


def time_eager(fn, calls: int, repeats: int) -> float:
    """Microseconds per call, launches included."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        best = min(best, 1e3 * start.elapsed_time(end) / calls)
    return best


def time_graph(fn, calls: int, repeats: int) -> float:
    """Microseconds per call, `calls` calls captured in one CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture (compiles, lazy init), as PyTorch's notes ask
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_eager(graph.replay, 1, repeats) / calls


def inputs(T: int, E: int, K: int, F: int, D: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", generator=gen).to(dtype)
    w1 = (torch.randn(E, F, D, device="cuda", generator=gen) / D**0.5).to(dtype)
    w3 = (torch.randn(E, F, D, device="cuda", generator=gen) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, F, device="cuda", generator=gen) / F**0.5).to(dtype)
    topk_w, topk_idx = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=-1)
    return x, topk_idx, topk_w.to(dtype), w1, w2, w3


def hardware() -> dict:
    import triton

    return {"gpu": torch.cuda.get_device_name(), "capability": ".".join(map(str, torch.cuda.get_device_capability())),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--inter", type=int, default=512, help="F, the experts' intermediate size")
    p.add_argument("--dim", type=int, default=1536, help="D, the experts' input and output size")
    p.add_argument("--act", choices=["swiglu", "situ"], default="swiglu", help="kimi-linear: swiglu, K3: situ")
    p.add_argument("--blocks", type=parse_blocks, nargs="+", default=[None],
                   help="GEMV tile sets BLOCK_F,BLOCK_D1,BLOCK_D,BLOCK_F2[,WARPS1,WARPS2] (default: the module's)")
    p.add_argument("--by-expert-blocks", type=parse_by_expert_blocks, nargs="+", default=[None],
                   help="by-expert tile sets BLOCK_M,BLOCK_F,BLOCK_D1,BLOCK_D,BLOCK_F2[,WARPS1,WARPS2] "
                        "(default: the module's, BLOCK_M from S / E)")
    p.add_argument("--calls", type=int, default=20, help="calls per timing (and per captured graph)")
    p.add_argument("--layers", type=int, default=1,
                   help="copies of the weights the calls cycle over (15: kimi-linear-1.5b's MoE layers, which "
                        "read their experts from memory; 1: each call re-reads what the last one left in L2)")
    p.add_argument("--repeats", type=int, default=20, help="timings; the best is reported")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "moe_gemv.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/moe_gemv.py times CUDA kernels: no CUDA device here")
    ok, why = moe_gemv.gemv_supported("cuda", torch.bfloat16)
    if not ok:
        raise SystemExit(f"the GEMV kernels cannot run here: {why}")
    for name, value in (("--tokens", min(args.tokens)), ("--calls", args.calls), ("--repeats", args.repeats),
                        ("--layers", args.layers)):
        if value < 1:
            raise SystemExit(f"{name} must be >= 1, got {value}")
    if args.topk > args.experts:
        raise SystemExit(f"--topk {args.topk} is more than --experts {args.experts}")
    dtype = torch.bfloat16  # NOTE: the grouped matmul is one fused (capturable) kernel only in bf16 on sm90+
    act = {"swiglu": swiglu, "situ": situ}[args.act]
    E, K, F, D = args.experts, args.topk, args.inter, args.dim
    pow2 = moe_gemv.triton.next_power_of_2  # the module caps the dot-product tiles at these
    default_blocks = (moe_gemv.BLOCK_F, min(moe_gemv.BLOCK_D1, pow2(D)),
                      moe_gemv.BLOCK_D, min(moe_gemv.BLOCK_F2, pow2(F)))

    rows = []
    print(f"{hardware()['gpu']}: E={E} K={K} F={F} D={D} bf16 {args.act}, us per call (best of "
          f"{args.repeats} x {args.calls} calls); * = the path openk3.ops.moe_experts takes (GEMV up to "
          f"S = {GEMV_MAX_SLOTS}, by-expert up to S = {BY_EXPERT_MAX_SLOTS}, then grouped+combine)")
    print(f"{'T':>4} {'S':>5} {'path':<30} {'eager us':>9} {'graph us':>9} {'GB/s':>7} {'rel err':>9}")
    with torch.no_grad():
        for T in args.tokens:
            x, idx, w, w1, w2, w3 = inputs(T, E, K, F, D, dtype, seed=T)
            distinct = torch.unique(idx).numel()  # one readback, outside the timed calls
            weight_bytes = distinct * 3 * F * D * w1.element_size()
            y_grouped = moe_experts_grouped(x, idx, w, w1, w2, w3, act)
            # --layers: the calls cycle over that many copies of the weights (as a step's MoE layers do), so that a
            # call reads its experts from memory, not from the L2 cache the previous call filled
            weights = [(w1, w2, w3)] + [tuple(t.clone() for t in (w1, w2, w3)) for _ in range(args.layers - 1)]
            turn = itertools.count()

            def cycled(run):
                return lambda: run(*weights[next(turn) % len(weights)])
            paths = [("grouped", cycled(lambda a, b, c: moe_experts_grouped(x, idx, w, a, b, c, act)), None),
                     ("grouped+combine", cycled(lambda a, b, c: moe_experts_grouped_combined(x, idx, w, a, b, c, act)),
                      None)]
            module_warps = moe_gemv.WARPS if T * K <= moe_gemv.WARPS_MAX_SLOTS else moe_gemv.WARPS_MORE
            for blocks in args.blocks:
                # the tiles, then the warps of each kernel (the module's rule, by S, unless given)
                label = "gemv " + ",".join(map(str, tuple((blocks or default_blocks)[:4]) + tuple(
                    blocks[4:] if blocks and blocks[4:] else module_warps)))
                tiles, warps = (blocks[:4], blocks[4:] or None) if blocks else (None, None)
                paths.append((label, cycled(lambda a, b, c, t=tiles, n=warps: moe_experts_gemv(
                    x, idx, w, a, b, c, act, blocks=t, warps=n)), blocks))
            for blocks in args.by_expert_blocks:
                label = "by-expert " + (",".join(map(str, blocks)) if blocks else "default")
                tiles, warps, stages = (blocks[:5], blocks[5:7] or None, blocks[7:] or None) if blocks else (None,) * 3
                paths.append((label, cycled(lambda a, b, c, t=tiles, n=warps, st=stages: moe_experts_by_expert(
                    x, idx, w, a, b, c, act, blocks=t, warps=n, stages=st)), blocks))
            taken = dispatched(T * K)
            for label, fn, blocks in paths:
                y = fn()
                err = ((y.double() - y_grouped.double()).norm() / y_grouped.double().norm()).item()
                eager = time_eager(fn, args.calls, args.repeats)
                graph = time_graph(fn, args.calls, args.repeats)
                gbs = weight_bytes / (graph * 1e-6) / 1e9
                # the module's own tiles of the path moe_experts takes here
                is_taken = label.split(" ")[0] == taken and blocks is None
                rows.append({"T": T, "slots": T * K, "path": label, "eager_us": eager, "graph_us": graph,
                             "distinct_experts": distinct, "weight_GBps": gbs, "rel_err_vs_grouped": err,
                             "moe_experts_takes": is_taken})
                print(f"{T:>4} {T * K:>5} {label + (' *' if is_taken else ''):<30} {eager:>9.1f} {graph:>9.1f} "
                      f"{gbs:>7.0f} {err:>9.2e}")
    write_json(args.out, {"hardware": hardware(), "args": {k: str(v) for k, v in vars(args).items()},
                          "gemv_max_slots": GEMV_MAX_SLOTS, "by_expert_max_slots": BY_EXPERT_MAX_SLOTS,
                          "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
