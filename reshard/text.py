"""Showing text from files to a person: verbatim, but never as terminal codes or markup.

Tensor names, metadata, paths and patterns come from files anyone may have written.
Printed raw, ``"\\x1b]0;pwned\\x07"`` retitles the terminal, ``"\\x1b[2J"`` clears it,
and a right-to-left override (U+202E) makes ``evil.weight`` read as something else.
Printed through rich, ``"experts[gate].weight"`` would be parsed as markup (dropped,
or a crash on ``"[/bad]"``). So:

- :func:`shown` keeps the text as written but replaces every character Python does
  not call printable (:meth:`str.isprintable`: C0/C1 controls, DEL, bidi and other
  invisible format characters, separators other than the ASCII space, surrogates,
  private-use and unassigned code points) by a visible escape (``\\x1b``, ``\\u202e``);
- :func:`markup_safe` is :func:`shown` then :func:`rich.markup.escape`, for text
  interpolated into a string rich will parse as markup.

Printable text, including backslashes and non-ASCII letters, is returned unchanged
after one C-speed :meth:`str.isprintable` check.

>>> shown("model.layers.0.weight")
'model.layers.0.weight'
>>> print(shown("a\\x1b[31mred\\x07"))
a\\x1b[31mred\\x07
>>> print(shown("evil\\u202egnp.weight"))
evil\\u202egnp.weight
>>> print(markup_safe("experts[gate].weight [/bad]"))
experts\\[gate].weight \\[/bad]

- :func:`name_pattern` is an ``--include``/``--exclude`` pattern for one name, quoted
  for a POSIX shell, that a message can suggest: pasted, it matches that name and no other.
"""

from __future__ import annotations

__all__ = ["shown", "markup_safe", "name_pattern"]


def _escape(char: str) -> str:
    return char if char.isprintable() else _code(char)


def _code(char: str) -> str:
    """``char`` as a Python escape by its code point (``\\x1b``, ``\\u202e``)."""
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def shown(text: str) -> str:
    """``text`` with every character a terminal could act on replaced by a visible escape.

    Args:
        text: a string from a file (tensor name, metadata value, path, pattern).

    Returns:
        The same text where it is printable (the ASCII space included); ``\\xNN``
        up to U+00FF, ``\\uNNNN`` and ``\\UNNNNNNNN`` above, for every other character.
        Backslashes are kept as written: regex patterns stay readable.
    """
    if text.isprintable():
        return text
    return "".join(map(_escape, text))


def markup_safe(text: str) -> str:
    """``text`` ready to interpolate into a rich markup string: shown, then markup-escaped.

    rich then prints it as written (``[qkv]`` stays ``[qkv]``) and never fails on it.
    For a whole value, ``rich.text.Text(shown(text))`` does the same without markup.
    Emoji codes (``:smile:``) are not markup: print with ``Console(emoji=False)``.
    """
    # every "[" is written escaped ("\\["), so no text can open a tag; rich halves backslashes
    # only right before a "[" (a tag, or an escaped one), so a run of them ending a part would
    # show doubled, or eat the escape: it goes before a no-op tag of its own, doubled, and
    # shows as written whatever follows. No rich import: `convert --quiet` never loads it.
    return "\\[".join(map(_tail_safe, shown(text).split("[")))


def _tail_safe(part: str) -> str:
    """A part of a text without "[": its trailing backslashes made to show as written."""
    stripped = part.rstrip("\\")
    tail = len(part) - len(stripped)
    return stripped + "[none]" + "\\" * (2 * tail) + "[/none]" if tail else part


_GLOB = frozenset("*?[")


def name_pattern(name: str) -> str:
    r"""A shell-quoted ``--include``/``--exclude`` pattern matching ``name``, printable, to paste.

    A printable name without glob characters or a quote is its own pattern; any other
    becomes a ``re:`` regex of its escaped characters, a character that is not printable
    (or a quote) written as an escape (``\xNN``, ``\uNNNN``), which ``re:`` patterns read
    as Python's ``re`` does.

    >>> name_pattern("model.norm.weight")
    "'model.norm.weight'"
    >>> print(name_pattern("experts[0].w"), name_pattern("a\nb\x1b[31m"), name_pattern("it's"))
    're:experts\[0\]\.w' 're:a\x0ab\x1b\[31m' 're:it\x27s'
    """
    if name.isprintable() and "'" not in name and not _GLOB.intersection(name) and not name.startswith("re:"):
        return f"'{name}'"
    import re

    body = "".join(re.escape(c) if c.isprintable() and c != "'" else _code(c) for c in name)
    return f"'re:{body}'"
