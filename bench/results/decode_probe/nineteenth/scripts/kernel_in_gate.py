"""For the next device call (not run yet): the failing hard-gate example's speculative engine (diag3.py's
`no_graphs` variant: eager, so Python sees every call) with every paged MLA call checked against the gather
reference as it runs (the kernel's result is what the engine gets, so the flow is the failing one). Prints each call
whose kernel result differs from the reference by more than 1e-4 (relative, per row) or is not finite, with its
shapes, splits, visible and table, then diag3's verdict against the general path. Run from the repo root:
python3 <this file> cuda."""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from diag3 import run  # noqa: E402

import openk3.model.model as mm  # noqa: E402
from openk3.ops import mla_decode as md  # noqa: E402

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
verdict = run(sys.argv[1] if len(sys.argv) > 1 else "cuda", (6, 6, 1, 2, 3, 45947), "no_graphs")
print("calls", seen[0], "bad", len(bad), "(no kernel ran)" if not seen[0] else "", json.dumps(verdict, default=str))
