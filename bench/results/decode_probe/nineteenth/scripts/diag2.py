"""The hard gate's body (tests/serve/test_engine.py `gate`, dense model, CUDA graphs, overlapped) over a sequence of
fixed draws in one process, as hypothesis ran them; per example which engines' outputs differ (cold / cached / spec)
instead of stopping at the first assertion. argv: device, variant (plain | sync), then draw tuples."""
import json
import os
import random
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from openk3.serve.cache import PagePool  # noqa: E402
from openk3.serve.engine import Engine, EngineConfig, early_exit_draft  # noqa: E402
from openk3.serve.static import StaticDecoder  # noqa: E402
from tests.serve.test_cache import small_model  # noqa: E402
from tests.serve.test_engine import run_conversations  # noqa: E402


def example(device, draws, overlap):
    page_size, hash_interval, checkpoint_every, n_conv, n_turns, seed = draws
    rng = random.Random(seed)
    convs = [[[rng.randrange(256) for _ in range(rng.randint(1, 12))] for _ in range(n_turns)] for _ in range(n_conv)]
    max_tokens = [[rng.randint(1, 6) for _ in range(n_turns)] for _ in range(n_conv)]
    k = rng.randint(1, 4)
    model = small_model(seed=1, dense=True).to(device)
    longest = max(sum(len(u) for u in c) + sum(m) for c, m in zip(convs, max_tokens)) + k
    ckpt_pages = PagePool(model.config, 2, page_size, "meta", torch.float32).checkpoint_pages
    tiny_pool = -(-longest // page_size) + 1 + ckpt_pages + ckpt_pages // 2
    shared = dict(page_size=page_size, hash_interval=hash_interval, prefill_chunk=rng.randint(2, 9),
                  checkpoint_interval=checkpoint_every and checkpoint_every * hash_interval)
    cold = Engine(model, EngineConfig(page_size=4, num_pages=200, prefix_cache=False, fast_decode=True,
                                      overlap=overlap))
    cached = Engine(model, EngineConfig(num_pages=tiny_pool, fast_decode=True, overlap=overlap, **shared))
    spec = Engine(model, EngineConfig(num_pages=tiny_pool, num_draft_tokens=k, fast_decode=True, **shared),
                  draft=early_exit_draft(model, 3))
    for runner in (cached.target, spec.target, spec.drafter):
        runner.static_prefill = True
    cold.target.static_prefill = False
    ref = Engine(model, EngineConfig(page_size=4, num_pages=200, prefix_cache=False, fast_decode=False))
    names = ("ref", "cold", "cached", "spec")
    results = {n: run_conversations(e, convs, max_tokens) for n, e in zip(names, (ref, cold, cached, spec))}
    report = {}
    for n in names[1:]:
        report[n] = None
        for t, (rt, gt) in enumerate(zip(results["ref"], results[n])):
            diffs = [c for c, (r, g) in enumerate(zip(rt, gt)) if r.output != g.output]
            worst = max([0.0] + [abs(a - b) for r, g in zip(rt, gt) for a, b in zip(r.logprobs, g.logprobs)])
            if diffs or worst > 1e-2:
                c = diffs[0] if diffs else None
                report[n] = dict(turn=t, conv=c, worst=worst, ref=rt[c].output if diffs else None,
                                 got=gt[c].output if diffs else None, cached=[g.cached_tokens for g in gt])
                break
    report["counters"] = {n: dict(e.counters) for n, e in zip(names[1:], (cold, cached, spec))}
    return report


def main():
    device, variant = sys.argv[1], sys.argv[2]
    if variant == "sync":
        launch = StaticDecoder._launch

        def synced(self, *a, **kw):
            out = launch(self, *a, **kw)
            torch.cuda.synchronize()
            return out
        StaticDecoder._launch = synced
    out = []
    for spec in sys.argv[3:]:
        draws = [None if v == "None" else int(v) for v in spec.split(",")]
        t = time.time()
        try:
            rep = example(device, draws, overlap=None)
        except Exception:  # noqa: BLE001
            rep = dict(error=traceback.format_exc()[-1500:])
        rep["seconds"] = round(time.time() - t, 1)
        bad = {k: v for k, v in rep.items() if k in ("cold", "cached", "spec", "error") and v}
        print(spec, "FAIL" if bad else "ok", json.dumps(bad)[:600], rep["seconds"], flush=True)
        out.append(dict(draws=spec, **rep))
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"diag2_{variant}.json"), "w") as f:
                json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
