"""The training loop (`openk3 train`) and `openk3 eval`; `openk3 generate` (serve/engine.py) samples from the result.

    openk3 train                         # tiny preset, stdlib corpus, CPU: trains, checkpoints, prints a sample
    openk3 train --out runs/a --resume   # continue runs/a exactly where its last checkpoint left it
    openk3 generate --model runs/a --prompt "def "
    openk3 eval --model runs/a           # validation loss and bits per byte on the run's held-out documents

One optimizer step (K3_SPEC sections 4.1 and 5):
  1. `grad_accum` micro-batches, forward + backward; every MoE layer records its fp32 router scores and choices;
  2. gradient clipping, learning rate = base lr x cosine schedule, Muon (Per-Head for attention Q/K/V) + AdamW;
  3. optional QK-Clip of the MLA heads whose largest logit of the step exceeded tau;
  4. Quantile Balancing: every router's new bias, from all the step's scores, used from the next step on.

The run directory (`--out`, default `runs/<config>-<time>`):
    train_args.json      the resolved TrainArgs (what `--resume` and `openk3 eval` rebuild the run from)
    config.json          the resolved model config (vocabulary and token ids from the trained tokenizer)
    tokenizer/           the tokenizer: a BPE trained on the training documents, or the one given by --tokenizer
    tokens-*.npz         tokenized corpora (cache)
    metrics.jsonl        one JSON object per logged step (keys: `METRIC_KEYS`, plus val_loss/val_bpb on eval steps)
    plots/*.png          loss curves, expert-load heat map, AttnRes mixing weights (openk3/train/plots.py)
    checkpoints/step_000300/   a release-format model dir (checkpoint.save_pretrained) + tokenizer + train_args.json
                               + trainer_state.pt (fp32 master weights, optimizer, data position, RNG)
    checkpoints/latest   the name of the newest complete checkpoint

Image-text (a config with a vision_config, e.g. `openk3 train --config tiny-vl`): the same loop trains the text model,
the vision tower and the projector jointly from scratch, on next-token loss only, on the synthetic image-text corpus
of openk3/vision/synthetic.py (generated on the fly; no --data); the run ends with the attribute accuracy of the
model's descriptions of held-out images (`vision_eval.json`) instead of a text sample and validation loss.

Resuming is exact on the CPU in fp32: the losses after `--resume` equal those of an uninterrupted run, because
every input of a step is a function of what the checkpoint holds (weights and router biases, optimizer moments,
the data offset, the step number that drives the schedule and the curriculum).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from openk3.config import PRESETS, K3Config, get_config
from openk3.model.checkpoint import (ARGS_FILE, CHECKPOINTS, CONFIG_NAME, LATEST, config_for_tokenizer,
                                     find_checkpoint, load_for_inference, load_pretrained, save_pretrained)
from openk3.model.model import GatedMLA, K3ForCausalLM, document_causal_mask
from openk3.ops import select_kda_backend
from openk3.parallel.context import ContextParallel, apply_context_parallel, local_rows
from openk3.parallel.dcp import dcp_to_release_into, load_release_sharded, load_sharded, save_sharded
from openk3.parallel.expert import apply_expert_parallel, finish_expert_gradients_
from openk3.parallel.fsdp import apply_activation_checkpointing, apply_fsdp, clip_grad_norm_sharded_
from openk3.parallel.mesh import (DistEnv, ParallelDims, build_cp_mesh, build_ep_mesh, build_mesh, init_distributed,
                                  rows_of_rank, under_torchrun)
from openk3.text.tokenizer import BPE_FILE, TIKTOKEN_FILE, Tokenizer, get_or_train_tokenizer
from openk3.train import balance
from openk3.train.compile import BACKENDS as COMPILE_BACKENDS
from openk3.train.compile import compile_layers
from openk3.train.data import (IGNORE_INDEX, Batch, PackedDataset, TokenizedCorpus, load_corpus, split_train_val,
                               tokenize_corpus)
from openk3.train.optim import build_optimizer, cosine_schedule, model_head_dims, qk_clip_mla_
from openk3.train.precision import BF16Compute
from openk3.vision import synthetic
from openk3.vision.model import build_model

# ------------------------------------------------------------------------------------------------- settings


@dataclass
class TrainArgs:
    """Everything a run depends on. Saved as `train_args.json`; `openk3 train` flags have the same names.

    The defaults are the main job: the tiny preset on the stdlib corpus in about 6 minutes on 2 CPU cores,
    tokenizer training and data preparation included."""

    config: str = "tiny"  # preset name or config.json path
    data: str | None = None  # corpus path (file, JSONL, directory); None = the stdlib's .py files
    vocab_size: int = 2048  # BPE vocabulary trained for the run; replaces the config's vocab_size
    tokenizer: str | None = None  # use this tokenizer (dir, tokenizer.json or tiktoken.model) instead of training one
    # start from this checkpoint (or run directory)'s weights, config and tokenizer (if it has one) instead of a
    # random init; `config` must then match the checkpoint's (the command line's --config defaults to it)
    init_from: str | None = None
    out: str | None = None  # run directory; None = runs/<config>-<time>
    steps: int = 400
    # 32 x 64 tokens a step: measured on the default run (400 steps, same tokens), validation loss at 256-token
    # context 3.76 against 3.89 for 16 x 128 and 4.04 for 8 x 256: at this budget more independent rows beat
    # longer ones.
    batch_size: int = 32  # rows per micro-batch
    seq_len: int = 64
    seq_len_schedule: str | None = None  # "LEN:UNTIL_STEP,...": overrides seq_len (see parse_seq_len_schedule)
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 6e-3  # peak lr of every group (optim.py matches Muon's update RMS to AdamW's)
    warmup: float = 0.05  # fraction of the steps spent in linear warmup
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    # Micro-batches with more tokens than this compute the loss in chunks with recomputed logits (memory: K3's
    # 163,840-entry vocabulary makes full fp32 logits 0.6 MB a token); 0 = never. Not bit-identical to unchunked.
    loss_chunk: int = 4096
    balance: str = "quantile"  # quantile | sign | none
    qb_bins: int = 0  # Quantile Balancing histogram bins; 0 = exact (sort every residual)
    sign_rate: float = 1e-3  # bias step of --balance sign
    qat: bool | None = None  # MXFP4 expert weights + MXFP8 expert inputs (fake quant); None = config.mxfp4_experts
    qk_clip: float | None = None  # QK-Clip threshold tau for MLA; None = off
    device: str = "cpu"
    dtype: str = "fp32"  # fp32 | bf16 (bf16 compute; the parameters, i.e. the masters, stay fp32)
    # How --dtype bf16 computes: "copy" (a bf16 copy of the fp32 masters runs forward and backward,
    # train/precision.py) or "autocast" (CUDA autocast over the fp32 parameters); None = `bf16_mode`'s default
    # (copy for a text model in one process, autocast under torchrun or for a vision model).
    bf16_mode: str | None = None
    seed: int = 0
    val_fraction: float = 0.02  # documents held out for validation
    log_every: int = 10
    eval_every: int = 100
    eval_tokens: int = 16384  # validation tokens per evaluation during training
    ckpt_every: int = 100
    keep_last: int = 2  # checkpoints kept (older ones are deleted)
    stop_at: int | None = None  # stop after this step as if interrupted; the schedule still spans `steps`
    sample: bool = True  # print a sample at the end
    sample_prompt: str = "def "
    sample_tokens: int = 200
    sample_temperature: float = 0.7
    vision_eval_images: int = 200  # image-text runs: held-out images the final attribute accuracy is measured on
    # torch intra-op CPU threads. NOTE: 1 by default, measured: the tiny model's ops are too small to split, and
    # on 2 cores a step took 0.65 s with 1 thread, 1.4 s with 2, and over 50 s with 2 while another process
    # used one core (the threads wait on each other). Raise it for bigger models.
    threads: int = 1
    progress: bool = True  # tqdm progress bar
    # Data-parallel ranks when run under torchrun / --nproc (FSDP2 shards over dp x cp); None = processes / cp.
    # docs/parallel.md
    dp: int | None = None
    ep: int = 1  # expert-parallel ranks inside the data x context-parallel ones (MoonEP, parallel/expert.py)
    cp: int = 1  # context-parallel ranks: each takes a contiguous slice of every row (parallel/context.py)
    activation_checkpointing: bool = False  # recompute token mixers and dense MLPs in backward (parallel/fsdp.py)
    # FSDP2 mixed precision: parameters gathered in bf16 for compute, fp32 masters and gradient reduction, the
    # release's fp32 tensors kept fp32 (parallel/fsdp.py); instead of --dtype bf16's autocast
    fsdp_bf16: bool = False
    # torch.compile backend of the decoder layers and the loss head (train/compile.py: "inductor" fuses their
    # elementwise chains); "off" = eager; None = `compile_backend`'s default (Inductor for a text model in one CUDA
    # process, else eager). Evaluation and the final sample always run eagerly.
    compile: str | None = None


# Settings that define the math of a run: `--resume` refuses to change them.
FIXED_ON_RESUME = ("config", "data", "vocab_size", "tokenizer", "init_from", "batch_size", "seq_len", "seq_len_schedule", "grad_accum", "lr",
                   "warmup", "min_lr_ratio", "weight_decay", "grad_clip", "balance", "qb_bins", "sign_rate", "qat",
                   "qk_clip", "dtype", "seed", "val_fraction")
# Settings of one invocation, never taken from the saved run (a resumed run must not stop at the old --stop-at).
# NOTE: bf16_mode too: both modes keep fp32 masters (a checkpoint is the same either way), and its default changes with
# the process count, which a resume may change.
PER_INVOCATION = ("stop_at", "threads", "progress", "dp", "ep", "cp", "compile", "bf16_mode")
BALANCE_MODES = ("quantile", "sign", "none")
BF16_MODES = ("copy", "autocast")
METRIC_KEYS = ("step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "seq_len", "elapsed_s",
               "expert_load_max_over_mean", "expert_load", "attnres")
TRAINER_STATE = "trainer_state.pt"
DCP_DIR = "dcp"  # a data-parallel run's checkpoint: model + optimizer shards (parallel/dcp.py) ...
DIST_STATE = "dist_state.pt"  # ... and step, token count, data position of every row, RNG
METRICS_FILE = "metrics.jsonl"
SPLIT_SEED = 0  # the train/val split does not move with --seed, so runs with different seeds share one val set


def check_args(a: TrainArgs) -> None:
    """Raise ValueError naming the first bad setting."""
    positive = ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_every", "eval_tokens",
                "ckpt_every", "keep_last", "vocab_size", "sample_tokens", "vision_eval_images")
    for name in positive:
        v = getattr(a, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v!r}: must be a positive integer")
    if a.lr <= 0:
        raise ValueError(f"--lr={a.lr}: must be > 0")
    if not 0 <= a.warmup < 1:
        raise ValueError(f"--warmup={a.warmup}: a fraction of the steps in [0, 1)")
    if not 0 <= a.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio={a.min_lr_ratio}: must be in [0, 1]")
    if not 0 <= a.val_fraction < 1:
        raise ValueError(f"--val-fraction={a.val_fraction}: must be in [0, 1)")
    for name in ("weight_decay", "grad_clip", "sign_rate", "loss_chunk"):
        if getattr(a, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(a, name)}: must be >= 0")
    if a.balance not in BALANCE_MODES:
        raise ValueError(f"--balance={a.balance!r}: expected one of {BALANCE_MODES}")
    if a.qb_bins < 0:
        raise ValueError(f"--qb-bins={a.qb_bins}: must be >= 0 (0 = exact)")
    if a.sample_temperature < 0:
        raise ValueError(f"--sample-temperature={a.sample_temperature}: must be >= 0 (0 = greedy)")
    if a.qk_clip is not None and a.qk_clip <= 0:
        raise ValueError(f"--qk-clip={a.qk_clip}: tau must be > 0")
    if a.device not in ("cpu", "cuda"):
        raise ValueError(f"--device={a.device!r}: expected cpu or cuda")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda: torch sees no CUDA device here")
    if a.dtype not in ("fp32", "bf16"):
        raise ValueError(f"--dtype={a.dtype!r}: expected fp32 or bf16")
    if a.fsdp_bf16 and a.dtype == "bf16":
        raise ValueError("--fsdp-bf16 and --dtype bf16 are two ways to compute in bf16; choose one")
    if a.bf16_mode is not None and a.bf16_mode not in BF16_MODES:
        raise ValueError(f"--bf16-mode={a.bf16_mode!r}: expected one of {BF16_MODES}")
    if a.bf16_mode is not None and a.dtype != "bf16":
        raise ValueError(f"--bf16-mode={a.bf16_mode} says how --dtype bf16 computes; this run has --dtype {a.dtype}")
    if a.dtype == "bf16" and a.bf16_mode == "autocast" and a.device != "cuda":
        raise ValueError("--bf16-mode=autocast runs under CUDA autocast; it needs --device cuda")
    if a.stop_at is not None and not 1 <= a.stop_at <= a.steps:
        raise ValueError(f"--stop-at={a.stop_at}: must be in [1, --steps={a.steps}]")
    if a.compile is not None and a.compile not in COMPILE_BACKENDS + ("off",):
        raise ValueError(f"--compile={a.compile!r}: expected one of {COMPILE_BACKENDS + ('off',)}")
    if a.threads < 1:
        raise ValueError(f"--threads={a.threads}: must be >= 1")
    if a.config not in PRESETS and not Path(a.config).is_file() and not Path(a.config, "config.json").is_file():
        raise ValueError(f"--config={a.config!r}: not a preset {sorted(PRESETS)} and no such config file")
    parse_seq_len_schedule(a.seq_len_schedule)


def check_cp_lengths(a: TrainArgs) -> None:
    """Every row length of the run (--seq-len and the --seq-len-schedule phases) splits into --cp equal slices."""
    for length in [a.seq_len] + [length for length, _ in parse_seq_len_schedule(a.seq_len_schedule)]:
        if length % a.cp:
            raise ValueError(f"--cp={a.cp} splits every row into {a.cp} equal slices: the row length {length} "
                             f"(--seq-len / --seq-len-schedule) must be divisible by it")


def parse_seq_len_schedule(spec: str | None) -> list[tuple[int, int | None]]:
    """"128:200,512:400,1024" -> [(128, 200), (512, 400), (1024, None)]: sequence length 128 for steps [0, 200),
    512 for [200, 400), then 1024. The last phase may omit its end; its length then holds to the end of the run
    (as it also does when the last end comes before --steps). None or "" -> []."""
    if not spec:
        return []
    phases: list[tuple[int, int | None]] = []
    parts = spec.split(",")
    for i, part in enumerate(parts):
        length, sep, until = part.strip().partition(":")
        try:
            length_i = int(length)
            until_i = int(until) if sep else None
        except ValueError:
            raise ValueError(f"--seq-len-schedule={spec!r}: {part!r} is not LEN:UNTIL_STEP (two integers)") from None
        if length_i < 1:
            raise ValueError(f"--seq-len-schedule={spec!r}: sequence length {length_i} must be positive")
        if until_i is None and i != len(parts) - 1:
            raise ValueError(f"--seq-len-schedule={spec!r}: only the last phase may leave out its end step")
        previous_end = phases[-1][1] if phases else 0
        if until_i is not None and until_i <= previous_end:
            raise ValueError(f"--seq-len-schedule={spec!r}: end steps must increase, got {until_i} after "
                             f"{previous_end}")
        phases.append((length_i, until_i))
    return phases


def seq_len_at(step: int, phases: list[tuple[int, int | None]], default: int) -> int:
    """The sequence length of the 0-based optimizer step `step`."""
    for length, until in phases:
        if until is None or step < until:
            return length
    return phases[-1][0] if phases else default


# ------------------------------------------------------------------------------------------- run directory


def default_out(config: str) -> str:
    name = Path(config).stem if config not in PRESETS else config
    return str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def resolve_train_args(cli: dict, resume: bool) -> TrainArgs:
    """TrainArgs from command-line values (None = not given). A resumed run takes its saved settings; changing one
    that defines its math (FIXED_ON_RESUME) is an error, while --steps, logging, checkpointing and the device may
    change; PER_INVOCATION settings always come from this command line."""
    given = {k: v for k, v in cli.items() if v is not None}
    if not resume:
        if "init_from" in given and "config" not in given:
            given["config"] = str(find_checkpoint(given["init_from"]) / CONFIG_NAME)
        return TrainArgs(**given)
    if "out" not in given:
        raise ValueError("--resume needs --out DIR, the run directory to continue")
    saved_file = Path(given["out"]) / ARGS_FILE
    if not saved_file.is_file():
        raise FileNotFoundError(f"--resume: {given['out']} is not a run directory (no {ARGS_FILE})")
    saved = {k: v for k, v in json.loads(saved_file.read_text()).items() if k not in PER_INVOCATION}
    for k in FIXED_ON_RESUME:
        if k in given and given[k] != saved[k]:
            raise ValueError(f"--resume: cannot change --{k.replace('_', '-')} of a run ({saved[k]!r} -> "
                             f"{given[k]!r}); start a new run instead")
    return TrainArgs(**{**saved, **given})


def save_checkpoint(run_dir: Path, step: int, model: K3ForCausalLM, tokenizer: Tokenizer, args: TrainArgs,
                    trainer_state: dict, args_file: str = ARGS_FILE) -> Path:
    """Write checkpoints/step_XXXXXX atomically (built under a temporary name, then renamed), point `latest` at it
    (also atomically), and delete all but the newest `args.keep_last` checkpoints. `args` is any dataclass with a
    `keep_last`, written to `args_file` (post-training runs name theirs apart from `openk3 train`'s)."""
    ckpt_root = run_dir / CHECKPOINTS
    name = f"step_{step:06d}"
    tmp = ckpt_root / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed while writing
    save_pretrained(model, tmp)
    tokenizer.save(tmp)
    write_json(tmp / args_file, dataclasses.asdict(args))
    torch.save(trainer_state, tmp / TRAINER_STATE)
    final = ckpt_root / name
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    write_text_atomic(ckpt_root / LATEST, name + "\n")
    steps = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for old in steps[:-args.keep_last]:
        shutil.rmtree(old)
    return final


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop the lines logged after `last_step` (a run killed after its last checkpoint logged them; the resumed
    run logs them again)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    write_text_atomic(path, "".join(line + "\n" for line in keep))


# ------------------------------------------------------------------------------------------ data parallel


def run_dir_of(args: TrainArgs, env: DistEnv | None) -> Path:
    """--out, or a new default name; in a distributed run rank 0's default, sent to every rank.
    NOTE: the default carries the time in seconds: ranks that started in different seconds would each pick their
    own directory (and read a tokenizer or write checkpoint shards where rank 0 never looks)."""
    if args.out is not None:
        return Path(args.out)
    if env is None:
        return Path(default_out(args.config))
    name = [default_out(args.config) if env.is_main else None]
    torch.distributed.broadcast_object_list(name, src=0)
    return Path(name[0])


def barrier(env: DistEnv | None) -> None:
    if env is not None:
        torch.distributed.barrier()


def global_loss_share(labels: Tensor, world: int) -> float:
    """The factor that turns this rank's mean loss into its share of the global batch's mean loss, times `world`
    (FSDP divides the summed gradients by the world size): world x local predicted tokens / global predicted
    tokens. So the gradient is that of one process on the whole global batch, even when ranks predict different
    numbers of tokens (IGNORE_INDEX at document ends). One small all-reduce per micro-batch."""
    counts = (labels != IGNORE_INDEX).sum().reshape(1)
    total = counts.clone()
    torch.distributed.all_reduce(total)
    return world * float(counts) / max(float(total), 1.0)


def sum_over_ranks(x: Tensor) -> float:
    total = x.detach().float().reshape(1).clone()
    torch.distributed.all_reduce(total)
    return float(total)


def save_distributed_checkpoint(run_dir: Path, step: int, model: K3ForCausalLM, opt, stream: RowStreams,
                                tokenizer: Tokenizer, args: TrainArgs, tokens: int, elapsed_s: float,
                                main: bool) -> Path:
    """The data-parallel `save_checkpoint` (collective): every rank writes its model and optimizer shards into
    `dcp/`; rank 0 adds the step's state (with every data-parallel rank's data rows: the first rank of each
    context-parallel group of args.cp, whose ranks read the same rows), the tokenizer, train_args.json, and the
    model in the release layout (streamed from the DCP files, so `openk3 generate/eval` read it as any
    checkpoint), then renames the directory into place and moves `latest`, as `save_checkpoint` does."""
    ckpt_root = run_dir / CHECKPOINTS
    name = f"step_{step:06d}"
    tmp = ckpt_root / f".{name}.tmp"
    if main and tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed while writing
    rows: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, stream.state_dict()["rows"])
    torch.distributed.barrier()
    save_sharded(model, opt.optimizers, tmp / DCP_DIR)
    torch.distributed.barrier()
    final = ckpt_root / name
    if main:
        model.config.save(tmp / DCP_DIR / CONFIG_NAME)
        dcp_to_release_into(tmp / DCP_DIR, tmp)
        tokenizer.save(tmp)
        write_json(tmp / ARGS_FILE, dataclasses.asdict(args))
        torch.save({"step": step, "tokens": tokens, "elapsed_s": elapsed_s,
                    "data": {"rows": [r for rank_rows in rows[::args.cp] for r in rank_rows]},
                    "rng": {"torch": torch.get_rng_state()}}, tmp / DIST_STATE)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        write_text_atomic(ckpt_root / LATEST, name + "\n")
        for old in sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())[:-args.keep_last]:
            shutil.rmtree(old)
    torch.distributed.barrier()
    return final


def load_distributed_checkpoint(ckpt: Path, model: K3ForCausalLM, opt, stream: RowStreams) -> tuple[int, int, float]:
    """Load a data-parallel checkpoint into the sharded model, optimizer and this rank's data rows, at any world
    size (DCP reshards); returns (step, tokens, elapsed_s)."""
    if not (ckpt / DCP_DIR).is_dir():
        raise ValueError(f"--resume: {ckpt} is a single-process checkpoint (no {DCP_DIR}/); resume it without "
                         f"torchrun / --nproc")
    load_sharded(model, opt.optimizers, ckpt / DCP_DIR)
    state = torch.load(ckpt / DIST_STATE, map_location="cpu", weights_only=True)
    stream.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"]["torch"])
    return state["step"], state["tokens"], state["elapsed_s"]


# ------------------------------------------------------------------------------------------------------ data


@dataclass
class RunData:
    tokenizer: Tokenizer
    train: TokenizedCorpus
    val: TokenizedCorpus | None  # None when the corpus is a single document (nothing to hold out)


def prepare_data(args: TrainArgs, run_dir: Path) -> RunData:
    """Load the corpus, split whole documents into train/val, train (or reuse) the run's BPE tokenizer on the
    training documents, and tokenize both parts (cached in the run directory)."""
    docs = load_corpus(args.data)
    if len(docs) >= 2:
        train_docs, val_docs = split_train_val(docs, args.val_fraction, seed=SPLIT_SEED)
    else:
        train_docs, val_docs = docs, []
    if args.tokenizer is not None:  # e.g. the release's tiktoken.model for a K3-vocabulary model
        tokenizer = Tokenizer.from_path(args.tokenizer)
        tokenizer.save(run_dir / "tokenizer")
    else:
        tokenizer = get_or_train_tokenizer(run_dir, (d.text for d in train_docs), args.vocab_size)
    train = tokenize_corpus(train_docs, tokenizer, cache_dir=run_dir)
    val = tokenize_corpus(val_docs, tokenizer, cache_dir=run_dir) if val_docs else None
    n_bytes = sum(len(d.text.encode()) for d in train_docs)
    print(f"data: {len(train_docs)} training documents ({n_bytes / 1e6:.1f} MB, {train.num_tokens:,} tokens), "
          f"{len(val_docs)} held out; vocabulary {tokenizer.vocab_size}")
    return RunData(tokenizer, train, val)


def prepare_image_text_data(args: TrainArgs, run_dir: Path) -> RunData:
    """The tokenizer of an image-text run (a BPE trained on the synthetic corpus's texts, or --tokenizer); the
    examples themselves are drawn on the fly by `synthetic.ImageTextStream`, so there is no corpus to hold."""
    if args.data is not None:
        raise ValueError(f"--data={args.data}: an image-text run ({args.config} has a vision_config) trains on the "
                         f"synthetic image-text corpus, generated on the fly; leave --data out")
    if args.seed == synthetic.HELD_OUT_SEED:  # the stream of seed s is drawn from s alone: this one IS the eval set
        raise ValueError(f"--seed={args.seed}: the seed of the held-out images the run is evaluated on; pick another")
    if args.tokenizer is not None:
        tokenizer = Tokenizer.from_path(args.tokenizer)
        tokenizer.save(run_dir / "tokenizer")
    else:
        # NOTE: repeated so the BPE trainer's pair counts see each text often enough to merge it
        tokenizer = get_or_train_tokenizer(run_dir, synthetic.corpus_texts() * 20, args.vocab_size)
    print(f"data: synthetic image-text examples drawn on the fly ({len(synthetic.COLOURS)} colours x "
          f"{len(synthetic.SHAPES)} shapes, {synthetic.IMAGE_SIZE}x{synthetic.IMAGE_SIZE}); vocabulary "
          f"{tokenizer.vocab_size}")
    return RunData(tokenizer, None, None)  # type: ignore[arg-type]


def image_inputs(batch) -> dict:
    """The image arguments of the model's forward for an image-text batch, none for a text batch."""
    return {k: getattr(batch, k) for k in ("pixel_values", "grid_thws") if hasattr(batch, k)}


class RowStreams:
    """Training batches whose B rows come from B independent places of the corpus: row b is read from its own
    `PackedDataset` (one row per batch) whose document order is seeded by (seed, b).

    NOTE: a single PackedDataset cuts its B rows from B*T consecutive tokens of one stream, so a long file fills
    many consecutive batches: in the default run, html/entities.py (39k tokens of one dict literal) was 19 steps
    in a row, drove the training loss to 2.7 and then back up to 7.9 on the next file. Independent rows make
    every batch a sample of B unrelated documents. Each row keeps only its epoch's document order (one int per
    document), so B rows cost B x documents x 8 bytes.
    Same interface as PackedDataset: iterate, `seq_len` settable between batches, state_dict / load_state_dict."""

    ROW_SEED_STRIDE = 2**20  # row b of run seed s uses s * stride + b: distinct for every batch size below it

    def __init__(self, corpus: TokenizedCorpus, batch_size: int, seq_len: int, seed: int, rows: range | None = None):
        """rows: which rows of the global batch of `batch_size` this stream yields (a data-parallel rank's share,
        parallel.mesh.rows_of_rank); None = all. Row b is the same stream whichever rank reads it."""
        self.batch_size = batch_size
        self.row_ids = range(batch_size) if rows is None else rows
        self.rows = [PackedDataset(corpus, 1, seq_len, seed=seed * self.ROW_SEED_STRIDE + b) for b in self.row_ids]

    @property
    def seq_len(self) -> int:
        return self.rows[0].seq_len

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        for row in self.rows:
            row.seq_len = value

    def __next__(self) -> Batch:
        """A `Batch` of B rows; cu_seqlens and seq_ids are over the flattened B*T tokens, as for one stream."""
        parts = [next(row) for row in self.rows]
        T = self.seq_len
        cu_seqlens, seq_ids, segments = [], [], 0
        for b, part in enumerate(parts):
            cu_seqlens.append(part.cu_seqlens[:-1] + b * T)
            seq_ids.append(part.seq_ids + segments)
            segments += part.cu_seqlens.numel() - 1
        cu_seqlens.append(torch.tensor([len(parts) * T]))
        return Batch(input_ids=torch.cat([p.input_ids for p in parts]), labels=torch.cat([p.labels for p in parts]),
                     cu_seqlens=torch.cat(cu_seqlens), seq_ids=torch.cat(seq_ids))

    def state_dict(self) -> dict:
        """{"rows": the states of this stream's rows}; a data-parallel run gathers every rank's rows in rank order,
        which is the state of the whole global batch, loadable at any world size."""
        return {"rows": [row.state_dict() for row in self.rows]}

    def load_state_dict(self, state: dict) -> None:
        """`state` holds every row of the global batch; this stream takes its own rows from it."""
        if len(state["rows"]) != self.batch_size:
            raise ValueError(f"cannot resume: the saved data state has {len(state['rows'])} rows per batch, this "
                             f"run {self.batch_size}")
        for row, b in zip(self.rows, self.row_ids):
            row.load_state_dict(state["rows"][b])


def saved_run_args(model_dir: Path) -> TrainArgs | None:
    """The TrainArgs of the run that wrote `model_dir` (its train_args.json), or None for a checkpoint without one."""
    args_file = model_dir / ARGS_FILE
    return TrainArgs(**json.loads(args_file.read_text())) if args_file.is_file() else None


def validation_corpus(model_dir: Path, tokenizer: Tokenizer, data: str | None) -> TokenizedCorpus:
    """What `openk3 eval` scores: every document of `data` when given, else the held-out documents of the run
    that trained `model_dir` (rebuilt from its train_args.json)."""
    if data is not None:
        return tokenize_corpus(load_corpus(data), tokenizer)
    saved = saved_run_args(model_dir)
    if saved is None:
        raise FileNotFoundError(f"no --data given and {model_dir} has no {ARGS_FILE} to rebuild the run's "
                                f"validation documents from")
    docs = load_corpus(saved.data)
    if len(docs) < 2:
        raise ValueError(f"the run of {model_dir} trained on one document and held none out; pass --data")
    _, val_docs = split_train_val(docs, saved.val_fraction, seed=SPLIT_SEED)
    return tokenize_corpus(val_docs, tokenizer)


def eval_settings(saved: TrainArgs | None, data: str | None, batch_size: int | None, seq_len: int | None,
                  max_tokens: int | None) -> dict:
    """`openk3 eval`'s batch_size, seq_len and max_tokens (None = every token), given ones kept.

    NOTE: the defaults are those of the run's final validation (train's last "validation: loss"): its batch size,
    the row length of its last step and, on its held-out documents, its --eval-tokens. Row starts see no earlier
    context, so another row length or token count gives another loss: with eval's old defaults (every held-out
    token in 8 x 256 rows) a default run reported 4.03 where train had printed 3.81 (16,384 tokens, 64-token rows).
    Without a saved run (or with --data): 8 rows of 256 tokens, every token. max_tokens 0 = every token."""
    if saved is None:
        defaults = {"batch_size": 8, "seq_len": 256, "max_tokens": None}
    else:
        final_seq_len = seq_len_at(saved.steps - 1, parse_seq_len_schedule(saved.seq_len_schedule), saved.seq_len)
        defaults = {"batch_size": saved.batch_size, "seq_len": final_seq_len,
                    "max_tokens": saved.eval_tokens if data is None else None}
    given = {"batch_size": batch_size, "seq_len": seq_len, "max_tokens": max_tokens}
    out = {k: defaults[k] if v is None else v for k, v in given.items()}
    if out["max_tokens"] == 0:
        out["max_tokens"] = None
    return out


# ----------------------------------------------------------------------------------------------------- model


def resolve_model_config(args: TrainArgs, tokenizer: Tokenizer) -> K3Config:
    """The preset or file config with the trained tokenizer's vocabulary size and bos/eos/pad ids."""
    return config_for_tokenizer(get_config(args.config), tokenizer)


def _has_tokenizer(directory: Path) -> bool:
    return (directory / BPE_FILE).is_file() or (directory / TIKTOKEN_FILE).is_file()


def init_config(args: TrainArgs, init_dir: Path, tokenizer: Tokenizer) -> K3Config:
    """The config of a run started from the checkpoint `init_dir`: the checkpoint's. `args.config` must be the same
    config (an error names the first field that differs), and the tokenizer's ids must fit its vocabulary."""
    config = K3Config.load(init_dir)
    fields = {f.name for f in dataclasses.fields(K3Config)} - {"extra"}  # not what a config.json carries besides

    def model_fields(c: K3Config) -> dict:
        vision = {"vision_config": c.vision_config.to_dict() if c.vision_config is not None else None}
        return {**{k: v for k, v in c.to_dict().items() if k in fields}, **vision}

    diff = first_difference(model_fields(get_config(args.config)), model_fields(config))
    if diff is not None:
        name, given, stored = diff
        raise ValueError(f"--config={args.config} differs from the config of --init-from={init_dir}: {name} is "
                         f"{given!r} there and {stored!r} in the checkpoint (leave --config out to use the "
                         f"checkpoint's)")
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids, more than vocab_size={config.vocab_size} "
                         f"of --init-from={init_dir}")
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    for name, tid in ids.items():
        if getattr(config, name) != tid:
            raise ValueError(f"the tokenizer's {name.removesuffix('_token_id')} id is {tid}, but {name}="
                             f"{getattr(config, name)} in --init-from={init_dir}")
    return config


def first_difference(a: dict, b: dict, prefix: str = "") -> tuple[str, object, object] | None:
    """(dotted field name, value in a, value in b) of the first field (in a's order, then b's) that differs."""
    for k in list(a) + [k for k in b if k not in a]:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            sub = first_difference(va, vb, f"{prefix}{k}.")
            if sub is not None:
                return sub
        elif va != vb:
            return prefix + k, va, vb
    return None


def heartbeat(message: str, every_s: float) -> threading.Event:
    """Print `message` with the seconds elapsed every `every_s` to stderr until the returned event is set."""
    done, t0 = threading.Event(), time.time()

    def beat() -> None:
        while not done.wait(every_s):
            print(f"  {message}... {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    threading.Thread(target=beat, daemon=True).start()
    return done


def autocast(args_dtype: str, device: torch.device):
    """bf16 autocast on CUDA for --dtype bf16 (parameters and optimizer state stay fp32), else nothing.
    The model keeps its fp32 islands (router, gates, recurrent state, AttnRes, loss) fp32 under autocast."""
    if args_dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------- balancing


class RouterBalancer:
    """Collects every MoE layer's router scores over the micro-batches of one optimizer step (from the forwards'
    `record=True` outputs) and, after the step, sets the new `e_score_correction_bias` (used from the next step on).
    Also counts expert loads.

    mode quantile: `balance.quantile_balance_exact` on all the step's scores (bins == 0) or a
    `balance.QuantileHistogram` per layer (bins > 0). mode sign: `balance.sign_update`. mode none: loads only.

    Data parallel (torch.distributed running): loads are summed over the ranks, the histograms of all layers with
    one all-reduce (`balance.all_reduce_histograms_`), and exact mode gathers every rank's scores, so every rank
    sets the biases a single process would set from the same global batch."""

    def __init__(self, model: K3ForCausalLM, mode: str, bins: int, sign_rate: float):
        self.moes = model.moe_layers()
        self.mode, self.bins, self.sign_rate = mode, bins, sign_rate
        self.begin_step()

    def begin_step(self) -> None:
        self.loads = [None] * len(self.moes)
        self.scores: list[list[Tensor]] = [[] for _ in self.moes]
        self.hists = ([balance.QuantileHistogram(m.gate.e_score_correction_bias, m.gate.k, self.bins)
                       for m in self.moes] if self.mode == "quantile" and self.bins else None)

    def after_forward(self, router: list[tuple[Tensor, Tensor]]) -> None:
        """Take the router records of the micro-batch just run: `CausalLMOutput.router` of a `record=True` forward,
        (scores, selected experts) per MoE layer."""
        if len(router) != len(self.moes):
            raise ValueError(f"router records for {len(router)} MoE layers, the model has {len(self.moes)}")
        for i, (moe, (scores, idx)) in enumerate(zip(self.moes, router)):
            n = moe.gate.e_score_correction_bias.numel()
            load = balance.expert_load(idx, n)
            self.loads[i] = load if self.loads[i] is None else self.loads[i] + load
            if self.hists is not None:
                self.hists[i].update(scores)
            elif self.mode == "quantile":
                self.scores[i].append(scores)

    @torch.no_grad()
    def end_step(self) -> list[Tensor]:
        """Set every layer's new bias; return the step's expert loads [E] per layer (summed over ranks)."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and self.moes:
            loads = torch.stack(self.loads)
            torch.distributed.all_reduce(loads)
            self.loads = list(loads)
        if self.hists is not None:
            balance.all_reduce_histograms_(self.hists)
        for i, moe in enumerate(self.moes):
            bias = moe.gate.e_score_correction_bias
            if self.mode == "quantile" and self.hists is not None:
                bias.copy_(self.hists[i].bias())
            elif self.mode == "quantile":
                scores = torch.cat(self.scores[i])
                if distributed:
                    gathered = [torch.empty_like(scores) for _ in range(torch.distributed.get_world_size())]
                    torch.distributed.all_gather(gathered, scores)
                    scores = torch.cat(gathered)
                bias.copy_(balance.quantile_balance_exact(scores, bias, moe.gate.k))
            elif self.mode == "sign":
                bias.copy_(balance.sign_update(bias, self.loads[i], self.sign_rate))
        loads = self.loads
        self.begin_step()
        return loads


# --------------------------------------------------------------------------------------------------- QK-Clip


class MLAMaxLogits:
    """Each MLA head's largest pre-softmax logit over a step, for QK-Clip, via forward hooks on the MLA layers.

    NOTE: the model does not expose its attention logits, so the hook recomputes them from the layer's own
    `query` / `latent` / `kv_b_proj` (the expanded form, without gradients) one head at a time: B x T x T per head,
    fine at the sizes this trainer runs on one device, not at K3's 64K contexts, where the max belongs inside the
    attention kernel."""

    def __init__(self, model: K3ForCausalLM, cp: ContextParallel | None = None, runs: K3ForCausalLM | None = None):
        """cp: the model's context parallelism, if any: its ranks' queries see keys of the whole row. runs: the model
        whose forwards are watched, when another one computes for `model` (a bf16 copy, train/precision.py); the
        clip always changes `model`'s weights."""
        self.cp = cp
        self.layers = [l.self_attn for l in model.model.layers if isinstance(l.self_attn, GatedMLA)]
        self.max_H = [None] * len(self.layers)
        watched = self.layers if runs is None else [l.self_attn for l in runs.model.layers
                                                      if isinstance(l.self_attn, GatedMLA)]
        for i, attn in enumerate(watched):
            attn.register_forward_hook(self._hook(i), with_kwargs=True)

    def _hook(self, i: int):
        @torch.no_grad()
        def hook(attn: GatedMLA, args, kwargs, output) -> None:
            x = args[0] if args else kwargs["x"]
            mask, varlen = kwargs.get("mask"), kwargs.get("varlen")
            B, T, _ = x.shape
            if mask is None and varlen is not None:  # NOTE: on CUDA the model describes packed documents this way
                mask = document_causal_mask(varlen[0], B, T)
            if mask is None:
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None]
            keys = self.cp.mla_keys(attn, x) if self.cp is not None else None
            lat, mask = keys if keys is not None else (attn.latent(x), mask)  # [B, S, r + rope], [B, 1, T, S]
            q = attn.query(x).float()  # [B, T, H, nope + rope]
            c, k_pe = lat.split([attn.r, attn.rope], dim=-1)
            k_nope = attn.kv_b_proj(c).float().unflatten(-1, (attn.H, attn.nope + attn.vd))[..., :attn.nope]
            k_pe = k_pe.float()
            maxima = []
            for h in range(attn.H):
                k = torch.cat([k_nope[:, :, h], k_pe], dim=-1)  # [B, T, nope + rope]
                logits = (q[:, :, h] @ k.mT) * attn.scale  # [B, T, S]
                maxima.append(logits.masked_fill(~mask[:, 0], float("-inf")).amax())
            step_max = torch.stack(maxima)
            self.max_H[i] = step_max if self.max_H[i] is None else torch.maximum(self.max_H[i], step_max)
        return hook

    @torch.no_grad()
    def clip_(self, tau: float) -> None:
        """Apply QK-Clip to every MLA layer with the step's maxima (max-reduced over data-parallel ranks, one
        collective), then start a new step."""
        if self.layers and torch.distributed.is_available() and torch.distributed.is_initialized():
            maxima = torch.stack(self.max_H)
            torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX)
            self.max_H = list(maxima)
        for attn, max_H in zip(self.layers, self.max_H):
            q_weight = attn.q_b_proj.weight if hasattr(attn, "q_b_proj") else attn.q_proj.weight
            qk_clip_mla_(q_weight, attn.kv_b_proj.weight, max_H, tau, qk_nope_head_dim=attn.nope,
                         qk_rope_head_dim=attn.rope, v_head_dim=attn.vd)
        self.max_H = [None] * len(self.layers)


# ------------------------------------------------------------------------------------ evaluation and sampling


@torch.no_grad()
def evaluate(model: K3ForCausalLM, corpus: TokenizedCorpus, tokenizer: Tokenizer, *, batch_size: int, seq_len: int,
             max_tokens: int | None = None, amp: str = "fp32", loss_chunk: int = TrainArgs.loss_chunk) -> dict:
    """Validation loss (nats per predicted token) and bits per byte over the start of `corpus` in document order.

    Predicted tokens: every token of the stream after position 0 that its predecessor predicts, i.e. each
    document's text tokens and its EOS, up to `max_tokens` of them (None = the whole corpus).
    bpb = total nats / ln 2 / the UTF-8 bytes of the predicted tokens' text (EOS has no bytes).
    NOTE: a row start sees no earlier context (the packing resets at rows), exactly as in training."""
    device = model.lm_head.weight.device
    data = PackedDataset(corpus, batch_size, seq_len, shuffle=False)
    n = corpus.num_tokens - 1 if max_tokens is None else min(max_tokens, corpus.num_tokens - 1)
    nats, count = 0.0, 0
    while data.offset < n:
        start = data.offset
        batch = next(data)
        labels = batch.labels.view(-1).clone()
        labels[start + torch.arange(labels.numel()) >= n] = IGNORE_INDEX  # past the evaluated span
        labels = labels.view_as(batch.labels)
        valid = int((labels != IGNORE_INDEX).sum())
        if valid == 0:
            continue
        with autocast(amp, device):
            out = model(batch.input_ids.to(device), labels=labels.to(device), cu_seqlens=batch.cu_seqlens.to(device),
                        loss_chunk=loss_chunk)
        nats += float(out.loss) * valid
        count += valid
    # The predicted tokens are stream tokens 1..n (shuffle=False: the stream is the corpus in order).
    n_bytes = len(tokenizer.decode(corpus.tokens[1:n + 1].tolist(), skip_special=True).encode("utf-8"))
    return {"loss": nats / count, "bpb": nats / math.log(2) / max(n_bytes, 1), "tokens": count, "bytes": n_bytes,
            "seq_len": seq_len}


def generate(model: K3ForCausalLM, tokenizer: Tokenizer, prompt: str, *, max_tokens: int = 200,
             temperature: float = 0.8, top_k: int | None = None, seed: int = 0) -> list[int]:
    """Sample up to `max_tokens` token ids after [BOS] + prompt through the inference engine, stopping at EOS
    (not returned). temperature 0 = greedy."""
    from openk3.serve.engine import Engine, SamplingParams

    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: must be >= 1")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k or 0, seed=seed,
                            stop_token_ids=(tokenizer.eos_id,))
    (req,) = Engine(model).generate([[tokenizer.bos_id] + tokenizer.encode(prompt)], params)
    return req.completion_ids


# -------------------------------------------------------------------------------------------- the training loop


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)  # the training loss of every step this call ran
    final_eval: dict | None = None
    vision_eval: dict | None = None  # image-text runs: synthetic.attribute_accuracy on held-out images
    sample: str | None = None
    wall_s: float = 0.0


def compile_backend(args: TrainArgs, distributed: bool) -> str | None:
    """The torch.compile backend a run uses: --compile's, None for "off"; unset, Inductor for a text model in one
    CUDA process and eager elsewhere. Why that default: on one H200 (kimi-linear-1.5b, 8 x 2048 tokens,
    bench/vs_transformers.py, docs/training.md) compiled steps ran 1.30x faster with bf16 weights and 1.06x with
    the recipe, at 16-22% less peak memory, for a first step of 20-41 s (47.7 s with empty caches). Not on the
    CPU (Inductor's C++ compile of every region takes minutes there), nor under torchrun or for a vision model:
    compile is not measured there."""
    if args.compile is not None:
        return None if args.compile == "off" else args.compile
    vision = get_config(args.config).vision_config is not None
    return "inductor" if args.device == "cuda" and not distributed and not vision else None


def bf16_mode(args: TrainArgs, distributed: bool) -> str | None:
    """How a --dtype bf16 run computes (None for fp32): --bf16-mode's, else "copy" (train/precision.py) for a text
    model in one process and "autocast" under torchrun (FSDP2 shards the one model it is given) or for a vision model
    (its tower has no bf16 cast). Why copy: on one H200 the autocast recipe's compiled forward took 134 ms against 80
    ms with bf16 weights (kimi-linear-1.5b, docs/training.md); a copy computes exactly as the bf16-weights run."""
    if args.dtype != "bf16":
        return None
    vision = get_config(args.config).vision_config is not None
    why = f"--config={args.config} has a vision tower" if vision else "the run is under torchrun"
    if args.bf16_mode == "copy" and (distributed or vision):
        raise ValueError(f"--bf16-mode=copy runs in one process on a text model, and {why}: use --bf16-mode "
                         "autocast" + ("" if vision else " (or --fsdp-bf16)"))
    if args.bf16_mode is not None:
        return args.bf16_mode
    if distributed or vision:
        if args.device != "cuda":
            raise ValueError(f"--dtype=bf16 runs under CUDA autocast here ({why}): it needs --device cuda, not "
                             f"--device {args.device}")
        return "autocast"
    return "copy"


def train(args: TrainArgs, resume: bool = False) -> TrainResult:
    """Run (or with `resume`, continue) a training run; see the module docstring."""
    t_start = time.time()
    check_args(args)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dist_env = init_distributed(args.device)  # None unless launched by torchrun (or `--nproc`)
    main = dist_env is None or dist_env.is_main
    if dist_env is not None:
        dims = ParallelDims(dp=args.dp, ep=args.ep, cp=args.cp).resolve(dist_env.world)
        check_cp_lengths(args)
        device = dist_env.device
        if not main:  # NOTE: a torchrun worker: rank 0 alone prints and shows progress
            sys.stdout = open(os.devnull, "w")
            args = dataclasses.replace(args, progress=False)
    elif args.fsdp_bf16:
        raise ValueError("--fsdp-bf16 is FSDP2's mixed precision: it needs torchrun or --nproc N (N >= 2)")
    elif args.dp not in (None, 1) or args.ep != 1 or args.cp != 1:
        n = max((args.dp or 1) * args.cp, args.ep)
        raise ValueError(f"--dp={args.dp} --ep={args.ep} --cp={args.cp} needs {n} processes: add --nproc {n} or run "
                         f"under torchrun")
    run_dir = run_dir_of(args, dist_env)
    args = dataclasses.replace(args, out=str(run_dir), compile=compile_backend(args, dist_env is not None),
                               bf16_mode=bf16_mode(args, dist_env is not None))
    latest = run_dir / CHECKPOINTS / LATEST
    if resume and not latest.is_file():
        raise FileNotFoundError(f"--resume: {run_dir} has no checkpoint to resume from ({CHECKPOINTS}/{LATEST})")
    if not resume and latest.is_file():
        raise ValueError(f"--out={run_dir} already holds a run with checkpoints; pass --resume to continue it or "
                         f"choose another --out")
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    print(f"run directory: {run_dir}")
    if not resume and main:
        # NOTE: a run killed before its first checkpoint leaves its rows; this fresh run logs those steps again
        (run_dir / METRICS_FILE).unlink(missing_ok=True)

    init_dir = find_checkpoint(args.init_from) if args.init_from is not None and not resume else None
    if init_dir is not None and args.tokenizer is None and _has_tokenizer(init_dir):
        args = dataclasses.replace(args, tokenizer=str(init_dir))
    vision = get_config(args.config).vision_config is not None
    if vision and dist_env is not None:
        raise ValueError(f"--config={args.config} has a vision tower: image-text training runs in one process (data "
                         f"parallelism covers text configs)")
    # rank 0 trains the tokenizer and fills the token cache; the other ranks then read both from the run directory
    if main:
        data = prepare_image_text_data(args, run_dir) if vision else prepare_data(args, run_dir)
    barrier(dist_env)
    if not main:
        data = prepare_data(args, run_dir)
    if resume:
        config = K3Config.load(run_dir / "config.json")
    elif init_dir is not None:
        config = init_config(args, init_dir, data.tokenizer)
    else:
        config = resolve_model_config(args, data.tokenizer)
    if main:
        if not resume:
            config.save(run_dir / "config.json")
        write_json(run_dir / ARGS_FILE, dataclasses.asdict(args))

    torch.manual_seed(args.seed)
    qat = config.mxfp4_experts if args.qat is None else args.qat
    sharded_init = init_dir is not None and dist_env is not None
    if sharded_init:  # built on the meta device; each rank fills only its shards once they exist (below)
        with torch.device("meta"):
            model = K3ForCausalLM(config, qat=qat)
    elif init_dir is not None:  # parameters stay fp32 in training (--dtype bf16: a bf16 copy or autocast computes)
        model = load_pretrained(init_dir, dtype=torch.float32, qat=qat)
        print(f"initialised from {init_dir}")
    else:
        model = build_model(config, qat=qat)  # K3ForConditionalGeneration for a vision_config
        model.reset_parameters(seed=args.seed)
    if not sharded_init:
        model.to(device)
    cp: ContextParallel | None = None
    dp_rank = 0 if dist_env is None else dist_env.rank
    if args.cp > 1:  # the token mixers' context-parallel forms, first (they only wrap forwards: parallel/__init__.py)
        cp_mesh = build_cp_mesh(dims, dist_env)
        cp = apply_context_parallel(model, cp_mesh["cp"].get_group())
        dp_rank = cp_mesh["dp"].get_local_rank()
    # --dtype bf16 --bf16-mode copy: `runs` (a bf16 copy) computes, `model` keeps the fp32 masters the optimizer,
    # checkpoints, QK-Clip and the balancer work on; otherwise the model runs itself
    bf16 = BF16Compute(model) if args.bf16_mode == "copy" else None
    runs = model if bf16 is None else bf16.model
    if args.activation_checkpointing:  # before FSDP: torchtitan's order (parallel/__init__.py)
        apply_activation_checkpointing(runs)
    if args.compile is not None:  # after activation checkpointing, before FSDP: torchtitan's order
        compiled = compile_layers(runs, args.compile)
        print(f"  torch.compile ({args.compile}): {compiled['regions']} regions (the decoder layers, the loss head); "
              f"they compile during the first step")
    expert_params, ep_mesh = [], None
    if dist_env is not None:  # EP, then FSDP2 over the dp x cp ranks (parallel/); the optimizer sees the shards
        if args.ep > 1:
            ep_mesh = build_ep_mesh(dims, dist_env)
            expert_params = apply_expert_parallel(model, ep_mesh)
        apply_fsdp(model, build_mesh(dims, dist_env), ignored_params=set(expert_params),
                   param_dtype=torch.bfloat16 if args.fsdp_bf16 else None)
    if sharded_init:
        model.to_empty(device=device)
        load_release_sharded(model, init_dir)  # one whole tensor at a time, never the whole model
        print(f"initialised from {init_dir} (each rank read its own shards)")
    opt = build_optimizer(model, lr=args.lr, weight_decay=args.weight_decay, head_dims=model_head_dims(config))
    world = 1 if dist_env is None else dist_env.world
    if vision:
        stream = synthetic.ImageTextStream(data.tokenizer, config, args.batch_size, args.seq_len, seed=args.seed)
    else:
        # the ranks of a context-parallel group read the same rows (and each takes its slice of them)
        stream = RowStreams(data.train, args.batch_size, args.seq_len, seed=args.seed,
                            rows=None if dist_env is None else rows_of_rank(args.batch_size, dp_rank, dims.dp))
    balancer = RouterBalancer(model, args.balance, args.qb_bins, args.sign_rate)
    max_logits = MLAMaxLogits(model, cp, runs=runs) if args.qk_clip is not None else None
    phases = parse_seq_len_schedule(args.seq_len_schedule)

    step, tokens_seen, elapsed_before = 0, 0, 0.0
    if resume and dist_env is not None:
        ckpt = run_dir / CHECKPOINTS / latest.read_text().strip()
        step, tokens_seen, elapsed_before = load_distributed_checkpoint(ckpt, model, opt, stream)
        if main:
            truncate_metrics(run_dir / METRICS_FILE, step)
        print(f"resumed from {ckpt} at step {step} (DCP, now on {world} ranks)")
    elif resume:
        ckpt = run_dir / CHECKPOINTS / latest.read_text().strip()
        if not (ckpt / TRAINER_STATE).is_file():
            raise ValueError(f"--resume: {ckpt} is a sharded checkpoint of a data-parallel run; resume it under "
                             f"torchrun (--nproc N, any N that divides --batch-size)")
        state = torch.load(ckpt / TRAINER_STATE, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        stream.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and state["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        step, tokens_seen, elapsed_before = state["step"], state["tokens"], state["elapsed_s"]
        truncate_metrics(run_dir / METRICS_FILE, step)
        print(f"resumed from {ckpt} at step {step}")
    if bf16 is not None:
        bf16.refresh()  # the masters as loaded (or initialised), rounded
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.config}, {n_params / 1e6:.2f}M parameters, {config.num_hidden_layers} layers; "
          f"QAT {'on' if qat else 'off'}; balance {args.balance}; device {device} {args.dtype}"
          + (f" ({args.bf16_mode}: fp32 masters)" if args.bf16_mode else ""))
    if dist_env is not None:
        print(f"  data parallel (FSDP2) over {world} ranks"
              + (f", context parallel in groups of {args.cp} (every row split in {args.cp})" if cp else "")
              + (f", experts split over groups of {args.ep} (MoonEP)" if expert_params else ""))
    kda_backend = select_kda_backend(device)
    print(f"  {kda_backend}")
    if kda_backend.name == "fla":
        print("  note: the first step compiles the Triton kernels (cached under TRITON_CACHE_DIR for later runs)")

    end = args.stop_at or args.steps
    result = TrainResult(run_dir)
    bar = tqdm(total=end, initial=step, disable=not args.progress, dynamic_ncols=True, file=sys.stderr,
               desc="train")
    t_run = time.time()
    interval_s, interval_tokens, tok_s = 0.0, 0, 0.0  # training time and tokens since the last log (no eval, no I/O)

    def trainer_state() -> dict:
        return {"step": step, "tokens": tokens_seen, "elapsed_s": elapsed_before + time.time() - t_run,
                "model": model.state_dict(), "optimizer": opt.state_dict(), "data": stream.state_dict(),
                "rng": {"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None}}

    # the first GPU step compiles (and without shipped fla configs, autotunes) the Triton kernels: say it is alive
    # (not when there is no step to run: a resumed finished run would hear it through its final evaluation)
    first_step = (heartbeat("first step: compiling GPU kernels", 30.0) if device.type == "cuda" and main and step < end
                  else None)
    while step < end:
        t_step = time.time()
        lr_scale = cosine_schedule(step, args.steps, args.warmup, args.min_lr_ratio)
        opt.set_lr_scale(lr_scale)
        stream.seq_len = seq_len_at(step, phases, args.seq_len)
        eval_now = data.val is not None and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps)
        log_now = (step + 1) % args.log_every == 0 or step == 0 or step + 1 == end or eval_now
        loss_sum, attnres = 0.0, None
        for micro in range(args.grad_accum):
            # AttnRes weights are recorded on the last micro-batch of logged steps only (a cheap extra output).
            record_attnres = log_now and micro == args.grad_accum - 1
            batch = next(stream).to(device)
            ids, labels, cu_seqlens = batch.input_ids, batch.labels, batch.cu_seqlens
            if cp is not None:  # this rank's slice of every row; the mixers see the global packing
                ids, labels, cu_seqlens = local_rows(ids, labels, cu_seqlens, cp.rank, cp.world)
            with contextlib.nullcontext() if cp is None else cp.packing(batch.cu_seqlens):
                with autocast("bf16" if args.bf16_mode == "autocast" else "fp32", device):
                    out = runs(ids, labels=labels, cu_seqlens=cu_seqlens, loss_chunk=args.loss_chunk, record=True,
                                record_attnres=record_attnres, **image_inputs(batch))
                # data (and context) parallel: this rank's share of the global batch's mean loss over all its
                # predicted tokens (FSDP averages the gradients over all ranks), so the loss is the whole rows'
                share = 1.0 if dist_env is None else global_loss_share(labels, world)
                (out.loss * share / args.grad_accum).backward()
                if bf16 is not None:
                    bf16.accumulate_grads()
            loss_sum += out.loss.item() if dist_env is None else sum_over_ranks(out.loss.detach() * share / world)
            balancer.after_forward(out.router)
            if record_attnres:
                attnres = out.attnres
            tokens_seen += ids.numel() * world
            interval_tokens += ids.numel() * world
        if first_step is not None:
            first_step.set()
            first_step = None
        max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
        if expert_params:  # gradients on two meshes: FSDP's and the experts'
            finish_expert_gradients_(expert_params, ep_mesh, world)
            grad_norm = clip_grad_norm_sharded_(list(model.parameters()), max_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
        opt.step()
        opt.zero_grad()
        if max_logits is not None:
            max_logits.clip_(args.qk_clip)
        loads = balancer.end_step()  # the new router biases apply from the next step
        if bf16 is not None:
            bf16.refresh()
        step += 1
        loss = loss_sum / args.grad_accum
        if not math.isfinite(loss):
            raise FloatingPointError(f"the training loss is {loss} at step {step}; lower --lr or raise --warmup")
        result.losses.append(loss)
        interval_s += time.time() - t_step

        if log_now:
            tok_s = interval_tokens / max(interval_s, 1e-9)
            interval_s, interval_tokens = 0.0, 0
            record = {"step": step, "tokens": tokens_seen, "loss": loss, "lr": args.lr * lr_scale,
                      "grad_norm": grad_norm, "tokens_per_s": tok_s, "seq_len": stream.seq_len,
                      "elapsed_s": elapsed_before + time.time() - t_run, **router_metrics(model, loads),
                      "attnres": attnres_metrics(attnres)}
            if eval_now:
                with eager_stance(args):
                    ev = evaluate(model, data.val, data.tokenizer, batch_size=args.batch_size, seq_len=stream.seq_len,
                                  max_tokens=args.eval_tokens, loss_chunk=args.loss_chunk,
                                  # the masters, as `openk3 eval` scores a checkpoint: autocast on CUDA, fp32 on the CPU
                                  amp=args.dtype if device.type == "cuda" else "fp32")
                record.update(val_loss=ev["loss"], val_bpb=ev["bpb"])
                result.final_eval = ev
                bar.write(f"step {step}: train loss {loss:.4f}, val loss {ev['loss']:.4f}, val bpb {ev['bpb']:.4f}")
            if main:
                with open(run_dir / METRICS_FILE, "a") as f:
                    f.write(json.dumps(record) + "\n")
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", lr=f"{args.lr * lr_scale:.2e}", refresh=False)
        bar.update(1)
        if (step % args.ckpt_every == 0 or step == end) and dist_env is not None:
            save_distributed_checkpoint(run_dir, step, model, opt, stream, data.tokenizer, args, tokens_seen,
                                        elapsed_before + time.time() - t_run, main)
        elif step % args.ckpt_every == 0 or step == end:
            save_checkpoint(run_dir, step, model, data.tokenizer, args, trainer_state())
        if (step % args.ckpt_every == 0 or step == end) and main:
            # matplotlib costs a second to import: only once there is something to draw
            from openk3.train import plots

            plots.plot_run(run_dir)  # 0.3 s
    bar.close()

    if vision and step == args.steps:
        with eager_stance(args):
            result.vision_eval = synthetic.attribute_accuracy(model, data.tokenizer,
                                                              n_images=args.vision_eval_images)
        write_json(run_dir / "vision_eval.json", result.vision_eval)
    elif args.sample and step == args.steps and dist_env is not None:
        print(f"no sample in a data-parallel run: `openk3 generate --model {run_dir}` samples from its checkpoint")
    elif args.sample and step == args.steps:
        with eager_stance(args):
            ids = generate(model, data.tokenizer, args.sample_prompt, max_tokens=args.sample_tokens,
                           temperature=args.sample_temperature, seed=args.seed)
        result.sample = args.sample_prompt + data.tokenizer.decode(ids)
    result.wall_s = time.time() - t_start
    print_summary(result, step, args)
    return result


def eager_stance(args: TrainArgs):
    """Run the compiled regions of a --compile run eagerly inside this context: evaluation (no_grad) and sampling
    (a growing decode cache) would each compile every layer again for shapes and modes the training steps never
    use."""
    return torch.compiler.set_stance("force_eager") if args.compile is not None else contextlib.nullcontext()


def router_metrics(model: K3ForCausalLM, loads: list[Tensor]) -> dict:
    """Keyed by decoder layer index, for each MoE layer: max/mean expert load, and every expert's load / mean (the
    heat map)."""
    layers = [str(l.i) for l in model.model.layers if hasattr(l, "block_sparse_moe")]
    return {"expert_load_max_over_mean": {i: balance.load_stats(l)["max_over_mean"] for i, l in zip(layers, loads)},
            "expert_load": {i: [round(float(x), 4) for x in l.double() / l.double().mean()]
                            for i, l in zip(layers, loads)}}


def attnres_metrics(attnres: dict[str, Tensor] | None) -> dict | None:
    """{"<layer>.attn" | "<layer>.mlp" | "output": mean mixing weight of each source, rounded} from a forward's
    `CausalLMOutput.attnres` (record_attnres=True); None when the config has no AttnRes. Sources: 0 = embedding, then
    the completed blocks, last = the partial block. Layer 0 has nothing to mix before its mixer (no "0.attn")."""
    if attnres is None:
        return None
    return {name: [round(float(x), 4) for x in w] for name, w in attnres.items()}


def print_summary(result: TrainResult, step: int, args: TrainArgs) -> None:
    print(f"\nstopped at step {step} of {args.steps}" if step < args.steps else f"\ntrained {step} steps")
    if result.losses:
        print(f"final training loss {result.losses[-1]:.4f}")
    if result.final_eval is not None:
        ev = result.final_eval
        print(f"validation: loss {ev['loss']:.4f}, {ev['bpb']:.4f} bits per byte on the held-out documents "
              f"(the first {ev['tokens']:,} tokens, {ev['bytes']:,} bytes, in {ev['seq_len']}-token rows; "
              f"`openk3 eval --model {result.run_dir}` repeats it)")
    if result.vision_eval is not None:
        ev = result.vision_eval
        print(synthetic.accuracy_line(ev))
        for e in ev["examples"]:
            print(f"  {e['truth']!r:>22} -> {e['answer']!r}")
    print(f"checkpoints, metrics and plots in {result.run_dir}")
    if result.sample is not None:
        print(f"\n---- sample (prompt {args.sample_prompt!r}, temperature {args.sample_temperature}) ----\n"
              f"{result.sample}\n----")
    print(f"total wall time {result.wall_s:.0f} s")


# ------------------------------------------------------------------------------------------------------ CLI


def register_commands(sub: argparse._SubParsersAction) -> None:
    """Register `train` and `eval` on the `openk3` parser (their one-line help is in openk3/cli.py)."""
    d = TrainArgs()
    # Every default is None here, the real one in [brackets]: resolve_train_args tells given flags from defaults
    # (a resumed run keeps its own settings).
    p = sub.add_parser("train")
    p.add_argument("--config", help=f"preset {sorted(PRESETS)} or config.json path [{d.config}]")
    p.add_argument("--data", help="corpus: a file, a .jsonl file or a directory [the stdlib's .py files]")
    p.add_argument("--vocab-size", type=int, help=f"BPE vocabulary size trained for the run [{d.vocab_size}]")
    p.add_argument("--tokenizer", help="use this tokenizer (a directory, tokenizer.json or a release-style "
                                       "tiktoken.model) instead of training a BPE")
    p.add_argument("--out", help="run directory [runs/<config>-<time>]")
    p.add_argument("--init-from", metavar="DIR", help="start from the weights of this checkpoint or run directory, "
                   "with its config (--config defaults to it and must match it) and its tokenizer, if it has one")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--steps", type=int, help=f"optimizer steps [{d.steps}]")
    p.add_argument("--stop-at", type=int, help="stop after this step (checkpointed) as if interrupted")
    p.add_argument("--batch-size", type=int, help=f"rows per micro-batch [{d.batch_size}]")
    p.add_argument("--seq-len", type=int, help=f"tokens per row [{d.seq_len}]")
    p.add_argument("--seq-len-schedule", help="curriculum LEN:UNTIL_STEP,...,LEN e.g. 128:200,512")
    p.add_argument("--grad-accum", type=int, help=f"micro-batches per step [{d.grad_accum}]")
    p.add_argument("--lr", type=float, help=f"peak learning rate, Muon and AdamW [{d.lr}]")
    p.add_argument("--warmup", type=float, help=f"warmup as a fraction of --steps [{d.warmup}]")
    p.add_argument("--min-lr-ratio", type=float, help=f"final lr / peak lr of the cosine [{d.min_lr_ratio}]")
    p.add_argument("--weight-decay", type=float, help=f"[{d.weight_decay}]")
    p.add_argument("--grad-clip", type=float, help=f"max gradient norm, 0 = off [{d.grad_clip}]")
    p.add_argument("--loss-chunk", type=int, help=f"tokens per chunk of the loss (recomputed logits), 0 = off "
                                                  f"[{d.loss_chunk}]")
    p.add_argument("--balance", choices=BALANCE_MODES, help=f"router bias update [{d.balance}]")
    p.add_argument("--qb-bins", type=int, help=f"Quantile Balancing histogram bins, 0 = exact [{d.qb_bins}]")
    p.add_argument("--sign-rate", type=float, help=f"bias step of --balance sign [{d.sign_rate}]")
    p.add_argument("--qat", action=argparse.BooleanOptionalAction, default=None,
                   help="MXFP4 expert weights + MXFP8 expert inputs, straight-through [on when the config stores "
                        "MXFP4 experts]")
    p.add_argument("--qk-clip", type=float, metavar="TAU", help="QK-Clip threshold for MLA logits [off]")
    p.add_argument("--device", choices=("cpu", "cuda"), help=f"[{d.device}]")
    p.add_argument("--dtype", choices=("fp32", "bf16"), help=f"bf16: compute in bf16 over fp32 master weights "
                                                             f"(--bf16-mode) [{d.dtype}]")
    p.add_argument("--bf16-mode", choices=BF16_MODES,
                   help="how --dtype bf16 computes: copy = a bf16 copy of the fp32 masters runs forward and backward "
                        "(train/precision.py), autocast = CUDA autocast over fp32 parameters [copy in one process "
                        "for a text model, else autocast]")
    p.add_argument("--seed", type=int, help=f"[{d.seed}]")
    p.add_argument("--val-fraction", type=float, help=f"documents held out for validation [{d.val_fraction}]")
    p.add_argument("--log-every", type=int, help=f"[{d.log_every}]")
    p.add_argument("--eval-every", type=int, help=f"[{d.eval_every}]")
    p.add_argument("--eval-tokens", type=int, help=f"validation tokens per evaluation [{d.eval_tokens}]")
    p.add_argument("--ckpt-every", type=int, help=f"[{d.ckpt_every}]")
    p.add_argument("--keep-last", type=int, help=f"checkpoints kept [{d.keep_last}]")
    p.add_argument("--no-sample", dest="sample", action="store_false", default=None, help="skip the final sample")
    p.add_argument("--sample-prompt", help=f"[{d.sample_prompt!r}]")
    p.add_argument("--sample-tokens", type=int, help=f"[{d.sample_tokens}]")
    p.add_argument("--sample-temperature", type=float, help=f"[{d.sample_temperature}]")
    p.add_argument("--vision-eval-images", type=int, help=f"image-text runs: held-out images described at the end "
                                                          f"[{d.vision_eval_images}]")
    p.add_argument("--threads", type=int, help=f"torch CPU threads [{d.threads}]")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    p.add_argument("--nproc", type=int, help="run under torchrun with this many local processes, data parallel "
                                             "(FSDP2; --batch-size stays the global batch) [1: no torchrun]")
    p.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="recompute the token mixers and dense MLPs in backward (less activation memory)")
    p.add_argument("--fsdp-bf16", action="store_true", default=None,
                   help="data parallel: FSDP2 computes with bf16 copies of the parameters (fp32 masters, fp32 "
                        "gradient reduction), instead of --dtype bf16's autocast")
    p.add_argument("--compile", nargs="?", const="inductor", choices=COMPILE_BACKENDS + ("off",),
                   help="torch.compile the decoder layers and the loss (train/compile.py); the first step compiles "
                        "[inductor for one CUDA process and a text model, else off; --compile alone: inductor]")
    p.add_argument("--dp", type=int, help="data-parallel ranks of the mesh; --dp x --cp must equal the number of "
                                          "processes [processes / --cp]")
    p.add_argument("--cp", type=int, help="context-parallel ranks: each takes a contiguous slice of every row "
                                          "(KDA fold, MLA latent all-gather); must divide the processes and "
                                          "--seq-len [1]")
    p.add_argument("--ep", type=int, help="expert-parallel ranks (MoonEP) inside the dp x cp ones; must divide "
                                          "the number of processes and the number of experts [1]")
    p.set_defaults(fn=cmd_train, parser=p)

    p = sub.add_parser("eval")
    p.add_argument("--model", required=True, help="checkpoint directory or run directory (its latest checkpoint)")
    p.add_argument("--data", default=None, help="corpus to score [the run's held-out documents]")
    # The defaults repeat the run's final validation, so eval prints the loss train printed (see eval_settings).
    p.add_argument("--batch-size", type=int, help="rows per batch [the run's --batch-size, else 8]")
    p.add_argument("--seq-len", type=int, help="tokens per row [the run's last row length, else 256]")
    p.add_argument("--max-tokens", type=int, help="score only the first N tokens, 0 = all [the run's --eval-tokens "
                                                  "on its held-out documents, else all]")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_eval)


def cmd_train(ns: argparse.Namespace) -> None:
    if ns.nproc is not None and ns.nproc < 1:
        raise ValueError(f"--nproc={ns.nproc}: must be a positive integer")
    cli = {k: v for k, v in vars(ns).items() if k not in ("fn", "command", "resume", "parser", "nproc")}
    args = resolve_train_args(cli, ns.resume)
    if ns.nproc is not None and ns.nproc > 1 and not under_torchrun():
        from openk3.parallel.launch import argv_from_namespace, run_torchrun

        # the settings' errors here, once, before N processes would each report them
        check_args(args)
        dims = ParallelDims(dp=args.dp, ep=args.ep, cp=args.cp).resolve(ns.nproc)
        check_cp_lengths(args)
        rows_of_rank(args.batch_size, 0, dims.dp)
        run_torchrun(ns.nproc, "train", argv_from_namespace(ns.parser, ns, skip={"nproc"}))
        return
    train(args, resume=ns.resume)


def cmd_eval(ns: argparse.Namespace) -> None:
    for name in ("batch_size", "seq_len"):
        v = getattr(ns, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v}: must be positive")
    if ns.max_tokens is not None and ns.max_tokens < 0:
        raise ValueError(f"--max-tokens={ns.max_tokens}: must be positive, or 0 for every token")
    model, tokenizer, model_dir = load_for_inference(ns.model, ns.device)
    saved = saved_run_args(model_dir)
    if model.config.vision_config is not None:  # an image-text model: its held-out descriptions, not a text loss
        if ns.data is not None:
            raise ValueError(f"--data={ns.data}: an image-text model is evaluated on the synthetic held-out images")
        ev = synthetic.attribute_accuracy(model, tokenizer, n_images=saved.vision_eval_images if saved else 200)
        if ns.json:
            print(json.dumps({"model": str(model_dir), **ev}))
        else:
            print(f"{model_dir}: {synthetic.accuracy_line(ev)}")
        return
    corpus = validation_corpus(model_dir, tokenizer, ns.data)
    settings = eval_settings(saved, ns.data, ns.batch_size, ns.seq_len, ns.max_tokens)
    amp = saved.dtype if saved is not None and ns.device == "cuda" else "fp32"
    ev = evaluate(model, corpus, tokenizer, **settings, amp=amp,
                  loss_chunk=saved.loss_chunk if saved is not None else TrainArgs.loss_chunk)
    data = ns.data if ns.data is not None else f"the held-out documents of {saved.data or 'the stdlib'}"
    if ns.json:
        print(json.dumps({"model": str(model_dir), "data": data, "seq_len": settings["seq_len"], **ev}))
    else:
        print(f"{model_dir}: loss {ev['loss']:.4f} nats/token, {ev['bpb']:.4f} bits per byte on {data} "
              f"(the first {ev['tokens']:,} tokens, {ev['bytes']:,} bytes, in {settings['seq_len']}-token rows)")
