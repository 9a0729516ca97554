"""Benchmarks of the openk3 inference engine (openk3/serve/engine.py); prints tables and writes JSON.

    python bench/engine_bench.py                                   # CPU, tiny preset (docs/engine.md)
    python bench/engine_bench.py --device cuda --preset k3-1b      # GPU, the ~1B K3-shaped preset, bf16

1. decode throughput: generated tokens per second of decode steps, by batch size (prompts prefilled first);
2. time to first token on a multi-turn conversation, prefix cache off (cold) vs on;
3. decode-cache bytes per token: the hybrid model vs the same shape with MLA in every layer and with plain
   multi-head attention in every layer (analytic, checked against the engine's page size);
4. speculative decoding: acceptance rate and speed-up of an early-exit draft (the target's first layers).

Models are randomly initialised: speeds are real, but acceptance rates of a random model say nothing about a
trained one (a trained draft and target agree far more often than random ones).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openk3  # noqa: E402
from openk3.config import get_config  # noqa: E402
from openk3.model import K3ForCausalLM, count_params  # noqa: E402
from openk3.ops import select_kda_backend  # noqa: E402
from openk3.serve.cache import cache_bytes_per_token  # noqa: E402
from openk3.serve.engine import Engine, EngineConfig, SamplingParams, early_exit_draft  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def hardware(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_name(),
            "cpu_cores": os.cpu_count(), "cpu_threads_used": torch.get_num_threads(),
            "kda_backend": str(select_kda_backend(device)),
            # which checkout ran: a copy of another version first on PYTHONPATH is shadowed by this script's own
            # (sys.path above; docs/engine_h200_log.md, fifteenth session)
            "openk3": str(Path(openk3.__file__).resolve().parent)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def build_model(preset: str, device: torch.device, dtype: torch.dtype, seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    with torch.device(device):
        model = K3ForCausalLM(get_config(preset))
    return model.to(dtype).eval()


def random_prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=())


def decode_rate(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    """Generated tokens per second of decode time (prefill excluded)."""
    before = dict(engine.counters)
    engine.generate(prompts, greedy(tokens))
    n = engine.counters["decode_tokens"] - before["decode_tokens"]
    return n / (engine.counters["decode_seconds"] - before["decode_seconds"])


def check_on_device(device: torch.device, seed: int) -> dict:
    """Before timing anything: on this device and its kernels, the tiny preset in fp32, decoded greedily cold, after
    prefix-cache hits and speculatively, must give the full forward's tokens (logprobs within 1e-3, or 1e-2 with
    fla: Triton runs fp32 dot products in TF32 on Hopper unless TRITON_F32_DEFAULT=ieee, so fla's chunked prefill
    and its decode step differ by ~1e-3 in fp32, measured on the H200)."""
    model = build_model("tiny", device, torch.float32, seed)
    tol = 1e-2 if select_kda_backend(device).name == "fla" else 1e-3
    rng = random.Random(seed)
    convs = [random_prompts(3, n, model.config.vocab_size, rng) for n in (5, 37, 70)]
    cfg = dict(page_size=16, num_pages=256, hash_interval=16, prefill_chunk=32)
    engines = {"cold": Engine(model, EngineConfig(prefix_cache=False, **cfg)),
               "prefix_cache": Engine(model, EngineConfig(**cfg)),
               "speculative": Engine(model, EngineConfig(num_draft_tokens=3, **cfg), draft=early_exit_draft(model, 3))}
    worst, agree, hits = 0.0, True, 0
    for name, engine in engines.items():
        histories = [[] for _ in convs]
        for t in range(3):
            prompts = [h + c[t] for h, c in zip(histories, convs)]
            reqs = engine.generate(prompts, greedy(12))
            for r in reqs:
                with torch.no_grad():
                    logp = torch.log_softmax(model(torch.tensor([r.prompt + r.output], device=device)).logits[0]
                                             .float(), -1)[len(r.prompt) - 1:-1]
                agree &= logp.argmax(-1).tolist() == r.output
                want = logp.gather(1, torch.tensor(r.output, device=device)[:, None])[:, 0].cpu()
                worst = max(worst, float((want - torch.tensor(r.logprobs)).abs().max()))
                hits += r.cached_tokens
            histories = [p + r.output for p, r in zip(prompts, reqs)]
    ok = agree and worst < tol and hits > 0
    print(f"  tiny fp32, cold / prefix cache / speculative vs full forward: tokens {'equal' if agree else 'DIFFER'}, "
          f"max logprob error {worst:.2e}, {hits} prompt tokens from the cache -> {'ok' if ok else 'FAILED'}")
    if not ok:
        raise SystemExit("engine check failed on this device")
    return {"tokens_equal": agree, "max_logprob_error": worst, "tolerance": tol, "cached_tokens": hits}


def bench_decode(model, args, rng) -> list[dict]:
    rows = []
    for B in args.batch_sizes:
        engine = Engine(model, EngineConfig(page_size=args.page_size, num_pages=args.pool_pages, max_batch=B,
                                            prefix_cache=False, prefill_chunk=B * args.prompt_len))
        prompts = random_prompts(B, args.prompt_len, model.config.vocab_size, rng)
        decode_rate(engine, prompts, 4)  # warm-up (allocator, kernels)
        rate = decode_rate(engine, prompts, args.decode_tokens)
        rows.append({"batch": B, "decode_tokens_per_s": rate, "per_sequence_tokens_per_s": rate / B})
        print(f"  batch {B:4d}: {rate:10.1f} tok/s  ({rate / B:8.1f} per sequence)", flush=True)
    return rows


def bench_ttft(model, args, rng) -> dict:
    """One conversation: a system prompt, then turns of user text and a reply; TTFT of each turn."""
    V = model.config.vocab_size
    system = random_prompts(1, args.system_len, V, rng)[0]
    users = random_prompts(args.turns, args.user_len, V, rng)
    out = {}
    for mode in ("cold", "prefix_cache"):
        engine = Engine(model, EngineConfig(page_size=args.page_size, num_pages=args.pool_pages,
                                            prefix_cache=mode == "prefix_cache", hash_interval=args.hash_interval,
                                            prefill_chunk=args.prefill_chunk))
        engine.generate([system[:8]], greedy(2), cache_salt="warm-up")  # a salt: the warm-up leaves no usable prefix
        history, turns = system, []
        for user in users:
            prompt = history + user
            req = engine.generate([prompt], greedy(args.reply_len))[0]
            turns.append({"prompt_tokens": len(prompt), "cached_tokens": req.cached_tokens,
                          "ttft_s": req.first_token_at - req.submitted_at})
            history = prompt + req.output
        out[mode] = turns
    for t, (c, h) in enumerate(zip(out["cold"], out["prefix_cache"])):
        print(f"  turn {t + 1}: prompt {c['prompt_tokens']:6d}  cold {1e3 * c['ttft_s']:9.1f} ms   "
              f"cached {h['cached_tokens']:6d} tokens {1e3 * h['ttft_s']:9.1f} ms", flush=True)
    later = range(1, len(users))
    if later:
        cold = sum(out["cold"][t]["ttft_s"] for t in later) / len(later)
        hot = sum(out["prefix_cache"][t]["ttft_s"] for t in later) / len(later)
        out["mean_ttft_later_turns_s"] = {"cold": cold, "prefix_cache": hot, "speedup": cold / hot}
        print(f"  turns 2..{len(users)}: mean TTFT cold {1e3 * cold:.1f} ms, with prefix cache {1e3 * hot:.1f} ms "
              f"({cold / hot:.1f}x)")
    return out


def bench_cache_bytes(model, args) -> list[dict]:
    rows = []
    for preset in dict.fromkeys([args.preset, "kimi-k3"]):
        sizes = cache_bytes_per_token(get_config(preset), dtype_bytes=2)
        row = {"config": preset, **sizes}
        for L in (4096, 32768, 131072, 1048576):
            row[f"hybrid_bytes_per_token_at_{L}"] = sizes["mla_bytes_per_token"] + sizes["kda_state_bytes"] / L
        rows.append(row)
        print(f"  {preset:10s} hybrid {sizes['mla_bytes_per_token']:8d} B/token + "
              f"{sizes['kda_state_bytes'] / 2**20:8.1f} MiB/sequence "
              f"(at 128K: {row['hybrid_bytes_per_token_at_131072']:8.0f} B/token)   "
              f"all-MLA {sizes['all_mla_bytes_per_token']:8d}   all-MHA {sizes['all_mha_bytes_per_token']:9d} B/token")
    engine = Engine(model, EngineConfig(page_size=args.page_size, num_pages=2))
    measured = engine.pool.page_bytes / engine.pool.page_size
    itemsize = engine.pool.dtype.itemsize
    rows[0]["measured_pool_bytes_per_token"] = measured
    rows[0]["measured_pool_dtype_bytes"] = itemsize
    rows[0]["measured_checkpoint_bytes"] = engine.pool.checkpoint_numel * 4
    print(f"  measured: the engine's pool stores {measured:.0f} B/token in {engine.pool.dtype} "
          f"({itemsize}-byte values), a KDA checkpoint {engine.pool.checkpoint_numel * 4 / 2**20:.2f} MiB")
    return rows


def bench_speculative(model, args, rng) -> list[dict]:
    if args.draft_layers is None:  # the engine's page pool needs an MLA layer in the draft
        c = model.config
        args.draft_layers = max(3, 1 + c.layer_types.index("mla"))
    draft = early_exit_draft(model, args.draft_layers)
    print(f"  draft: the target's first {args.draft_layers} of {model.config.num_hidden_layers} layers")
    rows = []
    for B in args.spec_batch_sizes:
        prompts = random_prompts(B, args.prompt_len, model.config.vocab_size, rng)
        config = dict(page_size=args.page_size, num_pages=args.pool_pages, max_batch=B, prefix_cache=False,
                      prefill_chunk=B * args.prompt_len)
        plain = Engine(model, EngineConfig(**config))
        decode_rate(plain, prompts, 4)
        base = decode_rate(plain, prompts, args.decode_tokens)
        for k in args.draft_k:
            engine = Engine(model, EngineConfig(num_draft_tokens=k, **config), draft=draft)
            decode_rate(engine, prompts, 4)
            before = dict(engine.counters)
            rate = decode_rate(engine, prompts, args.decode_tokens)
            c = {name: engine.counters[name] - before[name] for name in before}
            acc = c["accepted_tokens"] / c["draft_tokens"]
            # What the same round would give at a trained draft's acceptance a: (1 - a^(k+1)) / (1 - a) tokens per
            # round (Leviathan et al. 2023), each round costing what it cost here.
            round_s, step_s = c["decode_seconds"] / c["spec_rounds"], B / base
            projected = {f"{a:.1f}": (1 - a ** (k + 1)) / (1 - a) * step_s / round_s for a in (0.6, 0.8)}
            rows.append({"batch": B, "k": k, "draft_layers": args.draft_layers, "acceptance_rate": acc,
                         "tokens_per_s": rate, "baseline_tokens_per_s": base, "speedup": rate / base,
                         "round_s": round_s, "plain_step_s": step_s, "projected_speedup_at_acceptance": projected})
            print(f"  batch {B:3d} k {k}: acceptance {acc:6.1%}   {rate:9.1f} tok/s vs {base:9.1f} plain "
                  f"({rate / base:.2f}x); a round costs {round_s / step_s:.2f} plain steps -> "
                  f"{projected['0.6']:.2f}x at 60% acceptance, {projected['0.8']:.2f}x at 80%", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="[float32 on cpu, bfloat16 on cuda]")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: see docs/engine.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pool-pages", type=int, default=4096)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--user-len", type=int, default=128)
    p.add_argument("--reply-len", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--hash-interval", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--draft-layers", type=int, default=None,
                   help="layers of the early-exit draft [3, or up to the first MLA layer if that is deeper]")
    p.add_argument("--draft-k", type=int, nargs="+", default=[2, 4])
    p.add_argument("--spec-batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--parts", default="decode,ttft,cache,spec", help="which benchmarks, comma-separated [all]")
    p.add_argument("--out", default=None, help="JSON path [docs/engine_bench_<preset>_<device>.json]")
    args = p.parse_args()

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    model = build_model(args.preset, device, dtype, args.seed)
    counts = count_params(model.config)
    hw = hardware(device)
    print(f"openk3 engine bench: {args.preset} ({counts['total_params'] / 1e6:.1f}M params, "
          f"{counts['active_params'] / 1e6:.1f}M active) on {hw.get('gpu', hw['cpu'])}, {dtype}")
    print(f"  {hw['kda_backend']}")
    t0 = time.time()
    default = Path(__file__).resolve().parents[1] / "docs" / f"engine_bench_{args.preset}_{device.type}.json"
    out = Path(args.out) if args.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"fla_autotune": os.environ.get("OPENK3_FLA_AUTOTUNE", "3"), "preset": args.preset, "dtype": str(dtype),
              "device": args.device, "hardware": hw, "params": counts, "args": vars(args)}
    print("engine check")
    result["check"] = check_on_device(device, args.seed)
    parts = {"decode": ("decode throughput", lambda: bench_decode(model, args, rng)),
             "ttft": ("time to first token, multi-turn", lambda: bench_ttft(model, args, rng)),
             "cache": ("decode-cache bytes per token (bf16 latents, fp32 KDA state)",
                       lambda: bench_cache_bytes(model, args)),
             "spec": ("speculative decoding (early-exit draft: the target's first layers)",
                      lambda: bench_speculative(model, args, rng))}
    for name in args.parts.split(","):
        if name not in parts:
            raise SystemExit(f"--parts: unknown part {name!r}; expected some of {','.join(parts)}")
        title, run = parts[name]
        print(title)
        result[name] = run()
        result["wall_s"] = time.time() - t0
        out.write_text(json.dumps(result, indent=2) + "\n")  # after every part: a later failure loses nothing
    print(f"wrote {out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
