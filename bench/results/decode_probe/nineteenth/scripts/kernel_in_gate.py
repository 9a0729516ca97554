"""For the next device call (not run yet): the failing hard-gate example's speculative engine with every paged MLA
call checked against the gather reference as it runs (the kernel's result is what the engine gets, so the flow is
the failing one). Prints each call whose kernel result differs from the reference by more than 1e-4 (relative, per
row), with its shapes, splits, visible and table. Run from the repo root: python3 <this file> cuda."""
import json
import os
import random
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

import openk3.model.model as mm  # noqa: E402
from openk3.ops import mla_decode as md  # noqa: E402
from openk3.serve.cache import PagePool  # noqa: E402
from openk3.serve.engine import Engine, EngineConfig, early_exit_draft  # noqa: E402
from tests.serve.test_cache import small_model  # noqa: E402
from tests.serve.test_engine import run_conversations  # noqa: E402

kernel = md.paged_latent_attention
bad, seen = [], [0]


def checked(q_cat, pages, table, visible, scale, r, heads):
    got = kernel(q_cat, pages, table, visible, scale, r, heads)
    want = md.paged_latent_attention_reference(q_cat.float(), pages.float(), table, visible, scale, r, heads)
    B, M, _ = q_cat.shape
    err = [((got[b].float() - want[b]).norm() / want[b].norm().clamp(min=1e-30)).item() for b in range(B)]
    splits, keys = md.split_keys(B, -(-M // md.BLOCK_M), table.shape[1] * pages.shape[1], md.BLOCK_N, pages.shape[1])
    seen[0] += 1
    if not (all(e <= 1e-4 for e in err) and torch.isfinite(got).all()):  # (a NaN error compares False)
        bad.append(dict(call=seen[0], B=B, T=M // heads, P=table.shape[1], splits=splits, keys=keys, err=err,
                        visible=visible.tolist(), table=table.tolist(), pages_stride=list(pages.stride())))
        print(json.dumps(bad[-1]), flush=True)
    return got


mm.paged_latent_attention = checked
device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
page_size, hash_interval, checkpoint_every, n_conv, n_turns, seed = 6, 6, 1, 2, 3, 45947
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
spec = Engine(model, EngineConfig(num_pages=tiny_pool, num_draft_tokens=k, fast_decode=True, cuda_graphs=False,
                                  **shared), draft=early_exit_draft(model, 3))
for runner in (spec.target, spec.drafter):
    runner.static_prefill = True
turns = run_conversations(spec, convs, max_tokens)
print("outputs", [[r.output for r in t] for t in turns], "calls", seen[0], "bad", len(bad),
      "kernel" if spec.target.decoder.mla_kernel else "gather (no kernel ran)")
