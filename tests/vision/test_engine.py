"""Images in the inference engine: outputs equal a full forward, the tower runs once per image per request however the
prompt is chunked, and the prefix cache never lets two different images share an entry."""

import re

import pytest
import torch
from PIL import Image

from openk3.config import tiny_vl
from openk3.serve.engine import Engine, EngineConfig, SamplingParams
from openk3.vision.model import K3ForConditionalGeneration, expand_media_pads
from openk3.vision.preprocess import preprocess

CONFIG = tiny_vl(vocab_size=300)
PAD = CONFIG.media_placeholder_token_id
GREEDY = dict(temperature=0.0, stop_token_ids=())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForConditionalGeneration(CONFIG).eval()
    with torch.no_grad():  # larger random weights than the init, so that different images give different outputs
        for name, p in m.named_parameters():
            if name.startswith(("vision_tower", "mm_projector")) and p.dim() >= 2:
                p.mul_(8)
    return m


def image(seed: int, size=(84, 56)):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return preprocess(Image.frombytes("RGB", size, pixels.numpy().tobytes()), CONFIG.vision_config)


def prompt_for(images, before=20, between=5, after=20):
    """Text ids around the images' slots (one run of pads per image)."""
    ids = list(range(30, 30 + before))
    for k, im in enumerate(images):
        ids += [PAD] * im.num_tokens + list(range(60 + 10 * k, 60 + 10 * k + between))
    return ids + list(range(100, 100 + after))


def full_forward_greedy(model, prompt, images, n):
    features = model.image_features(*[torch.cat([im.pixel_values for im in images]),
                                      torch.tensor([im.grid_thw for im in images])])
    ids, logps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), image_features=features).logits[0, -1].float()
            logps.append(torch.log_softmax(logits, -1))
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], logps


def test_generation_with_images_equals_full_forward(model):
    """Two images, a prompt prefilled in 4-token chunks (a chunk boundary falls inside each image's slots): the
    greedy tokens and logprobs are those of full forwards, and the tower ran once per image."""
    ims = [image(1), image(2, size=(40, 60))]
    prompt = prompt_for(ims)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=200, prefill_chunk=4, hash_interval=4,
                                        checkpoint_interval=8))
    req = engine.submit(prompt, SamplingParams(max_tokens=6, **GREEDY), images=ims)
    while engine.has_work():
        engine.step()
    tokens, logps = full_forward_greedy(model, prompt, ims, 6)
    assert req.output == tokens
    for lp, t, got in zip(logps, tokens, req.logprobs):
        assert abs(float(lp[t]) - got) < 1e-4
    assert engine.stats()["images_encoded"] == 2


def test_two_images_never_share_cache_entries(model):
    """Same tokens, different pixels: the second request reuses only the text before the image, and its output is
    what an engine with an empty cache gives. The same image again reuses past it."""
    config = EngineConfig(page_size=4, num_pages=4000, prefill_chunk=64, hash_interval=4, checkpoint_interval=8)
    a, b = image(3), image(4)
    assert a.digest != b.digest
    prompt = prompt_for([a], before=18, after=30)  # pads at 18..26
    params = SamplingParams(max_tokens=5, **GREEDY)
    engine = Engine(model, config)

    def run(im):
        req = engine.submit(prompt, params, images=[im])
        while engine.has_work():
            engine.step()
        return req

    first, other = run(a), run(b)
    assert engine.stats()["evictions"] == 0  # the pool holds every checkpoint: nothing below is an eviction
    assert first.cached_tokens == 0
    assert 0 < other.cached_tokens <= 18  # at most up to the image's first slot
    encoded = engine.stats()["images_encoded"]
    same = run(a)
    assert same.cached_tokens > 26  # past the image: its pixels are the first request's
    assert same.output == first.output
    assert engine.stats()["images_encoded"] == encoded  # every slot came from the cache: the tower did not run

    cold = Engine(model, config)
    req = cold.submit(prompt, params, images=[b])
    while cold.has_work():
        cold.step()
    assert other.output == req.output and other.output != first.output
    assert max(abs(x - y) for x, y in zip(other.logprobs, req.logprobs)) < 1e-4


def test_image_slots_are_checked(model):
    engine = Engine(model, EngineConfig(page_size=4, num_pages=100))
    im = image(5)
    with pytest.raises(ValueError, match="slots; its 1 image"):
        engine.submit([1, 2, PAD, 3], SamplingParams(max_tokens=2), images=[im])
    ids = expand_media_pads([1, 2, PAD, 3], PAD, [im.num_tokens])
    assert engine.submit(ids, SamplingParams(max_tokens=2), images=[im]).cache_tokens[2] < 0


def test_a_request_cancelled_mid_prefill_drops_its_pixels(model):
    engine = Engine(model, EngineConfig(page_size=4, num_pages=400, prefill_chunk=8))
    im = image(6)
    req = engine.submit(prompt_for([im], before=4, after=30), SamplingParams(max_tokens=4, **GREEDY), images=[im])
    engine.step()
    engine.step()
    assert req.vision is not None and not req.finished  # the tower ran, the prompt is not read yet
    engine.cancel(req.id)
    while engine.has_work():
        engine.step()
    assert req.finish_reason == "cancelled" and req.images is None and req.vision is None


def test_each_run_of_slots_holds_whole_images(model):
    engine = Engine(model, EngineConfig(page_size=4, num_pages=100))
    six, one = image(5), image(6, size=(28, 28))
    assert (six.num_tokens, one.num_tokens) == (6, 1)
    swapped = [1, PAD, 2] + [PAD] * 6 + [3]  # right total, wrong order
    with pytest.raises(ValueError, match=re.escape("run of 1 <|media_pad|> slots at position 1 does not hold")):
        engine.submit(swapped, SamplingParams(max_tokens=2), images=[six, one])
    engine.submit([1] + [PAD] * 7 + [3], SamplingParams(max_tokens=2), images=[six, one])  # adjacent images
    engine.submit([1, PAD, 2] + [PAD] * 6 + [3], SamplingParams(max_tokens=2), images=[one, six])


def test_a_tower_out_of_memory_fails_its_request_alone(model, monkeypatch):
    engine = Engine(model, EngineConfig(page_size=4, num_pages=400, prefill_chunk=8))
    text = engine.submit(list(range(30, 50)), SamplingParams(max_tokens=5, **GREEDY))
    engine.step()  # the text request is decoding when the image request's tower fails

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(model, "image_features", oom)
    im = image(7)
    req = engine.submit(prompt_for([im]), SamplingParams(max_tokens=4, **GREEDY), images=[im])
    while engine.has_work():
        engine.step()
    assert req.finish_reason == "error" and "out of memory" in req.error and req.images is None
    assert text.finish_reason == "length" and len(text.output) == 5
    monkeypatch.undo()  # the engine still serves images afterwards
    again = engine.submit(prompt_for([im]), SamplingParams(max_tokens=2, **GREEDY), images=[im])
    while engine.has_work():
        engine.step()
    assert again.finish_reason == "length" and len(again.output) == 2
