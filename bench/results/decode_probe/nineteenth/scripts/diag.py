"""Which engine of the hard gate departs on CUDA, under which settings (the failing dense-graphs-overlapped example).
Prints, per variant and engine, the first (turn, conversation) whose tokens differ from the general path's, and the
largest logprob difference before it."""
import json
import os
import random
import sys
import time

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from openk3.serve.cache import PagePool  # noqa: E402
from openk3.serve.engine import Engine, EngineConfig  # noqa: E402
from openk3.serve.static import StaticDecoder  # noqa: E402
from tests.serve.test_cache import small_model  # noqa: E402
from tests.serve.test_engine import run_conversations  # noqa: E402


def setup(page_size, hash_interval, checkpoint_every, n_conv, n_turns, seed):
    rng = random.Random(seed)
    convs = [[[rng.randrange(256) for _ in range(rng.randint(1, 12))] for _ in range(n_turns)] for _ in range(n_conv)]
    max_tokens = [[rng.randint(1, 6) for _ in range(n_turns)] for _ in range(n_conv)]
    k = rng.randint(1, 4)
    return convs, max_tokens, k, rng


def compare(ref, got):
    worst = 0.0
    for t, (rt, gt) in enumerate(zip(ref, got)):
        for c, (r, g) in enumerate(zip(rt, gt)):
            if r.output != g.output:
                return dict(first_diff=(t, c), ref=r.output, got=g.output, worst_logprob=worst,
                            cached=[x.cached_tokens for x in gt])
            worst = max([worst] + [abs(a - b) for a, b in zip(r.logprobs, g.logprobs)])
    return dict(first_diff=None, worst_logprob=worst)


def main():
    device = sys.argv[1]
    draws = [None if v == "None" else int(v) for v in sys.argv[2].split(",")]
    variants = sys.argv[3].split(",")
    page_size, hash_interval, checkpoint_every = draws[:3]
    convs, max_tokens, k, rng = setup(*draws[:3], *draws[3:])
    model = small_model(seed=1, dense=True).to(device)
    longest = max(sum(len(u) for u in c) + sum(m) for c, m in zip(convs, max_tokens)) + k
    ckpt_pages = PagePool(model.config, 2, page_size, "meta", torch.float32).checkpoint_pages
    tiny_pool = -(-longest // page_size) + 1 + ckpt_pages + ckpt_pages // 2
    shared = dict(page_size=page_size, hash_interval=hash_interval, prefill_chunk=rng.randint(2, 9),
                  checkpoint_interval=checkpoint_every and checkpoint_every * hash_interval)
    ref = run_conversations(Engine(model, EngineConfig(page_size=4, num_pages=200, prefix_cache=False,
                                                       fast_decode=False)), convs, max_tokens)
    print("convs", [[len(u) for u in c] for c in convs], "max_tokens", max_tokens, "k", k, "shared", shared)
    launch = StaticDecoder._launch
    results = {}
    for variant in variants:
        opts = dict(overlap=None)
        StaticDecoder._launch = launch
        if variant == "no_overlap":
            opts = dict(overlap=False)
        elif variant == "eager_overlap":
            opts = dict(overlap=True, cuda_graphs=False)
        elif variant == "unfused":
            opts = dict(overlap=None, fuse_projections=False)
        elif variant == "sync":
            def synced(self, *a, **kw):
                out = launch(self, *a, **kw)
                torch.cuda.synchronize()
                return out
            StaticDecoder._launch = synced
        t = time.time()
        cold = Engine(model, EngineConfig(page_size=4, num_pages=200, prefix_cache=False, fast_decode=True, **opts))
        cached = Engine(model, EngineConfig(num_pages=tiny_pool, fast_decode=True, **opts, **shared))
        cached.target.static_prefill = True
        cold.target.static_prefill = False
        res = {}
        for name, e in (("cold", cold), ("cached", cached)):
            try:
                res[name] = compare(ref, run_conversations(e, convs, max_tokens))
            except Exception as err:  # noqa: BLE001
                res[name] = dict(error=repr(err)[:300])
            res[name]["path"] = e.decode_path
        res["seconds"] = round(time.time() - t, 1)
        results[variant] = res
        print(variant, json.dumps(res), flush=True)
    StaticDecoder._launch = launch
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"diag_{sys.argv[2].replace(',', '_')}.json"), "w") as f:
            json.dump(dict(draws=draws, results=results), f, indent=1)


if __name__ == "__main__":
    main()
