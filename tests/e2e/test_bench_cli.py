"""`attnc bench` (issue 37): attnc.bench is reached from the command's handler only; without a GPU
the command refuses in one line; rows go to --out or ./bench-results/, never into the package."""
import pytest

from attnc.compiler.cli import _bench_out, main
from attnc.compiler.errors import InputError


def test_without_a_gpu_the_bench_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the bench would run")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "prefill"]) == 1
    assert capsys.readouterr().err == "error: attnc bench measures GPU kernels; no CUDA device is visible\n"
    assert not list(tmp_path.iterdir())  # nothing written


def test_rows_go_to_the_current_directory_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = _bench_out(None, "decode")
    assert path.startswith("bench-results/decode-") and path.endswith(".jsonl")
    assert (tmp_path / "bench-results").is_dir() and not (tmp_path / path).exists()
    assert capsys.readouterr().err == f"attnc bench decode: rows -> {path}\n"
    assert _bench_out(str(tmp_path / "a" / "rows.jsonl"), "append") == str(tmp_path / "a" / "rows.jsonl")
    with pytest.raises(InputError, match="cannot write"):
        _bench_out(str(tmp_path / "a"), "prefill")  # a folder
