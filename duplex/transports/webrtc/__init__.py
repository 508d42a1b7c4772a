"""WebRTC calls (OpenAI's WebRTC flow): the aiortc peer (``peer``), SDP checks (``sdp``), the ICE
policy (``ice``), and the call that binds a peer to a session (``call``)."""
