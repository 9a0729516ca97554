"""Checkpoints in the released Kimi K3 format (K3_SPEC sections 5 and 6), and the one table of outside names.

A checkpoint directory holds
    config.json                          the HF config
    model-00001-of-0000N.safetensors     N shards, each at most `max_shard_bytes` (a larger tensor gets one alone)
    model.safetensors.index.json         {"metadata": {"total_size": bytes}, "weight_map": {tensor: shard file}}

Two layouts, picked by `is_k3_layout(config)`:
  - K3-style (the release): tensor names are `language_model.` + the outside name, and config.json is a
    `KimiK3ForConditionalGeneration` top level with the text model under `text_config`. A config with a
    `vision_config` (the release) adds the vision tower and projector as `vision_tower.*` and `mm_projector.*`
    (K3_SPEC section 10: no prefix, not quantised, in the model's dtype, after the text model: the last shards).
  - Kimi-Linear-style (Kimi-Linear-48B-A3B): the outside names without a prefix, and config.json is the bare text
    config (model_type "kimi_linear").

How a model tensor is stored (the `how` of an `Entry`):
    same          as it is, in the model's dtype (bf16 for the release)
    vision        as `same`, without the `language_model.` prefix (the vision tower and projector)
    fp32          in fp32 whatever the model's dtype (spec: o_norm, the conv weights, dt_bias, the router's bias)
    a_log         fp32; K3-style [max(H, head_dim)] padded with zeros (the release: 96 heads in [128]);
                  Kimi-Linear-style [1, 1, H, 1] (the shape of Kimi-Linear's `A_log` parameter)
    expert        one slice [e] of the model's stacked experts, as `...experts.{e}.{w1,w2,w3}.weight`
    expert_mxfp4  one slice [e] stored as MXFP4 (spec section 5): `.weight_packed` uint8 [rows, cols / 2] (two
                  E2M1 codes a byte, the low nibble is the even column) and `.weight_scale` uint8 [rows, cols / 32]
                  (E8M0). Used when `config.mxfp4_experts`. Saving quantises (round to nearest even), so experts
                  come back as dequantize(quantize(w)); MXFP4-representable experts (QAT) come back exactly.

Precision on load: the `fp32` and `a_log` tensors stay fp32 in the loaded model (`K3ForCausalLM.cast`; the model
computes with them in fp32 anyway: o_norm, conv, decay, router selection); everything else gets the load dtype. Saving then loading a model gives
bit-identical values and logits, in fp32 and in bf16.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from openk3.config import K3Config
from openk3.model.model import K3ForCausalLM, count_params, keeps_fp32
from openk3.ops.mxfp import dequantize_mxfp4, pack_e2m1, quantize_mxfp4, unpack_e2m1
from openk3.text.tokenizer import Tokenizer
from openk3.vision.model import build_model

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"  # HF's name for an unsharded checkpoint; read, never written
K3_PREFIX = "language_model."
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # HF's default shard size
MAX_INIT_PARAMS = 20e9  # init_checkpoint builds the whole model in memory
# A training run's directory (train/trainer.py) keeps its checkpoints under checkpoints/, names the newest in
# checkpoints/latest and holds train_args.json; `find_checkpoint` reads this layout so serving needs no trainer.
CHECKPOINTS = "checkpoints"
LATEST = "latest"
ARGS_FILE = "train_args.json"

class CheckpointError(ValueError):
    """A checkpoint file that cannot be read (truncated, not safetensors, garbage); the message names the file.
    A ValueError, so callers that handle bad input (the CLI) handle it too."""


def _open_shard(file: Path):
    """safe_open(file), with safetensors' error (e.g. "incomplete metadata", "header too large") naming the file."""
    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError, ValueError) here
        raise CheckpointError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e}); "
                              f"it may be truncated or in another format") from None


# ---------------------------------------------------------------------------------- the name table

# THE table of outside names. Model state_dict name (full match) -> outside name, and how it is stored (see the
# module docstring). The first matching row wins; a "same" tensor the model keeps in fp32 (model.FP32_TENSORS: o_norm,
# the conv weights, dt_bias, the router bias) is stored "fp32". K3-style checkpoints put `language_model.` in front of every name.
# `{e}` is the expert index of a stacked expert tensor.
# NOTE: the model keeps the output AttnRes vectors on K3ForCausalLM, beside lm_head; the spec lists them with
# embed_tokens and norm, which live under `model.`, so they are stored as `model.output_attn_res_*` [inferred].
NAME_TABLE: list[tuple[str, str, str]] = [
    # model name                                  outside name                              how
    (r"output_attn_res_(norm|proj)\.weight",      r"model.output_attn_res_\1.weight",       "same"),
    (r"(.*\.self_attn)\.A_log",                   r"\1.A_log",                              "a_log"),
    (r"(.*\.experts)\.(w[123])",                  r"\1.{e}.\2",                             "expert"),
    (r"((?:vision_tower|mm_projector)\..*)",       r"\1",                                    "vision"),
    (r"(.*)",                                     r"\1",                                    "same"),
]


@dataclass(frozen=True)
class Stored:
    """One tensor in the checkpoint. dtype None means the model's dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None


@dataclass(frozen=True)
class Entry:
    """One model tensor (or one expert slice [expert] of a stacked one) and the checkpoint tensor(s) holding it."""

    model_name: str
    expert: int | None
    how: str
    stored: tuple[Stored, ...]


def is_k3_layout(config: K3Config) -> bool:
    """K3-style names and config.json when the config came with a top level (`text_config`) or sets any K3
    addition; Kimi-Linear-style otherwise. The K3 additions are exactly the fields whose absence means
    Kimi-Linear behaviour (config.py leaves them out of config.json when unset), so the choice survives a round trip."""
    lac = config.linear_attn_config
    return (config.extra.get("top") is not None or config.vision_config is not None or config.attn_res
            or config.latent_moe
            or config.quantization_config is not None or lac.use_full_rank_gate or lac.gate_lower_bound is not None)


def name_map(config: K3Config) -> list[Entry]:
    """Every model tensor of `config` with its checkpoint name(s), shape(s) and storage, in model order."""
    with torch.device("meta"):
        model = build_model(config)
    return _entries(config, {name: tuple(t.shape) for name, t in model.state_dict().items()})


def _outside_name(name: str) -> tuple[str, str]:
    """(outside name without prefix, how) of one model tensor, from the first NAME_TABLE row that matches."""
    for pattern, outside, how in NAME_TABLE:
        m = re.fullmatch(pattern, name)
        if m:
            return m.expand(outside), ("fp32" if how == "same" and keeps_fp32(name) else how)
    raise AssertionError("unreachable: the last NAME_TABLE row matches every name")


def _entries(config: K3Config, shapes: dict[str, tuple[int, ...]]) -> list[Entry]:
    """name_map for model tensors of the given shapes (state_dict order)."""
    k3 = is_k3_layout(config)
    entries = []
    for name, shape in shapes.items():
        outside, how = _outside_name(name)
        outside = (K3_PREFIX if k3 and how != "vision" else "") + outside
        if how == "expert":
            E, rows, cols = shape
            for e in range(E):
                base = outside.replace("{e}", str(e))
                if config.mxfp4_experts:
                    stored = (Stored(base + ".weight_packed", (rows, cols // 2), torch.uint8),
                              Stored(base + ".weight_scale", (rows, cols // 32), torch.uint8))
                    entries.append(Entry(name, e, "expert_mxfp4", stored))
                else:
                    entries.append(Entry(name, e, "expert", (Stored(base + ".weight", (rows, cols), None),)))
        elif how == "a_log":
            (H,) = shape
            stored_shape = (max(H, config.linear_attn_config.head_dim),) if k3 else (1, 1, H, 1)
            entries.append(Entry(name, None, how, (Stored(outside, stored_shape, torch.float32),)))
        else:
            dtype = torch.float32 if how == "fp32" else None
            entries.append(Entry(name, None, how, (Stored(outside, shape, dtype),)))
    return entries


# ------------------------------------------------------------------------------ model -> checkpoint

def _to_stored(entry: Entry, value: Tensor) -> tuple[Tensor, ...]:
    """The checkpoint tensor(s) of one entry, on the CPU. `value` is the whole model tensor (stacked for experts)."""
    value = value.detach()
    if entry.how in ("same", "vision"):
        return (value.cpu().contiguous(),)
    if entry.how == "fp32":
        return (value.float().cpu().contiguous(),)
    if entry.how == "a_log":
        (stored,) = entry.stored
        if len(stored.shape) == 1:  # K3-style: [max(H, head_dim)], zero padded
            padded = torch.zeros(stored.shape, dtype=torch.float32)
            padded[: value.shape[0]] = value.float().cpu()
            return (padded,)
        return (value.float().cpu().reshape(stored.shape).contiguous(),)
    w = value[entry.expert]
    if entry.how == "expert":
        # NOTE: a copy, because safetensors refuses tensors that share one storage (here: the stacked parameter)
        return (w.to("cpu", copy=True),)
    codes, scales = quantize_mxfp4(w)
    return pack_e2m1(codes).cpu(), scales.cpu()


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def save_pretrained(model: K3ForCausalLM, path: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    tokenizer: Tokenizer | None = None) -> None:
    """Write `model` as a checkpoint directory at `path` (see the module docstring for the layout), with
    `tokenizer` beside it if given.

    Atomic: everything is written into a fresh directory beside `path`, which replaces `path` only once complete.
    Files in an existing `path` that are not checkpoint files (a tokenizer, a README) are copied over first; a
    `tokenizer` given here is written after them, so it replaces an old one.
    Streams: each shard's tensors are built (cast, padded, MXFP4-packed expert by expert), written, and dropped
    before the next shard's, so at most one shard is held besides the model.
    """
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r}: must be a positive integer")
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"cannot save a checkpoint to {target}: it exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        _write_checkpoint(model, tmp, max_shard_bytes)
        if target.exists():
            _copy_other_files(target, tmp)
        if tokenizer is not None:
            tokenizer.save(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_dir(tmp, target)


def _write_checkpoint(model: K3ForCausalLM, out: Path, max_shard_bytes: int) -> None:
    values = model.state_dict()  # references to the model's tensors, no copies
    write_weights(model.config, {name: (tuple(t.shape), t.dtype) for name, t in values.items()}, values.__getitem__,
                  out, max_shard_bytes)


def write_weights(config: K3Config, metas: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  read: Callable[[str], Tensor], out: Path, max_shard_bytes: int) -> None:
    """Write the shards, index and config.json of a model whose tensors are described by `metas` (state_dict name
    -> (shape, dtype), in state_dict order) and fetched one at a time by `read(name)` into the directory `out`.
    Only one model tensor (and one shard) is held at a time, so `read` may load from elsewhere, e.g. a sharded
    DCP checkpoint (parallel/dcp.py)."""
    entries = _entries(config, {name: shape for name, (shape, _) in metas.items()})

    # Plan the shards from shapes and dtypes alone, so the file names (which carry the shard count) are known
    # before any data is built. An entry's tensors (MXFP4 packed + scale) always share a shard.
    shards: list[list[Entry]] = [[]]
    used = 0
    for entry in entries:
        size = sum(_nbytes(s.shape, s.dtype or metas[entry.model_name][1]) for s in entry.stored)
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(entry)
        used += size

    weight_map: dict[str, str] = {}
    total = 0
    current: tuple[str, Tensor] | None = None  # the model tensor read last (the expert entries of one share it)
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, Tensor] = {}
        for entry in shard:
            if current is None or current[0] != entry.model_name:
                current = (entry.model_name, read(entry.model_name))
            for s, t in zip(entry.stored, _to_stored(entry, current[1])):
                tensors[s.name] = t
                weight_map[s.name] = file
                total += t.numel() * t.element_size()
        save_file(tensors, out / file, metadata={"format": "pt"})  # HF's loader requires format "pt"
        del tensors

    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    dtype = metas["model.embed_tokens.weight"][1]
    (out / CONFIG_NAME).write_text(json.dumps(hf_config_dict(config, dtype), indent=2) + "\n")


def hf_config_dict(config: K3Config, dtype: torch.dtype) -> dict:
    """The config.json of a checkpoint with weights in `dtype`.

    A K3-style config without a top level (e.g. the `tiny` preset) gets the release's: KimiK3ForConditionalGeneration
    with the token ids at the top and the text model under `text_config`."""
    if is_k3_layout(config) and config.extra.get("top") is None:
        config = config.replace(extra={**config.extra, "top": config.release_top()})
    d = config.to_hf_dict()
    d["dtype"] = str(dtype).removeprefix("torch.")  # what HF's `dtype="auto"` reads; the release says "bfloat16"
    if "torch_dtype" in d:  # the older name, kept from a loaded config: keep it true as well
        d["torch_dtype"] = d["dtype"]
    return d


_CHECKPOINT_FILE = re.compile(r"config\.json|model\.safetensors\.index\.json|model(-\d{5}-of-\d{5})?\.safetensors")


def _copy_other_files(old: Path, new: Path) -> None:
    """Copy what a user put beside an old checkpoint into the new one. NOTE: copy, not move: until the new
    directory is in place, the old one must stay complete."""
    for p in old.iterdir():
        if _CHECKPOINT_FILE.fullmatch(p.name):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.copytree(p, new / p.name, symlinks=True)
        else:
            shutil.copy2(p, new / p.name, follow_symlinks=False)


def _replace_dir(new: Path, target: Path) -> None:
    """Move the complete `new` directory to `target`. A directory cannot be renamed over a non-empty one, so an
    existing `target` is first renamed aside and deleted afterwards. NOTE: a crash between the two renames leaves
    the old checkpoint at `.{name}.old-*` and the new one at `.{name}.tmp-*`, both complete."""
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(target, old)
        os.rename(new, target)
        shutil.rmtree(old)
    else:
        os.rename(new, target)


# ------------------------------------------------------------------------------ checkpoint -> model

@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str  # safetensors' name: "BF16", "F32", "U8", ...
    shape: tuple[int, ...]


_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_index(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory -> (shard file, dtype, shape), read from the shard headers (no data).

    Reads the index's shards, or a single `model.safetensors`. The index and the shard headers must agree."""
    path = Path(path)
    index_file = path / INDEX_NAME
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index_file} is not a safetensors index: {e}") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_file} has no weight_map object (tensor name -> shard file)")
        files = list(dict.fromkeys(weight_map.values()))
    elif (path / SINGLE_FILE_NAME).is_file():
        weight_map, files = None, [SINGLE_FILE_NAME]
    else:
        raise FileNotFoundError(f"no {INDEX_NAME} (nor a single {SINGLE_FILE_NAME}) in checkpoint directory {path}")
    infos: dict[str, TensorInfo] = {}
    for file in files:
        if not (path / file).is_file():
            raise FileNotFoundError(f"{index_file} names shard {file}, which is not in {path}")
        with _open_shard(path / file) as f:
            for name in f.keys():
                if name in infos:
                    raise ValueError(f"tensor {name} is stored twice, in {infos[name].file} and {file}")
                sl = f.get_slice(name)
                infos[name] = TensorInfo(file, sl.get_dtype(), tuple(sl.get_shape()))
    if weight_map is not None:
        disagree = sorted(n for n in weight_map.keys() | infos.keys()
                          if weight_map.get(n) != (infos[n].file if n in infos else None))
        if disagree:
            raise ValueError(f"{index_file} and the shard headers disagree about {len(disagree)} tensor(s), e.g. "
                             + ", ".join(f"{n} (index: {weight_map.get(n)}, shards: "
                                         f"{infos[n].file if n in infos else None})" for n in disagree[:3]))
    return infos


def iter_checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) for every tensor of a checkpoint directory, shard by shard, one tensor at a time (CPU)."""
    path = Path(path)
    infos = read_index(path)
    for file in dict.fromkeys(i.file for i in infos.values()):
        with _open_shard(path / file) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _read_config(path: Path) -> K3Config:
    file = path / CONFIG_NAME
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in checkpoint directory {path}")
    try:
        return K3Config.load(file)
    except (ValueError, TypeError) as e:  # add the path to the config's own message
        raise ValueError(f"invalid checkpoint config {file}: {e}") from None


def _shape_ok(stored: tuple[int, ...], expected: tuple[int, ...], heads: int | None) -> bool:
    """Shapes must match exactly, except A_log (heads = its H; spec section 6): any 1-D length >= H (the release:
    96 heads in [128], zero padded; `_load_entry` checks the padding) or Kimi-Linear's [1, 1, H, 1], in either
    layout."""
    if heads is None:
        return stored == expected
    return (len(stored) == 1 and stored[0] >= heads) or stored == (1, 1, heads, 1)


def _check_match(path: Path, entries: list[Entry], infos: dict[str, TensorInfo], prefix: str,
                 a_log_heads: dict[str, int]) -> None:
    """One error naming every missing, unexpected, mis-shaped or mis-typed tensor (a few names each, and counts).
    a_log_heads: the stored name of every A_log -> its number of heads."""
    expected = {s.name: s for e in entries for s in e.stored}
    missing = [n for n in expected if n not in infos]
    # NOTE: the release also holds the vision tower and projector (outside `language_model.`): a text-only config
    # (prefix `language_model.`) skips them; a config with a vision_config (prefix "") checks every tensor.
    unexpected = [n for n in infos if n not in expected and n.startswith(prefix)]
    bad_shape = [f"{n} {list(infos[n].shape)} (expected "
                 + (f"[L >= {a_log_heads[n]}] or [1, 1, {a_log_heads[n]}, 1])" if n in a_log_heads
                    else f"{list(s.shape)})")
                 for n, s in expected.items() if n in infos
                 and not _shape_ok(infos[n].shape, s.shape, a_log_heads.get(n))]
    bad_dtype = [f"{n} {infos[n].dtype} (expected {'U8' if s.dtype == torch.uint8 else 'a float type'})"
                 for n, s in expected.items() if n in infos
                 and (infos[n].dtype != "U8" if s.dtype == torch.uint8 else infos[n].dtype not in _FLOAT_DTYPES)]
    problems = [(what, items) for what, items in (("missing", missing), ("unexpected", unexpected),
                                                   ("with the wrong shape", bad_shape),
                                                   ("with the wrong dtype", bad_dtype)) if items]
    if problems:
        lines = [f"{len(items)} tensor(s) {what}: " + ", ".join(items[:3]) + (", ..." if len(items) > 3 else "")
                 for what, items in problems]
        raise ValueError(f"checkpoint {path} does not match its config.json:\n  " + "\n  ".join(lines))
    skipped = len(infos) - len(expected)
    if skipped:
        log.info("%s: skipped %d tensors outside %r (the config has no vision_config)", path, skipped, prefix)


def _load_entry(entry: Entry, stored: list[Tensor], target: Tensor) -> None:
    """Copy one entry's checkpoint tensor(s) into the model tensor `target` (stacked for experts)."""
    if entry.how in ("same", "fp32", "vision"):
        target.copy_(stored[0])
    elif entry.how == "a_log":
        (t,) = stored
        H = target.shape[0]
        t = t.reshape(-1)
        if t[H:].any():
            raise ValueError(f"{entry.stored[0].name}: the padding after the {H} heads of the config is not zero; "
                             f"is the checkpoint for a config with more KDA heads?")
        target.copy_(t[:H])
    elif entry.how == "expert":
        target[entry.expert].copy_(stored[0])
    else:
        packed, scales = (t.to(target.device) for t in stored)
        target[entry.expert].copy_(dequantize_mxfp4(unpack_e2m1(packed), scales, target.dtype))


def load_pretrained(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None, qat: bool = False) -> K3ForCausalLM:
    """Build a K3ForCausalLM (a K3ForConditionalGeneration when config.json has a vision_config: text and vision
    from the one index) from a checkpoint directory.

    dtype: the dtype of the model's tensors (default: the checkpoint's, read from its embedding); the fp32-stored
    ones (o_norm, conv weights, dt_bias, A_log, router bias) stay fp32, bit-equal to the file's values. The model is built on the meta device, checked
    against the checkpoint's headers (one error names every missing, unexpected, mis-shaped tensor), allocated on
    `device`, then filled tensor by tensor, shard by shard (MXFP4 experts are dequantised expert by expert).
    qat: the model runs its routed experts fake-quantised (`K3ForCausalLM`'s option, fixed at construction).
    """
    path = Path(path)
    config = _read_config(path)
    infos = read_index(path)
    with torch.device("meta"):
        model = build_model(config, qat=qat)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    entries = _entries(config, shapes)
    a_log_heads = {e.stored[0].name: shapes[e.model_name][0] for e in entries if e.how == "a_log"}
    prefix = K3_PREFIX if is_k3_layout(config) and config.vision_config is None else ""
    _check_match(path, entries, infos, prefix, a_log_heads)
    if dtype is None:
        embed = next(e for e in entries if e.model_name == "model.embed_tokens.weight").stored[0].name
        dtype = _FLOAT_DTYPES[infos[embed].dtype]
    model.cast(dtype)  # the fp32-stored tensors stay fp32
    model.to_empty(device=device)

    targets = model.state_dict()  # share storage with the parameters and buffers
    shard_order = {f: i for i, f in enumerate(dict.fromkeys(i.file for i in infos.values()))}
    filled: set[tuple[str, int | None]] = set()
    with ExitStack() as stack, torch.no_grad():
        handles = {}

        def read(name: str) -> Tensor:
            file = infos[name].file
            if file not in handles:
                handles[file] = stack.enter_context(_open_shard(path / file))
            return handles[file].get_tensor(name)

        for entry in sorted(entries, key=lambda e: shard_order[infos[e.stored[0].name].file]):
            _load_entry(entry, [read(s.name) for s in entry.stored], targets[entry.model_name])
            filled.add((entry.model_name, entry.expert))

    # Nothing may be left as to_empty's garbage: every parameter and buffer (a non-persistent buffer is not in the
    # checkpoint) must have been written, every expert of the stacked ones included.
    needed = {(n, e) for n, t in list(model.named_parameters()) + list(model.named_buffers())
              for e in (range(t.shape[0]) if _outside_name(n)[1] == "expert" else [None])}
    left = sorted(needed - filled, key=str)
    if left:
        raise RuntimeError(f"{len(left)} model tensor(s) were not loaded from {path}, e.g. {left[:3]}")
    return model


# ------------------------------------------------------------------------------------ random init

def config_for_tokenizer(config: K3Config, tokenizer: Tokenizer) -> K3Config:
    """`config` with the vocabulary size and bos/eos/pad ids of `tokenizer` (the model's embedding must hold
    exactly the tokenizer's ids), and for a multimodal config the tokenizer's `<|media_pad|>` id."""
    media = {} if config.vision_config is None else {"media_placeholder_token_id": tokenizer.token_id("<|media_pad|>")}
    return config.replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                          eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id, **media)


def init_checkpoint(config: K3Config, out_dir: str | Path, seed: int, dtype: torch.dtype = torch.float32,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: Tokenizer | None = None) -> K3Config:
    """Randomly initialise a model (`K3ForCausalLM.reset_parameters(seed)`) and save it to `out_dir`; returns its
    config. With `tokenizer`, the config takes the tokenizer's vocabulary and token ids (`config_for_tokenizer`)
    and the tokenizer is saved beside the weights, so the checkpoint can generate.

    The whole model is built in memory (in `dtype`, the fp32-stored tensors in fp32, as `load_pretrained` gives),
    so configs above MAX_INIT_PARAMS parameters are refused."""
    if tokenizer is not None:
        config = config_for_tokenizer(config, tokenizer)
    n = count_params(config)["total_params"]
    if n > MAX_INIT_PARAMS:
        raise ValueError(f"init_checkpoint builds the whole model in memory; this config has {n:.4g} parameters, "
                         f"above the limit of {MAX_INIT_PARAMS:.4g}")
    with torch.device("meta"):
        model = build_model(config)
    model.cast(dtype)
    model.to_empty(device="cpu")
    model.reset_parameters(seed)
    # NOTE: the tokenizer goes into the same atomic write: a run killed in between must not leave weights whose
    # config.json names a tokenizer's vocabulary with no tokenizer beside them.
    save_pretrained(model, out_dir, max_shard_bytes=max_shard_bytes, tokenizer=tokenizer)
    return config


# ----------------------------------------------------------------------------- run directories

def find_checkpoint(path: str | Path) -> Path:
    """The model directory `path` names: a checkpoint (or any model) directory itself, or a run directory, which
    names its latest checkpoint."""
    path = Path(path)
    latest = path / CHECKPOINTS / LATEST
    if latest.is_file():
        return path / CHECKPOINTS / latest.read_text().strip()
    has_weights = (path / INDEX_NAME).is_file() or (path / SINGLE_FILE_NAME).is_file()
    if (path / CONFIG_NAME).is_file() and has_weights:
        return path
    if (path / ARGS_FILE).is_file():
        raise FileNotFoundError(f"run directory {path} has no checkpoint yet ({CHECKPOINTS}/{LATEST})")
    if path.is_dir():
        raise FileNotFoundError(f"{path} is neither a model directory (config.json + safetensors weights) nor a "
                                f"run directory")
    raise FileNotFoundError(f"no model or run directory at {path}")


def load_for_inference(path: str | Path, device: str = "cpu") -> tuple[K3ForCausalLM, Tokenizer, Path]:
    """Model + tokenizer from a checkpoint or run directory. MXFP4-expert models run with their experts fake-quantised
    (MXFP4 weights, exact after loading; MXFP8 inputs), as they were trained and are meant to be served. The model
    comes back in eval mode."""
    model_dir = find_checkpoint(path)
    try:
        tokenizer = Tokenizer.load(model_dir)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}. Copy the model's tokenizer into {model_dir}, or write a new checkpoint that "
                                f"has one with `openk3 init --tokenizer PATH|bpe`") from None
    model = load_pretrained(model_dir, device=device, qat=_read_config(model_dir).mxfp4_experts).eval()
    return model, tokenizer, model_dir
