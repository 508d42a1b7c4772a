"""A caller on a speakerphone over SIP: the server's real SIP stack and call binding
(``SipServer`` + ``SipAgent``, as ``duplex.serve --sip-port`` wires them) in this process, with a
pipeline fake that answers in espeak speech (tests/e2e/speakerphone.py), called by the RTP peer
and hand-driven caller of tests/telephony/peers.py. The caller's phone plays the agent's RTP as it
comes, 20 ms a tick, and its microphone hears it again ``DELAY_S`` later through a synthetic room,
after the caller's question.

The server paces the agent's audio (a paced transport), so an echo heard as speech pauses it and,
confirmed, cancels the answer. With echo cancellation (SIP's default) the answer plays to its end;
with ``--no-echo-cancellation`` the agent interrupts itself.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

from duplex.media.pcm import float_to_pcm16, pcm16_to_float, ulaw_decode, ulaw_encode
from duplex.registry import SessionRegistry
from duplex.transports.sip import SipConfig, SipServer
from duplex.transports.sip.agent import SipAgent
from duplex.transports.sip.rtp import RtpPacket
from duplex.transports.sip.sdp import parse_offer
from harness.speech import speech
from tests.e2e.speakerphone import (
    QUESTION,
    Microphone,
    SpeakingPipeline,
    answer_span_s,
    speaking_preset,
    voiced_span_s,
)
from tests.telephony.peers import RawUac, UdpPeer, sdp_offer, wait_until

pytestmark = pytest.mark.e2e

RATE = 8000
FRAME = RATE // 50  # 20 ms, G.711's packet
DELAY_S = 0.2  # loudspeaker to microphone, and back through the network
TIMEOUT = 30.0
PCMU = 0


class SpeakerphoneCaller:
    """The caller's phone on speaker (see module doc): every 20 ms its loudspeaker plays the next
    packet the agent sent (a FIFO: both ends tick at 20 ms) and its microphone's 20 ms goes out."""

    def __init__(self, rtp: UdpPeer, agent: tuple[str, int]) -> None:
        self.rtp = rtp
        self.agent = agent
        self.mic = Microphone(RATE, DELAY_S)
        self.heard: list[np.ndarray] = []  # what the loudspeaker played, 20 ms a frame
        self._arrived: deque[np.ndarray] = deque()  # received, not played yet

    def quiet_for(self) -> float:
        """Seconds since the loudspeaker last played speech (0 before it ever did)."""
        voiced = [i for i, f in enumerate(self.heard) if np.sqrt(np.mean(f ** 2)) > 0.015]
        return (len(self.heard) - 1 - voiced[-1]) * FRAME / RATE if voiced else 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        for seq in range(1 << 30):
            for data, _ in self.rtp.drain():
                packet = RtpPacket.parse(data)
                if packet is not None and packet.payload_type == PCMU:
                    self._arrived.append(pcm16_to_float(ulaw_decode(packet.payload)))
            played = self._arrived.popleft() if self._arrived else np.zeros(FRAME, np.float32)
            self.heard.append(played)
            payload = ulaw_encode(float_to_pcm16(self.mic.hear(played)))
            self.rtp.send(RtpPacket(PCMU, seq & 0xFFFF, seq * FRAME, 0x5EC0, payload).serialise(),
                          self.agent)
            due += FRAME / RATE
            await asyncio.sleep(max(0.0, due - loop.time()))  # a microphone's pace


@asynccontextmanager
async def sip_call(tmp_path: Path, *options: str, rtp_ports: tuple[int, int] = (44100, 44199),
                   ) -> AsyncIterator[tuple[SpeakerphoneCaller, SpeakingPipeline]]:
    """A call to the server's SIP stack (``options``: the command line's) answered with a
    :class:`SpeakingPipeline`: the phone runs for the block, then hangs up (BYE) and everything
    is closed."""
    settings = speaking_preset(tmp_path, *options).settings
    pipeline = SpeakingPipeline()
    server = SipServer(SipAgent(settings, SessionRegistry(settings.max_sessions), lambda: pipeline,
                                "speaking"),
                       SipConfig(port=0, rtp_ports=rtp_ports))
    await server.start()
    uac = await RawUac.open()
    uac.server = ("127.0.0.1", server.port)
    rtp = await UdpPeer.open()
    phone_task: asyncio.Task[None] | None = None
    try:
        uac.request("INVITE", body=sdp_offer(rtp.port, formats="0 101"))
        ok = await uac.response(200)
        uac.request("ACK", call_id=uac.call_id, to_tag=ok.to_tag)
        (line,) = parse_offer(ok.body.decode())  # the answer's audio: where the agent takes RTP
        phone = SpeakerphoneCaller(rtp, (line.address or "127.0.0.1", line.port))
        phone_task = asyncio.create_task(phone.run())
        yield phone, pipeline
        uac.request("BYE", call_id=uac.call_id, cseq=2, to_tag=ok.to_tag)
        await uac.response(200)
    finally:
        if phone_task is not None:
            phone_task.cancel()
            await asyncio.gather(phone_task, return_exceptions=True)
        rtp.close()
        uac.close()
        await server.close()


async def call(tmp_path: Path, *options: str) -> tuple[SpeakerphoneCaller, SpeakingPipeline]:
    """One call: the question, then the answer on the speakerphone until it ended (completed or
    cut) and its echo had time to come back; the caller and the pipeline fake."""
    async with sip_call(tmp_path, *options) as (phone, pipeline):
        phone.mic.say(speech(QUESTION, RATE, 0.2, 0.0))
        await wait_until(lambda: pipeline.requests, TIMEOUT)
        # The answer ended (to its end, or cut) and its echo came back and was heard or not.
        await wait_until(lambda: phone.quiet_for() >= DELAY_S + 1.0 or len(pipeline.requests) > 1,
                         TIMEOUT)
    return phone, pipeline


async def test_sip_with_echo_cancellation_the_agent_answers_to_its_end(tmp_path: Path) -> None:
    phone, pipeline = await call(tmp_path)
    assert not pipeline.aborted, pipeline.aborted
    assert len(pipeline.requests) == 1
    heard = voiced_span_s(phone.heard, RATE)
    assert heard >= answer_span_s(RATE) - 0.2, (heard, answer_span_s(RATE))


async def test_sip_without_echo_cancellation_the_agent_interrupts_itself(tmp_path: Path) -> None:
    phone, pipeline = await call(tmp_path, "--no-echo-cancellation")
    assert pipeline.aborted[:1] == [pipeline.requests[0].request_id]
    heard = voiced_span_s(phone.heard, RATE)
    assert heard < answer_span_s(RATE) - 1.0, (heard, answer_span_s(RATE))
