"""TokenTexts (the logprobs output's decoded_token): special tokens are "" where the text skips them (the default) and
keep their names where it does not; other tokens read the same either way, and the sampled tokens' texts make up the
request's text."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from backend.outputs.detokenizer import IncrementalDetokenizer
from backend.outputs.token_text import TokenTexts
from backend.request import SamplingParams

EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny byte-level BPE with one special token, trained here."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The capital of France is Paris."] * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, clean_up_tokenization_spaces=False)


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
    text = "".join(detok.add_tokens([token]) for token in ids) + detok.finish()
    decode = TokenTexts(tokenizer).decoder(skip)
    assert "".join(decode(token) for token in ids) == text
    assert text.endswith(EOS) is not skip
