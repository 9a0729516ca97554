"""bench/vs_transformers_decode.py runs end to end on the CPU at test size and writes every part into its JSON; with
transformers installed (the `bench` extra), on a Kimi-Linear config both engines load the same checkpoint and
agree on the greedy tokens; the speculative part trains its target and draft and keeps fp32 greedy outputs equal."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.serve.test_cache import small_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from vs_transformers_decode import main  # noqa: E402

SMALL = ["--device", "cpu", "--quick", "--batch-sizes", "1", "3", "--prompt-len", "12", "--decode-tokens", "6",
         "--prefill-lengths", "40", "--ttft-len", "80", "--page-size", "8", "--draft-k", "2",
         "--spec-train-steps", "2", "--spec-corpus-mb", "0.2"]


def test_bench_smoke_on_cpu_writes_every_part(tmp_path):
    out = tmp_path / "r.json"
    main(["--config", "tiny", "--skip-transformers", "--out", str(out), *SMALL])
    data = json.loads(out.read_text())
    assert set(data) >= {"hardware", "decode", "prefill", "prefix_hit_ttft", "speculative", "memory", "router"}
    assert data["decode"]["3"]["generated_tokens"] == 18 and data["decode"]["1"]["openk3_tokens_per_s"] > 0
    for row in data["decode"].values():  # the reported run is the median of the timed runs (3 by default)
        rates = sorted(r["tokens_per_s"] for r in row["openk3_runs"])
        assert len(rates) == 3 and row["openk3_tokens_per_s"] == rates[1]
    for row in data["decode"].values():  # the prefill + the 5 steps after it lie within the timed run
        split = row["openk3_ttft_s"] + 5 * row["openk3_decode_ms_per_step"] / 1e3
        assert row["openk3_ttft_s"] > 0 and row["openk3_decode_ms_per_step"] > 0 and split <= row["openk3_seconds"]
    assert data["prefix_hit_ttft"]["cached_tokens"] > 0 and data["prefix_hit_ttft"]["same_first_token"]
    split = data["prefix_hit_ttft"]["hit_host_split"]  # one hit turn: one lookup, one restore, one forward in its step
    assert split["prefix_lookup"]["calls"] == split["prefix_use"]["calls"] == split["forward"]["calls"] == 1
    assert 0 < split["model_forward"]["ms"] < split["forward"]["ms"] < split["step"]["ms"]
    assert data["speculative"]["k=2"]["greedy_output_equal"]
    assert data["memory"]["max_batch_32k"] > 0
    main(["--config", "tiny", "--skip-transformers", "--out", str(out), "--parts", "memory", *SMALL])
    again = json.loads(out.read_text())
    assert again["decode"] == data["decode"]  # a run of other parts keeps the earlier run's parts
    with pytest.raises(SystemExit, match="--decode-runs 0"):
        main(["--config", "tiny", "--skip-transformers", "--out", str(out), *SMALL, "--decode-runs", "0"])


@pytest.mark.slow  # 25-40 s on 2 cores: two trainings of 40 steps
@pytest.mark.parametrize("labels", ["corpus", "target"])
def test_speculative_part_trains_a_draft_and_keeps_the_greedy_output_in_fp32(tmp_path, labels):
    """--quick's speculative part on the CPU: both models train (their loss falls), the draft is a small model of its
    own, and every greedy output with a draft, trained or early exit, equals the plain engine's in fp32; the draft
    trained on the corpus's labels or distilled from the target's greedy tokens (`--spec-draft-labels`)."""
    out = tmp_path / "r.json"
    main(["--config", "tiny", "--device", "cpu", "--quick", "--skip-transformers", "--parts", "speculative",
          "--draft-k", "2", "3", "--spec-draft-labels", labels, "--out", str(out)])
    sp = json.loads(out.read_text())["speculative"]
    for model in ("target", "draft"):
        assert sp[f"{model}_steps"] == 40 and sp[f"{model}_train_seconds"] > 0
        assert sp[f"{model}_train_loss"] < sp[f"{model}_first_loss"] - 0.5  # it learned something (its labels)
        assert sp[f"{model}_held_out_loss"] > 0
    # the held-out loss is the corpus's: a distilled draft learns the target's tokens, not the text
    assert sp["target_held_out_loss"] < sp["target_first_loss"]
    assert (sp["draft_held_out_loss"] < sp["draft_first_loss"]) == (labels == "corpus")
    assert ("target's greedy tokens" in sp["draft"]) == (labels == "target")
    assert 0 < sp["draft_params"] < sp["target_params"] / 4 and sp["prompts"] == 2
    assert sp["baseline_tokens_per_s"] > 0 and sp["baseline_decode_path"] == "general"
    for rows in (sp, sp["early_exit"]):
        for k in (2, 3):
            row = rows[f"k={k}"]
            assert 0 <= row["acceptance_rate"] <= 1 and row["tokens_per_s"] > 0 and row["speedup"] > 0
            # one round drafts k tokens and keeps the accepted ones plus the target's own: counted apart, they agree
            assert row["tokens_per_round"] == pytest.approx(1 + k * row["acceptance_rate"])
            assert row["greedy_output_equal"], (rows["draft"], k)
    # drafts both accepted and rejected: the rollback ran, and the outputs still equal the plain engine's. NOTE: not
    # asked of each draft: after --quick's 40 steps the early exit (3 of the tiny target's 6 layers) agreed with the
    # target on no token on one machine (0.0 at k = 2 and 3, the trained draft 64% and 58%) and on some on another.
    # The distilled draft learns the quick target's loop of newlines (100% accepted on this CPU): only that it learned.
    if labels == "corpus":
        assert 0 < sp["k=2"]["acceptance_rate"] < 1
    else:
        assert sp["k=2"]["acceptance_rate"] > 0.5


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
    with pytest.raises(SystemExit, match="--decode-tokens 1"):  # no step after the prefill to time
        main(["--decode-tokens", "1", "--device", "cpu"])
