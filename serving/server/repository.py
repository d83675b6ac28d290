"""A model repository: folders of bundles, each bundle servable by its folder's name.

Owns: scanning the folders (every subfolder holding a bundle manifest is a model, named by the subfolder, which must
be a name the API accepts: serving/server/config.py's MODEL_NAME), each model's task, version and size as its
manifest says (a manifest that cannot be read is listed with the reason, and refused when asked for), rescanning
(new bundles appear and removed ones go, without a restart), and finding a model by name (a 404 naming the
repository's folders when it holds none of that name). The first folder wins when two hold the same name.

Does not own: verifying a bundle's files (export.bundle.load_bundle does when a model loads, naming the file at
fault), loading and evicting models (serving/server/model_pool.py).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from export.bundle import MANIFEST_FILE, content_version
from serving.server.config import MODEL_NAME
from serving.server.errors import ErrorKind, ServiceError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """One model of the repository."""

    name: str
    path: Path
    task: str | None  # "translate" | "generate"; None when the manifest cannot be read
    version: str | None
    bytes: int  # the bundle folder's size on disk
    error: str | None = None  # why the manifest cannot be read

    def listing(self) -> dict[str, object]:
        return {
            "id": self.name,
            "task": self.task,
            "version": self.version,
            "bytes": self.bytes,
            **({"error": self.error} if self.error else {}),
        }


def read_entry(name: str, path: Path) -> Entry:
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    try:
        doc = json.loads((path / MANIFEST_FILE).read_text())
        return Entry(name, path, doc["task"], content_version(doc), size)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Entry(name, path, None, None, size, error=f"{path / MANIFEST_FILE}: {type(e).__name__}: {e}")


class Repository:
    def __init__(self, roots: list[Path], rescan_s: float = 30.0) -> None:
        self.roots, self.rescan_s = [Path(r) for r in roots], rescan_s
        self._entries: dict[str, Entry] = {}
        self._scanned = -float("inf")
        self.scan()

    def scan(self) -> dict[str, Entry]:
        """Read the folders again; returns the models now held."""
        found: dict[str, Entry] = {}
        for root in self.roots:
            for path in sorted(root.iterdir()) if root.is_dir() else ():
                if not (path / MANIFEST_FILE).is_file():
                    continue
                if not MODEL_NAME.match(path.name):
                    log.warning("repository: %s is not a model name (%s); skipped", path, MODEL_NAME.pattern)
                    continue
                if path.name in found:
                    log.warning("repository: %s is shadowed by %s", path, found[path.name].path)
                    continue
                old = self._entries.get(path.name)
                found[path.name] = (
                    old if old is not None and old.path == path and _unchanged(old) else read_entry(path.name, path)
                )
        self._entries, self._scanned = found, time.monotonic()
        return found

    def entries(self) -> list[Entry]:
        self._maybe_rescan()
        return list(self._entries.values())

    def get(self, name: str) -> Entry:
        self._maybe_rescan()
        entry = self._entries.get(name) or self.scan().get(name)  # a bundle added since the last scan
        if entry is None:
            raise ServiceError(
                ErrorKind.NOT_FOUND,
                f"model {name[:120]!r} is not in the model repository "
                f"({', '.join(map(str, self.roots))}); GET /v1/models lists the models it holds",
                field="model",
            )
        if entry.error is not None:
            raise ServiceError(ErrorKind.UNAVAILABLE, f"model {name!r} cannot be loaded: {entry.error}", field="model")
        return entry

    def _maybe_rescan(self) -> None:
        if time.monotonic() - self._scanned >= self.rescan_s:
            self.scan()


def _unchanged(entry: Entry) -> bool:
    """Whether the manifest still reads as it did (a re-exported bundle gets a new version)."""
    fresh = read_entry(entry.name, entry.path)
    return fresh.version == entry.version and fresh.bytes == entry.bytes
