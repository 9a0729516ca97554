"""Session probe: the host work behind the batch-64 prefill's idle gaps: the CPU ops inside the largest device
gaps of a profiled prefill-only run, and a cProfile of another."""
import cProfile, io, json, os, pstats, random, sys, tempfile, time
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
from bench.engine_bench import greedy, random_prompts
from bench.vs_transformers_decode import build_checkpoint, engine_for, parse_args
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

out = Path(os.environ["OUT"]) / "gaps.json"
res = {}
def save(): out.write_text(json.dumps(res, indent=1))
args = parse_args(["--skip-transformers", "--prefill-chunk", "32768"])
args.pool_pages = 64 * 12 + 64
rng = random.Random(0)
with tempfile.TemporaryDirectory() as tmp:
    model, _, _ = build_checkpoint(args, Path(tmp))
engine = engine_for(model, args, 64, prefix_cache=False)
V = model.config.vocab_size
engine.generate(random_prompts(64, 512, V, rng), greedy(args.decode_tokens))  # captures
def prefill_only():
    prompts = random_prompts(64, 512, V, rng)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    engine.generate(prompts, greedy(1)); torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3
for _ in range(3):
    print("warm", prefill_only(), flush=True)
res["runs"] = []
for i in range(3):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms = prefill_only()
    ev = prof.events()
    dev = sorted((e for e in ev if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    cpu = [e for e in ev if e.device_type == DeviceType.CPU]
    gaps, end = [], None
    for j, e in enumerate(dev):
        if end is not None and e.time_range.start - end > 300:
            gaps.append((end, e.time_range.start, j))
        end = max(end or 0, e.time_range.end)
    t_first = dev[0].time_range.start
    run = {"ms": ms, "first_kernel_us": t_first, "gaps": []}
    for g0, g1, j in sorted(gaps, key=lambda g: g[0] - g[1])[:6]:
        inside = [e for e in cpu if e.time_range.end > g0 and e.time_range.start < g1]
        top = [e for e in inside if e.cpu_parent is None or e.cpu_parent not in inside]
        by = {}
        for e in inside:
            ov = min(e.time_range.end, g1) - max(e.time_range.start, g0)
            by[e.name] = by.get(e.name, 0) + ov
        run["gaps"].append({"from_us": g0 - t_first, "us": g1 - g0, "before": dev[j].name[:60],
                            "after": dev[j - 1].name[:60],
                            "top_level_cpu": [(e.name, round(e.time_range.elapsed_us(), 1)) for e in top][:40],
                            "cpu_overlap_by_name": sorted(((k, round(v, 1)) for k, v in by.items()), key=lambda x: -x[1])[:30]})
    # all CPU ops before the first big kernel burst, by self time
    res["runs"].append(run)
    print("profiled", ms, [(round(g["from_us"]), round(g["us"])) for g in run["gaps"]], flush=True)
    save()
pr = cProfile.Profile()
pr.enable(); ms = prefill_only(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
s2 = io.StringIO(); pstats.Stats(pr, stream=s2).sort_stats("tottime").print_stats(40)
(Path(os.environ["OUT"]) / "cprofile.txt").write_text(f"{ms} ms\n" + s.getvalue() + "\n\n" + s2.getvalue())
print("cprofile", ms, flush=True)
