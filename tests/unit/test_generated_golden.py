"""Generated source for every example × backend is checked in (tests/golden/generated/).

A change to a template or to code generation shows up here as a diff; rewrite
deliberately with `pytest --update-golden` and say why in the commit message.
"""
import ast as pyast

import pytest

from attnc.compiler.dispatch import REGISTRY, backend
from attnc.compiler.lower import compile_file
from tests.conftest import EXAMPLES


@pytest.mark.parametrize("backend_name", sorted(REGISTRY))
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_generated_source_is_golden(path, backend_name, golden):
    source = backend(backend_name).emit(compile_file(path)).text
    pyast.parse(source)  # valid Python
    golden(f"generated/{backend_name}/{path.stem}.py", source)


def test_generated_numpy_source_is_self_contained():
    for path in EXAMPLES:
        source = backend("numpy").emit(compile_file(path)).text
        imports = [n for n in pyast.walk(pyast.parse(source)) if isinstance(n, (pyast.Import, pyast.ImportFrom))]
        assert [a.name for n in imports for a in n.names] == ["numpy"], path
