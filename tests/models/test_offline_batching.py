"""Several callers at once on the offline model set (issue 28): the ``asr`` stage recognises a
batch's clips in one decode per window length, the ``lm`` stage decodes a batch's requests side by
side, and the ``tts`` stage voices a new answer's first clause ahead of other answers' tails. Each
request's result is the one it gets alone (greedy): batching changes when, never what."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("faster_whisper")

from harness.lm_runner import answer, lm_slot
from harness.speech import speech
from pipeline.config import StageConfig
from pipeline.models import StageContext
from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot, BatchItem

RATE = 16000
QUESTIONS = (
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    # Long enough for a longer window than the others: the batch decodes in two groups.
    "Please tell me slowly which planet in our solar system is the largest one of all of them.",
    "What colour is the sky on a clear day?",
)
PROMPTS = (
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    "Name three fruits that are red.",
    "Why do cats purr?",
)


@pytest.fixture(scope="module")
def recognizer():
    from pipeline.models.offline.asr import Recognizer

    stage = StageConfig(name="asr", runner="asr", scheduler="simple", next=["lm"], max_batch=4)
    return Recognizer(StageContext(stage, {"asr": "packaged"}))


@pytest.fixture(scope="module")
def spoken() -> list[BatchItem]:
    return [
        BatchItem(StagePayload(f"r{i}", {"messages": [
            {"role": "user", "text": None, "audio": speech(q, RATE), "sample_rate": RATE}
        ]}), final=True)
        for i, q in enumerate(QUESTIONS)
    ]


@pytest.fixture(scope="module")
def heard_alone(recognizer, spoken: list[BatchItem]) -> list[dict]:
    return [recognizer.run([item])[0] for item in spoken]


@pytest.mark.parametrize("size", [2, 4])
def test_a_batch_of_clips_is_heard_as_each_alone(
    recognizer, spoken: list[BatchItem], heard_alone: list[dict], size: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.models.offline.asr import Transcriber

    decodes: list[int] = []
    one_window = Transcriber._transcribe_short

    def counted(self: Transcriber, clips: list[np.ndarray], seconds: int) -> list[str]:
        decodes.append(len(clips))
        return one_window(self, clips, seconds)

    monkeypatch.setattr(Transcriber, "_transcribe_short", counted)
    batch = spoken[:size]  # 2: two short questions; 4: three short ones and the long one
    assert recognizer.run(batch) == heard_alone[:size]
    # One decode per window length: the short questions' windows together.
    assert sorted(decodes) == ([2] if size == 2 else [1, 3])
    assert [h["input_transcript"] for h in heard_alone][:2] == [
        "What is the capital of Japan?", "How many legs does a spider have?"
    ]


@pytest.fixture(scope="module")
def language_model():
    from pipeline.models.offline.lm import LanguageModel

    stage = StageConfig(name="lm", runner="lm", scheduler="ar", max_new_tokens=48,
                        terminal=True, max_batch=4, options={})
    return LanguageModel(StageContext(stage, {"lm": "packaged"}))


def _slot(language_model, index: int, prompt: str, cap: int = 48) -> ARSlot:
    return lm_slot(language_model, f"q{index}", [{"role": "user", "text": prompt}], cap)


@pytest.fixture(scope="module")
def answered_alone(language_model) -> list[tuple[list[int], str]]:
    return [answer(language_model, [_slot(language_model, i, p)])[0]
            for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("size", [2, 4])
def test_requests_decoded_side_by_side_answer_as_each_alone(
    language_model, answered_alone: list[tuple[list[int], str]], size: int
) -> None:
    slots = [_slot(language_model, i, p) for i, p in enumerate(PROMPTS[:size])]
    together = answer(language_model, slots)
    assert together == answered_alone[:size]
    assert len({tuple(ids) for ids, _ in together}) == size  # different answers, not one repeated
    assert all(text for _, text in together)


def test_a_second_request_does_not_wait_for_the_whole_firstanswer(language_model) -> None:
    """Its first token comes while the first request's decoder is still running (one decoding
    thread per request): one thread would finish the whole first answer first."""
    first = _slot(language_model, 10, "Tell me a long story about a brave dragon and a princess.",
                  cap=96)
    language_model.step([first])
    second = _slot(language_model, 11, "What is the capital of Japan?")
    seen = 0
    try:
        while not second.state.ids:
            language_model.step([first, second])
            seen += 1
        assert first.state.decoder.is_alive(), "the first answer ended before the second began"
    finally:
        language_model.release(first)
        language_model.release(second)
    assert seen == 1  # the step that started it brought its first token


def test_spoken_answers_start_one_after_another_s_first_tokens() -> None:
    """With pacing, a new spoken answer starts only once the one before has had its first tokens
    (oldest first), and its tokens are still the ones it gets alone."""
    from pipeline.models.offline.lm import LanguageModel

    stage = StageConfig(name="lm", runner="lm", scheduler="ar", max_new_tokens=48, terminal=True,
                        max_batch=4, options={"pace_after_tokens": 4,
                                              "pace_tokens_per_s": 50})
    paced = LanguageModel(StageContext(stage, {"lm": "packaged"}))
    first, second = (_slot(paced, 20 + i, p) for i, p in enumerate(PROMPTS[:2]))
    assert paced.runnable(first) and not paced.runnable(second)
    paced.step([first])
    while len(first.state.ids) < 4 and first.state.decoder.is_alive():
        assert not paced.runnable(second)
        paced.step([first])
    assert paced.runnable(second)
    second.steps = first.steps = 0
    together = answer(paced, [first, second])
    alone = [answer(paced, [_slot(paced, 30 + i, p)])[0] for i, p in enumerate(PROMPTS[:2])]
    assert together[1] == alone[1] and together[0][0] == alone[0][0]


@pytest.fixture(scope="module")
def speaker():
    pytest.importorskip("piper")
    from pipeline.models.offline.tts import Speaker

    stage = StageConfig(name="tts", runner="tts", scheduler="ar", max_new_tokens=32,
                        terminal=True, max_batch=1)
    return Speaker(StageContext(stage, {"voice": "packaged"}))


def test_a_new_answer_s_first_clause_goes_ahead_of_another_s_tail(speaker) -> None:
    def streaming(rid: str, text: str) -> ARSlot:
        slot = ARSlot(rid, {}, speaker.new_state(StagePayload(rid, {})), cap=32)
        speaker.feed(slot, StagePayload(rid, {"text": text}))
        return slot

    playing = streaming("a", "The capital of Japan is Tokyo, a very large city. It has many parks")
    assert speaker.runnable(playing)
    (voiced,) = speaker.step([playing])
    assert voiced.data["spoken_text"] == "The capital of Japan is Tokyo,"
    assert playing.state.clauses  # its tail waits
    new = streaming("b", "A spider has eight legs, and most have eight eyes. They")
    # The new answer's listener hears nothing yet; the first one's has a clause of audio queued.
    assert speaker.runnable(new) and not speaker.runnable(playing)
    (first,) = speaker.step([new])
    assert first.data["spoken_text"] == "A spider has eight legs,"
    # Then the tail whose listener runs out of audio first.
    sooner, later = sorted((playing, new), key=lambda slot: slot.state.due)
    assert speaker.runnable(sooner) and not speaker.runnable(later)
    speaker.release(sooner)
    assert speaker.runnable(later)
    speaker.release(later)


def test_a_paced_decoder_yields_to_first_clauses_and_wakes_on_abort() -> None:
    """Past its free tokens, a spoken answer's decoder waits while another answer has not had its
    own, then keeps to the pace; an abort wakes it at once."""
    import threading
    import time

    from pipeline.models.offline.pacing import Pacer

    pacer, stop = Pacer(free_tokens=2, tokens_per_s=20.0), threading.Event()
    tail, first = pacer.begin(), pacer.begin()
    started = time.monotonic()
    pacer.after_token(tail, stop)  # a free token
    assert time.monotonic() - started < 0.04
    threading.Timer(0.2, lambda: [pacer.after_token(first, stop) for _ in range(2)]).start()
    pacer.after_token(tail, stop)  # its free tokens are out: it waits for the other's
    assert time.monotonic() - started >= 0.19 and not first.urgent
    started = time.monotonic()
    pacer.after_token(tail, stop)  # then one token every 1 / 20 s
    assert time.monotonic() - started >= 0.04
    stop.set()
    started = time.monotonic()
    for _ in range(100):  # due in 5 s, but aborted
        pacer.after_token(tail, stop)
    assert time.monotonic() - started < 0.5
    pacer.end(tail)
    pacer.end(first)
