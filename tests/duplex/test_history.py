"""What a truncated assistant turn keeps of its text, and what the model gets of each turn."""

from __future__ import annotations

from duplex.session.history import History, Item


def answer(spoken_ms: int | None) -> Item:
    item = Item("item_a", "assistant", spoken_ms=spoken_ms)
    item.deltas = [("Hello ", 0), ("there, ", 0), ("how ", 40), ("are ", 400), ("you?", 900)]
    return item


def test_a_fully_generated_answer_keeps_the_heard_share_through_the_word_being_spoken() -> None:
    history = History(60)
    item = history.add(answer(spoken_ms=2000))
    history.truncate(item, 1100)  # 55 % of the audio: 14 of 25 characters, then the rest of "how"
    assert item.transcript == "Hello there, how"
    assert item.truncated_at_ms == 1100
    history.truncate(item, 500)  # a second truncation cuts what is left (1100 ms), by the same rule
    assert item.transcript == "Hello there,"


def test_while_still_generating_only_text_that_preceded_the_heard_audio_is_kept() -> None:
    history = History(60)
    item = history.add(answer(spoken_ms=None))
    history.truncate(item, 400)
    assert item.transcript == "Hello there, how "
    history.truncate(item, 0)
    assert item.transcript == ""


def test_a_model_that_counts_answer_tokens_keeps_the_text_of_the_tokens_voiced() -> None:
    """Audio chunks say how many answer tokens they voiced, text deltas how many they cover: the
    text kept is that of the tokens voiced by the chunk being heard (what the model's kept state
    keeps), not a share of the text nor the text that arrived before the heard audio."""
    history = History(60)
    item = history.add(answer(spoken_ms=2000))
    # "there, " arrived with the 3rd token (its 2nd held a character's first bytes), "how " the
    # 4th, ...; audio chunks of 500 ms voiced 2, 4, 5 and 6 tokens.
    item.delta_tokens = [1, 3, 4, 5, 6]
    item.voiced = [(500, 2), (1000, 4), (1500, 5), (2000, 6)]
    history.truncate(item, 1100)  # inside the third chunk: 5 tokens
    assert item.transcript == "Hello there, how are "
    assert item.delta_tokens == [1, 3, 4, 5]
    history.truncate(item, 300)  # inside the first: 2 tokens, whose text is only the first delta's
    assert item.transcript == "Hello "
    assert item.truncated_at_ms == 300


def test_messages_keep_newest_audio_within_the_budget_and_the_instructions_first() -> None:
    import numpy as np

    history = History(max_audio_s=1.5)
    for i in range(3):
        history.add(Item(f"u{i}", "user", audio=np.zeros(16000, np.float32), sample_rate=16000))
    history.add(Item("a", "assistant", text="hi"))
    messages = history.messages("Be brief.")
    assert messages[0] == {"role": "system", "text": "Be brief.", "audio": None, "sample_rate": None}
    audio = [m for m in messages if m["audio"] is not None]
    assert len(audio) == 1  # only the newest second of user audio fits 1.5 s
    assert messages[-1]["text"] == "hi"


def test_a_transcribed_turn_is_heard_as_audio_and_read_as_text_once_its_audio_is_gone() -> None:
    """The transcript rides beside the audio (a model that hears audio must not read the turn
    twice, nor see a kept prompt change when the transcript arrives); it is the turn's text once
    the audio leaves the budget."""
    import numpy as np

    history = History(max_audio_s=1.5)
    old = history.add(Item("u0", "user", audio=np.zeros(16000, np.float32), sample_rate=16000))
    new = history.add(Item("u1", "user", audio=np.zeros(16000, np.float32), sample_rate=16000))
    before = history.messages(None)
    for item, words in ((old, "an old question"), (new, "a new question")):
        item.text, item.transcribed = words, True
    first, second = history.messages(None)
    assert first == {"role": "user", "text": "an old question", "audio": None, "sample_rate": None}
    assert second["text"] is None and second["transcript"] == "a new question"
    assert second["audio"] is new.audio
    assert [m["text"] for m in before] == [None]  # before: the old turn's audio was simply dropped
