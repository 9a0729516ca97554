"""The failing hard-gate example's speculative engine under variants that each turn one GPU-only piece off:
which piece makes it agree with the general path again. argv: device, draws, variants."""
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
from openk3.serve.static import SlotPool  # noqa: E402
from tests.serve.test_cache import small_model  # noqa: E402
from tests.serve.test_engine import run_conversations  # noqa: E402


def run(device, draws, variant):
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
    fits = SlotPool.fits_tokens
    import openk3.ops.mla_decode as md
    saved = (md.STAGES, md.split_keys)
    os.environ.pop("OPENK3_MLA_KERNEL", None)
    os.environ.pop("OPENK3_KDA_BACKEND", None)
    extra = {}
    if variant == "mla_gather":
        os.environ["OPENK3_MLA_KERNEL"] = "0"
    elif variant == "fla_off":
        os.environ["OPENK3_KDA_BACKEND"] = "torch"
    elif variant == "no_spare":
        SlotPool.fits_tokens = lambda self, B, T: False
    elif variant == "no_graphs":
        extra = dict(cuda_graphs=False)
    elif variant == "unfused":
        extra = dict(fuse_projections=False)
    elif variant in ("stages1", "splits1"):
        if variant == "stages1":
            md.STAGES = 1
        else:
            md.split_keys = lambda B, qb, S, bn=md.BLOCK_N, ps=None: (1, -(-S // bn) * bn)
    elif variant == "big_pool":
        tiny_pool = 400
    try:
        spec = Engine(model, EngineConfig(num_pages=tiny_pool, num_draft_tokens=k, fast_decode=True, **extra,
                                          **shared), draft=early_exit_draft(model, 3))
        static = variant != "general_prefill"
        if variant == "draft_gather":
            spec.drafter.decoder.mla_kernel = False
        elif variant == "target_gather":
            spec.target.decoder.mla_kernel = False
        for runner in (spec.target, spec.drafter):
            runner.static_prefill = static
        ref = Engine(model, EngineConfig(page_size=4, num_pages=200, prefix_cache=False, fast_decode=False))
        want, got = (run_conversations(e, convs, max_tokens) for e in (ref, spec))
    finally:
        SlotPool.fits_tokens = fits
        md.STAGES, md.split_keys = saved
    for t, (rt, gt) in enumerate(zip(want, got)):
        for c, (r, g) in enumerate(zip(rt, gt)):
            if r.output != g.output:
                return dict(bad=dict(turn=t, conv=c, ref=r.output, got=g.output, cached=[x.cached_tokens for x in gt]),
                            path=spec.decode_path, counters=dict(spec.counters))
    return dict(bad=None, path=spec.decode_path, counters=dict(spec.counters))


def main():
    device, draws = sys.argv[1], [None if v == "None" else int(v) for v in sys.argv[2].split(",")]
    out = {}
    for variant in sys.argv[3].split(","):
        t = time.time()
        try:
            res = run(device, draws, variant)
        except Exception:  # noqa: BLE001
            res = dict(error=traceback.format_exc()[-1200:])
        res["seconds"] = round(time.time() - t, 1)
        out[variant] = res
        print(variant, "FAIL" if res.get("bad") or res.get("error") else "ok", json.dumps(res, default=str)[:700],
              flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "diag3.json"), "w") as f:
                json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
