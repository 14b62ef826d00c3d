"""The ReshardError family: expected failures the CLI prints without a traceback."""

from __future__ import annotations

__all__ = [
    "ReshardError",
    "ConfigError",
    "LayoutError",
    "HeaderError",
    "TensorNotFoundError",
    "PlanError",
    "UsageError",
    "WriteError",
    "SourceChangedError",
    "clip_words",
]


_LONG_WORD = 240
"""A longer run of non-space characters in a message (a hostile tensor name, a huge number) is
shown by its start and end: the message stays readable and its advice stays on screen."""


def clip_words(message: str, limit: int = _LONG_WORD) -> str:
    """``message`` with every run of more than ``limit`` non-space characters shortened to its
    first and last characters around ``…(N characters)…``.

    >>> clip_words("tensor " + "a" * 10 + " is bad", limit=6)
    'tensor aaaa…(10 characters)…aa is bad'
    """
    if len(message) <= limit:
        return message
    out = []
    for word in message.split(" "):
        if len(word) > limit:
            head, tail = limit * 2 // 3, limit // 3
            word = f"{word[:head]}…({len(word)} characters)…{word[-tail:]}"
        out.append(word)
    return " ".join(out)


class ReshardError(Exception):
    """Expected failure; the CLI prints it without a traceback.

    Attributes:
        path: the file the problem is in, when there is one.
        tensor: the tensor the problem is about, when there is one.
        hint: what the user can do about it.
    """

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        tensor: str | None = None,
        hint: str | None = None,
    ) -> None:
        message = clip_words(message)
        super().__init__(message)
        self.message = message
        self.path = path
        self.tensor = tensor
        self.hint = hint

    def __str__(self) -> str:
        return self.message

    def to_json(self) -> dict[str, object]:
        return {
            "type": type(self).__name__,
            "message": self.message,
            "path": self.path,
            "tensor": self.tensor,
            "hint": self.hint,
        }


class ConfigError(ReshardError, ValueError):
    """A layout file or an option value is wrong."""


class LayoutError(ReshardError, ValueError):
    """Placements, mesh or shapes do not fit together."""


class HeaderError(ReshardError, ValueError):
    """A file is not valid safetensors."""


class TensorNotFoundError(ReshardError, LookupError):
    """A tensor is missing where it must be."""


class PlanError(ReshardError):
    """Source pieces cannot produce the target (holes, conflicting overlaps)."""


class UsageError(ReshardError):
    """The command line asks for something that cannot be done."""


class WriteError(ReshardError):
    """Failure while writing; partial files were removed."""

    exit_code = 3


class SourceChangedError(ReshardError):
    """A source file changed while it was read (another job rewrote it, or since --resume began)."""
