"""What every backend shares: Jinja rendering and loading generated modules.

Not a backend: backends import this, never each other (DESIGN §2).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import jinja2

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
    root = os.environ.get("ATTNC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "attnc")
    return Path(root)


def load_module(source: str, stem: str) -> ModuleType:
    """Import generated source from a file named by its digest (Triton's JIT reads kernel
    source through `inspect`, so generated code must live in a real file)."""
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}_{key}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(source)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    name = f"attnc_generated.{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
