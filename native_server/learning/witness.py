"""The witness log: every request and its response as JSON lines, rotated by size, bounded on disk.

`ruvllm serve --witness-log DIR` writes two streams of files into DIR:

    witness-000001.jsonl    one line per finished request (type "completion")
    feedback-000001.jsonl   one line per accepted POST /v1/feedback (type "feedback"), the
                            completion it rates copied in, so replaying it needs no join

A stream moves to its next file once the current one passes `max_file_bytes`
and deletes its oldest beyond `max_files`, so the log never holds more than
about `max_files * max_file_bytes` per stream. A completion line holds what
the server made of the request (ids, texts, sampling parameters, timings),
never the request's headers: neither the API key nor anything else a client
sends beside the body is ever handed to this module.

Lines are written by one thread from a bounded queue, so a slow disk never
stalls the event loop; when the queue is full a record is dropped and counted
(`dropped`), and serving goes on. `lookup(id)` finds a logged completion (for
feedback) by an in-memory index of where each line lies, rebuilt from the
files at start-up and capped at `max_index` ids.
"""
from __future__ import annotations

import json
import logging
import queue
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger("ruvllm.server")

DEFAULT_MAX_FILE_BYTES = 64 << 20
DEFAULT_MAX_FILES = 8
DEFAULT_MAX_INDEX = 100_000
QUEUE_SIZE = 4096
_NAME = re.compile(r"(witness|feedback)-(\d{6})\.jsonl")


class RotatingJSONL:
    """Append JSON lines to PREFIX-NNNNNN.jsonl files in `folder`, starting a new file past `max_bytes`
    and keeping the newest `max_files`. Not thread-safe: one writer thread owns it."""

    def __init__(self, folder: Path, prefix: str, max_bytes: int, max_files: int) -> None:
        if max_bytes < 1024 or max_files < 1:
            raise ValueError(f"witness log: max_bytes must be >= 1024 and max_files >= 1, got {max_bytes}, "
                             f"{max_files}")
        self.folder, self.prefix, self.max_bytes, self.max_files = folder, prefix, max_bytes, max_files
        numbers = [n for n, _ in self.files()]
        self.number = numbers[-1] if numbers else 1
        self.path = self._path(self.number)
        self.size = self.path.stat().st_size if self.path.exists() else 0

    def _path(self, number: int) -> Path:
        return self.folder / f"{self.prefix}-{number:06d}.jsonl"

    def files(self) -> list[tuple[int, Path]]:
        """This stream's files, oldest first."""
        found = []
        for path in self.folder.iterdir():
            match = _NAME.fullmatch(path.name)
            if match and match.group(1) == self.prefix:
                found.append((int(match.group(2)), path))
        return sorted(found)

    def append(self, line: bytes) -> tuple[Path, int]:
        """Write one line (ending in a newline); where it starts."""
        if self.size and self.size + len(line) > self.max_bytes:
            self.number += 1
            self.path, self.size = self._path(self.number), 0
            old = self.files()  # the new file does not exist yet: keep max_files - 1 of these
            for _, path in old[:max(0, len(old) - (self.max_files - 1))]:
                path.unlink(missing_ok=True)
        with open(self.path, "ab") as f:
            offset = f.tell()
            f.write(line)
        self.size = offset + len(line)
        return self.path, offset


class WitnessLog:
    """The two rotated streams, one writer thread, and the id index feedback joins on."""

    def __init__(self, folder: Path | str, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 max_files: int = DEFAULT_MAX_FILES, max_index: int = DEFAULT_MAX_INDEX) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.streams = {kind: RotatingJSONL(self.folder, kind, max_file_bytes, max_files)
                        for kind in ("witness", "feedback")}
        self.max_index = max_index
        # id -> the record itself while queued, then (path, offset) once written
        self._index: OrderedDict[str, dict[str, Any] | tuple[Path, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(QUEUE_SIZE)
        self.dropped = 0
        self.written = 0
        self._rebuild_index()
        self._thread = threading.Thread(target=self._write_loop, name="witness-log", daemon=True)
        self._thread.start()

    # --- writing --------------------------------------------------------------------------------------
    def record_completion(self, record: dict[str, Any]) -> None:
        """Queue a completion line (it must carry "id"); never blocks, never raises."""
        self._put("witness", {"type": "completion", **record})

    def record_feedback(self, record: dict[str, Any]) -> None:
        self._put("feedback", {"type": "feedback", **record})

    def record_deletion(self, feedback_id: str) -> None:
        """DELETE /v1/feedback/{id}: a line that takes that feedback out of every later replay (feedback())."""
        import time

        self._put("feedback", {"type": "feedback_deleted", "id": feedback_id, "created": round(time.time(), 3)})

    def _put(self, stream: str, record: dict[str, Any]) -> None:
        if stream == "witness":
            with self._lock:
                self._remember(record["id"], record)
        try:
            self._queue.put_nowait((stream, record))
        except queue.Full:
            self.dropped += 1
            logger.warning("witness log: queue full, %d record(s) dropped so far", self.dropped)

    def _remember(self, rid: str, where: dict[str, Any] | tuple[Path, int]) -> None:
        self._index[rid] = where
        self._index.move_to_end(rid)
        while len(self._index) > self.max_index:
            self._index.popitem(last=False)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            stream, record = item
            try:
                line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
                where = self.streams[stream].append(line)
                self.written += 1
                if stream == "witness":
                    with self._lock:
                        if record["id"] in self._index:
                            self._index[record["id"]] = where
            except Exception:  # a full disk must not end the thread: later records may fit
                logger.exception("witness log: could not write a %s record", stream)
            finally:
                self._queue.task_done()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every queued record is on disk (tests, shutdown)."""
        done = threading.Event()
        threading.Thread(target=lambda: (self._queue.join(), done.set()), daemon=True).start()
        done.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(10)

    # --- reading --------------------------------------------------------------------------------------
    def lookup(self, rid: str) -> dict[str, Any] | None:
        """The logged completion `rid`, or None (unknown, evicted from the index, or its file rotated away)."""
        with self._lock:
            where = self._index.get(rid)
        if where is None or isinstance(where, dict):
            return where
        path, offset = where
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                record = json.loads(f.readline())
        except (OSError, ValueError):
            return None
        return record if record.get("id") == rid else None

    def _rebuild_index(self) -> None:
        for path, offset, record in read_lines(self.folder, "witness"):
            if isinstance(record.get("id"), str):
                self._remember(record["id"], (path, offset))

    def feedback(self) -> list[dict[str, Any]]:
        """Every logged feedback record not deleted since, oldest first."""
        records = [record for _, _, record in read_lines(self.folder, "feedback")]
        deleted = {r.get("id") for r in records if r.get("type") == "feedback_deleted"}
        return [r for r in records if r.get("type") != "feedback_deleted" and r.get("id") not in deleted]


def read_lines(folder: Path | str, prefix: str) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """(path, offset, record) of every well-formed line of one stream in `folder`, oldest first;
    a torn last line (a crash mid-write) is skipped."""
    folder = Path(folder)
    files = sorted((int(m.group(2)), p) for p in folder.iterdir()
                   if (m := _NAME.fullmatch(p.name)) and m.group(1) == prefix) if folder.is_dir() else []
    for _, path in files:
        offset = 0
        with open(path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if isinstance(record, dict):
                    yield path, offset, record
                offset += len(line)


def log_size(folder: Path | str) -> int:
    """Bytes the log's files take (tests, /metrics)."""
    return sum(p.stat().st_size for p in Path(folder).iterdir() if _NAME.fullmatch(p.name))

