"""Record every paged MLA call of the failing gate example's engines on the CPU (the kernel's place taken by the
gather reference, which has the same signature), to see which call shapes only the speculative engine makes.
argv: [pool pages, or "tiny" for the gate's tiny pool (the default)] [JSON out path]. The calls' tensors go to
/tmp/mla_calls.pt (for interpret_recorded.py)."""
import json
import os
import random
import sys
from collections import Counter

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

import openk3.model.model as mm  # noqa: E402
from openk3.ops import mla_decode as md  # noqa: E402
from openk3.serve.cache import PagePool  # noqa: E402
from openk3.serve.engine import Engine, EngineConfig, early_exit_draft  # noqa: E402
from tests.serve.test_cache import small_model  # noqa: E402
from tests.serve.test_engine import run_conversations  # noqa: E402

calls = []
tag = [None]


def recording(q_cat, pages, table, visible, scale, r, heads):
    B, M, _ = q_cat.shape
    S = table.shape[1] * pages.shape[1]
    splits, keys = md.split_keys(B, -(-M // md.BLOCK_M), S, md.BLOCK_N, pages.shape[1])
    calls.append(dict(tag=tag[0], B=B, T=M // heads, P=table.shape[1], visible=visible.tolist(), splits=splits,
                      keys=keys, table=table.tolist(), args=(q_cat.clone(), pages.clone(), table.clone(),
                                                             visible.clone(), scale, r, heads)))
    return md.paged_latent_attention_reference(q_cat, pages, table, visible, scale, r, heads)


mm.paged_latent_attention = recording
draws = (6, 6, 1, 2, 3, 45947)
page_size, hash_interval, checkpoint_every, n_conv, n_turns, seed = draws
rng = random.Random(seed)
convs = [[[rng.randrange(256) for _ in range(rng.randint(1, 12))] for _ in range(n_turns)] for _ in range(n_conv)]
max_tokens = [[rng.randint(1, 6) for _ in range(n_turns)] for _ in range(n_conv)]
k = rng.randint(1, 4)
model = small_model(seed=1, dense=True)
longest = max(sum(len(u) for u in c) + sum(m) for c, m in zip(convs, max_tokens)) + k
ckpt_pages = PagePool(model.config, 2, page_size, "meta", torch.float32).checkpoint_pages
tiny_pool = -(-longest // page_size) + 1 + ckpt_pages + ckpt_pages // 2
if len(sys.argv) > 1 and sys.argv[1] != "tiny":
    tiny_pool = int(sys.argv[1])
shared = dict(page_size=page_size, hash_interval=hash_interval, prefill_chunk=rng.randint(2, 9),
              checkpoint_interval=checkpoint_every and checkpoint_every * hash_interval)
cached = Engine(model, EngineConfig(num_pages=tiny_pool, fast_decode=True, **shared))
spec = Engine(model, EngineConfig(num_pages=tiny_pool, num_draft_tokens=k, fast_decode=True, **shared),
              draft=early_exit_draft(model, 3))
for runner in (cached.target, spec.target, spec.drafter):
    runner.static_prefill = True
    runner.decoder.mla_kernel = True
results = {}
for name, e in (("cached", cached), ("spec", spec)):
    tag[0] = name
    results[name] = run_conversations(e, convs, max_tokens)
print("tiny_pool", tiny_pool, "ckpt_pages", ckpt_pages, "k", k)
for name in results:
    print(name, [[r.output for r in t] for t in results[name]], [[r.cached_tokens for r in t] for t in results[name]])
shapes = Counter((c["tag"], c["B"], c["T"], c["P"], c["splits"], c["keys"]) for c in calls)
for s, n in sorted(shapes.items()):
    print(s, n)
torch.save(calls, "/tmp/mla_calls.pt")
if len(sys.argv) > 2:
    rows = [dict(engine=c["tag"], B=c["B"], T=c["T"], P=c["P"], splits=c["splits"], keys_a_split=c["keys"],
                 visible=c["visible"], table=c["table"]) for c in calls]
    with open(sys.argv[2], "w") as f:
        json.dump(dict(note="every paged MLA call of the failing gate example's prefix-hit and speculative engines, "
                            "recorded on the CPU (scripts/record.py; the kernel's place taken by the gather "
                            "reference)", pool_pages=tiny_pool, calls=rows), f, indent=0)
