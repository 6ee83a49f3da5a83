"""What every backend shares: Jinja rendering and loading generated modules.

Not a backend: backends import this, never each other (DESIGN §2).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import jinja2

from attnc.compiler import cachedir

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


@functools.cache
def _environment(backend: str) -> jinja2.Environment:
    """One environment per backend: its templates are parsed once per process (they are package
    data, never edited while it runs)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES / backend),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        auto_reload=False,
    )


def render(backend: str, template: str, **context) -> str:
    return _environment(backend).get_template(template).render(**context)


def cache_dir() -> Path:
    """Where generated modules are written (``compiler.cachedir.writable_root``: the cache root,
    or a temporary directory when that cannot be written)."""
    return cachedir.writable_root()


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file of its own (unique per call, in the
    same directory) and ``os.replace``: a concurrent reader, thread or process, sees the old file
    or the new one, never half of one, and two writers never share a temporary file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_module(source: str, stem: str) -> ModuleType:
    """Import generated source from a file named by its digest (Triton's JIT reads kernel
    source through `inspect`, so generated code must live in a real file)."""
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    directory = cache_dir()
    path = directory / f"{stem}_{key}.py"
    try:
        current = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        current = None
    if current != source:
        _write_atomically(path, source)
    name = f"attnc_generated.{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
