"""How fast the default preset answers over a real WebRTC call, stage by stage, for one caller and
for 2 and 4 callers who finish speaking at the same moment; and whether it cuts anyone off.

    python -m evaluation.answer_latency [--preset offline] [--callers 1,2,4] [--samples 8]
        [--natural] [--name answer_latency]

A real ``duplex.serve`` (the preset as shipped: semantic_vad, speculative start) runs under the
server probe (evaluation/server_probe.py: CLOCK_MONOTONIC times of public calls inside the server),
and real aiortc calls (``POST /v1/realtime/calls``) speak espeak-ng questions in four voices that
the turn policy was *not* tuned on (evaluation/turn_utterances.py tunes on others). Per turn, from
the moment the caller's last sample left its microphone (end of speech):

- decision: the session's end-of-turn decision (``input_audio_buffer.speech_stopped`` sent);
- transcript: the answering request brought the user's recognised words;
- first token: its first answer text;
- first clause: its first synthesised audio (the first clause voiced) reached the session;
- on the wire: the first audible 20 ms frame left the call's outbound track (to the encoder);
- heard: the client received it (Opus, RTP over loopback, the client's jitter buffer).

``--natural``: the questions in piper's natural voice instead, at a rate the policy was not tuned
on (length scale 1.0; tuning used 0.9 and 1.15), which Whisper hears far better than espeak-ng: it
separates what the turn policy makes of the words from what misheard words make of it (results
under ``--name``).

A request submitted before the decision is a speculative answer adopted at the decision: its
transcript, first token and first clause may come before the decision, and its first audio then
goes on the wire at the decision. For N callers, each round has every caller finish a question at
the same moment (each starts its question that much earlier); ``--samples`` turns per level.

Also: two sentences with a pause of 0.8-0.9 s inside (an order, a phone number), spoken alone in
each voice: a turn ended inside the pause is a cut (counted; the target is none).

Prints a table per level (p50/p90, ms) and writes evaluation/results/answer_latency.{json,png}.
Needs the offline extra (``make install``), espeak-ng and sox; re-executes itself in a network
namespace holding only loopback, as the tests do. Nothing here holds state between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import yaml

from evaluation.bench_common import (
    RESULTS_DIR,
    ROOT,
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
)
from evaluation.duplex_analysis import Probe
from evaluation.duplex_bench import probed_server
from evaluation.duplex_calls import AUDIBLE, call_id, open_call, speak, trimmed
from harness.calls import Call, hang_up
from harness.server import ServerProcess
from harness.speech import natural_speech, speech, speech_with_pauses
from harness.wer import wer

matplotlib.use("Agg")
import matplotlib.pyplot as plt

NAME = "answer_latency"
RATE = 48000
# (espeak-ng voice, words a minute): none of them is in turn_utterances.VOICES (the tuning set).
VOICES = (("en-gb-scotland+m2", 155), ("en-029+f3", 150), ("en-us-nyc+m4", 165),
          ("en-gb-x-rp+f1", 145))
QUESTIONS = (
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    "What is frozen water called?",
    "What color is the sky on a clear day?",
    "Can you recommend a good book?",
    "How do I make a cup of tea?",
    "Tell me something about the moon.",
    "What do bees make?",
)
PAUSED = ((("I would like to order", "a large pizza with mushrooms."), (850,)),
          (("My phone number is five five five", "one two three four."), (900,)))
STAGES = ("decision", "transcript", "first_token", "first_clause", "wire", "heard")
TARGET_MS = {1: 600, 4: 1000}
ANSWER_TIMEOUT_S = 60.0


NATURAL = ("piper joe, length scale 1.0", 0)


def question(text: str, voice: tuple[str, int]) -> np.ndarray:
    if voice == NATURAL:
        return trimmed(natural_speech(text, RATE, 0.0, 0.0, length_scale=1.0))
    return trimmed(speech(text, RATE, 0.0, 0.0, voice=voice[0], wpm=voice[1]))


@dataclass
class Said:
    """One thing a caller said in a round: what, in which voice, when its speech started and
    ended (client clock = the probe's), and the call's turn count before it."""

    call: Call
    text: str
    voice: str
    started: float
    ended: float


def count(call: Call, kind: str) -> int:
    return sum(1 for e in call.events() if e["type"] == kind)


async def answered(call: Call, stops_before: int) -> None:
    """Until the turn after ``stops_before`` decisions has been decided and answered to its end
    (an answer into a pause is cut by the speech after it: its audio is cleared, not stopped)."""
    def done() -> bool:
        stops = count(call, "input_audio_buffer.speech_stopped")
        ended = count(call, "output_audio_buffer.stopped") + count(call, "output_audio_buffer.cleared")
        return (stops > stops_before and count(call, "response.done") >= stops
                and ended >= count(call, "output_audio_buffer.started"))

    await call.peer.wait_for(done, ANSWER_TIMEOUT_S)


async def say_together(calls: list[Call], lines: list[tuple[str, np.ndarray, str]]) -> list[Said]:
    """Each call says its line so that all of them end at the same moment; returns once every
    line was answered to its end."""
    longest = max(len(samples) for _, samples, _ in lines)
    stops = [count(call, "input_audio_buffer.speech_stopped") for call in calls]

    async def one(call: Call, text: str, samples: np.ndarray, voice: str, stops_before: int) -> Said:
        # The stimulus's timing, not a wait for anything: shorter lines start later.
        await asyncio.sleep((longest - len(samples)) / RATE)
        utterance = speak(call, samples)
        started, ended = await utterance.started, await utterance.ended
        await answered(call, stops_before)
        return Said(call, text, voice, started, ended)

    return list(await asyncio.gather(*(one(c, *line, s) for c, line, s in zip(calls, lines, stops))))


async def run_phases(server: ServerProcess, levels: list[int], samples: int,
                     voices: tuple[tuple[str, int], ...]) -> dict[str, Any]:
    warm = await open_call(server)
    await say_together([warm], [(QUESTIONS[0], question(QUESTIONS[0], voices[0]), "warm-up")])
    await hang_up(server, warm)
    paused = []
    for voice in VOICES:
        call = await open_call(server)
        for pieces, pauses in PAUSED:
            samples_ = trimmed(speech_with_pauses(pieces, pauses, RATE, 0.0, 0.0, *voice))
            paused += await say_together([call], [(" ".join(pieces), samples_, voice[0])])
        await hang_up(server, call)
    said: dict[int, list[Said]] = {}
    for level in levels:
        calls = list(await asyncio.gather(*(open_call(server) for _ in range(level))))
        said[level] = []
        for round_ in range(-(-samples // level)):
            lines = []
            for i in range(level):
                text, voice = QUESTIONS[(round_ * level + i) % len(QUESTIONS)], voices[i % len(voices)]
                lines.append((text, question(text, voice), voice[0]))
            said[level] += await say_together(calls, lines)
        await asyncio.gather(*(hang_up(server, call) for call in calls))
    return {"paused": paused, "levels": said}


def first_after(times: list[tuple[float, str, str | None]], kind: str, since: float) -> float | None:
    return next((t for t, k, _ in times if k == kind and t >= since), None)


def turn_times(probe: Probe, said: Said) -> dict[str, Any]:
    """The stages of one answered turn, in ms after the end of speech (see module doc)."""
    call = call_id(said.call)
    track = probe.track_of[call]
    decision = first_after(probe.events[call], "input_audio_buffer.speech_stopped", said.started)
    assert decision is not None, f"{said.text!r}: no decision"
    enqueue = next(r for r in probe.enqueues if r["track"] == track and r["t"] >= decision)
    request = probe.request_of_item[enqueue["item"]]
    transcript_at, transcript = probe.transcripts.get(request, (None, ""))
    heard = next((t for t, s, _ in said.call.peer.frames
                  if t > decision and np.abs(s).max() > AUDIBLE), None)
    at = {"decision": decision, "transcript": transcript_at, "first_token": probe.first_text.get(request),
          "first_clause": probe.first_audio.get(request, (None, ""))[0],
          "wire": probe.first_frame(track, decision, audible=True), "heard": heard}
    return {"question": said.text, "voice": said.voice, "transcript": transcript,
            "wer": round(wer(said.text, transcript), 3),
            "speculative": probe.submits[request] < decision,
            "ms": {k: None if t is None else round((t - said.ended) * 1000) for k, t in at.items()}}


def cuts(probe: Probe, said: Said) -> int:
    """Turns ended while ``said`` was still being said (inside its pause)."""
    return sum(1 for t, k, _ in probe.events[call_id(said.call)]
               if k == "input_audio_buffer.speech_stopped" and said.started < t < said.ended)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None}
    return {"p50": round(statistics.median(values)),
            "p90": round(float(np.percentile(values, 90)))}


def analyse(probe: Probe, phases: dict[str, Any]) -> dict[str, Any]:
    levels = {}
    for level, said in phases["levels"].items():
        turns = [turn_times(probe, s) for s in said]
        levels[str(level)] = {
            "stages_ms": {stage: percentiles([t["ms"][stage] for t in turns if t["ms"][stage] is not None])
                          for stage in STAGES},
            "speculative": sum(t["speculative"] for t in turns),
            "wer_mean": round(statistics.mean(t["wer"] for t in turns), 3),
            "turns": turns,
        }
    paused = [{"said": s.text, "voice": s.voice, "cuts": cuts(probe, s)} for s in phases["paused"]]
    return {"levels": levels, "mid_sentence_cuts": sum(p["cuts"] for p in paused),
            "paused_turns": paused}


def plot(result: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    levels = list(result["levels"])
    width = 0.8 / len(levels)
    x = np.arange(len(STAGES))
    for i, level in enumerate(levels):
        stages = result["levels"][level]["stages_ms"]
        p50 = [stages[s]["p50"] or 0 for s in STAGES]
        p90 = [stages[s]["p90"] or 0 for s in STAGES]
        bars = ax.bar(x + i * width, p50, width, label=f"{level} caller{'s' if level != '1' else ''} p50")
        ax.scatter(x + i * width, p90, marker="_", s=120, color=bars.patches[0].get_facecolor(),
                   label=f"{level} p90")
    for level, target in TARGET_MS.items():
        ax.axhline(target, linestyle=":", color="grey")
        ax.text(len(STAGES) - 0.5, target, f"target, {level} caller{'s' if level > 1 else ''}",
                va="bottom", ha="right", fontsize=8)
    ax.set_xticks(x + width * (len(levels) - 1) / 2, [s.replace("_", " ") for s in STAGES])
    ax.set_ylabel("ms after the end of speech")
    ax.set_title(f"Answer latency over WebRTC, {result['preset']} preset "
                 f"({result['machine']['cpus']} CPUs); mid-sentence cuts: {result['mid_sentence_cuts']}")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def write_preset(preset: str, sessions: int) -> Path:
    data = yaml.safe_load((ROOT / "configs" / f"{preset}.yaml").read_text())
    data["max_sessions"] = max(sessions, data.get("max_sessions", 8))
    path = RESULTS_DIR / f"{NAME}_preset.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main() -> None:
    run_in_loopback_namespace("evaluation.answer_latency")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="offline")
    p.add_argument("--callers", default="1,2,4")
    p.add_argument("--samples", type=int, default=8, help="answered turns per level")
    p.add_argument("--natural", action="store_true", help="questions in piper's voice (module doc)")
    p.add_argument("--name", default=NAME, help="results file name")
    args = p.parse_args()
    voices = (NATURAL,) if args.natural else VOICES
    levels = [int(n) for n in args.callers.split(",")]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    with probed_server(write_preset(args.preset, max(levels)), "server", NAME) as (server, probe_path):
        phases = asyncio.run(run_phases(server, levels, args.samples, voices))
    result = {"preset": args.preset, "machine": machine(), "voices": [v for v, _ in voices],
              **analyse(Probe.load(probe_path), phases)}
    for level, data in result["levels"].items():
        print(f"\n{level} caller(s), ms after the end of speech "
              f"({data['speculative']}/{len(data['turns'])} speculative, WER {data['wer_mean']}):")
        print(format_table(["stage", "p50", "p90"],
                           [[s, data["stages_ms"][s]["p50"], data["stages_ms"][s]["p90"]] for s in STAGES]))
    print(f"\nmid-sentence cuts: {result['mid_sentence_cuts']} of {len(result['paused_turns'])} paused sentences")
    save_results(args.name, result, plot)


if __name__ == "__main__":
    main()
