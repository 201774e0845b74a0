"""The ControlNets of a model cache's store: the names under ``<store>/controlnets`` and
the store's name for a pipeline with one attached (by name there, or by folder)."""

from __future__ import annotations

import difflib
import hashlib
import os

from nostall.errors import UnknownModel
from nostall.store.catalog import Store

__all__ = ["attached", "listed"]


def listed(folder: str | None) -> list[str]:
    """The ControlNet names under ``folder`` (each a folder with a ``config.json``)."""
    if folder is None or not os.path.isdir(folder):
        return []
    return sorted(
        n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n, "config.json"))
    )


def attached(store: Store, folder: str | None, base: str, controlnet: str | os.PathLike) -> str:
    """The store's name for ``base`` with ``controlnet`` (a name under ``folder``, or a
    folder) attached; :class:`~nostall.UnknownModel` naming the close ones if neither."""
    given = os.fspath(controlnet)
    named = os.path.join(folder, given) if folder else None
    if named is not None and os.sep not in given and os.path.isdir(named):
        return store.with_controlnet(base, named, given)
    if os.path.isdir(given):
        path = os.path.abspath(given)
        tag = hashlib.sha256(path.encode()).hexdigest()[:8]
        return store.with_controlnet(base, path, f"{os.path.basename(path)}#{tag}")
    names = listed(folder)
    close = difflib.get_close_matches(given, names)
    raise UnknownModel(
        f"no ControlNet {given!r} in {folder or '(no store folder: give a path)'}"
        + (f"; did you mean {', '.join(close)}?" if close else "")
        + (f" (there: {', '.join(names[:20])})" if names else ""),
        name=given,
        available=names,
        close=close,
    )
