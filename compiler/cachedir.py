"""Where attnc keeps files between runs: one place decides.

The root is ``$ATTNC_CACHE``, else ``$XDG_CACHE_HOME/attnc``, else ``~/.cache/attnc``.  It holds
the generated modules every backend imports (``backends.common.load_module``) and, unless
``ATTNC_TUNE_CACHE`` names another file, the tuning cache ``tune.json``.

:func:`writable_root` is the root generated modules go to: when it cannot be created or written
(a read-only home directory), a private temporary directory of this process takes its place
(made with ``mkdtemp``: mode 0700, never shared with another user; removed at exit), with one
warning per process naming the root that failed and ``ATTNC_CACHE``.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

ENV_VAR = "ATTNC_CACHE"
_fallback: dict[str, Path] = {}  # configured root -> this process's temporary stand-in
_lock = threading.Lock()


def root() -> Path:
    """The configured cache root (nothing is created)."""
    return Path(os.environ.get(ENV_VAR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "attnc"))


def _usable(directory: Path) -> str | None:
    """None when files can be created in ``directory`` (made if missing), else why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def writable_root() -> Path:
    """:func:`root` when it can be written, else this process's temporary directory (one
    warning the first time)."""
    configured = root()
    key = str(configured)
    hit = _fallback.get(key)
    if hit is not None:
        return hit
    if (configured / ".").is_dir() and os.access(configured, os.W_OK | os.X_OK):
        return configured
    with _lock:
        if key in _fallback:
            return _fallback[key]
        why = _usable(configured)
        if why is None:
            return configured
        tmp = Path(tempfile.mkdtemp(prefix="attnc-cache-"))
        atexit.register(shutil.rmtree, tmp, True)
        print(f"attnc: warning: cache directory {configured} cannot be written ({why}); using {tmp} for "
              f"this process (set {ENV_VAR} to a writable directory to keep generated modules between runs)",
              file=sys.stderr, flush=True)
        _fallback[key] = tmp
        return tmp
