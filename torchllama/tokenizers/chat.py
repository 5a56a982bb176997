"""Chat templates: a conversation rendered with the checkpoint's Jinja template, as HF
transformers renders it (`Tokenizer.apply_chat_template` calls these).

The template runs in Jinja's immutable sandbox with transformers' settings: ``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter without HTML escaping, and
the globals ``raise_exception`` and ``strftime_now``.

Source: HF transformers ``utils/chat_template_utils.py`` (``_compile_jinja_template``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from torchllama.errors import ArgumentError, ModelFileError, TorchLlamaError


def _validate_messages(messages: Any) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ArgumentError(
            f"messages must be a list of {{'role': str, 'content': str}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ArgumentError("messages must contain at least one message, got an empty list")
    for n, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ArgumentError(f"messages[{n}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ArgumentError(f"messages[{n}] has no {key!r} key (expected 'role' and 'content')")
            if not isinstance(m[key], str):
                raise ArgumentError(f"messages[{n}][{key!r}] must be a str, got {type(m[key]).__name__}")


def _compile_chat_template(source_text: str, source: str) -> Any:
    """Compile a chat template in the sandboxed environment HF transformers uses."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TorchLlamaError(f"{source}: chat template error: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Like HF: no HTML escaping (Jinja's own tojson escapes '<', '>', '&').
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source_text)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFileError(
            f"{source}: metadata field 'tokenizer.chat_template' is not a valid Jinja template "
            f"(line {e.lineno}: {e.message})"
        ) from e
