"""CallPeer and IcePolicy with real aiortc peers over 127.0.0.1 (run in a loopback-only netns)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from aiortc import RTCPeerConnection
from aiortc.contrib.media import MediaPlayer
from aiortc.mediastreams import AudioStreamTrack

from duplex.transports.webrtc.ice import IcePolicy, _gatherers, parse_ice_server
from duplex.transports.webrtc.peer import CallPeer
from duplex.transports.webrtc.sdp import SdpError, plan_answer
from duplex.turns.server_vad import SpeechStarted, SpeechStopped, TurnDetector
from harness.peers import LOOPBACK, ClientPeer, Recorder
from harness.speech import read_wav, speech_wav

SENTENCE = "Please book a table for two people tonight."


def candidate_addresses(sdp: str) -> set[str]:
    return {line.split()[4] for line in sdp.splitlines() if line.startswith("a=candidate:")}


async def client_offer(policy: IcePolicy = LOOPBACK, **transceivers: str) -> str:
    """A real aiortc offer: ``audio="sendrecv"`` etc., plus an events channel."""
    pc = RTCPeerConnection(policy.configuration())
    for kind, direction in transceivers.items():
        pc.addTransceiver(kind, direction=direction)
    pc.createDataChannel("oai-events")
    policy.restrict(pc)
    policy.restrict(pc)  # idempotent
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


@pytest.fixture(scope="module")
async def good_offer() -> str:
    return await client_offer(audio="sendrecv")


def without(sdp: str, prefix: str) -> str:
    return "".join(line for line in sdp.splitlines(keepends=True) if not line.startswith(prefix))


async def test_bad_offers_are_rejected_with_a_clear_reason(good_offer: str) -> None:
    plan_answer(good_offer)
    cases = {
        "": "must start with 'v=0'",
        "hello": "must start with 'v=0'",
        "v=0\r\nm=audio x UDP 0\r\n": "malformed SDP",
        "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n": "no audio section",
        await client_offer(): "no audio section",  # events channel only
        await client_offer(audio="recvonly"): "the client must send audio",
        without(good_offer, "a=fingerprint"): "no DTLS fingerprint",
        without(good_offer, "a=ice-pwd"): "no ICE credentials",
        good_offer.replace("opus/", "nopus/").replace("PCMU/", "X/").replace("PCMA/", "Y/")
        .replace("G722/", "Z/"): "no supported audio codec",
        good_offer + "".join(f"a=candidate:{i} 1 udp 1 127.0.0.1 {1000 + i} typ host\r\n"
                             for i in range(65)): "more than 64 ICE candidates",
        good_offer + "a=x-padding:" + "x" * 70_000 + "\r\n": "larger than 65536 bytes",
    }
    for sdp, reason in cases.items():
        with pytest.raises(SdpError, match=reason):
            plan_answer(sdp)


async def test_answering_a_bad_offer_raises_and_closes_the_peer(good_offer: str) -> None:
    listener = Recorder()
    peer = CallPeer("bad", LOOPBACK, listener)
    with pytest.raises(SdpError, match="no audio section"):
        await peer.answer(await client_offer())
    assert peer.closed and listener.closed == ["rejected"]
    assert peer.connection_state == "closed"


def test_ice_servers_are_explicit_and_parsed() -> None:
    assert LOOPBACK.configuration().iceServers == []  # never None: aiortc would add Google STUN
    pc = RTCPeerConnection(IcePolicy().configuration())
    pc.addTransceiver("audio")
    assert all(g._connection.stun_server is None for g in _gatherers(pc))

    stun = parse_ice_server("stun:stun.example.org:3478")
    assert (stun.urls, stun.username, stun.credential) == ("stun:stun.example.org:3478", None, None)
    turn = parse_ice_server("turn:alice:s3cret@turn.example.org:3478?transport=tcp")
    assert (turn.urls, turn.username, turn.credential) == (
        "turn:turn.example.org:3478?transport=tcp", "alice", "s3cret")
    policy = IcePolicy(servers=(stun, turn))
    assert policy.configuration().iceServers == [stun, turn]
    with pytest.raises(ValueError, match="bad ICE server"):
        parse_ice_server("http://example.org")
    with pytest.raises(ValueError):
        IcePolicy(hosts=("localhost",))


def test_remote_candidates_outside_the_allowed_scope_are_dropped() -> None:
    sdp = "".join(
        f"a=candidate:1 1 udp 2130706431 {address} 5000 typ host\r\n"
        for address in ("127.0.0.1", "192.168.1.5", "::1", "2001:db8::7", "abc.local")
    ) + "a=end-of-candidates\r\n"
    assert candidate_addresses(LOOPBACK.filter_candidates(sdp)) == {"127.0.0.1"}
    lan = IcePolicy(hosts=("10.0.0.2",))
    assert candidate_addresses(lan.filter_candidates(sdp)) == {"192.168.1.5"}
    assert candidate_addresses(IcePolicy(hosts=("::1",)).filter_candidates(sdp)) == {"::1"}
    assert IcePolicy().filter_candidates(sdp) == sdp
    assert "a=end-of-candidates" in LOOPBACK.filter_candidates(sdp)


async def test_host_restriction_is_per_peer() -> None:
    on_ipv4 = await client_offer(IcePolicy(hosts=("127.0.0.1",)), audio="sendrecv")
    on_ipv6 = await client_offer(IcePolicy(hosts=("::1",)), audio="sendrecv")
    assert candidate_addresses(on_ipv4) == {"127.0.0.1"}
    assert candidate_addresses(on_ipv6) == {"::1"}


async def test_a_call_carries_audio_and_events_both_ways() -> None:
    wav = speech_wav(SENTENCE, 48000)
    sent, _ = read_wav(wav)
    listener = Recorder()
    server = CallPeer("call-1", LOOPBACK, listener)
    # Events the session sends before the client's channel opens are held, in order.
    server.send_event({"type": "session.created", "n": 1})
    server.send_event({"type": "session.updated", "n": 2})
    client = ClientPeer(MediaPlayer(str(wav)).audio)
    try:
        answer = await client.connect(server)
        assert candidate_addresses(answer) == {"127.0.0.1"}

        server.send_event({"type": "response.created", "n": 3})
        await client.wait_for(lambda: len(client.messages) >= 3)
        assert [e["n"] for e in client.events()] == [1, 2, 3]

        client.send({"type": "session.update", "session": {"instructions": "be brief"}})
        client.channel.send("{not json")
        client.channel.send("[1, 2]")
        client.send({"type": "response.create"})
        # Messages arrive as they were sent, in order; parsing them is the session binding's job.
        await listener.wait_for(lambda: len(listener.messages) >= 4)
        assert listener.messages[1:3] == ["{not json", "[1, 2]"]
        assert [json.loads(m)["type"] for m in (listener.messages[0], listener.messages[3])] == [
            "session.update", "response.create"]

        # The whole file arrives as 16 kHz mono float32, timestamped on arrival.
        def received() -> int:
            return sum(len(samples) for samples, _ in listener.audio)

        await listener.wait_for(lambda: received() >= len(sent) // 3 - 16000 // 10)
        chunks = [samples for samples, _ in listener.audio]
        arrivals = [at for _, at in listener.audio]
        assert all(c.dtype == np.float32 and c.ndim == 1 for c in chunks)
        assert all(later >= earlier for earlier, later in zip(arrivals, arrivals[1:]))

        # It is the same speech, where it was in the file: the VAD finds the turn.
        events = TurnDetector().process(np.concatenate(chunks))
        assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]
        loud = np.nonzero(np.abs(sent) > 1e-3)[0]
        assert abs(events[0].start_ms - loud[0] / 48) <= 150
        assert abs(events[1].speech_end_ms - loud[-1] / 48) <= 200

        # And the agent's voice reaches the client.
        mark = len(client.frames)
        server.outbound.enqueue("reply", (sent * 32767).astype(np.int16))
        await client.wait_for(lambda: any(np.sqrt(np.mean(s ** 2)) > 0.02
                                          for _, s, _ in client.frames[mark:]))
    finally:
        await client.close()
        await server.close()
    assert listener.closed == ["closed"]


async def test_closing_releases_the_peer_and_its_media() -> None:
    listener = Recorder()
    server = CallPeer("call-2", LOOPBACK, listener)
    client = ClientPeer(AudioStreamTrack())
    await client.connect(server)
    await listener.wait_for(lambda: listener.audio)
    reader = server._reader
    server.outbound.enqueue("a", np.ones(48000, dtype=np.int16))
    await server.close("hangup")
    await server.close("again")  # idempotent
    assert listener.closed == ["hangup"]
    assert server.closed and server.connection_state == "closed"
    assert server.outbound.readyState == "ended" and server.outbound.queued_seconds == 0
    assert reader is not None and reader.done()
    server.send_event({"type": "too.late"})  # ignored, no error
    await client.close()


async def test_a_client_hanging_up_closes_the_server_peer() -> None:
    listener = Recorder()
    server = CallPeer("call-3", LOOPBACK, listener)
    client = ClientPeer(AudioStreamTrack())
    await client.connect(server)
    await client.close()
    await listener.wait_for(lambda: listener.closed)
    assert listener.closed == ["closed"] and server.closed
