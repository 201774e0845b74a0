"""The video job index: pages, monotone progress, the byte cap, restarts, and many threads."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from contextlib import closing

import pytest

from nostall.errors import ArgumentError, ClosedError, SinkError
from nostall.serve import video_store
from nostall.serve.video_store import DB_NAME, VideoStore, as_openai


def _job(store: VideoStore, prompt: str = "a red fox", **params) -> str:
    return store.create("wan", prompt, size="832x480", seconds="4", params=params)["id"]


def _finish(store: VideoStore, job_id: str, nbytes: int = 100, **info) -> None:
    """Run a job to completion with an output of ``nbytes`` bytes, as the worker would."""
    store.start(job_id)
    with open(store.path(job_id), "wb") as f:
        f.write(b"\0" * nbytes)
    assert store.complete(job_id, info=info)


@pytest.fixture
def store(tmp_path):
    with VideoStore(tmp_path / "videos") as s:
        yield s


def test_a_new_job_is_queued_and_shown_as_openai_shows_one(store):
    job = store.create("wan", "a red fox", size="832x480", seconds="4", params={"steps": 30})
    assert job["id"].startswith("video_") and len(job["id"]) == 38
    assert job["status"] == "queued" and job["progress"] == 0 and job["bytes"] == 0
    assert job["params"] == {"steps": 30} and job["info"] == {} and job["error"] is None
    assert isinstance(job["created_at"], int) and job["completed_at"] is None
    assert store.get(job["id"]) == job
    assert store.get("video_" + "0" * 32) is None and store.get("nonsense") is None
    shown = as_openai(job)
    assert set(shown) == {
        "id", "object", "model", "status", "progress", "created_at", "completed_at",
        "expires_at", "prompt", "size", "seconds", "error", "remixed_from_video_id", "nostall",
    }  # fmt: skip
    assert shown["object"] == "video" and shown["seconds"] == "4" and shown["size"] == "832x480"
    assert shown["expires_at"] is None and shown["nostall"] == {"params": {"steps": 30}, "info": {}}
    assert store.path(job["id"]) == os.path.join(store.folder, job["id"] + ".mp4")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model": ""}, "model"),
        ({"prompt": None}, "prompt"),
        ({"size": "832"}, "size"),
        ({"size": "0x480"}, "size"),
        ({"size": 832}, "size"),
        ({"seconds": 4}, "seconds"),
        ({"seconds": "four"}, "seconds"),
        ({"params": [1, 2]}, "params"),
        ({"params": {"guidance": float("nan")}}, "params"),
        ({"params": {"x": object()}}, "params"),
    ],
)
def test_a_bad_job_is_refused_naming_its_field(store, change, field):
    kw = {"model": "wan", "prompt": "p", "size": "832x480", "seconds": "4", "params": {}} | change
    with pytest.raises(ArgumentError) as e:
        store.create(kw.pop("model"), kw.pop("prompt"), **kw)
    assert e.value.field == field
    assert store.counts()["queued"] == 0


def test_list_pages_in_creation_order_both_ways(store, monkeypatch):
    monkeypatch.setattr(video_store, "_now", lambda: 1_800_000_000.0)  # every created_at ties
    ids = [_job(store, f"p{i}") for i in range(7)]
    pages, after = [], None
    while True:
        items, more = store.list(after=after, limit=3, order="asc")
        pages.append(([j["id"] for j in items], more))
        if not more:
            break
        after = items[-1]["id"]
    assert pages == [(ids[0:3], True), (ids[3:6], True), (ids[6:], False)]
    items, more = store.list(limit=4)  # newest first by default
    assert [j["id"] for j in items] == ids[::-1][:4] and more
    items, more = store.list(after=items[-1]["id"], limit=4)
    assert [j["id"] for j in items] == ids[::-1][4:] and not more
    assert store.list(after=ids[0], order="desc") == ([], False)
    assert [j["id"] for j in store.list(limit=100, order="asc")[0]] == ids


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"limit": True}, "limit"),
        ({"limit": "5"}, "limit"),
        ({"order": "newest"}, "order"),
        ({"after": "video_" + "f" * 32}, "after"),
    ],
)
def test_list_refuses_bad_arguments_naming_them(store, kw, field):
    _job(store)
    with pytest.raises(ArgumentError) as e:
        store.list(**kw)
    assert e.value.field == field


def test_progress_only_rises_stays_below_100_and_stops_a_cancelled_job(store):
    a = _job(store)
    assert not store.progress(a, 30) and store.get(a)["progress"] == 0  # not started yet
    assert store.start(a) and not store.start(a)
    assert store.get(a)["status"] == "in_progress" and store.get(a)["started_at"] is not None
    assert store.progress(a, 40) and store.get(a)["progress"] == 40
    assert store.progress(a, 20) and store.get(a)["progress"] == 40  # never backwards
    assert store.progress(a, 150) and store.get(a)["progress"] == 99  # 100 is complete()'s
    assert store.progress(a, -5) and store.get(a)["progress"] == 99
    with pytest.raises(ArgumentError) as e:
        store.progress(a, "half")
    assert e.value.field == "progress"
    assert store.cancel(a) and not store.cancel(a)
    assert not store.progress(a, 99)  # the worker's cue to stop
    job = store.get(a)
    assert job["status"] == "cancelled" and job["progress"] == 99 and job["completed_at"]
    assert not store.fail(a, "x", "y") and store.get(a)["error"] is None


def test_complete_records_the_output_and_its_info(store):
    a = _job(store)
    store.start(a)
    with pytest.raises(SinkError) as e:  # the writer has not renamed its file into place
        store.complete(a)
    assert e.value.path == store.path(a) and store.get(a)["status"] == "in_progress"
    _finish(store, a, 1234, frames=17)
    job = store.get(a)
    assert job["status"] == "completed" and job["progress"] == 100 and job["bytes"] == 1234
    assert job["info"] == {"frames": 17} and job["completed_at"] >= job["created_at"]
    assert store.counts() == {
        "queued": 0, "in_progress": 0, "completed": 1, "failed": 0, "cancelled": 0, "bytes": 1234
    }  # fmt: skip
    assert not store.complete(a) and store.get(a)["status"] == "completed"
    assert os.path.exists(store.path(a))  # a second complete() keeps the output


def test_complete_refuses_an_output_that_is_not_a_file(store):
    """A folder under the job's name (PNG frames went there, not an MP4) is no output:
    refused naming it, the job still running (the worker then fails it), the folder kept."""
    a = _job(store)
    store.start(a)
    os.mkdir(store.path(a))
    with pytest.raises(SinkError, match="is not a file") as e:
        store.complete(a)
    assert e.value.path == store.path(a) and store.get(a)["status"] == "in_progress"
    assert os.path.isdir(store.path(a))


def test_a_poll_reads_one_row_by_index_however_many_jobs_there_are(store):
    """What GET /v1/videos/{id} and a list page cost: the statements get() and list()
    run search the id's unique index or walk the creation index for one page; none scans
    the table or sorts it (no work that grows with the jobs kept)."""
    ids = [_job(store, f"p{i}") for i in range(50)]
    ran: list[str] = []
    store._db.set_trace_callback(ran.append)  # (the statements, as sqlite runs them)
    try:
        store.get(ids[10])
        store.list(limit=10)
        store.list(after=ids[20], limit=10, order="asc")
    finally:
        store._db.set_trace_callback(None)
    assert ran
    with closing(sqlite3.connect(store.db_path)) as db:
        for sql in ran:
            plan = " | ".join(row[-1] for row in db.execute(f"EXPLAIN QUERY PLAN {sql}"))
            assert "TEMP B-TREE" not in plan, (sql, plan)
            for step in plan.split(" | "):
                assert not step.startswith("SCAN") or "USING" in step, (sql, plan)


def test_a_job_cancelled_while_it_ran_keeps_no_output(store):
    a = _job(store)
    store.start(a)
    assert store.cancel(a)
    with open(store.path(a), "wb") as f:
        f.write(b"late")
    assert not store.complete(a)
    assert store.get(a)["status"] == "cancelled" and not os.path.exists(store.path(a))


def test_fail_records_code_and_message(store):
    a = _job(store)
    assert store.fail(a, "out_of_memory", "the device ran out of memory")
    job = store.get(a)
    assert job["status"] == "failed"
    assert job["error"] == {"code": "out_of_memory", "message": "the device ran out of memory"}
    assert as_openai(job)["error"] == job["error"]


def test_the_cap_removes_the_oldest_completed_first_and_keeps_the_newest(tmp_path, caplog):
    with VideoStore(tmp_path, max_bytes=250) as store:
        a, b, c, d = (_job(store, p) for p in "abcd")
        _finish(store, b)  # b completes before a, though created after it
        _finish(store, a)
        assert store.counts()["bytes"] == 200
        _finish(store, c)  # 300 > 250: the oldest completed (b) goes
        assert store.get(b) is None and not os.path.exists(store.path(b))
        assert store.get(a)["status"] == store.get(c)["status"] == "completed"
        assert store.counts()["bytes"] == 200
        with caplog.at_level(logging.WARNING, logger="nostall.serve.video_store"):
            _finish(store, d, 1000)  # alone above the cap: kept, said
        assert store.get(a) is None and store.get(c) is None
        assert store.get(d)["bytes"] == 1000 and os.path.exists(store.path(d))
        assert store.counts()["completed"] == 1 and store.counts()["bytes"] == 1000
        assert any("max_bytes=250" in r.getMessage() for r in caplog.records)


def test_delete_refuses_a_live_job_and_removes_a_finished_ones_file(store):
    a, b = _job(store), _job(store)
    for _ in range(2):  # queued, then in progress
        with pytest.raises(ArgumentError) as e:
            store.delete(a)
        assert e.value.field == "id" and "cancel it first" in str(e.value)
        store.start(a)
    assert store.get(a)["status"] == "in_progress"
    assert store.cancel(a) and store.delete(a) and store.get(a) is None
    _finish(store, b)
    assert os.path.exists(store.path(b))
    assert store.delete(b) and store.get(b) is None and not os.path.exists(store.path(b))
    assert not store.delete(b) and not store.delete("video_" + "1" * 32)
    assert store.counts()["completed"] == 0 and store.list() == ([], False)


def test_a_restart_fails_unfinished_jobs_and_removes_their_temporaries(tmp_path, caplog):
    with VideoStore(tmp_path) as store:
        queued, running, done = _job(store), _job(store), _job(store)
        store.start(running)
        store.progress(running, 30)
        _finish(store, done, 10)
    temps = [tmp_path / f".{running}.mp4.1a2b3c4d.partial", tmp_path / f"{queued}.mp4.partial"]
    for t in temps:
        t.write_bytes(b"half")
    (tmp_path / "mine.mp4").write_bytes(b"not ours")
    with caplog.at_level(logging.WARNING, logger="nostall.serve.video_store"):
        store = VideoStore(tmp_path)
    with store:
        for job_id in (queued, running):
            job = store.get(job_id)
            assert job["status"] == "failed" and job["error"]["code"] == "interrupted"
            assert "submit it again" in job["error"]["message"]
        assert store.get(running)["progress"] == 30
        assert not any(t.exists() for t in temps)
        assert store.get(done)["status"] == "completed" and os.path.exists(store.path(done))
        assert [j["id"] for j in store.list(order="asc")[0]] == [queued, running, done]
    assert (
        tmp_path / "mine.mp4"
    ).read_bytes() == b"not ours"  # never removed what it did not write
    strays = [r.getMessage() for r in caplog.records if "mine.mp4" in r.getMessage()]
    assert len(strays) == 1 and done not in strays[0]  # its own outputs are not strays


def test_a_completed_job_whose_file_vanished_fails_as_output_missing(tmp_path):
    with VideoStore(tmp_path) as store:
        a, b = _job(store), _job(store)
        _finish(store, a)
        _finish(store, b)
    os.remove(os.path.join(tmp_path, f"{a}.mp4"))
    with VideoStore(tmp_path) as store:
        job = store.get(a)
        assert job["status"] == "failed" and job["error"]["code"] == "output_missing"
        assert job["bytes"] == 0 and store.get(b)["status"] == "completed"
        assert store.counts()["bytes"] == 100


def _newer(path):
    with closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA user_version = 99")


def _foreign(path):
    with closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE notes (text TEXT)")
        db.commit()


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda p: p.write_bytes(b"this is not a database" * 100), "not a database"),
        (_newer, "newer nostall"),
        (_foreign, "not a nostall video index"),
        (lambda p: p.mkdir(), "cannot be opened"),
    ],
)
def test_a_database_it_cannot_use_is_refused_naming_it(tmp_path, make, said):
    path = tmp_path / DB_NAME
    make(path)
    before = path.read_bytes() if path.is_file() else None
    with pytest.raises(ArgumentError) as e:
        VideoStore(tmp_path)
    assert e.value.field == "video_dir"
    assert str(path) in str(e.value) and said in str(e.value) and "--video-dir" in str(e.value)
    assert before is None or path.read_bytes() == before  # left as it was


def test_the_schema_version_is_recorded(tmp_path):
    VideoStore(tmp_path).close()
    with closing(sqlite3.connect(tmp_path / DB_NAME)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 1
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_folder_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    for folder in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(ArgumentError) as e:
            VideoStore(folder)
        assert e.value.field == "video_dir" and str(folder) in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_folder_it_cannot_write_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(ArgumentError) as e:
            VideoStore(folder)
        assert "cannot be written" in str(e.value) and str(folder) in str(e.value)
    finally:
        folder.chmod(0o700)


def test_bad_options_and_use_after_close_are_refused(tmp_path):
    for bad in (-1, 1.5, True):
        with pytest.raises(ArgumentError) as e:
            VideoStore(tmp_path, max_bytes=bad)
        assert e.value.field == "max_bytes"
    store = VideoStore(tmp_path)
    with pytest.raises(ArgumentError):
        store.path("../../etc/passwd")
    with pytest.raises(ArgumentError):
        store.path("video_" + "G" * 32)
    store.close()
    store.close()  # twice is fine
    for call in (lambda: store.get("x"), lambda: _job(store), store.counts, store.list):
        with pytest.raises(ClosedError):
            call()


def test_many_threads_at_once_lose_nothing(store):
    running = [_job(store) for _ in range(8)]
    for job_id in running:
        store.start(job_id)
    made: list[str] = []
    errors: list[BaseException] = []
    writing = threading.Barrier(8 + 2)
    done = threading.Event()

    def worker(job_id: str) -> None:
        try:
            writing.wait()
            for p in range(1, 501):  # 50 show the rule; 500 make an unlocked race near certain
                assert store.progress(job_id, p // 10)
                if p % 100 == 0:
                    made.append(_job(store))
        except BaseException as e:
            errors.append(e)

    def reader() -> None:
        try:
            writing.wait()
            while not done.is_set():
                items, _ = store.list(limit=100)
                assert all(store.get(j["id"]) is not None for j in items[:5])
                assert store.counts()["in_progress"] == 8
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=worker, args=(j,)) for j in running]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in workers + readers:
        t.start()
    for t in workers:
        t.join()
    done.set()
    for t in readers:
        t.join()
    assert errors == []
    assert [store.get(j)["progress"] for j in running] == [50] * 8
    listed = {j["id"] for j in store.list(limit=100)[0]}
    assert len(made) == 40 and listed == set(running) | set(made)


def test_one_worker_per_folder_and_the_folder_is_free_again_after_close(tmp_path):
    first = VideoStore(tmp_path)
    with pytest.raises(ArgumentError, match=r"another worker \(pid \d+\) keeps its videos"):
        VideoStore(tmp_path)
    first.close()
    VideoStore(tmp_path).close()
