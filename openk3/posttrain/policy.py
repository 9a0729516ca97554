"""What SFT, RL and distillation share: loading a policy for training, saving it as a run's checkpoint, the engine
that samples from it, per-token log-probabilities, and the metrics file.

A post-training run directory (`--out`):
    args.json             the command's resolved settings
    metrics.jsonl         one JSON object per logged step / iteration
    plots/*.png           drawn from metrics.jsonl
    checkpoints/step_N/   while running (rl, distill): the policy, posttrain_args.json and trainer_state.pt
                          (optimizer, RNG, iteration, rl's partial rollouts); `--resume` continues from it
    checkpoints/final/    a release-format model dir + tokenizer (`openk3 chat --model RUN` loads it)
    checkpoints/latest    names the newest complete checkpoint (written last, atomically); "final" = finished
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

from openk3.model.checkpoint import CHECKPOINTS, LATEST, find_checkpoint, load_pretrained, save_pretrained
from openk3.model.model import K3ForCausalLM
from openk3.serve.engine import Engine, EngineConfig
from openk3.text.tokenizer import Tokenizer
from openk3.train.trainer import TRAINER_STATE, save_checkpoint, truncate_metrics, write_json, write_text_atomic

METRICS_FILE = "metrics.jsonl"
FINAL = "final"
STATE_ARGS = "posttrain_args.json"  # not train_args.json: `openk3 eval` reads that one as `openk3 train`'s settings
# settings a resumed run may change (how many iterations, where and how often it saves); all others must match
RESUME_MAY_CHANGE = ("resume", "iterations", "threads", "device", "ckpt_every", "keep_last")


def load_policy(path: str | Path, device: str = "cpu") -> tuple[K3ForCausalLM, Tokenizer, Path]:
    """(fp32 model for training, its tokenizer, the model directory) of a checkpoint or run directory. The model
    runs with QAT exactly when its config stores MXFP4 experts, as `openk3 train` and `load_for_inference` do, so
    the engine's and the trainer's log-probabilities come from the same function."""
    model_dir = find_checkpoint(path)
    tokenizer = Tokenizer.load(model_dir)
    model = load_pretrained(model_dir, device=device, dtype=torch.float32, qat=_qat(model_dir))
    return model, tokenizer, model_dir


def _qat(model_dir: Path) -> bool:
    from openk3.config import K3Config

    return K3Config.load(model_dir).mxfp4_experts


def is_finished(run_dir: str | Path) -> bool:
    """Whether `run_dir` holds a finished run (`latest` names the final checkpoint)."""
    latest = Path(run_dir) / CHECKPOINTS / LATEST
    return latest.is_file() and latest.read_text().strip() == FINAL


def save_policy(run_dir: Path, model: K3ForCausalLM, tokenizer: Tokenizer) -> Path:
    """checkpoints/final (atomic: save_pretrained builds it beside and renames), then `latest` names it; the
    intermediate step checkpoints are deleted after that (a finished run is not resumed)."""
    final = run_dir / CHECKPOINTS / FINAL
    save_pretrained(model, final)
    tokenizer.save(final)
    write_text_atomic(run_dir / CHECKPOINTS / LATEST, FINAL + "\n")
    for step_dir in (run_dir / CHECKPOINTS).glob("step_*"):
        shutil.rmtree(step_dir)
    return final


def save_state(run_dir: Path, step: int, model: K3ForCausalLM, tokenizer: Tokenizer, args, state: dict) -> Path:
    """checkpoints/step_N with the model and `state` (trainer_state.pt), atomically (`trainer.save_checkpoint`)."""
    return save_checkpoint(run_dir, step, model, tokenizer, args, state, args_file=STATE_ARGS)


def load_state(ckpt: Path) -> dict:
    return torch.load(ckpt / TRAINER_STATE, map_location="cpu", weights_only=True)


def start_run(out: str | Path, args: dict, resume: bool = False) -> tuple[Path, Path | None]:
    """(run directory, the checkpoint to resume from or None). A fresh run creates the directory, writes args.json
    and starts a new metrics.jsonl. A directory that holds a finished run is refused (runs are not overwritten), one
    with an unfinished checkpoint needs `resume` (then its settings must match, but RESUME_MAY_CHANGE, and the
    metrics logged after that checkpoint are dropped: the resumed run logs them again)."""
    run_dir = Path(out)
    if is_finished(run_dir):
        raise ValueError(f"--out={run_dir} already holds a finished run; choose another --out or delete it")
    latest = run_dir / CHECKPOINTS / LATEST
    if resume:
        if not latest.is_file():
            raise ValueError(f"--resume: --out={run_dir} holds no checkpoint to resume from")
        ckpt = run_dir / CHECKPOINTS / latest.read_text().strip()
        saved = json.loads((run_dir / "args.json").read_text())
        for k, v in args.items():
            if k not in RESUME_MAY_CHANGE and saved.get(k) != v:
                raise ValueError(f"--resume: cannot change --{k.replace('_', '-')} of the run in {run_dir} "
                                 f"({saved.get(k)!r} -> {v!r}); start a new run instead")
        write_json(run_dir / "args.json", args)
        truncate_metrics(run_dir / METRICS_FILE, load_state(ckpt)["step"])
        return run_dir, ckpt
    if latest.is_file():
        raise ValueError(f"--out={run_dir} holds an unfinished run ({latest.read_text().strip()}); pass --resume to "
                         f"continue it, or choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "args.json", args)
    (run_dir / METRICS_FILE).unlink(missing_ok=True)
    return run_dir, None


def log_metrics(run_dir: Path, record: dict) -> None:
    with open(run_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def make_engine(model: K3ForCausalLM, max_seq_tokens: int, max_batch: int = 64) -> Engine:
    """An engine over `model` for rollouts: room for `max_batch` sequences of `max_seq_tokens`, small pages and
    hashes (prompts here are short), KDA checkpoints only at prompt and turn ends (where chunks resume)."""
    page = 16
    pages = max_batch * (max_seq_tokens // page + 2) + 1
    return Engine(model, EngineConfig(page_size=page, num_pages=pages, max_batch=max_batch, prefill_chunk=512,
                                      hash_interval=page, checkpoint_interval=None))


def token_logprobs(model: K3ForCausalLM, ids_BT: Tensor) -> Tensor:
    """fp32 log p(ids[:, t + 1] | ids[:, :t + 1]) for t < T - 1: [B, T - 1]. Rows may be right-padded (a causal
    model's earlier positions never see the padding)."""
    logits = model(ids_BT).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids_BT[:, 1:, None])[..., 0]


def check_fields(args, *, counts: tuple[str, ...] = (), positive: tuple[str, ...] = (),
                 non_negative: tuple[str, ...] = ()) -> None:
    """A ValueError naming the flag of the first field of `args` that is not a positive integer (counts), not > 0
    (positive) or not >= 0 (non_negative). NOTE: a negative --grad-clip must be refused, not passed on:
    clip_grad_norm_ with max_norm < 0 multiplies the gradient by a negative factor (ascent)."""
    def flag(name):
        return f"--{name.replace('_', '-')}={getattr(args, name)}"

    for name in counts:
        if getattr(args, name) < 1:
            raise ValueError(f"{flag(name)}: must be a positive integer")
    for name in positive:
        if not getattr(args, name) > 0:  # also refuses NaN
            raise ValueError(f"{flag(name)}: must be > 0")
    for name in non_negative:
        if not getattr(args, name) >= 0:
            raise ValueError(f"{flag(name)}: must be >= 0 (0 = off)")


def add_fields(p: argparse.ArgumentParser, defaults, exclude: tuple[str, ...]) -> None:
    """One flag per dataclass field (ints and floats), named as the field with dashes, default in [brackets]."""
    for f in dataclasses.fields(defaults):
        if f.name in exclude:
            continue
        v = getattr(defaults, f.name)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(v), default=v, help=f"[{v}]")
