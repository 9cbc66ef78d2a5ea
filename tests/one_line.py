"""`raises_one_line`: pytest.raises that also holds the project's rule for bad input, one line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def raises_one_line(kind: type[BaseException] | tuple[type[BaseException], ...], match: str) -> Iterator[Any]:
    """As pytest.raises(kind, match=match), and the message must be one line."""
    with pytest.raises(kind, match=match) as info:
        yield info
    assert "\n" not in str(info.value), f"not one line: {str(info.value)!r}"
