"""Input a model does not take: one error, worded once, for the Realtime and chat APIs.

Each model declares what a request's messages may carry (``ModelPipeline.input_modalities``:
"text", "audio", "image", "video"); content of another kind is refused before it reaches the
pipeline, with this message and code, naming what the model does take.
"""

from __future__ import annotations

CODE = "unsupported_modality"


def not_taken(kind: str, inputs: tuple[str, ...]) -> str:
    """The message for content of ``kind`` (a modality: "image") that a model taking ``inputs``
    does not take."""
    taken = inputs[0] if len(inputs) == 1 else f"{', '.join(inputs[:-1])} and {inputs[-1]}"
    return f"the model of this preset takes {taken}, not {kind}s"
