"""The IR: typed expression trees plus the program's declared tensors and policies.

A small closed set of frozen, slotted nodes (DESIGN §4).  Every node has a
``type``; operands of an arithmetic or comparison node always have the same
type (lowering inserts explicit ``cast_f32`` nodes), so backends never guess
promotion rules.  :func:`verify` checks those invariants.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator, Union

from . import policies

node = dataclass(frozen=True, slots=True)


class Type(str, enum.Enum):
    I32 = "i32"
    I64 = "i64"  # an integer whose range does not fit i32 (compiler/ranges.py decides; never declared)
    F32 = "f32"
    BOOL = "bool"

    @property
    def numeric(self) -> bool:
        return self is not Type.BOOL

    @property
    def integer(self) -> bool:
        return self in (Type.I32, Type.I64)


I32, I64, F32, BOOL = Type.I32, Type.I64, Type.F32, Type.BOOL
INT_BOUNDS = {I32: (-2**31, 2**31 - 1), I64: (-2**63, 2**63 - 1)}

# Operators, by the node kind that carries them.  Integer `//` and `%` are floor division and
# the remainder with the divisor's sign; both are total: x // 0 = 0 and x % 0 = x (so
# (x // y) * y + x % y == x for every y).
ARITH_OPS = ("add", "sub", "mul", "div", "floordiv", "mod")
BIT_OPS = ("bitand", "bitor", "bitxor", "shl", "shr")  # integers only
LOGIC_OPS = ("and", "or")
BINARY_OPS = ARITH_OPS + BIT_OPS + LOGIC_OPS
COMPARE_OPS = ("eq", "ne", "lt", "le", "gt", "ge")
UNARY_OPS = ("neg", "not", "cast_f32", "cast_i64")
# The language's functions: name -> arity.  The result type: FLOAT_FNS give f32, the others keep
# the (promoted) operand type.  Every table that computes or prints a call is keyed by this one
# (scalar.CALLS, interp.CALL, each backend's emit table; ranges and autodiff have a rule per name),
# and tests/unit/test_functions.py fails when one of them lacks a function: adding a function is
# the checklist in docs/ARCHITECTURE.md ("How to add a mask or score function").
CALL_FNS = {
    "min": 2, "max": 2, "abs": 1, "sign": 1, "exp": 1, "log": 1, "sqrt": 1, "tanh": 1, "erf": 1, "sin": 1,
    "cos": 1,
}
FLOAT_FNS = ("exp", "log", "sqrt", "tanh", "erf", "sin", "cos")
POSITION_VARS = ("q", "k", "b", "h")
LENGTH_VARS = ("S_q", "S_k")  # the request's query rows and keys (per request in a batch)
SINK_VARS = ("b", "h")  # what a sink may depend on: one logit per (request, query head)

# Surface spellings (the .attn language) of IR operators.  `&`, `|` and `^` are logical on
# conditions and bitwise on integers (`^` on conditions lowers to `!=`).
SURFACE_BINARY = {"+": "add", "-": "sub", "*": "mul", "/": "div", "//": "floordiv", "%": "mod",
                  "&": "and", "|": "or"}
SURFACE_BITWISE = {"&": "bitand", "|": "bitor", "^": "bitxor", "<<": "shl", ">>": "shr"}
SURFACE_COMPARE = {"==": "eq", "!=": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}


def promote(a: Type, b: Type) -> Type:
    """The common numeric type of two numeric operands."""
    return F32 if F32 in (a, b) else I64 if I64 in (a, b) else I32


# ---------------------------------------------------------------- expressions
@node
class Const:
    value: Union[int, float, bool]
    type: Type


@node
class Var:
    name: str  # q | k | b | h | S_q | S_k | score
    type: Type


@node
class Load:
    tensor: str
    index: tuple["Expr", ...]
    type: Type


@node
class Unary:
    op: str
    operand: "Expr"
    type: Type


@node
class Binary:
    op: str
    left: "Expr"
    right: "Expr"
    type: Type


@node
class Compare:
    op: str
    left: "Expr"
    right: "Expr"
    type: Type = BOOL


@node
class Select:
    cond: "Expr"
    if_true: "Expr"
    if_false: "Expr"
    type: Type


@node
class Call:
    fn: str
    args: tuple["Expr", ...]
    type: Type


Expr = Union[Const, Var, Load, Unary, Binary, Compare, Select, Call]


def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, (Const, Var)):
        return ()
    if isinstance(e, Load):
        return e.index
    if isinstance(e, Unary):
        return (e.operand,)
    if isinstance(e, (Binary, Compare)):
        return (e.left, e.right)
    if isinstance(e, Select):
        return (e.cond, e.if_true, e.if_false)
    if isinstance(e, Call):
        return e.args
    raise TypeError(f"not an IR expression: {e!r}")


def walk(e: Expr) -> Iterator[Expr]:
    """Pre-order traversal."""
    yield e
    for c in children(e):
        yield from walk(c)


def free_vars(e: Expr) -> frozenset[str]:
    return frozenset(n.name for n in walk(e) if isinstance(n, Var))


def score_keeps_tile(program: "Program") -> bool:
    """Whether every score statement reads ``score``: then each one's value has the shape of the
    tile of scores it starts from.  A statement that does not (``score = 7``, ``score = q``) is
    legal and its value is the same in every cell it does not vary over: a tiled backend
    broadcasts the program's result to the tile (the one rule every emitter asks here)."""
    return all("score" in free_vars(s) for s in program.score)


def loads(e: Expr) -> frozenset[str]:
    return frozenset(n.tensor for n in walk(e) if isinstance(n, Load))


def substitute(e: Expr, values: dict[str, Expr]) -> Expr:
    """``e`` with every ``Var`` named in ``values`` replaced by its expression, simultaneously
    (``{"q": k, "k": q}`` swaps the two)."""
    if isinstance(e, Var):
        return values.get(e.name, e)
    if isinstance(e, Const):
        return e
    if isinstance(e, Load):
        return Load(e.tensor, tuple(substitute(i, values) for i in e.index), e.type)
    if isinstance(e, Unary):
        return Unary(e.op, substitute(e.operand, values), e.type)
    if isinstance(e, (Binary, Compare)):
        return type(e)(e.op, substitute(e.left, values), substitute(e.right, values), e.type)
    if isinstance(e, Select):
        return Select(substitute(e.cond, values), substitute(e.if_true, values), substitute(e.if_false, values),
                      e.type)
    if isinstance(e, Call):
        return Call(e.fn, tuple(substitute(a, values) for a in e.args), e.type)
    raise TypeError(f"not an IR expression: {e!r}")


# ---------------------------------------------------------------- declarations
@node
class Sample:
    """How `attnc run`/`attnc demo` make an example value for a tensor."""

    kind: str
    args: tuple[Union[int, float, str], ...]


@node
class TensorDecl:
    name: str
    dtype: Type
    axes: tuple[Union[str, int], ...]  # "b" | "h" | "s" | size
    sample: Sample | None = None

    def signature(self) -> str:
        return f"{self.dtype.value}[{', '.join(str(a) for a in self.axes)}]"


@node
class FlashmaskBounds:
    """A tensor read by ``flashmask(tensor, causal)``: Paddle's ``startend_row_indices`` with
    ``bounds`` values per column, whose contract every call checks (``inputs.check_flashmask``)."""

    tensor: str
    causal: bool
    bounds: int  # 1, 2 or 4

    @property
    def columns(self) -> tuple[str, ...]:
        """What each of the ``bounds`` values is, in Paddle's order."""
        return {(True, 1): ("LTS",), (True, 2): ("LTS", "LTE"), (False, 2): ("LTS", "UTE"),
                (False, 4): ("LTS", "LTE", "UTS", "UTE")}[(self.causal, self.bounds)]


class TileClass(enum.IntEnum):
    """How a (Q tile, K/V tile) enters the online softmax (M4.5 §0x05C)."""

    SKIP = 0  # every cell masked: never load K/V, merge the empty identity
    PARTIAL = 1  # some cells masked: set them to -inf before the max/sum update
    FULL = 2  # no cell masked: ordinary update, no element mask


class CacheKind(str, enum.Enum):
    CONTIGUOUS = "contiguous"
    RAGGED = "ragged"
    PAGED = "paged"


class Layout(str, enum.Enum):
    BHSD = "bhsd"  # HND
    BSHD = "bshd"  # NHD
    NHD = "nhd"  # page layouts
    HND = "hnd"


class StateABI(str, enum.Enum):
    LSE_O = "lse_o"
    MLU = "mlu"


# ``state = shared_shift(phi, lower, upper)``: the window (lower, upper) of s - phi must keep
# exp(s - phi) a normal float32 and the sum of 2**32 such terms finite (e**64 * 2**32 < 3.4e38,
# e**-64 > 1.2e-38), so a split whose guard holds cannot overflow or flush to zero.
SHIFT_WINDOW = policies.SHIFT_WINDOW  # declared with the policy table's other bounds


@node
class SharedShift:
    """The FlashDecoding++ partial-state ABI (M4.5 §0x09C): every split accumulates
    numerator and denominator in the common frame exp(s - phi); a visible score whose
    s - phi leaves (lower, upper) makes the call recompute its output with (m, l, u)."""

    phi: float
    lower: float
    upper: float

    @property
    def value(self) -> str:  # the ABI's name, as StateABI members have it
        return "shared_shift"

    @property
    def params(self) -> policies.Args:
        """The arguments by the names ``compiler/policies.py`` declares (this node's fields)."""
        return policies.Args((q.name, getattr(self, q.name)) for q in policies.POLICIES["state"]["shared_shift"])


class SplitKind(str, enum.Enum):
    AUTO = "auto"
    BALANCED = "balanced"
    CHUNK = "chunk"
    CAPACITY = "capacity"
    HEURISTIC = "heuristic"


@node
class Cache:
    kind: CacheKind = CacheKind.CONTIGUOUS
    layout: Layout = Layout.BHSD
    page_size: int | None = None
    table: str | None = None  # paged: "dense" | "csr"


@node
class Split:
    """``split = kind(name = value, ...)``: the arguments by the names ``compiler/policies.py``
    declares (a mapping given here is checked against the table and its defaults filled in)."""

    kind: SplitKind = SplitKind.AUTO
    params: policies.Args = policies.Args()

    def __post_init__(self):
        object.__setattr__(self, "kind", SplitKind(self.kind))
        object.__setattr__(self, "params", policies.args("split", self.kind, self.params))


@node
class Program:
    name: str
    heads_q: int | None  # None in a shape-generic spec: the call decides (``specialize``); likewise below
    heads_kv: int | None
    d_qk: int | None
    d_v: int | None
    dtype: str  # f16 | bf16 | f32 (storage of Q, K, V, O); bf16 where the spec leaves it to the call
    scale: float | None  # None: 1 / sqrt(d_qk) of the call
    tensors: tuple[TensorDecl, ...]
    score: tuple[Expr, ...]  # ordered statements; each reads Var("score") = the previous value
    mask: Expr
    cache: Cache = field(default_factory=Cache)
    split: Split = field(default_factory=Split)
    state: Union[StateABI, SharedShift] = StateABI.LSE_O
    masked_rows: str = "zero"
    # what the spec leaves to each call (some of "heads", "head_dim", "dtype"): ``specialize`` fills
    # them in from the call's tensors; heads and head dims are None until then, dtype is bf16
    open_fields: tuple[str, ...] = ()
    # the tensors flashmask(...) reads, with the contract their values keep; implied by the mask
    # (which reads them), so the spec digest (repr) leaves it out
    flashmask: tuple[FlashmaskBounds, ...] = field(default=(), repr=False)
    # ``sink = expr``: an f32 logit of b and h (constants, loads indexed by b and h) that joins every
    # row's softmax denominator with no value: O = sum_k e^(s_k - m) v_k / (e^(sink - m) + sum_k
    # e^(s_k - m)), LSE = log(e^sink + sum_k e^s_k); a row that sees no key has O = 0, LSE = sink.
    # None: no sink.  Left out of repr (a program without one keeps its digest); ``digest`` adds it.
    sink: Expr | None = field(default=None, repr=False)

    @property
    def generic(self) -> tuple[str, ...]:
        """What the spec leaves to the call that a program cannot run without: 'heads', 'head_dim'."""
        return tuple(n for n in ("heads", "head_dim") if n in self.open_fields)

    @property
    def group(self) -> int:
        """GQA group size G = H_q / H_kv; the K/V head of query head h is h // G."""
        return self.heads_q // self.heads_kv

    def tensor(self, name: str) -> TensorDecl:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


# ---------------------------------------------------------------- typing rules
def unary_type(op: str, t: Type) -> Type | None:
    """Result type of a unary op, or None when the operand type is wrong."""
    if op == "neg":
        return t if t.numeric else None
    if op == "not":
        return BOOL if t is BOOL else None
    if op == "cast_f32":
        return F32 if t.numeric else None
    if op == "cast_i64":
        return I64 if t.integer else None
    return None


def binary_type(op: str, a: Type, b: Type) -> Type | None:
    if op in LOGIC_OPS:
        return BOOL if a is BOOL and b is BOOL else None
    if op in BIT_OPS:
        return promote(a, b) if a.integer and b.integer else None
    if not (a.numeric and b.numeric):
        return None
    return F32 if op == "div" else promote(a, b)


def compare_type(op: str, a: Type, b: Type) -> Type | None:
    if a.numeric and b.numeric:
        return BOOL
    if a is BOOL and b is BOOL and op in ("eq", "ne"):
        return BOOL
    return None


def call_type(fn: str, args: tuple[Type, ...]) -> Type | None:
    if fn not in CALL_FNS or len(args) != CALL_FNS[fn] or not all(t.numeric for t in args):
        return None
    if fn in FLOAT_FNS:
        return F32
    return promote(*args) if len(args) == 2 else args[0]


# ---------------------------------------------------------------- verifier
class VerifyError(Exception):
    """An IR invariant is broken: a compiler bug, never a user error."""


def verify_expr(e: Expr, program: Program | None = None, allowed_vars=POSITION_VARS + LENGTH_VARS) -> None:
    for n in walk(e):
        if isinstance(n, Const):
            ok = {BOOL: bool, I32: int, I64: int, F32: float}[n.type]
            if type(n.value) is not ok:
                raise VerifyError(f"constant {n.value!r} is not {n.type.value}")
            if n.type.integer and not INT_BOUNDS[n.type][0] <= n.value <= INT_BOUNDS[n.type][1]:
                raise VerifyError(f"constant {n.value} overflows {n.type.value}")
        elif isinstance(n, Var):
            if n.name not in allowed_vars:
                raise VerifyError(f"variable {n.name} not allowed here")
            if n.type is not (F32 if n.name == "score" else I32):
                raise VerifyError(f"variable {n.name} has type {n.type.value}")
        elif isinstance(n, Load):
            if program is not None:
                decl = program.tensor(n.tensor)
                if len(n.index) != len(decl.axes) or n.type is not decl.dtype:
                    raise VerifyError(f"load of {n.tensor} disagrees with {decl.signature()}")
            if not all(i.type.integer for i in n.index):
                raise VerifyError(f"load of {n.tensor} has a non-integer index")
        elif isinstance(n, Unary):
            if unary_type(n.op, n.operand.type) is not n.type:
                raise VerifyError(f"{n.op} on {n.operand.type.value} typed {n.type.value}")
        elif isinstance(n, (Binary, Compare)):
            rule = binary_type if isinstance(n, Binary) else compare_type
            if n.left.type is not n.right.type or rule(n.op, n.left.type, n.right.type) is not n.type:
                raise VerifyError(f"{n.op} on {n.left.type.value}, {n.right.type.value} typed {n.type.value}")
        elif isinstance(n, Select):
            if n.cond.type is not BOOL or not (n.if_true.type is n.if_false.type is n.type):
                raise VerifyError("select operands disagree")
        elif isinstance(n, Call):
            if n.args and any(a.type is not n.args[0].type for a in n.args):
                raise VerifyError(f"{n.fn} operands disagree")
            if call_type(n.fn, tuple(a.type for a in n.args)) is not n.type:
                raise VerifyError(f"{n.fn} typed {n.type.value}")


def verify(program: Program) -> Program:
    """Check the IR invariants; return the program so passes can chain it."""
    if program.heads_q is not None and program.heads_q % program.heads_kv:
        raise VerifyError("heads_q is not a multiple of heads_kv")
    verify_expr(program.mask, program)
    if program.mask.type is not BOOL:
        raise VerifyError("mask is not boolean")
    for s in program.score:
        verify_expr(s, program, POSITION_VARS + LENGTH_VARS + ("score",))
        if s.type is not F32:
            raise VerifyError("score statement is not f32")
    if program.sink is not None:
        verify_expr(program.sink, program, SINK_VARS)
        if program.sink.type is not F32:
            raise VerifyError("sink is not f32")
    return program


# ---------------------------------------------------------------- surface text
_PRECEDENCE = {"or": 1, "bitor": 1, "bitxor": 2, "and": 3, "bitand": 3, "not": 4, "cmp": 5, "shl": 6, "shr": 6,
               "add": 7, "sub": 7, "mul": 8, "div": 8, "floordiv": 8, "mod": 8, "neg": 9}
_NEG = _PRECEDENCE["neg"]
_CHAIN_OPS = ("or", "bitor", "bitxor", "and", "bitand")  # the parser builds their runs as balanced trees
_SURFACE_OF = {v: k for table in (SURFACE_BINARY, SURFACE_BITWISE, SURFACE_COMPARE) for k, v in table.items()}


def format_expr(e: Expr) -> str:
    """The IR as .attn surface syntax (sugar already folded), minimally parenthesized.

    Generated sources quote this, never the user's text."""
    return _fmt(e, 0)


def _fmt(e: Expr, outer: int) -> str:
    if isinstance(e, Const):
        text = ("true" if e.value else "false") if e.type is BOOL else repr(e.value)
        return text if not (isinstance(e.value, (int, float)) and e.value < 0 and outer >= _NEG) else f"({text})"
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Load):
        return f"{e.tensor}[{', '.join(_fmt(i, 0) for i in e.index)}]"
    if isinstance(e, Call):
        return f"{e.fn}({', '.join(_fmt(a, 0) for a in e.args)})"
    if isinstance(e, Select):
        return f"where({_fmt(e.cond, 0)}, {_fmt(e.if_true, 0)}, {_fmt(e.if_false, 0)})"
    if isinstance(e, Unary):
        if e.op in ("cast_f32", "cast_i64"):
            return _fmt(e.operand, outer)  # implicit in the surface language
        prec = _PRECEDENCE[e.op]
        text = ("-" if e.op == "neg" else "!") + _fmt(e.operand, prec)
    else:
        key = "cmp" if isinstance(e, Compare) else e.op
        prec = _PRECEDENCE[key]
        # left-associative: the right operand needs parentheses at equal precedence; comparisons do not
        # chain, and a run of '&', '|' or '^' parses as a balanced tree (frontend._chain), so a left
        # operand of the same run is parenthesized too: the printed text parses back to this tree
        left_prec = prec + 1 if isinstance(e, Compare) or e.op in _CHAIN_OPS else prec
        text = f"{_fmt(e.left, left_prec)} {_SURFACE_OF[e.op]} {_fmt(e.right, prec + 1)}"
    return f"({text})" if prec < outer else text


def digest(program: Program) -> str:
    """sha256 of the program's canonical form: the compile-time cache key."""
    import hashlib
    text = repr(program) if program.sink is None else f"{program!r} sink={program.sink!r}"
    return hashlib.sha256(text.encode()).hexdigest()


def specialize(program: Program, heads_q: int, heads_kv: int, d_qk: int, d_v: int, dtype: str, *,
               where: str = "inputs", flags: dict[str, str] | None = None) -> Program:
    """The concrete program of a shape-generic spec for one call's shapes and dtype.  Declared
    values are checks: a call that contradicts one is refused naming it.  A concrete spec comes
    back unchanged when the call agrees with it.  The values come from a call's tensors, or, with
    ``flags`` (field -> option, e.g. ``{"heads": "--heads"}``), from the command line: the errors
    then name the option, prefixed with ``where``."""
    from .errors import InputError
    declared = {"heads": (program.heads_q, program.heads_kv), "head_dim": (program.d_qk, program.d_v),
                "dtype": program.dtype}
    called = {"heads": (heads_q, heads_kv), "head_dim": (d_qk, d_v), "dtype": dtype}
    shown = {"heads": lambda v: f"{v[0]} / {v[1]}", "head_dim": lambda v: f"{v[0]} / {v[1]}", "dtype": str}
    for name, want in declared.items():
        if name not in program.open_fields and want != called[name]:
            given = (f"{flags[name]} gives {shown[name](called[name])}" if flags and name in flags
                     else f"the call has {name} {shown[name](called[name])}")
            raise InputError(f"{where}: spec '{program.name}' declares {name} = {shown[name](want)}; {given}")
    if heads_q < 1 or heads_kv < 1 or heads_q % heads_kv:
        given = f"{flags['heads']} {heads_q}/{heads_kv}" if flags and "heads" in flags else \
            f"q has {heads_q} heads and k/v {heads_kv}"
        raise InputError(f"{where}: {given}: H_q must be a multiple of H_kv (GQA)")
    if dtype not in ("f16", "bf16", "f32"):
        given = f"{flags['dtype']} {dtype}" if flags and "dtype" in flags else f"q has dtype {dtype}"
        raise InputError(f"{where}: {given}; attention stores f16, bf16 or f32")
    if d_qk < 1 or d_v < 1:
        given = f"{flags['head_dim']} {d_qk}/{d_v}" if flags and "head_dim" in flags else \
            f"q/k have head dim {d_qk} and v {d_v}"
        raise InputError(f"{where}: {given}; a head dim is at least 1")
    if not program.open_fields:
        return program
    import math
    from dataclasses import replace
    return replace(program, heads_q=heads_q, heads_kv=heads_kv, d_qk=d_qk, d_v=d_v, dtype=dtype,
                   scale=program.scale if program.scale is not None else 1 / math.sqrt(d_qk), open_fields=())
