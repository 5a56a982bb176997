"""Tool calling: OpenAI's `tools` / `tool_choice` in a chat request, the model's calls parsed back.

The model writes a call in the Hermes format (Qwen2.5's, NousResearch Hermes 2 Pro's), one per
call, calls separated by a newline:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

How the tools reach the prompt (`chat_messages`):
- **native**: the checkpoint's chat template renders `tools` itself and writes calls in this
  format (it names `tools` and contains "<tool_call>": Qwen2/2.5/3, Hermes, SmolLM3). The
  template gets `tools` and the history as transformers' `apply_chat_template(tools=...)` does.
- **fallback**, every other template (SmolLM2, Gemma 3, Llama 2/3, Mistral's own formats
  included): `FALLBACK_INSTRUCTIONS` with the tools' JSON is appended to the system message (or
  is the system message); an assistant turn's calls become its text in the format above and a
  `tool` message becomes a user turn `<tool_response>\\n…\\n</tool_response>`.

What the model may write (`tool_grammar`, a Lark grammar for llguidance):
- "required" / a named function: only calls (of that function), the arguments by each tool's
  parameter schema (JSON with `JSON_WHITESPACE`; objects that list their properties take no
  other keys unless the schema says `additionalProperties`, and a `strict: true` function
  requires every property: `grammar.closed_schema`); with "required" one or more calls (one
  with parallel_tool_calls false), with a named function one call (more only with
  parallel_tool_calls true: vLLM's named function calling writes one, and small models
  forced to a function otherwise repeat the call until max_tokens).
- "auto": free text (never containing the marker), or text up to the marker "<tool_call>" and
  then calls as above. The grammar is lazy in effect (llama.cpp's trigger words): nothing is
  refused before the marker but the marker's completion rules.
- "none": no tools in the prompt, no grammar.

`ToolCallParser` turns the generated text into content and calls, piece by piece, the same way
for a stream and for the whole text (a stream's calls equal the non-streamed ones by
construction).

Sources: OpenAI's chat completions API (tools, tool_choice, tool_calls, streaming deltas);
transformers' chat templating (`apply_chat_template(tools=...)`); Qwen2.5's and Hermes 2 Pro's
tool-call format; llama.cpp's lazy grammars (PR 9639).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from torchllama.generation.grammar import JSON_WHITESPACE, closed_schema

#: The marker that opens a call, and the text around a call's JSON.
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

#: Appended to the system message when the template does not render tools itself; {tools} is
#: one JSON object per line, each OpenAI's {"type": "function", "function": {...}}.
FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to help with the user's request. The "
    "functions are given as JSON objects within <tools></tools> tags:\n<tools>\n{tools}\n"
    "</tools>\n\nTo call a function, write a JSON object with its name and arguments within "
    "<tool_call></tool_call> tags, one per call:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <arguments-json-object>}}\n</tool_call>')

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be served; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    """A request's tools and what it asks of them.

    Attributes:
        functions: name → the parameters' JSON schema, in the request's order (objects that
            list their properties closed, `grammar.closed_schema`; a `strict: true` function's
            also requiring every property, as OpenAI's strict function calling).
        specs: the request's tool objects ({"type": "function", "function": {...}}).
        choice: "auto", "none", "required", or a function's name.
        parallel: more than one call allowed (`parallel_tool_calls`; by default yes, but for
            a named function).
    """

    functions: dict[str, dict]
    specs: list[dict]
    choice: str
    parallel: bool = True

    @property
    def active(self) -> bool:
        """The model sees the tools and its output is parsed for calls."""
        return self.choice != "none"


def tools_of(tools: Optional[list], tool_choice: Any, parallel: Optional[bool]) -> Optional[Tools]:
    """The request's `Tools`, or None without tools.

    Raises:
        ToolError: a tool that is not {"type": "function", "function": {"name", ...}}, a name
            outside [A-Za-z0-9_-]{1,64} or given twice, parameters that are not a JSON object,
            a tool_choice without tools, an unknown tool_choice or named function.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(fn, dict):
            raise ToolError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": "
                            "{...}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(f"tools[{i}].function.name: 1 to 64 letters, digits, _ or -, got "
                            f"{name!r}", f"tools[{i}].function.name")
        if name in functions:
            raise ToolError(f"tools[{i}].function.name: {name!r} is given twice",
                            f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters: a JSON schema object is required",
                            f"tools[{i}].function.parameters")
        functions[name] = closed_schema(params, require_all=fn.get("strict") is True)
    choice = _choice_of(tool_choice, functions)
    if parallel is None:
        parallel = choice in ("auto", "none", "required")
    return Tools(functions, list(tools), choice, bool(parallel))


def _choice_of(tool_choice: Any, functions: dict) -> str:
    if tool_choice is None:
        return "auto"
    if tool_choice in ("auto", "none", "required"):
        return tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise ToolError(f"tool_choice.function.name: no tool is named {name!r} (tools: "
                            f"{', '.join(functions)})", "tool_choice")
        return name
    raise ToolError("tool_choice: expected \"auto\", \"none\", \"required\" or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


# --------------------------------------------------------------------------------------------
# The prompt
# --------------------------------------------------------------------------------------------

def renders_tools(chat_template: Optional[str]) -> bool:
    """Whether a chat template renders tools itself in the Hermes format (names the `tools`
    variable and writes "<tool_call>")."""
    if not chat_template or CALL_OPEN not in chat_template:
        return False
    import jinja2.meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(chat_template))
    except jinja2.TemplateSyntaxError:
        return False


def chat_messages(messages: list[dict], tools: Optional[Tools], native: bool
                  ) -> tuple[list[dict], Optional[list[dict]]]:
    """(messages, tools) to render with the chat template (see the module docstring).

    Args:
        messages: OpenAI's messages as dicts: role, content (str or None), and tool_calls
            (assistant) or tool_call_id (tool).
        tools: the request's tools (None, or choice "none": no tools in the prompt).
        native: the template renders tools (`renders_tools`).
    """
    offered = tools.specs if tools is not None and tools.active else None
    if native:
        return [_native_message(m) for m in messages], offered
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"].get("arguments") or "{}")
                     for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        if role == "tool":
            text = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):             # consecutive results: one user turn
                out[-1]["content"] += "\n" + text
                continue
            out.append({"role": "user", "content": text, "_tool": True})
            continue
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool", None)
    if offered:
        instructions = FALLBACK_INSTRUCTIONS.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in offered))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{instructions}"
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out, None


def _native_message(m: dict) -> dict:
    """A message as transformers passes it to a template: calls' arguments as objects."""
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = m.get("content") or ""
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            fn = dict(c["function"])
            try:
                fn["arguments"] = json.loads(fn.get("arguments") or "{}")
            except (TypeError, ValueError):
                pass
            calls.append({**c, "function": fn})
        out["tool_calls"] = calls
    return out


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (`arguments`: the JSON text, as given)."""
    return f'{CALL_OPEN}\n{{"name": "{name}", "arguments": {arguments}}}\n{CALL_CLOSE}'


# --------------------------------------------------------------------------------------------
# The grammar
# --------------------------------------------------------------------------------------------

def tool_grammar(tools: Tools) -> Optional[str]:
    """The Lark grammar (llguidance's dialect) of what the model may write, or None for "none".

    Each function's call is `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`
    with ARGS its parameter schema as `%json` (`JSON_WHITESPACE` between tokens unless the
    schema's own "x-guidance" says otherwise).
    """
    if not tools.active:
        return None
    names = list(tools.functions) if tools.choice in ("auto", "required") else [tools.choice]
    rules = [f"call_body: {' | '.join(f'body_{i}' for i in range(len(names)))}"]
    for i, name in enumerate(names):
        schema = dict(tools.functions[name])
        schema.setdefault("x-guidance", {"whitespace_pattern": JSON_WHITESPACE})
        head = json.dumps(f'\n{{"name": "{name}", "arguments": ')
        tail = json.dumps(f"}}\n{CALL_CLOSE}")
        rules.append(f"body_{i}: {head} args_{i} {tail}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    more = f' ("\\n{CALL_OPEN}" call_body)*' if tools.parallel else ""
    if tools.choice == "auto":   # free text without the marker, or text up to it, then calls
        start = ["start: TEXT | lead call_body" + more,
                 rf"TEXT: /(.|\n)*/ & ~/(.|\n)*{CALL_OPEN}(.|\n)*/",
                 rf"lead[lazy]: /(.|\n)*{CALL_OPEN}/"]
    else:
        start = [f'start: "{CALL_OPEN}" call_body' + more]
    return "\n".join(start + rules) + "\n"


# --------------------------------------------------------------------------------------------
# The model's output → content and calls
# --------------------------------------------------------------------------------------------

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')
_END = "}\n" + CALL_CLOSE


@dataclass
class ToolCall:
    """One call: its id, function name and arguments (the JSON text the model wrote)."""

    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def as_dict(self) -> dict:
        """OpenAI's tool call object."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallParser:
    """Splits generated text, fed piece by piece, into content and tool calls.

    `feed(text)` and `finish()` return events: ("content", text), ("call", index) when call
    `calls[index]` has its name, ("arguments", index, text) as its arguments arrive. Text that
    may still turn out to be a marker (or whitespace before one) is held back until it is
    known. Content followed by calls loses its trailing whitespace; `content` is all of it.
    """

    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    _buffer: str = ""
    _state: str = "content"          # content | head | arguments | between

    def feed(self, text: str) -> list[tuple]:
        """Events of the next piece of text (what is decided so far; see the class)."""
        self._buffer += text
        events: list[tuple] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[tuple]:
        """Events of the text held back at the end: an unfinished call stays incomplete (its
        arguments as far as they got), one cut in its closing tag is complete."""
        events: list[tuple] = []
        if self._state == "arguments" and _END.startswith(self._buffer):
            self.calls[-1].complete = bool(self._buffer)      # only the closing tag was cut
        elif self._state == "arguments":
            self._arguments(events, self._buffer)
        elif self._buffer and self._state != "arguments":
            if self._state in ("head", "between"):
                self._buffer = ("" if self._state == "between" else CALL_OPEN) + self._buffer
            self._content(events, self._buffer)
        self._buffer = ""
        return events

    @property
    def finish_reason(self) -> Optional[str]:
        """"tool_calls" when the text made a complete call."""
        return "tool_calls" if any(c.complete for c in self.calls) else None

    def _step(self, events: list) -> bool:
        """Handle what the buffer decides; False when more text is needed."""
        buf = self._buffer
        if self._state == "content":            # (the whitespace before a call is dropped)
            return self._until(events, CALL_OPEN, self._content, "head", strip=True)
        if self._state == "head":
            match = _HEAD.match(buf)
            if match is None or match.end() == len(buf):     # (more whitespace may come)
                return False
            self.calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", match.group(1)))
            events.append(("call", len(self.calls) - 1))
            self._buffer, self._state = buf[match.end():], "arguments"
            return True
        if self._state == "arguments":
            if not self._until(events, _END, self._arguments, "between"):
                return False
            self.calls[-1].complete = True
            return True
        # between calls: "\n<tool_call>" opens the next one
        opener = "\n" + CALL_OPEN
        if buf.startswith(opener):
            self._buffer, self._state = buf[len(opener):], "head"
            return True
        if opener.startswith(buf):
            return False
        self._state = "content"             # text after the calls (not from the grammar)
        return True

    def _until(self, events: list, tag: str, emit, state: str, strip: bool = False) -> bool:
        """Emit the buffer up to `tag` and go on past it in `state` (True); or emit what
        cannot begin the tag and wait for more (False)."""
        buf = self._buffer
        at = buf.find(tag)
        if at >= 0:
            emit(events, buf[:at].rstrip() if strip else buf[:at])
            self._buffer, self._state = buf[at + len(tag):], state
            return True
        keep = _held_back(buf, tag)
        emit(events, buf[:keep])
        self._buffer = buf[keep:]
        return False

    def _content(self, events: list, text: str) -> None:
        if text:
            self.content += text
            events.append(("content", text))

    def _arguments(self, events: list, text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            events.append(("arguments", len(self.calls) - 1, text))


def _held_back(buf: str, marker: str) -> int:
    """Where to cut `buf`: the text from there may begin `marker` (a proper prefix of it at the
    end) or is whitespace before such a prefix or the end; the text before it is decided."""
    cut = len(buf)
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            cut = len(buf) - n
            break
    if marker == CALL_OPEN:          # trailing whitespace before a marker is dropped
        cut = len(buf[:cut].rstrip())
    return cut


def parse_all(text: str) -> ToolCallParser:
    """The parser after the whole of `text` (what a non-streamed answer reports)."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    return parser
