"""The OpenAI-compatible server: the chat template and output parser on token sequences, then a live server on
127.0.0.1 driven by the official `openai` client (streaming and not, 32 concurrent clients against sequential greedy
runs, cache-salt isolation, disconnects, graceful shutdown, metrics), error bodies, and fuzzed request bodies
through the ASGI app (never a 500)."""

import argparse
import json
import random
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openk3.model import K3ForCausalLM
from openk3.model.checkpoint import load_for_inference, save_pretrained
from openk3.serve.engine import Engine, EngineConfig, SamplingParams
from openk3.serve.server import Server, TextDiff, cmd_serve, create_app, register_commands
from openk3.text.chat import (IdOutputParser, K2OutputParser, chat_format_for, chat_stop_ids, encode_segments, render,
                              render_k2)
from openk3.text.tokenizer import train_bpe
from tests.serve.test_cache import small_config

NAME = "k3-test"
MAX_CONTEXT = 1024  # K3 XTML prompts of a few turns are a few hundred tokens of the small BPE
TIMEOUT = 30.0  # seconds, for every client call: a hung server fails the test instead of hanging it


def stats(server: Server) -> dict:
    """The engine's stats as the engine thread last saw them (calling engine.stats() here would race it)."""
    return server.app.state.loop.stats


def wait_for(condition, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random-init small K3 with a BPE tokenizer trained on a few stdlib files, saved as `openk3 serve` loads it."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(lib / f).read_text() for f in ("textwrap.py", "json/__init__.py", "bisect.py")]
    tokenizer = train_bpe(texts, vocab_size=400)
    torch.manual_seed(0)
    config = small_config().replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                    eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    path = tmp_path_factory.mktemp("model")
    save_pretrained(K3ForCausalLM(config), path)
    tokenizer.save(path)
    return path


@pytest.fixture(scope="module")
def loaded(model_dir):
    model, tokenizer, _ = load_for_inference(model_dir)
    return model, tokenizer


def make_engine(model, max_batch: int = 32) -> Engine:
    return Engine(model, EngineConfig(page_size=16, num_pages=400, max_batch=max_batch, prefill_chunk=64,
                                      hash_interval=16, checkpoint_interval=16))


@pytest.fixture(scope="module")
def server(loaded):
    model, tokenizer = loaded
    engine = make_engine(model)
    srv = Server(create_app(engine, tokenizer, NAME, max_context=MAX_CONTEXT)).start()
    srv.engine = engine
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def chat(client, text: str, max_tokens: int = 8, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}],
                                          max_tokens=max_tokens, temperature=0, **kw)


# ------------------------------------------------------------------------------------------ template and parser

def encode_conversation(tok, messages, tools=None, fmt=None, **options) -> list[int]:
    """The prompt ids the server renders for these messages (its format: the tokenizer's, unless `fmt`)."""
    return encode_segments(tok, render(fmt or tok, messages, tools=tools, **options))


def test_k2_chat_template_renders_k3_messages(loaded):
    """The K2 template (chat.render_k2, what a K2-named tokenizer is served with), on a tokenizer that has K2's
    names too."""
    _, tok = loaded
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "-3 C"},
        {"role": "assistant", "content": "Cold: -3 C. <|im_end|>"},
        {"role": "user", "content": "Thanks"},
    ]
    ids = encode_segments(tok, render_k2(messages, tools=tools))
    assert tok.decode(ids) == (
        '<|im_system|>tool_declare<|im_middle|>' + json.dumps(tools) + '<|im_end|>'
        '<|im_system|>system<|im_middle|>Be brief.<|im_end|>'
        '<|im_user|>user<|im_middle|>Weather in Oslo?<|im_end|>'
        '<|im_assistant|>assistant<|im_middle|><think>Need the tool.</think>'
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n-3 C<|im_end|>'
        '<|im_assistant|>assistant<|im_middle|>Cold: -3 C. <|im_end|><|im_end|>'
        '<|im_user|>user<|im_middle|>Thanks<|im_end|>'
        '<|im_assistant|>assistant<|im_middle|>')
    # a special-token string typed into content stays text: 7 real <|im_end|> ids, not 8
    assert ids.count(tok.token_id("<|im_end|>")) == 7


def test_k2_output_parser_splits_reasoning_content_and_tool_calls_streaming(loaded):
    """Kimi K2's output format parsed into reasoning, content and two tool calls; fed in random pieces, the parts
    only ever grow, so the differences a stream sends join to the final message."""
    _, tok = loaded
    t = tok.token_id
    ids = ([t("<think>")] + tok.encode("Two cities, two calls. é") + [t("</think>")] + tok.encode("Checking ü…")
           + [t("<|tool_calls_section_begin|>")]
           + [t("<|tool_call_begin|>")] + tok.encode("functions.get_weather:0") + [t("<|tool_call_argument_begin|>")]
           + tok.encode('{"city": "Oslo"}') + [t("<|tool_call_end|>")]
           + [t("<|tool_call_begin|>")] + tok.encode(" functions.ns.lookup:1") + [t("<|tool_call_argument_begin|>")]
           + tok.encode("{}") + [t("<|tool_call_end|>"), t("<|tool_calls_section_end|>")])
    rng = random.Random(0)
    for trial in range(5):
        parser, reasoning, content = K2OutputParser(tok), TextDiff(), TextDiff()
        sent_r = sent_c = ""
        i = 0
        while i < len(ids):
            n = rng.randint(1, 3)
            parser.feed(ids[i:i + n])
            i += n
            final = i >= len(ids)
            if parser.reasoning is not None:
                sent_r += reasoning.update(parser.reasoning, final)
            sent_c += content.update(parser.content, final)
            assert len(parser.tool_calls) <= 2
        assert sent_r == parser.reasoning == "Two cities, two calls. é"
        assert sent_c == parser.content == "Checking ü…"
    assert parser.tool_calls == [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "functions.ns.lookup:1", "type": "function", "function": {"name": "ns.lookup", "arguments": "{}"}}]
    plain = K2OutputParser(tok)
    plain.feed(tok.encode("no reasoning here") + [t("</think>")] + tok.encode("!"))
    assert plain.reasoning is None and plain.content == "no reasoning here!" and plain.tool_calls == []
    cut = K2OutputParser(tok)  # a truncated output: reasoning so far, no content, no half-written tool call
    cut.feed([t("<think>")] + tok.encode("hmm"))
    assert (cut.reasoning, cut.content) == ("hmm", "")


# ------------------------------------------------------------------------------------------ the live server

def test_openai_client_chat_and_completions_streaming_and_not(client, server, loaded):
    model, tok = loaded
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).json()["status"] == "ok"

    r = chat(client, "Hello there, how are you?", max_tokens=9)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert r.usage.completion_tokens <= 9 and r.usage.prompt_tokens > 5
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    # the server's greedy tokens are the engine's, for the same prompt
    prompt = encode_conversation(tok, [{"role": "user", "content": "Hello there, how are you?"}])
    assert r.usage.prompt_tokens == len(prompt)
    want = make_engine(model).generate([prompt], SamplingParams(max_tokens=9, temperature=0.0,
                                                                stop_token_ids=chat_stop_ids(tok)))[0]
    parser = IdOutputParser(tok, "xtml")
    parsed = parser.feed(want.completion_ids)
    parsed += parser.finish()
    assert choice.message.content == parsed.content

    stream = chat(client, "Hello there, how are you?", max_tokens=9, stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    # K3 history (reasoning_content, tool_calls, a tool result) and tool definitions are accepted and templated
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "1 + 2?"},
               {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [
                   {"id": "functions.add:0", "type": "function", "function": {"name": "add", "arguments": "[1, 2]"}}]},
               {"role": "tool", "tool_call_id": "functions.add:0", "content": "3"}]
    r = client.chat.completions.create(model=NAME, messages=history, tools=tools, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == len(encode_conversation(tok, history, tools))
    assert r.choices[0].finish_reason in ("stop", "length")
    # the client's own message object goes back into the history as it came
    again = client.chat.completions.create(model=NAME, messages=history + [r.choices[0].message, {
        "role": "user", "content": "And 2 + 2?"}], tools=tools, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens

    c = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=7, temperature=0)
    assert c.choices[0].finish_reason in ("stop", "length") and c.usage.completion_tokens <= 7
    streamed = "".join(x.choices[0].text for x in client.completions.create(
        model=NAME, prompt="def f(x):", max_tokens=7, temperature=0, stream=True))
    assert streamed == c.choices[0].text
    ids = client.completions.create(model=NAME, prompt=[tok.bos_id] + tok.encode("def f(x):"), max_tokens=7,
                                    temperature=0)
    assert ids.choices[0].text == c.choices[0].text


def test_32_concurrent_clients_match_sequential_greedy(client, server):
    questions = [f"Question {i}: what is {i * 7} plus {i}?" + " Think." * (i % 5) for i in range(32)]
    sequential = [chat(client, q).choices[0].message.content for q in questions]
    steps = stats(server)["steps"]
    with ThreadPoolExecutor(32) as pool:
        concurrent = list(pool.map(lambda q: chat(client, q).choices[0].message.content, questions))
    assert concurrent == sequential
    # batched: far fewer engine steps than 32 requests x (prefill + 7 decode steps) run one at a time
    assert stats(server)["steps"] - steps < 32 * 8 / 2


def test_prefix_cache_shared_across_requests_and_isolated_by_cache_salt(client):
    text = "A long shared system prompt that many tenants send before their question. " * 2
    first = chat(client, text, extra_body={"cache_salt": "tenant-a"})
    assert first.usage.prompt_tokens > 32
    again = chat(client, text, extra_body={"cache_salt": "tenant-a"})
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    assert again.choices[0].message.content == first.choices[0].message.content
    other = chat(client, text, extra_body={"cache_salt": "tenant-b"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == first.choices[0].message.content


def test_client_disconnect_cancels_and_frees_pages(server):
    """A streaming client that hangs up after its first token, and a non-streaming one that times out: both are
    cancelled in the engine long before their 200 tokens, and every page they reserved is returned."""
    engine = server.engine
    # greedy, this prompt runs to the 200-token limit (about 1.5 s) when nobody cancels it (checked below)
    body = {"model": NAME, "prompt": "def f(x):", "max_tokens": 200, "temperature": 0}
    for stream in (True, False):
        wait_for(lambda: not engine.has_work())
        decoded, finished = stats(server)["decode_tokens"], stats(server)["finished"]
        with httpx.Client(timeout=TIMEOUT) as http:
            if stream:
                with http.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True)) as r:
                    assert r.status_code == 200
                    lines = r.iter_lines()
                    while not next(lines).startswith("data: {"):
                        pass
            else:
                with pytest.raises(httpx.ReadTimeout):
                    http.post(server.url + "/v1/completions", json=body, timeout=0.2)
        wait_for(lambda: stats(server)["finished"] == finished + 1 and not engine.has_work())
        assert stats(server)["decode_tokens"] - decoded < 200, stream  # stopped early
        assert engine.pool.reserved == 0 and stats(server)["running"] == 0
    with httpx.Client(timeout=TIMEOUT) as http:
        r = http.post(server.url + "/v1/completions", json=body).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 200


def test_non_streaming_disconnect_cancels_within_a_step(server):
    """A non-streaming client that hangs up while its request decodes: the engine cancels it within a step or two,
    not after the whole generation (tokens keep arriving, so the handler must watch the connection meanwhile)."""
    engine = server.engine
    body = {"model": NAME, "prompt": "def f(x):", "max_tokens": 240, "temperature": 0}
    wait_for(lambda: not engine.has_work())
    before = dict(stats(server))
    with httpx.Client(timeout=TIMEOUT) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(server.url + "/v1/completions", json=body, timeout=0.3)
    gone = stats(server)["decode_tokens"]
    wait_for(lambda: stats(server)["finished"] == before["finished"] + 1 and not engine.has_work())
    after = stats(server)
    assert after["decode_tokens"] - gone <= 10, "decoded on after the client left"
    assert after["decode_tokens"] - before["decode_tokens"] < 200
    assert engine.pool.reserved == 0 and after["running"] == 0


def test_bad_requests_get_openai_error_bodies(server):
    url = server.url + "/v1/chat/completions"
    ok = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        (dict(ok, model="gpt-4"), 404, "gpt-4"),
        (dict(ok, temperature=5), 400, "temperature"),
        (dict(ok, top_p=0), 400, "top_p"),
        (dict(ok, max_tokens=0), 400, "max_tokens"),
        (dict(ok, max_tokens=MAX_CONTEXT), 400, "max_tokens"),
        (dict(ok, n=2), 400, "n"),
        (dict(ok, logprobs=True), 400, "logprobs"),
        (dict(ok, messages=[{"role": "user", "content": "word " * MAX_CONTEXT}]), 400, "context"),
        (dict(ok, messages=[]), 400, "messages"),
        (dict(ok, messages=[{"role": "robot", "content": "x"}]), 400, "role"),
        (dict(ok, messages=[{"role": "tool", "content": "x"}]), 400, "tool_call_id"),
        (dict(ok, messages=[{"role": "user", "content": "x", "reasoning_content": "y"}]), 400, "reasoning_content"),
        (dict(ok, messages="hi"), 400, "messages"),
        ({k: v for k, v in ok.items() if k != "model"}, 400, "model"),
    ]
    with httpx.Client(timeout=TIMEOUT) as http:
        for body, status, needle in cases:
            r = http.post(url, json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert needle in err["message"] and err["type"] == "invalid_request_error", (body, err)
        r = http.post(url, content=b'{"model": "k3-test", "messages": [', headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = http.post(server.url + "/v1/completions", json={"model": NAME, "prompt": [10**9], "max_tokens": 2})
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
        r = http.get(server.url + "/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()


def test_types_are_strict_as_in_openai(server):
    """JSON booleans are not integers and a string is not a boolean: a 400 naming the field, wherever an int or a
    bool is taken (pydantic's lax mode would take `true` as 1 and "yes" as True)."""
    chat_ok = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cmpl_ok = {"model": NAME, "prompt": "x", "max_tokens": 2}
    cases = [(dict(chat_ok, **{field: value}), field) for field, value in [
        ("max_tokens", True), ("max_completion_tokens", True), ("n", True), ("seed", True), ("top_k", True),
        ("temperature", True), ("top_p", True), ("max_tokens", "2"), ("stream", "yes"), ("stream", 1),
        ("parallel_tool_calls", "yes")]]
    cases += [(dict(cmpl_ok, prompt=[1, True]), "prompt"), (dict(cmpl_ok, stream="true"), "stream"),
              (dict(cmpl_ok, stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
              (dict(cmpl_ok, stream="yes", stream_options={"include_usage": True}), "stream")]
    with httpx.Client(timeout=TIMEOUT) as http:
        for body, field in cases:
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            r = http.post(server.url + path, json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == field and field in err["message"], (body, err)


def test_stream_options_need_stream_true(server):
    """As OpenAI: stream_options without `stream: true` is a 400 naming stream_options."""
    chat_ok = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cmpl_ok = {"model": NAME, "prompt": "x", "max_tokens": 2}
    with httpx.Client(timeout=TIMEOUT) as http:
        for path, ok in [("/v1/chat/completions", chat_ok), ("/v1/completions", cmpl_ok)]:
            for extra in ({}, {"stream": False}):
                r = http.post(server.url + path, json=dict(ok, stream_options={"include_usage": True}, **extra))
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == "stream_options" and "stream" in err["message"], err


def test_completions_usage_chunk_has_no_choices(client):
    """The usage chunk of a completions stream has `choices: []`, as chat's does; the finish chunk before it
    carries the finish_reason."""
    chunks = list(client.completions.create(model=NAME, prompt="def f(x):", max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_openapi_documents_400_not_422(server):
    """The server answers a validation error with 400 (OpenAI's error body), so its OpenAPI document must say 400."""
    doc = httpx.get(server.url + "/openapi.json", timeout=TIMEOUT).json()
    assert "422" not in json.dumps(doc)
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert "400" in doc["paths"][path]["post"]["responses"], path


def test_tool_parameters_must_be_a_json_schema_object(server):
    """A tool's `function.parameters` is a JSON Schema of type "object" (or {}, no parameters): else a 400 naming
    the tool by its index."""
    good = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    user = [{"role": "user", "content": "hi"}]
    with httpx.Client(timeout=TIMEOUT) as http:
        for parameters in ("a string", [], {"type": "string"}, {"properties": {"x": {}}},
                           {"type": "object", "properties": []}, {"type": "object", "required": "x"}):
            tools = [good, {"type": "function", "function": {"name": "g", "parameters": parameters}}]
            r = http.post(server.url + "/v1/chat/completions",
                          json={"model": NAME, "messages": user, "max_tokens": 2, "tools": tools})
            assert r.status_code == 400, (parameters, r.text)
            err = r.json()["error"]
            assert err["param"] == "tools.1.function.parameters" and "tools.1" in err["message"], err
        for parameters in ({}, {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}):
            tools = [{"type": "function", "function": {"name": "g", "parameters": parameters}}]
            r = http.post(server.url + "/v1/chat/completions",
                          json={"model": NAME, "messages": user, "max_tokens": 2, "tools": tools})
            assert r.status_code == 200, (parameters, r.text)


def test_lone_surrogates_are_refused_naming_the_field(server):
    """Valid JSON may escape a lone surrogate ("\\ud800"), which no UTF-8 tokenizer can encode: a 400 naming the
    field, never a 500."""
    user = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": "f", "description": "@", "parameters": {"type": "object"}}}
    call = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "@"}]}, "messages.0.content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "@"}]}]},
         "messages.0.content.0.text"),
        ("/v1/chat/completions", {"messages": [user], "tools": [tool]}, "tools.0.function.description"),
        ("/v1/chat/completions", {"messages": [user, {"role": "assistant", "tool_calls": [call]},
                                               {"role": "tool", "tool_call_id": "@", "content": "1"}]},
         "messages.2.tool_call_id"),
        ("/v1/chat/completions", {"messages": [user], "tools": [dict(tool, function={
            "name": "f", "parameters": {"@": 1}})]}, "tools.0.function.parameters"),
        ("/v1/completions", {"prompt": "x = @"}, "prompt"),
    ]
    with httpx.Client(timeout=TIMEOUT) as http:
        for path, fields, param in cases:
            raw = json.dumps({"model": NAME, "max_tokens": 2, **fields}).replace("@", "\\ud800")
            r = http.post(server.url + path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (fields, r.text)
            err = r.json()["error"]
            assert err["param"] == param and "surrogate" in err["message"] and param in err["message"], err


def test_large_bodies_tokenise_off_the_event_loop_and_over_the_limit_get_413(loaded):
    """A body under the limit that takes about a second to tokenise does not stop /health (or anyone else) being
    answered meanwhile; a body over the limit is refused at once with 413, before it is parsed."""
    model, tok = loaded
    srv = Server(create_app(make_engine(model), tok, NAME, max_context=MAX_CONTEXT, max_body_bytes=2 << 20)).start()
    try:
        text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
        big = {"model": NAME, "prompt": (text * 60)[:1 << 20], "max_tokens": 1}  # about 1 s of tokenising
        result = {}
        worker = threading.Thread(target=lambda: result.update(r=httpx.post(srv.url + "/v1/completions", json=big,
                                                                              timeout=TIMEOUT)))
        with httpx.Client(timeout=TIMEOUT) as http:
            worker.start()
            time.sleep(0.2)  # the big body has been received and is being tokenised
            t0 = time.monotonic()
            assert http.get(srv.url + "/health").status_code == 200
            assert time.monotonic() - t0 < 0.5 and worker.is_alive(), "/health waited for the tokeniser"
            worker.join(TIMEOUT)
            assert result["r"].status_code == 400 and "context" in result["r"].json()["error"]["message"]
            huge = dict(big, prompt="x" * (3 << 20))
            t0 = time.monotonic()
            r = http.post(srv.url + "/v1/completions", json=huge)
            assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"], r.text
            assert time.monotonic() - t0 < 1.0
            chunked = http.post(srv.url + "/v1/completions", content=iter([b"x" * (1 << 20)] * 3))
            assert chunked.status_code == 413
    finally:
        srv.stop()


def test_nan_logits_fail_one_request_and_the_server_serves_on(loaded, monkeypatch):
    """A request whose logits turn NaN gets a 500 (non-streaming) or an error event (streaming) naming the cause;
    the engine thread lives on, so /health is ok and the next request succeeds."""
    model, tok = loaded
    engine = make_engine(model)
    forward, poison = engine._forward, [7, 7, 7, 7]

    def poisoned(model, pool, seqs, kda, tokens, logits_to_keep=0):
        logits = forward(model, pool, seqs, kda, tokens, logits_to_keep)
        for b, s in enumerate(seqs):
            if any(r.seq is s and r.prompt == poison for r in engine.prefilling + engine.running):
                logits[b] = float("nan")
        return logits

    monkeypatch.setattr(engine, "_forward", poisoned)
    srv = Server(create_app(engine, tok, NAME, max_context=MAX_CONTEXT)).start()
    try:
        bad = {"model": NAME, "prompt": poison, "max_tokens": 4, "temperature": 1.0}
        with httpx.Client(timeout=TIMEOUT) as http:
            r = http.post(srv.url + "/v1/completions", json=bad)
            assert r.status_code == 500 and "NaN" in r.json()["error"]["message"], r.text
            r = http.post(srv.url + "/v1/completions", json=dict(bad, stream=True))
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert "NaN" in events[-1]["error"]["message"], r.text
            assert http.get(srv.url + "/health").status_code == 200
            r = http.post(srv.url + "/v1/completions", json=dict(bad, prompt="x = ", temperature=0))  # greedy: no chance stop
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert engine.pool.reserved == 0
    finally:
        srv.stop()


def test_serve_command_defaults_to_localhost():
    parser = argparse.ArgumentParser()
    register_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", "some/dir"])
    assert (args.host, args.port, args.fn, args.threads) == ("127.0.0.1", 8000, cmd_serve, 1)
    with pytest.raises(ValueError, match="--threads=0"):
        cmd_serve(parser.parse_args(["serve", "--model", "x", "--threads", "0"]))
    with pytest.raises(ValueError, match="--cache-tokens=8"):
        cmd_serve(parser.parse_args(["serve", "--model", "x", "--cache-tokens", "8"]))


def test_api_key_required_when_configured(loaded):
    model, tok = loaded
    with TestClient(create_app(make_engine(model), tok, NAME, api_key="s3cret")) as http:
        assert http.get("/v1/models").status_code == 401
        r = http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert http.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).json()["data"][0]["id"] == NAME
        assert http.get("/health").status_code == 200
    n = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_context={n + 1} .*max_position_embeddings={n}"):
        create_app(make_engine(model), tok, NAME, max_context=n + 1)
    with TestClient(create_app(make_engine(model), tok, NAME, api_key="")) as http:  # OPENK3_API_KEY="": open
        assert http.get("/v1/models").status_code == 200


def test_metrics_in_prometheus_format(client, server):
    chat(client, "metrics please")
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['openk3_requests_total{endpoint="chat",finish_reason="length"}'] >= 1
    assert values["openk3_prompt_tokens_total"] > 0 and values["openk3_completion_tokens_total"] > 0
    assert 0 <= values["openk3_prefix_cache_hit_rate"] <= 1
    assert values["openk3_time_to_first_token_seconds_count"] >= 1
    assert values['openk3_request_latency_seconds_bucket{le="+Inf"}'] == values["openk3_request_latency_seconds_count"]
    assert values["openk3_queue_depth"] == 0 and values["openk3_running_requests"] == 0


def test_graceful_shutdown_finishes_in_flight_requests(loaded):
    model, tok = loaded
    engine = make_engine(model)
    srv = Server(create_app(engine, tok, NAME, max_context=MAX_CONTEXT)).start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=chat(client, "A long answer, please.", max_tokens=40)))
    worker.start()
    wait_for(lambda: stats(srv)["running"] == 1 and stats(srv)["decode_tokens"] >= 2)
    srv.stop()
    worker.join(TIMEOUT)
    assert not worker.is_alive()
    r = result["r"]
    assert r.usage.completion_tokens == 40 or r.choices[0].finish_reason == "stop"
    assert engine.stats()["running"] == 0


# ------------------------------------------------------------------------------------------ fuzzing

JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats() | st.text(max_size=12),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=8)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"])},
    optional={"content": st.text(max_size=30) | JSON, "reasoning_content": st.text(max_size=10) | JSON,
              "tool_call_id": st.text(max_size=10), "tool_calls": JSON | st.just(
                  [{"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}])})
# per field: values in and out of range, and arbitrary JSON
FIELDS = {
    "model": st.just(NAME) | JSON, "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 500), max_size=5) | JSON,
    "max_tokens": st.integers(-3, 30) | JSON, "temperature": st.floats(-1, 3) | JSON, "top_p": st.floats(-1, 2),
    "top_k": st.integers(-2, 5), "seed": st.integers(-1, 2**64), "stream": st.booleans() | JSON,
    "cache_salt": st.text(max_size=5) | JSON, "n": st.integers(0, 3), "tool_choice": JSON,
    "tools": JSON | st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "stream_options": JSON | st.just({"include_usage": True}), "logprobs": JSON}
VALID = {"/v1/chat/completions": {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
         "/v1/completions": {"model": NAME, "prompt": "x = ", "max_tokens": 3}}


@pytest.fixture(scope="module")
def asgi(loaded):
    model, tok = loaded
    # a short context: every fuzzed body that is valid generates only a few tokens
    with TestClient(create_app(make_engine(model), tok, NAME, max_context=24), raise_server_exceptions=False) as c:
        yield c


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_bodies_never_500(asgi, data):
    """Raw bytes, arbitrary JSON objects, and valid bodies with a few fields replaced: always a 2xx or a 4xx with
    an error body, never a 500."""
    path = data.draw(st.sampled_from(sorted(VALID)))
    kind = data.draw(st.sampled_from(["raw", "object", "mutated", "mutated"]))
    if kind == "raw":
        body, content = None, data.draw(st.binary(max_size=40))
    else:
        body = {} if kind == "object" else dict(VALID[path])
        for key in data.draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
            body[key] = data.draw(FIELDS[key])
        content = json.dumps(body).encode()
    r = asgi.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert isinstance(r.json()["error"]["message"], str)
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["usage"]["completion_tokens"] >= 1


# ------------------------------------------------------------------------------------------ K3's XTML format served

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "number"}}}}}]
# what the model writes after the generation prompt (<|open|>message role="assistant"<|sep|><|open|>think<|sep|>)
XTML_COMPLETION = ('Hm, é.<|close|>think<|sep|><|open|>response<|sep|>Oslo ü…<|close|>response<|sep|>'
                   '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
                   '<|open|>argument key="city" type="string"<|sep|>Oslo<|close|>argument<|sep|>'
                   '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>'
                   '<|close|>tools<|sep|><|end_of_msg|>')  # the message close elided: <|end_of_msg|> ends it


def scripted(engine: Engine, script: list[int]) -> list[list[int]]:
    """Make the engine emit `script` (one id per sampled token, whatever the model samples) and record the prompt of
    every request; the returned list fills with those prompts."""
    prompts, submit, emit = [], engine.submit, engine._emit

    def record(prompt, *a, **k):
        prompts.append(list(prompt))
        return submit(prompt, *a, **k)

    def replace(req, tokens, logprobs, outputs):
        n = len(req.output)
        return emit(req, [script[min(n + i, len(script) - 1)] for i in range(len(tokens))], logprobs, outputs)

    engine.submit, engine._emit = record, replace
    return prompts


@pytest.fixture(scope="module")
def xtml_server(loaded):
    model, tokenizer = loaded
    engine = make_engine(model)
    srv = Server(create_app(engine, tokenizer, NAME, max_context=MAX_CONTEXT)).start()
    srv.prompts = scripted(engine, tokenizer.encode(XTML_COMPLETION, allow_special=True))
    yield srv
    srv.stop()


def test_xtml_reasoning_content_and_tool_calls_through_the_openai_client(xtml_server, loaded):
    """A trained BPE (both name sets) speaks XTML: the prompt the engine gets is chat.render + encode_segments of the
    request (with effort, tool choice and response format), the output is parsed into reasoning_content, content and
    tool_calls, streaming (OpenAI's deltas) and not, and usage.prompt_tokens is the rendered prompt's length."""
    _, tok = loaded
    assert chat_format_for(tok) == "xtml"
    client = openai.OpenAI(base_url=xtml_server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    want_call = {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 2})}
    for kw, options in [
            ({}, {}),
            ({"reasoning_effort": "high", "tool_choice": "required"}, {"effort": "high", "tool_choice": "required"}),
            ({"extra_body": {"chat_template_kwargs": {"thinking_effort": "max"}},
              "response_format": {"type": "json_object"}},
             {"effort": "max", "response_format": {"type": "json_object"}})]:
        r = client.chat.completions.create(model=NAME, messages=messages, tools=WEATHER, max_tokens=200,
                                           temperature=0, **kw)
        prompt = encode_conversation(tok, messages, WEATHER, **options)
        assert xtml_server.prompts[-1] == prompt and r.usage.prompt_tokens == len(prompt)
        assert tok.decode(prompt).endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
        m = r.choices[0].message
        assert m.reasoning_content == "Hm, é." and m.content == "Oslo ü…"
        assert [c.function.model_dump() for c in m.tool_calls] == [want_call]
        assert m.tool_calls[0].id == "functions.get_weather:0" and r.choices[0].finish_reason == "tool_calls"
        if kw:
            continue  # the stream of one of them is enough
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, tools=WEATHER, max_tokens=200,
                                                     temperature=0, stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == m.reasoning_content
        assert "".join(d.content or "" for d in deltas) == m.content
        calls = [c for d in deltas for c in d.tool_calls or []]
        assert [(c.index, c.id, c.function.model_dump()) for c in calls] == [(0, m.tool_calls[0].id, want_call)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # thinking off: the prompt opens the response channel and the output is all answer
    messages = [{"role": "user", "content": "hi"}]
    for kw in ({"reasoning_effort": "none"}, {"extra_body": {"chat_template_kwargs": {"thinking": False}}}):
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0, **kw)
        assert xtml_server.prompts[-1] == encode_conversation(tok, messages, thinking=False)
        assert getattr(r.choices[0].message, "reasoning_content", None) is None
        assert "Hm, é.".startswith(r.choices[0].message.content) and r.choices[0].finish_reason == "length"
    # a past turn's reasoning and tool call, and the tool's result, go back into the prompt as XTML
    history = messages + [r.choices[0].message.model_dump(exclude_none=True) | {
        "reasoning_content": "r", "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                                  "function": want_call}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "-3 C"}]
    r = client.chat.completions.create(model=NAME, messages=history, tools=WEATHER, max_tokens=2, temperature=0)
    history[1] = {k: v for k, v in history[1].items() if k in ("role", "content", "reasoning_content", "tool_calls")}
    assert xtml_server.prompts[-1] == encode_conversation(tok, history, WEATHER)


def test_chat_options_get_a_400_naming_the_field(xtml_server):
    ok = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    cases = [
        (dict(ok, reasoning_effort="medium"), "reasoning_effort"),
        (dict(ok, reasoning_effort="high", chat_template_kwargs={"thinking": False}), "reasoning_effort"),
        (dict(ok, reasoning_effort="none", chat_template_kwargs={"thinking": True}), "reasoning_effort"),
        (dict(ok, reasoning_effort="low", chat_template_kwargs={"thinking_effort": "max"}),
         "chat_template_kwargs.thinking_effort"),
        (dict(ok, chat_template_kwargs={"thinking": "yes"}), "chat_template_kwargs.thinking"),
        (dict(ok, chat_template_kwargs={"enable_thinking": True}), "chat_template_kwargs.enable_thinking"),
        (dict(ok, tool_choice="required"), "tool_choice"),  # no tools to call
        (dict(ok, tool_choice="sometimes"), "tool_choice"),
        (dict(ok, response_format={"type": "yaml"}), "response_format.type"),
        (dict(ok, response_format={"type": "json_schema"}), "response_format"),
        (dict(ok, response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format.json_schema"),
        (dict(ok, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "b", "content": "x"}]), "messages.2"),
    ]
    with httpx.Client(timeout=TIMEOUT) as http:
        for body, param in cases:
            r = http.post(xtml_server.url + "/v1/chat/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param, (body, err)
        r = http.post(xtml_server.url + "/v1/chat/completions", json=dict(ok, response_format=schema))
        assert r.status_code == 200, r.text


def tiktoken_model_dir(path: Path, names: str) -> Path:
    """A random-init small K3 with a release-style tiktoken.model of byte ranks: bare (K3's names, as the release)
    or with a tokenizer_config.json naming the block K2's way."""
    import base64

    from openk3.text.tokenizer import K2_SPECIAL_TOKEN_OFFSETS, Tokenizer

    path.mkdir()
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    if names == "k2":
        decoder = {str(len(ranks) + o): {"content": n, "special": True} for n, o in K2_SPECIAL_TOKEN_OFFSETS.items()}
        (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    tok = Tokenizer.load(path)
    torch.manual_seed(0)
    config = small_config().replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                                    pad_token_id=tok.pad_id)
    save_pretrained(K3ForCausalLM(config), path)
    return path


@pytest.mark.parametrize("names,fmt", [("bare", "xtml"), ("k2", "k2")])
def test_a_tiktoken_model_serves_and_chats_in_its_format(tmp_path, capsys, names, fmt):
    """A bare release-style tiktoken.model has K3's names only (no <|im_end|>): served and chatted in XTML, no
    KeyError; one with K2's names in a tokenizer_config.json in K2's template. Both stop at their end token."""
    from openk3.serve.engine import register_commands as engine_commands

    path = tiktoken_model_dir(tmp_path / "model", names)
    model, tok, _ = load_for_inference(path)
    assert chat_format_for(tok) == fmt
    end = "<|end_of_msg|>" if fmt == "xtml" else "<|im_end|>"
    assert chat_stop_ids(tok) == tuple(sorted({tok.token_id(end), tok.eos_id}))
    engine = make_engine(model)
    answer = "r<|close|>think<|sep|><|open|>response<|sep|>hello<|close|>response<|sep|>" if fmt == "xtml" else \
        "<think>r</think>hello"
    prompts = scripted(engine, tok.encode(answer + end, allow_special=True))
    messages = [{"role": "user", "content": "hello"}]
    with TestClient(create_app(engine, tok, NAME, max_context=MAX_CONTEXT)) as http:
        r = http.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 40})
        assert r.status_code == 200, r.text
        assert prompts[-1] == encode_conversation(tok, messages)
        message = r.json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("r", "hello")
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        if fmt == "k2":  # K2's template has no thinking-effort message
            r = http.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 4,
                                                        "reasoning_effort": "high"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
            for field, value, param in [("reasoning_effort", "none", "reasoning_effort"),
                                        ("chat_template_kwargs", {"thinking": False}, "chat_template_kwargs.thinking"),
                                        ("tool_choice", "required", "tool_choice"),
                                        ("response_format", {"type": "json_object"}, "response_format")]:
                r = http.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 4,
                                                            field: value})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

    parser = argparse.ArgumentParser()
    engine_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chat", "--model", str(path), "--max-tokens", "4", "--temperature", "0",
                              "--device", "cpu", "--system", "Be brief."])
    lines = ["hello", "hello hello"]
    args.fn(args, read=lambda _: lines.pop(0) if lines else "")
    shown = capsys.readouterr().out
    cached = [int(line.split("[")[-1].split("/")[0]) for line in shown.splitlines() if "prefix cache" in line]
    assert len(cached) == 2
