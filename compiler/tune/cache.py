"""The tuning cache: a JSON document of winners keyed by dispatch-key digest, written
atomically; a corrupt or foreign-version file is reported and ignored (and set aside as
``FILE.bad`` when the tuner rewrites it)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

CACHE_FORMAT = "attnc-tune"
CACHE_VERSION = 1


def default_cache_path() -> Path:
    if os.environ.get("ATTNC_TUNE_CACHE"):
        return Path(os.environ["ATTNC_TUNE_CACHE"])
    root = os.environ.get("ATTNC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "attnc")
    return Path(root) / "tune.json"


class TuneCache:
    """The JSON tuning cache.  ``problems`` lists what was wrong with the file when it was
    read (corrupt, foreign format or version, a malformed entry); those parts are ignored."""

    def __init__(self, path: str | os.PathLike | None = None, report: Callable[[str], None] | None = None):
        self.path = Path(path) if path is not None else default_cache_path()
        self.entries: dict[str, dict] = {}
        self.problems: list[str] = []
        self._bad = False
        self._load()
        for p in self.problems:
            (report or report_to_stderr)(f"attnc tune: {p}")

    def _load(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as e:
            self.problems.append(f"cannot read tuning cache {self.path}: {e}; ignoring it")
            self._bad = True
            return
        try:
            doc = json.loads(text)
        except ValueError as e:
            self.problems.append(f"tuning cache {self.path} is corrupt ({e}); ignoring it")
            self._bad = True
            return
        if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT:
            self.problems.append(f"{self.path} is not an attnc tuning cache; ignoring it")
            self._bad = True
            return
        if doc.get("version") != CACHE_VERSION:
            self.problems.append(f"tuning cache {self.path} has version {doc.get('version')!r}; this attnc "
                                 f"reads version {CACHE_VERSION}; ignoring it")
            self._bad = True
            return
        entries = doc.get("entries")
        if not isinstance(entries, dict):
            self.problems.append(f"tuning cache {self.path} has no entries object; ignoring it")
            self._bad = True
            return
        for digest, e in entries.items():
            if not isinstance(e, dict) or not isinstance(e.get("config"), dict) or e.get("digest") != digest:
                self.problems.append(f"tuning cache {self.path}: entry {digest[:12]} is malformed; ignoring it")
                continue
            self.entries[digest] = e

    def get(self, digest: str) -> dict | None:
        return self.entries.get(digest)

    def put(self, entry: dict) -> None:
        self.entries[entry["digest"]] = entry

    def save(self) -> None:
        """Atomic: a reader sees the old file or the new one, never half of either."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._bad and self.path.exists():
            os.replace(self.path, self.path.with_name(self.path.name + ".bad"))
            self._bad = False
        doc = {"format": CACHE_FORMAT, "version": CACHE_VERSION,
               "entries": {d: self.entries[d] for d in sorted(self.entries)}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp")
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
        _MEMO.pop(str(self.path), None)


def report_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)



_MEMO: dict[str, tuple[float, TuneCache]] = {}


def load_cache(cache: TuneCache | str | os.PathLike | None) -> TuneCache | None:
    """``cache`` itself, or the file at the path (default: :func:`default_cache_path`) read once
    per modification time; None when there is no file."""
    if isinstance(cache, TuneCache):
        return cache
    path = Path(cache) if cache is not None else default_cache_path()
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    hit = _MEMO.get(str(path))
    if hit is None or hit[0] != mtime:
        hit = (mtime, TuneCache(path))
        _MEMO[str(path)] = hit
    return hit[1]
