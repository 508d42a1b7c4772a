"""The call's outbound track as one peer sends it: lent for the peer's life, never stopped by it.

aiortc's ``RTCRtpSender`` stops the track it sends once its RTP loop ends (the peer connection
closing), and :class:`~duplex.media.paced_track.OpusPacketTrack` stops its source with itself. A
WebRTC call keeps one :class:`~duplex.media.paced_track.OutboundAudioTrack` for its session's
life and lends it to each peer it has in turn (a resumed call: docs/resume.md), so each peer sends
it through one of these, whose ``stop`` ends only the loan.
"""

from __future__ import annotations

import av
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from duplex.media.paced_track import OpusPacketTrack, OutboundAudioTrack


class LentTrack(MediaStreamTrack):
    """``source``'s frames, for aiortc's own encoder (a call that did not negotiate Opus)."""

    kind = "audio"

    def __init__(self, source: OutboundAudioTrack) -> None:
        super().__init__()
        source.channels = 2  # the layout aiortc's encoder wants (an earlier peer may have set 1)
        self.source = source

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        return await self.source.recv()


class LentOpusTrack(OpusPacketTrack):
    """``source``'s frames as Opus packets (:class:`OpusPacketTrack`), the source left running."""

    def stop(self) -> None:
        MediaStreamTrack.stop(self)

    async def recv(self) -> av.Packet:
        if self.readyState != "live":
            raise MediaStreamError
        return await super().recv()
