"""Chat encodings and the output parser (K3_SPEC.md section 9).

    segments = render_xtml(messages, tools=tools, effort="high")   # [(text, allow_special), ...]
    ids = encode_segments(tokenizer, segments)                       # segment by segment, never re-joined
    parsed = parse_output(model_text)                                # ParsedOutput(reasoning_content, content, tool_calls)

    parser = OutputParser(); for chunk in stream: delta = parser.feed(chunk); ...; delta = parser.finish()

Two encodings, chosen from the tokenizer's special tokens by `chat_format_for`:
- "xtml" (K3): `<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>`; tag names, attributes
  and all message text are plain-text segments, so user text spelling `<|open|>` is ordinary bytes.
- "k2" (Kimi K2 / Kimi-Linear): `<|im_user|>user<|im_middle|>hi<|im_end|>`, for tokenizers with K2's names only.

The server and `openk3 chat` use both through `render` + `encode_segments`, `chat_stop_ids` and `IdOutputParser`
(generated ids -> ParsedOutput deltas in either format).

Messages are OpenAI-style dicts: system (or developer), user (optional name), assistant (reasoning_content,
content, tool_calls), tool (tool_call_id, content). Content is a string, None, or a list of parts
{"type": "text", "text"} / {"type": "image_url" | "image", "width", "height"} (the image's original size).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

Segment = tuple[str, bool]  # (text, allow_special): a marker (one special token) or plain text

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"
XTML_MARKERS = (OPEN, CLOSE, SEP, END)
K2_MARKERS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")
TAGS = ("message", "think", "response", "tools", "call", "argument", "json")
EFFORTS = ("low", "high", "max")
ROLES = ("system", "developer", "user", "assistant", "tool")

# The internal system messages' bodies, verbatim from K3_SPEC.md section 9 (the model was trained on them).
TOOL_DECLARE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
THINKING_EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                   "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                   "Now the system is invoked with `thinking_effort={effort}`.")
TOOL_CHOICE = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
RESPONSE_FORMAT = ("The system is invoked with `response_format={kind}`.\nYour response must be raw JSON data "
                   "without markdown code blocks (```json) or any additional formatting.")
RESPONSE_SCHEMA = "\nThe JSON data must match the following schema:\n```json\n{schema}\n```"


def chat_format_for(tokenizer) -> str:
    """"xtml" if the tokenizer has K3's markers (the release, and BPEs trained here), else "k2" if it has K2's."""
    names = tokenizer.special_tokens
    if all(m in names for m in XTML_MARKERS):
        return "xtml"
    if all(m in names for m in K2_MARKERS):
        return "k2"
    raise ValueError(f"the tokenizer has neither K3's chat markers {list(XTML_MARKERS)} nor K2's {list(K2_MARKERS)}")


def render(tokenizer_or_format, messages: list, **options) -> list[Segment]:
    """Render with the encoding `chat_format_for` picks (or a format name): see render_xtml / render_k2."""
    fmt = tokenizer_or_format if isinstance(tokenizer_or_format, str) else chat_format_for(tokenizer_or_format)
    if fmt == "xtml":
        return render_xtml(messages, **options)
    if fmt == "k2":
        return render_k2(messages, **options)
    raise ValueError(f"unknown chat format {fmt!r}; expected 'xtml' or 'k2'")


def segments_text(segments: list[Segment]) -> str:
    return "".join(text for text, _ in segments)


def encode_segments(tokenizer, segments: list[Segment]) -> list[int]:
    """Segment by segment: a special segment is its one id, a plain one is encoded with no special tokens allowed
    (so it can never produce a special id). BPE never merges across a boundary."""
    plain = tokenizer.encode_batch([t for t, special in segments if not special])
    ids, k = [], 0
    for text, special in segments:
        if special:
            ids.append(tokenizer.token_id(text))
        else:
            ids += plain[k]
            k += 1
    return ids


# ------------------------------------------------------------------------------------------ XTML rendering

def _attr_escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, **attrs: str) -> list[Segment]:
    # NOTE: the release splits each attribute into ` key`, `="`, value, `"` (four plain segments).
    segs = [(OPEN, True), (tag, False)]
    for key, value in attrs.items():
        segs += [(f" {key}", False), ('="', False)] + ([(_attr_escape(value), False)] if value else []) + [('"', False)]
    return segs + [(SEP, True)]


def _close(tag: str) -> list[Segment]:
    return [(CLOSE, True), (tag, False), (SEP, True)]


def _text(text: str) -> list[Segment]:
    return [(text, False)] if text else []


def _message(attrs: dict, body: list[Segment]) -> list[Segment]:
    return _open("message", **attrs) + body + _close("message") + [(END, True)]


def _compact(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _json_type(value) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    return "object" if isinstance(value, dict) else "array"


def media_prompt(width: int, height: int) -> list[Segment]:
    """One image's place in a prompt (K3_SPEC section 9), with its ORIGINAL width and height:
    `<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>`; the one pad is the slot of its
    vision vectors (openk3.vision.model.expand_media_pads writes one pad per vector)."""
    return [(MEDIA_BEGIN, True), (f"image {width}x{height}", False), (MEDIA_CONTENT, True), (MEDIA_PAD, True),
            (MEDIA_END, True)]


def _content(content, where: str, images: bool) -> list[Segment]:
    """Message content (str, None or a list of parts) as plain text and media prompts."""
    if content is None:
        return []
    if isinstance(content, str):
        return _text(content)
    if not isinstance(content, list):
        raise ValueError(f"{where}: field 'content' must be a string, null or a list of parts, "
                         f"got {type(content).__name__}")
    segs = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            segs += _text(part["text"])
        elif kind in ("image_url", "image") and images:
            w, h = part.get("width"), part.get("height")
            if not (isinstance(w, int) and isinstance(h, int) and w > 0 and h > 0):
                raise ValueError(f"{where}: content part {j} is an image without positive integer 'width' and "
                                 f"'height' (its original size, written into the media prompt)")
            segs += media_prompt(w, h)
        else:
            allowed = "'text' or 'image_url'" if images else "'text'"
            raise ValueError(f"{where}: content part {j} must be {{'type': {allowed}, ...}}, got {part!r:.80}")
    return segs


def _plain(content, where: str) -> str:
    return segments_text(_content(content, where, images=False))


def _tool_calls(calls, where: str) -> list[Segment]:
    if not isinstance(calls, list):
        raise ValueError(f"{where}: field 'tool_calls' must be a list, got {type(calls).__name__}")
    segs = _open("tools")
    for n, call in enumerate(calls, start=1):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}: tool_calls[{n - 1}] needs 'function': {{'name': str, 'arguments': ...}}")
        segs += _open("call", tool=fn["name"], index=str(n))
        raw = fn.get("arguments", "{}")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError:
            args = None
        if isinstance(args, dict):
            for key, value in args.items():
                body = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                segs += _open("argument", key=str(key), type=_json_type(value)) + _text(body) + _close("argument")
        else:
            # NOTE: the raw-JSON escape hatch: arguments that are not a JSON object are written whole.
            raw = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
            segs += _open("json", type="object") + _text(raw) + _close("json")
        segs += _close("call")
    return segs + _close("tools")


def render_xtml(messages: list, *, tools: list | None = None, thinking: bool = True, effort: str | None = None,
                tool_choice=None, response_format=None, add_generation_prompt: bool = True) -> list[Segment]:
    """OpenAI-style messages -> K3 prompt segments, in the spec's order: tool-declare, thinking-effort, the
    conversation, tool-choice, response-format, the generation prompt. No BOS."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    if effort is not None and effort not in EFFORTS:
        raise ValueError(f"effort={effort!r} is not supported; expected one of {list(EFFORTS)}")
    if effort is not None and not thinking:
        raise ValueError(f"effort={effort!r} needs thinking on (the effort message guides the thinking channel)")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    segs = []
    if tools:
        segs += _message({"role": "system", "type": "tool-declare"}, _text(TOOL_DECLARE.format(tools=_compact(tools))))
    if effort is not None:
        segs += _message({"role": "system", "type": "thinking-effort"}, _text(THINKING_EFFORT.format(effort=effort)))
    segs += _conversation(messages, thinking)
    if tool_choice not in (None, "auto"):
        if tool_choice not in TOOL_CHOICE:
            raise ValueError(f"tool_choice={tool_choice!r} is not supported; expected 'auto', 'required' or 'none'")
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice='required' needs tools")
        segs += _message({"role": "system", "type": "tool-choice"}, _text(TOOL_CHOICE[tool_choice]))
    if response_format is not None:
        segs += _response_format(response_format)
    if add_generation_prompt:
        segs += _open("message", role="assistant") + _open("think" if thinking else "response")
    return segs


def _response_format(rf) -> list[Segment]:
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return []
    if kind == "json_object":
        body = RESPONSE_FORMAT.format(kind=kind)
    elif kind == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
        body = RESPONSE_FORMAT.format(kind=kind) + RESPONSE_SCHEMA.format(schema=_compact(schema))
    else:
        raise ValueError(f"response_format {rf!r:.80} is not supported; expected type text, json_object or json_schema")
    return _message({"role": "system", "type": "response-format"}, _text(body.strip()))


def _list(value) -> list:
    return value if isinstance(value, list) else []  # a non-list tool_calls is reported by _tool_calls


def _ordered(messages: list) -> list[tuple[int, dict]]:
    """(index, message) pairs with each run of tool messages re-ordered into the preceding assistant's tool_calls
    order by tool_call_id; every message is checked to be a dict with a known role."""
    out, calls, i = [], {}, 0
    while i < len(messages):
        m = messages[i]
        if not isinstance(m, dict):
            raise ValueError(f"message {i} must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i}: unknown role {role!r}; expected one of {list(ROLES)}")
        if role != "tool":
            if role == "assistant":
                calls = {c.get("id"): n for n, c in enumerate(_list(m.get("tool_calls"))) if isinstance(c, dict)}
            out.append((i, m))
            i += 1
            continue
        run = []
        while i < len(messages) and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
            t = messages[i]
            cid = t.get("tool_call_id")
            if cid not in calls:
                raise ValueError(f"message {i}: field 'tool_call_id' {cid!r} matches no tool call of the assistant "
                                 f"message before it (ids {sorted(k for k in calls if k is not None)})")
            run.append((calls[cid], i, t))
            i += 1
        out += [(j, t) for _, j, t in sorted(run)]
    return out


def _render_message(i: int, m: dict, thinking: bool) -> list[Segment]:
    where, role = f"message {i}", m["role"]
    for key in m:
        if key not in ("role", "content", "name", "reasoning_content", "tool_calls", "tool_call_id"):
            raise ValueError(f"{where}: unknown field {key!r}")
    name = m.get("name")
    if name is not None and (role not in ("system", "developer", "user") or not isinstance(name, str)):
        raise ValueError(f"{where}: field 'name' is only for system and user messages, as a string")
    if role in ("system", "developer", "user"):
        attrs = {"role": "user" if role == "user" else "system", **({"name": name} if name else {})}
        return _message(attrs, _content(m.get("content"), where, images=True))
    reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"{where}: field 'reasoning_content' must be a string")
    body = (_open("think") + _text(reasoning or "") + _close("think")) if thinking else []
    body += _open("response") + _text(_plain(m.get("content"), where)) + _close("response")
    if m.get("tool_calls"):
        body += _tool_calls(m["tool_calls"], where)
    return _message({"role": "assistant"}, body)


def _tool_result(m: dict, where: str, name: str, n: int) -> list[Segment]:
    return _message({"role": "tool", "tool": name, "index": str(n)}, _content(m.get("content"), where, images=True))


def _conversation(messages: list, thinking: bool) -> list[Segment]:
    """The conversation, tool messages included (their name and index need the assistant before them)."""
    segs, calls, n = [], [], 0
    for i, m in _ordered(messages):
        if m["role"] == "tool":
            n += 1
            ids = {c.get("id"): c for c in calls}
            segs += _tool_result(m, f"message {i}", ids[m["tool_call_id"]]["function"]["name"], n)
            continue
        if m["role"] == "assistant":
            calls, n = [c for c in _list(m.get("tool_calls")) if isinstance(c, dict)], 0
        segs += _render_message(i, m, thinking)
    return segs


# ------------------------------------------------------------------------------------------ K2 rendering

def render_k2(messages: list, *, tools: list | None = None, add_generation_prompt: bool = True,
              **unsupported) -> list[Segment]:
    """Kimi K2's template as segments (docs/server.md, "The K2 template")."""
    bad = {k: v for k, v in unsupported.items() if v not in (None, True, "auto")}
    if bad:
        raise ValueError(f"the K2 chat format has no {sorted(bad)} option")

    def block(role_token, name, body):
        return [(role_token, True)] + _text(name) + [("<|im_middle|>", True)] + _text(body) + [("<|im_end|>", True)]

    segs = block("<|im_system|>", "tool_declare", json.dumps(tools, ensure_ascii=False)) if tools else []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"message {i}: unknown role {m.get('role') if isinstance(m, dict) else m!r}")
        role, text = m["role"], _plain(m.get("content"), f"message {i}")
        if role == "assistant":
            segs += [("<|im_assistant|>", True), ("assistant", False), ("<|im_middle|>", True)]
            if m.get("reasoning_content"):
                segs += [("<think>", True)] + _text(m["reasoning_content"]) + [("</think>", True)]
            segs += _text(text)
            if m.get("tool_calls"):
                segs.append(("<|tool_calls_section_begin|>", True))
                for n, call in enumerate(m["tool_calls"]):
                    call_id = call.get("id") or f"functions.{call['function']['name']}:{n}"
                    segs += ([("<|tool_call_begin|>", True)] + _text(call_id) + [("<|tool_call_argument_begin|>", True)]
                             + _text(call["function"]["arguments"]) + [("<|tool_call_end|>", True)])
                segs.append(("<|tool_calls_section_end|>", True))
            segs.append(("<|im_end|>", True))
        elif role == "tool":
            segs += block("<|im_system|>", "tool", f"## Return of {m.get('tool_call_id')}\n{text}")
        else:
            role = "system" if role == "developer" else role
            segs += block(f"<|im_{role}|>", role, text)
    if add_generation_prompt:
        segs += [("<|im_assistant|>", True), ("assistant", False), ("<|im_middle|>", True)]
    return segs


# ------------------------------------------------------------------------------------------ output parsing

@dataclass
class ParsedOutput:
    """An assistant message as OpenAI returns it; in streaming, one delta (tool_calls: the calls completed in it)."""
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __iadd__(self, other: ParsedOutput) -> ParsedOutput:
        self.reasoning_content += other.reasoning_content
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


_LONGEST_MARKER = max(len(m) for m in XTML_MARKERS)


class _Lexer:
    """Text chunks -> ("text", s) / ("marker", m) tokens. A chunk ending in a proper prefix of a marker holds that
    suffix back (at most 13 characters) until the next chunk decides it; so the work is linear in the input."""

    def __init__(self):
        self.held = ""

    def feed(self, chunk: str, final: bool = False) -> list[tuple[str, str]]:
        buf, self.held = self.held + chunk, ""
        out, start, search = [], 0, 0
        while True:
            j = buf.find("<|", search)
            if j < 0:
                end = len(buf) - 1 if (not final and buf.endswith("<")) else len(buf)
                self.held = buf[end:]
                if end > start:
                    out.append(("text", buf[start:end]))
                return out
            marker = next((m for m in XTML_MARKERS if buf.startswith(m, j)), None)
            if marker is not None:
                if j > start:
                    out.append(("text", buf[start:j]))
                out.append(("marker", marker))
                start = search = j + len(marker)
                continue
            # NOTE: only a short tail can be a partial marker; slicing buf[j:] everywhere would be quadratic.
            rest = buf[j:j + _LONGEST_MARKER]
            if len(rest) < _LONGEST_MARKER and any(m.startswith(rest) for m in XTML_MARKERS):
                if j > start:
                    out.append(("text", buf[start:j]))
                # NOTE: output cut mid-marker (max_tokens): the partial marker is markup, not text.
                self.held = "" if final else rest
                return out
            search = j + 1


MAX_HEADER_CHARS = 4096  # an open tag longer than this (tool names and keys are short) is not one
_LONGEST_TAG = max(len(t) for t in TAGS)
_ATTR_UNESCAPE = re.compile(r"&(amp|quot);")


def _parse_header(text: str) -> tuple[str, dict[str, str]] | None:
    """`call tool="f" index="1"` -> ("call", {"tool": "f", "index": "1"}); None if it is not a well-formed header.
    One left-to-right pass (no regex over model output)."""
    name, _, rest = text.partition(" ")
    if name not in TAGS:
        return None
    attrs, i, n = {}, 0, len(rest)
    while i < n:
        if rest[i] == " ":
            i += 1
            continue
        eq = rest.find('="', i)
        if eq < 0:
            return None
        close = rest.find('"', eq + 2)
        if close < 0:
            return None
        attrs[rest[i:eq]] = _ATTR_UNESCAPE.sub(lambda m: "&" if m[1] == "amp" else '"', rest[eq + 2:close])
        i = close + 1
    return name, attrs


class OutputParser:
    """Incremental parser of what the model writes after the XTML generation prompt.

    `feed(text)` returns the delta that text completes; `finish()` flushes and drops what is unclosed.
    Survives the released model's malformed shapes (K3_SPEC.md section 9): reasoning ends at the earliest of a think
    close (with or without its <|sep|>), a response open or close, a tools open, a message close or <|end_of_msg|>;
    a tools channel when no tools were declared keeps its text and drops its markup; an unclosed call is dropped
    when the next call, the end of the tools channel or the end of output comes, never stretched over it.
    """

    def __init__(self, *, thinking: bool = True, tools_declared: bool = True):
        self._lexer = _Lexer()
        self._tools_declared = tools_declared
        self._channel = "think" if thinking else "response"  # think|response|top|tools|call|argument|json|done
        self._header: list[str] | None = None  # text after <|open|> or <|close|>, waiting for <|sep|>
        self._header_kind = ""
        self._header_len = 0
        self._call: dict | None = None  # {"name", "index", "args": [(key, type, value)], "raw": str | None}
        self._arg: tuple[str, str] | None = None
        self._value: list[str] = []
        self._n_calls = 0
        self._out = ParsedOutput()

    def feed(self, chunk: str) -> ParsedOutput:
        for kind, value in self._lexer.feed(chunk):
            self._token(kind, value)
        return self._take()

    def finish(self) -> ParsedOutput:
        for kind, value in self._lexer.feed("", final=True):
            self._token(kind, value)
        if self._header is not None:
            self._end_header(None)
        self._drop_call()
        self._channel = "done"
        return self._take()

    def _take(self) -> ParsedOutput:
        out, self._out = self._out, ParsedOutput()
        return out

    # -- tokens
    def _token(self, kind: str, value: str) -> None:
        if self._channel == "done":
            return
        if self._header is not None:
            if kind == "text":
                self._header.append(value)
                self._header_len += len(value)
                if self._header_kind == CLOSE:
                    self._check_close_header()
                elif self._header_len > MAX_HEADER_CHARS:
                    # NOTE: no <|sep|> for this long: prose after a stray <|open|>, not a header; keep the text.
                    text, self._header = "".join(self._header), None
                    self._text(text)
                return
            self._end_header(value)
            if value == SEP:
                return
        if kind == "text":
            self._text(value)
        elif value in (OPEN, CLOSE):
            self._header, self._header_kind, self._header_len = [], value, 0
        elif value == END:
            self._end_message()
        # a stray <|sep|> is markup: dropped

    def _check_close_header(self) -> None:
        """A close tag's name is one of TAGS; once the text after <|close|> can no longer be a bare name, it was a
        close with the <|sep|> elided (`<|close|>thinkThe answer`): the name ends the tag, the rest is text."""
        text = "".join(self._header)
        if len(text) <= _LONGEST_TAG and any(t.startswith(text) for t in TAGS):
            return
        self._header = None
        name = next((t for t in sorted(TAGS, key=len, reverse=True) if text.startswith(t)), None)
        if name is None:
            self._text(text)  # not a close tag: the <|close|> is dropped, the text kept
            return
        self._close(name)
        if len(text) > len(name):
            self._token("text", text[len(name):])

    def _end_header(self, marker: str | None) -> None:
        """The header ended at `marker` (None: end of output)."""
        text, kind, self._header = "".join(self._header), self._header_kind, None
        if kind == CLOSE:
            if text in TAGS:
                self._close(text)
            elif marker is None and any(t.startswith(text) for t in TAGS):
                pass  # output cut inside a close tag's name: markup, dropped
            elif text:
                self._text(text)
            return
        parsed = _parse_header(text) if marker == SEP else None
        if parsed is not None:
            self._open(*parsed)
        elif self._channel in ("call", "argument", "json"):
            self._drop_call()  # a truncated header inside a call: the call is malformed
        # any other malformed open tag is markup: dropped

    # -- structure
    def _text(self, text: str) -> None:
        ch = self._channel
        if ch == "think":
            self._out.reasoning_content += text
        elif ch in ("response", "top"):
            self._out.content += text
        elif ch == "argument" or ch == "json":
            self._value.append(text)
        elif ch == "tools" and not self._tools_declared:
            self._out.content += text
        # text between calls in a declared tools channel, or between arguments, is layout: dropped

    def _open(self, tag: str, attrs: dict[str, str]) -> None:
        ch = self._channel
        if ch in ("call", "argument", "json"):
            if tag == "argument" and ch == "call" and "key" in attrs:
                self._arg, self._value, self._channel = (attrs["key"], attrs.get("type", "string")), [], "argument"
                return
            if tag == "json" and ch == "call" and not self._call["args"]:
                self._value, self._channel = [], "json"
                return
            self._drop_call()  # anything else inside a call: the call was unclosed or truncated
            ch = self._channel
        if tag == "tools":
            self._channel = "tools"
        elif tag == "call" and ch == "tools" and self._tools_declared and "tool" in attrs:
            self._call, self._channel = {"name": attrs["tool"], "args": [], "raw": None}, "call"
        elif tag == "response" and ch in ("think", "top", "tools"):
            self._channel = "response"
        elif tag == "think" and ch == "top":
            self._channel = "think"
        # other opens (a nested think, a message header, a call outside tools) are markup: dropped

    def _close(self, tag: str) -> None:
        ch = self._channel
        if ch == "argument" and tag == "argument":
            self._call["args"].append((*self._arg, "".join(self._value)))
            self._channel = "call"
        elif ch == "json" and tag == "json":
            self._call["raw"] = "".join(self._value)
            self._channel = "call"
        elif ch == "call" and tag == "call":
            self._emit_call()
        elif ch in ("call", "argument", "json"):
            self._drop_call()
            self._close(tag)
        elif tag == "message":
            self._end_message()
        elif tag == "tools" and ch == "tools":
            self._channel = "top"
        elif tag in ("think", "response") and ch in ("think", "response"):
            self._channel = "top"  # an orphan response close also ends the think channel
        # any other close is markup: dropped

    def _end_message(self) -> None:
        self._drop_call()
        self._channel = "done"

    def _drop_call(self) -> None:
        if self._call is not None:
            self._call, self._arg, self._value, self._channel = None, None, [], "tools"

    def _emit_call(self) -> None:
        call, self._call, self._channel = self._call, None, "tools"
        if call["raw"] is not None:
            arguments = call["raw"]
        else:
            args = {}
            for key, kind, value in call["args"]:
                if kind == "string":
                    args[key] = value
                else:
                    try:
                        args[key] = json.loads(value)
                    except json.JSONDecodeError:
                        args[key] = value  # NOTE: raw text fallback for a value that is not valid JSON
            arguments = json.dumps(args, ensure_ascii=False)
        self._out.tool_calls.append({"id": f"functions.{call['name']}:{self._n_calls}", "type": "function",
                                     "function": {"name": call["name"], "arguments": arguments}})
        self._n_calls += 1


def parse_output(text: str, *, thinking: bool = True, tools_declared: bool = True) -> ParsedOutput:
    """The whole generated text (specials as their strings) -> ParsedOutput."""
    parser = OutputParser(thinking=thinking, tools_declared=tools_declared)
    out = parser.feed(text)
    out += parser.finish()
    return out


def parse_output_ids(tokenizer, ids: list[int], **options) -> ParsedOutput:
    """Generated XTML ids -> ParsedOutput, all at once (`IdOutputParser`): only the marker ids act as markers, so
    plain bytes that spell `<|open|>` stay text."""
    parser = IdOutputParser(tokenizer, "xtml", **options)
    out = parser.feed(ids)
    out += parser.finish()
    return out


def chat_stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end an assistant message: <|end_of_msg|> (XTML) or <|im_end|> (K2), and the tokenizer's eos."""
    end = END if chat_format_for(tokenizer) == "xtml" else "<|im_end|>"
    return tuple(sorted({tokenizer.token_id(end), tokenizer.eos_id}))


def function_name(call_id: str) -> str:
    """K2's tool-call id "functions.NAME:IDX" -> NAME (an id of another form is its own name)."""
    name = call_id.strip()
    if name.startswith("functions."):
        name = name[len("functions."):]
    head, sep, tail = name.rpartition(":")
    return head if sep and tail.isdigit() else name


class K2OutputParser:
    """Splits K2-format generated ids into reasoning, content and tool calls as they arrive. Prefix-stable: feeding
    more ids only appends to the three parts.

    The states, in order: start -> (<think>) reasoning -> (</think>) content -> (section begin) tools -> content.
    Reasoning exists only if the output starts with <think>. Other special tokens are dropped from the text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        tid = tokenizer.token_id
        self.think, self.end_think = tid("<think>"), tid("</think>")
        self.section_begin, self.section_end = tid("<|tool_calls_section_begin|>"), tid("<|tool_calls_section_end|>")
        self.call_begin, self.call_end = tid("<|tool_call_begin|>"), tid("<|tool_call_end|>")
        self.arg_begin = tid("<|tool_call_argument_begin|>")
        self.state = "start"
        self.reasoning_ids: list[int] | None = None
        self.content_ids: list[int] = []
        self.tool_ids: list[int] = []

    def feed(self, ids: list[int]) -> None:
        for t in ids:
            if self.state == "start":
                self.state = "content"
                if t == self.think:
                    self.state, self.reasoning_ids = "reasoning", []
                    continue
            if self.state == "reasoning":
                if t == self.end_think:
                    self.state = "content"
                else:
                    self.reasoning_ids.append(t)
            elif self.state == "content" and t == self.section_begin:
                self.state = "tools"
            elif self.state == "tools":
                if t == self.section_end:
                    self.state = "after_tools"
                else:
                    self.tool_ids.append(t)
            else:
                self.content_ids.append(t)

    @property
    def reasoning(self) -> str | None:
        if self.reasoning_ids is None:
            return None
        return self.tokenizer.decode(self.reasoning_ids, skip_special=True)

    @property
    def content(self) -> str:
        return self.tokenizer.decode(self.content_ids, skip_special=True)

    @property
    def tool_calls(self) -> list[dict]:
        """The complete calls so far, in OpenAI's form ({"id", "type": "function", "function": {...}})."""
        calls, header, args, part = [], [], [], None
        for t in self.tool_ids:
            if t == self.call_begin:
                header, args, part = [], [], "header"
            elif t == self.arg_begin and part == "header":
                part = "args"
            elif t == self.call_end and part == "args":
                call_id = self.tokenizer.decode(header, skip_special=True).strip()
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": function_name(call_id),
                                           "arguments": self.tokenizer.decode(args, skip_special=True)}})
                part = None
            elif part == "header":
                header.append(t)
            elif part == "args":
                args.append(t)
        return calls


def grown_text(old: str, new: str, final: bool) -> str:
    """What `new` adds to `old`, holding back a trailing U+FFFD (a character whose bytes are still coming)."""
    if (new.endswith("\ufffd") and not final) or not new.startswith(old):
        return ""
    return new[len(old):]


class IdOutputParser:
    """Generated ids -> ParsedOutput deltas, for either format: `feed(ids)` returns what those ids complete,
    `finish()` the rest. XTML: only marker ids act as markers, and a run of text ids is
    held until its bytes are whole characters. K2: `K2OutputParser`, its growing parts sent as differences."""

    def __init__(self, tokenizer, fmt: str, *, thinking: bool = True, tools_declared: bool = True):
        self.tokenizer, self.fmt = tokenizer, fmt
        if fmt == "xtml":
            self._xtml = OutputParser(thinking=thinking, tools_declared=tools_declared)
            self._markers = {tokenizer.token_id(m): m for m in XTML_MARKERS}
            self._run: list[int] = []
        else:
            self._k2 = K2OutputParser(tokenizer)
            self._sent = ["", "", 0]  # reasoning, content, tool calls

    def feed(self, ids: list[int]) -> ParsedOutput:
        return self._step(ids, final=False)

    def finish(self) -> ParsedOutput:
        return self._step([], final=True)

    def _step(self, ids: list[int], final: bool) -> ParsedOutput:
        if self.fmt != "xtml":
            return self._k2_step(ids, final)
        p = self._xtml
        for i in ids:
            if i in self._markers:
                self._flush(True)
                p._token("marker", self._markers[i])
            else:
                self._run.append(i)
        self._flush(final)
        out = p._take()
        if final:
            out += p.finish()
        return out

    def _flush(self, final: bool) -> None:
        if not self._run:
            return
        text = self.tokenizer.decode(self._run, skip_special=True)
        if text.endswith("\ufffd") and not final:
            return
        self._run = []
        if text:
            self._xtml._token("text", text)

    def _k2_step(self, ids: list[int], final: bool) -> ParsedOutput:
        k2, sent = self._k2, self._sent
        k2.feed(ids)
        out = ParsedOutput()
        if k2.reasoning is not None:
            out.reasoning_content = grown_text(sent[0], k2.reasoning, final)
            sent[0] += out.reasoning_content
        out.content = grown_text(sent[1], k2.content, final)
        sent[1] += out.content
        calls = k2.tool_calls
        out.tool_calls, sent[2] = calls[sent[2]:], len(calls)
        return out


# ------------------------------------------------------------------------------------------ `openk3 render`

def _load_json(path: str, what: str):
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def cmd_render(args: argparse.Namespace) -> None:
    conv = _load_json(args.messages, "--messages")
    options = {}
    if isinstance(conv, dict):  # {"messages": [...], "tools": [...], "tool_choice": ..., "response_format": ...}
        options = {k: conv[k] for k in ("tools", "tool_choice", "response_format") if k in conv}
        conv = conv.get("messages")
    if not isinstance(conv, list):
        raise ValueError(f"{args.messages}: expected a list of messages or an object with 'messages'")
    if args.tools:
        options["tools"] = _load_json(args.tools, "--tools")
    tokenizer = None
    if args.tokenizer:
        from openk3.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_path(args.tokenizer)
    fmt = chat_format_for(tokenizer) if tokenizer is not None else "xtml"
    options.update(thinking=not args.no_thinking, effort=args.effort)  # the K2 format rejects both
    segments = render(fmt, conv, add_generation_prompt=not args.no_generation_prompt, **options)
    text = segments_text(segments)
    if not args.json:
        sys.stdout.write(text + "\n")
        return
    out = {"text": text, "segments": [[t, s] for t, s in segments]}
    if tokenizer is not None:
        out["ids"] = encode_segments(tokenizer, segments)
    print(json.dumps(out, ensure_ascii=False))


def register_commands(sub: argparse._SubParsersAction) -> None:
    """Register `render` (its one-line help is in openk3.cli.COMMANDS)."""
    p = sub.add_parser("render", description="Print a conversation rendered as the model's prompt (K3 XTML, or K2 "
                                             "for a tokenizer with K2's special tokens).")
    p.add_argument("--messages", required=True, help="JSON: a list of OpenAI-style messages, or {'messages', 'tools', "
                                                     "'tool_choice', 'response_format'}")
    p.add_argument("--tools", help="JSON: a list of tool definitions")
    p.add_argument("--effort", choices=EFFORTS, help="thinking effort (writes the thinking-effort system message)")
    p.add_argument("--no-thinking", action="store_true", help="drop think channels; the prompt opens the response")
    p.add_argument("--no-generation-prompt", action="store_true", help="end after the last message")
    p.add_argument("--tokenizer", help="tokenizer directory or file: picks the format and adds ids to --json")
    p.add_argument("--json", action="store_true", help="print {text, segments, ids}")
    p.set_defaults(fn=cmd_render)
