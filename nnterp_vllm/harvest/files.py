"""Files written atomically: under a temporary name unique to the writer, then renamed."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def staging(path: Path) -> Path:
    """A temporary name next to ``path``, unique to this process (and call)."""
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def write_json(path: Path, content: dict[str, Any], sort_keys: bool = True) -> None:
    """Write ``content`` as JSON at ``path`` atomically (a temporary file, then a rename)."""
    temporary = staging(path)
    try:
        temporary.write_text(json.dumps(content, indent=2, sort_keys=sort_keys))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
