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

What is shipped (fla_configs/NVIDIA_H200/): the KDA kernels of `kimi-linear-1.5b` training (16 heads x 128, bf16),
each the best of three candidates (`limit_fla_autotuning`), and the short conv's two kernels and the gate's backward
tuned over every candidate (OPENK3_FLA_AUTOTUNE=full; the three-candidate pick of the conv kernels was all BD=16,
the full tune chose BD=32, 3 stages), dumped by bench/vs_transformers.py on the H200.

Every key without a shipped config autotunes, but over at most three candidates (`limit_fla_autotuning`, on by
default; OPENK3_FLA_AUTOTUNE=full keeps every candidate): fla compiles each candidate (12 to 36 per KDA kernel)
one after another, which made a fresh H200 spend minutes before the first k3-1b step (more than a 10-minute device
call at full candidates); with three, the first `kimi-linear-1.5b` step took 45 s. The kernels it picks are
lightly tuned, so a user after the last few percent sets OPENK3_FLA_AUTOTUNE=full once and keeps Triton's cache.
"""

from __future__ import annotations

import collections
import hashlib
import importlib
import json
import math
import os
import re
import sys
from pathlib import Path

SHIPPED = Path(__file__).parent / "fla_configs"
AUTOTUNE_ENV = "OPENK3_FLA_AUTOTUNE"
# the fla modules whose kernels openk3 runs (ops/kda/backend.py, ops/kda/fused.py)
FLA_MODULES = ("fla.ops.kda", "fla.modules.causal_conv1d", "fla.modules.norm.fused_norm_gate",
               "fla.modules.activations", "fla.modules.norm.l2norm", "fla.modules.norm.layernorm")


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
    return {t.kernel_name: t for t in _every_autotuner()
            if hasattr(t, "kernel_name") and isinstance(getattr(t, "cache", None), dict) and t.cache}


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


# ------------------------------------------------------------------------------------------ fewer candidates

def autotune_candidates() -> int | None:
    """How many candidate configs each fla kernel may autotune over: 3, or None (all) with OPENK3_FLA_AUTOTUNE=full.
    Unset or empty is the default, as for openk3's other environment variables (ops/kda/backend.py)."""
    value = os.environ.get(AUTOTUNE_ENV, "").strip().lower() or "3"
    if value == "full":
        return None
    if value != "3":
        raise ValueError(f"{AUTOTUNE_ENV}={value!r}: expected 3 (the default) or full")
    return 3


def pick(configs: list) -> list:
    """Up to three candidates: the one nearest to 4 warps then 2 stages, the smallest (fewest stages, then smallest
    block sizes, then fewest warps: the most likely to fit in shared memory), and the first listed. NOTE: one is
    not enough: on the H200 the candidate nearest to 4 warps / 2 stages of one backward kernel needed 240 KB of
    shared memory (limit 227 KB), and Triton's autotuner skips a candidate that does not fit."""
    order = list(enumerate(configs))
    mid = min(order, key=lambda ic: (abs(math.log2(ic[1].num_warps) - 2), abs(ic[1].num_stages - 2), ic[0]))
    small = min(order, key=lambda ic: (ic[1].num_stages, math.prod(v for v in ic[1].kwargs.values()
                                                                   if isinstance(v, int)), ic[1].num_warps, ic[0]))
    return [configs[i] for i in sorted({mid[0], small[0], 0})]


def limit_fla_autotuning(modules: tuple[str, ...] = FLA_MODULES) -> int:
    """Import `modules`, then cut every autotuned fla kernel loaded so far to `pick`'s candidates (unless
    OPENK3_FLA_AUTOTUNE=full) and make a candidate whose launch fails with CUDA "out of memory" time as infinitely
    slow instead of ending the run. Kernels that prune their candidates at run time (`early_config_prune`) keep
    them all. Safe to call again after more fla modules were loaded (transformers' model loads its own). Returns
    how many kernels were cut."""
    keep = autotune_candidates()
    for name in modules:
        importlib.import_module(name)
    cut = 0
    for tuner in _every_autotuner():
        if getattr(tuner, "_openk3_limited", False):
            continue
        tuner._openk3_limited = True
        tuner._bench = skip_launch_oom(tuner._bench)
        if keep is not None and len(tuner.configs) > keep and tuner.early_config_prune is None:
            tuner.configs = pick(tuner.configs)
            cut += 1
    return cut


def skip_launch_oom(bench):
    """Wrap an autotuner's `_bench` so that a candidate failing to launch with CUDA "out of memory" times as
    infinitely slow (how Triton treats one that does not fit) instead of ending the run: seen on the H200 with
    17 processes sharing the GPU, in `chunk_kda_bwd_kernel_dAv`."""
    def timed(*args, **kwargs):
        try:
            return bench(*args, **kwargs)
        except RuntimeError as e:
            if "out of memory" not in str(e):
                raise
            print(f"openk3: skipped an fla autotune candidate that failed to launch ({e})", file=sys.stderr,
                  flush=True)
            return [float("inf")] * 3
    return timed


def _every_autotuner() -> list:
    """Every Triton autotuner object in the loaded fla modules (duck-typed: it has `configs`, `_bench` and
    `early_config_prune`), each once; `@triton.heuristics` wrappers are walked down through `.fn`."""
    found, seen = [], set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for obj in list(vars(module).values()):
            for _ in range(4):
                if obj is None:
                    break
                if all(hasattr(obj, a) for a in ("configs", "_bench", "early_config_prune")):
                    if id(obj) not in seen:
                        seen.add(id(obj))
                        found.append(obj)
                    break
                obj = getattr(obj, "fn", None)
    return found
