"""One call's recording (``--record-dir``): a stereo WAV of both sides and a JSON-lines log.

``<dir>/<id>.wav``: 16-bit PCM, 16 kHz, two channels on the call's clock (seconds since the
recording began, when the call was admitted): left, the caller's audio as the session received it
(decoded, at 16 kHz, before any turn-taking); right, the agent's audio as the caller heard it:

- paced transports (WebRTC, SIP): each 20 ms frame the sender took from the queue, at the time it
  took it (a paused or cleared answer sends no more frames, so a barge-in cuts the channel there);
- Twilio: each chunk as it starts playing (the echo of the mark before it, or its sending when
  Twilio had played everything before it): a chunk cut by ``clear`` is kept whole;
- the Realtime WebSocket: the client plays what it is sent in real time from the first chunk on,
  and stops at ``input_audio_buffer.speech_started``: the chunks are laid out one after the other
  from their sending and cut at that event (the session tells its AgentAudio's tap, ``cut_agent``).

Each side is placed by when it arrived (or played), and kept continuous across the jitter of its
packets (:data:`JITTER_S`); a gap longer than that is silence, as the caller had it.

``<dir>/<id>.jsonl``: one JSON object a line, each with ``t`` (seconds on the same clock) and a
``kind``: ``call`` (first: id, transport, rate, wall-clock start), ``server`` / ``client`` (the
event, without audio payloads; ``input_audio_buffer.append`` is left out: its audio is the left
channel), ``transcript`` (``role`` user or assistant, ``item_id``, ``text``; a user turn with
``audio_start_ms`` / ``audio_end_ms`` of the input stream, an assistant answer with
``audio_start_t``, when its audio began, and ``heard_ms`` once a barge-in truncated it),
``end`` (the reason).

Memory and disk: samples are written once they are :data:`SETTLE_S` old; what is held meanwhile is
bounded (:data:`MAX_AHEAD_S` of audio a fast client sent ahead of time), the log stops growing
past :data:`MAX_LOG_BYTES`. A write that fails (a full disk) ends the recording, never the call.

Lifetime: one per call, made by the call's binding when the call starts and closed by it when the
call ends, however it ends (:meth:`CallRecording.close`, idempotent): the files are then complete.
"""

from __future__ import annotations

import json
import logging
import re
import time
import wave
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from duplex.media.pcm import float_to_pcm16
from duplex.media.resample import Resampler

log = logging.getLogger(__name__)

RATE = 16000
JITTER_S = 0.1  # a packet this much early or late still joins the one before it
SETTLE_S = 0.5  # samples older than this are final: written out
MAX_AHEAD_S = 60.0  # audio a client sent ahead of real time, held at most
MAX_LOG_BYTES = 64 * 1024 * 1024
MAX_EVENT_CHARS = 16 * 1024  # a larger event is logged by its type and ids only
AUDIO_FIELDS = {"response.output_audio.delta": "delta"}
SKIPPED_EVENTS = {"input_audio_buffer.append"}
LEFT, RIGHT = 0, 1


def file_stem(call_id: str) -> str:
    """A call id as a file name (a SIP Call-ID may hold '@', '/' and more)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", call_id)[:200] or "call"


class CallRecording:
    """See module doc. Every method is called on the event loop and never blocks for long: the
    writes are a few kB each (a file system that blocks longer delays the loop)."""

    def __init__(self, directory: str | Path, call_id: str, transport: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        stem = file_stem(call_id)
        self.wav_path = folder / f"{stem}.wav"
        self.log_path = folder / f"{stem}.jsonl"
        self._clock = clock
        self._start = clock()
        self._wav: wave.Wave_write | None = wave.open(str(self.wav_path), "wb")
        self._wav.setnchannels(2)
        self._wav.setsampwidth(2)
        self._wav.setframerate(RATE)
        self._log: Any = self.log_path.open("w", encoding="utf-8")
        self._log_bytes = 0
        self._written = 0  # frames (sample pairs) written to the WAV
        self._pending = np.zeros((0, 2), dtype=np.int16)  # frames from self._written on
        self._cursor = [0, 0]  # per channel: where its next continuous sample goes
        self._resamplers: dict[tuple[int, str], Resampler] = {}
        self._scheduled: deque[tuple[int, np.ndarray]] = deque()  # client playout to come
        self._user_turns: dict[str, list[int]] = {}  # item_id -> [audio_start_ms, audio_end_ms]
        self._answer_starts: dict[str, float] = {}  # response_id -> t its audio began
        self._item_responses: dict[str, str] = {}  # item_id -> response_id
        self._write_line({"t": 0.0, "kind": "call", "id": call_id, "transport": transport,
                          "rate": RATE, "channels": ["caller", "agent"],
                          "started_at": datetime.now(UTC).isoformat()})

    @property
    def closed(self) -> bool:
        return self._wav is None

    def _t(self, at: float | None = None) -> float:
        return (self._clock() if at is None else at) - self._start

    def _pos(self, at: float) -> int:
        return round(self._t(at) * RATE)

    # --- audio ------------------------------------------------------------------------------

    def caller(self, samples: np.ndarray, arrival: float) -> None:
        """16 kHz float32 audio of the caller that arrived (its end) at ``arrival``."""
        self._place(LEFT, float_to_pcm16(samples), self._pos(arrival) - len(samples))
        self._settle(self._clock())

    def agent_played(self, samples: np.ndarray, rate: int, at: float) -> None:
        """Agent audio the caller heard: it began playing at ``at``."""
        self._place(RIGHT, self._resample(samples, rate), self._pos(at))
        self._settle(self._clock())

    def agent_sent(self, samples: np.ndarray, rate: int, at: float) -> None:
        """Agent audio a client will play after what it already has (sent at ``at``)."""
        pcm = self._resample(samples, rate)
        last = self._scheduled[-1] if self._scheduled else None
        start = max(self._pos(at), last[0] + len(last[1]) if last else 0, self._cursor[RIGHT])
        if start - self._pos(at) <= MAX_AHEAD_S * RATE:
            self._scheduled.append((start, pcm))
        self._settle(at)

    def cut_agent(self, at: float) -> None:
        """The client stopped playing at ``at``: what it had not played yet is dropped."""
        self._release_scheduled(self._pos(at))
        self._scheduled.clear()

    def _resample(self, samples: np.ndarray, rate: int) -> np.ndarray:
        samples = np.asarray(samples)
        key = (rate, samples.dtype.str)
        if rate == RATE:
            return samples if samples.dtype == np.int16 else float_to_pcm16(samples)
        resampler = self._resamplers.get(key)
        if resampler is None:
            resampler = self._resamplers[key] = Resampler(rate, RATE, in_dtype=samples.dtype.type,
                                                          out_dtype=np.int16)
        return resampler.push(samples)

    def _place(self, channel: int, pcm: np.ndarray, start: int) -> None:
        if self._wav is None or not len(pcm):
            return
        cursor = self._cursor[channel]
        if abs(start - cursor) <= JITTER_S * RATE or start < cursor:
            start = cursor  # continuous with what came before (jitter, or a client ahead of time)
        now = self._pos(self._clock())
        if start - now > MAX_AHEAD_S * RATE:
            return  # a client far ahead of real time: beyond what a recording holds
        begin = max(start, self._written)
        pcm = pcm[begin - start:]
        end = begin + len(pcm)
        if end > self._written + len(self._pending):
            grown = np.zeros((end - self._written, 2), dtype=np.int16)
            grown[: len(self._pending)] = self._pending
            self._pending = grown
        if len(pcm):
            self._pending[begin - self._written : end - self._written, channel] = pcm
        self._cursor[channel] = max(cursor, end)

    def _release_scheduled(self, until: int) -> None:
        """Client playout up to ``until`` (a position) has been played: onto the right channel."""
        while self._scheduled and self._scheduled[0][0] < until:
            start, pcm = self._scheduled.popleft()
            if start + len(pcm) > until:
                self._scheduled.appendleft((until, pcm[until - start:]))
                pcm = pcm[: until - start]
            self._place_exact(RIGHT, pcm, start)

    def _place_exact(self, channel: int, pcm: np.ndarray, start: int) -> None:
        self._cursor[channel] = min(self._cursor[channel], start)
        self._place(channel, pcm, start)

    def _settle(self, now: float) -> None:
        """Write out the frames older than :data:`SETTLE_S`."""
        self._release_scheduled(self._pos(now))
        ready = self._pos(now) - int(SETTLE_S * RATE) - self._written
        if ready >= RATE // 4:
            self._write_frames(min(ready, len(self._pending)), pad_to=ready)

    def _write_frames(self, count: int, pad_to: int = 0) -> None:
        if self._wav is None:
            return
        frames = self._pending[:count]
        if pad_to > count:  # nothing arrived for a while on either side: silence
            frames = np.concatenate([frames, np.zeros((pad_to - count, 2), dtype=np.int16)])
        try:
            self._wav.writeframesraw(frames.astype("<i2").tobytes())
        except OSError as err:
            self._fail(err)
            return
        self._written += len(frames)
        self._pending = self._pending[count:]

    # --- events -----------------------------------------------------------------------------

    def server_event(self, message: dict[str, Any]) -> None:
        now = self._clock()
        kind = message.get("type")
        if kind == "input_audio_buffer.speech_started":
            self._user_turns[str(message.get("item_id"))] = [int(message.get("audio_start_ms") or 0), 0]
        elif kind == "input_audio_buffer.speech_stopped":
            turn = self._user_turns.get(str(message.get("item_id")))
            if turn is not None:
                turn[1] = int(message.get("audio_end_ms") or 0)
        elif kind in ("output_audio_buffer.started", "response.output_audio.delta"):
            self._answer_starts.setdefault(str(message.get("response_id")), self._t(now))
        self._event("server", message, now)
        self._transcript(message, now)

    def client_event(self, message: dict[str, Any]) -> None:
        if message.get("type") not in SKIPPED_EVENTS:
            self._event("client", message, self._clock())

    def _event(self, side: str, message: dict[str, Any], now: float) -> None:
        field = AUDIO_FIELDS.get(str(message.get("type")))
        if field is not None and field in message:
            message = {**message, field: f"<{len(message[field])} base64 characters>"}
        line = {"t": round(self._t(now), 3), "kind": side, "event": message}
        text = json.dumps(line)
        if len(text) > MAX_EVENT_CHARS:
            brief = {k: v for k, v in message.items() if k in ("type", "event_id", "item_id", "response_id")}
            line["event"] = {**brief, "omitted_chars": len(text)}
        self._write_line(line)
        self._settle(now)

    def _transcript(self, message: dict[str, Any], now: float) -> None:
        kind = message.get("type")
        line: dict[str, Any] | None = None
        if kind == "conversation.item.input_audio_transcription.completed":
            item_id = str(message.get("item_id"))
            line = {"role": "user", "item_id": item_id, "text": message.get("transcript", "")}
            turn = self._user_turns.pop(item_id, None)
            if turn is not None:
                line["audio_start_ms"], line["audio_end_ms"] = turn
        elif kind in ("response.output_audio_transcript.done", "response.output_text.done"):
            response_id, item_id = str(message.get("response_id")), str(message.get("item_id"))
            self._item_responses[item_id] = response_id
            line = {"role": "assistant", "item_id": item_id, "response_id": response_id,
                    "text": message.get("transcript", message.get("text", "")),
                    "audio_start_t": self._answer_starts.get(response_id)}
        elif kind == "conversation.item.truncated":
            item_id = str(message.get("item_id"))
            line = {"role": "assistant", "item_id": item_id, "heard_ms": message.get("audio_end_ms")}
        elif kind == "response.done":
            self._answer_starts.pop(str((message.get("response") or {}).get("id")), None)
        if line is not None:
            self._write_line({"t": round(self._t(now), 3), "kind": "transcript", **line})

    def _write_line(self, line: dict[str, Any]) -> None:
        if self._log is None or self._log_bytes > MAX_LOG_BYTES:
            return
        text = json.dumps(line) + "\n"
        try:
            self._log.write(text)
        except OSError as err:
            self._fail(err)
            return
        self._log_bytes += len(text)
        if self._log_bytes > MAX_LOG_BYTES:
            log.warning("recording %s: the event log reached %d MiB; no more events are logged",
                        self.log_path.name, MAX_LOG_BYTES >> 20)

    # --- the end ----------------------------------------------------------------------------

    def close(self, reason: str = "ended") -> None:
        """Write out everything held (the client's playout up to now) and close both files."""
        if self._wav is None:
            return
        now = self._clock()
        self._release_scheduled(self._pos(now))
        self._scheduled.clear()
        self._write_line({"t": round(self._t(now), 3), "kind": "end", "reason": reason})
        self._write_frames(len(self._pending))
        wav, logfile = self._wav, self._log
        self._wav = self._log = None
        self._pending = np.zeros((0, 2), dtype=np.int16)
        self._resamplers.clear()
        try:
            wav.close()
            logfile.close()
        except OSError as err:
            log.warning("recording %s could not be closed: %s", self.wav_path.name, err)

    def _fail(self, err: OSError) -> None:
        log.warning("recording %s stopped: %s", self.wav_path.name, err)
        wav, logfile = self._wav, self._log
        self._wav = self._log = None
        self._pending = np.zeros((0, 2), dtype=np.int16)
        for f in (wav, logfile):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
