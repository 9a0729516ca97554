"""The demo's first stage: a run killed while it builds the base model leaves no half-built base behind."""

import pytest

from openk3.posttrain.demo import demo
from openk3.text.tokenizer import BPETokenizer, Tokenizer


def test_a_demo_killed_while_building_its_base_redoes_that_stage(tmp_path, monkeypatch):
    def killed(self, directory):
        raise KeyboardInterrupt  # as if the process died after the weights, before the tokenizer

    real_save = BPETokenizer.save
    monkeypatch.setattr(BPETokenizer, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        demo(str(tmp_path), n_data=30, vocab_size=300)
    assert not (tmp_path / "base" / "config.json").exists()  # so the next demo does not skip the stage
    monkeypatch.setattr(BPETokenizer, "save", real_save)
    monkeypatch.setattr("openk3.posttrain.demo.sft", lambda args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # stop at the next stage: the base is complete now
        demo(str(tmp_path), n_data=30, vocab_size=300)
    assert Tokenizer.load(tmp_path / "base").vocab_size == 300
