"""Semantic checks: names, types, subscripts, GQA ratio, policies, duplicates.

``check(attention_ast)`` returns a :class:`Spec` — the AST with every scalar
statement resolved and every policy turned into its IR value — or raises a
SpecError listing *every* error of the file, each located with a caret.
"""
from __future__ import annotations

import difflib
import keyword
import math
from dataclasses import dataclass, field
from typing import Callable

from . import ast, ir
from .errors import DiagnosticSink, Span
from .policies import MAX_SIZE, POLICIES, POSITIONAL_OK, Param  # noqa: F401  (Param: the table's, re-exported)
from .ir import BOOL, F32, I32, Type
from .scalar import FLT_MAX, float_floordiv, float_mod, int_floordiv, int_mod
from .scalar import CALLS as scalar_calls
from .scalar import f32 as fold_f32

DTYPES = ("f16", "bf16", "f32")
TENSOR_DTYPES = {"i32": I32, "f32": F32, "bool": BOOL}
AXES = ("b", "h", "s")
SUGAR = {"causal": 0, "window": 1, "softcap": 2, "where": 3}  # name -> arity (0: a name, not a call)
FUNCTIONS = {**ir.CALL_FNS, "window": 1, "softcap": 2, "where": 3, "flashmask": 2}
# flashmask(sri, causal): PaddlePaddle FlashMask's startend_row_indices [B, H or 1, S_k, n]
# with its causal flag; Paddle admits n in {1, 2} when causal and n in {2, 4} otherwise
# (python/paddle/nn/functional/flash_attention.py: flashmask_attention).
FLASHMASK_BOUNDS = {True: (1, 2), False: (2, 4)}
FLASHMASK_LAYOUT = "i32[b, heads, s, n] with heads = h, 1, H_q or H_kv and n = 1, 2 or 4"
MAX_NAME = 64  # identifiers (the attention name names generated files)
# Declared tensors are passed by name next to these: the inputs of a call (attnc run's npz keys,
# DESIGN §5) and every keyword argument of an entry point that takes tensors as **keywords
# (tests/unit/test_language_names.py reads the entry points' signatures and keeps this list whole).
CALL_KEYWORDS = {
    "q", "k", "v", "o", "lse", "k_cache", "v_cache", "block_table", "kv_lens", "kv_indptr", "kv_indices",
    "kv_last_page_len", "cache_batch_idx", "q_lens", "qo_indptr",  # inputs and outputs
    "self", "return_lse", "plan", "stats", "cache", "lengths", "backend", "block_m", "block_n", "block_q",
    "splits", "num_warps", "num_stages", "capture", "max_kv_len", "cuda_graph", "sp", "case", "mask_from",
    "tensors", "arrays", "options", "route", "device", "engine", "walk", "use_tma", "head_group",
    "schedule", "occupancy", "kernel", "do", "dlse", "config", "k_new", "v_new", "manifest", "q_offset", "k_offset",
}
LANGUAGE_NAMES = set(ir.POSITION_VARS) | set(ir.LENGTH_VARS) | {"s", "score", "causal", "true", "false"} \
    | set(FUNCTIONS)
RESERVED = LANGUAGE_NAMES | CALL_KEYWORDS


@dataclass
class Spec:
    """A checked spec: what lowering needs, nothing unvalidated."""

    node: ast.Attention
    name: str
    heads_q: int | None  # None: taken from each call (a shape-generic spec); likewise below
    heads_kv: int | None
    d_qk: int | None
    d_v: int | None
    dtype: str  # bf16 when left out: the call's in attnc.compile, the default elsewhere
    scale: float | None  # None: 1 / sqrt(d_qk) of the call
    tensors: dict[str, ast.TensorDecl]
    tensor_types: dict[str, ir.TensorDecl]
    score: list[ast.Expr]
    mask: ast.Expr | None
    sink: ast.Expr | None = None  # sink = expr: an f32 logit of (b, h) in every row's softmax denominator
    cache: ir.Cache = field(default_factory=ir.Cache)
    split: ir.Split = field(default_factory=ir.Split)
    open_fields: tuple[str, ...] = ()
    state: ir.StateABI | ir.SharedShift = ir.StateABI.LSE_O
    masked_rows: str = "zero"


def _suggest(name: str, candidates) -> tuple[str, ...]:
    close = difflib.get_close_matches(name, sorted(candidates), n=1)
    return (f"did you mean '{close[0]}'?",) if close else ()


def _one_of(values) -> str:
    return ", ".join(f"'{v}'" for v in values)


def _expected_one_of(values) -> str:
    values = list(values)
    return f"expected '{values[0]}'" if len(values) == 1 else f"expected one of {_one_of(values)}"


# ---------------------------------------------------------------- policies
# the kinds, typed parameters and defaults of cache / split / state / masked_rows: compiler/policies.py
SAMPLES: dict[str, tuple[tuple[str, type], ...]] = {
    # kind -> parameters; see compiler/inputs.py for what each draws
    "segments": (("min_len", int), ("max_len", int)),
    "prefix_ends": (("doc", str), ("min_len", int), ("max_len", int)),
    "randint": (("low", int), ("high", int)),
    "uniform": (("low", float), ("high", float)),
    "bernoulli": (("p", float),),
    "const": (("value", float),),
}
SAMPLE_DTYPES = {"segments": (I32,), "prefix_ends": (I32,), "randint": (I32,), "uniform": (F32,),
                 "bernoulli": (BOOL,), "const": (I32, F32)}


class Checker:
    def __init__(self, node: ast.Attention):
        self.node = node
        self.sink = DiagnosticSink()
        self.tensors: dict[str, ast.TensorDecl] = {}
        self.heads: tuple[int, int] | None = None  # (H_q, H_kv) once 'heads' is checked

    def error(self, message: str, span: Span | None, *notes: str) -> None:
        self.sink.error(message, span, *notes)

    # ------------------------------------------------------------ entry
    def run(self) -> Spec:
        node = self.node
        self._check_identifier(node.name, node.name_span, "attention name")
        seen: dict[str, ast.Statement] = {}
        scores: list[ast.ScoreStmt] = []
        for stmt in node.statements:
            key = self._statement_key(stmt)
            if key == "score":
                scores.append(stmt)
                continue
            if key in seen:
                first = seen[key].span
                what = f"tensor '{stmt.name}'" if isinstance(stmt, ast.TensorDecl) else f"'{key}' statement"
                self.error(f"duplicate {what}", stmt.span, f"first defined at line {first.line}")
                continue
            seen[key] = stmt

        for stmt in node.statements:  # tensors first: expressions may refer to any of them
            if isinstance(stmt, ast.TensorDecl) and seen.get(f"tensor {stmt.name}") is stmt:
                self._tensor(stmt)

        # heads, head_dim and dtype left out are the call's (a shape-generic spec): None here,
        # filled in by ir.specialize from the tensors of each call
        spec = Spec(node=node, name=node.name, heads_q=None, heads_kv=None, d_qk=None, d_v=None, dtype="bf16",
                    scale=None, tensors=self.tensors, tensor_types={}, score=[], mask=None,
                    open_fields=tuple(n for n in ("heads", "head_dim", "dtype") if n not in seen))
        if "heads" in seen:
            spec.heads_q, spec.heads_kv = self._heads(seen["heads"])
            self.heads = (spec.heads_q, spec.heads_kv)
        if "head_dim" in seen:
            hd = seen["head_dim"]
            spec.d_qk = self._size(hd.qk, "head_dim")
            spec.d_v = self._size(hd.v, "head_dim") if hd.v else spec.d_qk
        if "dtype" in seen:
            d = seen["dtype"]
            if d.name not in DTYPES:
                self.error(f"unknown dtype '{d.name}'; expected one of {_one_of(DTYPES)}", d.span,
                           *_suggest(d.name, DTYPES))
            spec.dtype = d.name
        if spec.d_qk is not None:
            spec.scale = 1 / math.sqrt(spec.d_qk)
        if "scale" in seen:
            spec.scale = self._scale(seen["scale"])
        spec.tensor_types = {n: self._tensor_type(t) for n, t in self.tensors.items()}
        for stmt in scores:
            t = self.expr(stmt.expr, "score")
            if t is BOOL:
                self.error("score statement is boolean; a score statement computes a number "
                           "(to hide positions, put the condition in 'mask')", stmt.expr.span)
            spec.score.append(stmt.expr)
        if "mask" in seen:
            m = seen["mask"].expr
            t = self.expr(m, "mask")
            if t is not None and t is not BOOL:
                self.error(f"mask is numeric ({t.value}); a mask is a condition that is true "
                           "where (q, k) is visible", m.span)
            spec.mask = m
        if "sink" in seen:
            spec.sink = self._sink(seen["sink"])
        for fld in POLICIES:
            if fld in seen:
                value = self._policy(fld, seen[fld].policy)
                if value is not None:
                    setattr(spec, fld, value)
        self.sink.raise_if_any()
        return spec

    @staticmethod
    def _statement_key(stmt) -> str:
        if isinstance(stmt, ast.TensorDecl):
            return f"tensor {stmt.name}"
        if isinstance(stmt, ast.PolicyStmt):
            return stmt.field
        return {ast.Heads: "heads", ast.HeadDim: "head_dim", ast.DType: "dtype", ast.Scale: "scale",
                ast.ScoreStmt: "score", ast.MaskStmt: "mask", ast.SinkStmt: "sink"}[type(stmt)]

    # ------------------------------------------------------------ scalars
    def _check_identifier(self, name: str, span: Span, what: str) -> bool:
        if len(name) > MAX_NAME:
            self.error(f"{what} is {len(name)} characters long; names have at most {MAX_NAME}", span)
            return False
        if keyword.iskeyword(name):  # soft keywords (match, case, type) are valid names
            self.error(f"{what} '{name}' is a Python keyword; choose another name", span)
            return False
        if name.startswith("_"):
            self.error(f"{what} '{name}' starts with '_', which generated code reserves", span)
            return False
        return True

    def _size(self, lit: ast.Literal, what: str) -> int:
        if lit.value <= 0:
            self.error(f"{what} must be positive, got {lit.value}", lit.span)
            return 1
        if lit.value > MAX_SIZE:
            self.error(f"{what} must be at most {MAX_SIZE}, got {lit.value}", lit.span)
            return 1
        return lit.value

    def _heads(self, stmt: ast.Heads) -> tuple[int, int]:
        hq = self._size(stmt.q, "heads")
        hkv = self._size(stmt.kv, "heads") if stmt.kv else hq
        if hq % hkv:
            self.error(f"{hq} query heads cannot share {hkv} K/V heads: H_q % H_kv = {hq % hkv}",
                       stmt.span, "GQA needs H_q to be a multiple of H_kv (e.g. heads = 32 / 8)")
            return hq, hq
        return hq, hkv

    def _scale(self, stmt: ast.Scale) -> float:
        errors_before = len(self.sink.diagnostics)
        t = self.expr(stmt.expr, "scale")
        if t is None or len(self.sink.diagnostics) > errors_before:
            return 1.0
        if t is BOOL:
            self.error("scale is boolean; it must be a positive number", stmt.expr.span)
            return 1.0
        try:
            value = _const_value(stmt.expr, strict=True)
        except (ValueError, OverflowError, ZeroDivisionError) as exc:  # e.g. sqrt(-1), exp(1000)
            self.error(f"scale cannot be computed: {exc}", stmt.expr.span)
            return 1.0
        if value is None:
            self.error("scale must be a constant expression", stmt.expr.span)
            return 1.0
        if not (math.isfinite(value) and value > 0):
            self.error(f"scale must be a positive finite number, got {value}", stmt.expr.span)
            return 1.0
        return float(value)

    def _sink(self, stmt: ast.SinkStmt) -> ast.Expr | None:
        """``sink = expr``: an f32 value of the request ``b``, the query head ``h``, constants and
        tensor reads indexed by them (``sinks[h]``): one logit per (b, h) row set."""
        errors_before = len(self.sink.diagnostics)
        t = self.expr(stmt.expr, "sink")
        if t is None or len(self.sink.diagnostics) > errors_before:
            return None
        if t is BOOL:
            self.error("sink is a condition; a sink is an f32 logit that joins every row's softmax "
                       "denominator", stmt.expr.span, "e.g. declare tensor sinks: f32[h] and write sink = sinks[h]")
            return None
        if t is not F32:
            self.error(f"sink is {t.value}; a sink is an f32 logit (read an f32 tensor, e.g. sinks[h], or "
                       "write a float such as 0.0)", stmt.expr.span)
            return None
        return stmt.expr

    # ------------------------------------------------------------ tensors
    def _tensor(self, t: ast.TensorDecl) -> None:
        if not self._check_identifier(t.name, t.name_span, "tensor name"):
            return
        if t.name in RESERVED:
            if t.name in LANGUAGE_NAMES:
                self.error(f"tensor name '{t.name}' is reserved by the language", t.name_span)
            else:
                self.error(f"tensor name '{t.name}' is reserved: a call passes its inputs and options by "
                           "that name", t.name_span)
            return
        ok = True
        if t.dtype not in TENSOR_DTYPES:
            self.error(f"unknown tensor dtype '{t.dtype}'; expected one of {_one_of(TENSOR_DTYPES)}",
                       t.dtype_span, *_suggest(t.dtype, TENSOR_DTYPES))
            ok = False
        for a in t.axes:
            if isinstance(a.value, int):
                if not 0 < a.value <= MAX_SIZE:
                    self.error(f"axis size must be in [1, {MAX_SIZE}], got {a.value}", a.span)
                    ok = False
            elif a.value not in AXES:
                self.error(f"unknown axis '{a.value}'; an axis is 'b' (request), 'h' (query head), "
                           "'s' (token position) or a positive size", a.span)
                ok = False
        if ok and t.sample is not None:
            self._sample(t)
        self.tensors[t.name] = t

    def _sample(self, t: ast.TensorDecl) -> None:
        s = t.sample
        if s.kind not in SAMPLES:
            self.error(f"unknown sample '{s.kind}'; expected one of {_one_of(SAMPLES)}", s.kind_span,
                       *_suggest(s.kind, SAMPLES))
            return
        params = SAMPLES[s.kind]
        if len(s.args) != len(params):
            sig = ", ".join(p for p, _ in params)
            self.error(f"sample '{s.kind}' takes {len(params)} arguments ({sig}), got {len(s.args)}", s.span)
            return
        args_ok = True
        for (pname, kind), arg in zip(params, s.args):
            if kind is str:
                ref = self.tensors.get(arg.value) if isinstance(arg.value, str) else None
                if ref is None or "s" not in [a.value for a in ref.axes]:
                    self.error(f"'{pname}' of sample '{s.kind}' must name a tensor declared before "
                               "it with an 's' axis", arg.span)
                    args_ok = False
            elif not _literal_fits(arg.value, kind):
                self.error(f"'{pname}' of sample '{s.kind}' must be {_kind_name(kind)}, got {arg.value!r}",
                           arg.span)
                args_ok = False
        if args_ok:
            self._sample_ranges(t)
        dtype = TENSOR_DTYPES[t.dtype]
        if dtype not in SAMPLE_DTYPES[s.kind]:
            kinds = " or ".join(d.value for d in SAMPLE_DTYPES[s.kind])
            self.error(f"sample '{s.kind}' makes {kinds} values; tensor '{t.name}' is {t.dtype}", s.kind_span)
        if s.kind in ("segments", "prefix_ends") and [a.value for a in t.axes][-1:] != ["s"]:
            self.error(f"sample '{s.kind}' runs along the last axis, which must be 's'", s.kind_span)

    def _sample_ranges(self, t: ast.TensorDecl) -> None:
        """Argument values that can never draw a sample."""
        s = t.sample
        args = {p: a for (p, _), a in zip(SAMPLES[s.kind], s.args)}
        if s.kind in ("segments", "prefix_ends"):
            lo, hi = args["min_len"], args["max_len"]  # lengths drawn from [min_len, max_len]
            if lo.value < 1:
                self.error(f"'min_len' of sample '{s.kind}' must be at least 1, got {lo.value}", lo.span)
            elif hi.value < lo.value:
                self.error(f"'max_len' of sample '{s.kind}' is {hi.value}, less than 'min_len' {lo.value}",
                           hi.span)
            elif hi.value > MAX_SIZE:
                self.error(f"'max_len' of sample '{s.kind}' must be at most {MAX_SIZE}", hi.span)
        elif s.kind == "randint" and not all(-2**31 <= a.value <= 2**31 for a in (args["low"], args["high"])):
            bad = next(a for a in (args["low"], args["high"]) if not -2**31 <= a.value <= 2**31)
            self.error(f"values of sample 'randint' must fit in i32, got {bad.value}", bad.span)
        elif s.kind in ("uniform", "const") and any(
                isinstance(a.value, float) and not abs(a.value) <= FLT_MAX for a in args.values()):
            bad = next(a for a in args.values() if isinstance(a.value, float) and not abs(a.value) <= FLT_MAX)
            self.error(f"value {bad.value} of sample '{s.kind}' is outside the f32 range", bad.span)
        elif s.kind == "randint" and args["high"].value <= args["low"].value:  # draws from [low, high)
            self.error(f"'high' of sample 'randint' must be greater than 'low' ({args['low'].value}); "
                       f"values are drawn from [low, high), got {args['high'].value}", args["high"].span)
        elif s.kind == "bernoulli" and not 0 <= args["p"].value <= 1:
            self.error(f"'p' of sample 'bernoulli' is a probability in [0, 1], got {args['p'].value}",
                       args["p"].span)
        elif s.kind == "const" and t.dtype == "i32" and not isinstance(args["value"].value, int):
            self.error(f"'value' of sample 'const' must be an integer for an i32 tensor, "
                       f"got {args['value'].value!r}", args["value"].span)
        elif s.kind == "const" and t.dtype == "i32" and not -2**31 <= args["value"].value < 2**31:
            self.error(f"'value' of sample 'const' must fit in i32, got {args['value'].value}", args["value"].span)

    def _tensor_type(self, t: ast.TensorDecl) -> ir.TensorDecl:
        sample = ir.Sample(t.sample.kind, tuple(a.value for a in t.sample.args)) if t.sample else None
        return ir.TensorDecl(t.name, TENSOR_DTYPES.get(t.dtype, I32), tuple(a.value for a in t.axes), sample)

    # ------------------------------------------------------------ policies
    def _policy(self, fld: str, p: ast.Policy):
        kinds = POLICIES[fld]
        if p.kind not in kinds:
            what = "policy" if fld == "masked_rows" else "kind"
            self.error(f"unknown {fld} {what} '{p.kind}'; {_expected_one_of(kinds)}",
                       p.kind_span, *_suggest(p.kind, kinds))
            return None
        params = kinds[p.kind]
        values: dict[str, object] = {}
        ok = True
        for i, arg in enumerate(p.args):
            if arg.name is None:
                if fld not in POSITIONAL_OK:
                    names = ", ".join(f"{q.name} = ..." for q in params) or "no arguments"
                    hint = (f"write {params[i].name} = {arg.value.value}",) if i < len(params) else ()
                    self.error(f"{fld} arguments must be named ({p.kind} takes {names})", arg.span, *hint)
                    ok = False
                    continue
                if i >= len(params):
                    self.error(f"{p.kind} takes {len(params)} argument{'s' * (len(params) != 1)}, "
                               f"got {len(p.args)}", arg.span)
                    ok = False
                    continue
                param = params[i]
            else:
                match = [q for q in params if q.name == arg.name]
                if not match:
                    allowed = _one_of(q.name for q in params) if params else "none"
                    extra = ()
                    if fld == "cache" and arg.name == "page_size":
                        extra = ("only a paged cache has pages: cache = paged(page_size = 16)",)
                    self.error(f"{p.kind} has no argument '{arg.name}' (arguments: {allowed})", arg.span,
                               *extra)
                    ok = False
                    continue
                param = match[0]
            if param.name in values:
                self.error(f"argument '{param.name}' given twice", arg.span)
                ok = False
                continue
            v = arg.value.value
            if param.kind is str:
                if v not in param.choices:
                    self.error(f"{param.name} must be one of {_one_of(param.choices)}, got {v!r}",
                               arg.value.span, *(_suggest(v, param.choices) if isinstance(v, str) else ()))
                    ok = False
                    continue
            elif not _literal_fits(v, param.kind):
                self.error(f"{param.name} must be {_kind_name(param.kind)}, got {v!r}", arg.value.span)
                ok = False
                continue
            elif param.check and (msg := param.check(v)):
                self.error(f"{param.name} {msg}", arg.value.span)
                ok = False
                continue
            values[param.name] = param.kind(v)
        for q in params:
            if q.required and q.name not in values and ok:
                self.error(f"{p.kind} {fld} needs '{q.name}'", p.span)
                ok = False
            values.setdefault(q.name, q.default)
        if not ok:
            return None
        if fld == "cache":
            # the table's names are ir.Cache's fields (a ragged cache's rows are token-major: nhd)
            layout = ir.Layout(values.get("layout") or "nhd")
            return ir.Cache(kind=ir.CacheKind(p.kind), **{**values, "layout": layout})
        if fld == "split":
            if p.kind == "capacity" and values["splits"] > values["capacity"]:
                self.error(f"capacity({values['splits']}, {values['capacity']}): the number of splits "
                           "cannot exceed the split capacity", p.span)
                return None
            return ir.Split(ir.SplitKind(p.kind), values)
        if fld == "state":
            if p.kind != "shared_shift":
                return ir.StateABI(p.kind)
            if values["lower"] >= values["upper"]:
                self.error(f"shared_shift: lower = {values['lower']:g} must be below upper = {values['upper']:g} "
                           "(the guard's window of s - phi)", p.span)
                return None
            return ir.SharedShift(**values)
        return p.kind

    # ------------------------------------------------------------ expressions
    def expr(self, e: ast.Expr, ctx: str) -> Type | None:
        """Type of ``e`` in context ``ctx`` (mask | score | scale | index); None after an error."""
        if isinstance(e, ast.IntLit):
            if e.value >= 2**31:
                self.error(f"integer {e.value} does not fit in i32 (at most {2**31 - 1})", e.span)
                return None
            return I32
        if isinstance(e, ast.FloatLit):
            if not math.isfinite(e.value) or (e.value != 0 and abs(e.value) < 1.2e-38) or abs(e.value) > 3.4e38:
                self.error(f"number {e.span.text} is outside the f32 range", e.span)
                return None
            return F32
        if isinstance(e, ast.BoolLit):
            return BOOL
        if isinstance(e, ast.Name):
            return self._name(e, ctx)
        if isinstance(e, ast.Index):
            return self._index(e, ctx)
        if isinstance(e, ast.Call):
            return self._call(e, ctx)
        if isinstance(e, ast.Unary):
            t = self.expr(e.operand, ctx)
            if t is None:
                return None
            op = "neg" if e.op == "-" else "not"
            r = ir.unary_type(op, t)
            if r is None:
                want = "a number" if op == "neg" else "a condition"
                self.error(f"'{e.op}' needs {want}, got {t.value}", e.operand.span)
            return r
        if isinstance(e, (ast.Binary, ast.Compare)):
            lt, rt = self.expr(e.left, ctx), self.expr(e.right, ctx)
            if lt is None or rt is None:
                return None
            if isinstance(e, ast.Binary) and e.op in ir.SURFACE_BITWISE and (lt.integer or rt.integer
                                                                            or e.op in ("^", "<<", ">>")):
                return self._bitwise(e, lt, rt)
            if isinstance(e, ast.Binary):
                op = ir.SURFACE_BINARY[e.op]
                r = ir.binary_type(op, lt, rt)
            else:
                op = ir.SURFACE_COMPARE[e.op]
                r = ir.compare_type(op, lt, rt)
            if r is None:
                if op in ir.LOGIC_OPS:
                    want = "conditions on both sides"
                elif isinstance(e, ast.Compare) and BOOL in (lt, rt):
                    want = "numbers on both sides (conditions compare only with == and !=)"
                else:
                    want = "numbers on both sides"
                self.error(f"'{e.op}' needs {want}, got {lt.value} {e.op} {rt.value}", e.span)
                return None
            if op in ("div", "floordiv", "mod") and _const_value(e.right) == 0:
                what = "division" if e.op != "%" else "remainder"
                self.error(f"{what} by zero: the right side of '{e.op}' is always 0", e.right.span)
            return r
        raise TypeError(e)

    def _bitwise(self, e: ast.Binary, lt: Type, rt: Type) -> Type | None:
        """`&`, `|`, `^` on integers (bitwise) or on conditions (logical); `<<`, `>>` on integers."""
        if lt is BOOL and rt is BOOL:  # (only `^` comes here with two conditions)
            return BOOL
        if lt.integer and rt.integer:
            return ir.promote(lt, rt)
        if e.op in ("<<", ">>"):
            self.error(f"'{e.op}' shifts an integer by an integer, got {lt.value} {e.op} {rt.value}", e.span)
            return None
        notes = ()
        if BOOL in (lt, rt) and (lt.integer or rt.integer):
            notes = (f"'{e.op}' binds looser than comparisons: 'q {e.op} 7 == 0' is 'q {e.op} (7 == 0)'; "
                     f"write (q {e.op} 7) == 0",)
        self.error(f"'{e.op}' needs two integers (bitwise) or two conditions (logical), "
                   f"got {lt.value} {e.op} {rt.value}", e.span, *notes)
        return None

    def _name(self, e: ast.Name, ctx: str) -> Type | None:
        if ctx == "sink" and (e.id in ("q", "k") or e.id in ir.LENGTH_VARS):
            what = f"the {'query' if e.id == 'q' else 'key'} position" if len(e.id) == 1 else "the request's length"
            self.error(f"'{e.id}' is {what}; a sink depends only on the request 'b' and the query head 'h'",
                       e.span, "a sink is one logit per (b, h), shared by every query row of the head")
            return None
        if e.id in ("q", "k", "b", "h") or e.id in ir.LENGTH_VARS:
            if ctx == "scale":
                what = "a position" if len(e.id) == 1 else "the request's length"
                self.error(f"'{e.id}' is {what}; scale must be a constant", e.span)
                return None
            return I32
        if e.id == "score":
            if ctx == "score":
                return F32
            where = {"mask": "the mask", "scale": "scale", "index": "a subscript", "sink": "the sink"}[ctx]
            notes = () if ctx == "sink" else ("a mask decides visibility before scores exist",)
            self.error(f"'score' is not available in {where}; it exists only in score statements", e.span, *notes)
            return None
        if e.id == "causal":
            if ctx in ("scale", "sink"):
                what = "a condition; scale must be a constant" if ctx == "scale" else \
                    "a condition on q and k; a sink depends only on the request 'b' and the query head 'h'"
                self.error(f"'causal' is {what}", e.span)
                return None
            return BOOL
        if e.id in self.tensors:
            t = self.tensors[e.id]
            axes = ", ".join(str(a.value) for a in t.axes)
            self.error(f"tensor '{e.id}' must be subscripted: {e.id}[{axes}]", e.span)
            return None
        if e.id in FUNCTIONS:
            self.error(f"'{e.id}' is a function; call it: {e.id}(...)", e.span)
            return None
        known = {"q", "k", "b", "h", "S_q", "S_k", "causal", *self.tensors} | ({"score"} if ctx == "score" else set())
        self.error(f"unknown name '{e.id}'", e.span, *_suggest(e.id, known))
        return None

    def _index(self, e: ast.Index, ctx: str) -> Type | None:
        t = self.tensors.get(e.tensor)
        if t is None:
            self.error(f"unknown tensor '{e.tensor}'", e.tensor_span, *_suggest(e.tensor, self.tensors))
            if ctx != "scale":  # scale reports the read itself, not its subscripts
                for i in e.indices:
                    self.expr(i, ctx)
            return None
        if ctx == "scale":
            self.error("scale must be a constant; it cannot read a tensor", e.span)
            return None
        decl = f"declared {t.dtype}[{', '.join(str(a.value) for a in t.axes)}]"
        if len(e.indices) != len(t.axes):
            self.error(f"tensor '{e.tensor}' takes {len(t.axes)} subscript{'s' * (len(t.axes) != 1)} "
                       f"({decl}), got {len(e.indices)}", e.span)
            return None
        ok = True
        for pos, (axis, idx) in enumerate(zip(t.axes, e.indices), 1):
            it = self.expr(idx, ctx)
            if it is None:
                ok = False
                continue
            if it is not I32:
                which = f"axis '{axis.value}'" if isinstance(axis.value, str) else f"size {axis.value}"
                notes = ("'/' always makes a float; '//' divides integers",) if _has_op(idx, "/") else ()
                self.error(f"subscript {pos} of '{e.tensor}' ({which}) must be an integer, got {it.value}",
                           idx.span, *notes)
                ok = False
                continue
            used = _names(idx)
            if axis.value in ("b", "h"):
                allowed = {"b"} if axis.value == "b" else {"b", "h"}
                bad = sorted(used & ({"q", "k", "b", "h", "score", *ir.LENGTH_VARS} - allowed))
                if bad:
                    meaning = "the request index 'b'" if axis.value == "b" else "the query head 'h'"
                    self.error(f"axis '{axis.value}' of '{e.tensor}' must be indexed by {meaning}, "
                               f"not by an expression of '{bad[0]}'", idx.span, f"{e.tensor} is {decl}")
                    ok = False
        return TENSOR_DTYPES.get(t.dtype) if ok else None

    def _call(self, e: ast.Call, ctx: str) -> Type | None:
        if e.func not in FUNCTIONS:
            if e.func in self.tensors:
                self.error(f"'{e.func}' is a tensor, not a function", e.func_span,
                           f"index a tensor with brackets: {e.func}[...]")
            else:
                self.error(f"unknown function '{e.func}'", e.func_span, *_suggest(e.func, FUNCTIONS))
            for a in e.args:
                self.expr(a, ctx)
            return None
        if e.func == "flashmask":
            return self._flashmask(e, ctx)
        arity = FUNCTIONS[e.func]
        if len(e.args) != arity:
            self.error(f"'{e.func}' takes {arity} argument{'s' * (arity != 1)}, got {len(e.args)}", e.span)
            return None
        types = [self.expr(a, ctx) for a in e.args]
        if any(t is None for t in types):
            return None
        if e.func == "window":
            if ctx in ("scale", "sink"):
                what = "a condition; scale must be a constant" if ctx == "scale" else \
                    "a condition on q and k; a sink depends only on the request 'b' and the query head 'h'"
                self.error(f"'window' is {what}", e.span)
                return None
            if types[0] is not I32:
                self.error(f"window(n) takes an integer width, got {types[0].value}", e.args[0].span)
                return None
            return BOOL
        if e.func == "where":
            if types[0] is not BOOL:
                self.error(f"where(c, a, b) needs a condition first, got {types[0].value}", e.args[0].span)
                return None
            if types[1].numeric and types[2].numeric:
                return ir.promote(types[1], types[2])
            if types[1] is types[2]:
                return types[1]
            self.error(f"where(c, a, b): a and b disagree ({types[1].value}, {types[2].value})", e.span)
            return None
        if e.func == "softcap":
            if not all(t.numeric for t in types):
                self.error("softcap(x, cap) takes numbers", e.span)
                return None
            cap = _const_value(e.args[1])
            if cap is not None and cap <= 0:
                self.error(f"softcap cap must be positive, got {cap}", e.args[1].span)
            return F32
        r = ir.call_type(e.func, tuple(types))
        if r is None:
            what = "a number" if len(types) == 1 else "numbers"
            self.error(f"'{e.func}' takes {what}, got {', '.join(t.value for t in types)}", e.span)
        return r

    def _flashmask(self, e: ast.Call, ctx: str) -> Type | None:
        """``flashmask(sri, causal)``: a Paddle FlashMask mask brought unchanged.  The first
        argument names a tensor in Paddle's ``startend_row_indices`` layout, the second is
        Paddle's ``causal`` flag as a literal; lowering expands the call into plain IR."""
        if ctx in ("scale", "sink"):
            what = "a condition; scale must be a constant" if ctx == "scale" else \
                "a condition on q and k; a sink depends only on the request 'b' and the query head 'h'"
            self.error(f"'flashmask' is {what}", e.span)
            return None
        if len(e.args) != 2:
            self.error(f"'flashmask' takes 2 arguments (startend_row_indices, causal), got {len(e.args)}",
                       e.span)
            return None
        sri, flag = e.args
        bounds = None
        if not isinstance(sri, ast.Name):
            whole = f"flashmask({sri.tensor}, ...)" if isinstance(sri, ast.Index) else "flashmask(sri, ...)"
            self.error("the first argument of flashmask(sri, causal) must name a declared tensor, "
                       "not an expression", sri.span,
                       f"pass the whole tensor, declared {FLASHMASK_LAYOUT}: {whole}")
        elif sri.id not in self.tensors:
            self.error(f"unknown tensor '{sri.id}'", sri.span, *_suggest(sri.id, self.tensors))
        else:
            bounds = self._flashmask_tensor(sri)
        causal = flag.value if isinstance(flag, ast.BoolLit) else None
        if causal is None:
            notes = ("'causal' alone is the condition k <= q; Paddle's flag is written true",) \
                if isinstance(flag, ast.Name) and flag.id == "causal" else ()
            self.error("the second argument of flashmask(sri, causal) is Paddle's causal flag: "
                       "the literal true or false", flag.span, *notes)
        if bounds is None or causal is None:
            return None
        allowed = FLASHMASK_BOUNDS[causal]
        if bounds not in allowed:
            meaning = {True: "1: [LTS]; 2: [LTS, LTE]", False: "2: [LTS, UTE]; 4: [LTS, LTE, UTS, UTE]"}
            self.error(f"flashmask(sri, {'true' if causal else 'false'}) takes {allowed[0]} or {allowed[1]} "
                       f"bounds per column, but '{sri.id}' has {bounds}", e.span,
                       f"Paddle's startend_row_indices with causal={causal}: {meaning[causal]}")
            return None
        return BOOL

    def _flashmask_tensor(self, sri: ast.Name) -> int | None:
        """The number of bounds per column of a startend_row_indices tensor, or None after
        an error."""
        t = self.tensors[sri.id]
        axes = [a.value for a in t.axes]
        hq, hkv = self.heads or (None, None)  # a shape-generic spec: per query head or shared only
        # Paddle's num_heads: 1 (broadcast), H_q or H_kv ("h" is H_q by name)
        heads = ("h", 1) + tuple(n for n in (hq, hkv) if n is not None)
        if t.dtype == "i32" and len(axes) == 4 and axes[0] == "b" and axes[1] in heads and axes[2] == "s" \
                and axes[3] in (1, 2, 4):
            return axes[3]
        notes: tuple[str, ...] = ()
        if len(axes) > 1 and isinstance(axes[1], int) and axes[1] not in heads:
            notes = ("this spec leaves heads to the call: a head count written as a number needs declared "
                     "heads (heads = H_q / H_kv)",) if hq is None else \
                (f"Paddle's head axis here is 1 (shared by every head), h or {hq} (per query head)"
                 + (f" or {hkv} (per K/V head: query head h reads h // {hq // hkv})" if hkv != hq else ""),)
        self.error(f"tensor '{sri.id}' is declared {t.dtype}[{', '.join(str(a) for a in axes)}]; "
                   f"flashmask needs Paddle's startend_row_indices layout {FLASHMASK_LAYOUT}",
                   sri.span, *notes)
        return None


def _kind_name(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a name"}[kind]


def _literal_fits(v, kind: type) -> bool:
    if kind is int:
        return isinstance(v, int)
    if kind is float:
        return isinstance(v, (int, float))
    return isinstance(v, str)


def _names(e: ast.Expr) -> set[str]:
    if isinstance(e, ast.Name):
        return {e.id}
    out: set[str] = set()
    for c in _ast_children(e):
        out |= _names(c)
    return out


def _ast_children(e: ast.Expr) -> tuple[ast.Expr, ...]:
    if isinstance(e, (ast.Binary, ast.Compare)):
        return (e.left, e.right)
    if isinstance(e, ast.Unary):
        return (e.operand,)
    if isinstance(e, ast.Call):
        return e.args
    if isinstance(e, ast.Index):
        return e.indices
    return ()


_CONST_FNS = {**scalar_calls, "softcap": lambda x, cap: cap * math.tanh(x / cap)}
_CONST_COMPARE = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
                  "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b}


def _has_op(e: ast.Expr, op: str) -> bool:
    if isinstance(e, ast.Binary) and e.op == op:
        return True
    return any(_has_op(c, op) for c in _ast_children(e))


def _f32(v):
    """A computed float as the language holds it (binary32); an overflow is an OverflowError."""
    if not isinstance(v, float) or math.isnan(v) or math.isinf(v):
        return v
    r = fold_f32(v)
    if math.isinf(r):
        raise OverflowError(f"overflows f32 ({v:g} is beyond the largest f32, {FLT_MAX:g})")
    return r


_CONST_BITS = {"&": lambda a, b: a & b, "|": lambda a, b: a | b, "^": lambda a, b: a ^ b,
               "<<": lambda a, b: a << b, ">>": lambda a, b: a >> b}


def _const_value(e: ast.Expr, strict: bool = False):
    """The value of a name-free (well-typed) expression as the language computes it (integers
    exact, floats in f32), or None; a domain error (sqrt(-1), 1.0 / 0.0, an f32 overflow) gives
    None too, or raises when ``strict``."""
    try:
        if isinstance(e, ast.FloatLit):
            return _f32(e.value)
        if isinstance(e, (ast.IntLit, ast.BoolLit)):
            return e.value
        if isinstance(e, ast.Unary) and e.op == "-":
            v = _const_value(e.operand, strict)
            return None if v is None else -v
        if isinstance(e, ast.Compare):
            a, b = _const_value(e.left, strict), _const_value(e.right, strict)
            return None if a is None or b is None else _CONST_COMPARE[e.op](a, b)
        if isinstance(e, ast.Call) and e.func == "where":
            c = _const_value(e.args[0], strict)
            return None if c is None else _const_value(e.args[1] if c else e.args[2], strict)
        if isinstance(e, ast.Binary) and e.op in _CONST_BITS:
            a, b = _const_value(e.left, strict), _const_value(e.right, strict)
            if not (type(a) is int and type(b) is int) or (e.op in ("<<", ">>") and not 0 <= b <= 63):
                return None
            return _CONST_BITS[e.op](a, b)
        if isinstance(e, ast.Binary) and e.op in ("+", "-", "*", "/", "//", "%"):
            a, b = _const_value(e.left, strict), _const_value(e.right, strict)
            if a is None or b is None or isinstance(a, bool) or isinstance(b, bool):
                return None
            if isinstance(a, int) and isinstance(b, int) and e.op in ("//", "%"):
                return int_floordiv(a, b) if e.op == "//" else int_mod(a, b)
            if e.op == "/" or isinstance(a, float) or isinstance(b, float):
                a, b = _f32(float(a)), _f32(float(b))
            v = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b,
                 "//": lambda: float_floordiv(a, b), "%": lambda: float_mod(a, b)}[e.op]()
            return _f32(v)
        if isinstance(e, ast.Call) and e.func in _CONST_FNS:
            args = [_const_value(a, strict) for a in e.args]
            if None in args:
                return None
            if e.func in ir.FLOAT_FNS or e.func == "softcap":
                args = [_f32(float(a)) for a in args]
            return _f32(_CONST_FNS[e.func](*args))
    except (ZeroDivisionError, ValueError, OverflowError) as exc:
        if strict:
            raise exc
        return None
    except TypeError:
        return None
    return None


def check(node: ast.Attention) -> Spec:
    return Checker(node).run()
