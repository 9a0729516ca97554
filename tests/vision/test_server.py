"""`openk3 serve` with images: OpenAI-style image_url parts (base64 data URLs) through the official `openai` client,
the same answer as the engine gives directly; remote URLs, bad images and images for a text-only model are 400s."""

import base64
import io

import openai
import pytest
import torch
from PIL import Image

from openk3.config import tiny_vl
from openk3.model.checkpoint import config_for_tokenizer, load_for_inference, save_pretrained
from openk3.serve.engine import Engine, EngineConfig, SamplingParams
from openk3.serve.server import Server, create_app
from openk3.text.chat import IdOutputParser, chat_stop_ids, encode_segments, render
from openk3.text.tokenizer import train_bpe
from openk3.vision import synthetic
from openk3.vision.model import K3ForConditionalGeneration, expand_media_pads
from openk3.vision.preprocess import preprocess

NAME = "k3-vl-test"
TIMEOUT = 30.0


def data_url(image, fmt="PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tokenizer = train_bpe(synthetic.corpus_texts() * 20, 400)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("vl")
    save_pretrained(K3ForConditionalGeneration(config_for_tokenizer(tiny_vl(), tokenizer)), path)
    tokenizer.save(path)
    model, tok, _ = load_for_inference(path)
    engine = Engine(model, EngineConfig(page_size=16, num_pages=400, prefill_chunk=64, hash_interval=16,
                                        checkpoint_interval=16))
    srv = Server(create_app(engine, tok, NAME, max_context=512)).start()
    srv.model, srv.tokenizer, srv.engine = model, tok, engine
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def ask(client, url: str, **kw):
    return client.chat.completions.create(
        model=NAME, max_tokens=6, temperature=0, extra_body={"chat_template_kwargs": {"thinking": False}},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": synthetic.PROMPT}]}], **kw)


def test_openai_client_sends_an_image(client, served):
    ex = synthetic.draw_example(7, 0)
    encoded_before = served.engine.stats()["images_encoded"]
    r = ask(client, data_url(ex.image))
    # the same request straight into the engine: the prompt with the image's slots, the image preprocessed
    tok, model = served.tokenizer, served.model
    item = preprocess(ex.image, model.config.vision_config)
    messages = [{"role": "user", "content": [{"type": "image_url", "width": 84, "height": 84},
                                             {"type": "text", "text": synthetic.PROMPT}]}]
    ids = encode_segments(tok, render(tok, messages, thinking=False))
    ids = expand_media_pads(ids, model.config.media_placeholder_token_id, [item.num_tokens])
    engine = Engine(model, EngineConfig(page_size=16, num_pages=400))
    req = engine.submit(ids, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=chat_stop_ids(tok)),
                        images=[item])
    while engine.has_work():
        engine.step()
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(req.output)
    parser = IdOutputParser(tok, "xtml", thinking=False, tools_declared=False)  # as the server parses
    parsed = parser.feed(req.completion_ids)
    parsed += parser.finish()
    assert r.choices[0].message.content == parsed.content
    assert served.engine.stats()["images_encoded"] == encoded_before + 1
    # a JPEG of another image is another prompt for the cache: nothing past the text before the slots is shared
    r2 = ask(client, data_url(synthetic.draw_example(7, 1).image, "JPEG"))
    assert r2.usage.prompt_tokens == len(ids) and r2.usage.prompt_tokens_details.cached_tokens < ids.index(
        model.config.media_placeholder_token_id)


@pytest.mark.parametrize("url,message", [
    ("https://example.com/cat.png", "remote or other URLs are not fetched"),
    ("data:image/png;base64,aGVsbG8=", "not an image"),
    ("data:image/png;base64,@@", "not valid base64"),
])
def test_bad_image_urls_are_400s(client, url, message):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, url)
    assert message in str(e.value) and "messages.0.content.0.image_url" in str(e.value)


def test_text_only_model_refuses_images(tmp_path):
    from fastapi.testclient import TestClient

    from tests.serve.test_cache import small_config

    tok = train_bpe(["hello world"] * 10, 300)
    config = small_config().replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                                    pad_token_id=tok.pad_id)
    from openk3.model import K3ForCausalLM

    engine = Engine(K3ForCausalLM(config).eval(), EngineConfig(page_size=16, num_pages=100))
    with TestClient(create_app(engine, tok, NAME)) as http:
        r = http.post("/v1/chat/completions", json={
            "model": NAME, "max_tokens": 2,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(Image.new("RGB", (8, 8)))}}]}]})
    assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]


def test_images_beyond_the_context_are_refused_before_preprocessing(client, served, monkeypatch):
    """Many images in one body: the 400 comes at the image that overflows the context (512 here), and no image after
    it is preprocessed (each costs its fp32 patches in memory)."""
    import openk3.serve.server as server_module
    from openk3.vision.preprocess import num_image_tokens

    vision = served.model.config.vision_config
    side = 28
    while num_image_tokens(side, side, vision) * 2 <= 512:
        side += 28
    calls = []
    monkeypatch.setattr(server_module, "preprocess", lambda *a: calls.append(1) or preprocess(*a))
    url = data_url(Image.new("RGB", (side, side), (5, 6, 7)))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}} for _ in range(6)]}])
    assert "messages.0.content.1.image_url" in str(e.value) and "vision tokens" in str(e.value)
    assert len(calls) == 1
    # thousands of 1x1 images: each costs at least its slot and 4 prompt ids, so 102 fit in 512 and the 103rd is refused
    calls.clear()
    tiny = data_url(Image.new("RGB", (1, 1), (5, 6, 7)))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": tiny}} for _ in range(2000)]}])
    assert "messages.0.content.102.image_url" in str(e.value) and len(calls) == 102
