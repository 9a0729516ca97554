"""A small random policy with a BPE tokenizer trained on the synthetic trajectories (it has K3's XTML markers)."""

import pytest

from openk3.model.checkpoint import init_checkpoint
from openk3.posttrain.synth import generate
from openk3.text.chat import render_xtml, segments_text
from openk3.text.tokenizer import train_bpe
from tests.serve.test_cache import small_config


@pytest.fixture(scope="session")
def tokenizer():
    rows = generate(60, seed=1)
    texts = [segments_text(render_xtml(r["messages"], tools=r["tools"], effort=r["effort"],
                                       add_generation_prompt=False)) for r in rows]
    return train_bpe(texts, 400)


@pytest.fixture(scope="session")
def policy_dir(tokenizer, tmp_path_factory):
    """A checkpoint directory of a randomly initialised small K3 model (no MXFP4) with the tokenizer."""
    out = tmp_path_factory.mktemp("policy") / "base"
    init_checkpoint(small_config().replace(quantization_config=None), out, seed=0, tokenizer=tokenizer)
    return out
