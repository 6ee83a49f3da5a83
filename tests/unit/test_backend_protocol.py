"""One backend protocol (issue 37): every registered backend implements
``compiler/dispatch/protocol.Backend`` (or leaves a capability out and refuses it), and the torch
front doors under ``attnc/`` never decide anything by a backend's name: they reach backends
through the registry and dispatch only."""
import ast

import pytest

from attnc.compiler.dispatch import REGISTRY, protocol, torch_backend, with_capability
from tests.conftest import ROOT

NAMES = frozenset(REGISTRY)


def _named(node) -> list[str]:
    """Backend names spelled as string constants in ``node`` (a constant, or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and node.value in NAMES:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for e in node.elts for n in _named(e)]
    return []


def decisions_by_name(source: str) -> list[tuple[int, str]]:
    """(line, what) of every place ``source`` decides by a backend's name: a comparison with one
    (``==``, ``in``, ``!=``, ...), a map keyed by one, or a conditional choosing one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            names = [n for e in (node.left, *node.comparators) for n in _named(e)]
            if names:
                found.append((node.lineno, f"compares with {names[0]!r}"))
        elif isinstance(node, ast.Dict):
            names = [n for k in node.keys if k is not None for n in _named(k)]
            if names:
                found.append((node.lineno, f"a map keyed by {names[0]!r}"))
        elif isinstance(node, ast.IfExp):
            names = _named(node.body) + _named(node.orelse)
            if names:
                found.append((node.lineno, f"chooses {names[0]!r} by a condition"))
    return found


def test_the_scan_finds_a_decision_by_name():
    assert decisions_by_name("if name == 'triton':\n    pass\n") == [(1, "compares with 'triton'")]
    assert decisions_by_name("ok = backend in ('numpy', 'ahbm')") == [(1, "compares with 'numpy'")]
    assert decisions_by_name("R = {'ahbm': 1}") == [(1, "a map keyed by 'ahbm'")]
    assert decisions_by_name("b = 'triton' if cuda else 'numpy'") == [(1, "chooses 'triton' by a condition")]
    assert decisions_by_name("doc = 'the triton backend'; n = name == 'other'") == []


@pytest.mark.parametrize("path", sorted((ROOT / "attnc").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_backend_name_is_compared_in_attnc(path):
    found = decisions_by_name(path.read_text())
    assert not found, "; ".join(f"{path.relative_to(ROOT)}:{line} {what}" for line, what in found)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_registered_backend_implements_the_protocol(name):
    backend = torch_backend(name)
    assert isinstance(backend, protocol.Backend) and protocol.implements(backend) == []
    assert backend.name == name and set(backend.capabilities) <= set(protocol.CAPABILITIES)
    assert "forward" in backend.capabilities
    for capability in sorted(set(protocol.CAPABILITIES) - set(backend.capabilities)):
        with pytest.raises(protocol.BackendRefused) as e:  # a missing capability is said, not crashed into
            protocol.require(backend, capability, tensor="x")
        assert name in str(e.value) or name.capitalize() in str(e.value)


def test_a_missing_capability_is_refused_through_the_protocol():
    import attnc.api
    ahbm = torch_backend("ahbm")
    assert "backward" not in ahbm.capabilities and "ahbm" not in with_capability("backward")
    assert attnc.api.BackendRefused is protocol.BackendRefused
    with pytest.raises(attnc.api.BackendRefused, match="the ahbm backend has no backward pass"):
        ahbm.backward(None, *[None] * 7, {}, ())
    with pytest.raises(ValueError, match="unknown capability"):
        protocol.require(ahbm, "teleport")
