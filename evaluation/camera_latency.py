"""What a camera costs a WebRTC call on the tiny Qwen3-Omni preset: time to first audio with 0, 1
and 4 camera pictures in the turn, the frames a second that reach the video window and the vision
tower, and the server's memory per session with the window full.

A real ``python -m duplex.serve`` (a subprocess, the tiny preset's stage processes,
``session.video``: 2 fps, 4 pictures a turn, a window of 16 at most 448 px a side) and real aiortc
clients (``harness.calls.open_call``), on loopback in a network namespace of their own:

1. **time to first audio**: one call per turn, the three kinds interleaved run by run: no camera
   (0 pictures); a still test pattern (1: the picture does not change, the turn shows the latest);
   a moving one (4: ``harness.video.TestPattern``, 320 x 240 at 30 fps, kept unscaled). The client says one
   question (espeak, ~3.5 s) and measures from the last sample it sent (``from_speech_end``: the
   turn detector's silence included) and from ``input_audio_buffer.speech_stopped`` to the first
   audible frame of the answer. The committed user item says how many pictures the turn carried
   (its ``input_image`` parts), which the model read as one video (``image_times``);
2. **frames a second**: the server's ``duplex_video_frames_total{outcome}`` over the camera calls'
   time (what reached the window, per outcome), and the image encoder's compute per turn
   (``pipeline_stage_seconds{stage="image_encoder"}``);
3. **memory**: ``--sessions`` calls at once, without camera and then with moving cameras until each
   window holds its 16 pictures: the server process's RSS (``evaluation/resource_sampler.py``) above
   its idle value, per session (beside the pictures' own bytes, ``window_pictures_mb``).

Prints tables and writes ``evaluation/results/camera_latency.json`` and ``.png``.

    python -m evaluation.camera_latency [--runs 10] [--sessions 4]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from aiortc.mediastreams import MediaStreamTrack

from evaluation.answer_latency import percentiles
from evaluation.bench_common import format_table, machine, run_in_loopback_namespace, save_results
from evaluation.duplex_calls import scrape_metrics
from evaluation.resource_sampler import ResourceSampler
from harness.calls import QUESTION, Call, hang_up, open_call
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech
from harness.video import TestPattern

VIDEO = {"fps": 2, "frames_per_turn": 4, "window_frames": 16, "max_side": 448}
CAMERA_SIZE = (320, 240)  # under max_side: kept unscaled
CAMERAS = {0: None, 1: "still", 4: "moving"}  # pictures a turn carries -> the camera that gives them
AUDIBLE = 0.02
ENCODER_SECONDS = 'pipeline_stage_seconds_sum{stage="image_encoder"}'
FRAMES = "duplex_video_frames_total"


def camera(kind: str | None) -> MediaStreamTrack | None:
    return None if kind is None else TestPattern(*CAMERA_SIZE, moving=kind == "moving")


def first_audio_after(call: Call, since: float) -> float | None:
    return next((t for t, s, _ in call.peer.frames if t > since and np.abs(s).max() > AUDIBLE), None)


async def one_turn(server: ServerProcess, pictures: int, question: np.ndarray) -> dict[str, Any]:
    """One call that asks one question with the camera that gives ``pictures``; its times."""
    before = await scrape_metrics(server.url)
    call = await open_call(server, video=camera(CAMERAS[pictures]))
    opened = time.monotonic()
    await call.mic.say(question)
    spoken = time.monotonic()
    await call.wait_event("input_audio_buffer.speech_stopped")
    stopped = time.monotonic()
    first = await call.peer.wait_for(lambda: first_audio_after(call, spoken), 60)
    await call.wait_event("response.done")
    item = next(e["item"] for e in call.events() if e["type"] == "conversation.item.done"
                and e["item"]["role"] == "user")
    seconds = time.monotonic() - opened
    await hang_up(server, call)
    after = await scrape_metrics(server.url)
    return {"from_speech_end": first - spoken, "from_speech_stopped": first - stopped,
            "pictures": sum(c["type"] == "input_image" for c in item["content"]),
            "camera_s": seconds if CAMERAS[pictures] else 0.0,
            "encoder_s": after.get(ENCODER_SECONDS, 0.0) - before.get(ENCODER_SECONDS, 0.0),
            "frames": {k: after[k] - before.get(k, 0.0) for k in after if k.startswith(FRAMES + "{")}}


async def latency(server: ServerProcess, runs: int) -> dict[str, Any]:
    question = speech(QUESTION, 48000, 0.3, 0.0)
    for pictures in CAMERAS:  # warm-up: first calls load kernels and caches
        await one_turn(server, pictures, question)
    turns: dict[int, list[dict[str, Any]]] = {n: [] for n in CAMERAS}
    for _ in range(runs):
        for pictures in CAMERAS:
            turns[pictures].append(await one_turn(server, pictures, question))
    out: dict[str, Any] = {}
    for pictures, got in turns.items():
        frames: dict[str, float] = {}
        for turn in got:
            for key, value in turn["frames"].items():
                outcome = key.split('"')[1]
                frames[outcome] = frames.get(outcome, 0.0) + value
        camera_s = sum(t["camera_s"] for t in got)
        out[str(pictures)] = {
            "first_audio_from_speech_end_ms": percentiles([t["from_speech_end"] * 1000 for t in got]),
            "first_audio_from_speech_stopped_ms": percentiles([t["from_speech_stopped"] * 1000 for t in got]),
            "pictures_per_turn": sorted({t["pictures"] for t in got}),
            "image_encoder_ms_per_turn": round(1000 * float(np.median([t["encoder_s"] for t in got])), 1),
            "window_frames_per_s": {k: round(v / camera_s, 2) for k, v in sorted(frames.items())} if camera_s else {},
        }
    return out


async def kept_pictures(server: ServerProcess) -> float:
    return (await scrape_metrics(server.url)).get(f'{FRAMES}{{outcome="kept"}}', 0.0)


async def memory(server: ServerProcess, sessions: int) -> dict[str, Any]:
    """RSS of the server process per session: calls without camera, then with full windows."""
    sampler = ResourceSampler(server)
    idle = (await sampler.take()).rss_main_mb
    out: dict[str, Any] = {"sessions": sessions, "idle_rss_mb": idle}
    fill_s = VIDEO["window_frames"] / VIDEO["fps"]
    for label, kind in (("no_camera", None), ("camera_window_full", "moving")):
        kept = await kept_pictures(server)
        calls = [await open_call(server, video=camera(kind)) for _ in range(sessions)]
        if kind is None:
            await asyncio.sleep(fill_s)  # as long as the cameras take to fill their windows
        else:
            deadline = time.monotonic() + 4 * fill_s
            while await kept_pictures(server) < kept + sessions * VIDEO["window_frames"]:
                assert time.monotonic() < deadline, "the windows did not fill"
                await asyncio.sleep(0.5)
        rss = (await sampler.take()).rss_main_mb
        out[label] = {"rss_mb": rss, "per_session_mb": round((rss - idle) / sessions, 1)}
        for call in calls:
            await hang_up(server, call)
        await asyncio.sleep(2.0)
    width, height = CAMERA_SIZE
    out["window_pictures_mb"] = round(VIDEO["window_frames"] * width * height * 3 / 2**20, 1)
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from evaluation.bench_common import save_figure

    fig, ax = plt.subplots(figsize=(6, 3.5))
    rows = results["time_to_first_audio"]
    names = list(rows)
    for k, (q, shift) in enumerate((("p50", -0.2), ("p90", 0.2))):
        ax.bar(np.arange(len(names)) + shift, [rows[n]["first_audio_from_speech_end_ms"][q] for n in names],
               width=0.4, label=q)
    ax.set_xticks(range(len(names)), [f"{n} pictures" for n in names])
    ax.set_ylabel("first audio after speech end (ms)")
    ax.legend()
    save_figure(fig, path)


async def run(runs: int, sessions: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        preset = write_preset(Path(tmp) / "preset.yaml", base="qwen3_omni_tiny", session={"video": VIDEO})
        with run_server(preset, tmp=Path(tmp)) as server:
            return {"machine": machine(), "runs": runs, "video": VIDEO,
                    "time_to_first_audio": await latency(server, runs),
                    "memory": await memory(server, sessions)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=4)
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.camera_latency")
    results = asyncio.run(run(args.runs, args.sessions))
    rows = [(n, r["pictures_per_turn"], r["first_audio_from_speech_end_ms"]["p50"],
             r["first_audio_from_speech_end_ms"]["p90"], r["first_audio_from_speech_stopped_ms"]["p50"],
             r["first_audio_from_speech_stopped_ms"]["p90"], r["image_encoder_ms_per_turn"])
            for n, r in results["time_to_first_audio"].items()]
    print(format_table(["camera pictures", "seen", "speech end p50", "p90", "speech_stopped p50", "p90",
                        "encoder ms/turn"], rows))
    for n, r in results["time_to_first_audio"].items():
        if r["window_frames_per_s"]:
            print(f"{n} pictures: frames/s reaching the window by outcome {r['window_frames_per_s']}")
    mem = results["memory"]
    print(format_table(["sessions", "camera", "server RSS MB", "per session MB"],
                       [(mem["sessions"], label, mem[label]["rss_mb"], mem[label]["per_session_mb"])
                        for label in ("no_camera", "camera_window_full")]))
    save_results("camera_latency", results, plot)


if __name__ == "__main__":
    main()
