"""One binding of a transport to a Session each (``binding`` holds what they share): ``webrtc/``
(browser calls), ``websocket`` (the Realtime WebSocket), ``sip/`` (phone calls over SIP/RTP)."""
