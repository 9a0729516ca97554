"""openk3's engine against transformers on the same weights, in one process (issue #12); prints tables, writes JSON.

    python bench/vs_transformers_decode.py --device cuda                          # H200: kimi-linear-1.5b, bf16
    python bench/vs_transformers_decode.py --config tiny --device cpu --quick --skip-transformers   # smoke test

One randomly initialised model (seeded; the router's load is checked and reported so a degenerate router cannot
flatter the numbers) is written once with openk3's `save_pretrained`; for a Kimi-Linear config that is Kimi-Linear's
names and config.json, which transformers' `KimiLinearForCausalLM` loads. Then, each part timed both ways:

  decode            tokens/s at batch 1/4/16/64: 512-token prompts, 128 greedy tokens, time from submit to the
                    last token (engine: continuous batching and its default decode path, the median of
                    --decode-runs timed runs after two untimed ones; transformers `generate`, one timed run);
  prefill           time to the first token of one prompt of 8K/32K/64K tokens;
  prefix_hit_ttft   time to first token of a 32K-token turn cold vs after a prefix hit (engine only: transformers
                    has no prefix cache across calls), and the host split of another hit turn (`hit_host_split`);
  speculative       speculative decoding at batch 1 with a trained draft: the target (this model) and a 2-layer
                    half-width draft train briefly in turn on the same corpus (the stdlib's .py files) with the same
                    BPE tokenizer, then decode held-out prompts greedily: acceptance rate, tokens/s and speed-up per
                    --draft-k, whether the greedy output equals the plain engine's (it must in fp32), the training
                    losses and seconds; the trained target's first layers (early exit) as a second draft;
  memory            KV/state bytes per sequence at 32K tokens (the engine's pool sizes) and the largest batch of
                    32K-token sequences that fits in the device memory left after the weights;
  profile           (not in the default list) the top ops of eager decode steps at each batch size, torch.profiler.

The JSON (`--out`, default bench/results/vs_transformers_decode.json) is rewritten atomically after every part, so
a run cut short still leaves the parts it finished; a later run of the same config, dtype and GPU keeps the parts it
does not rerun, so one benchmark may be split into several runs by `--parts`. `--quick` uses fewer, smaller sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import greedy, hardware, random_prompts  # noqa: E402
from openk3.config import K3Config, get_config  # noqa: E402
from openk3.model import K3ForCausalLM, count_params  # noqa: E402
from openk3.model.checkpoint import is_k3_layout, load_pretrained, save_pretrained  # noqa: E402
from openk3.model.model import CUDNN_PREFIX_ENV  # noqa: E402
from openk3.ops import select_kda_backend  # noqa: E402
from openk3.ops.kda.tuned import FLA_MODULES, autotune_candidates, limit_fla_autotuning  # noqa: E402
from openk3.serve.cache import PagePool, cache_bytes_per_token  # noqa: E402
from openk3.serve.engine import Engine, EngineConfig, early_exit_draft  # noqa: E402
from openk3.text.tokenizer import Tokenizer, train_bpe  # noqa: E402
from openk3.train.data import IGNORE_INDEX, TokenizedCorpus, load_corpus, split_train_val, tokenize_corpus  # noqa: E402
from openk3.train.optim import cosine_schedule  # noqa: E402
from openk3.train.trainer import RouterBalancer, RowStreams, TrainArgs, evaluate  # noqa: E402

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


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back before an engine's runs at a new length: each engine then
    starts from the same state instead of from the blocks the other one's longest run left reserved (where those
    blocks do not fit, the allocator frees and re-allocates inside the timed run, each a device sync)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


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


OVERLAP = {"auto": None, "on": True, "off": False}  # --overlap -> EngineConfig.overlap


def engine_for(model, args, batch: int, draft=None, **kw) -> Engine:
    pages = kw.pop("num_pages", None) or args.pool_pages
    fast = {"auto": None, "fast": True, "general": False}[args.decode_path]
    return Engine(model, EngineConfig(page_size=args.page_size, num_pages=pages, max_batch=batch,
                                      prefill_chunk=args.prefill_chunk, fast_decode=fast,
                                      compile_decode=args.compile_decode,
                                      overlap=OVERLAP[args.overlap] if draft is None else None, **kw), draft=draft)


# ------------------------------------------------------------------------------------------ parts

def timed_engine_run(engine: Engine, prompts: list[list[int]], tokens: int, device) -> tuple[float, list]:
    sync(device)
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, greedy(tokens))
    sync(device)
    return time.perf_counter() - t0, reqs


def prefill_and_step(reqs: list, tokens: int) -> tuple[float, float]:
    """The split of a run's submit-to-last-token: (seconds to the last request's first token, the prefill; ms a
    decode step after it, over the tokens - 1 steps that follow)."""
    ttft = max(r.first_token_at for r in reqs) - min(r.submitted_at for r in reqs)
    after = max(r.finished_at for r in reqs) - max(r.first_token_at for r in reqs)
    return ttft, 1e3 * after / (tokens - 1)


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
        # two untimed runs: the first captures the bucket's CUDA graphs; the second lets the caching allocator settle
        # (on the H200 the first run after the captures still made 88-90 device allocations, adding ~30 ms to a
        # batch-64 prefill, bench/results/decode_probe/eighteenth); then `--decode-runs` timed runs, the median
        # reported and every run listed
        first, _ = timed_engine_run(engine, prompts, args.decode_tokens, args.device)
        timed_engine_run(engine, prompts, args.decode_tokens, args.device)
        runs, outputs = [], []
        for _ in range(args.decode_runs):
            seconds, reqs = timed_engine_run(engine, prompts, args.decode_tokens, args.device)
            ttft, ms_per_step = prefill_and_step(reqs, args.decode_tokens)
            n = sum(len(r.output) for r in reqs)
            runs.append({"tokens_per_s": n / seconds, "seconds": seconds, "ttft_s": ttft,
                         "decode_ms_per_step": ms_per_step, "generated_tokens": n})
            outputs.append(reqs)
        # the median run (of an even count, the slower of the two middle ones)
        median = sorted(range(len(runs)), key=lambda i: runs[i]["tokens_per_s"])[(len(runs) - 1) // 2]
        run, reqs = runs[median], outputs[median]
        rate, ttft = run["tokens_per_s"], run["ttft_s"]
        row = {"openk3_tokens_per_s": rate, "openk3_seconds": run["seconds"], "openk3_first_run_seconds": first,
               "openk3_ttft_s": ttft, "openk3_decode_ms_per_step": run["decode_ms_per_step"], "openk3_runs": runs,
               "openk3_decode_path": engine.decode_path, "generated_tokens": run["generated_tokens"],
               "openk3_decoder": dict(engine.target.decoder.counters) if engine.target.decoder else None}
        if hf is not None:
            timed_hf_generate(hf, prompts[:1], 4, args.device)  # warm-up
            hs, hf_out = timed_hf_generate(hf, prompts, args.decode_tokens, args.device)
            row.update(transformers_tokens_per_s=B * args.decode_tokens / hs, transformers_seconds=hs,
                       speedup=rate / (B * args.decode_tokens / hs),
                       greedy_tokens_agreeing_with_transformers=[agreeing_prefix(r.output, o)
                                                                 for r, o in zip(reqs, hf_out)])
        out[str(B)] = row
        hf_rate = f"{row['transformers_tokens_per_s']:10.1f}" if hf is not None else f"{'-':>10s}"
        if B == args.batch_sizes[0]:
            print(f"  openk3 decode path: {engine.decode_path}")
        rates = ", ".join(f"{r['tokens_per_s']:.0f}" for r in runs)
        print(f"  batch {B:3d}: transformers {hf_rate} tok/s   openk3 {row['openk3_tokens_per_s']:10.1f} tok/s, median "
              f"of {len(runs)} (prefill {1e3 * ttft:.1f} ms, then {row['openk3_decode_ms_per_step']:.2f} ms a step; "
              f"runs {rates}; first run, with any graph captures: {first:.2f} s)", flush=True)
    return out


def part_profile(model, args, rng) -> dict:
    """Where a decode step's device time goes: `--profile-tokens` greedy tokens at each batch size under
    torch.profiler, the top ops by self device time as tables beside the JSON and as rows in it. CUDA graphs are off
    by default (a graph's replay hides which op launched which kernel); with `--profile-graphs` the step runs as the
    engine runs it (graphs, and `--compile-decode`'s fused kernels), listed by kernel name."""
    from bench.vs_transformers import profile_step
    out = {}
    V, T = model.config.vocab_size, args.profile_tokens
    graphs = None if args.profile_graphs else False
    engine = engine_for(model, args, max(args.batch_sizes), prefix_cache=False, cuda_graphs=graphs)
    kind = ("graphs" if args.profile_graphs else "eager") + ("_compiled" if args.compile_decode else "")
    for B in args.batch_sizes:
        prompts = random_prompts(B, args.prompt_len, V, rng)
        timed_engine_run(engine, prompts, T, args.device)  # warm-up
        prefill_only, _ = timed_engine_run(engine, prompts, 1, args.device)
        seconds, _ = timed_engine_run(engine, prompts, T, args.device)
        rows = profile_step(lambda: timed_engine_run(engine, prompts, T, args.device),
                            args.out.parent / "vs_transformers_decode_profiles" / f"batch{B}_{kind}.txt")
        step_ms = 1e3 * (seconds - prefill_only) / (T - 1)
        out[str(B)] = {"decode_path": engine.decode_path, "decode_step_ms": step_ms, "tokens": T, "top_ops": rows}
        print(f"  batch {B:3d}: {kind} decode step {step_ms:.2f} ms; top ops: " +
              ", ".join(f"{r['op'][:40]} {r['share']:.0%}" for r in rows[:5]), flush=True)
    return out


def part_prefill(model, hf, args, rng) -> dict:
    out = {}
    V = model.config.vocab_size
    for L in args.prefill_lengths:
        prompt = random_prompts(1, L, V, rng)[0]
        release_cached_memory(args.device)
        engine = engine_for(model, args, 1, prefix_cache=False, num_pages=-(-(L + 8) // args.page_size) + 2)
        try:
            # warm-up at the timed length: fla's kernels compile (and autotune) per shape, and a shorter warm-up
            # left the first 8K run timing its compiles (docs/engine.md); transformers gets the same below
            timed_engine_run(engine, [prompt], 1, args.device)
            seconds, _ = timed_engine_run(engine, [prompt], 1, args.device)
            row = {"openk3_seconds": seconds, "openk3_tokens_per_s": L / seconds}
        except torch.OutOfMemoryError as error:
            seconds, row = float("nan"), {"openk3_error": f"out of memory: {str(error).splitlines()[0]}"}
            torch.cuda.empty_cache()
        del engine
        if hf is not None:
            release_cached_memory(args.device)
            try:
                timed_hf_generate(hf, [prompt], 1, args.device)
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
    turn cold (a fresh engine) and after the first turn (the prefix cache resumes at the end of the first turn).
    Each engine first serves one whole conversation of the same lengths (other random tokens) untimed: the kernels
    of the shapes the timed turn meets (fla's chunk kernels compile and autotune per shape; a prefix hit leaves a
    short chunk over a long cache) are then ready for both, as they are in a server that has run a while."""
    V = model.config.vocab_size
    L = args.ttft_len
    # room for both turns' pages and every KDA checkpoint along them, so no checkpoint is declined for space
    ckpt = PagePool(model.config, 2, args.page_size, "meta", DTYPES[args.dtype]).checkpoint_pages
    pages = 3 * -(-L // args.page_size) + (L // 2048 + 4) * ckpt
    warm = engine_for(model, args, 1, num_pages=pages)
    cold_engine = engine_for(model, args, 1, num_pages=pages, prefix_cache=False)

    def second_turn() -> list[int]:
        """A first turn served by `warm` (its prompt and reply then cached), and the next turn's prompt."""
        first = random_prompts(1, L - args.ttft_user_len - args.ttft_reply_len, V, rng)[0]
        user = random_prompts(1, args.ttft_user_len, V, rng)[0]
        reply = warm.generate([first], greedy(args.ttft_reply_len))[0].output
        return first + reply + user

    untimed = second_turn()
    warm.generate([untimed], greedy(1))
    cold_engine.generate([untimed], greedy(1))
    turn = second_turn()
    hit = warm.generate([turn], greedy(1))[0]
    cold = cold_engine.generate([turn], greedy(1))[0]
    hit_s, cold_s = hit.first_token_at - hit.submitted_at, cold.first_token_at - cold.submitted_at
    # the first token's logprob on each side; where the two picked different tokens, also the cold model's logprob
    # of the hit's token (`score`, the same chunks as the cold prefill): the margin the rounding had to cross
    first = {"hit_logprob": hit.logprobs[0], "cold_logprob": cold.logprobs[0]}
    if hit.output != cold.output:
        first["cold_logprob_of_hit_token"] = cold_engine.score(turn + hit.output[:1])[-1]
    print(f"  {len(turn)}-token turn: cold {1e3 * cold_s:.1f} ms, after a prefix hit of {hit.cached_tokens} tokens "
          f"{1e3 * hit_s:.1f} ms ({cold_s / hit_s:.1f}x); first token " +
          ", ".join(f"{k} {v:.4f}" for k, v in first.items()), flush=True)
    split = host_split(warm, second_turn())
    print("  host split of another hit turn (cProfile, ms): " +
          ", ".join(f"{k} {v['ms']:.2f}" for k, v in split.items()), flush=True)
    return {"turn_tokens": len(turn), "cached_tokens": hit.cached_tokens, "cold_ttft_s": cold_s,
            "hit_ttft_s": hit_s, "hit_over_cold": hit_s / cold_s, "same_first_token": hit.output == cold.output,
            "first_token": first, "hit_host_split": split}


def host_split(engine: Engine, prompt: list[int]) -> dict:
    """Where the host's time goes in the steps that serve one turn of `prompt` to its first (and only) token, from
    cProfile: cumulative ms and calls of the engine's pieces (the submit's checks, the prefix cache's lookup, its
    restore of pages and the KDA checkpoint, the forwards, publishing blocks and checkpoints (the prompt end's and
    the turn end's, which the one-token turn writes in the same step), the first token's sampling) and of the
    whole steps. cProfile slows Python, so the pieces are a split, not timings; on the GPU a piece that reads a
    device value back also holds the device time before it (docs/engine.md "Host time of a prefill and of a
    prefix hit")."""
    import cProfile
    import inspect
    import pstats
    from openk3.serve.cache import PrefixCache
    from openk3.serve.runner import ModelRunner
    from openk3.serve.sampler import sample_tokens
    pieces = {"submit": Engine.submit, "step": Engine.step, "prefix_lookup": PrefixCache.lookup,
              "prefix_use": PrefixCache.use, "forward": ModelRunner.forward,
              "model_forward": K3ForCausalLM.forward, "publish_blocks": PrefixCache.publish_blocks,
              "checkpoint": PrefixCache.checkpoint, "sample_first_token": sample_tokens, "join": ModelRunner.join}
    profile = cProfile.Profile()
    profile.enable()
    req = engine.submit(prompt, greedy(1))
    while not req.finished:
        engine.step()
    profile.disable()
    stats = pstats.Stats(profile).stats
    out = {}
    for name, fn in pieces.items():
        code = inspect.unwrap(fn).__code__
        row = stats.get((code.co_filename, code.co_firstlineno, code.co_name))
        out[name] = {"ms": 1e3 * row[3] if row else 0.0, "calls": row[1] if row else 0}
    return out


# ------------------------------------------------------------------------------------------ trained draft

SPEC_VAL_FRACTION = 0.05  # documents held out: the prompts of the measurement and the held-out loss come from them


def draft_config(config: K3Config) -> K3Config:
    """The speculative part's draft: the target's family at 2 layers and half the width. Layer 1 is KDA, layer 2
    MLA: the engine's page pool needs an MLA layer in the draft, and exact attention over the prompt lets it copy
    what code repeats (names, indentation). Both layers dense (no router to train or dispatch). The same vocabulary
    and token ids, which the engine requires. Why this size: at batch 1 a decode step is bound by kernel launches
    and host syncs, not FLOPs, so the draft's cost is set by its layer count (2 of 16 at kimi-linear-1.5b); half the
    width buys acceptance for nothing there, while its training stays a small fraction of the target's."""
    lac = dataclasses.asdict(config.linear_attn_config)
    return config.replace(
        num_hidden_layers=2, hidden_size=config.hidden_size // 2, intermediate_size=config.intermediate_size // 2,
        num_attention_heads=max(1, config.num_attention_heads // 2),
        num_key_value_heads=max(1, config.num_key_value_heads // 2), first_k_dense_replace=2,
        linear_attn_config={**lac, "num_heads": max(1, lac["num_heads"] // 2), "kda_layers": [1],
                            "full_attn_layers": [2]})


def spec_data(config: K3Config, args) -> tuple[Tokenizer, TokenizedCorpus, TokenizedCorpus]:
    """The corpus both models learn: `openk3 train`'s default (the stdlib's .py files, or a deterministic sample of
    `--spec-corpus-mb` of them), split by document, and the project's byte-level BPE trained on the training part.
    The tokenizer's ids must be the target's: ids 0..vocab-1 within the config's vocabulary (rows beyond are never
    seen), and the config's bos/eos/pad ids."""
    max_bytes = int(args.spec_corpus_mb * 1e6) if args.spec_corpus_mb else None
    train_docs, val_docs = split_train_val(load_corpus(None, max_bytes=max_bytes), SPEC_VAL_FRACTION, seed=0)
    tokenizer = train_bpe((d.text for d in train_docs), min(args.spec_vocab, config.vocab_size))
    ids = {"bos": (tokenizer.bos_id, config.bos_token_id), "eos": (tokenizer.eos_id, config.eos_token_id),
           "pad": (tokenizer.pad_id, config.pad_token_id)}
    bad = {k: v for k, v in ids.items() if v[0] != v[1]}
    if bad:
        raise SystemExit(f"--config {args.config}: its token ids differ from the BPE tokenizer's ({bad}, "
                         f"tokenizer first); the speculative part trains the config as it is")
    return tokenizer, tokenize_corpus(train_docs, tokenizer), tokenize_corpus(val_docs, tokenizer)


def train_briefly(model: K3ForCausalLM, data: RowStreams, val: TokenizedCorpus, tokenizer: Tokenizer,
                  args, teacher: K3ForCausalLM | None = None) -> dict:
    """The shortest correct loop over openk3's training pieces. `openk3 train`'s loop (trainer.train) is a whole
    run: a run directory, fp32 master weights with Muon, evaluation and checkpoints of every optimizer state; this
    trains the weights as they are (bf16 on CUDA: the bf16-weights + AdamW path docs/training.md measured at ~55K
    tokens/s for kimi-linear-1.5b) with AdamW, the trainer's warmup + cosine schedule, gradient clipping and
    Quantile Balancing of the routers (its RouterBalancer and defaults). `data` is advanced. Returns the mean loss
    of the last 10 steps, the held-out loss (trainer.evaluate) and the seconds of the steps (the first one apart).
    `teacher`: the labels are the teacher's greedy next tokens at every position that has a label (distillation
    with hard labels: what a greedy speculative round accepts is exactly the target's argmax), not the corpus's."""
    device, steps = model.lm_head.weight.device, args.spec_train_steps
    model.train().requires_grad_(True)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.spec_lr, betas=(0.9, 0.95), weight_decay=TrainArgs.weight_decay,
                            fused=device.type == "cuda")
    balancer = RouterBalancer(model, TrainArgs.balance, TrainArgs.qb_bins, TrainArgs.sign_rate)
    losses = []
    sync(device)
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = args.spec_lr * cosine_schedule(step, steps, TrainArgs.warmup, TrainArgs.min_lr_ratio)
        batch = next(data).to(device)
        labels = batch.labels
        if teacher is not None:
            with torch.no_grad():
                argmax = teacher(batch.input_ids, cu_seqlens=batch.cu_seqlens, validate=False).logits.argmax(-1)
            labels = torch.where(labels == IGNORE_INDEX, labels, argmax)
        out = model(batch.input_ids, labels=labels, cu_seqlens=batch.cu_seqlens,
                    loss_chunk=TrainArgs.loss_chunk, record=True)
        out.loss.backward()
        balancer.after_forward(out.router)
        torch.nn.utils.clip_grad_norm_(params, TrainArgs.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balancer.end_step()
        losses.append(out.loss.item())
        if step == 0:  # on CUDA the first step compiles (and autotunes) the backward's Triton kernels
            first_step_s = time.perf_counter() - t0
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"the training loss is {losses[-1]} at step {step + 1}; lower --spec-lr")
    sync(device)
    seconds = time.perf_counter() - t0
    del opt
    model.eval().requires_grad_(False)
    held_out = evaluate(model, val, tokenizer, batch_size=data.batch_size, seq_len=data.seq_len,
                        max_tokens=4 * data.batch_size * data.seq_len)
    tail = losses[-10:]
    return {"train_loss": sum(tail) / len(tail), "first_loss": losses[0], "held_out_loss": held_out["loss"],
            "train_seconds": seconds, "first_step_seconds": first_step_s, "steps": steps,
            "train_tokens_per_s": steps * data.batch_size * data.seq_len / seconds}


def held_out_prompts(val: TokenizedCorpus, n: int, length: int, continuation: int) -> list[list[int]]:
    """`n` prompts of `length` tokens: the starts of consecutive windows of `length + continuation` tokens of the
    held-out documents, in document order (so held-out text, not the prompt alone, follows each prompt)."""
    need, prompts = length + continuation, []
    for a, b in zip(val.doc_offsets[:-1].tolist(), val.doc_offsets[1:].tolist()):
        for start in range(a, b - need + 1, need):
            prompts.append(val.tokens[start:start + length].tolist())
            if len(prompts) == n:
                return prompts
    raise SystemExit(f"--spec-prompts {n}: the held-out documents hold only {len(prompts)} windows of "
                     f"{need} tokens (--prompt-len + --decode-tokens); raise --spec-corpus-mb or ask for fewer")


def speculative_rows(target: K3ForCausalLM, draft: K3ForCausalLM, prompts: list[list[int]], base_s: float,
                     base: list, args) -> dict:
    """Per k of --draft-k, the prompts one after another at batch 1 with `draft`: acceptance (accepted / drafted
    tokens), tokens/s, speed-up over the plain engine's `base_s`, and whether every greedy output equals `base`."""
    rows = {}
    for k in args.draft_k:
        engine = engine_for(target, args, 1, draft=draft, prefix_cache=False, num_draft_tokens=k)
        timed_engine_run(engine, prompts[:1], 4, args.device)  # warm-up
        before = dict(engine.counters)
        seconds, reqs = timed_engine_run(engine, prompts, args.decode_tokens, args.device)
        n = {key: engine.counters[key] - before[key] for key in ("draft_tokens", "accepted_tokens", "spec_rounds")}
        row = {"acceptance_rate": n["accepted_tokens"] / max(1, n["draft_tokens"]),
               "tokens_per_round": (n["accepted_tokens"] + n["spec_rounds"]) / max(1, n["spec_rounds"]),
               "tokens_per_s": sum(len(r.output) for r in reqs) / seconds, "speedup": base_s / seconds,
               "greedy_output_equal": [r.output for r in reqs] == [b.output for b in base]}
        rows[f"k={k}"] = row
        print(f"    k {k}: acceptance {row['acceptance_rate']:6.1%} ({row['tokens_per_round']:.2f} tokens a round)  "
              f"{row['tokens_per_s']:9.1f} tok/s ({row['speedup']:.2f}x), greedy output "
              f"{'equal' if row['greedy_output_equal'] else 'DIFFERS'}", flush=True)
    return rows


def part_speculative(ckpt: Path, args) -> dict:
    """Speculative decoding at batch 1 with a trained draft. The target (the bench's model, loaded again from its
    checkpoint) and a draft (`draft_config`, seeded init) train in turn on the same batches of the same corpus
    with the same tokenizer (`spec_data`, `train_briefly`); then the plain engine and the engine with each draft
    k decode the same held-out prompts greedily. The trained target's first layers (early exit) are a second row.
    NOTE: in fp32 the greedy outputs must equal the plain engine's (a speculative round changes the speed, never
    the tokens); in bf16 the verify forward over k + 1 tokens may round differently from one-token steps."""
    target = load_pretrained(ckpt, device=args.device, dtype=DTYPES[args.dtype])
    c = target.config
    t0 = time.perf_counter()
    tokenizer, train, val = spec_data(c, args)
    data_s = time.perf_counter() - t0
    print(f"  data: {train.num_tokens:,} training / {val.num_tokens:,} held-out tokens of the stdlib's .py files, "
          f"BPE vocabulary {tokenizer.vocab_size} ({data_s:.1f} s)", flush=True)
    with torch.device("meta"):
        draft = K3ForCausalLM(draft_config(c))
    draft.to_empty(device=args.device)
    draft.reset_parameters(seed=args.seed + 1)
    draft.cast(DTYPES[args.dtype])
    trained = {}
    for name, m in (("target", target), ("draft", draft)):  # a stream each, the same batches (trainer's rows)
        data = RowStreams(train, args.spec_train_batch, args.spec_train_seq, seed=args.seed)
        teacher = target if name == "draft" and args.spec_draft_labels == "target" else None
        trained[name] = train_briefly(m, data, val, tokenizer, args, teacher)
        t = trained[name]
        print(f"  trained the {name}: {t['steps']} steps of {args.spec_train_batch} x {args.spec_train_seq} tokens "
              f"in {t['train_seconds']:.1f} s (the first {t['first_step_seconds']:.1f} s; "
              f"{t['train_tokens_per_s']:,.0f} tokens/s), loss {t['first_loss']:.2f} "
              f"-> {t['train_loss']:.2f}, held out {t['held_out_loss']:.2f}", flush=True)
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    prompts = held_out_prompts(val, args.spec_prompts, args.prompt_len, args.decode_tokens)
    plain = engine_for(target, args, 1, prefix_cache=False)
    timed_engine_run(plain, prompts[:1], 4, args.device)  # warm-up
    base_s, base = timed_engine_run(plain, prompts, args.decode_tokens, args.device)
    d = draft.config
    labels = "the trained target's greedy tokens" if args.spec_draft_labels == "target" else "the corpus's next tokens"
    out = {"draft": f"trained: {d.num_hidden_layers} layers ({', '.join(d.layer_types)}, dense), hidden "
                    f"{d.hidden_size} of {c.hidden_size}, on the target's data and tokenizer, labels {labels}",
           "draft_params": sum(p.numel() for p in draft.parameters()),
           "target_params": sum(p.numel() for p in target.parameters()),
           "baseline_tokens_per_s": sum(len(r.output) for r in base) / base_s,
           "baseline_decode_path": plain.decode_path,
           # a briefly trained model may loop on one token (a newline); then equal outputs prove less
           "baseline_distinct_tokens": len({t for r in base for t in r.output}),
           "prompts": len(prompts), "prompt_source": "held-out documents of the training corpus",
           "tokenizer_vocab": tokenizer.vocab_size, "train_tokens": train.num_tokens, "data_seconds": data_s,
           "train_batch": [args.spec_train_batch, args.spec_train_seq], "lr": args.spec_lr}
    for name, t in trained.items():
        out.update({f"{name}_{key}": v for key, v in t.items()})
    print(f"  plain engine ({plain.decode_path}): {out['baseline_tokens_per_s']:.1f} tok/s over {len(prompts)} "
          f"held-out prompts; trained draft ({out['draft_params'] / 1e6:.1f}M parameters):", flush=True)
    out.update(speculative_rows(target, draft, prompts, base_s, base, args))
    layers = args.draft_layers or max(2, 1 + c.layer_types.index("mla"))
    print(f"  early exit (the trained target's first {layers} layers):", flush=True)
    out["early_exit"] = {"draft": f"early exit: the trained target's first {layers} of {c.num_hidden_layers} layers",
                         **speculative_rows(target, early_exit_draft(target, layers), prompts, base_s, base, args)}
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
        if "hit_host_split" in t:
            lines += ["host split of a hit turn (cProfile ms): " +
                      ", ".join(f"{k} {v['ms']:.2f}" for k, v in t["hit_host_split"].items())]
    if "speculative" in results and "draft_params" in results["speculative"]:
        sp = results["speculative"]
        lines += ["", f"speculative decoding at batch 1, {sp['prompts']} held-out prompts; plain engine "
                      f"{sp['baseline_tokens_per_s']:,.1f} tokens/s ({sp['baseline_decode_path']}); target trained "
                      f"{sp['target_train_seconds']:.1f} s to loss {sp['target_train_loss']:.2f} (held out "
                      f"{sp['target_held_out_loss']:.2f}), draft ({sp['draft_params'] / 1e6:.1f}M parameters) "
                      f"{sp['draft_train_seconds']:.1f} s to {sp['draft_train_loss']:.2f} "
                      f"({sp['draft_held_out_loss']:.2f})",
                  "", "| draft | k | acceptance | tokens a round | tokens/s | speed-up | greedy = plain |",
                  "|---|---|---|---|---|---|---|"]
        for name, rows in (("trained", sp), ("early exit", sp["early_exit"])):
            lines += [f"| {name} | {k[2:]} | {r['acceptance_rate']:.1%} | {r['tokens_per_round']:.2f} | "
                      f"{r['tokens_per_s']:,.1f} | {r['speedup']:.2f} | {'yes' if r['greedy_output_equal'] else 'NO'} |"
                      for k, r in rows.items() if k.startswith("k=")]
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
    p.add_argument("--decode-runs", type=int, default=3,
                   help="timed engine runs a batch size in the decode part, after two untimed ones; the median run is "
                        "reported (of an even count the slower of the two middle ones) [3]")
    p.add_argument("--prefill-lengths", type=int, nargs="+", default=None, help="[8192 32768 65536; quick: 256]")
    p.add_argument("--ttft-len", type=int, default=None, help="tokens of the prefix-hit turn [32768; quick: 512]")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="layers of the early-exit draft [the first MLA layer and those before it, at least 2]")
    p.add_argument("--draft-k", type=int, nargs="+", default=[2, 4], help="draft tokens per speculative round")
    # NOTE: the defaults are sized from docs/training.md: bf16 weights + AdamW train kimi-linear-1.5b at ~55K
    # tokens/s on one H200, so the target's 150 x 16 x 1024 = 2.5M tokens (about one epoch of the stdlib at vocab
    # 4096) take ~45 s and the 2-layer draft's the same tokens several times faster: <= ~60 s for both
    p.add_argument("--spec-draft-labels", choices=("target", "corpus"), default="target",
                   help="the draft's training labels: the trained target's greedy next tokens on the same batches "
                        "(distilled) or the corpus's next tokens [target]")
    p.add_argument("--spec-train-steps", type=int, default=None, help="training steps of target and draft each "
                   "(part speculative) [150; quick: 40]")
    p.add_argument("--spec-train-batch", type=int, default=None, help="rows per training step [16; quick: 8]")
    p.add_argument("--spec-train-seq", type=int, default=None, help="tokens per training row [1024; quick: 64]")
    p.add_argument("--spec-lr", type=float, default=None,
                   help="peak AdamW learning rate of both trainings [1e-3; quick: 4e-3]")
    p.add_argument("--spec-vocab", type=int, default=4096,
                   help="BPE vocabulary trained on the corpus, at most the config's [4096]")
    p.add_argument("--spec-corpus-mb", type=float, default=None,
                   help="MB of the stdlib's .py files to train on, a deterministic sample [all; quick: 1]")
    p.add_argument("--spec-prompts", type=int, default=None,
                   help="held-out prompts decoded one after another at batch 1 [4; quick: 2]")
    p.add_argument("--profile-tokens", type=int, default=16, help="greedy tokens per profiled run (part profile)")
    p.add_argument("--profile-graphs", action="store_true",
                   help="part profile: profile the step as the engine runs it (CUDA graphs on) [graphs off]")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile-decode", action="store_true", help="torch.compile the fast path's decode step")
    p.add_argument("--cudnn-prefix-attention", action="store_true",
                   help="a cached prefill chunk's MLA attention through cuDNN (OPENK3_CUDNN_PREFIX_ATTENTION=1: faster "
                        "once a shape's plan is built, a plan build per new shape; docs/engine.md)")
    p.add_argument("--overlap", choices=sorted(OVERLAP), default="auto",
                   help="EngineConfig.overlap of the engines without a draft: each decode step launched before the "
                        "one before it is read; auto = the engine's default (on with CUDA graphs) [auto]")
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
    if args.decode_runs < 1:
        raise SystemExit(f"--decode-runs {args.decode_runs}: must be at least 1")
    if args.decode_tokens < 2:  # part_decode's per-step time is over the decode_tokens - 1 steps after the prefill
        raise SystemExit(f"--decode-tokens {args.decode_tokens}: must be at least 2 (a step after the prefill)")
    args.prefill_lengths = args.prefill_lengths or ([256] if q else [8192, 32768, 65536])
    args.ttft_len = args.ttft_len or (512 if q else 32768)
    args.ttft_user_len, args.ttft_reply_len = (32, 8) if q else (256, 64)
    for name, quick, full in (("spec_train_steps", 40, 150), ("spec_train_batch", 8, 16), ("spec_train_seq", 64, 1024),
                              ("spec_corpus_mb", 1.0, None), ("spec_prompts", 2, 4), ("spec_lr", 4e-3, 1e-3)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    for name in ("spec_train_steps", "spec_train_batch", "spec_train_seq", "spec_prompts"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if not args.spec_lr > 0 or (args.spec_corpus_mb is not None and not args.spec_corpus_mb > 0):
        raise SystemExit(f"--spec-lr {args.spec_lr} and --spec-corpus-mb {args.spec_corpus_mb}: must be positive")
    need = max(args.batch_sizes) * -(-(args.prompt_len + args.decode_tokens + max(args.draft_k)) // args.page_size)
    args.pool_pages = args.pool_pages or need + 2
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cudnn_prefix_attention:
        os.environ[CUDNN_PREFIX_ENV] = "1"
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
                results["speculative"] = part_speculative(ckpt, args)
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
