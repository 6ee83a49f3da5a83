"""compiler/autodiff.py: every derivative rule against central finite differences of the
interpreted forward expression, the simplifier, the verifier, torch's conventions at kinks,
and a property test over random score programs."""
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from attnc.compiler import autodiff, ir
from attnc.compiler.autodiff import SCORE, derivative, score_grad
from attnc.compiler.interp import evaluate
from attnc.compiler.lower import compile_file, compile_spec
from tests.conftest import ROOT

F32, I32 = ir.F32, ir.I32
Q, K, H = ir.Var("q", I32), ir.Var("k", I32), ir.Var("h", I32)
W = ir.Load("w", (H, Q, K), F32)  # f32[h, s, s]
SLOPE = ir.Load("slope", (H,), F32)  # f32[h]
HEADS, S, N = 2, 6, 400
EPS = 1e-6
ALLOWED = ir.POSITION_VARS + ("score",)


def spec(*statements: str, mask: str = "causal") -> ir.Program:
    body = "\n".join(f"score = {s}" for s in statements)
    return compile_spec(f"""attention t {{
        heads = {HEADS}
        head_dim = 4
        dtype = f32
        tensor doc: i32[b, s] ~ segments(2, 4)
        tensor w: f32[h, s, s] ~ uniform(0.5, 1.5)
        tensor slope: f32[h] ~ uniform(0.1, 1.0)
        {body}
        mask = {mask}
    }}""")


def points(seed: int):
    """N random cells: a score value each, positions q, k, head h, and tensors w, slope."""
    rng = np.random.default_rng(seed)
    env = {"score": rng.uniform(-3, 3, N), "q": rng.integers(0, S, N), "k": rng.integers(0, S, N),
           "h": rng.integers(0, HEADS, N), "b": np.zeros(N, np.int64)}
    tensors = {"w": rng.uniform(-2, 2, (HEADS, S, S)), "slope": rng.uniform(0.1, 1.0, HEADS),
               "doc": np.zeros((1, S), np.int64)}
    return env, tensors


def _varies(e: ir.Expr) -> bool:
    return any(n == SCORE or (isinstance(n, ir.Load) and n.type is F32) for n in ir.walk(e))


def kink_distance(e: ir.Expr, env, tensors) -> np.ndarray:
    """How far each point is from a place where ``e`` is not smooth: a float comparison's
    sides equal, abs/min/max ties, integer crossings of float // and %, the edge of the
    domain of log/sqrt, a zero denominator."""
    dist = np.full(N, np.inf)
    ev = lambda x: np.broadcast_to(evaluate(x, env, tensors, wide=True), (N,)).astype(float)  # noqa: E731
    for n in ir.walk(e):
        sides = ir.children(n)
        if not _varies(n) or (len(sides) == 2 and sides[0] == sides[1]):
            continue  # constant, or both sides the same expression: no kink
        gaps = []
        if isinstance(n, ir.Compare) and n.left.type is F32:
            gaps.append(ev(n.left) - ev(n.right))
        elif isinstance(n, ir.Call) and n.type is F32 and n.fn in ("min", "max"):
            gaps.append(ev(n.args[0]) - ev(n.args[1]))
        elif isinstance(n, ir.Call) and n.fn in ("abs", "log", "sqrt") and n.args[0].type is F32:
            gaps.append(ev(n.args[0]))
        elif isinstance(n, ir.Binary) and n.type is F32 and n.op in ("div", "floordiv", "mod"):
            den = ev(n.right)
            gaps.append(den)
            if n.op != "div":
                ratio = ev(n.left) / np.where(den == 0, 1, den)
                gaps.append((ratio - np.round(ratio)) * den)
        for g in gaps:
            dist = np.minimum(dist, np.where(np.isfinite(g), np.abs(g), 0.0))
    return dist


def finite_difference(e: ir.Expr, wrt: ir.Expr, env, tensors, eps: float) -> np.ndarray:
    """Central difference of the interpreted ``e`` when ``wrt`` (score, or every read of a
    tensor) moves by +-eps."""
    def at(delta):
        if wrt == SCORE:
            return evaluate(e, {**env, "score": env["score"] + delta}, tensors, wide=True)
        return evaluate(e, env, {**tensors, wrt.tensor: tensors[wrt.tensor] + delta}, wide=True)
    with np.errstate(all="ignore"):
        return np.broadcast_to((at(eps) - at(-eps)) / (2 * eps), (N,))


def check_against_fd(e: ir.Expr, seed: int, margin: float = 1e-3) -> int:
    """The symbolic derivatives of ``e`` (score and every f32 load, summed per tensor) match
    central differences at every smooth point; returns how many points were compared."""
    env, tensors = points(seed)
    grads = {SCORE: derivative(e, SCORE)}
    for load in autodiff.f32_loads(e):
        key = ir.Load(load.tensor, (), F32)  # one entry per tensor: FD moves all its reads
        grads[key] = autodiff.add(grads.get(key, autodiff.ZERO), derivative(e, load))
    for d in grads.values():
        ir.verify_expr(d, None, ALLOWED)
        assert d.type is F32
    with np.errstate(all="ignore"):
        smooth = kink_distance(e, env, tensors) > margin
        value = np.broadcast_to(evaluate(e, env, tensors, wide=True), (N,))
    compared = 0
    for wrt, d in grads.items():
        fd = finite_difference(e, wrt, env, tensors, EPS)
        fd_coarse = finite_difference(e, wrt, env, tensors, 10 * EPS)
        with np.errstate(all="ignore"):
            sym = np.broadcast_to(evaluate(d, env, tensors, wide=True), (N,)).astype(float)
        # compare where the function is smooth, finite and the differences agree with each other
        ok = smooth & np.isfinite(value) & np.isfinite(fd) & (np.abs(fd) < 1e4) & \
            (np.abs(fd - fd_coarse) <= 1e-4 * (1 + np.abs(fd)))
        bad = ok & ~(np.abs(sym - fd) <= 1e-5 * (1 + np.abs(fd)))
        assert not bad.any(), (f"d/d{ir.format_expr(wrt)} of {ir.format_expr(e)} = {ir.format_expr(d)}: "
                               f"{sym[bad][:3]} vs finite differences {fd[bad][:3]}")
        compared += int(ok.sum())
    return compared


RULES = [  # every node kind and every function of ir.CALL_FNS, on score and on tensor loads
    "score + w[h, q, k]", "score - 2.5", "w[h, q, k] - score", "-score", "score * score * w[h, q, k]",
    "score / w[h, q, k]", "w[h, q, k] / (score * score + 1.0)", "score // 0.7", "score % 1.5",
    "w[h, q, k] % (score * score + 0.5)", "score // w[h, q, k] + score",
    "where(score > w[h, q, k], score * 2.0, 0.5 * score)", "where(q == k, score, w[h, q, k] * score)",
    "min(score, w[h, q, k])", "max(score, 0.3)", "abs(score - 0.5)", "score + sign(score - 0.5) * w[h, q, k]", "exp(score * w[h, q, k])",
    "log(score * score + w[h, q, k] * w[h, q, k])", "sqrt(score * score + 0.1)", "tanh(score * w[h, q, k])", "erf(score * w[h, q, k])", "sin(score * 0.7)", "cos(score - w[h, q, k])",
    "softcap(score, 30.0)", "score - slope[h] * (q - k)", "score * (q // 2) + k % 3",
    "score + w[h, q, k] * w[h, k, q]", "min(q, k) * score + max(q, 2) - abs(k - q)",
]


def test_the_rules_cover_every_function():
    assert [fn for fn in ir.CALL_FNS if f"{fn}(" not in " ".join(RULES)] == []


@pytest.mark.parametrize("text", RULES)
def test_rule_matches_finite_differences(text):
    (e,) = spec(text).score
    assert check_against_fd(e, seed=len(text)) > N // 2  # most points are smooth ones


def test_integer_subexpressions_and_casts_have_no_derivative():
    (e,) = spec("score + q * k - abs(q - k) % 3").score
    assert derivative(e, SCORE) == autodiff.ONE
    assert derivative(ir.Unary("cast_f32", ir.Binary("mul", Q, K, I32), F32), SCORE) == autodiff.ZERO
    assert derivative(ir.Unary("cast_f32", SCORE, F32), SCORE) == autodiff.ONE


def test_softcap_derivative_prints_short():
    # softcap(x, c) lowers to c * tanh(x * f32(1 / c)): the derivative's factor is c * f32(1 / c),
    # exactly 1 for a power of two, within an ulp of 1 otherwise (kept: it is the true derivative)
    (e,) = spec("softcap(score, 32.0)").score
    assert ir.format_expr(derivative(e, SCORE)) == "1.0 - tanh(score * 0.03125) * tanh(score * 0.03125)"
    (e,) = spec("softcap(score, 30.0)").score
    assert ir.format_expr(derivative(e, SCORE)) == \
        "1.0000000521540642 * (1.0 - tanh(score * 0.03333333507180214) * tanh(score * 0.03333333507180214))"


def test_simplification_drops_identities():
    (e,) = spec("score + w[h, q, k] - slope[h] * (q - k)").score
    g = score_grad(spec("score + w[h, q, k] - slope[h] * (q - k)"))
    assert g.dscore == (autodiff.ONE,)
    assert [(ir.format_expr(load), ir.format_expr(d)) for _, load, d in g.dloads] == \
        [("w[h, q, k]", "1.0"), ("slope[h]", "-(q - k)")]
    assert ir.format_expr(derivative(spec("exp(-score)").score[0], SCORE)) == "-exp(-score)"
    assert ir.format_expr(derivative(spec("score / 4.0").score[0], SCORE)) == "0.25"  # exact: folded
    assert ir.format_expr(derivative(spec("score / 3.0").score[0], SCORE)) == "1.0 / 3.0"  # inexact: kept
    assert autodiff.mul(ir.Const(3.0, F32), autodiff.div(W, ir.Const(3.0, F32))) == W
    assert autodiff.add(autodiff.ZERO, W) == autodiff.sub(W, autodiff.ZERO) == autodiff.mul(autodiff.ONE, W) == W
    assert autodiff.mul(W, autodiff.ZERO) == autodiff.ZERO
    assert autodiff.select(ir.Compare("lt", Q, K), W, W) == W


def test_torch_conventions_at_kinks():
    """Ties of min/max split the gradient, abs'(0) = 0, sqrt'(0) = +inf, where takes its
    branch's derivative, float // has none and % passes it through: as torch's autograd."""
    torch = pytest.importorskip("torch")
    x0 = np.array([0.0, 1.0, -1.0, 2.0, 0.7])
    cases = {  # IR text -> the same function on a torch tensor
        "min(score, 1.0)": lambda x: torch.minimum(x, torch.tensor(1.0, dtype=x.dtype)),
        "max(score, 1.0)": lambda x: torch.maximum(x, torch.tensor(1.0, dtype=x.dtype)),
        "max(score, score)": lambda x: torch.maximum(x, x),
        "abs(score)": torch.abs,
        "sqrt(score * score)": lambda x: torch.sqrt(x * x),
        "sqrt(abs(score) + 1.0)": lambda x: torch.sqrt(torch.abs(x) + 1.0),
        "where(score >= 1.0, 2.0 * score, -score)": lambda x: torch.where(x >= 1.0, 2.0 * x, -x),
        "score // 0.5": lambda x: torch.floor(x / 0.5),  # torch.floor_divide has no derivative at all
        "score % 0.7": lambda x: torch.remainder(x, 0.7),
        "2.0 % (score + 3.0)": lambda x: torch.remainder(torch.tensor(2.0, dtype=x.dtype), x + 3.0),
    }
    for text, fn in cases.items():
        (e,) = spec(text).score
        env = {"score": x0, "q": 0, "k": 0, "b": 0, "h": 0}
        with np.errstate(all="ignore"):
            ours = np.broadcast_to(evaluate(derivative(e, SCORE), env, {}, wide=True), x0.shape)
        x = torch.tensor(x0, requires_grad=True)
        fn(x).sum().backward()
        theirs = x.grad.numpy()
        same = np.isclose(ours, theirs, rtol=1e-12, atol=0) | (np.isnan(ours) & np.isnan(theirs))  # inf == inf
        assert same.all(), f"{text}: ours {ours}, torch {theirs}"


def test_score_grad_of_programs():
    assert score_grad(compile_file(ROOT / "examples" / "causal.attn")) == autodiff.ScoreGrad((), (), (), ())
    alibi = score_grad(compile_file(ROOT / "examples" / "alibi.attn"))
    assert alibi.dscore == (autodiff.ONE,) and alibi.dloads == () and alibi.tensors == ()
    p = spec("score + slope[h] * w[h, q, k]", "softcap(score, 20.0) + w[h, q, k]",
             mask="causal & doc[b, q] == doc[b, k] & w[h, q, k] > 0.0")
    g = score_grad(p)
    assert g.forward == p.score
    assert [(i, ir.format_expr(load)) for i, load, _ in g.dloads] == \
        [(0, "slope[h]"), (0, "w[h, q, k]"), (1, "w[h, q, k]")]
    assert g.tensors == ("w", "slope")  # declaration order; doc (i32, mask only) gets no gradient
    for d in g.dscore + tuple(d for _, _, d in g.dloads):
        ir.verify_expr(d, p, ALLOWED)


def test_derivative_refuses_non_variables():
    with pytest.raises(ValueError, match="only score and f32 loads"):
        derivative(SCORE, Q)


# ---------------------------------------------------------------- property: random programs
def _leaves():
    return st.sampled_from([SCORE, SCORE, W, SLOPE, ir.Unary("cast_f32", ir.Binary("sub", Q, K, I32), F32)]) | \
        st.floats(-2.0, 2.0).filter(lambda c: abs(c) > 0.1).map(lambda c: ir.Const(round(c, 2), F32))


def _grow(children):
    unary = st.tuples(st.sampled_from(["neg", "exp", "log", "sqrt", "tanh", "abs"]), children).map(
        lambda t: ir.Unary("neg", t[1], F32) if t[0] == "neg" else ir.Call(t[0], (t[1],), F32))
    binary = st.tuples(st.sampled_from(["add", "sub", "mul", "div", "floordiv", "mod"]), children, children).map(
        lambda t: ir.Binary(t[0], t[1], t[2], F32))
    minmax = st.tuples(st.sampled_from(["min", "max"]), children, children).map(
        lambda t: ir.Call(t[0], (t[1], t[2]), F32))
    where = st.tuples(st.sampled_from(ir.COMPARE_OPS), children, children, children, children).map(
        lambda t: ir.Select(ir.Compare(t[0], t[1], t[2]), t[3], t[4], F32))
    return unary | binary | minmax | where


PROGRAMS = st.recursive(_leaves(), _grow, max_leaves=6)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PROGRAMS, st.integers(0, 2**16))
def test_random_programs_match_finite_differences(e, seed):
    ir.verify_expr(e, None, ALLOWED)
    assume(check_against_fd(e, seed) > 0)  # e.g. sqrt(-1.0) has no point to compare
