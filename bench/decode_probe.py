"""Where a decode step and a prefix-hit turn spend their time on the GPU (issue #12): wall time against the time the
device is busy, and the kernels, from torch.profiler. Complements bench/vs_transformers_decode.py (which times
whole requests against transformers) with the split that says whether a path is bound by its kernels or by the
gaps between them (the host's launches, or a CUDA graph's kernel-to-kernel latency).

    python bench/decode_probe.py kda hit decode:1 decode:16 decode:64 decode:64:c --out bench/results/decode_probe
    python bench/decode_probe.py decode:1 decode:64 --overlap off # the engine's steps not overlapped with the host
    python bench/decode_probe.py run:64 --prefill-chunk 32768    # a batch-64 run with its 64 prompts in one prefill

Parts (any order, each written to <out>/probe.json as it finishes, with its profile table beside it; the first
row of each profile's `top` is the device's busy ms against the wall ms of the profiled steps):

  kda          one KDA layer's cached forward at T = 1 ... 1024 new tokens (batch 1, kimi-linear-1.5b's 16 heads of
               128): fla's chunk path (`chunk_gated`) against the token-by-token kernel (`recurrent_gated`), as
               (ms until the call returns, ms until the device is done), averaged over 10 calls
  hit          a prefix-hit turn of a 32,768-token conversation (its last 257 tokens new): wall ms, then one more
               such turn under the profiler (device busy against wall)
  spec:k       a speculative round of k drafts at batch 1 (early-exit draft of 4 layers): ms a round, the same
               split by phase (the draft's steps, the verification, its rollback, the draft's restore), 10 rounds profiled
  prefill:L[:B[:C]]  B (default 1) prompts of L tokens prefilled with `prefill_chunk` C (default the bench's
               8,192) until each has its first token: wall ms (after an untimed run at the same shapes), then one
               more such run under the profiler
  attn         a cached chunk's attention at kimi-linear-1.5b's heads (16 x qk 192, v 128, bf16), T new tokens after
               S - T cached, at shapes not seen before in the process: ms of the first call (cuDNN builds an
               execution plan per new shape) and of a repeat, for cuDNN's two merged parts and the varlen flash kernel;
               then a prompt's first chunk (T x T, plain causal) through SDPA's order (cuDNN first) and varlen
  prefill-modules:L[:B[:C]]  modules:B's split for prefill:L:B:C, its path (static runs up to 512 tokens a row) run
               eagerly, to <out>/prefill_modules_<L>_b<B>_c<C>.json
  modules:B    the kernels of one eager fast-path decode step (no CUDA graphs, so each kernel can be traced to its
               module) of B rows, grouped by the module that launched them (each layer's mixer, router, experts,
               shared experts, dense MLP, norms; the rest as "step"): count and device us a step, and each group's
               kernel names in order, written to <out>/modules_b<B>.json
  recurrent    fla's token-by-token KDA kernel over the slot pool at batch 1 / 16 / 64 over its state columns a
               program and warps, against fla's wrapper and a copy of the same states: us a call
  router       the router kernel over its tiles and warps against the eager chain (cuBLAS, sigmoid, selection):
               us a call at kimi-linear-1.5b's and K3's shapes
  mla          the paged MLA decode kernel over its key splits and key blocks at batch 1, 16, 64: us a call
  linear       cuBLAS's F.linear against openk3/ops/gemv.py's kernel (at one row also with 2 and 8 warps a program) at
               kimi-linear-1.5b's decode shapes, 1 / 2 / 4 rows, each timed as a CUDA graph of 20 calls over 20
               weights (one a call): us a call and the weight bytes read a second
  timeline:B   one engine step of B rows on its default path (CUDA graphs), every kernel in the order the device ran
               it: its duration and the idle gap before it; totals (kernels, device-busy us, gap us, the span from
               the first kernel's start to the last one's end) and the names by device time, to
               <out>/timeline_b<B>.json
  runs:B:N     N timed runs of B prompts (the decode benchmark's), each with the allocator's device allocations,
               frees and retries, Python's garbage collections and the SM clock before it: what differs between a
               run whose prefill is slow and one whose is not
  run:B        a whole decode benchmark run of B prompts (vs_transformers_decode.py's): the host's ms in each engine
               phase, the lines where it waits for the device (sync debug mode), the device's busy and idle time
               and its largest gaps, to <out>/run_b<B>.json
  decode:B     B requests of 512-token prompts in the engine's decode batch (its default path: CUDA graphs): the
               wall ms of an engine step (20 steps), then 10 steps under the profiler; decode:B:c with the compiled
               step (`compile_decode`)

kimi-linear-1.5b, random weights (the vs_transformers_decode checkpoint), bf16, CUDA only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import greedy, hardware, random_prompts  # noqa: E402
from bench.moe_gemv import time_graph  # noqa: E402
from bench.vs_transformers import profile_step  # noqa: E402
from bench.vs_transformers_decode import build_checkpoint, engine_for, parse_args as bench_args  # noqa: E402
from openk3.serve.cache import PagePool  # noqa: E402


def timed(fn, n: int = 10) -> tuple[float, float]:
    """(ms a call until it returns, ms a call until the device is done), over n calls."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return host * 1e3, (time.perf_counter() - t0) / n * 1e3


@torch.inference_mode()
def part_kda(model) -> dict:
    from openk3.ops.kda import fused as kf
    layer = next(layer.self_attn for layer in model.model.layers if layer.is_kda)
    H, K = layer.H, layer.K
    out = {}
    for T in (1, 5, 64, 257, 512, 1024):
        q, k, v, f = (torch.randn(1, T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        beta = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)
        s0 = torch.randn(1, H, K, K, device="cuda") * 0.01
        args = (q, k, v, f)

        def chunk():
            return kf.chunk_gated(*args, torch.sigmoid(beta.float()), layer.A_log.float(), layer.dt_bias.float(),
                                  layer.lower_bound, K ** -0.5, None, s0)

        def recurrent():
            return kf.recurrent_gated(*args, beta, layer.A_log, layer.dt_bias, layer.lower_bound, K ** -0.5, s0)
        chunk(), recurrent()  # compile and tune first
        out[str(T)] = {"chunk": timed(chunk), "recurrent": timed(recurrent)}
        print(f"  kda T={T:5d}: chunk {out[str(T)]['chunk'][1]:.3f} ms, token by token "
              f"{out[str(T)]['recurrent'][1]:.3f} ms", flush=True)
    return out


def part_hit(model, args, rng, out_dir: Path) -> dict:
    V, L = model.config.vocab_size, 32768
    ckpt = PagePool(model.config, 2, args.page_size, "meta", torch.bfloat16).checkpoint_pages
    engine = engine_for(model, args, 1, num_pages=3 * -(-L // args.page_size) + (L // 2048 + 4) * ckpt)

    def next_turn() -> list[int]:
        first = random_prompts(1, L - 256 - 64, V, rng)[0]
        reply = engine.generate([first], greedy(64))[0].output
        return first + reply + random_prompts(1, 256, V, rng)[0]

    def serve(turn: list[int]):
        req = engine.submit(turn, greedy(1))
        while not req.finished:
            engine.step()
        return req
    serve(next_turn())  # untimed: every kernel of these shapes compiled and tuned
    turn = next_turn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    req = serve(turn)
    torch.cuda.synchronize()
    out = {"hit_ms": (time.perf_counter() - t0) * 1e3, "cached": req.cached_tokens}
    turn = next_turn()
    out["profile_top"] = profile_step(lambda: serve(turn), out_dir / "hit.txt")[:25]
    print(f"  prefix hit: {out['hit_ms']:.1f} ms ({req.cached_tokens} tokens cached)", flush=True)
    return out


def decoding(model, args, rng, B: int):
    """An engine with B requests of 512-token prompts decoding (their buckets captured, five steps run) -> (engine,
    requests)."""
    engine = engine_for(model, args, B, prefix_cache=False)
    prompts = random_prompts(B, 512, model.config.vocab_size, rng)
    engine.generate(prompts, greedy(16))  # captures (and compiles) the buckets
    reqs = [engine.submit(p, greedy(200)) for p in prompts]
    while any(r.status != "running" for r in reqs):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    return engine, reqs


def part_decode(model, args, rng, B: int, compiled: bool, out_dir: Path) -> dict:
    args.compile_decode = compiled
    engine, reqs = decoding(model, args, rng, B)
    t0 = time.perf_counter()
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / 20 * 1e3
    name = f"decode_b{B}{'_compiled' if compiled else ''}.txt"
    rows = profile_step(lambda: [engine.step() for _ in range(10)], out_dir / name)
    for r in reqs:
        engine.cancel(r.id)
    engine.step()
    print(f"  decode batch {B}{' compiled' if compiled else ''}: {step_ms:.2f} ms a step "
          f"(device busy {rows[0]['self_device_ms'] / 10:.2f} ms a step under the profiler)", flush=True)
    return {"step_ms": step_ms, "top": rows[:30]}


def module_groups(model, run) -> dict:
    """The kernels `run()` launches (eagerly: no CUDA graphs, so each kernel can be traced to its module), grouped by
    the module that launched them (each layer's mixer, router, experts, shared experts, dense MLP, norms; the rest as
    "step") -> {"total": {kernels, device_us}, "groups": {group: {kernels, device_us, names}}} by device time."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    names, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        kind = "kda" if layer.is_kda else "mla"
        parts = {"mixer": layer.self_attn, "in_norm": layer.input_layernorm, "post_norm": layer.post_attention_layernorm}
        parts["layer"] = layer  # the residual adds (the innermost range names a kernel's group)
        if hasattr(layer, "block_sparse_moe"):
            moe = layer.block_sparse_moe
            parts.update(moe=moe, router=moe.gate, experts=moe.experts)
            if hasattr(moe, "shared_experts"):
                parts["shared"] = moe.shared_experts
        else:
            parts["mlp"] = layer.mlp
        for part, module in parts.items():
            names[module] = f"{kind}.{part}" if part not in ("mixer",) else kind
    names[model.lm_head] = "lm_head"

    def enter(module, inputs):
        module._probe_range = record_function("probe:" + names[module])
        module._probe_range.__enter__()

    def leave(module, inputs, output):
        module._probe_range.__exit__(None, None, None)
    for module in names:
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    groups: dict[str, dict] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CPU or not e.kernels or e.name.startswith("probe:"):
            continue
        parent, group = e.cpu_parent, "step"
        while parent is not None:
            if parent.name.startswith("probe:"):
                group = parent.name[len("probe:"):]
                break
            parent = parent.cpu_parent
        g = groups.setdefault(group, {"kernels": 0, "device_us": 0.0, "names": {}})
        for k in e.kernels:
            g["kernels"] += 1
            g["device_us"] += k.duration
            key = f"{e.name} | {k.name[:60]}"
            g["names"][key] = g["names"].get(key, 0) + 1
    total = {key: sum(g[key] for g in groups.values()) for key in ("kernels", "device_us")}
    order = sorted(groups, key=lambda k: -groups[k]["device_us"])
    return {"total": total, "groups": {k: groups[k] for k in order}}


def report_groups(label: str, found: dict, path: Path) -> dict:
    """Prints `module_groups`' result under `label`, writes it whole to `path` -> the totals and each group's sums."""
    total, groups = found["total"], found["groups"]
    print(f"  {label}: {total['kernels']} kernels, {total['device_us']:.0f} us of device time")
    for k, g in groups.items():
        print(f"    {k:16s} {g['kernels']:5d} kernels {g['device_us']:8.1f} us")
    path.write_text(json.dumps(found, indent=1))
    return {"total": total,
            "groups": {k: {"kernels": g["kernels"], "device_us": g["device_us"]} for k, g in groups.items()}}


def part_modules(model, args, rng, B: int, out_dir: Path) -> dict:
    engine = engine_for(model, args, B, prefix_cache=False, cuda_graphs=False)
    reqs = [engine.submit(p, greedy(200)) for p in random_prompts(B, 512, model.config.vocab_size, rng)]
    while any(r.status != "running" for r in reqs):
        engine.step()
    for _ in range(3):
        engine.step()
    found = module_groups(model, engine.step)
    for r in reqs:
        engine.cancel(r.id)
    engine.step()
    return report_groups(f"modules batch {B} (a step)", found, out_dir / f"modules_b{B}.json")


def prefill_engine(model, args, L: int, B: int, chunk: int, **kw):
    """An engine for B prompts of L tokens prefilled in chunks of `chunk` tokens (pages for them and a few more)."""
    args = argparse.Namespace(**{**vars(args), "prefill_chunk": chunk})
    return engine_for(model, args, B, prefix_cache=False, num_pages=B * (-(-(L + 8) // args.page_size) + 1) + 2, **kw)


def part_prefill_modules(model, args, rng, L: int, B: int, chunk: int, out_dir: Path) -> dict:
    """`modules:B` for a prefill of B prompts of L tokens (chunks of `chunk` tokens) until each has its first token:
    the path the engine takes with CUDA graphs (a chunk of at most STATIC_PREFILL_TOKENS a row as static runs), run
    eagerly."""
    engine = prefill_engine(model, args, L, B, chunk, cuda_graphs=False)
    engine.target.static_prefill = engine.target.decoder is not None  # as with graphs
    engine.generate(random_prompts(B, L, model.config.vocab_size, rng), greedy(1))  # untimed: compiled and tuned
    prompts = random_prompts(B, L, model.config.vocab_size, rng)
    found = module_groups(model, lambda: engine.generate(prompts, greedy(1)))
    return report_groups(f"prefill modules {B} x {L} tokens, chunk {chunk}", found,
                         out_dir / f"prefill_modules_{L}_b{B}_c{chunk}.json")


def kernel_timeline(prof) -> tuple[list[dict], dict, list]:
    """The device's kernels of a profile in the order they ran -> (a row per kernel: name, us, the idle gap before
    it; totals: kernels, busy us, gap us, span us; {name, count, us} by device time)."""
    from torch.autograd import DeviceType
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    rows, end, by_name = [], None, {}
    for e in kernels:
        start, dur = e.time_range.start, e.time_range.elapsed_us()
        gap = 0.0 if end is None else max(0.0, start - end)
        end = max(end or 0.0, start + dur)
        rows.append({"name": e.name[:90], "us": round(dur, 2), "gap_us": round(gap, 2)})
        g = by_name.setdefault(e.name[:90], [0, 0.0])
        g[0] += 1
        g[1] += dur
    busy = sum(r["us"] for r in rows)
    gaps = sum(r["gap_us"] for r in rows)
    span = (end - kernels[0].time_range.start) if kernels else 0.0
    total = {"kernels": len(rows), "busy_us": busy, "gap_us": gaps, "span_us": span}
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return rows, total, [{"name": k, "count": n, "us": us} for k, (n, us) in top]


def part_timeline(model, args, rng, B: int, out_dir: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine, reqs = decoding(model, args, rng, B)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    for r in reqs:
        engine.cancel(r.id)
    engine.step()
    rows, total, top = kernel_timeline(prof)
    print(f"  timeline batch {B}: {len(rows)} kernels, {total['busy_us']:.0f} us busy + {total['gap_us']:.0f} us gaps "
          f"= {total['span_us']:.0f} us span")
    for r in top[:25]:
        print(f"    {r['us']:8.1f} us {r['count']:4d}x  {r['name']}")
    (out_dir / f"timeline_b{B}.json").write_text(json.dumps({"total": total, "by_name": top, "kernels": rows},
                                                            indent=1))
    return {"total": total, "top": top[:25]}


def part_run(model, args, rng, B: int, out_dir: Path) -> dict:
    """A whole benchmark run (B prompts of 512 tokens, `--decode-tokens` greedy tokens each, as
    vs_transformers_decode.py's decode part times it) split three ways: the host's time in each engine phase (no
    syncs added), the Python lines where the host waited for the device (torch's sync debug mode), and the device's
    kernels with the idle gaps between them (the largest ones with their neighbours)."""
    import traceback
    import warnings
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    engine = engine_for(model, args, B, prefix_cache=False)
    prompts = random_prompts(B, 512, model.config.vocab_size, rng)
    tokens = args.decode_tokens
    engine.generate(prompts, greedy(tokens))  # untimed: captures the buckets

    def timed_run() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, greedy(tokens))
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3
    out = {"ms": timed_run(), "tokens": B * tokens}
    # the host's time in each phase: the engine's steps, and inside them the prefill's and the decode's parts
    # (wrappers set as instance attributes for this one run, whatever was there before put back after it)
    phases: dict[str, list[float]] = {}
    owners = [(engine, ("step", "_admit", "_prefill", "_prefill_group", "_prefilled", "_decode", "_retire",
                        "_launch_static", "_collect_static")),
              (engine.target, ("forward", "join", "collect", "launch_decode")),
              (engine.target.decoder, ("prefill", "_launch")),
              (engine.target.slots, ("take_rows", "read"))]
    missing = object()
    saved = [(owner, name, owner.__dict__.get(name, missing)) for owner, names in owners for name in names
             if hasattr(owner, name)]

    def wrap(fn, key):
        def timed_call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                ph = phases.setdefault(key, [0, 0.0])
                ph[0] += 1
                ph[1] += (time.perf_counter() - t0) * 1e3
        return timed_call
    try:
        for owner, name, _ in saved:
            setattr(owner, name, wrap(getattr(owner, name), f"{type(owner).__name__}.{name}"))
        out["phased_ms"] = timed_run()
    finally:
        for owner, name, before in saved:
            if before is missing:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, before)
    out["host_ms"] = {k: {"calls": n, "ms": round(ms, 3)} for k, (n, ms) in phases.items()}
    # where the host waits: every sync torch's debug mode reports, by the three innermost openk3 / bench lines
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/openk3/" in f.filename or "/bench/" in f.filename]
        sites[" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[::-1][:3])] += 1
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out["synced_ms"] = timed_run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    out["sync_sites"] = dict(sites.most_common(25))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out["profiled_ms"] = timed_run()
    rows, total, top = kernel_timeline(prof)
    largest = sorted(range(1, len(rows)), key=lambda i: -rows[i]["gap_us"])[:20]
    out["timeline"] = total
    out["gaps_over_50us"] = {"count": sum(r["gap_us"] > 50 for r in rows),
                             "us": sum(r["gap_us"] for r in rows if r["gap_us"] > 50)}
    out["largest_gaps"] = [{"gap_us": rows[i]["gap_us"], "after": rows[i - 1]["name"], "before": rows[i]["name"]}
                           for i in sorted(largest)]
    out["by_name"] = top[:30]
    print(f"  run batch {B}: {out['ms']:.1f} ms ({B * tokens / out['ms'] * 1e3:.0f} tokens/s); profiled: "
          f"{total['kernels']} kernels, {total['busy_us'] / 1e3:.1f} ms busy + {total['gap_us'] / 1e3:.1f} ms idle, "
          f"{out['gaps_over_50us']['count']} gaps over 50 us ({out['gaps_over_50us']['us'] / 1e3:.1f} ms)")
    for k, v in sorted(out["host_ms"].items(), key=lambda kv: -kv[1]["ms"]):
        print(f"    host {v['ms']:8.2f} ms {v['calls']:5d}x  {k}")
    for site, n in out["sync_sites"].items():
        print(f"    sync {n:5d}x  {site}")
    (out_dir / f"run_b{B}.json").write_text(json.dumps(out, indent=1))
    return out


def part_runs(model, args, rng, B: int, n: int) -> dict:
    """n timed runs of B prompts of 512 tokens, `--decode-tokens` greedy tokens each, timed as
    vs_transformers_decode.py's decode part times a run (here with new prompts every run, after one untimed run), each
    with what could make one run's prefill slower than another's: the caching allocator's device allocations, frees,
    retries and synchronisations of all streams during the run, Python's garbage collections during it (generation and
    ms of each), and the SM clock (NVML; None without pynvml) just before it starts."""
    import gc

    from bench.vs_transformers_decode import prefill_and_step, timed_engine_run

    engine = engine_for(model, args, B, prefix_cache=False)
    engine.generate(random_prompts(B, 512, model.config.vocab_size, rng), greedy(args.decode_tokens))  # captures
    pauses = []
    started = {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - started.pop("t", time.perf_counter())) * 1e3))
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    runs = []
    gc.callbacks.append(on_gc)
    try:
        for _ in range(n):
            prompts = random_prompts(B, 512, model.config.vocab_size, rng)
            pauses.clear()
            before = torch.cuda.memory_stats()
            try:
                clock = torch.cuda.clock_rate()
            except ModuleNotFoundError:  # pynvml is not installed
                clock = None
            seconds, reqs = timed_engine_run(engine, prompts, args.decode_tokens, args.device)
            after = torch.cuda.memory_stats()
            ttft, ms_per_step = prefill_and_step(reqs, args.decode_tokens)
            run = {"tokens_per_s": sum(len(r.output) for r in reqs) / seconds, "prefill_ms": 1e3 * ttft,
                   "ms_per_step": ms_per_step, "sm_clock_mhz_before": clock,
                   "allocator": {k: after.get(k, 0) - before.get(k, 0) for k in keys},
                   "gc": [{"generation": g, "ms": round(ms, 3)} for g, ms in pauses]}
            runs.append(run)
            print(f"  batch {B}: {run['tokens_per_s']:8.1f} tokens/s, prefill {run['prefill_ms']:6.1f} ms, "
                  f"{run['ms_per_step']:.3f} ms a step, SM {clock} MHz before, allocator {run['allocator']}, "
                  f"gc {[(g, round(ms, 2)) for g, ms in pauses]}", flush=True)
    finally:
        gc.callbacks.remove(on_gc)
    return {"runs": runs}


def part_linear() -> dict:
    import torch.nn.functional as F

    from openk3.ops.gemv import gemv

    shapes = {"kda in (qkv, f_a, g_a, b)": (1536, 6416), "kda o_proj": (2048, 1536), "kda f_b / g_b": (128, 2048),
              "shared gate_up": (1536, 1024), "shared down": (512, 1536), "dense gate_up": (1536, 8192),
              "dense down": (4096, 1536), "lm_head": (1536, 32000)}
    out = {}
    for name, (K, N) in shapes.items():
        # 20 weights, one a call: each call reads its weight from HBM as a decode step does (20 x the largest,
        # 0.98 GB, is past the 50 MB L2; 20 x the smallest, 10 MB, is not)
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(20)]
        for T in (1, 2, 4):
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            it = iter(range(10 ** 9))
            cublas = time_graph(lambda: F.linear(x, ws[next(it) % 20]), 20, 10)
            triton_us = time_graph(lambda: gemv(x, ws[next(it) % 20]), 20, 10)
            err = ((gemv(x, ws[0]).float() - F.linear(x, ws[0]).float()).norm() / F.linear(x, ws[0]).float().norm()).item()
            gbs = N * K * 2 / 1e3
            out[f"{name} T={T}"] = {"cublas_us": cublas, "gemv_us": triton_us, "rel_err": err,
                                    "cublas_GBps": gbs / cublas, "gemv_GBps": gbs / triton_us}
            # the kernel at other warps a program (one row: the rows it runs)
            others = {n: time_graph(lambda n=n: gemv(x, ws[next(it) % 20], warps=n), 20, 10)
                      for n in (2, 8)} if T == 1 else {}
            out[f"{name} T={T}"].update({f"gemv_us_warps{n}": us for n, us in others.items()})
            print(f"  {name:28s} T={T}  cuBLAS {cublas:7.2f} us ({gbs / cublas:5.0f} GB/s)  gemv {triton_us:7.2f} us "
                  f"({gbs / triton_us:5.0f} GB/s)" + "".join(f", {n} warps {us:.2f} us" for n, us in others.items())
                  + f"  rel err {err:.1e}", flush=True)
    return out


def part_recurrent() -> dict:
    """fla's token-by-token KDA kernel over the engine's slot pool (`recurrent_pool_step`: one layer's decode-step
    recurrence at kimi-linear-1.5b's 16 heads of 128, bf16 inputs, fp32 states updated in place) at batch 1 / 16 / 64
    over (BV state columns a program, warps), against fla's own wrapper (BV 32, 4 warps) and a copy of the same
    states (each read and written once: the floor of an in-place update). Each timed as a CUDA graph of 20 calls
    cycling over enough pools (>= 256 MB) that the states come from HBM, as in a step: us a call, the state bytes
    moved (read + written) a second, and each variant's largest difference from the wrapper's output and states."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from openk3.ops.kda.fused import recurrent_pool_step

    H, K = 16, 128
    variants = [(8, 1), (8, 2), (16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (64, 4), (64, 8), (128, 4),
                (128, 8)]
    out = {}
    for B in (1, 16, 64):
        gen = torch.Generator(device="cuda").manual_seed(B)
        q, k, v, f = (torch.randn(B, 1, H, K, device="cuda", generator=gen).bfloat16() for _ in range(4))
        beta = torch.randn(B, 1, H, device="cuda", generator=gen).bfloat16()
        A_log = torch.rand(H, device="cuda", generator=gen).mul(3).log1p()
        dt_bias = torch.randn(H * K, device="cuda", generator=gen)
        state_bytes = B * H * K * K * 4
        n = max(20, -(-(256 << 20) // state_bytes))
        pools = [torch.randn(B + 1, H, K, K, device="cuda", generator=gen) * 0.1 for _ in range(n)]
        idx = torch.randperm(B + 1, device="cuda", generator=gen)[:B].int()
        copies = [torch.empty(B, H, K, K, device="cuda") for _ in range(n)]
        args = dict(q=q, k=k, v=v, g=f, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5, lower_bound=None,
                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)

        def fla(pool):
            return fused_recurrent_kda_fwd(initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                                           out=torch.empty_like(v), **args)[0]

        def ours(pool, bv, w):
            return recurrent_pool_step(initial_state=pool, state_indices=idx, out=torch.empty_like(v), block_v=bv,
                                       warps=w, **args)

        base = pools[0].clone()  # (the timings below update the pools in place)
        ref_pool = base.clone()
        ref_o = fla(ref_pool)
        it = iter(range(10 ** 9))
        row = {"copy_us": time_graph(lambda: copies[next(it) % n].copy_(pools[next(it) % n][:B]), 20, 10),
               "fla_us": time_graph(lambda: fla(pools[next(it) % n]), 20, 10)}
        for bv, w in variants:
            pool = base.clone()
            o = ours(pool, bv, w)
            err = max((o.float() - ref_o.float()).abs().max().item(), (pool - ref_pool).abs().max().item())
            row[f"bv{bv}_w{w}"] = {"us": time_graph(lambda bv=bv, w=w: ours(pools[next(it) % n], bv, w), 20, 10),
                                   "max_diff": err}
        gbs = 2 * state_bytes / 1e3
        best = min((key for key in row if key.startswith("bv")), key=lambda key: row[key]["us"])
        print(f"  B={B:3d}  copy {row['copy_us']:6.2f} us ({gbs / row['copy_us']:5.0f} GB/s)  fla {row['fla_us']:6.2f} "
              f"us ({gbs / row['fla_us']:5.0f} GB/s)  best {best} {row[best]['us']:6.2f} us "
              f"({gbs / row[best]['us']:5.0f} GB/s)", flush=True)
        print("         " + "  ".join(f"{key} {val['us']:.2f} ({val['max_diff']:.0e})" for key, val in row.items()
                                    if key.startswith("bv")), flush=True)
        out[str(B)] = {**row, "state_GB_moved": 2 * state_bytes / 1e9, "best": best}
    return out


def part_router() -> dict:
    """The router kernel (ops/router_topk.py) at kimi-linear-1.5b's shape (32 experts, D 1536, top 4) and K3's (896,
    7168, top 16) over its tiles and warps, against the eager chain (cuBLAS's fp32 matmul, the sigmoid, the selection
    kernel), each timed as a CUDA graph of 15 calls over 15 weights."""
    import torch.nn.functional as F

    from openk3.ops.router_topk import route_topk, router_forward

    out = {}
    for E, D, k in ((32, 1536, 4), (896, 7168, 16)):
        ws = [torch.randn(E, D, device="cuda", dtype=torch.bfloat16) * D ** -0.5 for _ in range(15)]
        bias = torch.randn(E, device="cuda") * 0.1
        for T in (1, 16, 64) if E == 32 else (1, 2):
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            it = iter(range(10 ** 9))
            def eager():
                return route_topk(torch.sigmoid(F.linear(x.float(), ws[next(it) % 15].float())), bias, k, True, 1.0)
            row = {"eager_us": time_graph(eager, 15, 10)}
            ref = router_forward(x, ws[0], bias, k, True, 1.0)
            for blocks in (None, (1, 2048), (2, 1024), (4, 512), (8, 256)):
                for warps in (4, 8):
                    got = router_forward(x, ws[0], bias, k, True, 1.0, blocks=blocks, warps=warps)
                    if not torch.equal(got[0], ref[0]):
                        row[f"{blocks} w{warps}"] = "picks differ"
                        continue
                    row[f"{blocks} w{warps}"] = time_graph(
                        lambda: router_forward(x, ws[next(it) % 15], bias, k, True, 1.0, blocks=blocks, warps=warps),
                        15, 10)
            best = min((v, n) for n, v in row.items() if isinstance(v, float) and n != "eager_us")
            print(f"  router E={E} D={D} T={T}: eager {row['eager_us']:.2f} us, default {row['None w4']:.2f} us, "
                  f"best {best[0]:.2f} us ({best[1]})", flush=True)
            out[f"E{E} T{T}"] = row
    return out


def part_mla() -> dict:
    """The paged MLA decode kernel (ops/mla_decode.py) at kimi-linear-1.5b's shape (16 heads, latent 512 + 64, bf16
    pages of 64 tokens, a row's 640 tokens in a 16-page table bucket) over its key splits and key blocks at the
    module's warps and stages, then the warps and stages of the default and the best pair, each timed as a CUDA
    graph of 4 calls over 4 layers' pages (as the step's 4 MLA layers)."""
    from openk3.ops import mla_decode
    from openk3.ops.mla_decode import paged_latent_attention, split_keys, BLOCK_M

    out = {}
    H, r, rope, page, P, seen = 16, 512, 64, 64, 16, 640
    for B in (1, 16, 64):
        pools = [torch.randn(B * P + 1, page, r + rope, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        table = torch.arange(1, B * P + 1, device="cuda").view(B, P)
        visible = torch.full((B,), seen, device="cuda")
        q = torch.randn(B, H, r + rope, device="cuda", dtype=torch.bfloat16)
        it = iter(range(10 ** 9))
        ref = paged_latent_attention(q, pools[0], table, visible, 0.07, r, H)
        default = (split_keys(B, -(-H // BLOCK_M), P * page, page_size=page)[0], mla_decode.BLOCK_N)
        row = {"default_splits": default[0]}

        def sweep_point(splits: int, block_n: int, warps: int, stages: int):
            """us a call, or why not: a wrong result, or a setting that does not compile (shared memory)."""
            kw = dict(splits=splits, block_n=block_n, warps=warps, stages=stages)
            try:
                got = paged_latent_attention(q, pools[0], table, visible, 0.07, r, H, **kw)
            except Exception as error:  # e.g. triton's OutOfResources at large blocks x stages
                return f"{type(error).__name__}: {str(error)[:80]}"
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            if err >= 1e-2:
                return f"err {err:.1e}"
            return time_graph(lambda: paged_latent_attention(q, pools[next(it) % 4], table, visible, 0.07, r, H,
                                                             **kw), 4, 20)
        for block_n in (16, 32, 64):
            for splits in (1, 2, 4, 8, 16, 32, 64):
                row[f"n{block_n} s{splits}"] = sweep_point(splits, block_n, mla_decode.WARPS, mla_decode.STAGES)
        row["default"] = time_graph(lambda: paged_latent_attention(q, pools[next(it) % 4], table, visible, 0.07, r, H),
                                    4, 20)
        best_pair = min((v, n) for n, v in row.items() if isinstance(v, float) and n.startswith("n"))[1]
        pairs = {default, tuple(int(x[1:]) for x in best_pair.split()[::-1])}  # (splits, block_n)
        for splits, block_n in sorted(pairs):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4):
                    row[f"n{block_n} s{splits} w{warps} st{stages}"] = sweep_point(splits, block_n, warps, stages)
        best = min((v, n) for n, v in row.items() if isinstance(v, float))
        print(f"  mla B={B}: default {row['default']:.2f} us ({row['default_splits']} splits), best {best[0]:.2f} us "
              f"({best[1]})", flush=True)
        out[f"B{B}"] = row
    return out


def part_attn() -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from openk3.model.model import SDPA_ORDER, prefix_causal_attention, varlen_causal_attention

    def once(fn) -> float:  # ms until the device is done with one call
        return timed(fn, 1)[1]

    def first_and_repeat(label: str, paths: dict) -> dict:
        """Each path's first call (at a shape new to it) and its best of three repeats, printed after `label`."""
        row = {name: {"first_ms": once(fn), "repeat_ms": min(once(fn) for _ in range(3))} for name, fn in paths.items()}
        print(f"  {label}: " + ", ".join(f"{n} first {r['first_ms']:.2f} ms, then {r['repeat_ms']:.2f}"
                                         for n, r in row.items()), flush=True)
        return row
    out = {}
    for T, S in [(2048, 10240), (2048, 10304), (257, 32768), (300, 5000), (8192, 65536)]:
        q = torch.randn(1, 16, T, 192, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 16, S, 192, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 16, S, 128, device="cuda", dtype=torch.bfloat16)
        cu_q = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, S], dtype=torch.int32, device="cuda")
        paths = {"cudnn": lambda: prefix_causal_attention(q, k, v, 192 ** -0.5),
                 "varlen": lambda: varlen_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           cu_q, T, 192 ** -0.5, keys=(cu_k, S))}
        out[f"{T}x{S}"] = first_and_repeat(f"attention T={T} S={S}", paths)
    for T in (1000, 1001, 3000, 8192):  # a prompt's first chunk (plain causal): SDPA's order (cuDNN first) vs varlen
        q, k = (torch.randn(1, 16, T, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(1, 16, T, 128, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")

        def sdpa():
            with sdpa_kernel(SDPA_ORDER["cuda"], set_priority=True):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=192 ** -0.5)
        paths = {"sdpa_order": sdpa,
                 "varlen": lambda: varlen_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           cu, T, 192 ** -0.5)}
        out[f"{T}x{T}"] = first_and_repeat(f"first chunk T={T}", paths)
    return out


def part_prefill(model, args, rng, L: int, B: int, chunk: int, out_dir: Path) -> dict:
    engine = prefill_engine(model, args, L, B, chunk)

    def run() -> float:
        prompts = random_prompts(B, L, model.config.vocab_size, rng)
        return timed(lambda: engine.generate(prompts, greedy(1)), 1)[1]
    run()  # untimed: every kernel of these shapes compiled and tuned
    out = {"ms": run(), "tokens": B * L, "chunk": chunk}
    out["top"] = profile_step(run, out_dir / f"prefill_{L}_b{B}_c{chunk}.txt")[:30]
    print(f"  prefill {B} x {L} tokens, chunk {chunk}: {out['ms']:.1f} ms "
          f"({B * L / out['ms']:.0f} tokens/ms); device busy {out['top'][0]['self_device_ms']:.1f} ms profiled",
          flush=True)
    return out


def part_spec(model, args, rng, k: int, out_dir: Path) -> dict:
    """A speculative round at batch 1 (early-exit draft: the model's first 4 layers; random weights, so the
    acceptance says nothing, the cost a round does): wall ms a round, the same split by phase (each phase timed
    between two syncs), then 10 rounds under the profiler."""
    from openk3.serve.engine import early_exit_draft
    engine = engine_for(model, args, 1, draft=early_exit_draft(model, 4), prefix_cache=False, num_draft_tokens=k)
    prompt = random_prompts(1, 512, model.config.vocab_size, rng)
    engine.generate(prompt, greedy(16))  # captures the buckets
    req = engine.submit(prompt[0], greedy(400))
    while req.status != "running":
        engine.step()
    for _ in range(3):
        engine.step()

    def rounds(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3
    out = {"round_ms": rounds(20)}
    phases: dict[str, float] = {}
    names = ("draft", "verify", "rollback_verified", "restore")
    for owner, name in zip((engine.drafter, engine.target, engine.target, engine.drafter), names):
        def wrap(fn, key=f"{'draft' if owner is engine.drafter else 'target'}.{name}"):
            def timed_call(*a, **kw):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                result = fn(*a, **kw)
                torch.cuda.synchronize()
                phases[key] = phases.get(key, 0.0) + (time.perf_counter() - t0) * 1e3
                return result
            return timed_call
        setattr(owner, name, wrap(getattr(owner, name)))
    out["synced_round_ms"] = rounds(20)
    out["phase_ms_a_round"] = {key: ms / 20 for key, ms in phases.items()}
    for owner in (engine.drafter, engine.target):
        for name in names:
            owner.__dict__.pop(name, None)
    out["top"] = profile_step(lambda: rounds(10), out_dir / f"spec_k{k}.txt")[:30]
    engine.cancel(req.id)
    engine.step()
    print(f"  speculative k={k}: {out['round_ms']:.2f} ms a round; synced phases "
          + ", ".join(f"{key} {ms:.2f}" for key, ms in out["phase_ms_a_round"].items())
          + f" (round {out['synced_round_ms']:.2f}); device busy {out['top'][0]['self_device_ms'] / 10:.2f} ms a round",
          flush=True)
    return out


def prefill_shape(part: str) -> tuple[int, int, int]:
    """"prefill:L[:B[:C]]" (or prefill-modules:...) -> (L, B default 1, C default the bench's 8,192)."""
    v = [int(x) for x in part.split(":")[1:]]
    return tuple((v + [1, 8192][len(v) - 1:])[:3])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("parts", nargs="+", help="kda, attn, linear, recurrent, router, mla, hit, prefill:L[:B[:C]], "
                                            "prefill-modules:L[:B[:C]], modules:B, timeline:B, run:B, runs:B:N, "
                                            "decode:B, decode:B:c or spec:k")
    p.add_argument("--out", type=Path, default=Path("bench/results/decode_probe"), help="a directory")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="EngineConfig.overlap for the decode and hit parts, as in bench/vs_transformers_decode.py "
                        "(auto: the engine's default, on with CUDA graphs) [auto]")
    p.add_argument("--prefill-chunk", type=int, default=8192,
                   help="EngineConfig.prefill_chunk of the engines the parts build (prefill:L:B:C parts take C), as "
                        "in bench/vs_transformers_decode.py (32768 prefills a batch of 64 x 512-token prompts in one "
                        "forward) [8192]")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_probe.py needs CUDA")
    a.out.mkdir(parents=True, exist_ok=True)
    args = bench_args(["--skip-transformers", "--overlap", a.overlap, "--prefill-chunk", str(a.prefill_chunk)])
    args.pool_pages = 64 * 12 + 64
    rng = random.Random(0)
    results = {"hardware": hardware(torch.device("cuda")), "command": " ".join(sys.argv[1:])}
    with tempfile.TemporaryDirectory() as tmp:
        model, _, _ = build_checkpoint(args, Path(tmp))
    for name in a.parts:
        t0 = time.perf_counter()
        try:
            if name == "attn":
                results[name] = part_attn()
            elif name == "kda":
                results[name] = part_kda(model)
            elif name == "hit":
                results[name] = part_hit(model, args, rng, a.out)
            elif name.startswith("spec:"):
                results[name] = part_spec(model, args, rng, int(name.split(":")[1]), a.out)
            elif name.startswith("prefill:"):
                results[name] = part_prefill(model, args, rng, *prefill_shape(name), a.out)
            elif name == "linear":
                results[name] = part_linear()
            elif name == "router":
                results[name] = part_router()
            elif name == "recurrent":
                results[name] = part_recurrent()
            elif name == "mla":
                results[name] = part_mla()
            elif name.startswith("prefill-modules:"):
                results[name] = part_prefill_modules(model, args, rng, *prefill_shape(name), a.out)
            elif name.startswith("modules:"):
                results[name] = part_modules(model, args, rng, int(name.split(":")[1]), a.out)
            elif name.startswith("runs:"):
                _, B, n = name.split(":")
                results[name] = part_runs(model, args, rng, int(B), int(n))
            elif name.startswith("run:"):
                results[name] = part_run(model, args, rng, int(name.split(":")[1]), a.out)
            elif name.startswith("timeline:"):
                results[name] = part_timeline(model, args, rng, int(name.split(":")[1]), a.out)
            elif name.startswith("decode:"):
                _, B, *c = name.split(":")
                results[name] = part_decode(model, args, rng, int(B), c == ["c"], a.out)
            else:
                raise ValueError(f"unknown part {name!r}: kda, attn, linear, recurrent, router, mla, hit, "
                                 f"prefill:L[:B[:C]], prefill-modules:L[:B[:C]], modules:B, timeline:B, run:B, "
                                 f"runs:B:N, decode:B, decode:B:c or spec:k")
        except Exception as error:  # noqa: BLE001 (a part that fails is recorded; the others still run)
            import traceback
            traceback.print_exc()
            results[name] = {"error": repr(error)}
        results[name + "_s"] = time.perf_counter() - t0
        tmp_path = a.out / "probe.json.tmp"
        tmp_path.write_text(json.dumps(results, indent=1))
        tmp_path.replace(a.out / "probe.json")


if __name__ == "__main__":
    main()
