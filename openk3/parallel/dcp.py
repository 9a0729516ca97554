"""Sharded checkpoints (torch.distributed.checkpoint, DCP) and the converter to and from the release layout.

    save_sharded(model, opt.optimizers, path)     # collective: every rank writes its own shards (+ .metadata)
    load_sharded(model, opt.optimizers, path)     # collective: reshards on load, so the world size may differ
    openk3 convert CKPT_DIR OUT                   # DCP -> release safetensors, or release -> DCP (by what CKPT_DIR is)

A DCP checkpoint here is a directory with `.metadata`, one `__<rank>_0.distcp` file per saving rank, and the model's
`config.json`. It holds {"model": the model state_dict (parameters as DTensor shards, buffers whole),
"optim": the optimizer state (torch.distributed.checkpoint.state_dict's FQN-keyed form)}. `load_sharded` asks for
the shards of the *current* layout and DCP reads the overlapping pieces of the saved files: that is the reshard
(saved at world 4, loaded at world 2 or 1).

Conversion streams one model tensor at a time (`checkpoint.write_weights` and the one name table in
openk3/model/checkpoint.py):
  - DCP -> release: a single process reads each tensor from the DCP files (DCP reads only that tensor's pieces),
    converts it to its stored form (fp32 islands, padded A_log, MXFP4 experts) and writes shard by shard: at most
    one model tensor and one output shard in memory, never the whole model.
  - release -> DCP (`load_release_sharded`): every rank builds the model on the meta device, shards it (FSDP2),
    allocates only its shards, and fills them tensor by tensor from the safetensors files (holding one whole
    tensor at a time), then all ranks save. NOTE: run it under torchrun to split the memory; in one process that
    one rank holds every shard, which is the whole model.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from openk3.config import K3Config
from openk3.model.checkpoint import (_FLOAT_DTYPES, CONFIG_NAME, DEFAULT_MAX_SHARD_BYTES, INDEX_NAME, SINGLE_FILE_NAME,
                                     _entries, _load_entry, _read_config, read_index, write_weights)
from openk3.model.model import K3ForCausalLM, keeps_fp32

METADATA = ".metadata"  # DCP's index file
MODEL_KEY, OPTIM_KEY = "model", "optim"


def is_dcp_dir(path: str | Path) -> bool:
    return (Path(path) / METADATA).is_file()


# ---------------------------------------------------------------------------------------- save / load


def save_sharded(model: nn.Module, optimizers, path: str | Path) -> None:
    """Write the model (and, when `optimizers` is not None, their state) as a DCP checkpoint at `path`.
    Collective over the default process group (or none, in one process)."""
    state = {MODEL_KEY: get_model_state_dict(model)}
    if optimizers is not None:
        state[OPTIM_KEY] = get_optimizer_state_dict(model, optimizers)
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def load_sharded(model: nn.Module, optimizers, path: str | Path) -> None:
    """Fill the model (and the optimizers' state) from the DCP checkpoint at `path`, whatever world size wrote it."""
    if not is_dcp_dir(path):
        raise FileNotFoundError(f"{path} is not a torch.distributed.checkpoint directory (no {METADATA})")
    state = {MODEL_KEY: get_model_state_dict(model)}
    if optimizers is not None:
        state[OPTIM_KEY] = get_optimizer_state_dict(model, optimizers)
        # NOTE: a parameter that never had a gradient (layer 0's AttnRes query, which has nothing to mix) has no
        # optimizer state in the saved run, but get_optimizer_state_dict gives every parameter a fresh one: keep
        # that fresh (unused) state instead of asking the checkpoint for it. Model tensors stay strictly required.
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        per_param = state[OPTIM_KEY]["state"]
        never_stepped = [f for f in per_param if not any(f"{OPTIM_KEY}.state.{f}.{k}" in saved for k in per_param[f])]
        for fqn in never_stepped:
            del per_param[fqn]
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state[MODEL_KEY])
    if optimizers is not None:
        set_optimizer_state_dict(model, optimizers, state[OPTIM_KEY],
                                 options=StateDictOptions(strict=not never_stepped))


# ------------------------------------------------------------------------------------- DCP -> release


def dcp_config(path: Path) -> K3Config:
    """The model config stored with a DCP checkpoint: its own config.json, else the one of the directory above (a
    training checkpoint keeps its DCP files in `step_N/dcp/` beside the release files)."""
    for candidate in (path, path.parent):
        if (candidate / CONFIG_NAME).is_file():
            return _read_config(candidate)
    raise FileNotFoundError(f"no {CONFIG_NAME} in {path} or {path.parent}: the DCP checkpoint's model config is needed")


def dcp_model_metas(path: Path, config: K3Config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{state_dict name: (shape, dtype)} of the model tensors in the DCP checkpoint, in the model's state_dict order;
    a ValueError naming the first tensor that is missing or has another shape than `config` gives it."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    with torch.device("meta"):
        expected = K3ForCausalLM(config).state_dict()
    metas = {}
    for name, t in expected.items():
        meta = saved.get(f"{MODEL_KEY}.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"DCP checkpoint {path} has no tensor {MODEL_KEY}.{name} (is it for another config?)")
        if tuple(meta.size) != tuple(t.shape):
            raise ValueError(f"DCP checkpoint {path}: {name} is {list(meta.size)}, the config wants {list(t.shape)}")
        metas[name] = (tuple(meta.size), meta.properties.dtype)
    return metas


def read_dcp_tensor(path: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """One whole model tensor from a DCP checkpoint, in this process only (no collectives)."""
    t = torch.empty(shape, dtype=dtype)
    with _quiet_single_process():
        dcp.load({MODEL_KEY: {name: t}}, checkpoint_id=str(path), no_dist=True)
    return t


def dcp_to_release(src: str | Path, out: str | Path, *, dtype: torch.dtype | None = None,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write the model of the DCP checkpoint `src` as a release-layout checkpoint directory `out` (atomically), one
    tensor at a time. dtype: cast every tensor but the fp32 islands to it (e.g. bf16 as the release); None = keep."""
    src, out = Path(src), Path(out)
    if not is_dcp_dir(src):
        raise FileNotFoundError(f"{src} is not a torch.distributed.checkpoint directory (no {METADATA})")
    tmp = _fresh_dir_beside(out)
    try:
        dcp_to_release_into(src, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, out)


def dcp_to_release_into(src: Path, out: Path, *, dtype: torch.dtype | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """`dcp_to_release` into the existing directory `out`, not atomically (the caller renames `out` into place)."""
    config = dcp_config(src)
    metas = dcp_model_metas(src, config)
    if dtype is not None:
        metas = {n: (shape, torch.float32 if keeps_fp32(n) else dtype) for n, (shape, _) in metas.items()}

    def read(name: str) -> Tensor:
        shape, want = metas[name]
        return read_dcp_tensor(src, name, shape, want)  # DCP casts to the requested dtype as it reads

    write_weights(config, metas, read, out, max_shard_bytes)


# ------------------------------------------------------------------------------------- release -> DCP


@torch.no_grad()
def load_release_sharded(model: K3ForCausalLM, path: str | Path) -> None:
    """Fill `model` (plain or FSDP2-sharded, allocated) from the release-layout checkpoint at `path`, one model
    tensor at a time: each rank reads the tensor, keeps the rows of its own shard, and drops the rest."""
    path = Path(path)
    infos = read_index(path)
    targets = model.state_dict()
    entries = _entries(model.config, {n: tuple(t.shape) for n, t in targets.items()})
    by_name: dict[str, list] = {}
    for entry in entries:
        by_name.setdefault(entry.model_name, []).append(entry)
    missing = [s.name for e in entries for s in e.stored if s.name not in infos]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensor(s) of its config, e.g. {missing[:3]}")
    handles: dict[str, object] = {}
    try:
        for name, group in by_name.items():
            target = targets[name]
            full = torch.empty(tuple(target.shape), dtype=target.dtype)
            for entry in group:
                stored = []
                for s in entry.stored:
                    file = infos[s.name].file
                    if file not in handles:
                        handles[file] = safe_open(path / file, framework="pt")
                    stored.append(handles[file].get_tensor(s.name))
                _load_entry(entry, stored, full)
            copy_into_shard(target, full)
    finally:
        handles.clear()


def copy_into_shard(target: Tensor, full: Tensor) -> None:
    """Copy the whole tensor `full` into `target`: all of it, or, for a DTensor, the block of its local shard."""
    if not isinstance(target, DTensor):
        target.copy_(full)
        return
    shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
    block = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    target.to_local().copy_(block)


def release_to_dcp(src: str | Path, out: str | Path) -> None:
    """Convert the release-layout checkpoint `src` into a DCP checkpoint `out` (model only, config.json beside).
    Under torchrun every rank holds only its FSDP2 shards; in one process, the whole model (see the module doc)."""
    from openk3.parallel.fsdp import apply_fsdp
    from openk3.parallel.mesh import DistEnv, ParallelDims, build_mesh

    src, out = Path(src), Path(out)
    config = _read_config(src)
    if not ((src / INDEX_NAME).is_file() or (src / SINGLE_FILE_NAME).is_file()):
        raise FileNotFoundError(f"{src} has no safetensors weights ({INDEX_NAME} or {SINGLE_FILE_NAME})")
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model.cast(_FLOAT_DTYPES[read_index(src)[_embed_name(config)].dtype])  # the embedding's dtype, as load_pretrained
    if dist.is_initialized():
        env = DistEnv(dist.get_rank(), dist.get_world_size(), 0, torch.device("cpu"))
        apply_fsdp(model, build_mesh(ParallelDims(), env))
    model.to_empty(device="cpu")
    load_release_sharded(model, src)
    main = not dist.is_initialized() or dist.get_rank() == 0
    tmp = _fresh_dir_beside(out) if main else None
    if dist.is_initialized():
        holder = [tmp]
        dist.broadcast_object_list(holder)
        tmp = holder[0]
    save_sharded(model, None, tmp)
    if main:
        shutil.copy(src / CONFIG_NAME, tmp / CONFIG_NAME)
        _publish(tmp, out)
    if dist.is_initialized():
        dist.barrier()


def _embed_name(config: K3Config) -> str:
    with torch.device("meta"):
        shapes = {"model.embed_tokens.weight": tuple(K3ForCausalLM(config).model.embed_tokens.weight.shape)}
    return _entries(config, shapes)[0].stored[0].name


# ------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it "assumes" a single process whenever no process group runs: that is what no_dist asks."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")
        yield


def _fresh_dir_beside(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not empty; choose another output directory")
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def _publish(tmp: Path, target: Path) -> None:
    """Rename the complete `tmp` to `target` (an empty `target` directory is replaced)."""
    if target.is_dir():
        target.rmdir()
    os.rename(tmp, target)


# ------------------------------------------------------------------------------------------------ CLI


def register_commands(sub: argparse._SubParsersAction) -> None:
    """Register `openk3 convert` (its one-line help is in openk3/cli.py)."""
    p = sub.add_parser("convert")
    p.add_argument("src", help="a DCP checkpoint directory (.metadata; a training checkpoint's dcp/) or a "
                               "release-layout checkpoint directory (config.json + safetensors)")
    p.add_argument("out", help="the output directory (must not exist, or be empty)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="DCP -> release: store the weights in this dtype "
                   "(the fp32 islands stay fp32) [as saved]")
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                   help=f"DCP -> release: bytes per safetensors shard [{DEFAULT_MAX_SHARD_BYTES}]")
    p.set_defaults(fn=cmd_convert)


def cmd_convert(ns: argparse.Namespace) -> None:
    from openk3.parallel.mesh import init_distributed

    src = Path(ns.src)
    if not src.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {src}")
    if is_dcp_dir(src):
        if ns.max_shard_bytes <= 0:
            raise ValueError(f"--max-shard-bytes={ns.max_shard_bytes}: must be positive")
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[ns.dtype]
        dcp_to_release(src, ns.out, dtype=dtype, max_shard_bytes=ns.max_shard_bytes)
        print(f"wrote the release-layout checkpoint {ns.out} from the DCP checkpoint {src}")
        return
    if ns.dtype is not None:
        raise ValueError(f"--dtype {ns.dtype} applies to DCP -> release; {src} is a release-layout checkpoint")
    init_distributed("cpu")
    release_to_dcp(src, ns.out)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"wrote the DCP checkpoint {ns.out} from the release-layout checkpoint {src}")
