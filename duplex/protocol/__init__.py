"""The OpenAI Realtime wire protocol: server events and items (``events``, ``items``),
``session.update`` and the session object (``session_update``), ``response.create``
(``response_create``), the field checks they share (``fields``), OpenAI's voice names (``voices``)
and base64 audio in events (``wire_audio``). Knows no transport and no server settings."""
