"""The offline model set's parts without the pipeline: clause splitting, the WER helper, which
messages get transcribed, the language model from a user's Hugging Face folder (a tiny random
Llama converted the same way as the packaged GGUF), and the error when piper is missing."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harness.wer import normalize, wer
from pipeline.config import StageConfig
from pipeline.models import StageContext
from pipeline.models.offline.clauses import ClauseSplitter
from pipeline.models.offline.sources import MissingModelPackage, package_dir
from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot, BatchItem, RequestError


def split_all(text: str, deltas: list[str], **limits: int) -> list[str]:
    splitter = ClauseSplitter(**limits)
    clauses = [c for d in deltas for c in splitter.push(d)]
    return clauses + splitter.flush()


def test_clauses_end_at_punctuation_followed_by_space_and_keep_every_character() -> None:
    text = "Sure, the answer is 3.5 or 1,000 dollars. Really? Yes: it is!\nNext line"
    rng = random.Random(1)
    cuts = sorted(rng.sample(range(1, len(text)), 20))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    clauses = split_all(text, deltas, min_chars=4)
    assert "".join(clauses) == text
    assert clauses == [
        "Sure,",
        " the answer is 3.5 or 1,000 dollars.",
        " Really?",
        " Yes:",
        " it is!",
        "\nNext line",  # a newline alone is too short to voice: it joins the next clause
    ]


def test_short_clauses_join_the_next_and_long_ones_are_cut_at_a_space() -> None:
    assert split_all("", ["Yes, it is. Fine."], min_chars=10) == ["Yes, it is.", " Fine."]
    long = "word " * 50
    clauses = split_all(long, [long], max_chars=40)
    assert "".join(clauses) == long
    assert all(len(c) <= 40 for c in clauses)


def test_the_first_clause_ends_after_its_first_words_where_no_punctuation_came_first() -> None:
    text = "The capital of Japan is Tokyo. It is a big city and it is very old indeed"
    deltas = [text[i : i + 3] for i in range(0, len(text), 3)]
    clauses = split_all(text, deltas, first_words=4)
    assert clauses == ["The capital of Japan", " is Tokyo. It is a big city and it is very old indeed"]
    # Punctuation that comes first ends it as usual; later clauses never end at a word count.
    assert split_all("", ["Yes, of course. I can do that for you now"], first_words=4) == [
        "Yes, of course.", " I can do that for you now"]
    assert split_all("", ["Tokyo"], first_words=4) == ["Tokyo"]
    assert split_all("", ["Tokyo is big"], first_words=0) == ["Tokyo is big"]


def test_wer_normalises_case_punctuation_and_numbers() -> None:
    assert normalize("Twenty-one apples, 1,000 pears; It's EIGHT!") == [
        "21",
        "apples",
        "1000",
        "pears",
        "its",
        "8",
    ]
    assert wer("A spider has eight legs.", "a spider has 8 legs") == 0.0
    assert wer("the capital of France is Paris", "the capital of Francis Paris") == pytest.approx(
        2 / 6
    )
    assert wer("", "") == 0.0


def test_a_missing_model_package_names_what_to_install() -> None:
    with pytest.raises(MissingModelPackage, match=r"duplex\[offline\]"):
        package_dir("no_such_model_package", "no-such-model-package")


def test_without_piper_the_tts_stage_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.models.offline import make_tts

    monkeypatch.setitem(sys.modules, "piper", None)  # import piper now raises ImportError
    stage = StageConfig(name="tts", runner="tts", scheduler="ar", max_new_tokens=4, terminal=True)
    with pytest.raises(MissingModelPackage, match=r"piper-tts.*duplex\[offline\]"):
        make_tts(StageContext(stage, {"voice": "packaged"}))


class _FakeTranscriber:
    def __init__(self) -> None:
        self.calls = 0

    def transcribe(self, audio: np.ndarray, rate: int) -> str:
        self.calls += 1
        return f"heard {self.calls}"

    def transcribe_all(self, clips: list[tuple[np.ndarray, int]]) -> list[str]:
        return [self.transcribe(audio, rate) for audio, rate in clips]


@pytest.fixture(scope="module")
def recognizer():
    pytest.importorskip("faster_whisper")
    from pipeline.models.offline.asr import Recognizer

    stage = StageConfig(name="asr", runner="asr", scheduler="simple", next=["lm"])
    return Recognizer(StageContext(stage, {"asr": "packaged"}))


def _run(recognizer, messages: list[dict], params: dict | None = None) -> dict:
    payload = StagePayload("r1", {"messages": messages}, params or {})
    (out,) = recognizer.run([BatchItem(payload, final=True)])
    return out


@pytest.fixture(scope="module")
def judge():
    from pipeline.models.offline.finished_text import FinishedText

    return FinishedText()


def test_the_text_judge_hears_finished_words_not_a_phrase_that_goes_on(judge) -> None:
    """The packaged SmolLM2's P(the message ends here), on sentences the evaluation set does not
    hold, as Whisper writes them (a full stop after a mid-sentence pause too)."""
    finished = ["What is the capital of Canada?", "Please turn the music down.",
                "How long does the battery last?", "Thanks, that's all."]
    going_on = ["Could you tell me whether the.", "I would like to know if", "My address is",
                "The reason I called is that."]
    scores = {text: judge.probability(text) for text in finished + going_on}
    assert min(scores[t] for t in finished) > max(scores[t] for t in going_on), scores
    # Case and punctuation are not read: Whisper's full stop says nothing.
    assert judge.probability("what is the capital of canada") == scores[finished[0]]
    assert judge.probability(" ... ") == 0.0
    # The assistant's last words are read: the same answer, after a question, is judged apart.
    assert judge.probability("Yes.", "Shall I book it?") != judge.probability("Yes.")


def test_the_judge_stage_reports_the_transcript_and_judges_only_when_the_request_asks(
    judge, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.models.offline.finished_text import TurnJudge

    runner = TurnJudge.__new__(TurnJudge)  # the packaged judge of the module, not another copy
    monkeypatch.setattr(runner, "_judge", judge, raising=False)
    heard = {"messages": [{"role": "assistant", "text": "Where to?"},
                          {"role": "user", "text": "Boston."}], "input_transcript": "Boston."}

    def run(data: dict, params: dict | None = None) -> dict:
        (out,) = runner.run([BatchItem(StagePayload("r1", data, params or {}), final=True)])
        return out

    assert run(heard) == {"input_transcript": "Boston."}
    # Judged after the assistant's last words: "Boston." answers "Where to?".
    assert run(heard, {"end_of_turn": True}) == {
        "input_transcript": "Boston.", "input_end_of_turn": judge.probability("Boston.", "Where to?")}
    # A turn that came as text has no transcript to report, and nothing is judged.
    assert run({"messages": heard["messages"]}, {"end_of_turn": True}) == {}


def test_only_user_audio_without_text_is_transcribed(
    recognizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeTranscriber()
    monkeypatch.setattr(recognizer, "_transcriber", fake)
    audio = np.zeros(1600, np.float32)
    out = _run(
        recognizer,
        [
            {"role": "system", "text": "Be brief.", "audio": None, "sample_rate": None},
            {"role": "user", "text": "typed", "audio": audio, "sample_rate": 16000},
            {"role": "assistant", "text": None, "audio": audio, "sample_rate": 16000},
            {"role": "user", "text": None, "audio": audio, "sample_rate": 16000},
        ],
    )
    assert out == {
        "messages": [
            {"role": "system", "text": "Be brief."},
            {"role": "user", "text": "typed"},
            {"role": "user", "text": "heard 1"},
        ],
        "input_transcript": "heard 1",
    }
    assert "input_transcript" not in _run(recognizer, [{"role": "user", "text": "hi"}])
    # A turn the session already has a transcript of is not recognised again.
    out = _run(recognizer, [
        {"role": "user", "text": None, "transcript": "known", "audio": audio, "sample_rate": 16000},
        {"role": "user", "text": None, "audio": audio, "sample_rate": 16000},
    ])
    assert out["messages"] == [{"role": "user", "text": "known"}, {"role": "user", "text": "heard 2"}]
    assert fake.calls == 2


def test_long_speech_goes_through_whisper_s_own_30_s_windows(recognizer) -> None:
    """Clips up to 25 s are encoded in a window of twice their length; longer ones are segmented."""
    from harness.speech import speech

    sentences = [
        "The weather is nice today.",
        "I would like a cup of tea.",
        "My favourite colour is green.",
        "The train leaves at noon.",
        "Please close the window.",
        "We went to the beach yesterday.",
        "The cat is sleeping on the sofa.",
        "Thank you for your help.",
    ]
    audio = np.concatenate([speech(s, 16000) for s in sentences])
    assert audio.size > 25 * 16000
    heard = recognizer._transcriber.transcribe(audio, 16000)
    assert wer(" ".join(sentences), heard) <= 0.2, heard


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "non-empty list"),
        ([{"role": "robot", "text": "hi"}], "role must be one of"),
        (
            [
                {
                    "role": "user",
                    "text": None,
                    "audio": np.zeros(10, np.float32),
                    "sample_rate": 4000,
                }
            ],
            "sample_rate 4000 is not supported",
        ),
        ([{"role": "user", "text": None, "audio": None}], "neither text nor audio"),
    ],
)
def test_bad_messages_fail_their_request(recognizer, messages: list, error: str) -> None:
    with pytest.raises(RequestError, match=error):
        _run(recognizer, messages)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama saved as a Hugging Face folder, with SmolLM2's tokenizer."""
    pytest.importorskip("ctranslate2")
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pipeline.models.offline.sources import lm_source, prepare_lm

    tokenizer = AutoTokenizer.from_pretrained(prepare_lm(lm_source("packaged")).tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_a_hugging_face_folder_serves_with_its_chat_template(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.models.offline.lm import LanguageModel

    monkeypatch.setenv("DUPLEX_CACHE_DIR", str(tmp_path))
    stage = StageConfig(name="lm", runner="lm", scheduler="ar", max_new_tokens=6, terminal=True)
    runner = LanguageModel(StageContext(stage, {"lm": str(tiny_llama_dir)}))
    assert list(tmp_path.glob("offline-lm-*/ct2/model.bin"))  # converted into the cache
    assert list(tmp_path.glob("offline-lm-*/genai/genai_config.json"))
    messages = [{"role": "system", "text": "Speak like a pirate."}, {"role": "user", "text": "Hi"}]
    payload = StagePayload("r1", {"messages": messages, "input_transcript": "Hi"})
    slot = ARSlot("r1", {}, runner.new_state(payload), cap=6)
    assert "Speak like a pirate." in runner._tokenizer.decode(slot.state.prompt)
    outputs = []
    for _ in range(slot.cap):
        (result,) = runner.step([slot])
        slot.steps += 1
        outputs.append(result)
        if result.finished:
            break
    # Text only (the asr stage reports the transcript): every step a token, six at most.
    assert all(set(o.data or {}) <= {"text"} for o in outputs)
    assert len(outputs) <= 6 and 1 <= len(slot.state.ids) <= 6
    runner.release(slot)
    assert slot.state is None

    # Released mid-answer, the decoder stops at its next token instead of running to its cap.
    slot = ARSlot(
        "r2", {}, runner.new_state(StagePayload("r2", {"messages": messages})), cap=100000
    )
    state = slot.state
    runner.step([slot])
    runner.release(slot)
    deadline = time.monotonic() + 5
    while state.decoder.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not state.decoder.is_alive() and state.steps.qsize() + len(state.ids) < 1000


def test_a_transcript_that_loops_on_itself_is_caught() -> None:
    """Whisper tiny once gave a 2 s question back sixteen times over; such text compresses far
    better than speech does, which sends the clip to faster-whisper's path with its fallback."""
    from pipeline.models.offline.asr import MAX_COMPRESSION_RATIO, _compression_ratio

    question = "What is the capital of France?"
    assert _compression_ratio(question) < MAX_COMPRESSION_RATIO
    assert _compression_ratio("I would like to order a large pizza with mushrooms and olives.") \
        < MAX_COMPRESSION_RATIO
    assert _compression_ratio(" ".join([question] * 16)) > MAX_COMPRESSION_RATIO
    # Said once and a half, as CI once heard it, the text compresses no better than speech.
    from pipeline.models.offline.asr import _says_a_run_twice

    twice = f"{question} What is the capital of France"
    assert _compression_ratio(twice) < MAX_COMPRESSION_RATIO and _says_a_run_twice(twice)
    assert not _says_a_run_twice(question)
    assert not _says_a_run_twice("No, no, no. I said the red one, not the blue one.")


@pytest.mark.parametrize(("question", "before_s", "after_s"), [
    ("What is the capital of France?", 0.2, 0.3),
    ("What is the capital of France?", 0.25, 0.5),
    ("What is the capital of France?", 0.15, 0.6),
    ("What is the capital of Japan?", 0.05, 0.5),
    ("What is the capital of Japan?", 0.15, 0.0),
])
def test_a_question_is_heard_once_wherever_it_sits_in_the_clip(
        recognizer, question: str, before_s: float, after_s: float) -> None:
    """In a window of the clip's length plus a second, padded with zeros as features, Whisper
    tiny.en heard each of these placements of a natural voice's question as the question and then
    its start again (France also as "friends"). Heard once: no more words than were said, one of
    them misheard at most ("friends" for "France" came back in 1 of ~10 full-suite runs, where
    nothing else in the window had changed: tiny.en is unsure of that word in piper's voice)."""
    from harness.speech import natural_speech

    audio = natural_speech(question, 16000, before_s, after_s)
    heard = recognizer._transcriber.transcribe(audio, 16000)
    assert len(normalize(heard)) <= len(normalize(question)), heard
    assert wer(question, heard) <= 1 / len(normalize(question)), heard


def test_a_sentence_ends_where_the_next_one_begins() -> None:
    from pipeline.models.offline.lm import sentences_end

    def first(text: str, count: int) -> str | None:
        end = sentences_end(text, count)
        return None if end is None else text[:end]

    assert first("It is 3.5 m long. Yes it is. And", 1) == "It is 3.5 m long."
    assert first("It is 3.5 m long. Yes it is. And", 2) == "It is 3.5 m long. Yes it is."
    assert first("One! Two? Three", 2) == "One! Two?"
    assert first('He said "go." Then', 1) == 'He said "go."'
    # Nothing ends until the next sentence has begun: a final mark may be a decimal point yet.
    assert first("It is 3.", 1) is None and first("Yes. ", 1) is None
    # A list's items count one each; the line that opens the list runs on into its first item.
    assert first("Try these:\n\n- Dune\n- Emma", 1) == "Try these:\n\n- Dune"
    assert first("\nHello\nWorld", 1) == "\nHello"
    assert first("Hi. There", 0) is None  # no limit


def test_an_answer_ends_after_its_sentence_limit() -> None:
    """The packaged SmolLM2 answers this in more than one sentence; limited to one, its answer is
    the first of them, ended as an answer ends (finish_reason "stop")."""
    from pipeline.models.offline.lm import LanguageModel

    def answer(max_sentences: int) -> tuple[str, dict]:
        stage = StageConfig(name="lm", runner="lm", scheduler="ar", max_new_tokens=64,
                            terminal=True, options={"max_sentences": max_sentences})
        runner = LanguageModel(StageContext(stage, {"lm": "packaged"}))
        payload = StagePayload("r1", {"messages": [
            {"role": "user", "text": "How do I make a cup of tea?"}]})
        slot = ARSlot("r1", {}, runner.new_state(payload), cap=64, input_closed=True)
        text = ""
        while slot.steps < slot.cap:
            (result,) = runner.step([slot])
            slot.steps += 1
            text += (result.data or {}).get("text", "")
            if result.finished:
                break
        done = runner.finish(slot, capped=False)
        runner.release(slot)
        return text, done

    whole, _ = answer(0)
    first, done = answer(1)
    assert whole.count(". ") >= 1, whole  # the model's own answer goes on past one sentence
    assert whole.startswith(first) and len(first) < len(whole)
    assert first.endswith(".") and first.count(".") == 1, first
    assert done["finish_reason"] == "stop"
