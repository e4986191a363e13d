"""Tool-call parsers: a model's generated text → content and tool calls, incrementally.

One small interface (`ToolCallParser`: `feed(text)` → events, `finish()` → events) with one
implementation per output format, and a registry (`TOOL_PARSERS`, the names of
`--tool-call-parser`). Events are `ContentDelta`, `CallStart` (a call's index and function
name) and `ArgsDelta` (a fragment of that call's arguments, the raw JSON text as generated).

Invariants every parser keeps:
- the same text gives the same events' concatenation whatever the split into `feed` calls
  (the non-streaming response is the stream fed in one piece);
- a call's `CallStart` comes before its `ArgsDelta`s; calls are numbered 0, 1, ... in order;
- a call whose function name was never read is not a call: its text comes back as content;
- without any call, the content is the generated text exactly.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    index: int
    text: str


Event = ContentDelta | CallStart | ArgsDelta

_PRIMITIVE_CHARS = frozenset("-+.eE0123456789truefalsn")


class _RawValue:
    """The raw text of one JSON value read char by char (whitespace before it skipped by the
    caller). `done` once complete; a primitive (number, true, null) ends at the first char that
    cannot continue it, which `feed` then refuses."""

    def __init__(self) -> None:
        self.kind = ""  # "string" | "container" | "primitive"
        self.chars: list[str] = []
        self.done = False
        self._depth = 0
        self._in_str = False
        self._esc = False

    @property
    def text(self) -> str:
        return "".join(self.chars)

    def feed(self, ch: str) -> bool:
        """Consume `ch` if it belongs to the value; False when it does not (the value ended
        before it, or `ch` cannot start a value: then `kind` stays empty)."""
        if self.done:
            return False
        if not self.kind:
            if ch == '"':
                self.kind, self._in_str = "string", True
            elif ch in "{[":
                self.kind, self._depth = "container", 1
            elif ch in _PRIMITIVE_CHARS:
                self.kind = "primitive"
            else:
                return False
            self.chars.append(ch)
            return True
        if self.kind == "primitive":
            if ch not in _PRIMITIVE_CHARS:
                self.done = True
                return False
            self.chars.append(ch)
            return True
        self.chars.append(ch)
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if self.kind == "string":
                    self.done = True
        elif ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self.done = True
        return True

    def end(self) -> None:
        """No more input: a primitive is complete, anything else stays incomplete."""
        if self.kind == "primitive":
            self.done = True


class _JsonCall:
    """One call written as a JSON object `{"name": "...", <args key>: {...}, ...}`, read char by
    char (leading whitespace skipped). `name` is set when the name string closes; `args` holds
    argument fragments not yet taken: an object value streams as it arrives, a string value
    (JSON inside a string) comes decoded once closed. Other keys are read and ignored."""

    def __init__(self, args_keys: tuple[str, ...]):
        self.args_keys = args_keys
        self.name: str | None = None
        self.args: list[str] = []
        self.args_seen = False
        self.done = False
        self.failed = False
        self._opened = False
        self._phase = "key"  # key | colon | value | after
        self._key: str | None = None
        self._val: _RawValue | None = None
        self._target = ""  # what _val is: "key" or "value"

    def feed(self, text: str) -> int:
        """Consume up to the object's closing brace; returns how many chars were consumed
        (fewer than given when done or failed)."""
        for i, ch in enumerate(text):
            if self.done or self.failed:
                return i
            if not self._opened:
                if ch == "{":
                    self._opened = True
                elif not ch.isspace():
                    self.failed = True
                    return i
                continue
            if self._val is not None:
                took = self._val.feed(ch)
                if took and self._streams():
                    self.args.append(ch)
                if self._val.done:
                    self._end_value()
                if took:
                    continue
            self._structural(ch)
            if self.failed:
                return i
        return len(text)

    def _streams(self) -> bool:
        v = self._val
        return (self._target == "value" and self._key in self.args_keys
                and v is not None and v.kind == "container" and not self.args_seen)

    def _structural(self, ch: str) -> None:
        if ch.isspace():
            return
        phase = self._phase
        if phase == "key" and ch == '"':
            self._val, self._target = _RawValue(), "key"
            self._val.feed(ch)
        elif phase in ("key", "after") and ch == "}":
            self.done = True
            if self.name is None:
                self.failed = True
        elif phase == "colon" and ch == ":":
            self._phase = "value"
        elif phase == "after" and ch == ",":
            self._phase = "key"
        elif phase == "value":
            self._val, self._target = _RawValue(), "value"
            if not self._val.feed(ch):
                self.failed = True
            elif self._streams():
                self.args.append(ch)
        else:
            self.failed = True

    def _end_value(self) -> None:
        v, self._val = self._val, None
        assert v is not None
        if self._target == "key":
            try:
                self._key = json.loads(v.text)
            except ValueError:
                self.failed = True
            self._phase = "colon"
            return
        self._phase = "after"
        if self._key == "name" and self.name is None:
            try:
                name = json.loads(v.text)
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.failed = True
            else:
                self.name = name
        elif self._key in self.args_keys and not self.args_seen:
            self.args_seen = True
            if v.kind == "string":
                try:
                    decoded = json.loads(v.text)
                except ValueError:
                    decoded = v.text
                self.args.append(decoded)
            elif v.kind == "primitive":
                self.args.append("{}" if v.text == "null" else v.text)

    def take_args(self) -> str:
        out = "".join(self.args)
        self.args.clear()
        return out


def _partial_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of a marker (to hold
    back: it may become the marker)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


class ToolCallParser(ABC):
    """Incremental parser of one choice's generated text. `markers` are the format's literal
    tags: if the tokenizer treats one as a special token, the server keeps special tokens in
    the detokenized text (and removes the others) so the parser can see them."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._buf = ""
        self._ws = ""  # trailing whitespace of the content, held until more content follows
        self._calls = 0
        self._call: _JsonCall | None = None
        self._call_open = False
        self._raw: list[str] = []  # text of the current call so far (returned if it fails)
        self._dropped = ""  # whitespace dropped before the current call
        self._after_call = False  # a call just ended: leading whitespace is dropped

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Events for `text` (the next piece of the generated text)."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """Events for whatever was held back; the parser is done."""

    @staticmethod
    def new_call_id() -> str:
        """The id of a new call (OpenAI style)."""
        return "call_" + secrets.token_hex(12)

    @property
    def num_calls(self) -> int:
        return self._calls

    # -- helpers shared by the formats --------------------------------------------------------
    def _flush(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    def _content(self, text: str, before_call: bool = False) -> None:
        """Content, minus whitespace right before a call or right after one."""
        text = self._ws + text
        self._ws = ""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if before_call:  # the dropped whitespace returns if the call turns out not to be one
            kept = text.rstrip()
            self._dropped, text = text[len(kept):], kept
        else:
            kept = text.rstrip()
            self._ws, text = text[len(kept):], kept
        if text:
            self._events.append(ContentDelta(text))

    def _end_content(self) -> None:
        if self._calls == 0 and self._ws:
            self._events.append(ContentDelta(self._ws))
        self._ws = ""

    def _start_call(self, args_keys: tuple[str, ...], raw: str) -> None:
        self._call, self._call_open = _JsonCall(args_keys), False
        self._raw, self._dropped = [self._dropped + raw], ""

    def _feed_call(self) -> str:
        """Feed the buffer to the current call; returns "done", "failed" or "more"."""
        call = self._call
        assert call is not None
        n = call.feed(self._buf)
        self._raw.append(self._buf[:n])
        self._buf = self._buf[n:]
        self._drain(call)
        if call.failed and not self._call_open:
            self._call = None
            self._content("".join(self._raw))
            return "failed"
        if call.done or call.failed:
            self._close_call()
            return "done"
        return "more"

    def _drain(self, call: _JsonCall) -> None:
        if call.name is not None and not self._call_open:
            self._call_open = True
            self._events.append(CallStart(self._calls, call.name))
        if self._call_open:
            frag = call.take_args()
            if frag:
                self._events.append(ArgsDelta(self._calls, frag))

    def _close_call(self) -> None:
        call = self._call
        self._end_call(empty=call is not None and self._call_open and not call.args_seen)

    def _end_call(self, empty: bool) -> None:
        """The current call is over (`empty`: no argument was read, so they are `{}`)."""
        if empty:
            self._events.append(ArgsDelta(self._calls, "{}"))
        self._call, self._call_open = None, False
        self._calls += 1
        self._after_call = True

    def _abandon_call(self) -> None:
        """End of text inside a call: one without a name goes back to content; a named one
        keeps what it has (its arguments may be incomplete: cut by max_tokens)."""
        call = self._call
        if call is None:
            return
        if self._call_open:
            self._end_call(empty=False)
        else:
            self._call = None
            self._content("".join(self._raw))

    def _skip(self, chars: str | None = None) -> str:
        """Drop the leading `chars` (whitespace by default) of the buffer; returns them."""
        s = self._buf.lstrip(chars)
        skipped, self._buf = self._buf[:len(self._buf) - len(s)], s
        return skipped


class _StateMachineParser(ToolCallParser):
    """A format read by `_run`, a loop over `_state` that consumes the buffer as far as it
    can (all of it when `final`). `feed` and `finish` are the same for every such format;
    `_end_calls` is what the end of text does to a call left open."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._run(final=False)
        return self._flush()

    def finish(self) -> list[Event]:
        self._run(final=True)
        self._end_calls()
        self._run(final=True)
        self._end_content()
        return self._flush()

    def _text_until(self, marker: str, final: bool) -> bool:
        """Content up to `marker`. True when found: the buffer then starts right after it.
        False when the buffer is used up, less a tail that may begin the marker (unless final)."""
        i = self._buf.find(marker)
        if i >= 0:
            self._content(self._buf[:i], before_call=True)
            self._buf = self._buf[i + len(marker):]
            return True
        keep = 0 if final else _partial_suffix(self._buf, (marker,))
        self._content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _step_call(self, after: str) -> bool:
        """Feed the buffer to the current call; False when it needs more text, else the state
        becomes `after` (the call ended) or "text" (it was no call)."""
        status = self._feed_call()
        if status == "more":
            return False
        self._state = after if status == "done" else "text"
        return True

    @abstractmethod
    def _run(self, final: bool) -> None:
        """Consume the buffer as far as the format allows (`final`: no more text comes)."""

    @abstractmethod
    def _end_calls(self) -> None:
        """The text ended (the buffer is read): close or abandon what is open."""


class _TaggedParser(_StateMachineParser):
    """Content with calls inside start/end tags: `<start>{json}<end>`; the end tag may be
    missing. Used by hermes (`<tool_call>...</tool_call>`). States: text | call | after."""

    start: ClassVar[str]
    end: ClassVar[str]
    args_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")

    def _end_calls(self) -> None:
        if self._state == "call":
            self._abandon_call()
            self._state = "text"

    def _run(self, final: bool) -> None:
        while True:
            if self._state == "text":
                if not self._text_until(self.start, final):
                    return
                self._start_call(self.args_keys, self.start)
                self._state = "call"
                continue
            if self._state == "call":
                if not self._step_call("after"):
                    return
                continue
            s = self._buf.lstrip()
            if s.startswith(self.end):
                self._buf = s[len(self.end):]
            elif not final and (not s or self.end.startswith(s)):
                return
            self._state = "text"


class HermesParser(_TaggedParser):
    """Hermes / Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block
    per call, content around them. Also the fallback format for templates without tools."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    markers = ("<tool_call>", "</tool_call>")


class Llama3JsonParser(_StateMachineParser):
    """Llama 3.1+ JSON tool calling: the whole answer is `{"name": ..., "parameters": {...}}`
    (optionally after `<|python_tag|>`), several calls separated by `;`. An answer that does not
    start with `{` is content."""

    name = "llama3_json"
    tag = "<|python_tag|>"
    markers = ("<|python_tag|>",)
    args_keys = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # start | calls | call | text
        self._lead = ""

    def _end_calls(self) -> None:
        if self._state == "call":
            self._abandon_call()
            self._state = "text"
        if self._state == "start":  # nothing but whitespace (and the tag)
            self._buf, self._lead, self._state = self._lead + self._buf, "", "text"

    def _run(self, final: bool) -> None:
        while True:
            if self._state == "start":
                self._lead += self._skip()
                s = self._buf
                if s.startswith(self.tag):
                    self._lead += self.tag
                    self._buf = s[len(self.tag):]
                    continue
                if not s or (self.tag.startswith(s) and not final):
                    return
                if s[0] == "{":
                    self._state = "calls"
                else:
                    self._buf, self._lead = self._lead + self._buf, ""
                    self._state = "text"
                continue
            if self._state == "text":
                self._content(self._buf)
                self._buf = ""
                return
            if self._state == "calls":
                self._skip(" \t\r\n;")
                s = self._buf
                if not s:
                    return
                if s[0] != "{":
                    self._state = "text"
                    continue
                self._start_call(self.args_keys, self._lead if self._calls == 0 else "")
                self._state = "call"
                continue
            if not self._step_call("calls"):
                return


_V11_HEAD_CHARS = frozenset(string.ascii_letters + string.digits + "_.:-[]")
_V11_HEAD = re.compile(r"^([A-Za-z0-9_.:-]+)(?:\[CALL_ID\][A-Za-z0-9_.:-]*)?$")


class MistralParser(_StateMachineParser):
    """Mistral: content, then `[TOOL_CALLS]` followed by a JSON array of
    `{"name": ..., "arguments": {...}}` (v3 tokenizers) or by `name[ARGS]{...}` (v11+, one
    marker per call; `name[CALL_ID]id[ARGS]{...}` too). Call ids are 9 letters/digits, which
    Mistral's templates require when the history is rendered again."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    args_keys = ("arguments", "parameters")

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"  # text | head | array | call | name | args
        self._head = ""  # the marker and "[" before the array's first call
        self._args: _RawValue | None = None

    @staticmethod
    def new_call_id() -> str:
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))

    def _end_calls(self) -> None:
        if self._state == "call":
            self._abandon_call()
        elif self._state == "args":
            self._calls += 1
        self._state = "text"

    def _run(self, final: bool) -> None:
        while True:
            st = self._state
            if st == "text":
                if not self._text_until(self.marker, final):
                    return
                self._raw, self._dropped = [self._dropped + self.marker], ""
                self._state = "head"
                continue
            if st == "head":
                self._raw.append(self._skip())
                s = self._buf
                if not s:
                    if not final:
                        return
                    self._content("".join(self._raw))
                    self._raw, self._state = [], "text"
                    continue
                if s[0] == "[":
                    self._head, self._raw = "".join(self._raw) + "[", []
                    self._buf, self._state = s[1:], "array"
                else:
                    self._state = "name"
                continue
            if st == "array":  # _head: text since the last call (all of it before the first)
                self._head += self._skip(" \t\r\n,")
                s = self._buf
                if not s and not final:
                    return
                if s[:1] == "{":
                    self._start_call(self.args_keys, self._head)
                    self._head, self._state = "", "call"
                    continue
                first = self._head.startswith(self.marker)
                if s[:1] == "]":
                    self._buf = s[1:]
                    self._head += "]"
                if first or s[:1] != "]":
                    self._content(self._head)
                self._head, self._state = "", "text"
                continue
            if st == "call":
                if not self._step_call("array"):
                    return
                continue
            if st == "name":  # name[ARGS] or name[CALL_ID]id[ARGS]
                bad = next((k for k, c in enumerate(self._buf) if c not in _V11_HEAD_CHARS), -1)
                j = self._buf.find("[ARGS]")
                if j < 0 and bad < 0 and not final:
                    return
                m = _V11_HEAD.match(self._buf[:j]) if j >= 0 and (bad < 0 or j < bad) else None
                if m is None:  # not a call: the marker is content, the rest is text again
                    self._content("".join(self._raw))
                    self._raw, self._state = [], "text"
                    continue
                self._buf = self._buf[j + len("[ARGS]"):]
                self._events.append(CallStart(self._calls, m.group(1)))
                self._args, self._state = _RawValue(), "args"
                continue
            # args: one raw JSON value, streamed as it arrives
            args = self._args
            assert args is not None
            n, frag, ended = 0, [], False
            for ch in self._buf:
                if not args.kind and ch.isspace():
                    n += 1
                    continue
                if not args.feed(ch):
                    ended = True
                    break
                frag.append(ch)
                n += 1
                if args.done:
                    break
            self._buf = self._buf[n:]
            if frag:
                self._events.append(ArgsDelta(self._calls, "".join(frag)))
            if not (args.done or ended or final):
                return
            self._end_call(empty=not args.chars)
            self._args, self._state = None, "text"


class NamedCallParser(ToolCallParser):
    """`tool_choice` naming a function: the grammar makes the whole output that function's
    arguments (a JSON object), so the output is one call."""

    name = "named"

    def __init__(self, function: str):
        super().__init__()
        self.function = function
        self._args_started = False

    def feed(self, text: str) -> list[Event]:
        if self._calls == 0:
            self._calls = 1
            self._events.append(CallStart(0, self.function))
        if not self._args_started:
            text = text.lstrip()
            self._args_started = bool(text)
        if text:
            self._events.append(ArgsDelta(0, text))
        return self._flush()

    def finish(self) -> list[Event]:
        out = self.feed("")
        if not self._args_started:
            out.append(ArgsDelta(0, "{}"))
        return out


class JsonArrayCallParser(ToolCallParser):
    """`tool_choice: "required"`: the grammar makes the output a JSON array of
    `{"name": ..., "arguments": {...}}` objects. (Anything else, which the grammar does not
    allow, is content.)"""

    name = "json_array"
    args_keys = ("arguments", "parameters")

    def __init__(self) -> None:
        super().__init__()
        self._in_call = False
        self._sep = ""  # brackets, commas and whitespace since the last call
        self._text_mode = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._buf:
            if self._text_mode:
                self._content((self._sep if not self._calls else "") + self._buf)
                self._buf = self._sep = ""
                break
            if self._in_call:
                status = self._feed_call()
                if status == "more":
                    break
                self._in_call = False
                continue
            self._sep += self._skip(" \t\r\n[,]")
            s = self._buf
            if not s:
                break
            if s[0] == "{":
                self._start_call(self.args_keys, "")
                self._in_call, self._sep = True, ""
            else:  # not what the grammar allows: the rest is content
                self._text_mode = True
        return self._flush()

    def finish(self) -> list[Event]:
        if self._in_call:
            self._abandon_call()
        if self._sep and not self._calls:
            self._content(self._sep)
            self._sep = ""
        self._end_content()
        return self._flush()


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parse_text(parser: ToolCallParser, text: str) -> tuple[str, list[tuple[str, str]]]:
    """The whole text at once: (content, [(function name, arguments), ...])."""
    content: list[str] = []
    calls: list[list[str]] = []
    for ev in parser.feed(text) + parser.finish():
        if isinstance(ev, ContentDelta):
            content.append(ev.text)
        elif isinstance(ev, CallStart):
            calls.append([ev.name, ""])
        else:
            calls[ev.index][1] += ev.text
    return "".join(content), [(n, a) for n, a in calls]
