"""Checks on a WebRTC SDP offer before aiortc sees it, so that bad input gets a clear error."""

from __future__ import annotations

from aiortc import RTCRtpSender
from aiortc.sdp import SessionDescription

# What aiortc can decode: opus, G722, PCMU, PCMA.
_AUDIO_CODECS = {c.mimeType.split("/")[1].lower()
                 for c in RTCRtpSender.getCapabilities("audio").codecs}


# Bounds on what one offer may make the server do: aioice checks every remote candidate against
# every earlier one, so tens of thousands of them keep the event loop busy for minutes. Browsers
# send a handful of candidates and a few kB of SDP.
MAX_SDP_BYTES = 64 * 1024
MAX_CANDIDATES = 64
MAX_MEDIA_SECTIONS = 8


class SdpError(ValueError):
    """An offer this server cannot answer; the message says why (the HTTP layer answers 400)."""


def validate_offer(sdp: str) -> None:
    """Check an SDP offer before aiortc sees it, so that bad input gets a clear error.

    aiortc's parser accepts almost anything and its failures are assertion errors; this requires
    what answering needs: an audio section the client sends on, in a codec aiortc decodes, with
    ICE credentials and a DTLS fingerprint.
    """
    if not sdp.lstrip().startswith("v=0"):
        raise SdpError("not an SDP offer: it must start with 'v=0'")
    if len(sdp.encode()) > MAX_SDP_BYTES:
        raise SdpError(f"the offer is larger than {MAX_SDP_BYTES} bytes")
    if sdp.count("a=candidate:") > MAX_CANDIDATES:
        raise SdpError(f"the offer has more than {MAX_CANDIDATES} ICE candidates")
    if sdp.count("\nm=") + sdp.startswith("m=") > MAX_MEDIA_SECTIONS:
        raise SdpError(f"the offer has more than {MAX_MEDIA_SECTIONS} media sections")
    try:
        description = SessionDescription.parse(sdp)
    except Exception as exc:  # the parser asserts, indexes and converts without checking
        raise SdpError(f"malformed SDP: {exc!r}") from exc
    audio = [m for m in description.media if m.kind == "audio"]
    if not audio:
        raise SdpError("the offer has no audio section (m=audio)")
    media = audio[0]
    if media.direction not in (None, "sendrecv", "sendonly"):
        raise SdpError(f"the offer's audio is {media.direction}: the client must send audio")
    codecs = {codec.name.lower() for codec in media.rtp.codecs}
    if not codecs & _AUDIO_CODECS:
        raise SdpError(f"no supported audio codec offered (have {sorted(codecs)}, "
                       f"need one of {sorted(_AUDIO_CODECS)})")
    if not (media.ice.usernameFragment and media.ice.password):
        raise SdpError("the offer's audio has no ICE credentials (a=ice-ufrag / a=ice-pwd)")
    if not media.dtls or not media.dtls.fingerprints:
        raise SdpError("the offer's audio has no DTLS fingerprint (a=fingerprint)")
