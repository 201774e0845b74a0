"""Which key a store's weights component is served under, and what a shared key takes.

A key is what every tier of the model cache files a component under: two components
with one key are served as one copy. A weights component's key comes from the data
digests of its files (:mod:`nostall.store.digest`), either **verified** (computed
by this process from the bytes, as a read landed them or in ``Store.index_files``) or
**claimed** (a row of the digest index, :mod:`nostall.store.digest_index`, that an earlier
process wrote). A claim is what spares a new process reading and hashing files it has
seen, and it can be wrong: a row edited by hand or corrupted (its checksum catches
those), written by a buggy version, or copied with the index from a machine whose
inodes collide with this one's. Served under a key it shares with other files, a wrong
claim would serve one fine-tune's images from another's bytes, silently. So:

* **A claimed key labels one set of files.** The first set of files to claim a content
  is served under it; it shares nothing until its bytes are hashed.
* **A second claim waits for its proof.** Another set of files claiming the same
  content (or one this process verified in other files) is keyed by its own files'
  identities, and its first read from disk hashes it: the read that sharing would have
  skipped, once per process. The first claimant is hashed the next time it is read
  from disk (CPU in the reader threads, no read of its own): its first read where the
  second claim was scanned before it (a cache sized from its store scans every pipeline
  at start), else its next one, and until then the two are two copies.
* **Only verified content is shared.** A key served for two sets of files was computed
  from both sets' bytes in this process.
* **A claim its bytes contradict is repaired.** The store logs it, replaces the row and
  serves the component under its true content from then on.

An uncontested claim (one copy of each model, the common case) costs nothing: a new
process reads and hashes no more than it did before.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import hashlib
import json

from nostall.store import Checkpoint
from nostall.store.digest import FileIdentity

__all__ = ["Keys", "content_digest", "identity_key"]


def content_digest(
    library: str, cls: str, config_key: bytes, ckpt: Checkpoint, digests: list[str]
) -> str:
    """A weights component's content: class, config, every header and data digest."""
    h = hashlib.sha256(f"weights|{library}.{cls}\n".encode())
    h.update(config_key)
    for f, d in zip(ckpt.files, digests, strict=True):
        h.update(
            f"{f.file_size}|{f.data_start}|{json.dumps(f.metadata, sort_keys=True)}\n".encode()
        )
        for e in f.tensors:
            h.update(f"{e.name}|{e.dtype}|{list(e.shape)}|{e.begin}:{e.end}\n".encode())
        h.update(f"data|{d}\n".encode())
    return h.hexdigest()[:32]


def identity_key(library: str, cls: str, config_key: bytes, ckpt: Checkpoint) -> str:
    """A key from the files' identities (a symlinked copy is the same file): the same in
    every process of the host while the files are unchanged."""
    ident = hashlib.sha256(f"files|{library}.{cls}\n".encode())
    ident.update(config_key)
    for f in ckpt.files:
        i = f.identity or FileIdentity.stat(f.path)
        ident.update(f"{i.key()}\n".encode())
    return "f" + ident.hexdigest()[:31]


class Keys:
    """One store's keys: verified content, the claims each label stands for, and the
    digests this process computed. See the module doc for the rules."""

    def __init__(self) -> None:
        self._canon: dict[str, str] = {}  # verified content -> the key it is served under
        self._claims: dict[str, str] = {}  # content label -> the files (identity key) it keys
        self._contested: set[str] = set()  # contents two sets of files claim
        self._hashed: dict[FileIdentity, str] = {}  # data digests computed by this process

    def digest(self, identity: FileIdentity | None, index) -> str | None:
        """A file's data digest: as this process hashed it, else the index's claim."""
        if identity is None:
            return None
        return self._hashed.get(identity) or index.get(identity)

    def verified(self, ckpt: Checkpoint) -> bool:
        """Whether this process hashed every file of ``ckpt`` as it is now."""
        return all(f.identity is not None and f.identity in self._hashed for f in ckpt.files)

    def hashed(self, identity: FileIdentity, digest: str) -> None:
        """Record a digest computed from the bytes of the file with this identity."""
        self._hashed[identity] = digest

    def files(self, content: str) -> str:
        """The key of a files component (tokenizer, scheduler): read whole at scan time,
        its content is verified."""
        return self._canon.setdefault(content, content)

    def weights(self, content: str, files: str, *, verified: bool) -> str:
        """The key of a weights component whose data digests (hashed here, or claimed) are
        all known, making ``content`` (``files``: its identity key): ``files`` where a
        claim must be proven by a read first (another set of files claims it too)."""
        if verified:
            key = self._canon.get(content)
            if key is None:
                # Verified, but the content's label may key another set of files on an
                # unproven claim: then this one keeps to its own files until that is settled.
                key = content if self._claims.setdefault(content, files) == files else files
                if key == files:
                    self._contested.add(content)
                self._canon[content] = key
            return key
        if content not in self._canon and self._claims.setdefault(content, files) == files:
            return content
        self._contested.add(content)
        return files

    def must_hash(self, content: str | None, ckpt: Checkpoint) -> bool:
        """Whether a read from disk of a component with this content (``None``: unknown)
        must hash its bytes: unknown, or claimed against another claim and unproven."""
        if content is None:
            return True
        return content in self._contested and not self.verified(ckpt)

    def learned(self, content: str, key: str) -> str:
        """The key ``content``, just verified in a component served under ``key``, is
        served under from now on: ``key``, or the one it was verified under before."""
        return self._canon.setdefault(content, key)
