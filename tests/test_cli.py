"""The `openk3` command as a user runs it: info, init, and the checkpoint it writes."""

import json
import subprocess
import sys

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
    assert "KDA backend" in out and "MoE backend" in out and "MLA decode step" in out


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


def small_corpus(tmp_path):
    text = "def hello(world):\n    return world + 1\n" * 50 + "class Thing:\n    pass\n" * 30
    (tmp_path / "corpus.py").write_text(text)
    return tmp_path / "corpus.py"


def generate_json(capsys, model_dir):
    capsys.readouterr()
    main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "3", "--json"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_init_with_trained_bpe_then_generate(tmp_path, capsys):
    from openk3.text.tokenizer import Tokenizer

    out = tmp_path / "ckpt"
    main(["init", "--config", "tiny", "--out", str(out), "--tokenizer", "bpe", "--data", str(small_corpus(tmp_path))])
    tok = Tokenizer.load(out)
    config = load_pretrained(out).config
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (tok.vocab_size, tok.bos_id, tok.eos_id)
    assert len(generate_json(capsys, out)["token_ids"]) <= 3


def test_init_with_a_tokenizer_file_then_generate(tmp_path, capsys):
    from openk3.text.tokenizer import Tokenizer, train_bpe

    bpe = train_bpe([small_corpus(tmp_path).read_text()], 400)
    bpe.save(tmp_path / "tok")
    out = tmp_path / "ckpt"
    main(["init", "--config", "tiny", "--out", str(out), "--tokenizer", str(tmp_path / "tok" / "tokenizer.json")])
    assert Tokenizer.load(out).fingerprint() == bpe.fingerprint()
    assert load_pretrained(out).config.vocab_size == bpe.vocab_size
    assert len(generate_json(capsys, out)["token_ids"]) <= 3


def test_generate_without_tokenizer_says_how_to_fix(tmp_path, capsys):
    main(["init", "--config", "tiny", "--out", str(tmp_path / "ckpt")])
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "hi", "--max-tokens", "3"])
    err = capsys.readouterr().err
    assert "openk3 init --tokenizer" in err and str(tmp_path / "ckpt") in err


def test_init_with_a_missing_tokenizer_names_it(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["init", "--config", "tiny", "--out", str(tmp_path / "ckpt"), "--tokenizer", str(tmp_path / "nope")])
    assert str(tmp_path / "nope") in capsys.readouterr().err


def test_init_data_without_bpe_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["init", "--config", "tiny", "--out", str(tmp_path / "ckpt"), "--data", str(tmp_path)])
    assert "--data" in capsys.readouterr().err and not (tmp_path / "ckpt").exists()


def test_info_help_lists_every_preset(capsys):
    from openk3.config import PRESETS

    for command in ("info", "init"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at any space
        assert all(name in shown for name in PRESETS), (command, shown)
    assert "k3-1b" in PRESETS


def test_info_into_a_closed_pipe_exits_quietly():
    """`openk3 info | head -1`: the reader is gone before info prints; no BrokenPipeError traceback."""
    p = subprocess.Popen([sys.executable, "-m", "openk3.cli", "info"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # before info has imported torch, so every line it prints meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) in (0, 141) and err == "", err
