"""Reading a directory of model manifests: which files count, their content hashed, each parsed as a model entry.

A manifest is one YAML file holding one ``models:`` entry of the configuration
file (``gateway.settings.ModelEntry``: the same keys, the same checks), the
model's name taken from its ``name``. Only regular files directly in the
directory whose names end ``.yaml`` or ``.yml`` count; dotfiles and editor
leftovers (``~``, ``#...#``, ``.swp``) are ignored. A symbolic link counts
only if it resolves to a regular file inside the directory (as a Kubernetes
ConfigMap's files do, into its ``..data`` folder); one that leads out of it is
refused (reported), so a manifest is never a file elsewhere on the server. A
file over ``registry.max_manifest_bytes`` is reported unread.

Errors name the file by its name only; a path in an error's text is cut to its
last part, so ``/readyz`` (which anyone may read) shows no directory layout.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from inferflux.gateway.settings import ModelEntry
from inferflux.gateway.validation_errors import first_error

SUFFIXES = (".yaml", ".yml")
_ABSOLUTE = re.compile(r"(?<![\w.])/(?:[^\s'\"/]+/)+")


class ManifestError(Exception):
    """A manifest that cannot be used; the message is safe to show (no directory paths, no secrets)."""


@dataclass(frozen=True)
class ManifestFile:
    """One candidate file as read: its content's hash, and its bytes or why they could not be read."""

    name: str
    digest: str
    content: bytes | None
    error: str | None = None


def scrub(message: str) -> str:
    """``message`` with every absolute path cut to its last part (``/srv/models/x.gguf`` -> ``x.gguf``)."""
    return _ABSOLUTE.sub("", message)


def counts(name: str) -> bool:
    """Whether a directory entry named ``name`` is a manifest candidate (not a dotfile nor an editor's temp)."""
    if name.startswith((".", "#")) or name.endswith(("~", "#")):
        return False
    return name.lower().endswith(SUFFIXES)


def scan(directory: Path, max_bytes: int) -> dict[str, ManifestFile]:
    """The candidates directly in ``directory``, by file name (blocking: run it on a thread).

    A file that cannot be used as such (a link, not a regular file, too large,
    unreadable) is still listed, with its error and a digest of what was seen,
    so that it is reported once and its model (if any) left as it is.
    Raises ``OSError`` when the directory itself cannot be listed.
    """
    found: dict[str, ManifestFile] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            if counts(entry.name):
                found[entry.name] = _read(directory, entry.name, max_bytes)
    return found


def _read(directory: Path, name: str, max_bytes: int) -> ManifestFile:
    def refused(why: str, seen: str) -> ManifestFile:
        return ManifestFile(name, hashlib.sha256(f"{why}|{seen}".encode()).hexdigest(), None, why)

    try:
        path = _inside(directory, name)
        if path is None:
            return refused("a symbolic link out of the directory: manifests must be files in it", name)
        info = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode):
            return refused("not a regular file", str(info.st_mode))
        if info.st_size > max_bytes:
            return refused(f"larger than registry.max_manifest_bytes ({max_bytes} bytes)", str(info.st_size))
        # O_NOFOLLOW: a file swapped for a link since it was resolved is refused, not followed.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as handle:
            content = handle.read(max_bytes + 1)
    except OSError as exc:
        return refused(f"cannot be read ({exc.strerror or type(exc).__name__})", str(exc.errno))
    if len(content) > max_bytes:
        return refused(f"larger than registry.max_manifest_bytes ({max_bytes} bytes)", str(len(content)))
    return ManifestFile(name, hashlib.sha256(content).hexdigest(), content)


def _inside(directory: Path, name: str) -> str | None:
    """The file ``name`` stands for: itself, or the file its links resolve to if that is inside ``directory``
    (a Kubernetes ConfigMap's files are links into its ``..data`` folder); None for a link out of it."""
    path = os.path.join(directory, name)
    if not os.path.islink(path):
        return path
    root = os.path.realpath(directory)
    resolved = os.path.realpath(path)
    return resolved if resolved.startswith(root + os.sep) else None


def parse(file: ManifestFile) -> ModelEntry:
    """The model entry ``file`` holds, else ``ManifestError`` saying what is wrong with it."""
    if file.content is None:
        raise ManifestError(file.error or "cannot be read")
    try:
        data = yaml.safe_load(file.content.decode("utf-8"))
    except UnicodeDecodeError:
        raise ManifestError("not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ManifestError(f"not valid YAML{where}: {getattr(exc, 'problem', None) or 'syntax error'}") from None
    if not isinstance(data, dict):
        raise ManifestError("must be a mapping of one model's keys (as a models: entry of the configuration file)")
    try:
        return ModelEntry.model_validate(data)
    except ValidationError as exc:
        first = first_error(exc, unknown="unknown key")
        raise ManifestError(scrub(f"invalid {first.path or 'manifest'!r}: {first.message}")) from None
