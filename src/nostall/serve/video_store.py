"""The persisted index of video generation jobs, beside the folder of their outputs.

:class:`VideoStore` keeps one row per job of the OpenAI-Videos-shaped endpoint
(``POST /v1/videos`` and its fellows) in ``<folder>/videos.sqlite`` and names each job's
output ``<folder>/<id>.mp4``. HTTP handlers read it while the worker thread moves jobs
along; every call is safe from any thread::

    queued ──start──▶ in_progress ──complete──▶ completed
      │                   └─────────fail──────▶ failed
      └─────cancel (either)────────────────────▶ cancelled

``complete`` and ``fail`` also take a job still ``queued``. A worker call on a job that
was cancelled meanwhile changes nothing and returns ``False``: the worker's cue to stop.

One process owns a folder at a time. Opening it recovers from the last one's end: jobs
it left queued or running fail as ``"interrupted"``, a completed job whose file is gone
fails as ``"output_missing"``, and temporaries (``*.partial``) of jobs that did not
complete are removed. ``.mp4`` files no row names are never removed, only logged. With
``max_bytes``, each completion removes the oldest completed jobs, rows and files, until
the outputs fit. Times are unix seconds: whole seconds out, microseconds inside (order).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import threading
import time
import uuid
from typing import Any

from nostall.errors import ArgumentError, ClosedError, SinkError

__all__ = ["DB_NAME", "SCHEMA", "STATUSES", "VideoStore", "as_openai"]

log = logging.getLogger(__name__)

DB_NAME = "videos.sqlite"
SCHEMA = 1  # PRAGMA user_version of the files this module writes
STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
_OPEN = "IN ('queued', 'in_progress')"
# seq: creation order, to break ties of created_at; completed_at: when the job ended (any
# end); params, error, info: JSON (error NULL or {"code", "message"}).
_COLUMNS = (
    "seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, model TEXT NOT NULL, prompt TEXT NOT NULL,"
    " status TEXT NOT NULL, progress INTEGER NOT NULL, created_at REAL NOT NULL, started_at REAL,"
    " completed_at REAL, size TEXT NOT NULL, seconds TEXT NOT NULL, params TEXT NOT NULL,"
    " error TEXT, bytes INTEGER NOT NULL, info TEXT NOT NULL"
)
_NAMES = [c.split()[0] for c in _COLUMNS.split(", ")]
_SELECT = f"SELECT {', '.join(_NAMES)} FROM videos"
_FIX = "move it away or give another video folder (--video-dir)"
_RESTARTED = "the server restarted before this job finished; submit it again"
_now = time.time  # one clock for every timestamp (tests stop it to make ties)


class VideoStore:
    """Video jobs and their outputs in ``folder`` (created if missing); ``max_bytes``
    caps the completed outputs' bytes (``None``: no cap).

    Rows come back as dicts: ``id`` (``"video_"`` and 32 hex digits), ``model``,
    ``prompt``, ``status`` (one of :data:`STATUSES`), ``progress`` (0..100),
    ``created_at``, ``started_at``, ``completed_at`` (unix seconds or ``None``), ``size``
    (``"WxH"``), ``seconds`` (a string, as OpenAI gives it), ``params`` and ``info``
    (dicts), ``error`` (``None`` or ``{"code", "message"}``) and ``bytes`` (the output's
    size, 0 until completed). :class:`~nostall.ArgumentError` (``field="video_dir"``)
    for a folder that cannot be written or a database it cannot use;
    :class:`~nostall.errors.ClosedError` after :meth:`close`.

    >>> import pathlib, tempfile
    >>> with tempfile.TemporaryDirectory() as tmp, VideoStore(tmp) as store:
    ...     job = store.create("wan", "a red fox", size="832x480", seconds="4",
    ...                        params={"steps": 30})
    ...     store.start(job["id"]), store.progress(job["id"], 40)
    ...     pathlib.Path(store.path(job["id"])).write_bytes(b"mp4")  # the writer's output
    ...     store.complete(job["id"], info={"frames": 65})
    ...     store.get(job["id"])["status"], store.counts()["bytes"]
    (True, True)
    3
    True
    ('completed', 3)
    """

    def __init__(self, folder: str | os.PathLike, *, max_bytes: int | None = None):
        if max_bytes is not None and (not _whole(max_bytes) or max_bytes < 0):
            why = f"max_bytes={max_bytes!r}: give bytes >= 0, or None (no cap)"
            raise ArgumentError(why, field="max_bytes", allowed=">= 0 or None")
        self.folder = os.path.abspath(os.fspath(folder))
        self.db_path = os.path.join(self.folder, DB_NAME)
        self.max_bytes = max_bytes
        # One connection for every thread, each use under this lock: sqlite3 objects are
        # not safe to use from two threads at once. Every statement is short (no file I/O
        # but unlinks), so HTTP polls wait at most for one worker update.
        self._lock = threading.Lock()
        self._writable()
        self._held = self._hold()
        try:
            self._db: sqlite3.Connection | None = self._connect()
        except BaseException:
            self._held.close()
            raise
        try:
            with self._lock:
                self._recover()
        except BaseException:
            self.close()
            raise

    # ---- jobs ------------------------------------------------------------------------

    def create(
        self, model: str, prompt: str, *, size: str, seconds: str, params: dict | None = None
    ) -> dict[str, Any]:
        """A new ``queued`` job (its row)."""
        for name, value in (("model", model), ("prompt", prompt)):
            if not isinstance(value, str) or (name == "model" and not value):
                raise ArgumentError(f"{name}={value!r}: give a string", field=name)
        w, x, h = size.partition("x") if isinstance(size, str) else ("", "", "")
        if not (x and w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0):
            raise ArgumentError(f"size={size!r}: give e.g. '832x480'", field="size", allowed="WxH")
        if not (isinstance(seconds, str) and _positive(seconds)):
            why = f"seconds={seconds!r}: give a positive number as a string, e.g. '4'"
            raise ArgumentError(why, field="seconds")
        job = (f"video_{uuid.uuid4().hex}", model, prompt, _now(), size, seconds)
        with self._lock:
            db = self._live()
            with db:
                db.execute(
                    "INSERT INTO videos (id, model, prompt, created_at, size, seconds, params,"
                    " status, progress, bytes, info) VALUES (?, ?, ?, ?, ?, ?, ?, 'queued', 0, 0,"
                    " '{}')",
                    (*job, _dumps("params", {} if params is None else params)),
                )
            return self._get(job[0])

    def get(self, job_id: str) -> dict[str, Any] | None:
        """The job's row, or ``None`` when there is no such job."""
        with self._lock:
            return self._get(job_id)

    def start(self, job_id: str) -> bool:
        """``queued`` → ``in_progress``; ``False`` (nothing changed) for any other job."""
        sets = "status = 'in_progress', started_at = ?"
        return self._update(job_id, sets, (_now(),), "= 'queued'")

    def progress(self, job_id: str, percent: float) -> bool:
        """Raise a running job's progress to ``percent``, held to 0..99 (100 is
        :meth:`complete`'s) and never lowered. ``False`` when the job is not running
        (cancelled, or never started): the worker should stop."""
        try:
            p = max(0, min(99, int(percent)))
        except (TypeError, ValueError, OverflowError):
            raise ArgumentError(f"percent={percent!r}: give 0..100", field="progress") from None
        return self._update(job_id, "progress = max(progress, ?)", (p,), "= 'in_progress'")

    def complete(self, job_id: str, *, info: dict | None = None) -> bool:
        """Mark the job ``completed`` with its output :meth:`path` (which must be a file
        by now: :class:`~nostall.SinkError` otherwise), progress 100 and ``info``; then keep
        the outputs within ``max_bytes``. ``False`` for a job cancelled or gone
        meanwhile, whose output is removed: nobody will ask for it."""
        text, out = _dumps("info", {} if info is None else info), self.path(job_id)
        with self._lock:
            db = self._live()
            row = db.execute("SELECT status FROM videos WHERE id = ?", (job_id,)).fetchone()
            if row is None or row[0] not in ("queued", "in_progress"):
                if row is None or row[0] != "completed":
                    _remove(out)
                return False
            try:
                st = os.stat(out)
            except OSError as e:
                raise SinkError(
                    f"video {job_id} has no output ({e.strerror}): the writer must rename it "
                    "into place before complete()",
                    path=out,
                ) from e
            if not stat.S_ISREG(st.st_mode):  # (a folder there took PNG frames, not an MP4)
                raise SinkError(
                    f"video {job_id}'s output is not a file (mode {stat.filemode(st.st_mode)}); "
                    "remove what is there, then submit the job again",
                    path=out,
                )
            nbytes = st.st_size
            with db:
                db.execute(
                    "UPDATE videos SET status = 'completed', progress = 100, completed_at = ?,"
                    " bytes = ?, info = ? WHERE id = ?",
                    (_now(), nbytes, text, job_id),
                )
            self._cap(keep=job_id)
            return True

    def fail(self, job_id: str, code: str, message: str) -> bool:
        """Mark a queued or running job ``failed`` with ``{"code", "message"}``."""
        error = _dumps("error", {"code": str(code), "message": str(message)})
        sets = "status = 'failed', error = ?, completed_at = ?"
        return self._update(job_id, sets, (error, _now()), _OPEN)

    def cancel(self, job_id: str) -> bool:
        """Mark a queued or running job ``cancelled``; whether it changed. A running job's
        worker learns it from :meth:`progress` returning ``False``."""
        return self._update(job_id, "status = 'cancelled', completed_at = ?", (_now(),), _OPEN)

    def delete(self, job_id: str) -> bool:
        """Remove a finished job's row and output; ``False`` when there is no such job.
        A queued or running job is refused (:class:`~nostall.ArgumentError`,
        ``field="id"``): :meth:`cancel` it first."""
        with self._lock:
            db = self._live()
            row = db.execute("SELECT status FROM videos WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return False
            if row[0] in ("queued", "in_progress"):
                why = f"video {job_id} is {row[0]}: cancel it first, then delete it"
                raise ArgumentError(why, field="id", allowed="a finished or cancelled video")
            out = self.path(job_id)
            failed = _remove(out)
            if failed is not None:
                raise SinkError(f"cannot remove it ({failed}); the job is kept", path=out)
            with db:
                db.execute("DELETE FROM videos WHERE id = ?", (job_id,))
            return True

    def list(
        self, *, after: str | None = None, limit: int = 20, order: str = "desc"
    ) -> tuple[list[dict[str, Any]], bool]:
        """``(jobs, has_more)``: up to ``limit`` (1..100) jobs by creation, oldest first
        (``order="asc"``) or newest first (``"desc"``), starting after the job ``after``
        (the last id of the previous page), as OpenAI's cursor pagination does."""
        if order not in ("asc", "desc"):
            raise ArgumentError(f"order={order!r}", field="order", allowed=["asc", "desc"])
        if not _whole(limit) or not 1 <= limit <= 100:
            raise ArgumentError(f"limit={limit!r}: give 1..100", field="limit", allowed="1..100")
        way, op = ("ASC", ">") if order == "asc" else ("DESC", "<")
        with self._lock:
            db, where, key = self._live(), "", ()
            if after is not None:
                key = db.execute("SELECT created_at, seq FROM videos WHERE id = ?", (str(after),))
                key = key.fetchone()
                if key is None:
                    why = f"after={after!r}: no such video; give the last id of the previous page"
                    raise ArgumentError(why, field="after")
                where = f"WHERE (created_at, seq) {op} (?, ?)"
            rows = db.execute(
                f"{_SELECT} {where} ORDER BY created_at {way}, seq {way} LIMIT ?",
                (*key, limit + 1),
            ).fetchall()
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    def path(self, job_id: str) -> str:
        """Where the job's output lives once complete (the writer writes a temporary
        beside it and renames it there). :class:`~nostall.ArgumentError` for a string
        that is not a video id, so no request can name a path outside the folder."""
        if not _is_id(job_id):
            raise ArgumentError(
                f"{job_id!r} is not a video id", field="id", allowed="video_<32 hex>"
            )
        return os.path.join(self.folder, f"{job_id}.mp4")

    def counts(self) -> dict[str, int]:
        """Jobs per status (every one of :data:`STATUSES`) and ``bytes``, the completed
        outputs' total."""
        with self._lock:
            rows = self._live().execute(
                "SELECT status, count(*), sum(bytes) FROM videos GROUP BY status"
            )
            out = dict.fromkeys((*STATUSES, "bytes"), 0)
            for status, n, nbytes in rows:
                out[status] = n
                out["bytes"] += nbytes if status == "completed" else 0
        return out

    def close(self) -> None:
        """Close the database; further calls raise :class:`~nostall.errors.ClosedError`."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
                self._held.close()  # (closing the file lets the folder's lock go)

    def __enter__(self) -> VideoStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- inside ----------------------------------------------------------------------

    def _live(self) -> sqlite3.Connection:
        if self._db is None:
            raise ClosedError(f"video store {self.folder} was used after close()")
        return self._db

    def _get(self, job_id: str) -> dict[str, Any] | None:
        row = self._live().execute(f"{_SELECT} WHERE id = ?", (str(job_id),)).fetchone()
        return None if row is None else _job(row)

    def _update(self, job_id: str, sets: str, args: tuple, status: str) -> bool:
        with self._lock:
            db = self._live()
            with db:
                cur = db.execute(
                    f"UPDATE videos SET {sets} WHERE id = ? AND status {status}",
                    (*args, str(job_id)),
                )
            return cur.rowcount == 1

    def _hold(self) -> Any:
        """The folder's lock, held while this store is open: one worker per folder (a
        second one's recovery would mark the first's running jobs interrupted)."""
        import fcntl

        f = open(os.path.join(self.folder, ".lock"), "a+")  # noqa: SIM115 (held open)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            who = f.read().strip() or "?"
            f.close()
            raise self._refuse(
                self.folder,
                f"another worker (pid {who}) keeps its videos here",
                "give each worker its own video folder (--video-dir)",
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        return f

    def _refuse(self, where: str, why: str, fix: str = _FIX) -> ArgumentError:
        return ArgumentError(
            f"{where}: {why}; {fix}", field="video_dir", allowed="a writable folder of videos"
        )

    def _writable(self) -> None:
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise self._refuse(
                self.folder, "is a file, not a folder", "give a folder (--video-dir)"
            )
        try:
            os.makedirs(self.folder, exist_ok=True)
            # A file made and removed, not os.access: ACLs, read-only mounts and network
            # file systems can each make access() answer yes to a folder that refuses.
            probe = os.path.join(self.folder, f".write-test-{uuid.uuid4().hex}")
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.remove(probe)
        except OSError as e:
            why = f"cannot be written ({e.strerror or e})"
            raise self._refuse(self.folder, why, "give a writable folder (--video-dir)") from e

    def _connect(self) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(self.db_path, timeout=10, check_same_thread=False)
        except sqlite3.Error as e:
            raise self._refuse(self.db_path, f"cannot be opened ({e})") from e
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = sorted(r[0] for r in db.execute("SELECT name FROM sqlite_master"))
            if version > SCHEMA:
                why = f"was written by a newer nostall (schema {version}; this one reads {SCHEMA})"
                raise self._refuse(self.db_path, why, f"upgrade nostall, or {_FIX}")
            columns = [r[1] for r in db.execute("PRAGMA table_info(videos)")]
            if (version or tables) and (version, columns) != (SCHEMA, _NAMES):
                why = f"is not a nostall video index (schema {version}, tables {tables})"
                raise self._refuse(self.db_path, why)  # before a byte of it is changed
            # WAL: readers in other processes (a status page) never wait for the writer, and
            # with synchronous=NORMAL a commit (each progress update) does not wait for fsync;
            # a crash loses at most the last commits, never the file.
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            if not version:
                with db:
                    db.execute(f"CREATE TABLE videos ({_COLUMNS})")
                    db.execute("CREATE INDEX videos_created ON videos (created_at, seq)")
                    db.execute(f"PRAGMA user_version = {SCHEMA}")
        except sqlite3.DatabaseError as e:
            db.close()
            raise self._refuse(self.db_path, f"is not a database nostall can use ({e})") from e
        except BaseException:
            db.close()
            raise
        return db

    def _recover(self) -> None:
        """Undo what the last process left (the lock is held)."""
        db, now = self._live(), _now()
        error = _dumps("error", {"code": "interrupted", "message": _RESTARTED})
        with db:
            cur = db.execute(
                f"UPDATE videos SET status = 'failed', error = ?, completed_at = ?"
                f" WHERE status {_OPEN}",
                (error, now),
            )
        if cur.rowcount:
            log.warning("%s: %d unfinished job(s) failed as interrupted", self.folder, cur.rowcount)
        names = set(os.listdir(self.folder))
        status = dict(db.execute("SELECT id, status FROM videos"))
        for job_id in [j for j, s in status.items() if s == "completed"]:
            if f"{job_id}.mp4" not in names:
                why = f"its output {self.path(job_id)} was removed; submit the job again"
                with db:
                    db.execute(
                        "UPDATE videos SET status = 'failed', error = ?, bytes = 0 WHERE id = ?",
                        (_dumps("error", {"code": "output_missing", "message": why}), job_id),
                    )
                status[job_id] = "failed"
        strays = []
        for name in sorted(names):
            # The writer's temporaries: `.<id>.mp4.<random>.partial` (video/sinks.py) or
            # `<id>.mp4.partial`.
            job_id = name.lstrip(".").split(".", 1)[0]
            if ".partial" in name and status.get(job_id) not in (None, "completed"):
                failed = _remove(os.path.join(self.folder, name))
                if failed is not None:
                    log.warning("%s: cannot remove %s (%s)", self.folder, name, failed)
            elif name.endswith(".mp4") and name[: -len(".mp4")] not in status:
                strays.append(name)
        if strays:  # said once per open, the first few named
            few = ", ".join(strays[:5]) + (", ..." if len(strays) > 5 else "")
            why = "left alone: nostall removes only its own outputs"
            log.warning(
                "%s: %d .mp4 file(s) no job names (%s): %s", self.folder, len(strays), why, few
            )
        self._cap(keep=None)

    def _cap(self, *, keep: str | None) -> None:
        """Remove the oldest completed jobs until their outputs fit ``max_bytes``, never
        ``keep`` (default: the newest); the lock is held."""
        if self.max_bytes is None:
            return
        db = self._live()
        rows = db.execute(
            "SELECT id, bytes FROM videos WHERE status = 'completed' ORDER BY completed_at, seq"
        ).fetchall()
        if not rows:
            return
        keep = rows[-1][0] if keep is None else keep
        total = sum(nbytes for _, nbytes in rows)
        for job_id, nbytes in rows:
            if total <= self.max_bytes:
                break
            if job_id == keep:
                continue
            # A handler streaming this file keeps reading it: POSIX frees an unlinked
            # file's bytes only when its last descriptor closes.
            failed = _remove(self.path(job_id))
            if failed is not None:
                log.warning(
                    "%s: cannot remove %s to fit max_bytes (%s)", self.folder, job_id, failed
                )
                continue
            with db:
                db.execute("DELETE FROM videos WHERE id = ?", (job_id,))
            total -= nbytes
            log.info("%s: removed %s (%d bytes) to fit max_bytes", self.folder, job_id, nbytes)
        if total > self.max_bytes:
            why = f"{total} bytes of outputs, above max_bytes={self.max_bytes}"
            log.warning("%s: %s: the newest, %s, is kept", self.folder, why, keep)


def as_openai(job: dict[str, Any]) -> dict[str, Any]:
    """A row as the OpenAI API's Video object, with nostall's ``params`` and ``info``
    under ``"nostall"``. Nothing expires by time here (``expires_at`` is ``None``)."""
    out = {"id": job["id"], "object": "video"}
    for k in ("model", "status", "progress", "created_at", "completed_at", "prompt", "size"):
        out[k] = job[k]
    out.update(seconds=job["seconds"], error=job["error"], expires_at=None)
    out.update(remixed_from_video_id=None, nostall={"params": job["params"], "info": job["info"]})
    return out


def _job(row: tuple) -> dict[str, Any]:
    job = dict(zip(_NAMES, row, strict=True))
    del job["seq"]
    for k in ("created_at", "started_at", "completed_at"):
        job[k] = None if job[k] is None else int(job[k])
    for k in ("params", "error", "info"):
        job[k] = None if job[k] is None else json.loads(job[k])
    return job


def _dumps(name: str, value: Any) -> str:
    try:
        if not isinstance(value, dict):
            raise TypeError(f"a {type(value).__name__}, not a dict")
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"{name}: give a JSON object ({e})", field=name) from None


def _remove(path: str) -> OSError | None:
    """Remove ``path`` if it is there; the error when it cannot be removed."""
    try:
        os.remove(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return e
    return None


def _is_id(value: object) -> bool:
    hexes = value[6:] if isinstance(value, str) and value[:6] == "video_" else ""
    return len(hexes) == 32 and set(hexes) <= set("0123456789abcdef")


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(text: str) -> bool:
    try:
        return 0 < float(text) < float("inf")
    except ValueError:
        return False
