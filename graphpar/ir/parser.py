"""Reads the IR text of `graphpar.ir.printer` back into graphs; errors give line and column."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from graphpar.errors import GraphparError, IRParseError, VerificationError
from graphpar.ir.cluster import Cluster
from graphpar.ir.graph import Graph, Node, OutputRole, Program, Role, Value
from graphpar.ir.mesh import Mesh
from graphpar.ir.ops import get_op
from graphpar.ir.types import DTYPES_BY_NAME, TensorType
from graphpar.ir.verify import check_structure
from graphpar.ir.verify import verify as verify_graph

_SPACE = r"(?:[ \t\r]+|\#[^\n]*$)*"  # blanks and comments (to the end of the line: `$`)
_TOKEN = re.compile(
    _SPACE + r"""
    (?:
      (?P<value>%[A-Za-z0-9_.]+)
    | (?P<graph>@[A-Za-z0-9_.\-]+)
    | (?P<float>-?(?:\d+\.\d*(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)|-?inf\b|nan\b)
    | (?P<int>-?\d+)
    | (?P<string>"(?:[^"\\\n]|\\.)*")
    | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<punct>[()\[\]{},:=<>])
    )""",
    re.VERBOSE,
)
_BLANK = re.compile(_SPACE)
_KINDS = {index: name for name, index in _TOKEN.groupindex.items()}


MAX_NESTING = 32  # list literals nested deeper than this are not IR a printer wrote
MAX_DIM = 2**48  # a dimension size past this is a typo, not a tensor
_PROGRESS_BYTES = 1 << 20


class _Tok(NamedTuple):
    kind: str
    text: str
    line: int
    col: int
    pos: int


_new_tok = tuple.__new__  # _new_tok(_Tok, fields): a token without a Python-level __new__


class _Parser:
    """Lines are tokenized as the grammar reaches them: an error near the top of a huge file
    is found at once, and memory holds one line of tokens, not the file's."""

    def __init__(self, text: str, filename: str,
                 on_progress: Callable[[int, int], None] | None = None):
        self.text = text
        self.filename = filename
        self.on_progress = on_progress
        self.toks: list[_Tok] = []
        self.i = 0
        self.last: _Tok | None = None
        self.line, self.pos = 1, 0  # where the next untokenized line starts
        self.next_report = _PROGRESS_BYTES
        self.types: dict[tuple, TensorType] = {}
        self.origin: dict[int, _Tok] = {}  # id of a graph, node or input -> where it was written

    def _lex_line(self) -> list[_Tok]:
        """The tokens of the next line that has any; [eof] at the end of the text."""
        text = self.text
        while self.pos < len(text):
            start, line = self.pos, self.line
            end = text.find("\n", start)
            end = len(text) if end < 0 else end
            self.pos, self.line = end + 1, line + 1
            if self.on_progress is not None and start >= self.next_report:
                self.next_report = start + _PROGRESS_BYTES
                self.on_progress(start, len(text))
            toks, at = [], start
            for m in _TOKEN.finditer(text, start, end):
                if m.start() != at:
                    break
                group = m.lastindex
                pos, at = m.span(group)  # the token ends the match: blanks come before it
                toks.append(_new_tok(_Tok, (_KINDS[group], text[pos:at], line, pos - start + 1,
                                            pos)))
            at = _BLANK.match(text, at, end).end()
            if at != end:
                self._fail_at(at, line, at - start + 1, f"unexpected character {text[at]!r}")
            if toks:
                return toks
        return [_Tok("eof", "", self.line, 1, len(text))]

    # --- helpers ------------------------------------------------------------------------------

    def _fail_at(self, pos: int, line: int, col: int, message: str):
        start = pos - (col - 1)
        end = self.text.find("\n", start)
        source = self.text[start:end if end >= 0 else len(self.text)]
        skip = max(0, col - 80)  # a long line is shown around the column
        source, caret = source[skip:skip + 160], col - 1 - skip
        raise IRParseError(
            f"{self.filename}:{line}:{col}: {message}\n    {source}\n    {' ' * caret}^")

    def fail(self, message: str, tok: _Tok | None = None):
        tok = tok or self.peek()
        self._fail_at(tok.pos, tok.line, tok.col, message)

    def peek(self, ahead: int = 0) -> _Tok:
        j = self.i + ahead
        if j < len(self.toks):
            return self.toks[j]
        while j >= len(self.toks) and not (self.toks and self.toks[-1].kind == "eof"):
            self.toks, self.i, j = self.toks[self.i:] + self._lex_line(), 0, j - self.i
        return self.toks[min(j, len(self.toks) - 1)]

    def next(self) -> _Tok:
        tok = self.peek()
        if tok.kind != "eof":
            self.i += 1
        self.last = tok
        return tok

    def at(self, text: str) -> bool:
        i = self.i
        return (self.toks[i] if i < len(self.toks) else self.peek()).text == text

    def accept(self, text: str) -> bool:
        if self.at(text):
            self.next()
            return True
        return False

    def expect(self, text: str) -> _Tok:
        if not self.at(text):
            found = self.peek().text or "end of file"
            self.fail(f"expected {text!r}, found {found!r}")
        return self.next()

    def expect_kind(self, kind: str, what: str) -> _Tok:
        if self.peek().kind != kind:
            self.fail(f"expected {what}, found {self.peek().text or 'end of file'!r}")
        return self.next()

    # --- grammar ------------------------------------------------------------------------------

    def program(self) -> Program:
        graphs: dict[str, Graph] = {}
        self.clusters: dict[str, Cluster] = {}
        self.meshes: dict[str, Mesh] = {}
        while self.peek().kind != "eof":
            if self.at("cluster"):
                self.cluster_decl()
                continue
            if self.at("mesh"):
                self.mesh_decl()
                continue
            graph = self.graph()
            if graph.name in graphs:
                first = self.origin[id(graphs[graph.name])].line
                self.fail(f"graph @{graph.name} is defined twice (first on line {first}); "
                          "give each graph its own name", self.origin[id(graph)])
            graphs[graph.name] = graph
        if not graphs:
            self.fail("expected 'graph @name(...)', found nothing")
        return Program(graphs)

    def _declared_name(self, table: dict, what: str) -> str:
        tok = self.expect_kind("graph", f"a {what} name like @{what}")
        if tok.text[1:] in table:
            self.fail(f"{what} {tok.text} is declared twice", tok)
        return tok.text[1:]

    def _reference(self, table: dict, what: str):
        tok = self.expect_kind("graph", f"a {what} name like @{what}")
        if tok.text[1:] not in table:
            self.fail(f"{what} {tok.text} is not declared before its use", tok)
        return table[tok.text[1:]]

    def cluster_decl(self) -> None:
        """cluster @name = {name="...", num_nodes=1, ...}"""
        start = self.next()
        name = self._declared_name(self.clusters, "cluster")
        self.expect("=")
        attrs = self.attr_dict()
        try:
            self.clusters[name] = Cluster(**attrs)
        except (TypeError, GraphparError) as exc:
            self.fail(f"bad cluster declaration: {exc}", start)

    def mesh_decl(self) -> None:
        """mesh @name = <["dp"=2, "tp"=4]> [on @cluster] {bandwidth=[...], latency=[...]}"""
        start = self.next()
        name = self._declared_name(self.meshes, "mesh")
        self.expect("=")
        self.expect("<")
        self.expect("[")
        shape, names = [], []
        while not self.at("]"):
            if self.peek().kind == "string":
                names.append(self.literal())
                self.expect("=")
            shape.append(int(self.expect_kind("int", "an axis size").text))
            if not self.accept(","):
                break
        self.expect("]")
        self.expect(">")
        if names and len(names) != len(shape):
            self.fail("name every mesh axis or none", start)
        cluster = self._reference(self.clusters, "cluster") if self.accept("on") else None
        attrs = self.attr_dict() if self.at("{") else {}
        unknown = set(attrs) - {"bandwidth", "latency", "devices"}
        if unknown:
            self.fail(f"unknown mesh attribute(s) {', '.join(sorted(unknown))}; "
                      "a mesh takes bandwidth, latency and devices", start)
        for key, value in attrs.items():
            if not isinstance(value, (tuple, list)):
                self.fail(f"mesh attribute {key}={value!r}: expected a list, one entry per "
                          f"{'device' if key == 'devices' else 'mesh axis'}", start)
        try:
            self.meshes[name] = Mesh(tuple(shape), attrs.get("devices", ()),
                                     attrs.get("bandwidth", ()), attrs.get("latency", ()),
                                     tuple(names) if names else None, cluster)
        except (TypeError, GraphparError) as exc:
            self.fail(f"bad mesh declaration: {exc}", start)

    def graph(self) -> Graph:
        if self.peek().text != "graph":
            self.fail(f"expected 'graph', found {self.peek().text or 'end of file'!r}")
        self.next()
        name_tok = self.expect_kind("graph", "a graph name like @main")
        graph = Graph(name_tok.text[1:])
        self.origin[id(graph)] = name_tok
        self.env: dict[str, Value] = {}
        self.expect("(")
        while not self.at(")"):
            self.graph_input(graph)
            if not self.accept(","):
                break
        self.expect(")")
        if self.accept("on"):
            graph.mesh = self._reference(self.meshes, "mesh")
        if self.accept("attrs"):
            graph.attrs = self.attr_dict()
        self.expect("{")
        while self.peek().text != "return":
            self.node(graph)
        self.next()
        self.graph_outputs(graph)
        self.expect("}")
        try:
            check_structure(graph)
        except VerificationError as exc:
            self.fail(str(exc), self.origin.get(id(exc.subject), self.last))
        return graph

    def graph_input(self, graph: Graph) -> None:
        tok = self.expect_kind("value", "an input like %x: f32[2,3] input")
        self.expect(":")
        type_, layout = self.typed()
        role = self.role(Role, "input")
        if tok.text[1:] in self.env:
            self.fail(f"input {tok.text} defined twice", tok)
        value = graph.add_input(tok.text[1:], type_, role)
        value.layout = layout
        self.origin[id(value)] = tok
        self.env[tok.text[1:]] = value

    def role(self, roles, what: str):
        """An input or output role: a member of the enum `roles`."""
        tok = self.expect_kind("ident", f"an {what} role")
        try:
            return roles(tok.text)
        except ValueError:
            self.fail(f"unknown {what} role {tok.text!r}; roles: "
                      f"{', '.join(r.value for r in roles)}", tok)

    def typed(self):
        tok = self.expect_kind("ident", "a type like f32[2,3]")
        if tok.text not in DTYPES_BY_NAME:
            self.fail(f"unknown dtype {tok.text!r}; dtypes: {', '.join(DTYPES_BY_NAME)}", tok)
        self.expect("[")
        dims = []
        while not self.at("]"):
            dim_tok = self.expect_kind("int", "a dimension size")
            if len(dim_tok.text) > 16 or not 0 <= int(dim_tok.text) <= MAX_DIM:
                self.fail(f"dimension size {dim_tok.text} is not between 0 and 2**48", dim_tok)
            dims.append(int(dim_tok.text))
            if not self.accept(","):
                break
        self.expect("]")
        if math.prod(dims) > MAX_DIM:
            self.fail(f"a tensor of shape [{','.join(map(str, dims))}] has more than 2**48 "
                      "elements", tok)
        layout = self.layout() if self.at("{") else None
        key = (tok.text, *dims)
        type_ = self.types.get(key)
        if type_ is None:  # one TensorType per distinct type: a big graph has few
            type_ = self.types[key] = TensorType(tuple(dims), DTYPES_BY_NAME[tok.text])
        return type_, layout

    def layout(self):
        start = self.expect("{")
        depth = 1
        while depth:
            tok = self.next()
            if tok.kind == "eof":
                self.fail("unterminated layout '{'", start)
            depth += {"{": 1, "}": -1}.get(tok.text, 0)
        text = self.text[start.pos:self.last.pos + 1]
        from graphpar.ir.layout import Layout

        try:
            return Layout.parse(text)
        except (GraphparError, ValueError) as exc:
            self.fail(f"bad layout {text}: {exc}", start)

    def node(self, graph: Graph) -> None:
        first = self.peek()
        names = [self.expect_kind("value", "a result like %3 or 'return'").text[1:]]
        while self.accept(","):
            names.append(self.expect_kind("value", "a result name").text[1:])
        self.expect("=")
        op_tok = self.expect_kind("ident", "an op name")
        try:
            opdef = get_op(op_tok.text)
        except GraphparError as exc:
            self.fail(str(exc), op_tok)
        self.expect("(")
        operands = []
        while not self.at(")"):
            operands.append(self.operand())
            if not self.accept(","):
                break
        self.expect(")")
        attrs = self.attr_dict() if self.at("{") else {}
        self.expect(":")
        typed = [self.typed()]
        while self.accept(","):
            typed.append(self.typed())
        loc = module = None
        if self.accept("loc"):
            self.expect("(")
            loc = self.literal()
            self.expect(",")
            module = self.literal()
            self.expect(")")
        if len(typed) != len(names):
            self.fail(f"{len(names)} results but {len(typed)} types", first)
        if opdef.num_outputs is not None and len(names) != opdef.num_outputs:
            self.fail(f"{op_tok.text} has {opdef.num_outputs} result(s), not {len(names)}", first)
        node = graph.add_node(Node(op_tok.text, operands, [t for t, _ in typed], attrs,
                                   module=module, loc=loc))
        self.origin[id(node)] = first
        for name, out, (_, layout) in zip(names, node.outputs, typed):
            if name in self.env:
                self.fail(f"%{name} is defined twice", first)
            out.layout = layout
            self.env[name] = out

    def operand(self):
        if self.peek().kind == "value":
            tok = self.next()
            if tok.text[1:] not in self.env:
                self.fail(f"{tok.text} is used before it is defined", tok)
            return self.env[tok.text[1:]]
        return self.literal()

    def literal(self, depth: int = 0):
        tok = self.next()
        if tok.kind == "int":
            return int(tok.text)
        if tok.kind == "float":
            return float(tok.text)
        if tok.kind == "string":
            try:
                return json.loads(tok.text)
            except ValueError as exc:
                self.fail(f"bad string literal: {exc.args[0].split(':')[0]}; escapes are "
                          "JSON's (\\\\, \\\", \\n, \\uXXXX)", tok)
        if tok.text in ("true", "false"):
            return tok.text == "true"
        if tok.text == "none":
            return None
        if tok.text == "[":
            if depth >= MAX_NESTING:
                self.fail(f"lists nested deeper than {MAX_NESTING} levels", tok)
            items = []
            while not self.at("]"):
                items.append(self.literal(depth + 1))
                if not self.accept(","):
                    break
            self.expect("]")
            return tuple(items)
        self.fail(f"expected a value or literal, found {tok.text or 'end of file'!r}", tok)

    def attr_dict(self) -> dict:
        self.expect("{")
        attrs = {}
        while not self.at("}"):
            key = self.expect_kind("ident", "an attribute name").text
            self.expect("=")
            attrs[key] = self.literal()
            if not self.accept(","):
                break
        self.expect("}")
        return attrs

    def graph_outputs(self, graph: Graph) -> None:
        while True:
            tok = self.peek()
            value = self.operand()
            if not isinstance(value, Value):
                self.fail("a graph output must be a value", tok)
            role = self.role(OutputRole, "output")
            target = None
            if self.accept("("):
                target = self.expect_kind("value", "the input it belongs to").text[1:]
                self.expect(")")
            graph.add_output(value, role, target)
            if not self.accept(","):
                return


def parse_program(text: str, filename: str = "<string>", verify: bool = False,
                  on_progress: Callable[[str, int, int], None] | None = None) -> Program:
    """Every graph in `text`. Layouts, mesh axes and names are always checked; `verify` also
    runs the full verifier, whose errors then name the line of `text` they are about.
    `on_progress(stage, done, total)` is told of parsing (bytes) and verifying (nodes)."""
    parser = _Parser(text, filename,
                     on_progress and (lambda done, total: on_progress("parsing", done, total)))
    program = parser.program()
    if verify:
        for graph in program:
            try:
                verify_graph(graph, on_progress=on_progress and (
                    lambda done, total: on_progress("verifying", done, total)))
            except VerificationError as exc:
                tok = parser.origin.get(id(exc.subject)) or parser.origin[id(graph)]
                raise VerificationError(f"{filename}:{tok.line}: {exc}", exc.subject) from None
    return program


def parse(text: str, filename: str = "<string>") -> Graph:
    """The one graph in `text`."""
    program = parse_program(text, filename)
    if len(program) != 1:
        raise IRParseError(f"{filename}: expected one graph, found {len(program)}; "
                           "use parse_program for several")
    return next(iter(program))


def load(path: str | Path, verify: bool = False,
         on_progress: Callable[[str, int, int], None] | None = None) -> Program:
    """The program in an IR file (see `parse_program`); an unreadable file is an IRParseError."""
    path = Path(path)
    return parse_program(read_text_file(path, "IR file"), str(path), verify, on_progress)


def read_text_file(path: Path, what: str) -> str:
    """A UTF-8 text file's contents; a missing, unreadable or binary file is a GraphparError."""
    if path.is_dir():
        raise IRParseError(f"{path}: is a directory, not {_article(what)}; give the file's path")
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise IRParseError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise IRParseError(f"{path}: not a UTF-8 text file (byte {exc.start} is "
                           f"0x{exc.object[exc.start]:02x}); give {_article(what)}") from None


def _article(what: str) -> str:
    return ("an " if what[0] in "aeiouAEIOU" else "a ") + what
