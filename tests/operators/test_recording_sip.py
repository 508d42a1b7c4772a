"""A recorded SIP call, end to end: the server's real SIP stack and call binding (``SipServer`` +
``SipAgent``, as ``duplex.serve --sip-port --record-dir`` wires them) in this process, a pipeline
fake that answers in espeak speech (tests/e2e/speakerphone.py), and the RTP phone of
tests/e2e/test_echo_sip.py with a handset's microphone (no echo): it sends its 20 ms of caller
speech and plays the agent's RTP as it comes, 20 ms a tick.

The caller asks, hears part of the answer and talks over it. The recording's left channel holds
the caller's question and interruption where they were said; the right channel the agent as the
caller heard it, cut where the caller stopped hearing it; its log says the call was SIP, and the
answer's transcript was truncated to what was heard.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.speech import speech
from tests.e2e.speakerphone import (
    INTERRUPTION,
    QUESTION,
    Microphone,
    answer_span_s,
    voiced_span_s,
)
from tests.e2e.test_echo_sip import FRAME, RATE, TIMEOUT, SpeakerphoneCaller, sip_call
from tests.operators.recordings import read, runs
from tests.telephony.peers import wait_until

HEARD_BEFORE_S = 1.2  # of the answer, before the caller talks over it
CLEARED_WITHIN_S = 1.0  # the caller's voice to the end of the agent's (the barge-in's bound)
PLAYER_SLACK_S = 0.3  # what the recording and the phone's player may differ by


def heard_s(phone: SpeakerphoneCaller) -> float:
    return voiced_span_s(phone.heard, RATE)


async def test_a_sip_call_is_recorded_with_the_agent_cut_at_the_barge_in(tmp_path: Path) -> None:
    folder = tmp_path / "calls"
    folder.mkdir()
    recorded = sip_call(tmp_path, "--record-dir", str(folder), rtp_ports=(44300, 44399))
    async with recorded as (phone, pipeline):
        phone.mic = Microphone(RATE, 0.0, echo=False)  # a handset: no echo
        phone.mic.say(speech(QUESTION, RATE, 0.2, 0.0))
        await wait_until(lambda: heard_s(phone) >= HEARD_BEFORE_S, TIMEOUT)
        interrupted_at = len(phone.heard)  # frames, on the phone's clock
        phone.mic.say(speech(INTERRUPTION, RATE, 0.0, 0.0))
        await wait_until(lambda: pipeline.aborted, TIMEOUT)
        # The first answer stops; the second (to the interruption) is heard a while, then the
        # caller hangs up.
        await wait_until(lambda: phone.quiet_for() >= 0.6, TIMEOUT)
        cut_at = len(phone.heard)
        await wait_until(lambda: voiced_span_s(phone.heard[cut_at:], RATE) >= 0.5, TIMEOUT)
    await wait_until(lambda: list(folder.glob("*.jsonl"))
                     and '"end"' in next(folder.glob("*.jsonl")).read_text(), TIMEOUT)

    # What the phone heard of the first answer: from its first voiced frame to the interruption's
    # cut (the second answer begins after a silence).
    heard_first = voiced_span_s(phone.heard, RATE)
    assert heard_first < answer_span_s(RATE) - 0.5, heard_first  # the barge-in cut it

    (wav_path,) = folder.glob("*.wav")
    wav, lines = read(folder, wav_path.stem)  # asserts 16 kHz, 16-bit, stereo
    assert (lines[0]["kind"], lines[0]["transport"]) == ("call", "sip"), lines[0]
    assert lines[-1]["kind"] == "end", lines[-1]
    caller = runs(wav[:, 0], gap_s=0.6)
    assert len(caller) == 2, caller  # the question, then the interruption
    (asked, _), (interrupting, _) = caller
    agent = runs(wav[:, 1], gap_s=0.6)
    assert len(agent) == 2, agent  # the first answer, cut; the second, until the hang-up
    (first_start, first_end), (second_start, _) = agent
    assert asked < first_start < interrupting, (caller, agent)
    assert abs((first_end - first_start) - heard_first) <= PLAYER_SLACK_S, (agent, heard_first)
    assert first_end <= interrupting + CLEARED_WITHIN_S, (caller, agent)
    assert second_start > interrupting
    # The phone's clock and the recording's agree on when the caller began to talk over it.
    phone_first = next(i for i, f in enumerate(phone.heard) if np.sqrt(np.mean(f ** 2)) > 0.015)
    phone_interrupting = (interrupted_at - phone_first) * FRAME / RATE
    assert abs((interrupting - first_start) - phone_interrupting) <= PLAYER_SLACK_S, \
        (caller, agent, phone_interrupting)
    transcript = [line for line in lines if line["kind"] == "transcript" and line["role"] == "assistant"]
    assert any("heard_ms" in line for line in transcript), transcript  # the barge-in truncated it
