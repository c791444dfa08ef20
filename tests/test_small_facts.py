"""Small facts have one home: the first line of an error, the default-domain test, the dtype tables."""

from __future__ import annotations

from pathlib import Path

from graphconv.errors import first_line

ROOT = Path(__file__).resolve().parent.parent


def test_first_line_is_the_first_non_empty_line():
    assert first_line(ValueError("\n\n  bad shape  \nat node 3")) == "bad shape"
    assert first_line(RuntimeError("one line")) == "one line"


def test_first_line_of_an_empty_message_is_the_type_name():
    """An empty or blank message must not raise IndexError: the type name stands in."""
    assert first_line(KeyError()) == "KeyError"
    assert first_line(RuntimeError("")) == "RuntimeError"
    assert first_line(RuntimeError(" \n \n")) == "RuntimeError"


def test_first_line_cuts_at_the_limit_and_drops_colour_codes():
    assert first_line(ValueError("abcdef\nxyz"), 3) == "abc"
    assert first_line(ValueError("\x1b[31mred\x1b[0m failure")) == "red failure"
