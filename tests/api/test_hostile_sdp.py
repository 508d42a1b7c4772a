"""Offers with more than one audio stream and the events channel: a camera, a second microphone,
a second data channel, a foreign application protocol. RFC 3264 §6: the answer rejects each of
those sections (port 0, in its place, out of every BUNDLE group) and the call goes on with its
audio; the server never makes a track for a rejected section. Real aiortc peers on both sides
(the client's own offer with foreign sections grafted in, as a browser with a camera would send),
in process and through ``POST /v1/realtime/calls`` of the real server."""

from __future__ import annotations

import logging

import httpx
from aiortc import RTCSessionDescription
from aiortc.mediastreams import AudioStreamTrack

from duplex.transports.webrtc.peer import CallPeer
from duplex.transports.webrtc.sdp import plan_answer
from harness.calls import TIMEOUT, Call
from harness.mic import ScriptedMic
from harness.peers import LOOPBACK, ClientPeer, Recorder
from harness.server import ServerProcess
from harness.speech import speech
from tests.api.helpers import AUTH

log = logging.getLogger(__name__)

# Foreign sections, by mid. The camera goes before the client's audio (so that it heads the BUNDLE
# group: the server must not take it as the bundle's transport); the others go after.
CAMERA = ("cam", ["m=video 9 UDP/TLS/RTP/SAVPF 96 97", "c=IN IP4 0.0.0.0", "a=sendrecv",
                  "a=mid:cam", "a=rtcp-mux", "a=rtpmap:96 VP8/90000", "a=rtpmap:97 H264/90000"])
SECOND_MIC = ("mic2", ["m=audio 9 UDP/TLS/RTP/SAVPF 111 0", "c=IN IP4 0.0.0.0", "a=sendonly",
                       "a=mid:mic2", "a=rtcp-mux", "a=rtpmap:111 opus/48000/2"])
SECOND_CHANNEL = ("data2", ["m=application 9 UDP/DTLS/SCTP webrtc-datachannel", "c=IN IP4 0.0.0.0",
                            "a=mid:data2", "a=sctp-port:5000"])
FLOOR_CONTROL = ("bfcp", ["m=application 9 TCP/BFCP *", "c=IN IP4 0.0.0.0", "a=mid:bfcp"])
AFTER = [SECOND_MIC, SECOND_CHANNEL, FLOOR_CONTROL]
FOREIGN = {mid for mid, _ in [CAMERA, *AFTER]}


def sections(sdp: str) -> tuple[list[str], list[list[str]]]:
    """Session lines and m= sections (as lines) of an SDP text."""
    head: list[str] = []
    media: list[list[str]] = []
    for line in filter(None, sdp.splitlines()):
        if line.startswith("m="):
            media.append([line])
        else:
            (media[-1] if media else head).append(line)
    return head, media


def join(head: list[str], media: list[list[str]]) -> str:
    return "\r\n".join(head + [line for section in media for line in section]) + "\r\n"


def mid(section: list[str]) -> str:
    return next(line[6:] for line in section if line.startswith("a=mid:"))


def graft(offer: str) -> str:
    """The client's offer with the foreign sections added, all of them in its BUNDLE group."""
    head, media = sections(offer)
    head = [f"a=group:BUNDLE {CAMERA[0]} {line[15:]} {' '.join(m for m, _ in AFTER)}"
            if line.startswith("a=group:BUNDLE ") else line for line in head]
    return join(head, [CAMERA[1], *media, *(lines for _, lines in AFTER)])


def ungraft(answer: str) -> str:
    """The answer as the client that never offered the foreign sections applies it."""
    head, media = sections(answer)
    return join(head, [s for s in media if mid(s) not in FOREIGN])


def assert_rejects_the_foreign_sections(offer: str, answer: str) -> None:
    """Same m= lines in the same order; the foreign ones with port 0, the rest answered."""
    _, offered = sections(offer)
    head, answered = sections(answer)
    assert [mid(s) for s in answered] == [mid(s) for s in offered]
    for asked, got in zip(offered, answered):
        kind, port, proto, *_ = got[0][2:].split()
        assert (kind, proto) == tuple(asked[0][2:].split()[0:3:2])
        assert (port == "0") == (mid(got) in FOREIGN), got[0]
        if port == "0":
            assert not any(line.startswith("a=candidate:") for line in got)
    bundle = next(line for line in head if line.startswith("a=group:BUNDLE"))
    assert FOREIGN.isdisjoint(bundle.split()[1:]) and len(bundle.split()) == 3, bundle


async def test_extra_sections_are_rejected_and_the_audio_goes_on() -> None:
    listener = Recorder()
    server = CallPeer("hostile-1", LOOPBACK, listener)
    client = ClientPeer(AudioStreamTrack())
    try:
        own = await client.offer()
        offer = graft(own)
        plan = plan_answer(offer)
        assert plan.rejected_kinds == ["video", "audio", "application", "application"]
        assert plan.offer == own  # what aiortc sees: the client's own sections and BUNDLE group
        answer = await server.answer(offer)
        assert_rejects_the_foreign_sections(offer, answer)
        # aiortc never saw the rejected sections: one transceiver, no receiver for a camera.
        assert [t.kind for t in server._pc.getTransceivers()] == ["audio"]

        await client.pc.setRemoteDescription(
            RTCSessionDescription(LOOPBACK.filter_candidates(ungraft(answer)), "answer"))
        client.channel.on("open", client.notify)
        await client.wait_for(lambda: client.channel.readyState == "open")
        await listener.wait_for(lambda: sum(len(s) for s, _ in listener.audio) >= 16000)
        client.send({"type": "response.cancel"})
        await listener.wait_for(lambda: listener.messages)
    finally:
        await client.close()
        await server.close()
    assert listener.closed == ["closed"]


async def test_a_posted_offer_with_a_camera_gets_a_call_that_hears_the_user(server: ServerProcess) -> None:
    mic = ScriptedMic()
    peer = ClientPeer(mic)
    offer = graft(await peer.offer())
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{server.url}/v1/realtime/calls", content=offer, timeout=TIMEOUT,
                                   headers={**AUTH, "Content-Type": "application/sdp"})
    assert response.status_code == 201, response.text
    assert_rejects_the_foreign_sections(offer, response.text)
    call = Call(peer, mic, response.headers["location"])
    try:
        await peer.pc.setRemoteDescription(
            RTCSessionDescription(peer.policy.filter_candidates(ungraft(response.text)), "answer"))
        await call.wait_event("session.created")
        mic.say(speech("Hello there, can you hear me?", 48000))
        await call.wait_event("input_audio_buffer.speech_started")
        log.info("the call with rejected sections heard the user: %s", call.types())
    finally:
        async with httpx.AsyncClient() as http:
            await http.post(f"{server.url}{call.path}/hangup", headers=AUTH, timeout=TIMEOUT)
        await peer.close()
