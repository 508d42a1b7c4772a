"""A recorded Twilio media stream, end to end: a real ``python -m duplex.serve --record-dir`` (the
toy preset, paced like a real model) and the Twilio client of tests/telephony/test_twilio.py,
which streams the caller's μ-law speech in real time, plays what it receives on a real-time clock,
echoes each mark when its playback reaches it and drops its buffer on ``clear``. The caller asks,
hears part of the answer, and talks over it: the recording's right channel holds the agent as the
caller heard it (the chunks whose marks came back), cut where the caller stopped hearing it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.calls import INTERRUPTION, QUESTION
from harness.server import ServerProcess, run_server, write_preset
from tests.operators.recordings import read, runs
from tests.telephony.test_twilio import twilio_call, wait_sessions_gone

CLEARED_WITHIN_S = 1.0  # the caller's voice to the end of the agent's (test_twilio's bound)
MARK_GRANULARITY_S = 0.3  # what the recording and the caller's player may differ by
ANSWER_S = 12 * 3 * 0.08  # configs/toy.yaml: 12 words of 3 frames of 80 ms


@pytest.fixture(scope="module")
def recording_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    tmp = tmp_path_factory.mktemp("twilio-recording")
    folder = tmp / "calls"
    preset = write_preset(tmp / "preset.yaml", stages={
        "thinker": {"options": {"step_delay_s": 0.2}}, "talker": {"options": {"step_delay_s": 0.05}}})
    with run_server(preset, "--record-dir", str(folder), tmp=tmp) as running:
        yield running, folder


async def test_a_twilio_call_is_recorded_with_the_agent_cut_at_the_barge_in(
        recording_server: tuple[ServerProcess, Path]) -> None:
    server, folder = recording_server
    loop = asyncio.get_running_loop()
    async with twilio_call(server) as call:
        call.say(QUESTION)
        await call.until(lambda: call.heard_seconds() >= 1.2)
        spoke_at = loop.time()
        duration = call.say(INTERRUPTION)
        await call.until(lambda: call.count("clear") >= 1)
        cleared_at = loop.time()
        heard_first = call.heard_seconds() - call.heard_seconds(since=cleared_at)
        await call.until(lambda: loop.time() > spoke_at + duration)
        await call.until(lambda: call.heard_seconds(since=spoke_at + duration) > 0.5)
    await wait_sessions_gone(server)

    (wav_path,) = folder.glob("*.wav")
    wav, lines = read(folder, wav_path.stem)  # asserts 16 kHz, 16-bit, stereo
    assert (lines[0]["kind"], lines[0]["transport"]) == ("call", "twilio"), lines[0]
    assert lines[-1]["kind"] == "end", lines[-1]
    # Left: the caller's question, then the interruption.
    caller = runs(wav[:, 0], gap_s=0.6)
    assert len(caller) == 2, caller
    (asked, _), (interrupted, _) = caller
    # Right: the first answer from after the question, cut: as long as the caller heard it (not
    # the whole answer), ending within the clear's bound of the caller's voice (the agent's
    # chunks end at their marks' echoes, the caller's audio is laid out by arrival: a few tens of
    # ms either way); then the answer to the interruption.
    agent = runs(wav[:, 1], gap_s=0.6)
    assert len(agent) == 2, agent
    (first_start, first_end), (second_start, _) = agent
    assert asked < first_start < interrupted, (caller, agent)
    assert abs((first_end - first_start) - heard_first) <= MARK_GRANULARITY_S, (agent, heard_first)
    assert first_end - first_start < ANSWER_S - 0.5, agent
    assert first_end <= interrupted + CLEARED_WITHIN_S, (caller, agent)
    assert second_start > interrupted
    transcript = [line for line in lines if line["kind"] == "transcript" and line["role"] == "assistant"]
    assert any("heard_ms" in line for line in transcript), transcript  # the barge-in truncated it
