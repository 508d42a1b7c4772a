"""What a streaming end-of-turn detector sees of one spoken turn: its pauses, and the end-of-turn
model's cues at chosen points of each pause.

:func:`trace` runs the session's real VAD (``duplex.turns.server_vad.TurnDetector`` with a silence
too long to ever end the turn, so only its speech/silence tracking is used) window by window over
the audio, as the server would receive it. When the silence after speech reaches ``ask_at_ms``,
it asks the end-of-turn model for its cues on the audio up to that window, as a streaming detector
does once per pause. The policy can then be replayed on the trace for any eagerness and any
threshold without calling the model again (:mod:`evaluation.turn_eval` does).

Given a recogniser (``hear``: the offline preset's Whisper tiny.en, as its speculative request
would run it at that moment), each asked pause also gets the words of the turn so far, read by
:func:`duplex.turns.transcript_cue.read_transcript` and, given a ``judge``, by the language model
of the offline preset's ``judge`` stage (``pipeline/models/offline/finished_text.py``); the
recognition time then includes the judge's, as the words' arrival in the session does.

Nothing here holds state between calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from duplex.turns.config import TurnDetection
from duplex.turns.end_of_turn import Cues, EndOfTurnModel
from duplex.turns.server_vad import TurnDetector
from duplex.turns.transcript_cue import Words, read_transcript
from duplex.turns.vad import SAMPLE_RATE, WINDOW
from evaluation.turn_utterances import Utterance


@dataclass
class Pause:
    """One silence after speech, as the VAD counted it."""

    start_ms: int  # the VAD's end of speech (end of the last speech window)
    length_ms: int  # how long it lasted before speech resumed (or the audio ended)
    inside: bool = False  # speech resumed after it: ending the turn here cuts the speaker off
    cues: Cues | None = None  # the model's answer, when the pause reached ``ask_at_ms``
    transcript: str | None = None  # what the recogniser heard of the turn so far, then
    words: Words | None = None  # how those words read
    finished_text: float | None = None  # and the text judge's P(finished) for them


@dataclass
class Trace:
    utterance: Utterance
    pauses: list[Pause]
    call_seconds: list[float]  # wall time of each model call
    hear_seconds: list[float] = field(default_factory=list)  # wall time of each recognition


def trace(utterance: Utterance, model: EndOfTurnModel, ask_at_ms: int,
          hear: Callable[[np.ndarray], str] | None = None,
          judge: Callable[[str], float] | None = None, words_at_ms: int | None = None) -> Trace:
    """The pauses of ``utterance`` and the model's answer in each that lasted ``ask_at_ms``
    (rounded up to whole 32 ms VAD windows), with what ``hear`` made of the turn so far and what
    ``judge`` (the pipeline's text end-of-turn judge) made of those words, once the pause lasted
    ``words_at_ms`` (``ask_at_ms`` by default); see the module doc."""
    words_at_ms = ask_at_ms if words_at_ms is None else words_at_ms
    detector = TurnDetector(TurnDetection(silence_duration_ms=10_000))
    audio = utterance.audio
    pauses: list[Pause] = []
    calls: list[float] = []
    heard: list[float] = []
    current: Pause | None = None
    for begin in range(0, len(audio) - WINDOW + 1, WINDOW):
        detector.process(audio[begin : begin + WINDOW])
        silence = detector.silence_ms
        if silence == 0:
            if current is not None:
                current.inside = True
                pauses.append(current)
                current = None
            continue
        if current is None:
            current = Pause(start_ms=detector.position_ms - silence, length_ms=0)
        current.length_ms = silence
        so_far = audio[: detector.position_ms * SAMPLE_RATE // 1000]
        if current.cues is None and silence >= ask_at_ms:
            started = time.perf_counter()
            current.cues = model.cues(so_far)
            calls.append(time.perf_counter() - started)
        if hear is not None and current.transcript is None and silence >= words_at_ms:
            started = time.perf_counter()
            current.transcript = hear(so_far)
            current.words = read_transcript(current.transcript)
            if judge is not None:
                current.finished_text = judge(current.transcript)
            heard.append(time.perf_counter() - started)
    if current is not None:
        pauses.append(current)
    return Trace(utterance, pauses, calls, heard)
