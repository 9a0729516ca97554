"""Session probe: where the batch-64 prefill's spread comes from (prefill-only runs, profiled timelines), and
full runs with gc.freeze after warm-up. Writes $OUT/spread.json after every part."""
import gc, json, os, random, sys, tempfile, time
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
from bench.engine_bench import greedy, random_prompts
from bench.vs_transformers_decode import build_checkpoint, engine_for, parse_args, prefill_and_step, timed_engine_run
from bench.decode_probe import kernel_timeline

out = Path(os.environ["OUT"]) / f"spread_{os.environ.get('TAG', 'x')}.json"
res = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
def save(): out.write_text(json.dumps(res, indent=1))
args = parse_args(["--skip-transformers", "--prefill-chunk", "32768"])
args.pool_pages = 64 * 12 + 64
rng = random.Random(0)
with tempfile.TemporaryDirectory() as tmp:
    model, _, _ = build_checkpoint(args, Path(tmp))
engine = engine_for(model, args, 64, prefix_cache=False)
V = model.config.vocab_size
engine.generate(random_prompts(64, 512, V, rng), greedy(args.decode_tokens))  # captures
keys = ("num_device_alloc", "num_device_free")
def prefill_only():
    prompts = random_prompts(64, 512, V, rng)
    b = torch.cuda.memory_stats(); torch.cuda.synchronize(); t0 = time.perf_counter()
    reqs = engine.generate(prompts, greedy(1)); torch.cuda.synchronize()
    a = torch.cuda.memory_stats()
    return (time.perf_counter() - t0) * 1e3, {k: a.get(k, 0) - b.get(k, 0) for k in keys}, reqs
res["prefill_only"] = []
for i in range(8):
    ms, al, reqs = prefill_only()
    ttft, _ = prefill_and_step(reqs, 2)
    res["prefill_only"].append({"ms": ms, "ttft_ms": 1e3 * ttft, "alloc": al})
    print("prefill only", round(ms, 1), round(1e3 * ttft, 1), al, flush=True)
save()
from torch.profiler import ProfilerActivity, profile
res["profiled"] = []
for i in range(4):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms, al, reqs = prefill_only()
    rows, total, top = kernel_timeline(prof)
    big = sorted(rows, key=lambda r: -r["gap_us"])[:12]
    res["profiled"].append({"ms": ms, "total": total, "top": top[:25], "largest_gaps": big,
                            "gaps_over_20us": sum(r["gap_us"] for r in rows if r["gap_us"] > 20)})
    print("profiled", round(ms, 1), total, flush=True)
    save()
# full runs (the bench's timing), then the same after gc.freeze()
def full(n, label):
    runs = []
    for _ in range(n):
        prompts = random_prompts(64, 512, V, rng)
        b = torch.cuda.memory_stats()
        s, reqs = timed_engine_run(engine, prompts, args.decode_tokens, args.device)
        a = torch.cuda.memory_stats()
        ttft, step = prefill_and_step(reqs, args.decode_tokens)
        runs.append({"tokens_per_s": sum(len(r.output) for r in reqs) / s, "prefill_ms": 1e3 * ttft,
                     "ms_per_step": step, "alloc": {k: a.get(k, 0) - b.get(k, 0) for k in keys}})
        print(label, runs[-1], flush=True)
    res[label] = runs; save()
full(4, "full")
gc.collect(); gc.freeze()
full(4, "full_gc_frozen")
