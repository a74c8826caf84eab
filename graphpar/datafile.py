"""Reading the small data files users write (cluster files, placement SPECs): JSON, or YAML by
the file's suffix, with errors that name the file and line in one line. YAML aliases are
expanded only up to a bound, so a "billion laughs" file is refused, not expanded."""

from __future__ import annotations

import json
import reprlib
from pathlib import Path
from typing import Any

from graphpar.errors import GraphparError

MAX_FILE_BYTES = 16 * 2**20  # a SPEC or a cluster file is a few kB; more is not one
MAX_NODES = 100_000  # values in a file once its YAML aliases are expanded

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 40, 40
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = 4


def shown(value: Any, width: int = 80) -> str:
    """`value` as a short one-line repr for an error message, whatever its size or depth."""
    text = " ".join(_SHORT.repr(value).split())
    return text if len(text) <= width else text[:width - 3] + "..."


def read_text(path: str | Path, error: type[GraphparError], what: str = "file",
              max_bytes: int = MAX_FILE_BYTES) -> str:
    """A UTF-8 text file's contents; a missing, unreadable, too large or binary file raises
    `error` naming it (and the line of the first byte that is not UTF-8)."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path}: is a directory, not a {what}; give the file's path")
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: {size:,} bytes, more than a {what} holds (at most "
                        f"{max_bytes:,}); give the right file")
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{path}:{line}: not a UTF-8 text file (byte {exc.start} is "
                    f"0x{data[exc.start]:02x}); save the {what} as UTF-8") from None


def read_data_file(path: str | Path, error: type[GraphparError], what: str = "file") -> Any:
    """The plain data in `path` (`.yaml`/`.yml`: YAML, else JSON); a file that cannot be read
    or parsed raises `error` naming it, in one line."""
    path = Path(path)
    text = read_text(path, error, what)
    if path.suffix.lower() in (".yaml", ".yml"):
        return _yaml(text, path, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}, "
                    f"column {exc.colno}") from None
    except RecursionError:
        raise error(f"{path}: not a {what}: lists or mappings nested too deep") from None


def _yaml(text: str, path: Path, error: type[GraphparError]) -> Any:
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        raise error(f"{path}: reading YAML needs PyYAML, which is not installed; install "
                    "it (pip install pyyaml) or write the file as JSON") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_size(node, path, error)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = " ".join(str(exc.problem or exc.context or "malformed").split())
        raise error(f"{where}: not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {' '.join(str(exc).split())[:200]}") from None
    except RecursionError:
        raise error(f"{path}: not valid YAML here: nested too deep") from None
    finally:
        loader.dispose()


def _check_size(root: Any, path: Path, error: type[GraphparError]) -> None:
    """Refuse a YAML document whose values, aliases expanded, number over `MAX_NODES`, or
    whose alias refers to a value that holds it: counted on the node graph, each node once."""
    import yaml

    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise error(f"{path}:{node.start_mark.line + 1}: a YAML alias refers to a value "
                        "that contains it; write the value out")
        open_.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        open_.discard(key)
        if total > MAX_NODES:
            raise error(f"{path}:{node.start_mark.line + 1}: this value expands (YAML aliases "
                        f"included) to over {MAX_NODES:,} values; write the file without "
                        "repeated aliases")
        sizes[key] = total
        return total

    size(root)
