"""Container log reading: the CRI format, the options, tail from the end, follow across
growth and rotation, a raw log's refusals."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

import pytest

from nodeagent.runtime import logfile
from nodeagent.server import containerlogs
from nodeagent.server.containerlogs import LogOptions, LogRequestError, parse_options

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def cri(lines: list[tuple[str, str, str, str]]) -> bytes:
    return "".join(f"{t} {s} {tag} {text}\n" for t, s, tag, text in lines).encode()


SAMPLE = cri([("2026-01-02T03:00:00.000000001Z", "stdout", "F", "one"),
              ("2026-01-02T03:01:00.5Z", "stderr", "F", "two"),
              ("2026-01-02T03:02:00Z", "stdout", "P", "thr"),
              ("2026-01-02T03:02:00.1Z", "stdout", "F", "ee"),
              ("2026-01-02T03:03:00+01:00", "stdout", "F", "")])


async def read(path: Path, opts: LogOptions, fmt: str = "cri") -> bytes:
    out = bytearray()

    async def write(b: bytes) -> None:
        out.extend(b)
    await containerlogs.stream_log(str(path), fmt, opts, write)
    return bytes(out)


def test_cri_lines_partial_and_streams(tmp_path: Path) -> None:
    f = tmp_path / "0.log"
    f.write_bytes(SAMPLE)
    assert asyncio.run(read(f, LogOptions())) == b"one\ntwo\nthree\n\n"
    assert asyncio.run(read(f, LogOptions(stream="Stderr"))) == b"two\n"
    stamped = asyncio.run(read(f, LogOptions(timestamps=True, stream="Stdout")))
    assert stamped.splitlines()[0] == b"2026-01-02T03:00:00.000000001Z one"


def test_tail_since_and_limit(tmp_path: Path) -> None:
    f = tmp_path / "0.log"
    f.write_bytes(SAMPLE)
    assert asyncio.run(read(f, LogOptions(tail_lines=2))) == b"ee\n\n"
    assert asyncio.run(read(f, LogOptions(tail_lines=0))) == b""
    assert asyncio.run(read(f, LogOptions(tail_lines=10**9))) == b"one\ntwo\nthree\n\n"
    since = dt.datetime(2026, 1, 2, 3, 1, tzinfo=dt.UTC)
    # 03:03+01:00 is 02:03 UTC: earlier than since, but times only grow in a file, so
    # once past since every later line counts (the kubelet reads the same way)
    assert asyncio.run(read(f, LogOptions(since=since))) == b"two\nthree\n\n"
    assert asyncio.run(read(f, LogOptions(limit_bytes=5))) == b"one\nt"


def test_tail_reads_backwards_in_blocks(tmp_path: Path) -> None:
    f = tmp_path / "big.log"
    line = "x" * 100
    f.write_bytes(cri([("2026-01-02T03:00:00Z", "stdout", "F", f"{i} {line}")
                       for i in range(5000)]))
    out = asyncio.run(read(f, LogOptions(tail_lines=3))).splitlines()
    assert [x.split()[0] for x in out] == [b"4997", b"4998", b"4999"]
    with f.open("rb") as fh:
        assert logfile.tail_offset(fh, 1, f.stat().st_size) == f.stat().st_size - len(
            f.read_bytes().splitlines()[-1]) - 1


def test_an_incomplete_last_line_ends_the_output(tmp_path: Path) -> None:
    f = tmp_path / "0.log"
    f.write_bytes(SAMPLE + b"2026-01-02T03:04:00Z stdout F cut")
    assert asyncio.run(read(f, LogOptions())).endswith(b"\n\ncut\n")


def test_raw_logs_and_their_refusals(tmp_path: Path) -> None:
    f = tmp_path / "raw.log"
    f.write_bytes(b"a\nb\nc")
    assert asyncio.run(read(f, LogOptions(tail_lines=2), "raw")) == b"b\nc"
    with pytest.raises(LogRequestError, match="timestamps: the process runtime"):
        containerlogs.check_format("raw", LogOptions(timestamps=True), "process")
    with pytest.raises(LogRequestError, match="sinceSeconds"):
        containerlogs.check_format("raw", LogOptions(since=NOW), "process")


@pytest.mark.parametrize(("query", "status", "word"), [
    ({"tailLines": "-1"}, 422, "tailLines"),
    ({"tailLines": "x"}, 400, "tailLines"),
    ({"sinceSeconds": "0"}, 422, "sinceSeconds"),
    ({"sinceSeconds": "5", "sinceTime": "2026-01-01T00:00:00Z"}, 422, "sinceTime"),
    ({"sinceTime": "yesterday"}, 400, "sinceTime"),
    ({"limitBytes": "0"}, 422, "limitBytes"),
    ({"follow": "maybe"}, 400, "follow"),
    ({"stream": "Both"}, 400, "stream"),
])
def test_bad_options_are_refused_naming_the_parameter(query: dict[str, str], status: int,
                                                      word: str) -> None:
    with pytest.raises(LogRequestError, match=word) as e:
        parse_options(query, NOW)
    assert e.value.status == status


def test_options_parse() -> None:
    o = parse_options({"follow": "true", "tail": "5", "sinceSeconds": "60",
                       "timestamps": "1", "limitBytes": "10", "previous": "false"}, NOW)
    assert o == LogOptions(follow=True, timestamps=True, tail_lines=5, limit_bytes=10,
                           since=NOW - dt.timedelta(seconds=60))
    assert parse_options({"tail": "all"}, NOW).tail_lines is None
    assert parse_options({"sinceTime": "2026-01-02T03:04:05.123456789+02:00"}, NOW).since == \
        dt.datetime(2026, 1, 2, 1, 4, 5, 123456, tzinfo=dt.UTC)


def test_follow_sees_growth_and_rotation_and_ends_with_the_container(tmp_path: Path) -> None:
    f = tmp_path / "0.log"
    f.write_bytes(cri([("2026-01-02T03:00:00Z", "stdout", "F", "first")]))
    running = True
    got = bytearray()
    seen = asyncio.Event()

    async def write(b: bytes) -> None:
        got.extend(b)
        seen.set()

    async def main() -> None:
        nonlocal running
        watch = containerlogs.FileWatch()
        task = asyncio.create_task(containerlogs.stream_log(
            str(f), "cri", LogOptions(follow=True), write, running=lambda: running,
            watch=watch))

        async def until(text: bytes) -> None:
            while text not in got:
                seen.clear()
                await seen.wait()
        await until(b"first\n")
        with f.open("ab") as fh:  # the file grows: inotify wakes the follower
            fh.write(cri([("2026-01-02T03:00:01Z", "stdout", "F", "second")]))
        await until(b"second\n")
        # rotation: the old file gets one last line, then a new file takes its place
        with f.open("ab") as fh:
            fh.write(cri([("2026-01-02T03:00:02Z", "stdout", "F", "last-of-old")]))
        f.rename(tmp_path / "0.log.20260102-030002")
        f.write_bytes(cri([("2026-01-02T03:00:03Z", "stdout", "F", "new-file")]))
        await until(b"new-file\n")
        running = False  # the container exited: the follower ends by itself
        await asyncio.wait_for(task, 10)
        assert watch.watches == 0
        watch.close()

    asyncio.run(main())
    assert bytes(got) == b"first\nsecond\nlast-of-old\nnew-file\n"
