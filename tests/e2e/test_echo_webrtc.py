"""A caller on a speakerphone over WebRTC: the app in this process (httpx's ASGI transport for the
SDP exchange), a pipeline fake that answers in espeak speech, and a real aiortc client peer whose
microphone (a paced track) hears the agent's audio it received ``DELAY_S`` later through a
synthetic room (tests/e2e/speakerphone.py), after the caller's question.

The server paces the agent's audio, so an echo heard as speech pauses it and, confirmed, cancels
the answer. With echo cancellation (the default) the answer completes; with the server's
``--no-echo-cancellation`` the agent interrupts itself.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from duplex.media.paced_track import OutboundAudioTrack
from duplex.media.pcm import float_to_pcm16
from harness.peers import ClientPeer
from harness.speech import speech
from tests.e2e.speakerphone import QUESTION, Microphone, dial, speaking_app

RATE = 48000
FRAME = RATE // 50
DELAY_S = 0.2
TIMEOUT = 30.0


class SpeakerphoneMic(OutboundAudioTrack):
    """The client's microphone, paced as a real one: the caller's words (``mic.say``), plus the
    echo of what the client's loudspeaker played (everything ``peer`` received, as it came)."""

    def __init__(self) -> None:
        super().__init__()
        self.peer: ClientPeer | None = None
        self.mic = Microphone(RATE, DELAY_S)
        self._heard = 0  # frames of the peer's played

    def next_frame(self) -> np.ndarray | None:
        played = np.zeros(FRAME, dtype=np.float32)
        if self.peer is not None and self._heard < len(self.peer.frames):
            played = self.peer.frames[self._heard][1][:FRAME]
            self._heard += 1
        return float_to_pcm16(self.mic.hear(np.pad(played, (0, FRAME - len(played)))))


async def call(tmp_path: Path, *options: str) -> list[dict]:
    """One call: the question, the answer on the speakerphone until it is done and its echo back."""
    app = speaking_app(tmp_path, *options)
    state = app.state.duplex
    mic = SpeakerphoneMic()
    peer = mic.peer = ClientPeer(mic)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://localhost") as http:
            call_id = await dial(http, peer)
            mic.mic.say(speech(QUESTION, RATE, 0.2, 0.0))
            await peer.wait_for(lambda: any(e["type"] == "response.done" for e in peer.events()),
                                TIMEOUT)
            # The echo of the answer's last frames comes back, and the VAD has had its say on it.
            until = len(peer.frames) + int((DELAY_S + 1.0) * 50)
            await peer.wait_for(lambda: len(peer.frames) >= until, TIMEOUT)
            assert (await http.post(f"/v1/realtime/calls/{call_id}/hangup")).status_code == 200
    finally:
        await peer.close()
        await state.registry.close_all()
    return peer.events()


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


async def test_webrtc_with_echo_cancellation_the_agent_answers_to_its_end(tmp_path: Path) -> None:
    events = await call(tmp_path, "--echo-cancellation")
    assert [d["response"]["status"] for d in of(events, "response.done")] == ["completed"]
    assert len(of(events, "input_audio_buffer.speech_started")) == 1  # the question only
    assert not of(events, "output_audio_buffer.cleared")


async def test_webrtc_without_echo_cancellation_the_agent_interrupts_itself(tmp_path: Path) -> None:
    """Off by default over WebRTC (browsers cancel their own echo), as with the option."""
    for options in ((), ("--no-echo-cancellation",)):
        events = await call(tmp_path, *options)
        assert of(events, "response.done")[0]["response"]["status"] == "cancelled", options
        assert len(of(events, "input_audio_buffer.speech_started")) >= 2
