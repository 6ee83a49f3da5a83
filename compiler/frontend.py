"""Parse .attn text into the AST (compiler/ast.py).

Lark (LALR, contextual lexer, ``propagate_positions``) parses with
``grammar/attn.lark``; a :class:`lark.Transformer` whose methods are named
after grammar rules builds frozen AST nodes with spans.  Lark's
``UnexpectedInput`` becomes a located :class:`SpecError` that says what was
expected.
"""
from __future__ import annotations

import functools
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken
from lark.lexer import PatternStr

from . import ast
from .errors import Diagnostic, Source, Span, SpecError

MAX_DEPTH = 32
"""How deeply expressions may nest (calls, subscripts, operators; a chain of one of the
associative operators `&`, `|`, `^` counts as a balanced tree, so `a & b & ... & z` of n terms
is about log2(n) deep).  Every pass over an expression and every backend's generated code is
proven to work up to this depth (tests/unit/test_language_fuzz.py); deeper is a located error."""
MAX_INT_DIGITS = 19
"""Integer literals are i32 (policy and size arguments at most 2**31 - 1); a literal with more
digits than any i64 is refused here, before Python converts it."""

GRAMMAR_PATH = Path(__file__).resolve().parent.parent / "grammar" / "attn.lark"


@functools.cache
def parser() -> Lark:
    return Lark(GRAMMAR_PATH.read_text(), parser="lalr", propagate_positions=True,
                maybe_placeholders=False)


def parse(text: str, name: str = "<spec>") -> ast.Attention:
    """Parse one .attn file; raise SpecError with a located diagnostic on bad syntax."""
    source = Source(name, text)
    try:
        tree = parser().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(source, e) from None
    return _Builder(source).build(tree)


def parse_file(path: str | Path) -> ast.Attention:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read {path}: {e.strerror}") from None
    return parse(text, str(path))


# --------------------------------------------------------------- syntax errors
_EXPRESSION_START = {"NAME", "INT", "FLOAT_LIT", "LPAR"}
_STATEMENT_START = {"HEADS", "HEAD_DIM", "DTYPE", "SCALE", "TENSOR", "SCORE", "MASK", "SINK", "CACHE",
                    "SPLIT", "STATE", "MASKED_ROWS"}
_COMPARISONS = {"==", "!=", "<", "<=", ">", ">="}


def _describe_terminal(name: str) -> str:
    if name == "$END":
        return "end of file"
    friendly = {"NAME": "a name", "INT": "an integer", "SIGNED_INT": "an integer",
                "FLOAT_LIT": "a number", "SIGNED_FLOAT_LIT": "a number"}
    if name in friendly:
        return friendly[name]
    try:
        pattern = parser().get_terminal(name).pattern
    except KeyError:
        return name
    return f"'{pattern.value}'" if isinstance(pattern, PatternStr) else name


def _expected(names: set[str]) -> str:
    names = set(names)
    parts = []
    if _EXPRESSION_START <= names:
        names -= _EXPRESSION_START | {"MINUS", "BANG", "TRUE", "FALSE"}
        parts.append("an expression")
    if _STATEMENT_START <= names:
        names -= _STATEMENT_START
        parts.append("a statement")
    parts += sorted({_describe_terminal(n) for n in names})
    if len(parts) == 1:
        return parts[0]
    return "one of " + ", ".join(parts)


def _acceptable(e: UnexpectedInput) -> set[str]:
    """The terminals the parser accepts at the error.  LALR's ``expected`` merges
    lookaheads of states that share a reduction (it offers ')' after `heads = 8`);
    the interactive parser tries each terminal and is exact."""
    try:
        return set(e.interactive_parser.accepts())
    except Exception:  # pragma: no cover - no interactive parser for this error kind
        return set(getattr(e, "expected", ()) or ())


def _split_number(source: Source, tok: Token) -> int | None:
    """Where an integer-only slot got `8.0`, the lexer reads `8` then `.0`: the
    start of the whole number, or None."""
    text, start = source.text, tok.start_pos
    if tok.type not in ("FLOAT_LIT", "SIGNED_FLOAT_LIT") or not str(tok).startswith("."):
        return None
    i = start
    while i > 0 and text[i - 1].isdigit():
        i -= 1
    if i == start:
        return None
    return i - 1 if i > 0 and text[i - 1] == "-" else i


def _syntax_error(source: Source, e: UnexpectedInput) -> SpecError:
    if isinstance(e, UnexpectedToken) and e.token.type != "$END":
        tok = e.token
        number_start = _split_number(source, tok)
        if number_start is not None:
            span = Span.at(source, number_start, tok.end_pos)
            return SpecError(Diagnostic(f"expected an integer, got '{span.text}'", span))
        span = Span.at(source, tok.start_pos, tok.end_pos)
        msg = f"unexpected '{tok}', expected {_expected(_acceptable(e))}"
        if str(tok) in _COMPARISONS:
            notes = ("comparisons do not chain: write (a < b) & (b < c)",)
            return SpecError(Diagnostic(msg, span, notes))
    elif isinstance(e, (UnexpectedEOF, UnexpectedToken)):
        end = len(source.text.rstrip())
        span = Span.at(source, max(end - 1, 0), end)
        accepted = _acceptable(e)
        if "RBRACE" in accepted:  # every statement so far is complete: the block is not closed
            msg = "unexpected end of file, expected '}' to close the attention block"
        else:
            msg = f"unexpected end of file, expected {_expected(accepted)}"
    elif isinstance(e, UnexpectedCharacters):
        span = Span.at(source, e.pos_in_stream, e.pos_in_stream + 1)
        ch = source.text[e.pos_in_stream]
        msg = f"unexpected character '{ch}'"
    else:  # pragma: no cover - lark has no other UnexpectedInput kinds
        span, msg = None, str(e)
    return SpecError(Diagnostic(msg, span))


# --------------------------------------------------------------- tree -> AST
_CHAINS = ("and_op", "or_op", "xor_op")  # associative: a run of one is built as a balanced tree
_EXPR_NODES = (ast.IntLit, ast.FloatLit, ast.BoolLit, ast.Name, ast.Call, ast.Index, ast.Unary, ast.Binary,
               ast.Compare)


class _Builder:
    """Tree -> AST, one method per grammar rule (and per ``->`` alias), each taking the rule's
    meta and its built children.  The walk is iterative (a post-order with an explicit stack),
    so no input can exhaust Python's recursion, and it measures each expression's depth on the
    way up: the first node deeper than MAX_DEPTH is a located error."""

    def __init__(self, source: Source):
        self.source = source

    def build(self, tree: Tree) -> ast.Attention:
        values: list = []  # built children, with their expression depths
        depths: list[int] = []
        stack: list[tuple[object, bool]] = [(tree, False)]
        while stack:
            node, ready = stack.pop()
            if not isinstance(node, Tree):
                values.append(node)
                depths.append(0)
                continue
            kids = self._operands(node)
            if not ready:
                stack.append((node, True))
                stack.extend((c, False) for c in reversed(kids))
                continue
            n = len(kids)
            args, kid_depths = values[len(values) - n:], depths[len(depths) - n:]
            del values[len(values) - n:], depths[len(depths) - n:]
            if node.data in _CHAINS:
                built, depth = self._chain(node.data, args, kid_depths)
            elif node.data == "paren":  # parentheses only group: no level of their own, and a chain
                built, depth = args[0], kid_depths[0]  # stops at them (``_operands``)
            else:
                built = getattr(self, node.data)(node.meta, args)
                depth = 1 + max(kid_depths, default=0) if isinstance(built, _EXPR_NODES) else 0
            if depth > MAX_DEPTH:
                raise SpecError(Diagnostic(
                    f"expression nested more than {MAX_DEPTH} levels deep (the language's limit)", built.span,
                    ("name the parts with tensors or split the condition: a chain of '&', '|' or '^' "
                     "counts as a balanced tree, other operators one level each",)))
            values.append(built)
            depths.append(depth)
        return values[0]

    @staticmethod
    def _operands(node: Tree) -> list:
        """The children to build first: a chain ``a & b & c`` (left-nested in the parse tree)
        gives its operands, flat; a parenthesized run, ``(a & b) & c``, is one operand (so the
        printed IR, ``ir.format_expr``, parses back to its own tree)."""
        if node.data not in _CHAINS:
            return list(node.children)
        op, out = node.data, []
        while isinstance(node, Tree) and node.data == op:
            left, right = node.children
            out.append(right)
            node = left
        out.append(node)
        return out[::-1]

    def _chain(self, rule: str, operands: list, depths: list[int]):
        """A balanced tree of one associative operator over ``operands`` (in order)."""
        op = {"and_op": "&", "or_op": "|", "xor_op": "^"}[rule]
        if len(operands) == 1:
            return operands[0], depths[0]
        mid = len(operands) // 2
        left, dl = self._chain(rule, operands[:mid], depths[:mid])
        right, dr = self._chain(rule, operands[mid:], depths[mid:])
        return ast.Binary(op, left, right, left.span.to(right.span)), 1 + max(dl, dr)

    # spans -------------------------------------------------------------
    def _meta_span(self, meta) -> Span:
        return Span.at(self.source, meta.start_pos, meta.end_pos)

    def _tok_span(self, tok: Token) -> Span:
        return Span.at(self.source, tok.start_pos, tok.end_pos)

    def _int(self, tok: Token, span: Span) -> int:
        digits = str(tok).lstrip("-")
        if len(digits) > MAX_INT_DIGITS:
            raise SpecError(Diagnostic(f"integer with {len(digits)} digits is too large: integers are i32 "
                                       f"(at most {2**31 - 1})", span))
        return int(tok)

    # top level -----------------------------------------------------------
    def start(self, meta, children):
        name, *statements = children
        return ast.Attention(str(name), self._tok_span(name), tuple(statements), self._meta_span(meta))

    # literals ------------------------------------------------------------
    def int_lit(self, meta, children):
        span = self._meta_span(meta)
        return ast.Literal(self._int(children[0], span), span)

    def float_lit(self, meta, children):
        return ast.Literal(float(children[0]), self._meta_span(meta))

    def name_literal(self, meta, children):
        return ast.Literal(str(children[0]), self._meta_span(meta))

    # statements ------------------------------------------------------------
    def heads(self, meta, children):
        return ast.Heads(children[0], children[1] if len(children) > 1 else None, self._meta_span(meta))

    def head_dim(self, meta, children):
        return ast.HeadDim(children[0], children[1] if len(children) > 1 else None, self._meta_span(meta))

    def dtype(self, meta, children):
        return ast.DType(str(children[0]), self._tok_span(children[0]))

    def scale(self, meta, children):
        return ast.Scale(children[0], self._meta_span(meta))

    def axis(self, meta, children):
        value = children[0]
        if isinstance(value, ast.Literal):
            return ast.Axis(value.value, value.span)
        return ast.Axis(str(value), self._tok_span(value))

    def sample(self, meta, children):
        kind, *args = children
        return ast.Sample(str(kind), self._tok_span(kind), tuple(args), self._meta_span(meta))

    def tensor(self, meta, children):
        name, dtype, *rest = children
        sample = rest.pop() if rest and isinstance(rest[-1], ast.Sample) else None
        return ast.TensorDecl(str(name), self._tok_span(name), str(dtype), self._tok_span(dtype),
                              tuple(rest), sample, self._meta_span(meta))

    def score(self, meta, children):
        return ast.ScoreStmt(children[0], self._meta_span(meta))

    def mask(self, meta, children):
        return ast.MaskStmt(children[0], self._meta_span(meta))

    def sink(self, meta, children):
        return ast.SinkStmt(children[0], self._meta_span(meta))

    def _policy_stmt(field):
        def build(self, meta, children):
            return ast.PolicyStmt(field, children[0], self._meta_span(meta))
        return build

    cache = _policy_stmt("cache")
    split = _policy_stmt("split")
    state = _policy_stmt("state")
    masked_rows = _policy_stmt("masked_rows")

    def policy(self, meta, children):
        kind, *args = children
        args = tuple(a if isinstance(a, ast.Argument) else ast.Argument(None, a, a.span) for a in args)
        return ast.Policy(str(kind), self._tok_span(kind), args, self._meta_span(meta))

    def keyword_argument(self, meta, children):
        name, value = children
        return ast.Argument(str(name), value, self._meta_span(meta))

    # expressions -----------------------------------------------------------
    def int_const(self, meta, children):
        span = self._meta_span(meta)
        return ast.IntLit(self._int(children[0], span), span)

    def float_const(self, meta, children):
        return ast.FloatLit(float(children[0]), self._meta_span(meta))

    def true_const(self, meta, children):
        return ast.BoolLit(True, self._meta_span(meta))

    def false_const(self, meta, children):
        return ast.BoolLit(False, self._meta_span(meta))

    def name(self, meta, children):
        return ast.Name(str(children[0]), self._meta_span(meta))

    def call(self, meta, children):
        func, *args = children
        return ast.Call(str(func), self._tok_span(func), tuple(args), self._meta_span(meta))

    def index(self, meta, children):
        tensor, *indices = children
        return ast.Index(str(tensor), self._tok_span(tensor), tuple(indices), self._meta_span(meta))

    def neg_op(self, meta, children):
        return ast.Unary("-", children[0], self._meta_span(meta))

    def not_op(self, meta, children):
        return ast.Unary("!", children[0], self._meta_span(meta))

    def _binary(op, node=ast.Binary):
        def build(self, meta, children):
            return node(op, children[0], children[1], self._meta_span(meta))
        return build

    add, sub, mul, div = _binary("+"), _binary("-"), _binary("*"), _binary("/")
    floordiv, mod = _binary("//"), _binary("%")
    shl, shr = _binary("<<"), _binary(">>")
    eq, ne = _binary("==", ast.Compare), _binary("!=", ast.Compare)
    lt, le = _binary("<", ast.Compare), _binary("<=", ast.Compare)
    gt, ge = _binary(">", ast.Compare), _binary(">=", ast.Compare)
