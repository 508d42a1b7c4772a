"""One conversation: the turn state machine with barge-in (``session``) and its states (``states``),
responses (``response``), client events (``client_events``), history and truncation (``history``),
the session's settings (``config``) and the interface through which it reaches the model
(``model_pipeline``)."""
