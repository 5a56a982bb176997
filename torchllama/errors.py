"""Errors a user can cause and fix: bad files, bad arguments, prompts that do not fit.

Every such error is a :class:`TorchLlamaError` whose message names the file, field or argument and
what was expected. The CLI prints the message on one line and exits non-zero; anything else is a bug
in torchllama and keeps its traceback.
"""

import json


class TorchLlamaError(Exception):
    """A problem with the user's input (file, field, argument), explained in the message."""


class ModelFileError(TorchLlamaError):
    """A model or tokenizer file is missing, unreadable, truncated or of an unsupported kind."""


class ArgumentError(TorchLlamaError, ValueError):
    """A value passed to the API or CLI is out of its allowed range."""


class ContextLengthError(TorchLlamaError, ValueError):
    """A prompt (plus what is asked of it) does not fit in the model's context window."""


class TrainingError(TorchLlamaError):
    """Training cannot go on: a non-finite loss, or a checkpoint that does not fit the run."""


MISSING = object()  # "no default": the field is required

_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               list: "a list", dict: "an object"}


def checked_field(mapping, key: str, kind: type, source: str, default=MISSING, *,
                  what: str = "field"):
    """mapping[key], checked to be of `kind` (int, float, bool, str, list or dict), for the
    fields of checkpoint metadata (params.json, config.json, GGUF key/values). None counts as
    absent; bools are not numbers; ints are accepted for floats (and returned as float).

    Raises:
        ModelFileError: the key is absent and has no default ("{source}: required {what} 'key'
            is missing"), or its value is of another kind (the message shows it).
    """
    value = mapping.get(key)
    if value is None:
        if default is MISSING:
            raise ModelFileError(f"{source}: required {what} {key!r} is missing")
        return default
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        shown = (json.dumps(value) if isinstance(value, (int, float, str, bool)) and len(str(value)) < 60
                 else f"a {type(value).__name__}")
        raise ModelFileError(f"{source}: {what} {key!r} is {shown}, expected {_KIND_NAMES[kind]}")
    return float(value) if kind is float else value
