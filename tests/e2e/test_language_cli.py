"""Issue 18 at the command line: `attnc run --check` compares with an oracle that sees the
stored inputs, and `attnc check` answers every malformed spec with a located error."""
import numpy as np

from tests.e2e.test_cli import attnc


def test_run_check_with_float32_inputs_for_a_bf16_spec(tmp_path):
    """The kernel rounds the inputs to bf16; so does the oracle now (a false FAIL before)."""
    rng = np.random.default_rng(0)
    arrays = {"q": rng.standard_normal((1, 4, 24, 64), np.float32),
              "k": rng.standard_normal((1, 4, 24, 64), np.float32) * 3,
              "v": rng.standard_normal((1, 4, 24, 64), np.float32)}
    np.savez(tmp_path / "in.npz", **arrays)
    spec = tmp_path / "b.attn"
    spec.write_text("attention b { heads = 4 head_dim = 64 dtype = bf16 mask = causal }")
    r = attnc("run", spec, "--inputs", tmp_path / "in.npz", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vs float64 oracle: O" in r.stdout and "FAIL" not in r.stdout


def test_check_answers_adversarial_specs_with_located_errors(tmp_path):
    specs = {"deep.attn": "mask = " + "abs(" * 330 + "k" + ")" * 330 + " < q",
             "digits.attn": "mask = k < " + "9" * 4301,
             "overflow.attn": "mask = k * 100000000 * 100000000 * 100000000 < q",
             "reserved.attn": "tensor plan: i32[b, s] mask = plan[b, k] > 0",
             "scale.attn": "scale = 1e38 * 1e38"}
    for name, body in specs.items():
        (tmp_path / name).write_text(f"attention t {{\n    heads = 2 head_dim = 16\n    {body}\n}}\n")
    r = attnc("check", *sorted(tmp_path.glob("*.attn")))
    assert r.returncode == 1
    for name in specs:
        assert f"{name}:3:" in r.stderr, r.stderr
    (tmp_path / "chain.attn").write_text("attention t { heads = 2 head_dim = 16 mask = "
                                         + " & ".join(["k <= q"] * 489) + " }")
    assert attnc("check", tmp_path / "chain.attn").returncode == 0
