"""The journal: whole lines, even with several processes appending to one file."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson

from narwhal.observe.journal import Journal
from narwhal.protocol.bodies import Endpoint
from narwhal.router.call import Call

WRITER = """
import asyncio, sys
from pathlib import Path
from narwhal.observe.journal import Journal
from narwhal.protocol.bodies import Endpoint
from narwhal.router.call import Call

async def main() -> None:
    journal = Journal(Path(sys.argv[1]), {"worker": int(sys.argv[2])})
    journal.start()
    for i in range(3000):
        # Lines of a few kilobytes: a buffered writer would split some across writes.
        journal.record({"type": "request", "i": i, "pad": "x" * (i % 7 * 900)})
        if i % 100 == 0:
            await asyncio.sleep(0)
    await journal.close()

asyncio.run(main())
"""


async def test_lines_from_several_processes_never_cut_into_each_other(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    writers = [
        await asyncio.create_subprocess_exec(sys.executable, "-c", WRITER, str(path), str(n))
        for n in range(3)
    ]
    assert [await writer.wait() for writer in writers] == [0, 0, 0]
    lines = [orjson.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]
    assert len(lines) == 9000
    for worker in range(3):
        assert [line["i"] for line in lines if line["worker"] == worker] == list(range(3000))


async def test_a_stamp_goes_on_every_line(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.jsonl", {"worker": 7})
    journal.start()
    journal.record({"type": "request"})
    journal.record({"type": "engine", "worker": 1})
    await journal.close()
    lines = [orjson.loads(line) for line in (tmp_path / "j.jsonl").read_bytes().splitlines()]
    assert [line["worker"] for line in lines] == [7, 1]


async def test_a_request_line_names_its_model_and_adapter_when_it_has_one(
    tmp_path: Path,
) -> None:
    journal = Journal(tmp_path / "j.jsonl")
    journal.start()
    for model, adapter in (("model-a", "sql"), ("model-b", None), (None, None)):
        done = Call("r", None, Endpoint.COMPLETIONS, arrival=1.0, deadline=2.0)
        done.model, done.adapter, done.status = model, adapter, 200 if model else 404
        journal.record(done.entry(1.5))
    await journal.close()
    lines = [orjson.loads(line) for line in (tmp_path / "j.jsonl").read_bytes().splitlines()]
    assert [(line["model"], line.get("adapter", "-")) for line in lines] == [
        ("model-a", "sql"),
        ("model-b", "-"),
        # Refused before its model was known.
        (None, "-"),
    ]
