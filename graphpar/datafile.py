"""Reading the small data files users write (cluster files, placement SPECs): JSON, or YAML by
the file's suffix, with errors that name the file and, for JSON, the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from graphpar.errors import GraphparError


def read_data_file(path: str | Path, error: type[GraphparError], what: str = "file") -> Any:
    """The plain data in `path` (`.yaml`/`.yml`: YAML, else JSON); a file that cannot be read
    or parsed raises `error` naming it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise error(f"{path}: reading YAML needs PyYAML, which is not installed; install "
                        "it (pip install pyyaml) or write the file as JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise error(f"{path}: not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}, "
                    f"column {exc.colno}") from None
