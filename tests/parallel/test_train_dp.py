"""Data-parallel training (FSDP2 on gloo) equals one process on the same global batch; DCP checkpoints reshard.

The runs are `openk3 train --nproc N` (torchrun, CPU, gloo) on the small model of tests/train/test_train.py:
4 steps of 4 rows x 32 tokens, Quantile Balancing and QK-Clip on, MXFP4 QAT on (the config stores MXFP4 experts).
NOTE: not bit-equal: the gradients are summed in another order (reduce-scatter of the ranks' shares), and Muon's
bf16 Newton-Schulz turns those last-bit differences into bf16-sized ones (measured: losses 1.3e-5 apart at step 4,
weights up to 7e-3 in relative norm, the router biases, order statistics of the scores, 3e-2). So the tight checks
are on the first two steps (the step-2 loss and gradient norm depend on step 1's whole update: measured 1e-7 and 4e-6), and
the gradient norm of every step, which is what a wrongly scaled gradient would show (Muon and AdamW themselves are
blind to the gradient's scale).
"""

import json
from pathlib import Path

import pytest
import torch

from openk3 import cli
from openk3.model.checkpoint import load_for_inference
from openk3.parallel.dcp import dcp_config, dcp_model_metas, read_dcp_tensor
from openk3.train.trainer import DCP_DIR, DIST_STATE, TrainArgs, train
from tests.helpers import rel_norm_err
from tests.train.test_train import make_workdir

STEPS = 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return make_workdir(tmp_path_factory.mktemp("dp"))


def settings(workdir: Path, out: str) -> dict:
    return dict(config=str(workdir / "config.json"), data=str(workdir / "corpus"), vocab_size=300, steps=STEPS,
                batch_size=4, seq_len=32, log_every=1, eval_every=100, eval_tokens=256, ckpt_every=2, qk_clip=5.0,
                sample=False, progress=False, val_fraction=0.3, out=str(workdir / out))


def argv(s: dict) -> list[str]:
    out = ["train", "--no-sample", "--no-progress"]
    for name in ("config", "data", "vocab_size", "steps", "batch_size", "seq_len", "log_every", "eval_every",
                 "eval_tokens", "ckpt_every", "qk_clip", "val_fraction", "out"):
        out += [f"--{name.replace('_', '-')}", str(s[name])]
    return out


@pytest.fixture(scope="module")
def single(workdir) -> tuple[list[float], dict]:
    """The one-process reference: losses and gradient norms of every step, the final fp32 weights (+ router biases)."""
    train(TrainArgs(**settings(workdir, "single")))
    state = torch.load(workdir / "single/checkpoints/step_000004/trainer_state.pt", weights_only=True)
    return metrics(workdir / "single"), state["model"]


def metrics(run_dir: Path) -> dict[str, list[float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {key: [line[key] for line in lines] for key in ("loss", "grad_norm")}


def dcp_weights(ckpt: Path) -> dict:
    src = ckpt / DCP_DIR
    return {n: read_dcp_tensor(src, n, shape, dtype)
            for n, (shape, dtype) in dcp_model_metas(src, dcp_config(src)).items()}


def assert_same_run(got: dict, weights: dict, single, weight_tol: float = 1e-2) -> None:
    ref, ref_weights = single
    assert len(got["loss"]) == len(ref["loss"]) == STEPS  # rank 0 alone logs: one line per step
    for key in ("loss", "grad_norm"):
        assert got[key][:2] == pytest.approx(ref[key][:2], rel=2e-5), key
        assert got[key] == pytest.approx(ref[key], rel=1e-3 if key == "grad_norm" else 1e-4), key
    assert weights.keys() == ref_weights.keys()
    for name, w in ref_weights.items():
        if not w.any():  # layer 0's AttnRes query: nothing to mix there, no gradient, stays at its zero init
            assert not weights[name].any(), name
            continue
        bias = name.endswith("e_score_correction_bias")
        assert rel_norm_err(weights[name], w) < (0.1 if bias else weight_tol), name
    assert any(n.endswith("e_score_correction_bias") and ref_weights[n].abs().sum() > 0 for n in ref_weights)


@pytest.mark.slow
def test_two_ranks_equal_one_process(workdir, single, capsys):
    """`--nproc 2 --dp 2`: the same losses and final weights as one process; the checkpoint also has the release
    layout, so `openk3 generate/eval` can load it."""
    s = settings(workdir, "dp2")
    cli.main(argv(s) + ["--nproc", "2", "--dp", "2"])
    run = Path(s["out"])
    assert_same_run(metrics(run), dcp_weights(run / "checkpoints/step_000004"), single)
    model, _, model_dir = load_for_inference(run)
    assert model_dir.name == "step_000004"
    _, ref_weights = single
    # the release layout stores MXFP4 experts (lossy); every other tensor comes back as trained
    loaded = model.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.2.self_attn.kv_b_proj.weight"):
        assert rel_norm_err(loaded[name], ref_weights[name]) < 1e-2


@pytest.mark.slow
def test_dcp_checkpoint_of_four_ranks_resumes_on_two_with_expert_parallelism(workdir, single, capfd):
    """Stop a 4-rank FSDP2 run after step 2 (DCP checkpoint with the optimizer state), resume it on 2 ranks with
    `--ep 2` (each rank now holds half of every layer's experts, MoonEP dispatch): the resumed steps 3, 4 match the
    uninterrupted one-process run, so weights, Muon momentum, AdamW moments, router biases and every data row's
    position came back through the reshard into the other layout."""
    s = settings(workdir, "dp4to2")
    cli.main(argv(s) + ["--nproc", "4", "--stop-at", "2"])
    run = Path(s["out"])
    assert sorted(p.name for p in (run / "checkpoints/step_000002/dcp").glob("*.distcp")) == \
        [f"__{r}_0.distcp" for r in range(4)]
    capfd.readouterr()
    cli.main(["train", "--out", str(run), "--resume", "--no-progress", "--nproc", "2", "--ep", "2"])
    assert "experts split over groups of 2 (MoonEP)" in capfd.readouterr().out
    assert_same_run(metrics(run), dcp_weights(run / "checkpoints/step_000004"), single)


@pytest.mark.slow
def test_init_from_on_two_ranks_reads_only_the_shards(workdir, single, capfd):
    """`--init-from` a checkpoint under `--nproc 2 --ep 2`: every rank fills its FSDP2 and expert shards from the
    safetensors files (nothing is loaded whole); the first step's loss and gradient norm equal the one-process
    `--init-from` run's (the same weights, router biases included)."""
    init = workdir / "single/checkpoints/step_000004"
    same = {"steps": 1, "config": str(init / "config.json")}  # the checkpoint's config (vocabulary of its tokenizer)
    ref = train(TrainArgs(**{**settings(workdir, "init1"), **same, "init_from": str(init)}))
    s = {**settings(workdir, "init2"), **same}
    capfd.readouterr()
    cli.main(argv(s) + ["--init-from", str(init), "--nproc", "2", "--ep", "2"])
    assert "each rank read its own shards" in capfd.readouterr().out
    got = metrics(Path(s["out"]))
    assert got["loss"] == pytest.approx(ref.losses, rel=1e-6)
    assert got["grad_norm"] == pytest.approx(metrics(workdir / "init1")["grad_norm"], rel=2e-5)


@pytest.mark.slow
def test_context_parallel_runs_equal_one_process_and_resume(workdir, single, capfd):
    """`--nproc 4 --dp 2 --cp 2` (2 data-parallel replicas, each row split over a context-parallel pair: the
    KDA fold and the MLA latent gather across the split, packed documents crossing it) stops after step 2; the DCP
    checkpoint resumes on `--nproc 2 --cp 2 --ep 2` (the whole batch on one CP pair, which also splits the experts):
    the losses, gradient norms and final weights are those of the uninterrupted one-process run."""
    s = settings(workdir, "cp")
    cli.main(argv(s) + ["--nproc", "4", "--dp", "2", "--cp", "2", "--stop-at", "2"])
    run = Path(s["out"])
    assert "context parallel in groups of 2" in capfd.readouterr().out
    saved = torch.load(run / "checkpoints/step_000002" / DIST_STATE, weights_only=True)
    assert len(saved["data"]["rows"]) == 4  # each row once, not once per rank of its CP group
    cli.main(["train", "--out", str(run), "--resume", "--no-progress", "--nproc", "2", "--cp", "2", "--ep", "2"])
    out = capfd.readouterr().out
    assert "context parallel in groups of 2" in out and "experts split over groups of 2" in out
    # NOTE: the weights' tolerance is twice the data-parallel runs': the CP ranks' partial gradients add a third
    # summation order (measured: 1.2e-2 relative norm for one MLA o_proj, every other matrix below 1e-2), which
    # Muon's bf16 Newton-Schulz amplifies as in the module docstring; losses and gradient norms keep the tight
    # tolerances
    assert_same_run(metrics(run), dcp_weights(run / "checkpoints/step_000004"), single, weight_tol=2e-2)


def test_dp_flag_errors_name_the_value(workdir, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv(settings(workdir, "bad")) + ["--dp", "2"])
    assert "--dp=2 --ep=1 --cp=1 needs 2 processes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(argv(settings(workdir, "bad")) + ["--nproc", "0"])
    assert "--nproc=0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(argv(settings(workdir, "bad")) + ["--fsdp-bf16"])
    assert "--fsdp-bf16 is FSDP2's mixed precision: it needs torchrun" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(argv(settings(workdir, "bad")) + ["--ep", "2"])
    assert "--ep=2 --cp=1 needs 2 processes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(argv(settings(workdir, "bad")) + ["--cp", "2"])
    assert "--cp=2 needs 2 processes: add --nproc 2" in capsys.readouterr().err
    for flags, message in ((["--nproc", "3"], "--batch-size=4 is the global batch and must be divisible by the 3"),
                           (["--nproc", "4", "--ep", "3"], "--ep=3 must be a positive divisor of the 4"),
                           (["--nproc", "2", "--dp", "4"], "--dp=4 x --cp=1 must equal the number of processes (2)"),
                           (["--nproc", "4", "--cp", "3"], "--cp=3 must be a positive divisor of the number of "
                                                           "processes (4)"),
                           (["--nproc", "4", "--dp", "1", "--cp", "2"], "--dp=1 x --cp=2 must equal the number"),
                           (["--nproc", "2", "--cp", "2", "--seq-len-schedule", "16:2,33"],
                            "the row length 33 (--seq-len / --seq-len-schedule) must be divisible by it")):
        with pytest.raises(SystemExit):  # checked before any process starts
            cli.main(argv(settings(workdir, "bad")) + flags)
        assert message in capsys.readouterr().err


def _run_dir_worker(rank: int, world: int, out_file: str) -> None:
    import torch.distributed as dist

    from openk3.parallel.mesh import init_distributed
    from openk3.train import trainer

    env = init_distributed("cpu")
    trainer.default_out = lambda config: f"runs/{config}-started-in-second-{rank}"  # ranks a second apart
    got = trainer.run_dir_of(TrainArgs(config="tiny"), env)
    names = [None] * world
    dist.all_gather_object(names, str(got))
    if rank == 0:
        Path(out_file).write_text(json.dumps(names))


def test_ranks_without_out_share_rank_0s_default_run_dir(tmp_path):
    from tests.parallel.dist import spawn

    spawn(2, _run_dir_worker, str(tmp_path / "names.json"), timeout_s=120)
    assert json.loads((tmp_path / "names.json").read_text()) == ["runs/tiny-started-in-second-0"] * 2
