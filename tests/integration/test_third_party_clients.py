"""A third-party client against the real tritonserver: LiteLLM's Triton provider, called as its users call it.

`litellm.completion(model="triton/llm", api_base=".../v2/models/llm/generate", ...)` renders the chat messages
with the model's chat template into one prompt and posts {"text_input": prompt, "parameters": {"max_tokens": N,
<its other keyword arguments>}, "stream": bool} to /generate (/generate_stream when streaming); it reads
text_output back and turns an HTTP 400 into litellm.BadRequestError. Triton's OpenAI-compatible frontend itself
cannot run here (its in-process `tritonserver` wheels need Python 3.12, a newer libstdc++ than this machine's and
a newer Triton core than nvidia-pytriton's); test_vllm_conventions.py replays the requests it builds instead.
"""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from backend.models.default_model import DEFAULT_ALIAS, resolve_model_path
from tests.integration.conftest import MODEL_NAME
from tests.integration.test_triton_serving import http_generate, sse_events

pytestmark = pytest.mark.integration

AIPERF_TEMPLATE = Path(__file__).resolve().parents[2] / "loadtest" / "aiperf" / "generate.json.jinja"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def litellm_client():
    """litellm, given the served checkpoint's chat template, with a record of the bodies it sends. Left alone it
    looks the template up on the Hugging Face hub under the Triton model's name ("llm": no such repository) and
    falls back to the messages' contents joined by spaces; known_tokenizer_config is its cache of those look-ups."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price table: no download at import
        import litellm
        from litellm.integrations.custom_logger import CustomLogger
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_ALIAS))
    litellm.known_tokenizer_config[MODEL_NAME] = {"status": "success", "tokenizer": {
        "chat_template": tokenizer.chat_template, "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}}
    bodies: list[dict] = []

    class BodySpy(CustomLogger):
        """The request body LiteLLM posts, as its logging hook sees it just before the HTTP call."""

        def log_pre_api_call(self, model, messages, kwargs):
            bodies.append(kwargs["additional_args"]["complete_input_dict"])

    callbacks = litellm.callbacks
    litellm.callbacks = [BodySpy()]
    try:
        yield litellm, bodies, tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    finally:
        litellm.callbacks = callbacks
        litellm.known_tokenizer_config.pop(MODEL_NAME, None)
        # LiteLLM keeps its HTTP clients (and their keep-alive connections) for reuse; an open connection holds
        # tritonserver's shutdown for its whole --exit-timeout-secs
        from litellm.llms.custom_httpx.http_handler import HTTPHandler
        for client in list(litellm.in_memory_llm_clients_cache.cache_dict.values()):
            if isinstance(client, HTTPHandler):
                client.close()


def complete(litellm, server, **kwargs):
    api_base = f"http://{server.http_url}/v2/models/{server.model_name}/generate"
    return litellm.completion(model=f"triton/{server.model_name}", messages=MESSAGES, api_base=api_base, **kwargs)


def plain(server, prompt: str, parameters: dict) -> str:
    """The same prompt as a plain /generate request: the text the vLLM backend's conventions give."""
    response = http_generate(server, {"text_input": prompt, "parameters": parameters})
    assert response.status_code == 200, response.text
    return response.json()["text_output"]


@pytest.mark.parametrize("kwargs, sent, parameters", [
    # top_k is no OpenAI parameter: LiteLLM passes it through; top_k 1 is greedy
    ({"max_tokens": 8, "top_k": 1}, {"max_tokens": 8, "top_k": 1}, GREEDY),
    # OpenAI's own sampling parameters go through only when named in allowed_openai_params
    ({"max_tokens": 8, "temperature": 0, "seed": 7, "allowed_openai_params": ["temperature", "seed"]},
     {"max_tokens": 8, "temperature": 0, "seed": 7}, GREEDY),
    # a stop string (Triton's request parameters take no lists: see the errors below)
    ({"max_tokens": 8, "top_k": 1, "stop": " Paris", "allowed_openai_params": ["stop"]},
     {"max_tokens": 8, "top_k": 1, "stop": " Paris"}, {**GREEDY, "stop": " Paris"}),
], ids=["top_k", "temperature_seed", "stop"])
def test_litellm_chat_gives_the_plain_requests_text(triton_server, litellm_client, kwargs, sent, parameters):
    """Unary: the body is the chat-templated prompt and the keyword arguments; the content is the plain request's
    text_output, prompt first (the vLLM backend's non-streaming output repeats the prompt)."""
    litellm, bodies, prompt = litellm_client
    want = plain(triton_server, prompt, parameters)
    response = complete(litellm, triton_server, **kwargs)
    assert bodies[-1] == {"text_input": prompt, "parameters": sent, "stream": False}
    assert response.choices[0].message.content == want
    assert want.startswith(prompt) and len(want) > len(prompt)
    if "stop" in parameters:
        assert "Paris" not in want[len(prompt):] and plain(triton_server, prompt, GREEDY).startswith(want)


def test_litellm_exclude_input_in_output_gives_the_completion_only(triton_server, litellm_client):
    """exclude_input_in_output, passed as a keyword argument, lands in "parameters" and Triton's /generate hands it
    to the model as that input: the content is then the completion alone."""
    litellm, bodies, prompt = litellm_client
    want = plain(triton_server, prompt, GREEDY)
    response = complete(litellm, triton_server, max_tokens=8, top_k=1, exclude_input_in_output=True)
    assert bodies[-1]["parameters"] == {"max_tokens": 8, "top_k": 1, "exclude_input_in_output": True}
    assert response.choices[0].message.content == want[len(prompt):] != ""


def test_litellm_streaming_gives_the_completion_in_pieces(triton_server, litellm_client):
    """stream=True posts to /generate_stream with "stream": true; the deltas add up to the plain request's
    completion (a stream never repeats the prompt), one piece per token or more."""
    litellm, bodies, prompt = litellm_client
    want = plain(triton_server, prompt, GREEDY)[len(prompt):]
    chunks = list(complete(litellm, triton_server, max_tokens=8, top_k=1, stream=True))
    assert bodies[-1] == {"text_input": prompt, "parameters": {"max_tokens": 8, "top_k": 1}, "stream": True}
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(pieces) == want and len(pieces) > 1


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
@pytest.mark.parametrize("kwargs, message", [
    # without max_tokens LiteLLM sends 2000, more than this test server's max_model_len
    ({"top_k": 1}, "+ max_tokens (2000) exceeds the maximum model length (1024)"),
    # LiteLLM lists max_completion_tokens as a Triton parameter and forwards it as it is, beside max_tokens 2000;
    # vLLM's SamplingParams has no such field either
    ({"max_completion_tokens": 8}, "unknown sampling parameter(s) ['max_completion_tokens']"),
    # a list in "parameters" is refused by Triton's HTTP front end before the model sees the request
    ({"max_tokens": 8, "stop": ["Paris"], "allowed_openai_params": ["stop"]},
     "parameter 'stop' has invalid type. It should be either 'int', 'bool', or 'string'"),
], ids=["default_max_tokens", "max_completion_tokens", "stop_list"])
def test_litellm_gets_our_400_as_bad_request(triton_server, litellm_client, kwargs, message, stream):
    litellm, _, _ = litellm_client
    with pytest.raises(litellm.BadRequestError) as caught:
        response = complete(litellm, triton_server, stream=stream, **kwargs)
        if stream:
            list(response)
    assert caught.value.status_code == 400
    assert message in str(caught.value)


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "generate_stream"])
def test_aiperf_template_gives_exactly_max_tokens_without_the_prompt(triton_server, stream):
    """loadtest/aiperf/generate.json.jinja, rendered as aiperf's template endpoint renders it (Jinja2 with
    autoescape, its text / stream / max_tokens), is a body Triton's /generate and /generate_stream take: exactly
    max_tokens new tokens (ignore_eos), in text_output (the template's response_field), without the prompt."""
    prompt = 'Repeat after me: "tea & <biscuits>" and then a long story about a dragon'
    template = jinja2.Environment(autoescape=True).from_string(AIPERF_TEMPLATE.read_text())
    body = json.loads(template.render(text=prompt, stream=stream, max_tokens=12))
    assert body["text_input"] == prompt and body["stream"] is stream
    body["return_num_output_tokens"] = True  # as aiperf's --extra-inputs would add it, at the top level
    response = http_generate(triton_server, body, stream=stream)
    assert response.status_code == 200, response.text
    events = sse_events(response) if stream else [response.json()]
    assert [e for e in events if "error" in e] == []
    assert sum(e["num_output_tokens"] for e in events) == 12
    assert prompt not in "".join(e["text_output"] for e in events)
