"""How the session layer reaches a model: the small interface it needs from the pipeline.

``pipeline.coordinator.Coordinator`` implements it for real; tests may script it (a fake that
yields chosen chunks on virtual time). Nothing in ``duplex/`` reaches the model any other way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pipeline.proto import OmniRequest, OutputChunk


class ModelPipeline(Protocol):
    @property
    def ready(self) -> bool:
        """Whether requests are served now (not while loading or after a stage crashed)."""

    @property
    def output_sample_rate(self) -> int | None:
        """The sample rate of the audio chunks the pipeline yields."""

    @property
    def input_modalities(self) -> tuple[str, ...]:
        """What the model takes in a request's messages ("text", "audio", ...)."""

    @property
    def keeps_conversations(self) -> bool:
        """Whether some stage keeps conversation state that the history must match exactly (a
        thinker's KV: a truncated answer must cut it token for token); false where stages at most
        cache per conversation what a request's prompt re-derives."""

    def stream(self, request: OmniRequest) -> AsyncIterator[OutputChunk]:
        """Submit ``request`` and yield its output chunks; raises ``PipelineError`` (a stage failed
        it) or ``PipelineOverloaded``; leaving early aborts the request."""

    async def abort(self, request_id: str, keep_answer_tokens: int | None = None) -> None:
        """Abort ``request_id`` and return once every stage released it. Idempotent. With
        ``keep_answer_tokens`` (a barge-in), the conversation's kept state keeps that many tokens
        of the answer; otherwise it goes back to before the request."""

    async def withdraw(self, request_id: str) -> None:
        """Abort ``request_id`` as if it had never been asked (a speculative answer the user talked
        over) and return once every stage released it: the conversation's kept state goes back to
        before it, also where it already ended. Idempotent."""

    async def close_conversation(self, conversation_id: str) -> None:
        """Forget the state kept for ``conversation_id`` (``params["conversation_id"]``)."""
