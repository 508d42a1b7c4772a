"""Backchannels over the agent, measured: does the agent go on after "mhm" and stop for "stop"?

    python -m evaluation.backchannel_eval

A real Session on the offline preset (its own pipeline, its session defaults: server_vad,
``backchannel_max_ms`` 800) with a paced track pulled in real time as a WebRTC sender would. Each
trial asks for a long story, lets 1.5 s of the answer play, then says one fragment over it, in two
voices (piper's natural voice and espeak-ng): backchannels ("Yeah.", "Mm-hmm.", ...) that should
let the agent go on, and short interruptions ("Stop.", "Wait.", ...) that should stop it. Counted:
how each ended (went on: the same response completed; interrupted: it was cancelled), and for
those that went on, the silence the listener heard: from the fragment's last sound to the agent's
next audible frame (the agent goes quiet at the fragment's onset in every case). Without
backchannels (``backchannel_max_ms`` 0) every fragment of word length interrupts, by construction,
so that mode is not run. Prints a table, writes ``evaluation/results/backchannel_eval.{json,png}``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import matplotlib
import numpy as np

from duplex.media.paced_track import OutboundAudioTrack
from duplex.media.playout import PacedPlayout
from duplex.session.session import Session
from duplex.settings import SessionDefaults
from evaluation.bench_common import ROOT, format_table, machine, save_figure, save_results
from evaluation.live_session import silence_until, speak
from harness.speech import natural_speech, speech
from pipeline.config import parse_pipeline_config, read_yaml
from pipeline.models.offline.sources import lm_source, prepare_lm
from pipeline.runner import start_pipeline

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RATE = 16000
QUESTION = "Please tell me a long story about a brave knight and a dragon."
BACKCHANNELS = ["Yeah.", "Mm-hmm.", "Okay.", "Right.", "Uh-huh.", "I see.", "Got it.", "Sure."]
INTERRUPTIONS = ["Stop.", "Wait.", "No.", "Hold on.", "What?", "Sorry?"]
VOICES = {"piper": natural_speech, "espeak": speech}
PLAYED_BEFORE_S = 1.5
AFTER_S = 4.0
AUDIBLE = 300  # s16 peak of a frame the listener hears


class Listener:
    """The session's transport (events with arrival times) and its paced track's listener."""

    kind = "webrtc"

    def __init__(self) -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.track = OutboundAudioTrack()
        self.frames: list[tuple[float, bool]] = []  # (when pulled, audible)
        self._pull = asyncio.get_running_loop().create_task(self._pulling())

    def send_event(self, event: dict[str, Any]) -> None:
        self.events.append((time.perf_counter(), event))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for _, e in self.events if e["type"] == kind]

    async def _pulling(self) -> None:
        while True:
            frame = await self.track.recv()
            self.frames.append((time.perf_counter(), int(np.abs(frame.to_ndarray()).max()) > AUDIBLE))

    def audible_since(self, since: float) -> float | None:
        return next((t for t, loud in self.frames if t >= since and loud), None)

    def stop(self) -> None:
        self._pull.cancel()
        self.track.stop()


async def trial(pipeline: Any, defaults: SessionDefaults, fragment: np.ndarray) -> dict[str, Any]:
    listener = Listener()
    session = Session("sess_backchannel", listener, PacedPlayout(listener.track), pipeline, defaults,
                      ["default"], "offline")
    try:
        await speak(session, natural_speech(QUESTION, RATE, 0.3, 0.0))
        await silence_until(session, lambda: listener.audible_since(0.0) is not None, 15.0)
        started = listener.audible_since(0.0)
        if started is None:
            return {"outcome": "unanswered"}
        await silence_until(session, lambda: time.perf_counter() - started >= PLAYED_BEFORE_S, 5.0)
        await speak(session, fragment)
        # The fragment's last sound, not the end of the clip: espeak-ng ends its clips in silence.
        loud = np.flatnonzero(np.abs(fragment) > 0.02)
        said = time.perf_counter() - (len(fragment) - (loud[-1] if len(loud) else 0)) / RATE
        await silence_until(session, lambda: bool(listener.of("response.done")), AFTER_S)
        done = listener.of("response.done")
        if done and done[0]["response"]["status"] == "cancelled":
            return {"outcome": "interrupted"}
        resumed = listener.audible_since(said)
        return {"outcome": "went on" if resumed is not None else "silent",
                "resume_ms": None if resumed is None else round((resumed - said) * 1000)}
    finally:
        await session.close()
        listener.stop()


async def run() -> dict[str, Any]:
    preset = read_yaml(ROOT / "configs" / "offline.yaml")
    defaults = SessionDefaults(**preset["session"])
    await asyncio.to_thread(prepare_lm, lm_source("packaged"))
    pipeline = await start_pipeline(parse_pipeline_config(preset["pipeline"]), mode="process")
    trials: list[dict[str, Any]] = []
    try:
        for kind, phrases in (("backchannel", BACKCHANNELS), ("interruption", INTERRUPTIONS)):
            for phrase in phrases:
                for voice, say in VOICES.items():
                    result = await trial(pipeline, defaults, say(phrase, RATE, 0.0, 0.0))
                    trials.append({"kind": kind, "phrase": phrase, "voice": voice, **result})
                    print(kind, phrase, voice, result, flush=True)
    finally:
        await pipeline.close()
    return {"machine": machine(), "backchannel_max_ms": defaults.backchannel_max_ms,
            "summary": summarise(trials), "trials": trials}


def summarise(trials: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, right in (("backchannel", "went on"), ("interruption", "interrupted")):
        mine = [t for t in trials if t["kind"] == kind]
        resumes = [t["resume_ms"] for t in mine if t.get("resume_ms") is not None]
        out[kind] = {
            "n": len(mine), "right": sum(t["outcome"] == right for t in mine),
            "outcomes": {o: sum(t["outcome"] == o for t in mine) for o in sorted({t["outcome"] for t in mine})},
            "resume_ms_median": round(statistics.median(resumes)) if resumes else None,
            "resume_ms_p90": round(float(np.percentile(resumes, 90))) if resumes else None,
        }
    return out


def plot(results: dict[str, Any], path: Any) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    kinds = list(results["summary"])
    left.bar(kinds, [results["summary"][k]["right"] / results["summary"][k]["n"] for k in kinds])
    left.set_ylim(0, 1)
    left.set_ylabel("handled as intended (share)")
    left.set_title("went on after a backchannel / stopped")
    resumes = [t["resume_ms"] for t in results["trials"] if t.get("resume_ms") is not None]
    right.hist(resumes, bins=12)
    right.set_xlabel("end of fragment -> agent audible again (ms)")
    right.set_title("silence heard around a backchannel")
    save_figure(fig, path)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    results = asyncio.run(run())
    rows = [[kind, f"{s['right']}/{s['n']}", s["outcomes"], s["resume_ms_median"], s["resume_ms_p90"]]
            for kind, s in results["summary"].items()]
    print(format_table(["fragment", "handled as intended", "outcomes", "resume p50 ms", "p90"], rows))
    save_results("backchannel_eval", results, plot)


if __name__ == "__main__":
    main()
