"""Run fla's Triton kernels with one fixed launch config each instead of autotuning them.

fla autotunes a kernel on first use by compiling every candidate config (12 to 36 per KDA kernel) one after
another. On the H200 that took longer than a device call may run: after 5.5 minutes, the first k3-1b step was
still compiling candidates for its first backward. A tuned-config cache would fix it, but it is lost with each
fresh machine.

`fix_fla_configs()` keeps, for every autotuned kernel fla has loaded, at most three candidates (`pick`), so the
autotuner compiles three instead of up to 36. Keeping one is not enough: on the H200 the candidate nearest to
4 warps / 2 stages of one backward kernel needed 240 KB of shared memory (limit 227 KB); Triton's autotuner
skips a candidate that does not fit. Kernels that prune their candidates at run time (`early_config_prune`) keep
them all. Speeds measured this way are lightly tuned fla: a lower bound on fully tuned fla.

A candidate whose launch fails with CUDA "out of memory" is skipped too (`skip_launch_oom`): on the H200, with 17
processes sharing the GPU, one candidate of `chunk_kda_bwd_kernel_dAv` failed to launch that way while it was being
timed, and Triton's autotuner, which skips only candidates that fail to compile or do not fit, let the error end the
run.
"""

from __future__ import annotations

import importlib
import math
import sys


def pick(configs: list) -> list:
    """Up to three candidates: the one nearest to 4 warps then 2 stages, the smallest (fewest stages, then
    smallest block sizes, then fewest warps: the most likely to fit in shared memory), and the first listed."""
    order = list(enumerate(configs))
    mid = min(order, key=lambda ic: (abs(math.log2(ic[1].num_warps) - 2), abs(ic[1].num_stages - 2), ic[0]))
    small = min(order, key=lambda ic: (ic[1].num_stages, math.prod(v for v in ic[1].kwargs.values()
                                                                   if isinstance(v, int)), ic[1].num_warps, ic[0]))
    keep = sorted({mid[0], small[0], 0})
    return [configs[i] for i in keep]


def fix_fla_configs(modules: tuple[str, ...] = ("fla.ops.kda",)) -> int:
    """Import `modules`, then cut each autotuned fla kernel loaded so far to `pick`'s candidates. Returns how many
    kernels changed."""
    from triton.runtime.autotuner import Autotuner
    for name in modules:
        importlib.import_module(name)
    changed = 0
    seen: set[int] = set()
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("fla.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            while obj is not None and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
                obj = obj.fn  # unwrap @triton.heuristics and friends
            if not isinstance(obj, Autotuner) or id(obj) in seen:
                continue
            seen.add(id(obj))
            obj._bench = skip_launch_oom(obj._bench)
            if len(obj.configs) > 3 and obj.early_config_prune is None:
                obj.configs = pick(obj.configs)
                changed += 1
    return changed


def skip_launch_oom(bench):
    """Wrap an autotuner's `_bench` so a candidate that fails to launch with CUDA "out of memory" times as
    infinitely slow (how Triton treats a candidate that does not fit), instead of ending the run."""
    def timed(*args, **kwargs):
        try:
            return bench(*args, **kwargs)
        except RuntimeError as e:
            if "out of memory" not in str(e):
                raise
            print(f"fla_fixed: skipped a candidate that failed to launch ({e})", file=sys.stderr, flush=True)
            return [float("inf")] * 3
    return timed


if __name__ == "__main__":
    print(f"{fix_fla_configs()} fla kernels now have at most three candidate configs")
