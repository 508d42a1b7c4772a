"""semantic_vad over a real WebRTC call (toy model): an order read with a long pause in the middle
of its sentence gets exactly one answer, after it ends (the answer begun in the pause was aborted,
the one begun in the final pause adopted); a plain question is answered without waiting for the
maximum wait."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from harness.calls import QUESTION, hang_up, open_call, wait_stages_idle
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech, speech_with_pauses


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("semantic")
    preset = write_preset(tmp / "preset.yaml", session={
        "turn_detection": {"type": "semantic_vad", "eagerness": "medium"}})
    with run_server(preset, tmp=tmp) as running:
        yield running


async def test_a_pause_inside_a_sentence_gets_no_answer_and_the_end_gets_one(server: ServerProcess) -> None:
    def speculative(outcome: str) -> float:
        return server.metric("duplex_speculative_responses_total", {"outcome": outcome})

    aborted, adopted = speculative("aborted"), speculative("adopted")
    call = await open_call(server)
    assert call.events()[0]["session"]["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    order = speech_with_pauses(("I would like to order a large pizza with", "mushrooms and olives."),
                               (900,), 48000, 0.3, 0.0)
    await call.mic.say(order)
    # The whole order, its 900 ms pause included, has been sent: nothing was taken as a turn.
    assert "input_audio_buffer.committed" not in call.types()
    done = await call.wait_event("response.done")
    assert done["response"]["status"] == "completed"
    assert call.types().count("input_audio_buffer.committed") == 1
    assert call.types().count("response.created") == 1
    assert speculative("aborted") >= aborted + 1
    assert speculative("adopted") == adopted + 1
    # A plain question, answered well before medium's 4 s maximum wait.
    loop = asyncio.get_running_loop()
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    spoken = loop.time()
    await call.wait_event("input_audio_buffer.committed", 2)
    assert loop.time() - spoken < 4.0
    await call.wait_event("response.done", 2)
    await hang_up(server, call)
    await wait_stages_idle(server)
