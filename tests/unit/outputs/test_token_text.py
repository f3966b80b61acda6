"""TokenTexts (the logprobs output's decoded_token): special tokens are "" where the text skips them (the default) and
keep their names where it does not; other tokens read the same either way, and the sampled tokens' texts make up the
request's text."""
import pytest

from backend.outputs.detokenizer import IncrementalDetokenizer
from backend.outputs.token_text import TokenTexts
from backend.request import SamplingParams
from tests.tiny_models import byte_level_bpe
from tests.unit.outputs.detokenizer_steps import add_tokens

EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny byte-level BPE with one special token, trained here."""
    return byte_level_bpe(["The capital of France is Paris."] * 5, 280, EOS)


def test_special_tokens_follow_skip_special_tokens(tokenizer):
    texts = TokenTexts(tokenizer)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    assert texts.decoder(True)(eos) == ""
    assert texts.decoder(False)(eos) == EOS
    for token in tokenizer.encode(" Paris."):
        assert texts.decoder(True)(token) == texts.decoder(False)(token) == tokenizer.decode([token])


@pytest.mark.parametrize("skip", [True, False])
def test_sampled_tokens_texts_make_up_the_text(tokenizer, skip):
    ids = tokenizer.encode("The capital of France is Paris.") + [tokenizer.convert_tokens_to_ids(EOS)]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Q:"), SamplingParams(skip_special_tokens=skip))
    text = "".join(add_tokens(detok, [token]) for token in ids) + detok.finish()
    decode = TokenTexts(tokenizer).decoder(skip)
    assert "".join(decode(token) for token in ids) == text
    assert text.endswith(EOS) is not skip
