"""Training speed of openk3 against transformers' KimiLinear on the same weights, in one process (issue #11).

    python bench/vs_transformers.py                       # kimi-linear-1.5b, 8 x 2048 tokens, the default runs
    python bench/vs_transformers.py --runs openk3_bf16_adamw,openk3_bf16_adamw_compiled,openk3_recipe_compiled
    python bench/vs_transformers.py --runs openk3_bf16_adamw --profile
    python bench/vs_transformers.py --ablate              # + what each K3 feature costs, one at a time

One random `kimi-linear-1.5b` model (1.49e9 total / 0.45e9 active) is written as a checkpoint and loaded both
ways; their fp32 logits are compared on a short batch; then each run trains a few steps on the same random
8 x 2048-token batch and reports tokens/s, the step split (forward / backward / optimizer), peak memory, MFU and
the first step's time (which includes Triton's compiling and fla's autotuning on a fresh machine).

Runs:
  transformers       transformers' KimiLinearForCausalLM (fla kernels where it uses them), bf16 weights, fused AdamW
  openk3_bf16_adamw  openk3, bf16 weights (the fp32-stored tensors stay fp32), fused AdamW
  openk3_recipe      openk3's own recipe: fp32 master weights, bf16 compute, Muon (per-head) + AdamW; the bf16 compute
                     as `openk3 train --dtype bf16` runs it in one process: a bf16 copy of the masters
                     (openk3/train/precision.py; the optimizer column includes moving gradients and weights)
  openk3_recipe_autocast
                     the same recipe computing under bf16 autocast over the fp32 parameters (`--bf16-mode autocast`)
  openk3_packed      openk3_bf16_adamw on the same tokens packed as 4 documents a row (cu_seqlens)
  openk3_k3_features the `k3-1.5b` preset (every K3 feature, QAT off) with the recipe; `_qat` with MXFP4 QAT on
  *_graphed          (openk3_bf16_adamw[_compiled]_graphed, openk3_recipe[_compiled]_graphed) the same, with the steps after
                     the warm-up replaying one CUDA graph of the whole step (openk3/train/graphed.py)
  openk3_bf16_adamw_compiled, openk3_recipe_compiled, openk3_recipe_autocast_compiled
                     the same with the decoder layers and the loss head torch.compile'd (Inductor,
                     openk3/train/compile.py; `openk3 train`'s CUDA default); not in the default --runs: their first
                     step includes the compile, and they report the graphs each step compiled
With --ablate, `kimi-linear-1.5b` plus one K3 feature at a time (bf16 weights, AdamW).

MFU counts 6 x active non-embedding parameters per token plus causal attention and the KDA recurrence
(bench/train_throughput.py `flops_per_token`) against the H200's dense bf16 peak, 989 TFLOP/s. JSON after every
run: bench/results/vs_transformers_train.json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_throughput import PEAK_BF16, flops_per_token, timed_step  # noqa: E402

from openk3.config import _MXFP4, get_config  # noqa: E402
from openk3.model import K3ForCausalLM, count_params  # noqa: E402
from openk3.model.checkpoint import load_pretrained, save_pretrained  # noqa: E402
from openk3.ops import select_kda_backend, select_moe_backend  # noqa: E402
from openk3.ops.kda.tuned import FLA_MODULES, autotune_candidates, limit_fla_autotuning  # noqa: E402
from openk3.train.compile import compile_layers, compiled_graphs  # noqa: E402
from openk3.train.graphed import GraphedStep, make_capturable  # noqa: E402
from openk3.train.optim import build_optimizer, model_head_dims  # noqa: E402
from openk3.train.precision import BF16Compute, MasterStep  # noqa: E402

DEFAULT_RUNS = ("transformers", "openk3_bf16_adamw", "openk3_recipe", "openk3_packed", "openk3_k3_features",
                "openk3_k3_features_qat")
RUNS = DEFAULT_RUNS + ("openk3_bf16_adamw_compiled", "openk3_recipe_compiled", "openk3_recipe_autocast",
                       "openk3_recipe_autocast_compiled", "openk3_bf16_adamw_graphed", "openk3_bf16_adamw_compiled_graphed",
                       "openk3_recipe_graphed", "openk3_recipe_compiled_graphed")


def ablations(base):
    """kimi-linear-1.5b with one K3 feature switched on, by name."""
    lac = dict(vars(base.linear_attn_config))
    return {
        "bounded_gate": base.replace(linear_attn_config={**lac, "gate_lower_bound": -5.0}),
        "full_rank_gate": base.replace(linear_attn_config={**lac, "use_full_rank_gate": True}),
        "gated_mla": base.replace(mla_use_output_gate=True),
        "attnres": base.replace(attn_res_block_size=4),
        "latent_moe": base.replace(routed_expert_hidden_size=768, latent_moe_use_norm=True, routed_scaling_factor=1.0),
        "situ": base.replace(hidden_act="situ"),
        "qat": base.replace(quantization_config=copy.deepcopy(_MXFP4)),
    }


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


CUDA = torch.device("cuda")


def time_training(name: str, forward_loss, opt, args, profile_to: Path | None, graphed: bool = False) -> dict:
    """Run args.warmup + args.steps training steps; medians over the timed ones, plus the first step's time. With
    `graphed`, the steps after the warm-up are one CUDA graph's replays (openk3/train/graphed.py): only the whole
    step is timed (no phase split)."""
    phases = {"forward": [], "backward": [], "optimizer": [], "step": []}
    first = None
    graphs = []  # graphs torch.compile compiled during each step (all zero for an eager run)
    graph = None

    def whole_step():
        loss = forward_loss()
        loss.backward()
        opt.step()
        return loss

    def step():
        if graph is None:
            return timed_step(forward_loss, opt, CUDA)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = graph.replay()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return loss.item(), (float("nan"), float("nan"), float("nan"), dt)

    for i in range(args.warmup + args.steps):
        if graphed and i == args.warmup:
            make_capturable(opt)
            t0 = time.perf_counter()
            graph = GraphedStep(whole_step, lambda: opt.zero_grad(set_to_none=True))
            print(f"  [{name}] captured the step as a CUDA graph in {time.perf_counter() - t0:.1f} s", flush=True)
        before = compiled_graphs()
        loss, dts = step()
        graphs.append(compiled_graphs() - before)
        if i == 0:
            first = dts[-1]
        print(f"  [{name}] step {i} {dts[-1] * 1e3:.0f} ms (fwd {dts[0] * 1e3:.0f}, bwd {dts[1] * 1e3:.0f}, "
              f"opt {dts[2] * 1e3:.0f}) loss {loss:.4f}" + (f", {graphs[-1]} graphs compiled" if graphs[-1] else ""),
              flush=True)
        if i >= args.warmup:
            for key, dt in zip(phases, dts):
                phases[key].append(dt)
    med = {k: sorted(v)[len(v) // 2] for k, v in phases.items()}
    res = {"first_step_s": first, "step_s": med["step"], "forward_s": med["forward"], "backward_s": med["backward"],
           "optimizer_s": med["optimizer"], "tokens_per_s": args.batch_size * args.seq_len / med["step"],
           "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9, "last_loss": loss}
    if any(graphs):
        res["graphs_compiled_per_step"] = graphs
    if profile_to is not None:
        res["profile_top"] = profile_step(step, profile_to / f"{name}.profile.txt")
    if args.find_syncs:
        res["host_syncs"] = find_syncs(step)
    return res


def device_busy_us(prof) -> float:
    """Microseconds in which at least one kernel (or device copy) ran, from a profile's device events: the union of
    their intervals. Against the step's wall time it says how much of the step the GPU sat idle, waiting for the host
    (a step bound by Python and launches, or by a host sync) rather than being the limit itself."""
    from torch.autograd import DeviceType
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def profile_step(step, path: Path) -> list[dict]:
    """One more step under torch.profiler: the 40 ops with the most device time (self), as a table and rows, and
    under the table the 25 with the most host time (self: a host-bound step's launches and waits). The table's first
    line counts the kernels run, their device time in all (nested ops count twice there), the time the device was
    busy (`device_busy_us`) and the step's wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    wall_ms = (time.perf_counter() - t0) * 1e3
    busy_ms = device_busy_us(prof) / 1e3
    events = prof.key_averages()

    def dev_us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
    total = sum(dev_us(e) for e in events)
    kernels = sum(e.count for e in events if e.device_type == DeviceType.CUDA)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{kernels} kernels, {total / 1e3:.2f} ms of device time; device busy {busy_ms:.1f} ms of the "
                    f"profiled step's {wall_ms:.1f} ms wall (profiler overhead included)\n"
                    + events.table(sort_by="self_cuda_time_total", row_limit=40) + "\n\nBy host time:\n"
                    + events.table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
    rows = sorted(events, key=dev_us, reverse=True)[:40]
    print(f"  profiled step: device busy {busy_ms:.1f} ms of {wall_ms:.1f} ms wall", flush=True)
    return [{"op": "(device busy, ms; wall ms)", "self_device_ms": busy_ms, "share": busy_ms / wall_ms, "calls": 1}] + [
        {"op": e.key, "self_device_ms": dev_us(e) / 1e3, "share": dev_us(e) / max(total, 1), "calls": e.count}
        for e in rows]


def find_syncs(step) -> list[dict]:
    """One more step with CUDA's sync debug mode on: every operation that makes the host wait for the device (an
    `.item()`, a `nonzero`, a copy to the CPU) warns; each distinct site is returned as the innermost frames of
    openk3 / fla / transformers code that led to it, with its count. A sync inside the forward or backward stalls
    the launch queue there, so the device idles while the host catches up."""
    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if any(k in f.filename for k in ("openk3", "/fla/", "transformers", "vs_transformers"))]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))
        sites[where] = sites.get(where, 0) + 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning and the filters on the way out
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for where, n in sites.items():
        print(f"  sync x{n}: {where}", flush=True)
    return [{"site": w, "count": n} for w, n in sites.items()]


def fused_adamw(model) -> torch.optim.AdamW:
    """The bf16-weights baseline's optimizer, the same for both implementations."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95),
                             weight_decay=0.1, fused=True)


def openk3_run(name: str, ckpt: Path | None, config, recipe: str | None, packed: bool, qat: bool, ids, args,
               profile_to, compile: bool = False, graphed: bool = False) -> dict:
    """recipe: None (bf16 weights, fused AdamW), "copy" (fp32 masters, a bf16 copy computes, Muon + AdamW) or
    "autocast" (fp32 parameters under bf16 autocast, Muon + AdamW). graphed: the steps after the warm-up replay one
    CUDA graph of the whole step (the forward without its host-syncing id check)."""
    torch.manual_seed(0)
    if ckpt is not None:
        model = load_pretrained(ckpt, device="cuda", dtype=torch.float32 if recipe else torch.bfloat16, qat=qat)
    else:
        with torch.device("cuda"):
            model = K3ForCausalLM(config, qat=qat)
        if not recipe:
            model.cast(torch.bfloat16)
    model.train()
    bf16 = BF16Compute(model) if recipe == "copy" else None
    runs = model if bf16 is None else bf16.model
    if compile:  # before the optimizer, as `openk3 train --compile` orders it
        compile_layers(runs, "inductor")
    opt = build_optimizer(model, lr=1e-4, head_dims=model_head_dims(model.config)) if recipe else fused_adamw(model)
    if bf16 is not None:
        opt = MasterStep(bf16, opt)
    B, T = ids.shape
    labels = ids.roll(-1, 1)
    cu = torch.arange(0, B * T + 1, T // 4, device="cuda") if packed else None

    def forward_loss():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=recipe == "autocast"):
            return runs(ids, labels=labels, cu_seqlens=cu, loss_chunk=args.loss_chunk, validate=not graphed).loss

    res = time_training(name, forward_loss, opt, args, profile_to, graphed=graphed)
    res["doc_len"] = T // 4 if packed else T
    res["mfu"] = flops_per_token(model.config, res["doc_len"]) * res["tokens_per_s"] / args.peak
    del model, runs, bf16, opt
    free()
    return res


def transformers_run(ckpt: Path, ids, args, profile_to) -> dict:
    from transformers import KimiLinearForCausalLM
    torch.manual_seed(0)
    model = KimiLinearForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda()
    model.train()
    opt = fused_adamw(model)

    def forward_loss():
        return model(input_ids=ids, labels=ids).loss

    res = time_training("transformers", forward_loss, opt, args, profile_to)
    res["doc_len"] = ids.shape[1]
    del model, opt
    free()
    return res


@torch.no_grad()
def compare_logits(ckpt: Path, vocab: int) -> dict:
    """fp32 logits on one random [2, 256] batch: openk3 (fla kernels), openk3 with its PyTorch KDA, transformers.
    The openk3-vs-openk3 row measures how far fla's kernels alone move this random model's logits (its router
    scores are near ties, so tiny differences can change which experts a token takes)."""
    from transformers import KimiLinearForCausalLM
    ids = torch.randint(0, vocab, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    logits = {}
    for name, env in (("openk3_fla", None), ("openk3_torch", "torch")):
        if env:
            os.environ["OPENK3_KDA_BACKEND"] = env
        ours = load_pretrained(ckpt, device="cuda", dtype=torch.float32).eval()
        logits[name] = ours(ids).logits.float()
        os.environ.pop("OPENK3_KDA_BACKEND", None)
        del ours
        free()
    theirs = KimiLinearForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
    logits["transformers"] = theirs(input_ids=ids).logits.float()
    del theirs
    free()

    def diff(a, b):
        return {"max_abs_diff": (a - b).abs().max().item(), "rel_diff": ((a - b).norm() / b.norm()).item()}
    return {"max_abs_logit": logits["transformers"].abs().max().item(),
            "openk3_fla_vs_transformers": diff(logits["openk3_fla"], logits["transformers"]),
            "openk3_torch_vs_transformers": diff(logits["openk3_torch"], logits["transformers"]),
            "openk3_fla_vs_openk3_torch": diff(logits["openk3_fla"], logits["openk3_torch"])}


def table(runs: dict, base: str = "transformers") -> str:
    ref = runs.get(base, {}).get("tokens_per_s")

    def ms(x):
        return "-" if x != x else f"{x * 1e3:.0f}"  # NaN: a graph replay has no phase split
    lines = [f"| run | tokens/s | vs {base} | step ms | fwd / bwd / opt ms | peak GB | MFU | first step s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        if "tokens_per_s" not in r:
            lines.append(f"| {name} | failed: {r.get('error', '?')[:80]} | | | | | | |")
            continue
        x = f"{r['tokens_per_s'] / ref:.2f}x" if ref else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {x} | {r['step_s'] * 1e3:.0f} | "
                     f"{ms(r['forward_s'])} / {ms(r['backward_s'])} / {ms(r['optimizer_s'])} | "
                     f"{r['peak_memory_gb']:.1f} | {mfu} | {r['first_step_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="kimi-linear-1.5b")
    ap.add_argument("--features-config", default="k3-1.5b")
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--ablate", action="store_true", help="also each K3 feature alone on top of --config")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--loss-chunk", type=int, default=0, help="openk3's chunked loss (tokens per chunk), 0 = off")
    ap.add_argument("--profile", action="store_true", help="profile one extra step of every run (top ops -> JSON)")
    ap.add_argument("--find-syncs", action="store_true",
                    help="one more step of every run in CUDA's sync debug mode: where the host waits (-> JSON)")
    ap.add_argument("--skip-logits", action="store_true", help="skip the fp32 logits comparison")
    ap.add_argument("--dump-fla-configs", default=None,
                    help="after the runs, write fla's tuned kernel configs here (openk3/ops/kda/tuned.py)")
    ap.add_argument("--out", default="bench/results/vs_transformers_train.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    kda = select_kda_backend("cuda")  # first: it points fla at the shipped kernel configs before fla is imported
    # transformers' KimiLinear runs fla's layers: their kernels autotune the way openk3's do (at most 3 candidates
    # unless OPENK3_FLA_AUTOTUNE=full), so both sides are tuned alike
    print(f"fla: {limit_fla_autotuning(FLA_MODULES + ('fla.layers', 'fla.modules'))} more kernels cut to "
          f"{autotune_candidates() or 'all'} autotune candidates; {kda}")
    hw = torch.cuda.get_device_name(0)
    args.peak = PEAK_BF16.get(hw, 989e12)
    config = get_config(args.config)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prof_dir = out.parent / "vs_transformers_profiles" if args.profile else None
    result = {"hardware": f"{hw}, torch {torch.__version__}, {platform.python_version()}",
              "command": " ".join(sys.argv), "config": {"name": args.config, **count_params(config)},
              "batch": [args.batch_size, args.seq_len], "kda_backend": str(kda),
              "fla_autotune_candidates": autotune_candidates(),
              "moe_backend": select_moe_backend("cuda", torch.bfloat16).reason, "runs": {}}
    try:
        import transformers
        result["transformers"] = transformers.__version__
    except ImportError:
        transformers = None
    runs = [r for r in args.runs.split(",") if r]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        raise SystemExit(f"unknown run(s) {bad}; choose from {RUNS}")
    gen = torch.Generator("cuda").manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device="cuda", generator=gen)

    def save():
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(out)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "model"
        torch.manual_seed(0)
        with torch.device("cuda"):
            save_pretrained(K3ForCausalLM(config), ckpt)
        free()
        if transformers is not None and "transformers" in runs and not args.skip_logits:
            result["logits_fp32"] = compare_logits(ckpt, config.vocab_size)
            print("fp32 logits, openk3 vs transformers:", result["logits_fp32"], flush=True)
            save()
        todo = []
        for name in runs:
            if name == "transformers":
                if transformers is None:
                    result["runs"][name] = {"error": "transformers is not installed"}
                    continue
                todo.append((name, lambda: transformers_run(ckpt, ids, args, prof_dir)))
            elif name.startswith("openk3_k3_features"):
                qat = name.endswith("_qat")
                fc = get_config(args.features_config)
                todo.append((name, lambda fc=fc, qat=qat, n=name: openk3_run(n, None, fc, "copy", False, qat, ids,
                                                                             args, prof_dir)))
            else:
                graphed = name.endswith("_graphed")
                compiled = name.removesuffix("_graphed").endswith("_compiled")
                base = name.removesuffix("_graphed").removesuffix("_compiled")
                recipe = {"openk3_recipe": "copy", "openk3_recipe_autocast": "autocast"}.get(base)
                todo.append((name, lambda n=name, b=base, r=recipe, c=compiled, g=graphed: openk3_run(
                    n, ckpt, config, r, b == "openk3_packed", False, ids, args, prof_dir, compile=c, graphed=g)))
        if args.ablate:
            for feat, fc in ablations(config).items():
                n = f"ablate_{feat}"
                todo.append((n, lambda fc=fc, n=n, q=(feat == "qat"): openk3_run(n, None, fc, None, False, q, ids,
                                                                                 args, None)))
            todo.append(("ablate_none", lambda: openk3_run("ablate_none", None, config, None, False, False, ids,
                                                           args, None)))
        for name, fn in todo:
            print(f"== {name}", flush=True)
            try:
                result["runs"][name] = fn()
            except torch.OutOfMemoryError as e:
                result["runs"][name] = {"error": f"out of memory: {str(e)[:200]}"}
                free()
            except Exception as e:  # noqa: BLE001 -- one failing run (a capture refused, say) must not lose the rest
                traceback.print_exc()
                result["runs"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                free()
            if args.dump_fla_configs:  # after every run: a timeout later still leaves the configs tuned so far
                import triton
                from openk3.ops.kda.tuned import dump_fla_configs
                result["fla_configs_dumped"] = dump_fla_configs(args.dump_fla_configs, triton.__version__)
            save()
            print(table(result["runs"]), flush=True)
    print(f"hardware: {result['hardware']}\n{table(result['runs'])}\n-> {out}")


if __name__ == "__main__":
    main()
