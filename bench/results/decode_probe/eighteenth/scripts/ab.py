"""Session A/B: batch-64 prefill-only runs and whole runs (the decode bench's), this tree's openk3 (cwd first)."""
import json, os, random, sys, tempfile, time
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
import openk3
from bench.engine_bench import greedy, random_prompts
from bench.vs_transformers_decode import build_checkpoint, engine_for, parse_args, prefill_and_step, timed_engine_run
tag = os.environ["TAG"]
out = Path(os.environ["OUT"]) / f"ab_{tag}.json"
res = {"openk3": openk3.__file__}
print(tag, openk3.__file__, flush=True)
args = parse_args(["--skip-transformers", "--prefill-chunk", "32768"])
args.pool_pages = 64 * 12 + 64
rng = random.Random(0)
with tempfile.TemporaryDirectory() as tmp:
    model, _, _ = build_checkpoint(args, Path(tmp))
V = model.config.vocab_size
for B in (64, 1):
    engine = engine_for(model, args, B, prefix_cache=False)
    for _ in range(2):
        engine.generate(random_prompts(B, 512, V, rng), greedy(args.decode_tokens))
    pre = []
    for _ in range(6):
        prompts = random_prompts(B, 512, V, rng)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        engine.generate(prompts, greedy(1)); torch.cuda.synchronize()
        pre.append((time.perf_counter() - t0) * 1e3)
    full = []
    for _ in range(6):
        prompts = random_prompts(B, 512, V, rng)
        s, reqs = timed_engine_run(engine, prompts, args.decode_tokens, args.device)
        ttft, step = prefill_and_step(reqs, args.decode_tokens)
        full.append({"tokens_per_s": sum(len(r.output) for r in reqs) / s, "prefill_ms": 1e3 * ttft, "ms_per_step": step})
    res[str(B)] = {"prefill_only_ms": pre, "full": full}
    print(tag, B, "prefill only", [round(x, 1) for x in pre], flush=True)
    print(tag, B, "full", [(round(f["tokens_per_s"]), round(f["prefill_ms"], 1), round(f["ms_per_step"], 3)) for f in full], flush=True)
    out.write_text(json.dumps(res, indent=1))
    del engine
    torch.cuda.empty_cache()
