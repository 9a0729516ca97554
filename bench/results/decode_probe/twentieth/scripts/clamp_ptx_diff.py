"""Twentieth session, on the CPU machine: what the gather's index clamp (ops/mla_decode.py) changes in the split
kernel's sm_90 code. Compiles the working tree's kernel and a copy without the clamp, for the gate's fp32 shapes
and kimi-linear-1.5b's bf16 ones, and lists the PTX instructions that differ (register names ignored).

    PYTHONPATH=<triton 3.6 site> python bench/results/decode_probe/twentieth/scripts/clamp_ptx_diff.py
"""
import difflib
import importlib.util
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[5]
CLAMPED = "tl.gather(split_pages, tl.minimum(n // PAGE - first, BLOCK_P - 1), 0)"
BARE = "tl.gather(split_pages, n // PAGE - first, 0)"


def module(source: str, name: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_ptx(mod, dt, T, H, R, PE, PAGE, S, KEYS, SPLITS, BLOCK_P):
    kernel = mod._split_kernel
    cons = dict(T=T, H=H, R=R, PE=PE, PAGE=PAGE, S=S, KEYS=KEYS, SPLITS=SPLITS, stride_qm=R + PE, stride_po=R + PE,
                BLOCK_M=16, BLOCK_N=32, BLOCK_R=max(16, triton.next_power_of_2(R)),
                BLOCK_PE=max(16, triton.next_power_of_2(PE)), BLOCK_P=BLOCK_P, UPCAST=False, NUM_STAGES=3)
    types = {"q_ptr": f"*{dt}", "pages_ptr": f"*{dt}", "table_ptr": "*i64", "visible_ptr": "*i64", "o_ptr": f"*{dt}",
             "part_ptr": "*fp32", "ml_ptr": "*fp32", "scale": "fp32"}
    sig = {n: "constexpr" if n in cons else types.get(n, "i32") for n in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=cons), target=GPUTarget("cuda", 90, 32))
    return compiled.asm["ptx"], compiled.metadata.shared


def instructions(ptx: str) -> list[str]:
    out = []
    for line in ptx.splitlines():
        line = line.strip()
        if line and not line.startswith(("//", ".loc", ".file", "$L__", ".section", ".b8", ".b32", ".b64")):
            out.append(re.sub(r"\$L__\w+", "L", re.sub(r"%[a-z]+\d+", "%R", line)))
    return out


def main() -> None:
    source = (ROOT / "openk3/ops/mla_decode.py").read_text()
    if CLAMPED not in source:
        sys.exit("the working tree's kernel has no clamp to compare")
    clamped, bare = module(source, "clamped"), module(source.replace(CLAMPED, BARE), "bare")
    print("triton", triton.__version__)
    for case in [("fp32", 1, 2, 16, 8, 6, 48, 32, 2, 8), ("fp32", 2, 2, 16, 8, 3, 48, 32, 2, 16),
                 ("bf16", 1, 16, 512, 64, 64, 1024, 256, 4, 8), ("bf16", 4, 16, 512, 64, 64, 1024, 256, 4, 8),
                 ("bf16", 1, 16, 512, 64, 16, 1024, 256, 4, 32)]:
        (pa, sa), (pb, sb) = compile_ptx(bare, *case), compile_ptx(clamped, *case)
        diff = [line for line in difflib.unified_diff(instructions(pa), instructions(pb), lineterm="", n=0)
                if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        ops = Counter(line[0] + line[1:].split()[0] for line in diff)
        print(f"{case}: shared {sa} -> {sb} bytes, {len(diff)} differing lines: {dict(sorted(ops.items()))}")


if __name__ == "__main__":
    main()
