"""The `openk3` command as a user runs it: info, init, and the checkpoint it writes."""

import json

import pytest
import torch

from openk3.cli import main
from openk3.model.checkpoint import load_pretrained, save_pretrained


def test_info_json_gives_the_release_counts(capsys):
    main(["info", "--config", "kimi-k3", "--json"])
    info = json.loads(capsys.readouterr().out)
    assert round(info["total_params"] / 1e12, 4) == 2.7795
    assert round(info["active_params"] / 1e9, 2) == 104.19
    assert (info["kda_layers"], info["mla_layers"]) == (69, 24)


def test_info_human_readable_names_the_backends(capsys):
    main(["info", "--config", "tiny"])
    out = capsys.readouterr().out
    assert "KDA backend" in out and "MoE backend" in out


def test_init_then_reload_gives_identical_logits(tmp_path):
    main(["init", "--config", "tiny", "--out", str(tmp_path / "ckpt"), "--seed", "3"])
    a = load_pretrained(tmp_path / "ckpt")
    save_pretrained(a, tmp_path / "again")  # loaded experts are MXFP4-exact, so the round trip is lossless
    b = load_pretrained(tmp_path / "again")
    ids = torch.randint(0, a.config.vocab_size, (2, 19))
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert torch.equal(la, lb)
    # the seed matters: a different seed gives a different model
    main(["init", "--config", "tiny", "--out", str(tmp_path / "other"), "--seed", "4"])
    with torch.no_grad():
        assert not torch.equal(load_pretrained(tmp_path / "other")(ids).logits, la)


def test_bad_config_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["info", "--config", "no-such-thing"])
    assert e.value.code == 2
    assert "no-such-thing" in capsys.readouterr().err
