"""Benchmark of the XTML output parser (openk3/text/chat.py) on adversarial model output; prints a table and
writes bench/results/chat_parser.json.

    python bench/chat_parser.py

Inputs that make a backtracking parser quadratic (K3_SPEC.md section 9: regexes with lazy groups over model
output): thousands of call headers that never close, thousands of argument opens without a value close, a long
run of `<|` that never becomes a marker, and well-formed calls, each parsed whole and streamed in 7-character
chunks. A linear parser's time per character stays flat as the length grows.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openk3.text.chat import OutputParser, parse_output  # noqa: E402

SHAPES = {
    "unclosed call headers": '<|open|>call tool="f" index="1"<|sep|>',
    "unclosed arguments": '<|open|>argument key="k" type="string"<|sep|>value ',
    "headers without sep": '<|open|>call tool="f" index="1" ',
    "almost-markers": "<|<|clo ",
    "closed calls": ('<|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="number"<|sep|>1'
                     '<|close|>argument<|sep|><|close|>call<|sep|>'),
}
PREFIX = "<|close|>think<|sep|><|open|>tools<|sep|>"


def best_of(fn, repeats=3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def streamed(text: str, size: int = 7) -> None:
    parser = OutputParser()
    for i in range(0, len(text), size):
        parser.feed(text[i:i + size])
    parser.finish()


def main() -> None:
    rows = []
    print(f"{'shape':24} {'repeats':>8} {'chars':>9} {'whole s':>9} {'ns/char':>8} {'stream7 s':>10} {'ns/char':>8}")
    for name, unit in SHAPES.items():
        for n in (1_000, 4_000, 16_000):
            text = PREFIX + unit * n
            whole = best_of(lambda: parse_output(text))
            stream = best_of(lambda: streamed(text), repeats=1)
            rows.append({"shape": name, "repeats": n, "chars": len(text), "whole_s": whole, "stream7_s": stream,
                         "whole_ns_per_char": whole / len(text) * 1e9, "stream7_ns_per_char": stream / len(text) * 1e9})
            r = rows[-1]
            print(f"{name:24} {n:8d} {len(text):9d} {whole:9.4f} {r['whole_ns_per_char']:8.0f} {stream:10.4f} "
                  f"{r['stream7_ns_per_char']:8.0f}")
    # linear: 4x the length costs ~4x (the 1,000-repeat inputs fit in cache and run faster per character)
    ratios = {name: next(r["whole_s"] for r in rows if r["shape"] == name and r["repeats"] == 16_000)
              / next(r["whole_s"] for r in rows if r["shape"] == name and r["repeats"] == 4_000) for name in SHAPES}
    print("whole-parse time(16,000 repeats) / time(4,000 repeats), linear = 4:",
          {k: round(v, 1) for k, v in ratios.items()})
    out = Path(__file__).resolve().parent / "results" / "chat_parser.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"hardware": {"cpu": platform.processor() or platform.machine(),
                                            "cores": os.cpu_count(), "python": platform.python_version()},
                               "rows": rows, "ratio_16000_over_4000": ratios}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
