"""The tuning cache: a JSON document of winners keyed by dispatch-key digest.

Writers merge: :meth:`TuneCache.save` takes an exclusive lock (``fcntl.flock`` on ``FILE.lock``
beside the cache, POSIX), reads the file as it is now, adds the entries this process put (they
win for their digests), and replaces the file atomically (temporary file + ``os.replace``); two
``attnc tune`` processes on one cache keep every entry either of them wrote.  Readers never
lock: they see the old file or the new one, never half of either.

Whatever cannot be read is reported and skipped, and tuning goes on: an unreadable or non-UTF-8
file, invalid JSON, another format or version (set aside as ``FILE.bad`` by the next write, a
regular file only), a malformed entry (skipped, the rest kept).  A cache that cannot be written
(a read-only directory) raises :class:`CacheWriteError`, which the tuner reports before it goes
on with the next shape.  A path that names a directory means the file ``tune.json`` inside it;
the cache never renames, replaces or removes a directory.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from .. import cachedir
from ..errors import TuneError

CACHE_FORMAT = "attnc-tune"
CACHE_VERSION = 1
FILE_NAME = "tune.json"

try:  # POSIX advisory locks; elsewhere writers are atomic but do not wait for each other
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None


class CacheWriteError(TuneError):
    """The cache file (or its lock) cannot be written."""


def default_cache_path() -> Path:
    if os.environ.get("ATTNC_TUNE_CACHE"):
        return Path(os.environ["ATTNC_TUNE_CACHE"])
    return cachedir.root() / FILE_NAME


def cache_file(path: str | os.PathLike | None = None) -> Path:
    """The cache file a path names: the path itself, or ``DIR/tune.json`` when it is a directory."""
    p = Path(path) if path is not None else default_cache_path()
    return p / FILE_NAME if p.is_dir() else p


def _int_in(lo: int, hi: int, pow2: bool = False, none: bool = False) -> Callable[[object], bool]:
    def ok(v) -> bool:
        if v is None:
            return none
        return (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
                and (not pow2 or v & (v - 1) == 0))
    return ok


# A launch parameter a config may carry -> whether a value is one some backend's launch can take
# (a backend's own limits, such as a GPU's 16-row tiles, stay its own).  Keys not named here
# belong to some backend's own space and pass unchecked.
CONFIG_FIELDS: dict[str, Callable[[object], bool]] = {
    "BLOCK_M": _int_in(1, 1024, pow2=True),
    "BLOCK_N": _int_in(1, 1024, pow2=True),
    "num_warps": _int_in(1, 32, pow2=True),
    "num_stages": _int_in(1, 8),
    "splits": _int_in(1, 1 << 16, none=True),
    "use_tma": lambda v: isinstance(v, bool),
}


def entry_problem(digest: str, e) -> str | None:
    """Why an entry cannot be used (None: it can): every reader indexes ``config`` (whose
    launch parameters must be ones a launch can take, :data:`CONFIG_FIELDS`) and the tuner's
    report ``median_ms``."""
    if not isinstance(e, dict):
        return "is not an object"
    if e.get("digest") != digest:
        return "names another digest"
    if not isinstance(e.get("config"), dict):
        return "has no config object"
    for name, ok in CONFIG_FIELDS.items():
        if name in e["config"] and not ok(e["config"][name]):
            return f"has an unusable {name} ({e['config'][name]!r})"
    ms = e.get("median_ms")
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
        return f"has no usable median_ms ({ms!r})"
    return None


class NotRegularFile(OSError):
    """The cache path names something other than a regular file (a FIFO, a device, a socket)."""


def regular_or_missing(path: Path) -> bool:
    """Whether ``path`` is a regular file (through links) or names nothing: the only paths the
    cache reads or replaces (a FIFO would block a reader, a device node must never be replaced)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return True
    except OSError:
        return True  # unreadable for another reason: the read reports it


def _read_regular(path: Path) -> bytes:
    """The bytes of a regular file; :class:`NotRegularFile` for anything else, without blocking
    (the open is non-blocking, the type checked on the open descriptor)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


class TuneCache:
    """The JSON tuning cache.  ``problems`` lists what was wrong with the file when it was
    read (unreadable, corrupt, foreign format or version, malformed entries); those parts are
    ignored and reported through ``report``."""

    def __init__(self, path: str | os.PathLike | None = None, report: Callable[[str], None] | None = None):
        self.path = cache_file(path)
        self.report = report or report_to_stderr
        self.problems: list[str] = []
        self._reported: set[str] = set()
        self._put: set[str] = set()  # digests this process wrote: they win a merge
        self.write_errors: list[str] = []  # why a save failed (the tuner reports and goes on)
        self.entries, _, self._bad, _ = self._read()

    def _read(self) -> tuple[dict[str, dict], dict, bool, bool]:
        """The file as it is now: (usable entries, every entry as stored, whether the file as a
        whole is unusable, whether it could not be read at all); each problem is recorded and
        reported once."""
        def problem(text: str) -> None:
            self.problems.append(text)
            if text not in self._reported:
                self._reported.add(text)
                self.report(f"attnc tune: {text}")

        try:
            raw = _read_regular(self.path)
        except FileNotFoundError:
            return {}, {}, False, False
        except NotRegularFile:
            problem(f"tuning cache {self.path} is not a regular file; ignoring it")
            return {}, {}, False, True
        except OSError as e:
            problem(f"cannot read tuning cache {self.path}: {e.strerror or e}; ignoring it")
            return {}, {}, False, True
        try:
            doc = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            problem(f"tuning cache {self.path} is not UTF-8 text ({e.reason} at byte {e.start}); ignoring it")
            return {}, {}, True, False
        except ValueError as e:
            problem(f"tuning cache {self.path} is corrupt ({e}); ignoring it")
            return {}, {}, True, False
        except RecursionError:
            problem(f"tuning cache {self.path} is corrupt (nested too deeply); ignoring it")
            return {}, {}, True, False
        if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT:
            problem(f"{self.path} is not an attnc tuning cache; ignoring it")
            return {}, {}, True, False
        if doc.get("version") != CACHE_VERSION:
            problem(f"tuning cache {self.path} has version {doc.get('version')!r}; this attnc reads version "
                    f"{CACHE_VERSION}; ignoring it")
            return {}, {}, True, False
        entries = doc.get("entries")
        if not isinstance(entries, dict):
            problem(f"tuning cache {self.path} has no entries object; ignoring it")
            return {}, {}, True, False
        good = {}
        for digest, e in entries.items():
            why = entry_problem(digest, e)
            if why:
                problem(f"tuning cache {self.path}: entry {str(digest)[:12]} is malformed ({why}); ignoring it")
            else:
                good[digest] = e
        return good, entries, False, False

    def get(self, digest: str) -> dict | None:
        return self.entries.get(digest)

    def put(self, entry: dict) -> None:
        self.entries[entry["digest"]] = entry
        self._put.add(entry["digest"])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock = self.path.with_name(self.path.name + ".lock")
        if not regular_or_missing(self.path):  # never lock beside, nor replace, a FIFO or a device
            raise CacheWriteError(f"cannot write tuning cache {self.path}: not a regular file")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CacheWriteError(f"cannot write tuning cache {self.path}: {_why(e)}") from None
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (closing releases the lock)

    def save(self) -> None:
        """Merge this process's entries into the file as it is now, under the lock; atomic."""
        with self._locked():
            self.problems.clear()
            usable, stored, bad, unreadable = self._read()
            if unreadable:  # replacing it would lose entries nobody could read
                raise CacheWriteError(f"cannot merge into tuning cache {self.path}: {self.problems[-1]}")
            mine = {d: self.entries[d] for d in self._put if d in self.entries}
            entries = {**{d: e for d, e in stored.items() if d in usable or _serializable(e)}, **mine}
            # (malformed entries stay as they were stored, when they are JSON at all)
            if bad and self.path.is_file():
                os.replace(self.path, self.path.with_name(self.path.name + ".bad"))  # set aside, not destroyed
            doc = {"format": CACHE_FORMAT, "version": CACHE_VERSION,
                   "entries": {d: entries[d] for d in sorted(entries)}}
            try:
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp")
            except OSError as e:
                raise CacheWriteError(f"cannot write tuning cache {self.path}: {_why(e)}") from None
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f, indent=1, allow_nan=False)
                    f.write("\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        self.entries, self._bad = {**usable, **mine}, False
        _MEMO.pop(str(self.path), None)


def _why(e: OSError) -> str:
    if isinstance(e, (FileExistsError, NotADirectoryError)) and e.filename:
        return f"{e.filename} is not a directory"
    return f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")


def _serializable(e) -> bool:
    try:
        json.dumps(e, allow_nan=False)
    except ValueError:
        return False
    return True


def report_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


_MEMO: dict[str, tuple[float, TuneCache]] = {}


def load_cache(cache: TuneCache | str | os.PathLike | None) -> TuneCache | None:
    """``cache`` itself, or the file at the path (default: :func:`default_cache_path`) read once
    per modification time; None when there is no file."""
    if isinstance(cache, TuneCache):
        return cache
    path = cache_file(cache)
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    hit = _MEMO.get(str(path))
    if hit is None or hit[0] != mtime:
        hit = (mtime, TuneCache(path))
        _MEMO[str(path)] = hit
    return hit[1]
