"""A CUDA listing: what one device runs, one library or kernel call per line, over planned memory.

`lower-cuda` (graphpar.passes.lower_cuda) writes listings; the executors in
graphpar.backends.cuda run them (CuPy on a GPU, torch call for call on the CPU). A listing is
plain data, printed and parsed here, so the listing file is the contract between the two:

    listing @mlp_tiny rank=0 mesh=[2] arena=8192 state=4352 lower_bound=6144
      input x state+0 dtype=f32 shape=[4,32] strides=[32,1] role=input
      buffer b0 arena+0 bytes=512 live=0..2
      call cublas.gemmEx transa=T transb=N m=64 n=4 k=32 alpha=1.0 A=state+256 lda=32 ...  # %0
      call kernel.pointwise name=pw_1a2b shape=[4,64] out=arena+512 out_strides=[64,1] ...
      call nccl.allReduce sendbuff=arena+512 recvbuff=arena+512 count=256 ... comm=axes1
      output 0 arena+512 dtype=f32 shape=[4,64] strides=[64,1] role=output

Memory is two regions per device: `state` (parameters, buffers, optimizer state and the
user's inputs, placed once) and `arena` (every intermediate, at offsets the memory plan chose).
An address is `region+byte offset`; strides and element offsets count elements.

Fused pointwise kernels carry their expression (`expr=`), from which both the CUDA C source
and the CPU executor's computation are derived: `add(x0,gelu(x1,approximate=tanh))`, where
`xK` is the kernel's K-th input and `const(v)` a literal.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from graphpar.errors import IRParseError

__all__ = [
    "Addr",
    "Apply",
    "BufferSlot",
    "Call",
    "Const",
    "Expr",
    "Leaf",
    "Listing",
    "TensorRef",
    "format_expr",
    "parse_expr",
    "parse_listing",
    "print_listing",
]

REGIONS = ("arena", "state")
ALIGNMENT = 256
"""Every buffer starts at a multiple of this many bytes (cudaMalloc's alignment)."""


@dataclass(frozen=True)
class Addr:
    """A byte address: `offset` bytes into a device's `region` ("arena" or "state")."""

    region: str
    offset: int

    def __add__(self, nbytes: int) -> Addr:
        return Addr(self.region, self.offset + nbytes)

    def __str__(self) -> str:
        return f"{self.region}+{self.offset}"


Value = Any  # a call parameter: int, float, bool, None, str, Addr or a tuple of ints


@dataclass(frozen=True)
class Call:
    """One call: a library function (`cublas.gemmEx`, `nccl.allReduce`), a memory operation
    (`cuda.memsetAsync`) or a kernel launch (`kernel.pointwise`, `kernel.softmax`, ...),
    with its parameters in order. `note` says which IR node it came from."""

    kind: str
    params: tuple[tuple[str, Value], ...]
    note: str = ""

    def __getitem__(self, key: str) -> Value:
        for k, v in self.params:
            if k == key:
                return v
        raise KeyError(f"{self.kind} has no parameter {key!r}")

    def get(self, key: str, default: Value = None) -> Value:
        return next((v for k, v in self.params if k == key), default)

    @property
    def args(self) -> dict[str, Value]:
        return dict(self.params)


@dataclass(frozen=True)
class BufferSlot:
    """An intermediate's place in the arena and the calls it is live over (first write to
    last read, inclusive; -1: from before the first call, a graph input)."""

    name: str
    addr: Addr
    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class TensorRef:
    """A graph input or output: where its elements are and how they are laid out."""

    name: str
    addr: Addr
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    role: str = "input"


@dataclass
class Listing:
    """Everything one device runs for one graph, and the memory it needs."""

    name: str
    rank: int = 0
    mesh: tuple[int, ...] = (1,)
    arena_bytes: int = 0
    state_bytes: int = 0
    lower_bound_bytes: int = 0  # max over calls of the bytes of live intermediates
    inputs: list[TensorRef] = field(default_factory=list)
    buffers: list[BufferSlot] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    outputs: list[TensorRef] = field(default_factory=list)

    def calls_by_kind(self) -> dict[str, int]:
        return dict(sorted(Counter(c.kind for c in self.calls).items()))

    def kernels(self) -> list[str]:
        """The generated kernels' names, in order of first launch."""
        return list(dict.fromkeys(c["name"] for c in self.calls if c.kind.startswith("kernel.")))

    def __str__(self) -> str:
        return print_listing(self)


# ------------------------------------------------------------------------- expressions

@dataclass(frozen=True)
class Leaf:
    """The kernel's input `index`, read at the element being computed."""

    index: int


@dataclass(frozen=True)
class Const:
    value: int | float | bool


@dataclass(frozen=True)
class Apply:
    """An IR elementwise op (`graphpar.ir.ops`) applied to sub-expressions, with its attrs."""

    op: str
    args: tuple[Expr, ...]
    attrs: tuple[tuple[str, Value], ...] = ()


Expr = Leaf | Const | Apply


def format_expr(e: Expr) -> str:
    if isinstance(e, Leaf):
        return f"x{e.index}"
    if isinstance(e, Const):
        return f"const({_format_value(e.value)})"
    parts = [format_expr(a) for a in e.args] + [f"{k}={_format_value(v)}" for k, v in e.attrs]
    return f"{e.op}({','.join(parts)})"


_TOKEN = re.compile(r"\s*(-inf|[A-Za-z_][A-Za-z0-9_.]*|[-+0-9.][-+0-9.eE]*|[(),=])")


def parse_expr(text: str) -> Expr:
    """The expression `format_expr` printed."""
    tokens = _TOKEN.findall(text)
    if "".join(tokens) != text.replace(" ", ""):
        raise IRParseError(f"bad kernel expression {text!r}")
    pos = 0

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise IRParseError(f"kernel expression {text!r} ends early")
        pos += 1
        return tokens[pos - 1]

    def expr() -> Expr:
        head = take()
        if re.fullmatch(r"x\d+", head):
            return Leaf(int(head[1:]))
        if take() != "(":
            raise IRParseError(f"kernel expression {text!r}: expected '(' after {head!r}")
        if head == "const":
            value = _parse_value(take())
            take()  # ")"
            return Const(value)
        args: list[Expr] = []
        attrs: list[tuple[str, Value]] = []
        while tokens[pos] != ")":
            if pos + 1 < len(tokens) and tokens[pos + 1] == "=":
                key = take()
                take()
                attrs.append((key, _parse_value(take())))
            else:
                args.append(expr())
            if tokens[pos] == ",":
                take()
        take()
        return Apply(head, tuple(args), tuple(attrs))

    result = expr()
    if pos != len(tokens):
        raise IRParseError(f"kernel expression {text!r}: unexpected {tokens[pos]!r}")
    return result


# ------------------------------------------------------------------------- printing

def _format_value(v: Value) -> str:
    if isinstance(v, tuple):
        return "[" + ",".join(_format_value(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    text = str(v)
    if not text or any(c.isspace() or c == "#" for c in text):
        raise ValueError(f"listing value {v!r} cannot be printed on one line")
    return text


def _params(params: Iterable[tuple[str, Value]]) -> str:
    return " ".join(f"{k}={_format_value(v)}" for k, v in params)


def _ref(kind: str, t: TensorRef) -> str:
    return (f"  {kind} {t.name} {t.addr} dtype={t.dtype} shape={_format_value(t.shape)} "
            f"strides={_format_value(t.strides)} role={t.role}")


def print_listing(listing: Listing) -> str:
    """The listing as text, one record per line; `parse_listing` reads it back."""
    lines = [f"listing @{listing.name} rank={listing.rank} mesh={_format_value(listing.mesh)} "
             f"arena={listing.arena_bytes} state={listing.state_bytes} "
             f"lower_bound={listing.lower_bound_bytes}"]
    lines += [_ref("input", t) for t in listing.inputs]
    lines += [f"  buffer {b.name} {b.addr} bytes={b.nbytes} live={b.first}..{b.last}"
              for b in listing.buffers]
    for c in listing.calls:
        note = f"  # {c.note}" if c.note else ""
        lines.append(f"  call {c.kind} {_params(c.params)}".rstrip() + note)
    lines += [_ref("output", t) for t in listing.outputs]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------- parsing

def _parse_value(text: str) -> Value:
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1]
        return tuple(_parse_value(x) for x in inner.split(",")) if inner else ()
    m = re.fullmatch(r"(arena|state)\+(\d+)", text)
    if m:
        return Addr(m.group(1), int(m.group(2)))
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if re.fullmatch(r"-?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?|-?inf|nan", text):
        return float(text)
    return text


def _key_values(tokens: list[str], where: str) -> dict[str, Value]:
    out = {}
    for tok in tokens:
        if "=" not in tok:
            raise IRParseError(f"{where}: expected key=value, got {tok!r}")
        key, value = tok.split("=", 1)
        out[key] = _parse_value(value)
    return out


def _int(kv: dict[str, Value], key: str, low: int = 0) -> int:
    value = kv[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key}={_format_shown(value)}: expected a whole number >= {low}")
    return value


def _ints(kv: dict[str, Value], key: str) -> tuple[int, ...]:
    value = kv[key]
    if not isinstance(value, tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"{key}={_format_shown(value)}: expected a list of whole numbers "
                         "like [8,16]")
    return value


def _word(value: Value, what: str) -> str:
    """`value`, a name `print_listing` can print back: text with no space and no '#'."""
    if not isinstance(value, str) or not value or "#" in value or any(
            c.isspace() for c in value):
        raise ValueError(f"{what} {_format_shown(value)}: expected a name with no spaces "
                         "and no '#'")
    return value


def _addr(text: str) -> Addr:
    value = _parse_value(text)
    if not isinstance(value, Addr):
        raise ValueError(f"{text!r}: expected an address, arena+N or state+N")
    return value


def _format_shown(value: Value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _printable(params: dict[str, Value]) -> dict[str, Value]:
    """`params`, each of which `print_listing` can print back on one line."""
    for key, value in params.items():
        _word(key, "parameter name")
        _format_value(value)
    return params


def parse_listing(text: str, source: str = "<listing>") -> Listing:
    """The listing `print_listing` printed; every field is checked for its type, and a line
    that is not what the printer writes is an IRParseError naming it."""
    listing: Listing | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        where = f"{source}:{number}"
        body, _, note = raw.partition("  # ")
        tokens = body.split()
        if not tokens:
            continue
        kind = tokens[0]
        try:
            if kind == "listing":
                kv = _key_values(tokens[2:], where)
                listing = Listing(_word(tokens[1].lstrip("@"), "listing name"),
                                  _int(kv, "rank"), _ints(kv, "mesh"), _int(kv, "arena"),
                                  _int(kv, "state"), _int(kv, "lower_bound"))
                continue
            if listing is None:
                raise IRParseError(f"{where}: a listing starts with a 'listing @name' line")
            if kind in ("input", "output"):
                kv = _key_values(tokens[3:], where)
                ref = TensorRef(_word(tokens[1], "value name"), _addr(tokens[2]),
                                _word(kv["dtype"], "dtype"), _ints(kv, "shape"),
                                _ints(kv, "strides"), _word(kv["role"], "role"))
                (listing.inputs if kind == "input" else listing.outputs).append(ref)
            elif kind == "buffer":
                kv = _key_values(tokens[3:], where)
                first, last = (int(x) for x in str(kv["live"]).split(".."))
                listing.buffers.append(BufferSlot(_word(tokens[1], "buffer name"),
                                                  _addr(tokens[2]), _int(kv, "bytes"), first,
                                                  last))
            elif kind == "call":
                params = tuple(_printable(_key_values(tokens[2:], where)).items())
                listing.calls.append(Call(_word(tokens[1], "call"), params, note.strip()))
            else:
                raise IRParseError(f"{where}: unknown record {kind!r} (listing, input, buffer, "
                                   "call, output)")
        except KeyError as exc:
            raise IRParseError(f"{where}: malformed {kind} line: missing {exc}") from None
        except (ValueError, IndexError, TypeError) as exc:
            raise IRParseError(f"{where}: malformed {kind} line: {exc}") from None
    if listing is None:
        raise IRParseError(f"{source}: empty listing")
    return listing
