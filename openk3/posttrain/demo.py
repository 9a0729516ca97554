"""`openk3 posttrain-demo`: the whole post-training pipeline in one command, at tiny scale on the CPU:

    openk3 posttrain-demo --out runs/posttrain-demo

  1. synthetic trajectories (synth.py) -> sft.jsonl; a byte-level BPE trained on their rendered text; a random
     `--config` model with that vocabulary (base/);
  2. `sft` on the trajectories (sft/);
  3. `rl` for every domain x effort, 9 policies (rl/<domain>-<effort>/; rl/metrics.jsonl and rl/plots/rl.png
     hold all nine);
  4. `distill` (MOPD) of the nine into one student, and the report: success and reasoning length per domain and
     effort of each teacher, the SFT start and the student (distill/report.md).
A stage whose run directory already holds a finished checkpoint is skipped, so an interrupted demo continues at the
stage it was in. Wall time per stage goes to timings.json.

NOTE: the tiny preset's MXFP4 experts are turned off here (`quantization_config` None): fake-quantised experts made
decoding about 3x slower on this CPU (measured: 16 sequences x 60 tokens, 4.0 s with QAT, 1.4 s without).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from openk3.config import get_config
from openk3.model.checkpoint import CHECKPOINTS, LATEST, init_checkpoint
from openk3.posttrain.distill import COMBOS, DistillArgs, distill
from openk3.posttrain.plots import plot_rl
from openk3.posttrain.policy import METRICS_FILE
from openk3.posttrain.rl import RLArgs, rl
from openk3.posttrain.sft import SFTArgs, sft
from openk3.posttrain.synth import generate, write_jsonl
from openk3.text.chat import render_xtml, segments_text
from openk3.text.tokenizer import train_bpe
from openk3.train.trainer import write_json, write_text_atomic


def _done(run_dir: Path) -> bool:
    return (run_dir / CHECKPOINTS / LATEST).is_file()


def demo(out: str, *, config: str = "tiny", n_data: int = 1200, vocab_size: int = 1024, sft_steps: int = 100,
         rl_iterations: int = 5, rl_pool: int = 16, distill_iterations: int = 5, eval_prompts: int = 12,
         seed: int = 0, threads: int = 1, device: str = "cpu") -> dict:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    timings_file = root / "timings.json"
    timings = json.loads(timings_file.read_text()) if timings_file.is_file() else {}
    t_all = time.time()

    def stage(name: str, fn) -> None:
        t = time.time()
        fn()
        timings[name] = round(time.time() - t, 1)
        write_json(timings_file, timings)
        print(f"== {name}: {timings[name]:.0f} s", flush=True)

    base = root / "base"
    if not (base / "config.json").is_file():
        def prepare() -> None:
            rows = generate(n_data, seed)
            write_jsonl(root / "sft.jsonl", rows)
            texts = [segments_text(render_xtml(r["messages"], tools=r["tools"], effort=r["effort"],
                                               add_generation_prompt=False)) for r in rows]
            tokenizer = train_bpe(texts, vocab_size)
            # NOTE: built beside and renamed: init_checkpoint writes config.json (what this stage's skip test reads)
            # before the tokenizer, so a demo killed between the two would go on with a base lacking its tokenizer
            tmp = root / ".base.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            init_checkpoint(get_config(config).replace(quantization_config=None), tmp, seed=seed, tokenizer=tokenizer)
            if base.exists():
                shutil.rmtree(base)
            os.rename(tmp, base)
        stage("data+init", prepare)
    if not _done(root / "sft"):
        stage("sft", lambda: sft(SFTArgs(init_from=str(base), data=str(root / "sft.jsonl"), out=str(root / "sft"),
                                         steps=sft_steps, seed=seed, threads=threads, device=device)))
    for domain, effort in COMBOS:
        run = root / "rl" / f"{domain}-{effort}"
        if not _done(run):
            stage(f"rl {domain}-{effort}", lambda: rl(RLArgs(
                init_from=str(root / "sft"), out=str(run), domain=domain, effort=effort, iterations=rl_iterations,
                pool=rl_pool, seed=seed, threads=threads, device=device)))
    merged = [line for d, e in COMBOS for line in (root / "rl" / f"{d}-{e}" / METRICS_FILE).read_text().splitlines()]
    write_text_atomic(root / "rl" / METRICS_FILE, "".join(line + "\n" for line in merged))
    plot_rl(root / "rl")  # all nine policies in one figure: reasoning length by effort, per domain
    if not _done(root / "distill"):
        stage("distill+report", lambda: distill(DistillArgs(student=str(root / "sft"), teachers=str(root / "rl"),
                                                            out=str(root / "distill"), iterations=distill_iterations,
                                                            eval_prompts=eval_prompts, seed=seed, threads=threads,
                                                            device=device)))
    timings["this_invocation_s"] = round(time.time() - t_all, 1)
    write_json(timings_file, timings)
    print(f"posttrain-demo: done; stage times {timings}; report in {root / 'distill' / 'report.md'}")
    return timings


def register_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("posttrain-demo", description="SFT -> RL (3 domains x 3 efforts) -> MOPD at tiny scale.")
    p.add_argument("--out", default="runs/posttrain-demo", help="root directory of the demo's runs")
    p.add_argument("--config", default="tiny", help="model preset or config.json [tiny]")
    for name, v in (("n_data", 1200), ("vocab_size", 1024), ("sft_steps", 100), ("rl_iterations", 5), ("rl_pool", 16),
                    ("distill_iterations", 5), ("eval_prompts", 12), ("seed", 0), ("threads", 1)):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=v, help=f"[{v}]")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.set_defaults(fn=lambda ns: demo(**{k: v for k, v in vars(ns).items() if k not in ("fn", "command")}))
