"""What the audio front end (duplex/media/front_end.py) changes for turn-taking and recognition:
the agent's residual echo as false barge-ins, and noise as false turns and recognition errors.

    python -m evaluation.echo_eval [--minutes 2] [--noise-s 30]

Everything runs as a session runs it, on a clock of its own: a real
:class:`~duplex.media.front_end.AudioFrontEnd` (echo cancellation, noise suppression, the talk
gate) feeding a real server_vad :class:`~duplex.turns.server_vad.TurnDetector` (silero, OpenAI's
defaults), in 20 ms packets.

- **Echo**: the simulated speakerphone call of evaluation/echo_cost.py (the agent speaks 4 s of
  every 10; its echo comes back -6 dB through a synthetic room ``delay`` later) at 100, 250 and
  500 ms, with and without cancellation. The VAD runs with the session's echo guard (its threshold
  raised for the first ``echo_guard_ms`` of each answer). Counted while the agent speaks and
  :data:`~duplex.media.front_end.ECHO_TAIL_S` after: *onsets* (each pauses a paced agent) and
  *barge-ins* (speech lasting ``interrupt_min_speech_ms``: each would cut the answer), per minute
  of agent speech. The agent goes on speaking after each (a real one would have stopped), so these
  count every would-be interruption.
- **Noise**: white noise and babble (6 espeak-ng voices, harness/noise.py) at 0, 5, 10 and 20 dB
  below the questions' speech level, with noise_reduction off, ``near_field`` (WebRTC's
  suppressor and the talk gate) and ``far_field`` (the suppressor and its gain control). Noise
  alone: onsets per minute and the share of the time the VAD holds a turn open. Each of four
  questions (piper's natural voice) after 4 s of that noise: whether a turn was committed for it,
  and the WER of what Whisper tiny.en (the offline preset's recogniser) makes of the turn's audio
  (1.0 where no turn ended: the recogniser never gets it).

Prints tables and writes ``evaluation/results/echo_eval.json`` and ``echo_eval.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from duplex.media.front_end import ECHO_TAIL_S
from duplex.settings import SessionDefaults
from duplex.turns.config import TurnDetection
from duplex.turns.server_vad import SpeechStarted, SpeechStopped, TurnDetector
from evaluation.bench_common import format_table, machine, save_figure, save_results
from evaluation.echo_cost import AGENT_S, PACKET, RATE, TURN_S, process_call, simulated_call
from harness.noise import at_snr, babble, speech_level, under, white_noise
from harness.speech import natural_speech
from harness.wer import wer

DELAYS_MS = (100, 250, 500)
SNRS_DB = (0, 5, 10, 20)
REDUCTIONS: dict[str, dict[str, Any]] = {
    "off": {"echo_cancellation": False},
    "near_field": {"echo_cancellation": False, "noise_reduction": {"type": "near_field"}},
    "far_field": {"echo_cancellation": False, "noise_reduction": {"type": "far_field"}},
}
QUESTIONS = ("What time does the library open tomorrow morning?",
             "Please book a table for four people at seven tonight.",
             "How long does it take to drive to the airport?",
             "Can you remind me to call my mother on Friday?")
LEAD_S = 4.0  # noise alone before each question


def detect(audio: np.ndarray, guard_until: np.ndarray | None = None) -> list[tuple[str, int, Any]]:
    """server_vad over ``audio`` in 20 ms packets: ("start", sample, None) at each onset,
    ("confirmed", sample, None) when a turn's speech reached interrupt_min_speech_ms,
    ("stop", sample, SpeechStopped) at each end. ``guard_until[i]``: the echo guard is on for the
    packet starting at sample ``i`` (the session's raised threshold while an answer is young)."""
    defaults = SessionDefaults()
    detector = TurnDetector(TurnDetection(type="server_vad"))
    events: list[tuple[str, int, Any]] = []
    confirmed = False
    for i in range(0, len(audio) - PACKET + 1, PACKET):
        guarded = guard_until is not None and guard_until[i]
        detector.threshold_override = defaults.echo_guard_threshold if guarded else None
        for event in detector.process(audio[i : i + PACKET]):
            if isinstance(event, SpeechStarted):
                events.append(("start", event.start_ms * RATE // 1000, None))
                confirmed = False
            elif isinstance(event, SpeechStopped):
                events.append(("stop", event.end_ms * RATE // 1000, event))
        if detector.in_speech and not confirmed and \
                detector.speech_ms >= defaults.interrupt_min_speech_ms:
            confirmed = True
            events.append(("confirmed", i + PACKET, None))
    return events


def echo_barge_ins(minutes: float, delay_ms: int, cancel: bool) -> dict[str, float]:
    agent48, _, mic = simulated_call(minutes, delay_ms / 1000, noise=False)
    out, _ = process_call(agent48, mic, {} if cancel else {"echo_cancellation": False})
    speaking = np.zeros(len(mic), dtype=bool)  # the agent's audio and its echo's tail
    guard = np.zeros(len(mic), dtype=bool)
    for turn in range(int(minutes * 60 / TURN_S)):
        at = int((turn * TURN_S + TURN_S - AGENT_S) * RATE)
        speaking[at : at + int((AGENT_S + delay_ms / 1000 + ECHO_TAIL_S) * RATE)] = True
        guard[at : at + SessionDefaults().echo_guard_ms * RATE // 1000] = True
    events = detect(out, guard)
    agent_minutes = int(minutes * 60 / TURN_S) * AGENT_S / 60
    onsets = sum(1 for kind, at, _ in events if kind == "start" and speaking[min(at, len(mic) - 1)])
    barge_ins = sum(1 for kind, at, _ in events
                    if kind == "confirmed" and speaking[min(at, len(mic) - 1)])
    return {"onsets_per_agent_minute": round(onsets / agent_minutes, 2),
            "barge_ins_per_agent_minute": round(barge_ins / agent_minutes, 2)}


def noise_of(kind: str, seconds: float) -> np.ndarray:
    return babble(seconds, voices=6) if kind == "babble" else white_noise(seconds, RATE)


def noise_alone(kind: str, snr_db: float, reduction: str, seconds: float) -> dict[str, float]:
    """The noise alone, ``snr_db`` below the questions' speech level."""
    level = speech_level(np.concatenate([natural_speech(q, RATE, 0.0, 0.0) for q in QUESTIONS]))
    noise = at_snr(noise_of(kind, seconds), level, snr_db)
    out, _ = process_call(np.zeros(len(noise) * 3, np.float32), noise, REDUCTIONS[reduction])
    events = detect(out)
    onsets = [at for k, at, _ in events if k == "start"]
    stops = [at for k, at, _ in events if k == "stop"]
    in_turn = sum(min(stops[i] if i < len(stops) else len(out), len(out)) - start
                  for i, start in enumerate(onsets))
    return {"onsets_per_minute": round(len(onsets) / (seconds / 60), 2),
            "in_turn_percent": round(100 * in_turn / len(out), 1)}


def recognised(kind: str, snr_db: float, reduction: str, hear: Any) -> dict[str, float]:
    errors, committed = [], 0
    for question in QUESTIONS:
        speech = natural_speech(question, RATE, LEAD_S, 1.0)
        heard = speech + under(speech, noise_of(kind, len(speech) / RATE + 1), snr_db)
        out, _ = process_call(np.zeros(len(heard) * 3, np.float32), heard, REDUCTIONS[reduction])
        turns = [e for k, at, e in detect(out) if k == "stop" and at > LEAD_S * RATE]
        if turns:
            committed += 1
            errors.append(wer(question, hear(turns[-1].audio, RATE)))
        else:
            errors.append(1.0)
    return {"wer": round(float(np.mean(errors)), 3), "turns": f"{committed}/{len(QUESTIONS)}"}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (echo, onsets, errors) = plt.subplots(1, 3, figsize=(15, 4.5))
    x = np.arange(len(DELAYS_MS))
    for offset, (name, label) in ((-0.2, ("on", "cancellation on")),
                                  (0.2, ("off", "cancellation off"))):
        values = [results["echo"][str(d)][name]["barge_ins_per_agent_minute"] for d in DELAYS_MS]
        echo.bar(x + offset, values, 0.4, label=label)
        for i, value in enumerate(values):
            echo.annotate(f"{value:g}", (i + offset, value), ha="center", va="bottom", fontsize=8)
    echo.set_xticks(x, [f"{d} ms" for d in DELAYS_MS])
    echo.set_xlabel("echo delay")
    echo.set_ylabel("false barge-ins per minute of agent speech")
    echo.set_title("Residual echo")
    echo.legend()
    for kind, style in (("white", "--"), ("babble", "-")):
        for reduction in REDUCTIONS:
            rows = [results["noise"][kind][reduction][str(s)] for s in SNRS_DB]
            label = f"{kind}, {reduction}"
            onsets.plot(SNRS_DB, [r["in_turn_percent"] for r in rows], style, marker="o",
                        label=label)
            errors.plot(SNRS_DB, [r["wer"] for r in rows], style, marker="o", label=label)
    onsets.set_xlabel("SNR (dB)")
    onsets.set_ylabel("% of noise-only time the VAD holds a turn open")
    onsets.set_title("False turns in noise alone")
    onsets.legend(fontsize=7)
    errors.set_xlabel("SNR (dB)")
    errors.set_ylabel("WER (Whisper tiny.en; 1 where no turn ended)")
    errors.set_title("The question in noise")
    errors.axhline(0.35, color="grey", lw=0.8)
    errors.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="simulated call length")
    parser.add_argument("--noise-s", type=float, default=30.0, help="noise alone, per condition")
    args = parser.parse_args()
    from pipeline.models.offline.asr import Transcriber
    from pipeline.models.offline.sources import asr_model_dir

    results: dict[str, Any] = {"machine": machine(), "minutes": args.minutes,
                               "noise_s": args.noise_s, "echo": {}, "noise": {}}
    rows = []
    for delay_ms in DELAYS_MS:
        on = echo_barge_ins(args.minutes, delay_ms, cancel=True)
        off = echo_barge_ins(args.minutes, delay_ms, cancel=False)
        results["echo"][str(delay_ms)] = {"on": on, "off": off}
        rows.append([delay_ms, on["onsets_per_agent_minute"], on["barge_ins_per_agent_minute"],
                     off["onsets_per_agent_minute"], off["barge_ins_per_agent_minute"]])
    print(format_table(["echo delay ms", "onsets/min (on)", "barge-ins/min (on)",
                        "onsets/min (off)", "barge-ins/min (off)"], rows))
    hear = Transcriber(asr_model_dir("packaged"), threads=1).transcribe
    rows = []
    for kind in ("white", "babble"):
        results["noise"][kind] = {}
        for reduction in REDUCTIONS:
            results["noise"][kind][reduction] = {}
            for snr in SNRS_DB:
                measured = {**noise_alone(kind, snr, reduction, args.noise_s),
                            **recognised(kind, snr, reduction, hear)}
                results["noise"][kind][reduction][str(snr)] = measured
                rows.append([kind, reduction, snr, measured["onsets_per_minute"],
                             measured["in_turn_percent"], measured["turns"], measured["wer"]])
                print(rows[-1], flush=True)
    print()
    print(format_table(["noise", "noise_reduction", "SNR dB", "false onsets/min",
                        "% in a false turn", "turns", "WER"], rows))
    save_results("echo_eval", results, plot)


if __name__ == "__main__":
    main()
