"""IncrementalDetokenizer: exact deltas, no half characters, stop strings, hold-back and its release."""
import pytest

from backend.outputs.detokenizer import IncrementalDetokenizer
from backend.request import SamplingParams
from tests.tiny_models import byte_level_bpe
from tests.unit.outputs.detokenizer_steps import add_tokens

SENTENCES = [
    "héllo wörld 日本語 🙂",
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Stop here: END of story. Ça va? naïve café 東京 🚀🙂",
]
TEXT = "héllo wörld 日本語 🙂 and then END of the 🚀 story"
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny byte-level BPE trained here: multi-byte characters span several tokens."""
    return byte_level_bpe(SENTENCES * 5, 300, EOS)


def stream(tokenizer, text, params, chunk=1, prompt="the prompt"):
    """Feed text's tokens chunk by chunk; return (deltas, detokenizer)."""
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    deltas = [add_tokens(detok, ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok


def test_tiny_tokenizer_splits_multibyte_characters(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1 and "\ufffd" in tokenizer.decode(ids[:1])


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_deltas_concatenate_to_the_full_decode(tokenizer, chunk):
    for text in SENTENCES + [TEXT]:
        deltas, detok = stream(tokenizer, text, SamplingParams(), chunk=chunk)
        tail = detok.finish()
        assert "".join(deltas) + tail == tokenizer.decode(tokenizer.encode(text)) == text
        assert all("\ufffd" not in d for d in deltas)
        assert detok.text == text and detok.token_ids == tokenizer.encode(text)


def test_partial_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🙂")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), SamplingParams())
    assert [add_tokens(detok, [i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert add_tokens(detok, ids[-1:]) == "🙂"


def test_finish_releases_an_incomplete_character_as_the_full_decode_does(tokenizer):
    ids = tokenizer.encode("ab🙂")[:-1]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    text = "".join(add_tokens(detok, [i]) for i in ids) + detok.finish()
    assert text == tokenizer.decode(ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["END of", "日本語 🙂", "wörld 日"])
def test_stop_string_spanning_tokens_truncates_exactly(tokenizer, stop, include):
    params = SamplingParams(stop=["never", stop], include_stop_str_in_output=include)
    deltas, detok = stream(tokenizer, TEXT, params)
    cut = TEXT.index(stop) + (len(stop) if include else 0)
    assert detok.stopped
    assert "".join(deltas) == detok.text == TEXT[:cut]
    assert detok.finish() == "" and add_tokens(detok, tokenizer.encode(" more")) == ""
    assert detok.text == TEXT[:cut]


def test_text_after_the_stop_is_never_emitted_even_in_the_same_chunk(tokenizer):
    deltas, detok = stream(tokenizer, TEXT, SamplingParams(stop=["wörld"]), chunk=100)
    assert deltas == ["héllo "] and detok.stopped


def test_earliest_completed_stop_wins(tokenizer):
    deltas, _ = stream(tokenizer, TEXT, SamplingParams(stop=["and then END", "then"]), chunk=100)
    assert "".join(deltas) == "héllo wörld 日本語 🙂 and "


def test_possible_stop_prefix_is_held_back_then_released_by_finish(tokenizer):
    params = SamplingParams(stop=["story time"])
    deltas, detok = stream(tokenizer, "once upon a story", params)
    assert "".join(deltas) == "once upon a " and not detok.stopped  # "story" may begin "story time"
    assert detok.finish() == "story"
    assert detok.text == "once upon a story"


def test_text_that_cannot_start_a_stop_is_not_held(tokenizer):
    deltas, detok = stream(tokenizer, "hello world", SamplingParams(stop=["xyz"]))
    assert "".join(deltas) == "hello world" and detok.finish() == ""


def test_special_tokens_are_skipped_or_kept(tokenizer):
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids = tokenizer.encode("hello") + [eos_id] + tokenizer.encode(" world")
    for skip, expected in ((True, "hello world"), (False, f"hello{EOS} world")):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
        assert "".join(add_tokens(detok, [i]) for i in ids) + detok.finish() == expected


def test_excluded_tokens_join_token_ids_without_text(tokenizer):
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    ids = tokenizer.encode("hello")
    text = add_tokens(detok, ids) + add_tokens(detok, [eos_id], exclude_from_text=True) + detok.finish()
    assert text == "hello" and detok.token_ids == ids + [eos_id]


def test_long_stream_keeps_the_window_short(tokenizer):
    text = " ".join(SENTENCES) * 30
    deltas, detok = stream(tokenizer, text, SamplingParams())
    assert "".join(deltas) + detok.finish() == text
    assert len(detok._window) < 300  # decoding cost does not grow with the output


def test_real_smollm2_tokenizer():
    default_model = pytest.importorskip("backend.models.default_model")
    try:
        path = default_model.resolve_model_path("smollm2-135m-instruct")
    except Exception as exc:  # the model package or its conversion is unavailable here
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    text = "héllo wörld 日本語 🙂\n  indented: café, END. 🚀"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Hi there"), SamplingParams())
    deltas = [add_tokens(detok, [i]) for i in ids]
    assert "".join(deltas) + detok.finish() == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas)
    stopped = IncrementalDetokenizer(tok, [], SamplingParams(stop=["END."]))
    assert "".join(add_tokens(stopped, [i]) for i in ids) == text[: text.index("END.")]


def test_overlapping_stop_prefix_is_held_exactly(tokenizer):
    deltas, detok = stream(tokenizer, "xaba", SamplingParams(stop=["abab"]))
    assert "".join(deltas) == "x" and detok.finish() == "aba"
    deltas, detok = stream(tokenizer, "xababy", SamplingParams(stop=["abab"]))
    assert "".join(deltas) == "x" and detok.stopped


def test_invalid_bytes_do_not_grow_the_window():
    """A model that emits invalid UTF-8 (lone continuation bytes) must not make each step decode all history."""
    from backend.models.random_model import byte_tokenizer

    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(tok, [104, 105], SamplingParams())
    text = ""
    for _ in range(300):
        text += add_tokens(detok, [0x80])
        assert len(detok.windows()[1]) <= 40
    text += detok.finish()
    assert text.count("\ufffd") == 300
