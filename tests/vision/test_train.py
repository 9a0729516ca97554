"""`openk3 train --config tiny-vl`: the image-text run trains the whole model jointly, resumes exactly, and ends with
the held-out attribute accuracy (the learning result itself is measured in docs/vision.md: minutes, not a test)."""

import json

import pytest
import torch

from openk3 import cli
from openk3.train.trainer import TrainArgs, train
from openk3.vision import synthetic


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def args(tmp_path, out, **changes):
    return TrainArgs(**{**dict(config="tiny-vl", steps=4, batch_size=3, seq_len=64, vocab_size=400, log_every=1,
                               ckpt_every=2, progress=False, vision_eval_images=4, out=str(tmp_path / out)),
                        **changes})


def test_image_text_run_resumes_exactly_and_reports_accuracy(tmp_path, capsys):
    full = train(args(tmp_path, "full"))
    assert len(full.losses) == 4 and all(l == l and l > 0 for l in full.losses)
    ev = json.loads((tmp_path / "full" / "vision_eval.json").read_text())
    assert ev["images"] == 4 and set(ev["accuracy"]) == {"colour", "shape", "both"}
    assert "held-out images" in capsys.readouterr().out

    train(args(tmp_path, "split", stop_at=2))
    resumed = train(args(tmp_path, "split"), resume=True)
    assert resumed.losses == full.losses[2:]
    a = torch.load(tmp_path / "full/checkpoints/step_000004/trainer_state.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "split/checkpoints/step_000004/trainer_state.pt", weights_only=True)["model"]
    assert any(k.startswith("vision_tower.") for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    capsys.readouterr()
    cli.main(["eval", "--model", str(tmp_path / "full"), "--json"])
    assert json.loads(capsys.readouterr().out)["images"] == 4


def test_data_is_refused(tmp_path):
    with pytest.raises(ValueError, match="synthetic image-text corpus"):
        train(args(tmp_path, "x", data="somewhere"))


def test_the_held_out_seed_is_refused_for_training(tmp_path):
    with pytest.raises(ValueError, match="--seed=1000000000: the seed of the held-out images"):
        train(args(tmp_path, "x", seed=synthetic.HELD_OUT_SEED))


def test_examples_are_deterministic_and_labels_cover_only_the_answer():
    a, b = synthetic.draw_example(3, 17), synthetic.draw_example(3, 17)
    assert a.description == b.description and a.image.tobytes() == b.image.tobytes()
    assert synthetic.draw_example(3, 18).image.tobytes() != a.image.tobytes()
    from openk3.config import tiny_vl
    from openk3.model.checkpoint import config_for_tokenizer
    from openk3.text.tokenizer import train_bpe

    tok = train_bpe(synthetic.corpus_texts() * 20, 400)
    config = config_for_tokenizer(tiny_vl(), tok)
    batch = synthetic.make_batch([a], tok, config, seq_len=64)
    targets = [t for t in batch.labels[0].tolist() if t != -100]
    assert tok.decode(targets[:3]) == a.description
    assert (batch.input_ids[0] == config.media_placeholder_token_id).sum() == 9  # 84x84 -> 3x3 merged patches
    with pytest.raises(ValueError, match="more than --seq-len=16"):
        synthetic.make_batch([a], tok, config, seq_len=16)
