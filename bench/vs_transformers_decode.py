"""openk3's engine against transformers on the same weights, in one process (issue #12); prints tables, writes JSON.

    python bench/vs_transformers_decode.py --device cuda                          # H200: kimi-linear-1.5b, bf16
    python bench/vs_transformers_decode.py --config tiny --device cpu --quick --skip-transformers   # smoke test

One randomly initialised model (seeded; the router's load is checked and reported so a degenerate router cannot
flatter the numbers) is written once with openk3's `save_pretrained`; for a Kimi-Linear config that is Kimi-Linear's
names and config.json, which transformers' `KimiLinearForCausalLM` loads. Then, each part timed both ways:

  decode            tokens/s at batch 1/4/16/64: 512-token prompts, 128 greedy tokens, time from submit to the
                    last token (engine: continuous batching and its default decode path; transformers `generate`);
  prefill           time to the first token of one prompt of 8K/32K/64K tokens;
  prefix_hit_ttft   time to first token of a 32K-token turn cold vs after a prefix hit (engine only: transformers
                    has no prefix cache across calls);
  speculative       what the engine has: speculative decoding with an early-exit draft (the target's first
                    layers); acceptance rate and speed-up at batch 1. NOTE: a random model's acceptance says nothing
                    about a trained draft's;
  memory            KV/state bytes per sequence at 32K tokens (the engine's pool sizes) and the largest batch of
                    32K-token sequences that fits in the device memory left after the weights;
  profile           (not in the default list) the top ops of eager decode steps at each batch size, torch.profiler.

The JSON (`--out`, default bench/results/vs_transformers_decode.json) is rewritten atomically after every part, so
a run cut short still leaves the parts it finished; a later run of the same config, dtype and GPU keeps the parts it
does not rerun, so one benchmark may be split into several runs by `--parts`. `--quick` uses fewer, smaller sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import greedy, hardware, random_prompts  # noqa: E402
from openk3.config import get_config  # noqa: E402
from openk3.model import K3ForCausalLM, count_params  # noqa: E402
from openk3.model.checkpoint import is_k3_layout, load_pretrained, save_pretrained  # noqa: E402
from openk3.ops import select_kda_backend  # noqa: E402
from openk3.ops.kda.tuned import FLA_MODULES, autotune_candidates, limit_fla_autotuning  # noqa: E402
from openk3.serve.cache import PagePool, cache_bytes_per_token  # noqa: E402
from openk3.serve.engine import Engine, EngineConfig, early_exit_draft  # noqa: E402

PARTS = ("decode", "prefill", "prefix_hit_ttft", "speculative", "memory", "profile")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------------------ setup

def write_json(path: Path, data: dict) -> None:
    """Atomic: a temporary file beside `path`, renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_checkpoint(args, workdir: Path) -> tuple[K3ForCausalLM, Path, dict]:
    """The seeded random model, written once; the engine then runs what was loaded back from it."""
    config = get_config(args.config)
    with torch.device("meta"):  # built once, on the device (reset_parameters draws on the CPU and copies in)
        model = K3ForCausalLM(config)
    model.to_empty(device=args.device)
    model.reset_parameters(seed=args.seed)
    ckpt = workdir / "checkpoint"
    save_pretrained(model.cast(DTYPES[args.dtype]), ckpt)
    del model
    model = load_pretrained(ckpt, device=args.device, dtype=DTYPES[args.dtype]).eval()
    return model, ckpt, router_check(model, args)


@torch.inference_mode()
def router_check(model: K3ForCausalLM, args) -> dict:
    """How the random router spreads 256 random tokens over the experts: the share of experts that get any token and
    the largest expert's share of all routed slots (1 / num_experts when perfectly even)."""
    c = model.config
    if not model.moe_layers():
        return {"moe": False}
    ids = torch.randint(0, c.vocab_size, (1, 256), generator=torch.Generator().manual_seed(args.seed))
    out = model(ids.to(args.device), record=True)
    used, top = [], []
    for _, idx in out.router:
        load = torch.bincount(idx.flatten().cpu(), minlength=c.num_experts).float()
        used.append(float((load > 0).float().mean()))
        top.append(float(load.max() / load.sum()))
    check = {"moe": True, "experts_used_fraction_min": min(used), "max_expert_share_max": max(top),
             "even_share": 1 / c.num_experts}
    print(f"  router: every MoE layer routes to >= {min(used):.0%} of its {c.num_experts} experts; the busiest "
          f"expert takes <= {max(top):.1%} of the slots (even: {1 / c.num_experts:.1%})")
    if min(used) < 0.5:
        raise SystemExit("the random router is degenerate (fewer than half the experts get tokens); change --seed")
    return check


def load_transformers(ckpt: Path, args):
    """transformers' model of the same checkpoint, or None with --skip-transformers. transformers is a bench-only
    dependency (pip install 'openk3[bench]')."""
    if args.skip_transformers:
        return None
    if is_k3_layout(get_config(args.config)):
        raise SystemExit(f"--config {args.config} is K3-shaped: transformers has no K3 model; use a Kimi-Linear config "
                         f"(kimi-linear-1.5b) or --skip-transformers")
    try:
        import transformers
    except ImportError as error:
        raise SystemExit(f"transformers does not import ({error}): pip install 'openk3[bench]', "
                         f"or pass --skip-transformers") from None
    cls = getattr(transformers, "KimiLinearForCausalLM", None)
    if cls is None:
        raise SystemExit(f"transformers {transformers.__version__} has no KimiLinearForCausalLM; pip install "
                         f"'openk3[bench]' (transformers >= 5) or pass --skip-transformers")
    model = cls.from_pretrained(ckpt, dtype=DTYPES[args.dtype]).to(args.device).eval()
    print(f"  transformers {transformers.__version__}: {cls.__name__} loaded from the same checkpoint")
    return model


def engine_for(model, args, batch: int, draft=None, **kw) -> Engine:
    pages = kw.pop("num_pages", None) or args.pool_pages
    fast = {"auto": None, "fast": True, "general": False}[args.decode_path]
    return Engine(model, EngineConfig(page_size=args.page_size, num_pages=pages, max_batch=batch,
                                      prefill_chunk=args.prefill_chunk, fast_decode=fast,
                                      compile_decode=args.compile_decode, **kw), draft=draft)


# ------------------------------------------------------------------------------------------ parts

def timed_engine_run(engine: Engine, prompts: list[list[int]], tokens: int, device) -> tuple[float, list]:
    sync(device)
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, greedy(tokens))
    sync(device)
    return time.perf_counter() - t0, reqs


@torch.inference_mode()
def timed_hf_generate(hf, prompts: list[list[int]], tokens: int, device) -> tuple[float, list[list[int]]]:
    """Seconds of transformers' greedy `generate` of `tokens` tokens after each prompt, and the generated ids."""
    ids = torch.tensor(prompts, device=device)
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                      do_sample=False, pad_token_id=0)
    sync(device)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share (bf16 rounding lets them part after a while)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def part_decode(model, hf, args, rng) -> dict:
    out = {}
    V = model.config.vocab_size
    # one engine for every batch size (max_batch is only a cap), so its CUDA graphs (and compiled step) are built once
    engine = engine_for(model, args, max(args.batch_sizes), prefix_cache=False)
    for B in args.batch_sizes:
        prompts = random_prompts(B, args.prompt_len, V, rng)
        first, _ = timed_engine_run(engine, prompts, args.decode_tokens, args.device)  # warm-up: graph captures
        seconds, reqs = timed_engine_run(engine, prompts, args.decode_tokens, args.device)
        n = sum(len(r.output) for r in reqs)
        row = {"openk3_tokens_per_s": n / seconds, "openk3_seconds": seconds, "openk3_first_run_seconds": first,
               "openk3_decode_path": engine.decode_path, "generated_tokens": n,
               "openk3_decoder": dict(engine.target.decoder.counters) if engine.target.decoder else None}
        if hf is not None:
            timed_hf_generate(hf, prompts[:1], 4, args.device)  # warm-up
            hs, hf_out = timed_hf_generate(hf, prompts, args.decode_tokens, args.device)
            row.update(transformers_tokens_per_s=B * args.decode_tokens / hs, transformers_seconds=hs,
                       speedup=(n / seconds) / (B * args.decode_tokens / hs),
                       greedy_tokens_agreeing_with_transformers=[agreeing_prefix(r.output, o)
                                                                 for r, o in zip(reqs, hf_out)])
        out[str(B)] = row
        hf_rate = f"{row['transformers_tokens_per_s']:10.1f}" if hf is not None else f"{'-':>10s}"
        if B == args.batch_sizes[0]:
            print(f"  openk3 decode path: {engine.decode_path}")
        print(f"  batch {B:3d}: transformers {hf_rate} tok/s   openk3 {row['openk3_tokens_per_s']:10.1f} tok/s "
              f"(first run, with any graph captures: {first:.2f} s)", flush=True)
    return out


def part_profile(model, args, rng) -> dict:
    """Where a decode step's device time goes: `--profile-tokens` greedy tokens at each batch size under
    torch.profiler, CUDA graphs off (a graph's replay hides which op launched which kernel; the kernels' own times
    are the same), the top ops by self device time as tables beside the JSON and as rows in it."""
    from bench.vs_transformers import profile_step
    out = {}
    V, T = model.config.vocab_size, args.profile_tokens
    engine = engine_for(model, args, max(args.batch_sizes), prefix_cache=False, cuda_graphs=False)
    for B in args.batch_sizes:
        prompts = random_prompts(B, args.prompt_len, V, rng)
        timed_engine_run(engine, prompts, T, args.device)  # warm-up
        prefill_only, _ = timed_engine_run(engine, prompts, 1, args.device)
        seconds, _ = timed_engine_run(engine, prompts, T, args.device)
        rows = profile_step(lambda: timed_engine_run(engine, prompts, T, args.device),
                            args.out.parent / "vs_transformers_decode_profiles" / f"batch{B}.txt")
        step_ms = 1e3 * (seconds - prefill_only) / (T - 1)
        out[str(B)] = {"decode_step_ms_eager": step_ms, "tokens": T, "top_ops": rows}
        print(f"  batch {B:3d}: eager decode step {step_ms:.2f} ms; top ops: " +
              ", ".join(f"{r['op'][:40]} {r['share']:.0%}" for r in rows[:5]), flush=True)
    return out


def part_prefill(model, hf, args, rng) -> dict:
    out = {}
    V = model.config.vocab_size
    for L in args.prefill_lengths:
        prompt = random_prompts(1, L, V, rng)[0]
        engine = engine_for(model, args, 1, prefix_cache=False, num_pages=-(-(L + 8) // args.page_size) + 2)
        timed_engine_run(engine, [prompt[:args.page_size]], 1, args.device)  # warm-up
        try:
            seconds, _ = timed_engine_run(engine, [prompt], 1, args.device)
            row = {"openk3_seconds": seconds, "openk3_tokens_per_s": L / seconds}
        except torch.OutOfMemoryError as error:
            seconds, row = float("nan"), {"openk3_error": f"out of memory: {str(error).splitlines()[0]}"}
            torch.cuda.empty_cache()
        del engine
        if hf is not None:
            try:
                timed_hf_generate(hf, [prompt[:64]], 1, args.device)
                hs, _ = timed_hf_generate(hf, [prompt], 1, args.device)
                row.update(transformers_seconds=hs, transformers_tokens_per_s=L / hs)
                if "openk3_seconds" in row:
                    row["speedup"] = hs / seconds
            except torch.OutOfMemoryError as error:
                row["transformers_error"] = f"out of memory: {str(error).splitlines()[0]}"
                torch.cuda.empty_cache()
        out[str(L)] = row
        hf_s = f"{row['transformers_seconds']:8.3f} s" if "transformers_seconds" in row else \
            f"{row.get('transformers_error', '-')[:30]:>10s}"
        print(f"  prefill {L:6d} tokens: transformers {hf_s}   openk3 {seconds:8.3f} s "
              f"{row.get('openk3_error', '')}", flush=True)
    return out


def part_prefix_hit(model, args, rng) -> dict:
    """A conversation's second turn: its prompt is the first turn's prompt + reply + a new user message. TTFT of that
    turn cold (a fresh engine) and after the first turn (the prefix cache resumes at the end of the first turn)."""
    V = model.config.vocab_size
    L = args.ttft_len
    first = random_prompts(1, L - args.ttft_user_len - args.ttft_reply_len, V, rng)[0]
    user = random_prompts(1, args.ttft_user_len, V, rng)[0]
    # room for both turns' pages and every KDA checkpoint along them, so no checkpoint is declined for space
    ckpt = PagePool(model.config, 2, args.page_size, "meta", DTYPES[args.dtype]).checkpoint_pages
    pages = 3 * -(-L // args.page_size) + (L // 2048 + 4) * ckpt
    warm = engine_for(model, args, 1, num_pages=pages)
    timed_engine_run(warm, [first[:args.page_size]], 1, args.device)  # warm-up
    reply = warm.generate([first], greedy(args.ttft_reply_len))[0].output
    turn = first + reply + user
    hit = warm.generate([turn], greedy(1))[0]
    cold_engine = engine_for(model, args, 1, num_pages=pages, prefix_cache=False)
    timed_engine_run(cold_engine, [first[:args.page_size]], 1, args.device)
    cold = cold_engine.generate([turn], greedy(1))[0]
    hit_s, cold_s = hit.first_token_at - hit.submitted_at, cold.first_token_at - cold.submitted_at
    print(f"  {len(turn)}-token turn: cold {1e3 * cold_s:.1f} ms, after a prefix hit of {hit.cached_tokens} tokens "
          f"{1e3 * hit_s:.1f} ms ({cold_s / hit_s:.1f}x)", flush=True)
    return {"turn_tokens": len(turn), "cached_tokens": hit.cached_tokens, "cold_ttft_s": cold_s,
            "hit_ttft_s": hit_s, "hit_over_cold": hit_s / cold_s, "same_first_token": hit.output == cold.output}


def part_speculative(model, args, rng) -> dict:
    c = model.config
    layers = args.draft_layers or max(2, 1 + c.layer_types.index("mla"))
    draft = early_exit_draft(model, layers)
    prompts = random_prompts(1, args.prompt_len, c.vocab_size, rng)
    plain = engine_for(model, args, 1, prefix_cache=False)
    timed_engine_run(plain, prompts, 4, args.device)
    base_s, base = timed_engine_run(plain, prompts, args.decode_tokens, args.device)
    out = {"draft": f"early exit: the target's first {layers} of {c.num_hidden_layers} layers (no trained draft "
                    f"exists in openk3 yet)", "baseline_tokens_per_s": args.decode_tokens / base_s}
    for k in args.draft_k:
        engine = engine_for(model, args, 1, draft=draft, prefix_cache=False, num_draft_tokens=k)
        timed_engine_run(engine, prompts, 4, args.device)
        before = dict(engine.counters)
        seconds, reqs = timed_engine_run(engine, prompts, args.decode_tokens, args.device)
        acc = (engine.counters["accepted_tokens"] - before["accepted_tokens"]) / max(
            1, engine.counters["draft_tokens"] - before["draft_tokens"])
        row = {"acceptance_rate": acc, "tokens_per_s": args.decode_tokens / seconds,
               "speedup": base_s / seconds, "greedy_output_equal": reqs[0].output == base[0].output}
        out[f"k={k}"] = row
        print(f"  k {k}: acceptance {acc:6.1%}  {row['tokens_per_s']:9.1f} tok/s vs {out['baseline_tokens_per_s']:9.1f}"
              f" ({row['speedup']:.2f}x), greedy output {'equal' if row['greedy_output_equal'] else 'DIFFERS'}",
              flush=True)
    return out


def part_memory(model, hf, args) -> dict:
    """Per-sequence decode memory at 32K tokens, analytic (cache_bytes_per_token) and from the engine's pool (its page
    bytes and its KDA slot); the largest batch of such sequences that fits in the device memory free now (cached
    allocator blocks released first) plus what transformers' copy of the weights holds, if it is loaded."""
    c, L = model.config, 32768
    sizes = cache_bytes_per_token(c, dtype_bytes=DTYPES[args.dtype].itemsize)
    engine = engine_for(model, args, 1, num_pages=2)
    pool = engine.pool
    per_token = pool.page_bytes / pool.page_size
    kda_slot = sum(t[0].numel() * t.element_size() for t in engine.target.slots.recurrent + engine.target.slots.conv) \
        if engine.target.slots is not None else sizes["kda_state_bytes"]
    per_seq = pool.pages_for(L) * pool.page_bytes + kda_slot
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(args.device)
        if hf is not None:
            free += sum(p.numel() * p.element_size() for p in hf.parameters())
    else:
        free = total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out = {"context_tokens": L, "mla_bytes_per_token": per_token, "kda_state_bytes_per_sequence": kda_slot,
           "bytes_per_sequence": per_seq, "analytic": sizes, "device_free_bytes": free, "device_total_bytes": total,
           "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "max_batch_32k": int(free // per_seq)}
    print(f"  32K-token sequence: {per_token:.0f} B/token of MLA latents + {kda_slot / 2**20:.2f} MiB KDA state = "
          f"{per_seq / 2**20:.1f} MiB; {free / 2**30:.1f} GiB free -> at most {out['max_batch_32k']} sequences",
          flush=True)
    return out


def summary(results: dict) -> str:
    """The headline table of whatever parts `results` holds (markdown, as docs/engine.md quotes it)."""
    def num(row: dict, key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    lines = [f"hardware: {results['hardware'].get('gpu', results['hardware']['cpu'])}, {results['config']}, "
             f"{results['dtype']}"]
    if "decode" in results:
        lines += ["", "| batch | transformers tokens/s | openk3 tokens/s | speed-up |", "|---|---|---|---|"]
        lines += [f"| {b} | {num(r, 'transformers_tokens_per_s', ',.1f')} | {num(r, 'openk3_tokens_per_s', ',.1f')} | "
                  f"{num(r, 'speedup', '.1f')} |" for b, r in results["decode"].items()]
    if "prefill" in results:
        lines += ["", "| prompt tokens | transformers s | openk3 s | speed-up |", "|---|---|---|---|"]
        lines += [f"| {n} | {num(r, 'transformers_seconds', '.3f')} | {num(r, 'openk3_seconds', '.3f')} | "
                  f"{num(r, 'speedup', '.1f')} |" for n, r in results["prefill"].items()]
    if "prefix_hit_ttft" in results:
        t = results["prefix_hit_ttft"]
        lines += ["", f"TTFT of a {t['turn_tokens']}-token turn: cold {t['cold_ttft_s']:.3f} s, after a prefix hit "
                      f"{t['hit_ttft_s']:.3f} s ({t['hit_over_cold']:.3f} of cold)"]
    if "memory" in results:
        m = results["memory"]
        lines += [f"32K-token sequence: {m['bytes_per_sequence'] / 2**20:.1f} MiB; largest batch that fits: "
                  f"{m['max_batch_32k']}"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="kimi-linear-1.5b", help="preset or config.json [kimi-linear-1.5b]")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="[bfloat16 on cuda, float32 on cpu]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", default=",".join(PARTS[:-1]), help=f"comma-separated, of {','.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="fewer and smaller sizes")
    p.add_argument("--skip-transformers", action="store_true", help="time openk3 only")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "vs_transformers_decode.json")
    p.add_argument("--workdir", type=Path, default=None, help="where the checkpoint is written [a temporary dir]")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pool-pages", type=int, default=None, help="[enough for the largest decode batch]")
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="[1 4 16 64; quick: 1 4]")
    p.add_argument("--prompt-len", type=int, default=None, help="[512; quick: 32]")
    p.add_argument("--decode-tokens", type=int, default=None, help="[128; quick: 16]")
    p.add_argument("--prefill-lengths", type=int, nargs="+", default=None, help="[8192 32768 65536; quick: 256]")
    p.add_argument("--ttft-len", type=int, default=None, help="tokens of the prefix-hit turn [32768; quick: 512]")
    p.add_argument("--draft-layers", type=int, default=None)
    p.add_argument("--draft-k", type=int, nargs="+", default=[2, 4])
    p.add_argument("--profile-tokens", type=int, default=16, help="greedy tokens per profiled run (part profile)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile-decode", action="store_true", help="torch.compile the fast path's decode step")
    p.add_argument("--decode-path", choices=("auto", "fast", "general"), default="auto",
                   help="the engine's decode path: its default (fast on CUDA), or forced [auto]")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32")
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        raise SystemExit(f"--parts {args.parts!r}: unknown part(s) {bad}; choose from {','.join(PARTS)}")
    args.parts = parts
    if args.profile_tokens < 2:
        raise SystemExit(f"--profile-tokens {args.profile_tokens}: must be at least 2 (a step after the prefill)")
    q = args.quick
    args.batch_sizes = args.batch_sizes or ([1, 4] if q else [1, 4, 16, 64])
    args.prompt_len = args.prompt_len or (32 if q else 512)
    args.decode_tokens = args.decode_tokens or (16 if q else 128)
    args.prefill_lengths = args.prefill_lengths or ([256] if q else [8192, 32768, 65536])
    args.ttft_len = args.ttft_len or (512 if q else 32768)
    args.ttft_user_len, args.ttft_reply_len = (32, 8) if q else (256, 64)
    need = max(args.batch_sizes) * -(-(args.prompt_len + args.decode_tokens + max(args.draft_k)) // args.page_size)
    args.pool_pages = args.pool_pages or need + 2
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    results = {"hardware": hardware(args.device), "config": args.config, "dtype": args.dtype,
               "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
               "settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir", "device")}}
    results["settings"]["device"] = str(args.device)
    if args.out.is_file():  # parts of an earlier run of the same model stay (runs may be split by part)
        old = json.loads(args.out.read_text())
        if (old.get("config"), old.get("dtype"), old.get("hardware", {}).get("gpu")) == \
                (args.config, args.dtype, results["hardware"].get("gpu")):
            results = {**{k: v for k, v in old.items() if k in PARTS}, **results}
    print(f"hardware: {results['hardware']}")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        print(f"building {args.config} ({args.dtype}, seed {args.seed}) and writing its checkpoint to {workdir}")
        model, ckpt, results["router"] = build_checkpoint(args, workdir)
        results["params"] = count_params(model.config)
        hf = load_transformers(ckpt, args) if {"decode", "prefill"} & set(args.parts) else None
        if hf is not None and select_kda_backend(args.device).name == "fla":
            # transformers' model runs fla's layers: they autotune the way openk3's kernels do
            print(f"fla: {limit_fla_autotuning(FLA_MODULES + ('fla.layers', 'fla.modules'))} more kernels cut to "
                  f"{autotune_candidates() or 'all'} autotune candidates (OPENK3_FLA_AUTOTUNE)")
        write_json(args.out, results)
        for part in args.parts:
            print(f"\n{part}:")
            if part == "decode":
                results["decode"] = part_decode(model, hf, args, rng)
            elif part == "prefill":
                results["prefill"] = part_prefill(model, hf, args, rng)
            elif part == "prefix_hit_ttft":
                results["prefix_hit_ttft"] = part_prefix_hit(model, args, rng)
            elif part == "speculative":
                results["speculative"] = part_speculative(model, args, rng)
            elif part == "profile":
                results["profile"] = part_profile(model, args, rng)
            else:
                results["memory"] = part_memory(model, hf, args)
            write_json(args.out, results)
    print("\n" + summary(results))
    print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    main()
