"""Twentieth session, call 2 (call2.sh): candidate fixes of the paged MLA kernel (openk3/ops/mla_decode.py) on
the GPU.
`probe_fix.py k NAME`: a kernel-level sweep of variant NAME over many small and kimi-linear shapes, fp32 and bf16,
split counts None/1/2/3, every row against the fp32 gather reference, the cases in order until K_BUDGET seconds
have passed -> $OUT/k_NAME.json.
`probe_fix.py t NAMES`: each variant timed at kimi-linear-1.5b's shapes (16 heads, 512 + 64, bf16 pages of 64,
rows of 513-640 keys in a shuffled 16-page table, 4 layers' pools cycled), a CUDA graph of 4 calls -> $OUT/t.json.
Variants: new (the working tree's module: the key's page by tl.gather), cur (the kernel at 154fba8: the page by a
[BLOCK_N, BLOCK_P] select-and-sum), cur_stages1, new_stages2, new_keys16, pre (the kernel before 0ea363e: the page
table read inside the key loop); cur and pre are loaded from variants/ beside this file (call2.sh says how they
are made)."""
import functools
import importlib.util
import json
import os
import random
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from openk3.ops import mla_decode as md  # noqa: E402
from tests.ops.test_mla_decode import CASES, random_paged  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
DEV = os.environ.get("PROBE_DEV", "cuda")
HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    spec = importlib.util.spec_from_file_location(f"mla_{name}", os.path.join(HERE, f"variants/mla_{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def variant(name):
    if name == "new":
        return md.paged_latent_attention
    if name == "new_stages2":
        return functools.partial(md.paged_latent_attention, stages=2)
    if name == "new_keys16":
        return functools.partial(md.paged_latent_attention, block_n=16)
    if name == "cur":
        return load("cur").paged_latent_attention
    if name == "cur_stages1":
        return functools.partial(load("cur").paged_latent_attention, stages=1)
    if name == "pre":
        return load("pre").paged_latent_attention
    raise ValueError(name)


def sweep_cases():
    """(B, T, H, r, rope, page, P, lengths): the tests' CASES, then the engine tests' model (2 heads, 16 + 8) at
    pages of 2-16, then wider heads, then kimi-linear-1.5b's MLA."""
    rng = random.Random(20)
    cases = list(CASES)
    for page in (2, 3, 5, 6, 7, 9, 11, 12, 16):
        for P in (4, 8, 16):
            S = P * page
            for T in (1, 2, 4):
                B = rng.choice((1, 2, 3))
                lengths = [rng.randrange(0, S - T + 1) for _ in range(B)]
                lengths[0] = min(S - T, rng.randrange(8, 32))  # the gate's visible 11-31
                if B == 3:
                    lengths[1] = None
                cases.append((B, T, 2, 16, 8, page, P, lengths))
    for (H, r, rope) in ((4, 24, 8), (8, 32, 16), (16, 64, 32)):
        for page in (3, 6, 8):
            cases.append((2, 1, H, r, rope, page, 8, [20, 7 * page - 3]))
            cases.append((2, 2, H, r, rope, page, 12, [11, 12 * page - 2]))
    for page, P, T in ((64, 16, 1), (64, 16, 4), (6, 128, 1), (16, 48, 2)):
        S = page * P
        cases.append((4, T, 16, 512, 64, page, P, [S - T, 21, None, S // 2]))
    return cases


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def part_k(name):
    fn = variant(name)
    rows, t0 = [], time.time()
    for case in sweep_cases():
        B, T, H, r, rope, page, P, lengths = case
        for dtype in (torch.float32, torch.bfloat16):
            q, pages, table, visible = random_paged(B, T, H, r, rope, page, P, lengths, dtype, seed=B + T + H + page,
                                                    device=DEV)
            want = md.paged_latent_attention_reference(q.float(), pages.float().nan_to_num(0.0), table, visible, 0.3,
                                                       r, H)
            for splits in (None, 1, 2, 3):
                row = dict(case=str(case), dtype=str(dtype)[6:], splits=splits)
                try:
                    got = fn(q, pages, table, visible, 0.3, r, H, **({} if splits is None else dict(splits=splits)))
                    torch.cuda.synchronize() if DEV == "cuda" else None
                    row.update(finite=bool(torch.isfinite(got).all()), err=max(rel(got[b], want[b]) for b in range(B)),
                               zero_rows=[b for b in range(B) if not got[b].any()])
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:300]
                rows.append(row)
        if time.time() - t0 > float(os.environ.get("K_BUDGET", "1e9")):
            break
    bad = [x for x in rows if x.get("error") or not x["finite"] or x["err"] > (1e-5 if x["dtype"] == "float32"
                                                                               else 1e-2)]
    out = dict(variant=name, checks=len(rows), bad=len(bad), bad_rows=bad, cases=len(sweep_cases()),
               seconds=round(time.time() - t0, 1), worst={d: max((x["err"] for x in rows if x["dtype"] == d and
                                                                   "err" in x), default=None)
                                                         for d in ("float32", "bfloat16")})
    with open(os.path.join(OUT, f"k_{name}.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("K", name, "checks", len(rows), "bad", len(bad), json.dumps(bad)[:400], flush=True)


def part_t(names):
    sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
    from bench.moe_gemv import time_graph
    out = {}
    H, r, rope, page, P, seen = 16, 512, 64, 64, 16, 640
    for B in (1, 16, 64):
        pools = [torch.randn(B * P + 1, page, r + rope, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        table = (1 + torch.randperm(B * P, device="cuda")).view(B, P)
        visible = torch.tensor([seen - (37 * b) % 128 for b in range(B)], device="cuda")
        q = torch.randn(B, H, r + rope, device="cuda", dtype=torch.bfloat16)
        ref = md.paged_latent_attention_reference(q.float(), pools[0].float(), table, visible, 0.07, r, H)
        for name in names:
            try:
                fn = variant(name)
                err = rel(fn(q, pools[0], table, visible, 0.07, r, H), ref)
                it = iter(range(10 ** 9))
                us = [time_graph(lambda: fn(q, pools[next(it) % 4], table, visible, 0.07, r, H), 4, 20)
                      for _ in range(3)]
                out.setdefault(name, {})[f"B{B}"] = dict(us=min(us), us_all=us, err=err)
                print(f"T {name} B={B}: {min(us):.2f} us {us} err {err:.1e}", flush=True)
            except Exception:  # noqa: BLE001
                out.setdefault(name, {})[f"B{B}"] = dict(error=traceback.format_exc()[-800:])
                print("T", name, B, "error", traceback.format_exc()[-300:], flush=True)
            with open(os.path.join(OUT, "t.json"), "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "k":
        part_k(sys.argv[2])
    elif sys.argv[1] == "t":
        part_t(sys.argv[2].split(","))
