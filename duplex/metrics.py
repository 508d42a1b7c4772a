"""The session layer's Prometheus metrics (names from CONTRACT.md), on the default registry."""

from prometheus_client import Counter, Gauge, Histogram

TRANSPORTS = ("webrtc", "websocket", "sip", "twilio")

SESSIONS_ACTIVE = Gauge("duplex_sessions_active", "Live sessions", ["transport"])
SESSIONS_TOTAL = Counter("duplex_sessions_total", "Sessions started", ["transport"])
BARGE_INS_TOTAL = Counter("duplex_barge_ins_total", "Confirmed interruptions of the agent")
TURNS_TOTAL = Counter("duplex_turns_total", "User turns answered")
VOICE_TO_VOICE_SECONDS = Histogram(
    "duplex_voice_to_voice_seconds",
    "End of the user's turn (decision) until the agent's first audio is queued for playout",
    buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0),
)
BARGE_IN_STOP_SECONDS = Histogram(
    "duplex_barge_in_stop_seconds",
    "User speech onset reaching the session until the agent's audio is paused",
    buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)
OUTBOUND_FRAME_GAP_SECONDS = Histogram(
    "duplex_outbound_frame_gap_seconds",
    "Time between two consecutive outbound 20 ms frames handed to the encoder, all calls",
    buckets=(0.01, 0.015, 0.019, 0.021, 0.025, 0.03, 0.04, 0.06, 0.1, 0.25),
)
OUTBOUND_UNDERRUNS_TOTAL = Counter(
    "duplex_outbound_underruns_total",
    "Outbound frames that ran short in the middle of an answer (the model fell behind playout)",
)
RESPONSE_PHASE_SECONDS = Histogram(
    "duplex_response_phase_seconds",
    "Where a response's time to first audio goes: end of turn -> pipeline submit -> first audio "
    "chunk -> playout started",
    ["phase"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
OUTBOUND_QUEUE_SECONDS = Gauge(
    "duplex_outbound_queue_seconds", "Agent audio queued for playout, all sessions"
)
SPECULATIVE_RESPONSES_TOTAL = Counter(
    "duplex_speculative_responses_total",
    "Answers begun at a pause of the user's turn (semantic_vad), by outcome: adopted when the turn "
    "ended in that pause, aborted when the user went on",
    ["outcome"],
)
for _outcome in ("adopted", "aborted"):
    SPECULATIVE_RESPONSES_TOTAL.labels(_outcome)
PREFILL_PIECES_TOTAL = Counter(
    "duplex_prefill_pieces_total",
    "Pieces of the user's turn prefilled into the model's kept state while they spoke "
    "(prefill_piece_s), by outcome: done, or failed (the next turn then prefills in full)",
    ["outcome"],
)
for _outcome in ("done", "failed"):
    PREFILL_PIECES_TOTAL.labels(_outcome)
BACKCHANNELS_TOTAL = Counter(
    "duplex_backchannels_total",
    "Speech over the agent recognised as a backchannel (\"mhm\", \"yeah\"): the agent went on",
)

for _transport in TRANSPORTS:
    SESSIONS_ACTIVE.labels(_transport)
    SESSIONS_TOTAL.labels(_transport)
EVENT_LOOP_LAG_SECONDS = Histogram(
    "duplex_event_loop_lag_seconds",
    "How late a 100 ms timer fires on the server's event loop (what any client input or work on "
    "the loop delays every call's audio by)",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
)
INBOUND_AUDIO_DROPPED_SECONDS = Counter(
    "duplex_inbound_audio_dropped_seconds",
    "Inbound media dropped before decoding because its peer sent it faster than real time (beyond "
    "the slack for jitter: duplex/media/inbound_budget.py)",
    ["transport"],
)
for _transport in TRANSPORTS:
    INBOUND_AUDIO_DROPPED_SECONDS.labels(_transport)
SESSIONS_AWAITING_RESUME = Gauge(
    "duplex_sessions_awaiting_resume",
    "Live sessions whose connection dropped, waiting for their client to resume them (they hold "
    "their slot: duplex_sessions_active counts them too)",
    ["transport"],
)
for _transport in TRANSPORTS:
    SESSIONS_AWAITING_RESUME.labels(_transport)
SESSIONS_HELD = Gauge(
    "duplex_sessions_held",
    "Slots held for sessions about to start: SIP calls ringing while the app decides, and calls "
    "being placed (they count against --max-sessions beside duplex_sessions_active)",
    ["transport"],
)
for _transport in TRANSPORTS:
    SESSIONS_HELD.labels(_transport)
VIDEO_FRAMES_TOTAL = Counter(
    "duplex_video_frames_total",
    "Decoded frames of WebRTC video tracks, by what became of them (duplex/media/video_window.py): "
    "kept, unchanged (the picture kept before still shows), skipped (between samples), busy (the "
    "previous one still converting), too_large, failed",
    ["outcome"],
)
for _outcome in ("kept", "unchanged", "skipped", "busy", "too_large", "failed"):
    VIDEO_FRAMES_TOTAL.labels(_outcome)
