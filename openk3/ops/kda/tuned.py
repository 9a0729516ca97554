"""Kernel configs for fla, tuned once and shipped, so the first training step on a fresh GPU does not autotune.

fla autotunes each Triton kernel on its first call per shape key, trying every candidate config; on a fresh H200
that made the first k3-1b step take 288 s (docs/training.md). fla 0.6 can instead read the chosen config of each
kernel from `$FLA_CONFIG_DIR/{kernel}.json` (`fla.ops.utils.cache`, mode from `FLA_CACHE_MODE`). openk3 ships such
files per GPU model under `fla_configs/<GPU name>/`, written by `dump_fla_configs` after a tuned run
(bench/vs_transformers.py --dump-fla-configs), and points fla at them before fla is first imported.

Lookup mode "strict": a kernel takes a shipped config only for exactly the key it was tuned at (fla's keys hold
head counts, head dims, flags and dtypes, in a few kernels the batch size, never the sequence length, so one file
covers every length of a model shape); any other key autotunes as before. "fuzzy" would hand a config tuned at head dim 128 to a kernel at
64, whose shared memory needs differ. A user's own FLA_CONFIG_DIR / FLA_CACHE_MODE always win.

What is shipped (fla_configs/NVIDIA_H200/): the 14 KDA kernels of `kimi-linear-1.5b` training (16 heads x 128,
bf16), each the best of three candidates (bench/fla_fixed.py), dumped by bench/vs_transformers.py on the H200.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import sys
from pathlib import Path

SHIPPED = Path(__file__).parent / "fla_configs"


def gpu_dir_name(device_name: str) -> str:
    """fla's directory name for a GPU model ("NVIDIA H200" -> "NVIDIA_H200"), as `fla.ops.utils.cache` makes it."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def use_shipped_fla_configs(device_name: str) -> Path | None:
    """Point fla at openk3's shipped configs for this GPU model; call before fla is first imported (fla reads the
    variables at import). Returns the directory used, or None (no configs for this GPU, the user set their own,
    or fla was already imported)."""
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ or "fla" in sys.modules:
        return None
    d = SHIPPED / gpu_dir_name(device_name)
    if not d.is_dir() or not any(d.glob("*.json")):
        return None
    os.environ["FLA_CONFIG_DIR"] = str(d)
    os.environ["FLA_CACHE_MODE"] = "strict"
    return d


def _key_hash(key) -> str:
    """fla's `AutotuneKey.key_hash`: md5 of the key as compact, sorted JSON."""
    return hashlib.md5(json.dumps(_plain(key), separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _config_dict(cfg) -> dict:
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "num_ctas": getattr(cfg, "num_ctas", 1), "maxnreg": getattr(cfg, "maxnreg", None)}


def _autotuners() -> dict[str, object]:
    """Every fla kernel autotuner (fla's `CachedAutotuner`, which reads config files) that has tuned something in
    this process, by kernel name."""
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for obj in list(vars(module).values()):
            for _ in range(4):  # @triton.heuristics wraps the autotuner: walk `.fn` down to it
                if hasattr(obj, "kernel_name") and isinstance(getattr(obj, "cache", None), dict):
                    if obj.cache:
                        found[obj.kernel_name] = obj
                    break
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break
    return found


def dump_fla_configs(out_dir: str | Path, triton_version: str) -> list[str]:
    """Write `{kernel}.json` for every fla kernel tuned in this process (fla 0.6's config-file format: one entry
    per shape key, plus the most chosen config as `default_config`). Returns the kernel names written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for kernel, tuner in sorted(_autotuners().items()):
        entries = {_key_hash(key): {"autotune_key": _plain(key), "config": _config_dict(cfg)}
                   for key, cfg in tuner.cache.items()}
        common = collections.Counter(json.dumps(e["config"], sort_keys=True) for e in entries.values())
        data = {"kernel_name": kernel, "triton_version": triton_version, "autotune_entries": entries,
                "default_config": json.loads(common.most_common(1)[0][0])}
        tmp = out / f".{kernel}.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(out / f"{kernel}.json")
        written.append(kernel)
    return written
