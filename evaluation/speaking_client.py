"""A Realtime WebSocket session whose user speaks and interrupts, for the load benchmarks
(evaluation/abort_storm.py, evaluation/soak.py).

The user's speech is espeak-ng audio sent as ``input_audio_buffer.append`` events under the
server's own turn detection (server_vad): the session hears an utterance, ends the turn at its
trailing silence and answers. Audio goes out as fast as the socket takes it, not in real time:
turn-taking runs on audio time (duplex/session/session.py), so the server decides the same, and
one benchmark minute holds many more turns. A reader task takes every server event as it comes
(a client that does not read is closed by the server) and keeps it until the session ends.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from duplex.media.pcm import float_to_pcm16
from harness.server import ServerProcess
from harness.speech import speech

PCM_RATE = 24000  # the session's default input format, audio/pcm at 24 kHz
CHUNK_S = 0.2  # one append event: 200 ms, well under the server's event rate limit
EVENT_TIMEOUT_S = 30.0
# Espeak-ng utterances; the trailing second of silence ends the turn (server_vad).
QUESTION = "Hello there. Could you tell me what the weather will be like tomorrow?"
INTERRUPTION = "Wait, stop, I have another question."
# A cancel that loses the race against the response's own end: expected, not a fault.
BENIGN_ERRORS = frozenset({"response_cancel_not_active"})


def utterance(text: str) -> list[str]:
    """``text`` spoken, as the base64 payloads of its append events."""
    pcm = float_to_pcm16(speech(text, PCM_RATE, 0.2, 1.0)).astype("<i2").tobytes()
    step = int(PCM_RATE * CHUNK_S) * 2
    return [base64.b64encode(pcm[i : i + step]).decode("ascii") for i in range(0, len(pcm), step)]


class SpeakingSession:
    """One connection: ``say`` speaks, ``next_response`` / ``first_audio`` / ``done`` follow the
    responses in order. The reader keeps what those need per response (not the events: a long
    session receives tens of thousands of audio deltas), every error code, and counts per type."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.counts: Counter[str] = Counter()
        self.error_codes: list[str] = []
        self.closed: ConnectionClosed | None = None
        self._created: list[str] = []
        self._deltas: Counter[str] = Counter()
        self._status: dict[str, str] = {}
        self._changed = asyncio.Condition()
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                self._keep(json.loads(message))
                async with self._changed:
                    self._changed.notify_all()
        except ConnectionClosed as err:
            self.closed = err
        finally:
            self.closed = self.closed or ConnectionClosed(None, None)
            async with self._changed:
                self._changed.notify_all()

    def _keep(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        self.counts[kind] += 1
        if kind == "response.created":
            self._created.append(event["response"]["id"])
        elif kind == "response.output_audio.delta":
            self._deltas[event["response_id"]] += 1
        elif kind == "response.done":
            self._status[event["response"]["id"]] = event["response"]["status"]
        elif kind == "error":
            self.error_codes.append(event["error"].get("code") or event["error"].get("type"))

    async def wait(self, found: Callable[[], Any]) -> Any:
        """The first truthy ``found()``, re-checked at every event; fails if the connection ends
        or EVENT_TIMEOUT_S passes first."""
        async def until() -> Any:
            async with self._changed:
                while not (hit := found()):
                    if self.closed is not None:
                        raise ConnectionError(f"connection ended: {self.closed}")
                    await self._changed.wait()
                return hit

        return await asyncio.wait_for(until(), EVENT_TIMEOUT_S)

    async def say(self, payloads: list[str]) -> None:
        for audio in payloads:
            await self.send("input_audio_buffer.append", audio=audio)

    async def send(self, kind: str, **fields: Any) -> None:
        await self.ws.send(json.dumps({"type": kind, **fields}))

    async def next_response(self, seen: int) -> str:
        """The id of the response created after the first ``seen`` ones."""
        return await self.wait(lambda: len(self._created) > seen and self._created[seen])

    async def first_audio(self, response_id: str) -> bool:
        """Until the response's first audio delta (True) or its end without audio (False)."""
        return await self.wait(
            lambda: ("audio" if self._deltas[response_id] else
                     "none" if response_id in self._status else None)) == "audio"

    async def done(self, response_id: str) -> str:
        """Until the response's ``response.done``; its status (completed, cancelled, ...)."""
        return await self.wait(lambda: self._status.get(response_id))


@asynccontextmanager
async def speaking_session(server: ServerProcess, api_key: str | None = None) -> AsyncIterator[SpeakingSession]:
    """A connected session past ``session.created``; closed (and its reader ended) on exit."""
    url = server.url.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with connect(url, max_size=None, additional_headers=headers) as ws:
        session = SpeakingSession(ws)
        try:
            await session.wait(lambda: session.counts["session.created"])
            yield session
        finally:
            session.reader.cancel()


# --- conversations: what the benchmarks' users do ------------------------------------------------

# The server these benchmarks load: the toy model with answers long enough to interrupt (40 words,
# 120 codec frames generated in about 1.2 s) and the preset's defaults otherwise.
LOAD_STAGES = {"thinker": {"options": {"answer_tokens": 40}},
               "talker": {"options": {"step_delay_s": 0.01}}}
MAX_BARGE_IN_DELAY_S = 1.0  # after the first audio delta: inside the ~1.2 s of generation


@dataclass
class BargeIn:
    """One interruption: how and when (seconds after the response's first audio), how the
    response ended, and how long from the interruption's first event to its ``response.done``."""

    method: str  # "speech" (server_vad barge-in) or "response.cancel"
    delay_s: float
    status: str
    stop_s: float


@dataclass
class SessionLog:
    """What one user's session did; ``failure`` is the exception that ended it early, if any."""

    barge_ins: list[BargeIn] = field(default_factory=list)
    answered: int = 0  # responses that completed
    without_audio: int = 0  # responses that ended before any audio
    errors: list[str] = field(default_factory=list)  # codes of the error events received
    failure: str | None = None


async def interrupt(session: SpeakingSession, response_id: str, rng: np.random.Generator,
                    phrases: dict[str, list[str]]) -> BargeIn:
    """Interrupt the response at a random moment of its audio, by speaking over it or with
    ``response.cancel`` (then speaking: the user's next turn either way)."""
    delay = float(rng.uniform(0.0, MAX_BARGE_IN_DELAY_S))
    await asyncio.sleep(delay)  # the random moment itself, not a wait for something
    method = "speech" if rng.random() < 0.5 else "response.cancel"
    sent = time.monotonic()
    if method == "speech":
        await session.say(phrases["interruption"])
    else:
        await session.send("response.cancel")
    status = await session.done(response_id)
    stop_s = time.monotonic() - sent
    if method == "response.cancel":
        await session.say(phrases["interruption"])
    return BargeIn(method, round(delay, 3), status, round(stop_s, 4))


async def converse(session: SpeakingSession, rng: np.random.Generator, go_on: Callable[[], bool],
                   barge_in_share: float, pause_s: tuple[float, float], log: SessionLog) -> None:
    """Ask, then for each answer: interrupt it (``barge_in_share`` of them) or let it finish and
    ask again after a pause drawn from ``pause_s``, while ``go_on()``; the last turn spoken is
    answered to its end."""
    phrases = {"question": utterance(QUESTION), "interruption": utterance(INTERRUPTION)}
    await session.say(phrases["question"])
    seen = 0
    while True:
        response_id = await session.next_response(seen)
        seen += 1
        if not go_on():
            log.answered += await session.done(response_id) == "completed"
            return
        if not await session.first_audio(response_id):
            log.without_audio += 1
        elif rng.random() < barge_in_share:
            log.barge_ins.append(await interrupt(session, response_id, rng, phrases))
            continue
        log.answered += await session.done(response_id) == "completed"
        await asyncio.sleep(float(rng.uniform(*pause_s)))  # the user's own pause before asking
        await session.say(phrases["question"])


async def run_sessions(server: ServerProcess, sessions: int, seed: int, go_on: Callable[[], bool],
                       barge_in_share: float, pause_s: tuple[float, float] = (0.0, 0.0)
                       ) -> list[SessionLog]:
    """``sessions`` users conversing at once (``converse``), each with its own seeded random
    choices; a session that fails is logged and ends, the others go on."""
    async def one(index: int) -> SessionLog:
        log = SessionLog()
        try:
            async with speaking_session(server) as session:
                try:
                    await converse(session, np.random.default_rng(seed + index), go_on,
                                   barge_in_share, pause_s, log)
                finally:
                    log.errors = list(session.error_codes)
        except Exception as err:  # noqa: BLE001 - this session's failure, reported; others go on
            log.failure = repr(err)
        return log

    return list(await asyncio.gather(*(one(i) for i in range(sessions))))


def error_counts(logs: list[SessionLog]) -> dict[str, int]:
    """Error codes over all sessions, with how often each came (benign races included)."""
    return dict(sorted(Counter(code for log in logs for code in log.errors).items()))
