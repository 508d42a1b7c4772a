"""``GET /v1/models``: the one model this server serves (the preset's), in OpenAI's list shape.

Realtime and chat clients that list models before connecting find it here; whatever ``model`` they
then send is accepted and echoed, and the preset answers. Beyond OpenAI's fields, the model's
``input_modalities`` and ``output_modalities`` (its ``ModelSpec``'s), known before it has loaded:
a client can tell whether the preset sees images before it sends one.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from duplex.api.auth import app_state, require_key
from duplex.api.errors import ERROR_RESPONSES
from pipeline.models import get_model

router = APIRouter(dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)
CREATED = int(time.time())  # the server's start: its model exists since then


def _model(request: Request) -> dict[str, object]:
    state = app_state(request)
    spec = get_model(state.preset.pipeline.model)
    return {"id": state.settings.preset, "object": "model", "created": CREATED,
            "owned_by": "duplex", "input_modalities": list(spec.input_modalities),
            "output_modalities": list(spec.output_modalities)}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, object]:
    return {"object": "list", "data": [_model(request)]}
