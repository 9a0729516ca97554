"""The training loop, its run directory, exact resume, and the generate / eval commands.

Runs use a model smaller than `tiny` (3 layers: 2 KDA + 1 MLA, AttnRes, LatentMoE with 4 experts, MXFP4 experts)
on six small stdlib files, a 300-token BPE and 2 x 32-token batches, so each run takes well under a second.
"""

import json
import math
import re
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from openk3 import cli
from openk3.config import K3Config, tiny
from openk3.model import GatedMLA, K3ForCausalLM
from openk3.model.checkpoint import load_for_inference
from openk3.text.tokenizer import Tokenizer
from openk3.train import balance
from openk3.train.data import load_corpus, split_train_val, tokenize_corpus
from openk3.train.trainer import (METRIC_KEYS, MLAMaxLogits, RouterBalancer, RowStreams, TrainArgs, TrainResult,
                                  check_args, evaluate, generate, parse_seq_len_schedule, resolve_train_args,
                                  seq_len_at, train)

STDLIB_FILES = ["bisect.py", "colorsys.py", "keyword.py", "this.py", "fnmatch.py", "glob.py"]


def small_config() -> K3Config:
    return tiny().replace(
        hidden_size=64, num_hidden_layers=3, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        linear_attn_config={"num_heads": 2, "head_dim": 16, "kda_layers": [1, 2], "full_attn_layers": [3]},
        num_experts=4, moe_intermediate_size=32, routed_expert_hidden_size=32)


@pytest.fixture(scope="module", autouse=True)
def keep_torch_threads():
    """train() sets torch's thread count (--threads); give the other test modules theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_workdir(root: Path) -> Path:
    """`root` with corpus/ (a few stdlib files) and config.json (`small_config`): what the training tests run on."""
    corpus = root / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_FILES:
        shutil.copy(stdlib / name, corpus / name)
    small_config().save(root / "config.json")
    return root


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return make_workdir(tmp_path_factory.mktemp("train"))


def args_for(workdir: Path, out: str, **changes) -> TrainArgs:
    settings = dict(config=str(workdir / "config.json"), data=str(workdir / "corpus"), vocab_size=300, steps=8,
                    batch_size=2, seq_len=32, log_every=1, eval_every=4, eval_tokens=256, ckpt_every=3,
                    sample=False, progress=False, val_fraction=0.3, out=str(workdir / out))
    settings.update(changes)
    return TrainArgs(**settings)


@pytest.fixture(scope="module")
def finished(workdir) -> TrainResult:
    """One 6-step run, checkpointed every 2 steps with the last 2 kept, with the final sample."""
    return train(args_for(workdir, "run", steps=6, ckpt_every=2, keep_last=2, eval_every=3, sample=True,
                          sample_prompt="def ", sample_tokens=8))


@pytest.fixture(scope="module")
def finished_run(finished) -> Path:
    return finished.run_dir


# ------------------------------------------------------------------------------------------- run directory

def test_run_directory_contents(finished):
    run = finished.run_dir
    for name in ("train_args.json", "config.json", "tokenizer/tokenizer.json", "metrics.jsonl"):
        assert (run / name).is_file(), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    config = K3Config.load(run / "config.json")
    for r in records:
        assert set(METRIC_KEYS) <= set(r), set(METRIC_KEYS) - set(r)
        assert list(r["expert_load_max_over_mean"]) == ["1", "2"]  # layer 0 is dense (first_k_dense_replace=1)
        assert {i: len(l) for i, l in r["expert_load"].items()} == {"1": 4, "2": 4}
        for i, load in r["expert_load"].items():
            assert abs(sum(load) - 4) < 1e-3 and r["expert_load_max_over_mean"][i] == pytest.approx(max(load), abs=1e-3)
        # layer 0 mixes once (before its FFN), the others twice, plus the output mix
        assert list(r["attnres"]) == ["0.mlp", "1.attn", "1.mlp", "2.attn", "2.mlp", "output"]
        assert all(abs(sum(w) - 1) < 1e-3 for w in r["attnres"].values())
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert all(math.isfinite(r["val_bpb"]) for r in records if "val_bpb" in r)
    assert finished.final_eval["loss"] == records[-1]["val_loss"] and finished.losses == [r["loss"] for r in records]
    assert finished.sample.startswith("def ") and len(finished.sample) > len("def ")
    assert config.vocab_size == Tokenizer.load(run / "tokenizer").vocab_size

    for plot in ("loss.png", "expert_load.png", "attnres.png"):
        data = (run / "plots" / plot).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", plot

    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_000004", "step_000006"]  # step_000002 pruned by keep_last=2
    assert (run / "checkpoints/latest").read_text().strip() == "step_000006"
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "train_args.json",
                 "trainer_state.pt"):
        assert (run / "checkpoints/step_000006" / name).is_file(), name


def test_refuses_to_overwrite_or_change_a_run(finished_run, workdir):
    with pytest.raises(ValueError, match="--resume"):
        train(args_for(workdir, "run", steps=6))
    with pytest.raises(ValueError, match="--lr"):
        resolve_train_args({"out": str(finished_run), "lr": 1.0}, resume=True)
    with pytest.raises(ValueError, match="--out"):
        resolve_train_args({"lr": 1.0}, resume=True)
    more = resolve_train_args({"out": str(finished_run), "steps": 20}, resume=True)
    assert more.steps == 20 and more.vocab_size == 300


# ---------------------------------------------------------------------------------------------- resume

def test_resume_is_exact(workdir):
    """8 steps in one go == `openk3 train --stop-at 5` ('killed' after step 5), then `--resume` for 3: the same
    losses and the same final weights. QK-Clip is on, so the clipped weights and the router biases must both come
    back exactly."""
    full = train(args_for(workdir, "full", qk_clip=5.0))
    split = args_for(workdir, "split", qk_clip=5.0)
    argv = ["train", "--no-progress", "--no-sample"]
    for name in ("config", "data", "vocab_size", "steps", "batch_size", "seq_len", "log_every", "eval_every",
                 "eval_tokens", "ckpt_every", "val_fraction", "qk_clip", "out"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(split, name))]
    cli.main(argv + ["--stop-at", "5"])
    assert (workdir / "split/checkpoints/latest").read_text().strip() == "step_000005"
    cli.main(["train", "--out", split.out, "--resume", "--no-progress"])

    def metric_losses(run):
        return [json.loads(l)["loss"] for l in (workdir / run / "metrics.jsonl").read_text().splitlines()]

    assert metric_losses("split") == metric_losses("full") == full.losses
    a = torch.load(workdir / "full/checkpoints/step_000008/trainer_state.pt", weights_only=True)["model"]
    b = torch.load(workdir / "split/checkpoints/step_000008/trainer_state.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("e_score_correction_bias") and a[k].abs().sum() > 0 for k in a)


def test_loss_decreases(workdir):
    """30 steps: the validation loss (the same held-out tokens every step) falls by more than a nat."""
    result = train(args_for(workdir, "learn", steps=30, batch_size=4, lr=1e-2, eval_every=1, ckpt_every=30))
    val = [json.loads(l)["val_loss"] for l in (workdir / "learn/metrics.jsonl").read_text().splitlines()]
    assert len(val) == 30 and val[-1] < val[0] - 1.0, val
    assert sum(result.losses[-10:]) / 10 < result.losses[0] - 1.0, result.losses


# ------------------------------------------------------------------------------------------- QAT + release

def test_qat_model_reloads_with_identical_logits(finished_run):
    """The release-format checkpoint of a QAT run (MXFP4 experts) gives the same logits as the fp32 master weights
    run with fake quantisation; without fake quantisation the masters differ (the check can fail)."""
    ckpt = finished_run / "checkpoints/step_000006"
    loaded, tokenizer, _ = load_for_inference(finished_run)
    weights = torch.load(ckpt / "trainer_state.pt", weights_only=True)["model"]
    master, plain = K3ForCausalLM(loaded.config, qat=True), K3ForCausalLM(loaded.config, qat=False)
    master.load_state_dict(weights)
    plain.load_state_dict(weights)
    ids = torch.tensor([tokenizer.encode("def fnmatch(name, pat):\n    return name")])
    assert loaded.qat and not loaded.training
    assert torch.equal(loaded(ids).logits, master(ids).logits)
    assert not torch.equal(loaded(ids).logits, plain(ids).logits)


# -------------------------------------------------------------------------------------- generate and eval

def test_generate_cli_matches_greedy_full_forward(finished_run, capsys):
    cli.main(["generate", "--model", str(finished_run), "--prompt", "def ", "--max-tokens", "6",
              "--temperature", "0", "--json"])
    out = json.loads(capsys.readouterr().out)
    model, tokenizer, _ = load_for_inference(finished_run)
    ids = [tokenizer.bos_id] + tokenizer.encode("def ")
    expected = []
    with torch.no_grad():  # greedy decoding without a cache: the whole sequence every time
        for _ in range(6):
            token = int(model(torch.tensor([ids + expected])).logits[0, -1].argmax())
            if token == tokenizer.eos_id:
                break
            expected.append(token)
    assert out["token_ids"] == expected
    assert out["text"] == tokenizer.decode(expected)


def test_generate_sampling_is_seeded(finished_run):
    model, tokenizer, _ = load_for_inference(finished_run)
    a = generate(model, tokenizer, "import ", max_tokens=10, temperature=1.0, top_k=20, seed=3)
    b = generate(model, tokenizer, "import ", max_tokens=10, temperature=1.0, top_k=20, seed=3)
    assert a == b and 0 < len(a) <= 10


def test_eval_cli_scores_every_held_out_byte(finished_run, workdir, capsys):
    cli.main(["eval", "--model", str(finished_run / "checkpoints/step_000006"), "--json", "--seq-len", "48",
              "--max-tokens", "0"])
    out = json.loads(capsys.readouterr().out)
    _, val_docs = split_train_val(load_corpus(workdir / "corpus"), 0.3, seed=0)
    model, tokenizer, _ = load_for_inference(finished_run)
    n_tokens = sum(len(tokenizer.encode(d.text)) + 2 for d in val_docs)
    # every token but the first document's BOS is a target except the next documents' BOS: N - D targets
    assert out["tokens"] == n_tokens - len(val_docs)
    assert out["bytes"] == sum(len(d.text.encode()) for d in val_docs)
    assert math.isclose(out["bpb"], out["loss"] * out["tokens"] / math.log(2) / out["bytes"], rel_tol=1e-9)
    # packing with another row length changes only the context at row starts: close, not equal
    other = evaluate(model, tokenize_corpus(val_docs, tokenizer), tokenizer, batch_size=3, seq_len=80)
    assert other["tokens"] == out["tokens"] and other["bytes"] == out["bytes"]
    assert other["loss"] != out["loss"] and abs(other["loss"] - out["loss"]) < 0.2


def test_eval_cli_repeats_the_final_validation_of_train(finished, capsys):
    """With no flags, `openk3 eval` scores what train's last validation scored (same documents, tokens, rows)."""
    cli.main(["eval", "--model", str(finished.run_dir), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == finished.final_eval["tokens"] == 256
    assert out["bytes"] == finished.final_eval["bytes"] and out["seq_len"] == 32
    assert out["loss"] == pytest.approx(finished.final_eval["loss"], rel=1e-5)
    cli.main(["eval", "--model", str(finished.run_dir)])
    assert "held-out documents" in (printed := capsys.readouterr().out) and "256 tokens" in printed
    assert "32-token rows" in printed


def test_user_errors_name_the_bad_value(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"])
    assert e.value.code == 2 and "missing" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no-such-preset"):
        check_args(TrainArgs(config="no-such-preset"))
    with pytest.raises(ValueError, match="--steps=0"):
        check_args(TrainArgs(steps=0))
    with pytest.raises(ValueError, match="--stop-at=9"):
        check_args(TrainArgs(steps=8, stop_at=9))


def test_seq_len_schedule():
    phases = parse_seq_len_schedule("128:200,512:400,1024")
    assert phases == [(128, 200), (512, 400), (1024, None)]
    assert [seq_len_at(s, phases, 7) for s in (0, 199, 200, 399, 400, 10**6)] == [128, 128, 512, 512, 1024, 1024]
    assert [seq_len_at(s, parse_seq_len_schedule("64:3"), 7) for s in (2, 3, 50)] == [64, 64, 64]
    assert seq_len_at(5, parse_seq_len_schedule(None), 7) == 7
    for bad in ("abc", "128:x", "0:10", "128:200,64:100", "128,256:300", "128:0", "128:200,"):
        with pytest.raises(ValueError, match="seq-len-schedule"):
            parse_seq_len_schedule(bad)


def test_curriculum_changes_the_batch_shape(workdir):
    train(args_for(workdir, "curriculum", steps=5, seq_len_schedule="16:2,40", eval_every=100, ckpt_every=100))
    records = [json.loads(l) for l in (workdir / "curriculum/metrics.jsonl").read_text().splitlines()]
    assert [r["seq_len"] for r in records] == [16, 16, 40, 40, 40]
    assert [r["tokens"] for r in records] == [32, 64, 144, 224, 304]


def test_row_streams_batch_layout(workdir, finished_run):
    """Rows come from independent document orders, and cu_seqlens / seq_ids describe the flattened batch the way
    the model needs: every row start begins a segment, seq_ids count segments, labels never cross a document."""
    corpus = tokenize_corpus(load_corpus(workdir / "corpus"), Tokenizer.load(finished_run / "tokenizer"))
    streams = RowStreams(corpus, batch_size=4, seq_len=37, seed=5)
    for i in range(3):
        batch = next(streams)
        B, T = batch.input_ids.shape
        assert (B, T) == (4, 37)
        cu = batch.cu_seqlens
        assert cu[0] == 0 and cu[-1] == B * T and bool((cu[1:] > cu[:-1]).all())
        assert set(range(0, B * T, T)) <= set(cu.tolist())
        expected_ids = torch.searchsorted(cu, torch.arange(B * T), right=True) - 1
        assert torch.equal(batch.seq_ids.flatten(), expected_ids)
        if i == 0:  # every row starts with a document's BOS, but not all with the same document
            assert len({tuple(row[:8].tolist()) for row in batch.input_ids}) > 1
    state = streams.state_dict()
    after = next(streams)
    again = RowStreams(corpus, batch_size=4, seq_len=37, seed=5)
    again.load_state_dict(state)
    assert torch.equal(next(again).input_ids, after.input_ids)
    with pytest.raises(ValueError, match="rows per batch"):
        RowStreams(corpus, batch_size=3, seq_len=37, seed=5).load_state_dict(state)


# ----------------------------------------------------------------------------------- balancing and QK-Clip

def _model_and_batches(seed: int, n: int, T: int = 24):
    torch.manual_seed(seed)
    model = K3ForCausalLM(small_config())
    return model, [torch.randint(0, model.config.vocab_size, (2, T)) for _ in range(n)]


@pytest.mark.parametrize("bins", [0, 512])
def test_balancer_uses_every_micro_batch(bins):
    model, batches = _model_and_batches(1, 3)
    balancer = RouterBalancer(model, "quantile", bins, 1e-3)
    scores = [[] for _ in model.moe_layers()]
    for ids in batches:
        router = model(ids, record=True).router
        balancer.after_forward(router)
        for i, (s, _) in enumerate(router):
            scores[i].append(s)
    biases_before = [m.gate.e_score_correction_bias.clone() for m in model.moe_layers()]
    loads = balancer.end_step()
    for i, moe in enumerate(model.moe_layers()):
        all_scores = torch.cat(scores[i])
        expected = balance.quantile_balance_exact(all_scores, biases_before[i], moe.gate.k)
        got = moe.gate.e_score_correction_bias
        tol = 1e-6 if bins == 0 else 2 * 2 / bins  # the histogram: within two bins after centring
        assert (got - expected).abs().max() <= tol
        assert loads[i].sum() == all_scores.shape[0] * moe.gate.k


def test_balance_none_and_sign():
    model, batches = _model_and_batches(2, 1)
    none = RouterBalancer(model, "none", 0, 1e-3)
    none.after_forward(model(batches[0], record=True).router)
    loads = none.end_step()
    assert all(m.gate.e_score_correction_bias.abs().sum() == 0 for m in model.moe_layers())
    sign = RouterBalancer(model, "sign", 0, 0.01)
    sign.after_forward(model(batches[0], record=True).router)
    sign.end_step()
    for moe, load in zip(model.moe_layers(), loads):
        expected = 0.01 * torch.sign(load.double().mean() - load.double())
        assert torch.allclose(moe.gate.e_score_correction_bias.double(), expected)


def test_qk_clip_brings_max_logit_to_tau():
    model, (ids,) = _model_and_batches(3, 1, T=40)
    with torch.no_grad():  # large q/k weights so the logits are worth clipping
        for attn in (l.self_attn for l in model.model.layers if isinstance(l.self_attn, GatedMLA)):
            attn.q_b_proj.weight.mul_(30)
            attn.kv_b_proj.weight.mul_(30)
    recorder = MLAMaxLogits(model)
    model(ids)
    before = recorder.max_H[0].clone()
    tau = float(before.min()) * 0.5
    recorder.clip_(tau)
    model(ids)
    after = recorder.max_H[0]
    assert torch.allclose(after, torch.full_like(after, tau), rtol=1e-4), (before, after, tau)


def test_qk_clip_max_logits_of_packed_documents_given_as_varlen():
    """On CUDA the model describes packed documents to MLA as `varlen` (cu_seqlens), not as a mask: the recorded
    maxima must still be over same-document pairs only (a plain causal mask would count cross-document logits)."""
    from openk3.model.model import document_causal_mask

    model, _ = _model_and_batches(3, 1, T=40)
    attn = next(l.self_attn for l in model.model.layers if isinstance(l.self_attn, GatedMLA))
    recorder = MLAMaxLogits(model)
    torch.manual_seed(5)
    B, T = 1, 24
    x = torch.randn(B, T, model.config.hidden_size)
    cu = torch.arange(T + 1)  # one-token documents: every causal pair but the diagonal crosses a boundary
    with torch.no_grad():
        maxima = {}
        for name, kw in [("varlen", dict(varlen=(cu.to(torch.int32), 1))),
                         ("mask", dict(mask=document_causal_mask(cu, B, T))), ("causal", {})]:
            attn(x, **kw)
            maxima[name] = recorder.max_H[0]
            recorder.max_H = [None] * len(recorder.layers)
    assert torch.equal(maxima["varlen"], maxima["mask"])
    assert not torch.equal(maxima["varlen"], maxima["causal"])


def test_train_with_a_release_style_tiktoken_file(workdir):
    """--tokenizer takes a tiktoken.model (the release format) instead of training a BPE; the model's vocabulary
    and special ids come from it (256 reserved ids after the ranks, bos/eos/pad at offsets 0/2/255)."""
    import base64

    ranks = [bytes([b]) for b in range(256)] + [b"de", b"def", b" def", b"  ", b"    ", b"im", b"import"]
    path = workdir / "tiktoken.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    result = train(args_for(workdir, "tiktoken-run", steps=2, tokenizer=str(path), ckpt_every=2, eval_every=2))
    config = K3Config.load(result.run_dir / "config.json")
    n = len(ranks)
    assert config.vocab_size == n + 256
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (n, n + 2, n + 255)
    assert Tokenizer.load(result.run_dir / "tokenizer").encode("import") == [n - 1]
    assert all(math.isfinite(x) for x in result.losses)


# ------------------------------------------------------------------------------------------- --init-from

def test_init_from_starts_at_the_checkpoint_weights(workdir, finished_run):
    from openk3.model.checkpoint import find_checkpoint, load_pretrained
    from openk3.train.trainer import prepare_data

    cli_args = {k: None for k in TrainArgs.__dataclass_fields__}
    base = args_for(workdir, "from", steps=2, ckpt_every=2)
    cli_args.update(data=base.data, vocab_size=None, steps=2, batch_size=2, seq_len=32, log_every=1, eval_every=4,
                    eval_tokens=256, ckpt_every=2, sample=False, progress=False, val_fraction=0.3, out=base.out,
                    init_from=str(finished_run))
    args = resolve_train_args(cli_args, resume=False)
    result = train(args)
    src = find_checkpoint(finished_run)
    # the config and tokenizer come from the checkpoint
    assert K3Config.load(result.run_dir / "config.json").to_dict() == K3Config.load(src).to_dict()
    assert Tokenizer.load(result.run_dir / "tokenizer").fingerprint() == Tokenizer.load(src).fingerprint()
    # the first step's loss is the loaded model's loss on the first batch
    data = prepare_data(args, result.run_dir)
    batch = next(RowStreams(data.train, 2, 32, seed=args.seed))
    model = load_pretrained(src, dtype=torch.float32, qat=K3Config.load(src / "config.json").mxfp4_experts)
    with torch.no_grad():
        expected = model(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens,
                         loss_chunk=args.loss_chunk).loss.item()
    first = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["loss"] == pytest.approx(expected, rel=1e-6)


def test_init_from_refuses_a_different_config(workdir, finished_run, tmp_path):
    from openk3.model.checkpoint import find_checkpoint

    other = K3Config.load(find_checkpoint(finished_run)).replace(rms_norm_eps=1e-6)
    other.save(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"rms_norm_eps.*1e-06"):
        train(args_for(workdir, "from-bad", steps=2, config=str(tmp_path / "config.json"),
                       init_from=str(finished_run)))
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere"))):
        train(args_for(workdir, "from-bad2", steps=2, init_from=str(tmp_path / "nowhere")))


def test_rerun_after_a_run_killed_before_its_first_checkpoint_logs_each_step_once(workdir):
    run = workdir / "killed"
    run.mkdir()
    # what a run killed at step 3, before its first checkpoint, leaves behind
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3)))
    train(args_for(workdir, "killed", steps=2))
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_heartbeat_prints_until_set(capsys):
    """The first GPU step's 'still compiling' lines: printed every period while running, none after the event."""
    import time

    from openk3.train.trainer import heartbeat
    done = heartbeat("compiling", 0.05)
    time.sleep(0.18)
    done.set()
    time.sleep(0.1)
    n = capsys.readouterr().err.count("compiling...")
    time.sleep(0.12)
    assert n >= 2 and capsys.readouterr().err.count("compiling...") == 0
