"""The OpenAI Realtime wire protocol: server events (``events``), ``session.update`` and the session
object (``session_update``), and base64 audio in events (``wire_audio``). Knows no transport and no
server settings."""
