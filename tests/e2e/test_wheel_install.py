"""A non-editable install, as a user gets it (issue 16): build the wheel, install it into a fresh
venv, and use it from outside the repository.

The wheel is built from a copy of the sources (a build writes build/ and *.egg-info beside
them) without build isolation, so nothing is downloaded; the venv sees the system site-packages
for numpy, lark and jinja2, and attnc itself must come from the venv, not from an editable
install of this checkout.  Run inside a virtual environment, the new venv also sees that
environment's site-packages (see_outer_environment)."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import attnc
from tests.conftest import ROOT

PACKAGE_FOLDERS = ["compiler", "backends", "bench", "grammar", "templates", "examples"]


def _run(cmd, cwd, env, timeout=120):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


OUTER_PTH = "test-outer-environment.pth"


def see_outer_environment(site_dir: Path) -> None:
    """When this test itself runs in a virtual environment, the venv it makes sees the *base*
    interpreter's site-packages, not this environment's (where numpy, lark, jinja2 and pip were
    installed): list this environment's site-packages in a .pth of the new venv.  They come after
    the new venv's own (its attnc wins), and their .pth files are not run (an editable attnc of
    this checkout stays out)."""
    if sys.prefix == sys.base_prefix:
        return
    import site
    outer = [p for p in site.getsitepackages() if Path(p).is_relative_to(sys.prefix)]
    (site_dir / OUTER_PTH).write_text("".join(f"{p}\n" for p in outer))


def _data_files(folder: str, pattern: str) -> set[str]:
    return {p.relative_to(ROOT / folder).as_posix() for p in (ROOT / folder).glob(pattern)}


@pytest.mark.skipif(os.environ.get("ATTNC_TEST_GPU") == "1",
                    reason="packaging is CPU CI's job: the GPU list's machine has no package index, attnc's "
                           "dependencies reach its interpreter only through PYTHONPATH (which a user's venv "
                           "does not see), and this test's `attnc bench` expects no GPU")
def test_wheel_installs_one_package_that_runs_the_demo(tmp_path):
    import setuptools  # noqa: F401  (the build runs without isolation: setuptools must be installed here)

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "tests", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".venv", ".benchmarks", "bench-results"))
    shutil.rmtree(src / "bench" / "results")  # (27 MB of recorded rows: one stands for them)
    (src / "bench" / "results").mkdir()
    (src / "bench" / "results" / "run.jsonl").write_text('{"bench": "prefill"}\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "TRITON_INTERPRET")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", tmp_path / "dist", src], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("attnc-*.whl")

    # the wheel: one top-level package, every module of the sources (a subpackage missing from
    # pyproject.toml's list would be left out), and the grammar, templates and examples as data
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"attnc", f"attnc-{attnc.__version__}.dist-info"}
    modules = {f"attnc/{m}" for m in _data_files("attnc", "**/*.py")}
    modules |= {f"attnc/{folder}/{m}" for folder in PACKAGE_FOLDERS for m in _data_files(folder, "**/*.py")}
    assert modules <= set(names), sorted(modules - set(names))
    for folder, pattern in [("grammar", "*.lark"), ("templates", "**/*.j2"), ("examples", "*.attn")]:
        shipped = {n.removeprefix(f"attnc/{folder}/") for n in names if n.startswith(f"attnc/{folder}/")}
        assert _data_files(folder, pattern) <= shipped, folder
    assert not [n for n in names if n.startswith("attnc/bench/") and not n.endswith(".py")]  # no results

    # a fresh venv; pip comes from the system site-packages (no ensurepip: faster, offline)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], tmp_path, env)
    py, bin_dir = venv / "bin" / "python", venv / "bin"
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    where = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env)
    site = Path(where.stdout.strip())
    see_outer_environment(site)
    # --ignore-installed: an editable attnc of this checkout in the system site-packages is not this install
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", wheel], tmp_path, env)

    assert site.is_relative_to(venv)
    # nothing but attnc and its dist-info at the top level of site-packages (and the test's .pth)
    assert {p.name for p in site.iterdir()} - {OUTER_PTH} == {"attnc", f"attnc-{attnc.__version__}.dist-info"}
    for folder in PACKAGE_FOLDERS:
        assert not (site / folder).exists()

    # run from outside the repository: attnc, its subpackages and its examples come from the venv
    probe = ("import attnc, attnc.compiler, attnc.backends.numpy; "
             "from attnc.compiler.demo import default_specs; "
             "print(attnc.__version__); print(attnc.__file__); print(attnc.compiler.__file__); "
             "print(attnc.backends.numpy.__file__); specs = default_specs(); print(len(specs)); print(specs[0])")
    version, *files, count, first = _run([py, "-c", probe], tmp_path, env).stdout.split()
    assert version == attnc.__version__
    for f in files + [first]:
        assert Path(f).is_relative_to(site / "attnc"), f
    assert int(count) == len(list((ROOT / "examples").glob("*.attn")))

    for cmd in ([bin_dir / "attnc", "--version"], [py, "-m", "attnc", "--version"]):
        assert _run(cmd, tmp_path, env).stdout == f"attnc {attnc.__version__}\n"

    # attnc bench from the install: its harness is attnc.bench; without a GPU, a one-line refusal
    probe = "import attnc.bench.harness as h, attnc.bench.append, attnc.bench.backward; print(h.__file__)"
    assert Path(_run([py, "-c", probe], tmp_path, env).stdout.strip()).is_relative_to(site / "attnc" / "bench")
    assert "prefill" in _run([bin_dir / "attnc", "bench", "--help"], tmp_path, env).stdout
    r = subprocess.run([bin_dir / "attnc", "bench", "prefill"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: attnc bench ") and len(r.stderr.splitlines()) == 1, \
        r.stderr

    # the main job from the install: every shipped example x prefill/append/decode vs the oracle
    r = _run([bin_dir / "attnc", "demo", "--length", "32"], tmp_path, env, timeout=300)
    passed, _, failed = r.stdout.splitlines()[-1].partition(" passed, ")
    assert failed == "0 failed" and int(passed) >= 3 * int(count), r.stdout
