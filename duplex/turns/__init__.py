"""Deciding when the user speaks and when a turn ends: the streaming VAD (``vad``), the one
turn-detection configuration (``config``) and the server_vad detector (``server_vad``)."""
