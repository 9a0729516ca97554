"""`openk3 convert`: release safetensors -> DCP -> release gives the same model, tensor by tensor."""

import pytest
import torch

from openk3 import cli
from openk3.model.checkpoint import init_checkpoint, load_pretrained, read_index
from openk3.model.model import keeps_fp32
from openk3.parallel import dcp as pdcp
from tests.parallel.dist import spawn
from tests.train.test_train import small_config


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    config = small_config()
    init_checkpoint(config, root / "release", seed=3, max_shard_bytes=40_000)  # several shards
    return root


def test_round_trip_is_exact(release, monkeypatch):
    cli.main(["convert", str(release / "release"), str(release / "dcp")])
    assert pdcp.is_dcp_dir(release / "dcp") and (release / "dcp/config.json").is_file()
    reads = []
    real_read = pdcp.read_dcp_tensor
    monkeypatch.setattr(pdcp, "read_dcp_tensor", lambda *a: reads.append(a[1]) or real_read(*a))
    cli.main(["convert", str(release / "dcp"), str(release / "back"), "--max-shard-bytes", "40000"])
    a = load_pretrained(release / "release").state_dict()
    b = load_pretrained(release / "back").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # streamed: each model tensor read from the DCP files once, on its own
    assert sorted(reads) == sorted(a)
    assert read_index(release / "back").keys() == read_index(release / "release").keys()
    assert len({i.file for i in read_index(release / "back").values()}) > 1


def test_dcp_to_bf16_release_keeps_the_fp32_islands(release):
    if not pdcp.is_dcp_dir(release / "dcp"):
        cli.main(["convert", str(release / "release"), str(release / "dcp")])
    cli.main(["convert", str(release / "dcp"), str(release / "bf16"), "--dtype", "bf16"])
    model = load_pretrained(release / "bf16")
    ref = load_pretrained(release / "release").state_dict()
    for name, t in model.state_dict().items():
        assert t.dtype == (torch.float32 if keeps_fp32(name) else torch.bfloat16), name
        if keeps_fp32(name):
            assert torch.equal(t, ref[name]), name


def test_convert_errors_name_the_bad_path(release, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["convert", str(tmp_path / "nothing"), str(tmp_path / "out")])
    assert "no checkpoint directory at" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full/x").write_text("x")
    with pytest.raises(SystemExit):
        cli.main(["convert", str(release / "release"), str(tmp_path / "full")])
    assert "is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["convert", str(release / "release"), str(tmp_path / "o"), "--dtype", "bf16"])
    assert "--dtype bf16 applies to DCP -> release" in capsys.readouterr().err


def _convert_worker(rank: int, world: int, src, out) -> None:
    cli.main(["convert", str(src), str(out)])  # joins the gloo group from the env, as under torchrun


def test_release_to_dcp_on_two_ranks(release, tmp_path):
    """Under torchrun each rank fills only its FSDP2 shards from the safetensors files and writes them; the
    result holds the same model."""
    spawn(2, _convert_worker, release / "release", tmp_path / "dcp2")
    assert sorted(p.name for p in (tmp_path / "dcp2").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    cli.main(["convert", str(tmp_path / "dcp2"), str(tmp_path / "back2")])
    a = load_pretrained(release / "release").state_dict()
    b = load_pretrained(tmp_path / "back2").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
