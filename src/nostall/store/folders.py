"""What a store's scan looks at on disk, and no more: one pipeline folder's listings,
stamps, JSON files and links.

A diffusers component folder holds a few files at its top level (config, weights, their
shard index; a tokenizer's files), so nothing is walked below that but one folder of a
tokenizer or scheduler (transformers reads ``additional_chat_templates/`` there), and a
folder of more entries than :data:`MAX_ENTRIES` is refused by name, in milliseconds,
instead of walked (a tokenizer folder linked to ``/usr/share`` was read whole: 13 s).
"""

from __future__ import annotations

import os
from typing import Any

from nostall.errors import CheckpointError, ReadError
from nostall.store.digest import FileIdentity
from nostall.store.files import open_regular, parse_json

__all__ = [
    "MAX_ENTRIES",
    "MAX_FILES_BYTES",
    "Stamp",
    "check_links",
    "check_role",
    "check_size",
    "component_files",
    "link_hint",
    "listdir",
    "read_json",
    "stamp",
]

# A component folder holds a handful of files: config, weights (a large model's shards:
# tens), their index, a tokenizer's files. Thousands of entries mean a link to the
# wrong folder (/usr/lib), which is refused rather than walked.
MAX_ENTRIES = 1000
# What a files component (tokenizer, scheduler, processor) may hold: the largest
# tokenizers are tens of MB (Gemma's tokenizer.json, 33 MB); all of it is read at scan.
MAX_FILES_BYTES = 1 << 30

Stamp = tuple[str, FileIdentity]  # a path and its identity when it was scanned


def stamp(path: str) -> Stamp:
    try:
        return path, FileIdentity.stat(path)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ReadError(f"cannot stat: {e.strerror or e}", path=path) from e


def check_role(role: str, index_path: str) -> None:
    """A component name is a folder beside ``model_index.json``: one plain name."""
    bad = (
        not role
        or role in (".", "..")
        or "/" in role
        or "\\" in role
        or "\0" in role
        or os.path.isabs(role)
        or os.sep in role
    )
    if bad:
        raise CheckpointError(
            f"model_index.json names a component {role!r}, which is not a folder name "
            "beside it (a path leaving the pipeline folder?); nostall reads only the "
            "pipeline's own component folders. Fix or re-download the index",
            path=index_path,
        )


def check_links(folder: str, listing: list[str]) -> None:
    for name in listing:
        path = os.path.join(folder, name)
        if os.path.islink(path) and not os.path.exists(path):
            raise CheckpointError(
                f"{name!r} is a symbolic link to {os.readlink(path)!r}, which does not exist "
                "(an interrupted download, or a cache whose blobs were deleted); download the "
                "component again",
                path=path,
            )


def read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open_regular(path, what=what) as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"no {os.path.basename(path)}; the {what} is missing", path=path
        ) from None
    except OSError as e:
        raise ReadError(f"cannot read the {what}: {e.strerror or e}", path=path) from e
    doc = parse_json(raw, what=what, fix="re-save it with save_pretrained", path=path)
    if not isinstance(doc, dict):
        raise CheckpointError(f"the {what} must be a JSON object", path=path)
    return doc


def listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError as e:
        raise ReadError(f"cannot list the folder: {e.strerror or e}", path=folder) from e


def check_size(role: str, folder: str, entries: int) -> None:
    if entries > MAX_ENTRIES:
        raise CheckpointError(
            f"component {role!r}: its folder holds {entries:,} entries or more (nostall looks "
            f"at its top level and, for a tokenizer or scheduler, one folder down: at most "
            f"{MAX_ENTRIES:,}); a diffusers component folder holds a few files (config, "
            f"weights, their index, a tokenizer's files){link_hint(folder)}. Point it at the "
            "component's own folder",
            path=folder,
        )


def link_hint(folder: str) -> str:
    """`` (it is a link to X)``, where the component folder is one."""
    if not os.path.islink(folder):
        return ""
    return f" (it is a link to {os.path.realpath(folder)})"


def component_files(role: str, folder: str, listing: list[str]) -> tuple[list[str], list[str]]:
    """A files component's subfolders and files (relative paths, sorted): its top level
    and one folder down, never further, at most ``MAX_ENTRIES`` entries in all. The
    top level's links were checked by the caller; one folder down they are checked here."""
    folders: list[str] = []
    files: list[str] = []
    seen = len(listing)
    for name in sorted(listing):
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            files.append(name)
            continue
        folders.append(name)
        inner = listdir(path)
        seen += len(inner)
        check_size(role, folder, seen)
        check_links(path, inner)
        files.extend(
            f"{name}/{n}" for n in sorted(inner) if not os.path.isdir(os.path.join(path, n))
        )
    return folders, files
