"""Reads the IR text of `graphpar.ir.printer` back into graphs; errors give line and column."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from graphpar.errors import GraphparError, IRParseError
from graphpar.ir.cluster import Cluster
from graphpar.ir.graph import Graph, Node, OutputRole, Program, Role, Value
from graphpar.ir.mesh import Mesh
from graphpar.ir.ops import get_op
from graphpar.ir.types import DTYPES_BY_NAME, TensorType

_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r]+|\#[^\n]*)
  | (?P<nl>\n)
  | (?P<value>%[A-Za-z0-9_.]+)
  | (?P<graph>@[A-Za-z0-9_.\-]+)
  | (?P<float>-?(?:\d+\.\d*(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)|-?inf\b|nan\b)
  | (?P<int>-?\d+)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>[()\[\]{},:=<>])
    """,
    re.VERBOSE,
)


@dataclass
class _Tok:
    kind: str
    text: str
    line: int
    col: int
    pos: int


class _Parser:
    def __init__(self, text: str, filename: str):
        self.text = text
        self.filename = filename
        self.toks = self._lex()
        self.i = 0

    def _lex(self) -> list[_Tok]:
        toks, line, line_start, pos = [], 1, 0, 0
        while pos < len(self.text):
            m = _TOKEN.match(self.text, pos)
            if m is None:
                self._fail_at(line, pos - line_start + 1,
                              f"unexpected character {self.text[pos]!r}")
            kind = m.lastgroup
            if kind == "nl":
                line, line_start = line + 1, m.end()
            elif kind != "ws":
                toks.append(_Tok(kind, m.group(), line, pos - line_start + 1, pos))
            pos = m.end()
        toks.append(_Tok("eof", "", line, pos - line_start + 1, pos))
        return toks

    # --- helpers ------------------------------------------------------------------------------

    def _fail_at(self, line: int, col: int, message: str):
        source = self.text.splitlines()[line - 1] if self.text.splitlines()[line - 1:] else ""
        raise IRParseError(
            f"{self.filename}:{line}:{col}: {message}\n    {source}\n    {' ' * (col - 1)}^"
        )

    def fail(self, message: str, tok: _Tok | None = None):
        tok = tok or self.peek()
        self._fail_at(tok.line, tok.col, message)

    def peek(self, ahead: int = 0) -> _Tok:
        return self.toks[min(self.i + ahead, len(self.toks) - 1)]

    def next(self) -> _Tok:
        tok = self.peek()
        self.i += 1
        return tok

    def at(self, text: str) -> bool:
        return self.peek().text == text

    def accept(self, text: str) -> bool:
        if self.at(text):
            self.i += 1
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
        graphs = []
        self.clusters: dict[str, Cluster] = {}
        self.meshes: dict[str, Mesh] = {}
        while self.peek().kind != "eof":
            if self.at("cluster"):
                self.cluster_decl()
            elif self.at("mesh"):
                self.mesh_decl()
            else:
                graphs.append(self.graph())
        if not graphs:
            self.fail("expected 'graph @name(...)', found nothing")
        return Program.of(graphs)

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
        graph = Graph(self.expect_kind("graph", "a graph name like @main").text[1:])
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
        return graph

    def graph_input(self, graph: Graph) -> None:
        tok = self.expect_kind("value", "an input like %x: f32[2,3] input")
        self.expect(":")
        type_, layout = self.typed()
        role_tok = self.expect_kind("ident", "an input role")
        try:
            role = Role(role_tok.text)
        except ValueError:
            self.fail(f"unknown input role {role_tok.text!r}; roles: "
                      f"{', '.join(r.value for r in Role)}", role_tok)
        if tok.text[1:] in self.env:
            self.fail(f"input {tok.text} defined twice", tok)
        value = graph.add_input(tok.text[1:], type_, role)
        value.layout = layout
        self.env[tok.text[1:]] = value

    def typed(self):
        tok = self.expect_kind("ident", "a type like f32[2,3]")
        if tok.text not in DTYPES_BY_NAME:
            self.fail(f"unknown dtype {tok.text!r}; dtypes: {', '.join(DTYPES_BY_NAME)}", tok)
        self.expect("[")
        dims = []
        while not self.at("]"):
            dims.append(int(self.expect_kind("int", "a dimension size").text))
            if not self.accept(","):
                break
        self.expect("]")
        layout = self.layout() if self.at("{") else None
        return TensorType(tuple(dims), DTYPES_BY_NAME[tok.text]), layout

    def layout(self):
        start = self.expect("{")
        depth = 1
        while depth:
            tok = self.next()
            if tok.kind == "eof":
                self.fail("unterminated layout '{'", start)
            depth += {"{": 1, "}": -1}.get(tok.text, 0)
        text = self.text[start.pos:self.toks[self.i - 1].pos + 1]
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

    def literal(self):
        tok = self.next()
        if tok.kind == "int":
            return int(tok.text)
        if tok.kind == "float":
            return float(tok.text)
        if tok.kind == "string":
            import json

            return json.loads(tok.text)
        if tok.text in ("true", "false"):
            return tok.text == "true"
        if tok.text == "none":
            return None
        if tok.text == "[":
            items = []
            while not self.at("]"):
                items.append(self.literal())
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
            role_tok = self.expect_kind("ident", "an output role")
            try:
                role = OutputRole(role_tok.text)
            except ValueError:
                self.fail(f"unknown output role {role_tok.text!r}; roles: "
                          f"{', '.join(r.value for r in OutputRole)}", role_tok)
            target = None
            if self.accept("("):
                target = self.expect_kind("value", "the input it belongs to").text[1:]
                self.expect(")")
            graph.add_output(value, role, target)
            if not self.accept(","):
                return


def parse_program(text: str, filename: str = "<string>") -> Program:
    """Every graph in `text`."""
    return _Parser(text, filename).program()


def parse(text: str, filename: str = "<string>") -> Graph:
    """The one graph in `text`."""
    program = parse_program(text, filename)
    if len(program) != 1:
        raise IRParseError(f"{filename}: expected one graph, found {len(program)}; "
                           "use parse_program for several")
    return next(iter(program))


def load(path: str | Path) -> Program:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise IRParseError(f"{path}: cannot read IR file: {exc.strerror}") from None
    return parse_program(text, str(path))
