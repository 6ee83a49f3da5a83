"""AST of the .attn language: frozen dataclasses, each with the span it came from.

The front end builds these from the Lark parse tree; the checker reads them and
the lowering turns the checked AST into IR (compiler/ir.py).  Nothing here is
validated beyond what the grammar guarantees.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .errors import Span

node = dataclass(frozen=True, slots=True)


# ---------------------------------------------------------------- expressions
@node
class IntLit:
    value: int
    span: Span


@node
class FloatLit:
    value: float
    span: Span


@node
class BoolLit:
    value: bool
    span: Span


@node
class Name:
    id: str
    span: Span


@node
class Call:
    func: str
    func_span: Span
    args: tuple["Expr", ...]
    span: Span


@node
class Index:
    tensor: str
    tensor_span: Span
    indices: tuple["Expr", ...]
    span: Span


@node
class Unary:
    op: str  # "-" or "!"
    operand: "Expr"
    span: Span


@node
class Binary:
    op: str  # + - * / // % & |
    left: "Expr"
    right: "Expr"
    span: Span


@node
class Compare:
    op: str  # == != < <= > >=
    left: "Expr"
    right: "Expr"
    span: Span


Expr = Union[IntLit, FloatLit, BoolLit, Name, Call, Index, Unary, Binary, Compare]


# ---------------------------------------------------------------- statements
@node
class Literal:
    """A policy argument or sample argument: int, float or bare name."""

    value: Union[int, float, str]
    span: Span


@node
class Argument:
    name: str | None  # None for positional
    value: Literal
    span: Span


@node
class Policy:
    kind: str
    kind_span: Span
    args: tuple[Argument, ...]
    span: Span


@node
class Heads:
    q: Literal
    kv: Literal | None
    span: Span


@node
class HeadDim:
    qk: Literal
    v: Literal | None
    span: Span


@node
class DType:
    name: str
    span: Span


@node
class Scale:
    expr: Expr
    span: Span


@node
class Axis:
    value: Union[str, int]
    span: Span


@node
class Sample:
    kind: str
    kind_span: Span
    args: tuple[Literal, ...]
    span: Span


@node
class TensorDecl:
    name: str
    name_span: Span
    dtype: str
    dtype_span: Span
    axes: tuple[Axis, ...]
    sample: Sample | None
    span: Span


@node
class ScoreStmt:
    expr: Expr
    span: Span


@node
class MaskStmt:
    expr: Expr
    span: Span


@node
class SinkStmt:
    """``sink = expr``: a learned logit per (request, query head) that joins every row's softmax
    denominator and carries no value."""

    expr: Expr
    span: Span


@node
class PolicyStmt:
    field: str  # cache | split | state | masked_rows
    policy: Policy
    span: Span


Statement = Union[Heads, HeadDim, DType, Scale, TensorDecl, ScoreStmt, MaskStmt, SinkStmt, PolicyStmt]


@node
class Attention:
    name: str
    name_span: Span
    statements: tuple[Statement, ...]
    span: Span
