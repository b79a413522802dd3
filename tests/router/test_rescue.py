"""A completion or chat answer's continuation tries, against a fake engine client: what a
replay sends, what it repeats, and the refusals of its own (the rules every route shares are
tests/router/test_replays.py's)."""

from __future__ import annotations

import pytest

from narwhal.config.continuation import ContinuationConfig
from narwhal.protocol.bodies import Endpoint
from narwhal.protocol.errors import Cause, NarwhalError, engine_error
from narwhal.router.call import Call
from narwhal.router.continuation import tracker
from narwhal.router.progress import Progress
from narwhal.router.rescue import Rescue
from support.legs import FakeLegs, Path, call, config, path, request

ENGINES = [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]
SETTINGS = ContinuationConfig(enabled=True, max_attempts=2, budget=5)
CUT = engine_error(Cause.CLOSED_EARLY, "engine d0 closed the stream early", "d0")


class NoHeaders:
    """A client reply that sent no headers; the rules never write to it."""

    committed = False

    def header(self, name: str) -> str | None:
        return None


def rescue(settings: ContinuationConfig = SETTINGS) -> tuple[Rescue, Call, Path]:
    stack = path(config(ENGINES), FakeLegs())
    client_request = request()
    progress = tracker(settings, client_request)
    assert isinstance(progress, Progress)
    progress.prompt_ids, progress.ids, progress.committed = [1, 2, 3], [7, 8, 9], 2
    record = call()
    record.tracks_ids = True
    rescuer = Rescue(
        stack.fleet,
        stack.retries,
        NoHeaders(),  # type: ignore[arg-type]
        record,
        client_request,
        progress,
        None,
        settings,
    )
    rescuer.error = CUT
    rescuer.failed_consumers.add("d0")
    rescuer.avoid.add("d0")
    return rescuer, record, stack


async def test_a_replay_prefills_the_prompt_and_the_committed_ids_as_a_completion() -> None:
    rescuer, record, _ = rescue()
    replay = rescuer.next_try(record)
    assert replay.endpoint is Endpoint.COMPLETIONS and replay.stream
    assert replay.body["prompt"] == [1, 2, 3, 7, 8]
    assert replay.body["max_tokens"] == 4 - 2
    assert rescuer.base == 2


async def test_the_replay_goes_to_another_consumer_and_is_counted() -> None:
    rescuer, record, stack = rescue()
    rescuer.next_try(record)
    async with await rescuer.reserve(record) as reservation:
        assert reservation.consumer.id == "d1"
        rescuer.placed(record, reservation)
    assert (record.continuations, record.replayed_tokens) == (1, 2)
    assert stack.seats_held() == 0


def refused(kind: str, why: str) -> tuple[str, str]:
    return kind, f"{CUT.message}; the answer was not continued: {why}"


async def test_continuation_max_attempts_refuses_as_budget() -> None:
    rescuer, record, _ = rescue()
    record.continuations = 2
    with pytest.raises(NarwhalError) as raised:
        rescuer.next_try(record)
    assert (record.refused_kind, raised.value.message) == refused(
        "budget", "continuation.max_attempts (2) used"
    )


async def test_an_answer_without_prompt_ids_refuses_as_answer() -> None:
    rescuer, record, _ = rescue()
    rescuer.progress.prompt_ids = None
    with pytest.raises(NarwhalError) as raised:
        rescuer.next_try(record)
    assert (record.refused_kind, raised.value.message) == refused(
        "answer", "the engine did not report the prompt's token ids"
    )
