"""--heads, --head-dim and --dtype: the CLI's commands on a shape-generic spec (issue 37), with the
rules of attnc.compile (ir.specialize): open fields are filled, declared ones are checked."""
import subprocess
import sys

import pytest

from attnc.compiler.cli import main
from tests.conftest import ROOT

# the README's example: heads, head_dim and dtype left to each call
GENERIC = """attention doc_causal {
    tensor doc: i32[b, s] ~ segments(4, 16)
    mask = causal & doc[b, q] == doc[b, k]
}
"""
DECLARED = """attention declared {
    heads    = 8 / 2
    head_dim = 32
    dtype    = f32
    mask     = causal
}
"""


@pytest.fixture
def specs(tmp_path):
    (tmp_path / "generic.attn").write_text(GENERIC)
    (tmp_path / "declared.attn").write_text(DECLARED)
    (tmp_path / "call.json").write_text('{"B": 1, "S_q": [64], "S_k": [64]}')
    return tmp_path


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _selected_here(spec_text: str, heads: int, head_dim: int, dtype: str, batch: int, length: int) -> str:
    """The backend `attnc run` takes for this call on this machine: dispatch under --backend auto,
    as the CLI asks it (numpy without a CUDA device, triton with one)."""
    import attnc
    from attnc.compiler.dispatch import dispatch, run_environment
    program = attnc.compile(spec_text).specialize(heads, heads, head_dim, head_dim, dtype)
    call = {"B": batch, "S_q": [length] * batch, "S_k": [length] * batch, "graph_mode": False,
            "backend_request": "auto"}
    return dispatch(program, call, run_environment(None, "auto")).require()


def test_run_check_on_a_shape_generic_spec(specs):
    """Issue 37's command, as a user runs it."""
    auto = _selected_here(GENERIC, 4, 32, "f32", 2, 64)
    r = subprocess.run([sys.executable, "-m", "attnc", "run", specs / "generic.attn", "--heads", "4", "--head-dim",
                        "32", "--dtype", "f32", "--kv-len", "64", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"doc_causal on {auto}: B=2 S_q=64 S_k=64 o [2, 4, 64, 32] float32" in r.stdout, r.stdout
    assert r.stdout.count("vs float64 oracle") == 2 and r.stdout.count(" ok") == 2, r.stdout


def test_gqa_and_split_head_dims(specs, capsys):
    rc, out, _ = _cli(capsys, "plan", specs / "generic.attn", "--heads", "16/4", "--head-dim", "192/128",
                      "--dtype", "f16", "--kv-lens", "100,200")
    assert rc == 0
    assert out.splitlines()[0] == "plan doc_causal: heads 16/4 (GQA group 4), head_dim 192/128, f16"
    rc, out, _ = _cli(capsys, "run", specs / "generic.attn", "--heads", "8/2", "--head-dim", "32/16",
                      "--kv-len", "32", "--batch", "1", "--check")
    assert rc == 0 and "o [1, 8, 32, 16] float32" in out, out  # dtype left open: bf16, which numpy holds in f32
    assert out.count(" ok") == 2, out


@pytest.mark.parametrize("command, extra", [
    ("compile", []), ("run", ["--kv-len", "64"]), ("explain", ["--kv-len", "64"]), ("plan", ["--kv-lens", "64"]),
    ("dispatch", ["--call", "{call}"]), ("tune", ["--shapes", "1:64:64", "--backend", "numpy"]),
])
def test_every_shape_command_names_the_missing_flag(specs, capsys, command, extra):
    extra = [e.format(call=specs / "call.json") for e in extra]
    spec = specs / "generic.attn"
    rc, _, err = _cli(capsys, command, spec, *extra)
    assert rc == 1
    assert err == (f"error: {spec}: spec 'doc_causal' leaves heads and head_dim to the call (a shape-generic "
                   "spec): give --heads H[/H_KV] and --head-dim D[/D_V] (from Python, attnc.compile(spec) "
                   "takes them from each call's tensors)\n")
    rc, _, err = _cli(capsys, command, spec, "--heads", "4", *extra)
    assert rc == 1 and "leaves head_dim to the call" in err and "give --head-dim D[/D_V] (" in err


@pytest.mark.parametrize("flags, message", [
    (["--heads", "8"], "spec 'declared' declares heads = 8 / 2; --heads gives 8 / 8"),
    (["--head-dim", "64"], "spec 'declared' declares head_dim = 32 / 32; --head-dim gives 64 / 64"),
    (["--dtype", "bf16"], "spec 'declared' declares dtype = f32; --dtype gives bf16"),
])
def test_a_flag_that_contradicts_a_declaration_is_refused(specs, capsys, flags, message):
    spec = specs / "declared.attn"
    rc, _, err = _cli(capsys, "run", spec, *flags, "--kv-len", "32")
    assert rc == 1 and err == f"error: {spec}: {message}\n"


def test_flags_that_agree_with_the_declarations_change_nothing(specs, capsys):
    spec = specs / "declared.attn"
    plain = _cli(capsys, "compile", spec)
    assert plain[0] == 0
    assert _cli(capsys, "compile", spec, "--heads", "8/2", "--head-dim", "32/32", "--dtype", "f32") == plain


def test_heads_must_group(specs, capsys):
    spec = specs / "generic.attn"
    rc, _, err = _cli(capsys, "run", spec, "--heads", "6/4", "--head-dim", "32", "--kv-len", "32")
    assert rc == 1 and err == f"error: {spec}: --heads 6/4: H_q must be a multiple of H_kv (GQA)\n"


@pytest.mark.parametrize("value, message", [
    ("0", "expected an integer >= 1, got '0'"), ("4/x", "expected an integer, got 'x'"),
    ("99999999999", "99999999999 exceeds 2147483647"),
])
def test_bad_shape_values_are_usage_errors(specs, capsys, value, message):
    with pytest.raises(SystemExit) as e:
        main(["plan", str(specs / "generic.attn"), "--heads", value, "--head-dim", "32", "--kv-lens", "8"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_flags_make_attnc_compiles_program(specs):
    """One specialisation: the CLI's program for --heads 4/2 --head-dim 32 --dtype f32 is the one
    attnc.compile runs for such tensors (same digest: same kernels, plans and tuning keys)."""
    import argparse

    import attnc
    from attnc.compiler import ir
    from attnc.compiler.cli import _concrete
    args = argparse.Namespace(spec=str(specs / "generic.attn"), heads=(4, 2), head_dim=(32, 32), dtype="f32")
    assert ir.digest(_concrete(args)) == ir.digest(attnc.compile(GENERIC).specialize(4, 2, 32, 32, "f32"))
