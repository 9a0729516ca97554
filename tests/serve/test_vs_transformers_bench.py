"""bench/vs_transformers_decode.py runs end to end on the CPU at test size and writes every part into its JSON; with
transformers installed (the `bench` extra), on a Kimi-Linear config both engines load the same checkpoint and
agree on the greedy tokens."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.serve.test_cache import small_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from vs_transformers_decode import main  # noqa: E402

SMALL = ["--device", "cpu", "--quick", "--batch-sizes", "1", "3", "--prompt-len", "12", "--decode-tokens", "6",
         "--prefill-lengths", "40", "--ttft-len", "80", "--page-size", "8", "--draft-k", "2"]


def test_bench_smoke_on_cpu_writes_every_part(tmp_path):
    out = tmp_path / "r.json"
    main(["--config", "tiny", "--skip-transformers", "--out", str(out), *SMALL])
    data = json.loads(out.read_text())
    assert set(data) >= {"hardware", "decode", "prefill", "prefix_hit_ttft", "speculative", "memory", "router"}
    assert data["decode"]["3"]["generated_tokens"] == 18 and data["decode"]["1"]["openk3_tokens_per_s"] > 0
    assert data["prefix_hit_ttft"]["cached_tokens"] > 0 and data["prefix_hit_ttft"]["same_first_token"]
    assert data["speculative"]["k=2"]["greedy_output_equal"]
    assert data["memory"]["max_batch_32k"] > 0
    main(["--config", "tiny", "--skip-transformers", "--out", str(out), "--parts", "memory", *SMALL])
    again = json.loads(out.read_text())
    assert again["decode"] == data["decode"]  # a run of other parts keeps the earlier run's parts


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers (the bench extra) is absent")
def test_bench_against_transformers_on_a_small_kimi_linear(tmp_path):
    config = tmp_path / "config.json"
    small_config("kimi-linear").save(config)
    out = tmp_path / "r.json"
    main(["--config", str(config), "--out", str(out), "--parts", "decode,prefill", *SMALL])
    data = json.loads(out.read_text())
    for B, row in data["decode"].items():
        assert row["transformers_tokens_per_s"] > 0
        assert row["greedy_tokens_agreeing_with_transformers"] == [6] * int(B)  # fp32: the same greedy tokens
    assert data["prefill"]["40"]["transformers_seconds"] > 0


def test_bench_rejects_unknown_parts():
    with pytest.raises(SystemExit, match="bogus"):
        main(["--parts", "decode,bogus", "--device", "cpu"])
