"""Checksum manifests for tensor files on disk: detect truncated or bit-flipped shards before loading.

What: `write_manifest(directory, names)` records sha256 and size of each named file in
`directory/checksums.json`; `verify_manifest` checks them and raises `IntegrityError` naming the file,
the fault and the fix. Model checkpoints and adapters call these; run checkpoints keep their own
manifest but use `file_sha256` / `describe_mismatch`, so every corruption message reads the same.
Why only tensor files: the large safetensors are what gets silently damaged, while the small JSON
files beside them are meant to be hand-edited and are validated strictly on load.

Invariants: the manifest is written after its files and published by atomic rename; a directory
without one still loads (one warning per directory per process, returns False); an existing manifest
must parse, and a missing, resized, changed or unlisted requested file is an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST_FILE = "checksums.json"
FORMAT_VERSION = 1
_CHUNK_BYTES = 1 << 20
_warned_unverified: set[str] = set()  # directories already warned about (warn once per process)


class IntegrityError(ValueError):
    """A file whose bytes do not match its recorded checksum (or an unreadable manifest)."""


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_record(path: Path) -> dict[str, int | str]:
    return {"sha256": file_sha256(path), "bytes": path.stat().st_size}


def describe_mismatch(path: Path, record: dict) -> str | None:
    """Why `path` does not match `record` ({sha256, bytes}), or None when it matches. The size is
    checked first: it is free and names the common case (a truncated copy)."""
    if not path.is_file():
        return "is missing"
    size, want = path.stat().st_size, record.get("bytes")
    if want is not None and size != want:
        kind = "truncated" if size < want else "longer than written"
        return f"is {kind} ({size} bytes, the manifest records {want})"
    if file_sha256(path) != record.get("sha256"):
        return "is corrupted (its sha256 does not match the manifest: bit flip or overwrite)"
    return None


def write_manifest(directory: str | os.PathLike, names: Iterable[str]) -> Path:
    """Hash the named files of `directory` (already written and complete) and publish
    `checksums.json` atomically. Returns the manifest path."""
    directory = Path(directory)
    files = {}
    for name in sorted(set(names)):
        fsync_path(directory / name)
        files[name] = file_record(directory / name)
    body = {"format": FORMAT_VERSION, "algorithm": "sha256", "files": files}
    tmp = directory / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(body, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_FILE)
    fsync_path(directory)
    return directory / MANIFEST_FILE


def read_manifest(directory: str | os.PathLike) -> dict[str, dict] | None:
    """{file name: {sha256, bytes}} of `directory`'s manifest; None if it has none."""
    mpath = Path(directory) / MANIFEST_FILE
    if not mpath.is_file():
        return None
    try:
        files = json.loads(mpath.read_text())["files"]
        if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in files.values()
        ):
            raise ValueError("'files' must map names to {sha256, bytes}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise IntegrityError(
            f"{mpath}: unreadable checksum manifest ({type(e).__name__}: {e}); the directory cannot be "
            f"verified: restore it from its source, or delete {MANIFEST_FILE} to load it unchecked"
        ) from None
    return files


def verify_manifest(directory: str | os.PathLike, names: Iterable[str], what: str = "checkpoint") -> bool:
    """Check the named files of `directory` against its manifest. True: all verified. False: the
    directory has no manifest (warned once). Raises IntegrityError naming the first bad file."""
    directory = Path(directory)
    files = read_manifest(directory)
    if files is None:
        key = str(directory.resolve())
        if key not in _warned_unverified:
            _warned_unverified.add(key)
            log.warning(
                "%s %s has no %s (written by an older version or another tool): loading it without "
                "checksum verification", what, directory, MANIFEST_FILE,
            )  # fmt: skip
        return False
    for name in sorted(set(names)):
        if name not in files:
            raise IntegrityError(
                f"{what} {directory}: file {name} is not listed in {MANIFEST_FILE}; the directory was "
                f"changed after it was written: re-create it, or delete {MANIFEST_FILE} to load it unchecked"
            )
        problem = describe_mismatch(directory / name, files[name])
        if problem is not None:
            raise IntegrityError(
                f"{what} {directory}: file {name} {problem}; the data is truncated or corrupt: "
                "re-download / re-copy it or restore it from a backup"
            )
    return True
