"""How every benchmark hands back its result: JSON on stdout and, when asked, in a file."""

from __future__ import annotations

import json
from typing import Any


def report(result: Any, path: str | None, *, echo: bool = True) -> None:
    """Print `result` as indented JSON (unless echo is False) and write it to `path` if given."""
    text = json.dumps(result, indent=2)
    if echo:
        print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)
