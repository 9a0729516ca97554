"""The calls record.py saved (/tmp/mla_calls.pt) with 2 key splits, through the kernel in Triton's interpreter
(run with TRITON_INTERPRET=1), against the gather reference: as recorded, and with values of 1e3 in every page slot
the rows do not see. Prints the largest absolute difference of each."""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from openk3.ops import mla_decode as md  # noqa: E402

assert md.INTERPRET, "run with TRITON_INTERPRET=1"
calls = torch.load("/tmp/mla_calls.pt", weights_only=False)
for i, c in enumerate(calls):
    if c["splits"] < 2:
        continue
    q, pages, table, vis, scale, r, heads = c["args"]
    want = md.paged_latent_attention_reference(q, pages, table, vis, scale, r, heads)
    got = md.paged_latent_attention(q, pages, table, vis, scale, r, heads)
    stale = pages.clone()
    seen = torch.zeros(stale.shape[:2], dtype=torch.bool)
    for b in range(table.shape[0]):
        for n in range(int(vis[b])):
            seen[table[b, n // stale.shape[1]], n % stale.shape[1]] = True
    stale[~seen] = 1e3 * torch.randn_like(stale[~seen])
    got_stale = md.paged_latent_attention(q, stale, table, vis, scale, r, heads)
    print(i, c["tag"], f"B {c['B']} T {c['T']} P {c['P']} splits {c['splits']} visible {c['visible']}",
          f"max |kernel - reference| {(got - want).abs().max().item():.3g}, with stale pages "
          f"{(got_stale - want).abs().max().item():.3g}")
