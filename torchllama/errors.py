"""Errors a user can cause and fix: bad files, bad arguments, prompts that do not fit.

Every such error is a :class:`TorchLlamaError` whose message names the file, field or argument and
what was expected. The CLI prints the message on one line and exits non-zero; anything else is a bug
in torchllama and keeps its traceback.
"""


class TorchLlamaError(Exception):
    """A problem with the user's input (file, field, argument), explained in the message."""


class ModelFileError(TorchLlamaError):
    """A model or tokenizer file is missing, unreadable, truncated or of an unsupported kind."""


class ArgumentError(TorchLlamaError, ValueError):
    """A value passed to the API or CLI is out of its allowed range."""


class ContextLengthError(TorchLlamaError, ValueError):
    """A prompt (plus what is asked of it) does not fit in the model's context window."""
