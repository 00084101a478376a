"""Text from elsewhere (a file, a server) made safe to print on a terminal."""

from __future__ import annotations


def printable(text: str) -> str:
    """`text` with every character a terminal could act on (escape sequences, CR, LF, other controls,
    invisible format characters) written as its Python escape, `\\x1b`: what is shown is what was there."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
