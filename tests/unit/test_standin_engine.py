"""The whole engine loop with the stand-in model: every request gets exactly its tokens, in both modes."""
import pytest

from backend import Engine, EngineConfig, SamplingParams
from backend.models.standin import StandInModel, expected_tokens
from tests.tiny_models import kv_blocks_used_after_settling, random_prompts


@pytest.mark.parametrize("async_pipeline", [False, True], ids=["sync", "async"])
def test_every_request_gets_exactly_its_tokens(async_pipeline):
    # model="stand-in" alone builds the stand-in and its byte tokenizer, as a served config.pbtxt would
    engine = Engine(EngineConfig(model="stand-in", device="cpu", num_kv_blocks=2048, max_num_seqs=64,
                                 max_num_batched_tokens=1024, async_pipeline=async_pipeline))
    assert isinstance(engine.parts.model, StandInModel) and engine.spec.vocab_size == 512
    try:
        prompts = random_prompts([(7 * i) % 90 + 1 for i in range(96)], seed=3)  # more requests than seats
        lengths = [(13 * i) % 60 + 1 for i in range(96)]
        outs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
        assert [o.token_ids for o in outs] == [expected_tokens(p, n, 512) for p, n in zip(prompts, lengths)]
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()
