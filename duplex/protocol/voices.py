"""OpenAI's voice names. A client may choose any of them; the preset's ``voice_map`` says which of
the model's own voices speaks for each (duplex.settings fills in the ones a preset leaves out)."""

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")
