"""schemathesis against the server's own OpenAPI schema (``/openapi.json`` of a real server), while
a second session keeps talking: no request gets a 5xx, every response whose status the schema
declares has the declared body and content type, and every status is one the schema declares;
meanwhile a Realtime WebSocket session asks turn after turn and each is answered, ``/healthz``
answers after the run, and the server's memory grows by less than MEMORY_BOUND_MB.

Every operation of the schema is fuzzed, none left out:

- ``POST /v1/realtime/calls`` gets generated text as its SDP (and generated multipart parts): this
  reaches only the refusals (400 ``invalid_sdp``, 413), never a started call, since a valid offer
  is a whole ICE/DTLS negotiation no generator produces; accepted offers are tested with real
  peers (tests/api/test_hostile_sdp.py, tests/e2e).
- ``POST /v1/realtime/calls/{call_id}/hangup`` and ``DELETE /v1/realtime/calls/{call_id}`` get
  generated ids, so they reach only ``call_not_found`` (404): no call is open to end.
- ``POST /v1/chat/completions`` gets generated bodies; the few that validate are answered by the
  toy model in three words.
- The WebSocket endpoints (``/v1/realtime``, the Twilio media stream) are not in an OpenAPI schema;
  tests/api/test_fuzz_events.py fuzzes the Realtime events with hypothesis.

Bounded: MAX_EXAMPLES per operation, derandomized (CI runs the same cases), no per-example deadline
(two cores shared with a talking session make timings noisy); about 25 s on 2 cores, server
start included.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import API_KEY, AUTH, realtime, toy_pipeline, user_text

log = logging.getLogger(__name__)

MAX_EXAMPLES = 25
MEMORY_BOUND_MB = 100  # growth of the server process's RSS over the whole run
TURN_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("schemathesis")
    pipeline = toy_pipeline(thinker={"options": {"answer_tokens": 3}})
    preset = write_preset(tmp / "preset.yaml", pipeline=pipeline, api_key=API_KEY)
    with run_server(preset, tmp=tmp) as running:
        yield running


def rss_mb(pid: int) -> float:
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class Talker:
    """A second session that asks turn after turn (a text item, then a short response) on its own
    thread and event loop until stopped; ``statuses`` holds each response's final status."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.statuses: list[str] = []
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="talker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(TURN_TIMEOUT_S)
        assert not self._thread.is_alive(), "the talking session's turn never ended"

    def _run(self) -> None:
        try:
            asyncio.run(self._talk())
        except Exception as err:  # noqa: BLE001 - reported by the test that checks the talker
            self.failure = err

    async def _talk(self) -> None:
        async with realtime(self.server) as rt:
            await rt.wait("session.created")
            while not self._stop.is_set():
                await rt.connection.conversation.item.create(item=user_text("What time is it?"))
                await rt.connection.response.create(response={"max_output_tokens": 3})
                done = await rt.wait("response.done", count=len(self.statuses) + 1)
                self.statuses.append(done.response.status)


@pytest.fixture(scope="module")
def talker(server: ServerProcess) -> Iterator[Talker]:
    running = Talker(server)
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def rss_before(server: ServerProcess) -> float:
    return rss_mb(server.process.pid)


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess, talker: Talker, rss_before: float) -> schemathesis.BaseSchema:
    """The running server's schema; requesting it starts the talker and notes the memory first."""
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True)
def test_every_operation_conforms(case: schemathesis.Case) -> None:
    case.call_and_validate(headers=AUTH, timeout=TURN_TIMEOUT_S,
                           checks=[not_a_server_error, status_code_conformance,
                                   content_type_conformance, response_schema_conformance])


def test_the_other_session_was_answered_and_the_server_is_well(
        server: ServerProcess, talker: Talker, rss_before: float) -> None:
    """Runs after the fuzzing (pytest keeps a module's order)."""
    talker.stop()
    assert talker.failure is None, repr(talker.failure)
    assert talker.statuses, "the talking session finished no turn during the fuzzing"
    assert set(talker.statuses) == {"completed"}, talker.statuses
    assert httpx.get(f"{server.url}/healthz", timeout=TURN_TIMEOUT_S).status_code == 200
    growth = rss_mb(server.process.pid) - rss_before
    log.info("the other session finished %d turns; the server grew by %.1f MB",
             len(talker.statuses), growth)
    assert growth < MEMORY_BOUND_MB, f"the server grew by {growth:.0f} MB"
