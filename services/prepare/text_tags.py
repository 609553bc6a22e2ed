"""What streamed text readers (tool calls, reasoning) share: how much of a text's end to hold back
because it could still become a tag once more text arrives."""

from __future__ import annotations


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag`` (0 when none is)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
