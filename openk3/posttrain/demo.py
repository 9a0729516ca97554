"""`openk3 posttrain-demo`: the whole post-training pipeline in one command, at tiny scale on the CPU:

    openk3 posttrain-demo --out runs/posttrain-demo

  1. synthetic trajectories (synth.py) -> sft.jsonl; a byte-level BPE trained on their rendered text; a random
     `--config` model with that vocabulary (base/);
  2. `sft` on the trajectories (sft/);
  3. `rl` for every domain x effort, 9 policies (rl/<domain>-<effort>/; rl/metrics.jsonl and rl/plots/rl.png
     hold all nine);
  4. `distill` (MOPD) of the nine into one student, and the report: success and reasoning length per domain and
     effort of each teacher, the SFT start and the student (distill/report.md).
A stage whose run directory already holds a finished checkpoint is skipped, and an RL or distill run killed midway
resumes from its last checkpoint (`--resume`), so an interrupted demo continues where it was. Wall time per stage
goes to timings.json; with `--export-to DIR`, timings.json and every stage's metrics (flat names: sft_metrics.jsonl,
rl_metrics.jsonl, distill_metrics.jsonl, report.md) are copied to DIR after every stage (bench/posttrain_gpu.sh).

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
from openk3.posttrain.policy import METRICS_FILE, is_finished
from openk3.posttrain.rl import RLArgs, rl
from openk3.posttrain.sft import SFTArgs, sft
from openk3.posttrain.synth import generate, write_jsonl
from openk3.text.chat import render_xtml, segments_text
from openk3.text.tokenizer import train_bpe
from openk3.train.trainer import write_json, write_text_atomic


def _started(run_dir: Path) -> bool:
    """Whether `run_dir` holds a checkpoint of an unfinished run (one to `--resume`)."""
    return (run_dir / CHECKPOINTS / LATEST).is_file() and not is_finished(run_dir)


def export(root: Path, to: Path) -> None:
    """Copy timings.json and the metrics of every stage so far into `to`, flat (no checkpoints: a device run
    brings back a few small files two folders deep at most)."""
    to.mkdir(parents=True, exist_ok=True)
    files = {"timings.json": root / "timings.json", "sft_metrics.jsonl": root / "sft" / METRICS_FILE,
             "distill_metrics.jsonl": root / "distill" / METRICS_FILE, "report.md": root / "distill" / "report.md"}
    for name, src in files.items():
        if src.is_file():
            write_text_atomic(to / name, src.read_text())
    rl_rows = [(root / "rl" / f"{d}-{e}" / METRICS_FILE) for d, e in COMBOS]
    write_text_atomic(to / "rl_metrics.jsonl", "".join(p.read_text() for p in rl_rows if p.is_file()))


def demo(out: str, *, config: str = "tiny", n_data: int = 1200, vocab_size: int = 1024, sft_steps: int = 100,
         sft_length_split: int = 4, rl_iterations: int = 5, rl_pool: int = 16, distill_iterations: int = 5,
         eval_prompts: int = 12, ckpt_every: int = 1, seed: int = 0, threads: int = 1, device: str = "cpu",
         export_to: str | None = None) -> dict:
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
        if export_to:
            export(root, Path(export_to))
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
    if not is_finished(root / "sft"):
        stage("sft", lambda: sft(SFTArgs(init_from=str(base), data=str(root / "sft.jsonl"), out=str(root / "sft"),
                                         steps=sft_steps, length_split=sft_length_split, seed=seed,
                                         threads=threads, device=device)))
    for domain, effort in COMBOS:
        run = root / "rl" / f"{domain}-{effort}"
        if not is_finished(run):
            stage(f"rl {domain}-{effort}", lambda: rl(RLArgs(
                init_from=str(root / "sft"), out=str(run), domain=domain, effort=effort, iterations=rl_iterations,
                pool=rl_pool, ckpt_every=ckpt_every, seed=seed, threads=threads, device=device,
                resume=_started(run))))
    merged = [line for d, e in COMBOS for line in (root / "rl" / f"{d}-{e}" / METRICS_FILE).read_text().splitlines()]
    write_text_atomic(root / "rl" / METRICS_FILE, "".join(line + "\n" for line in merged))
    plot_rl(root / "rl")  # all nine policies in one figure: reasoning length by effort, per domain
    if not is_finished(root / "distill"):
        stage("distill+report", lambda: distill(DistillArgs(
            student=str(root / "sft"), teachers=str(root / "rl"), out=str(root / "distill"),
            iterations=distill_iterations, eval_prompts=eval_prompts, ckpt_every=ckpt_every, seed=seed,
            threads=threads, device=device, resume=_started(root / "distill"))))
    timings["this_invocation_s"] = round(time.time() - t_all, 1)
    write_json(timings_file, timings)
    print(f"posttrain-demo: done; stage times {timings}; report in {root / 'distill' / 'report.md'}")
    return timings


def register_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("posttrain-demo", description="SFT -> RL (3 domains x 3 efforts) -> MOPD at tiny scale.")
    p.add_argument("--out", default="runs/posttrain-demo", help="root directory of the demo's runs")
    p.add_argument("--config", default="tiny", help="model preset or config.json [tiny]")
    for name, v in (("n_data", 1200), ("vocab_size", 1024), ("sft_steps", 100), ("sft_length_split", 4),
                    ("rl_iterations", 5), ("rl_pool", 16), ("distill_iterations", 5), ("eval_prompts", 12),
                    ("ckpt_every", 1), ("seed", 0), ("threads", 1)):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=v, help=f"[{v}]")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--export-to", metavar="DIR", help="after every stage, copy timings and metrics (flat) into DIR")
    p.set_defaults(fn=lambda ns: demo(**{k: v for k, v in vars(ns).items() if k not in ("fn", "command")}))
