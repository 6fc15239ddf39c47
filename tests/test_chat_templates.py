"""Chat templates: rendered as transformers renders them, within bounds, and a request's own only when trusted.

The renderer is compared with ``tokenizer.apply_chat_template`` on real templates (the default model's, the
Qwen-style test template, a multimodal parts template, and one that uses transformers' globals, tags and
filters). Hostile templates end with an error naming the bound they crossed; a render that ignores its
budget does not hold up other renders. Against real servers: a request's template is refused without
``--trust-request-chat-template`` (vLLM's message), used with it, and a template that loops for ever is a 400
while other requests are answered, and does not keep the server from exiting on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import openai
import pytest
import transformers

pytest.register_assert_rewrite("tests.server_helpers")
from server.chat_templates import TemplateRunner, render_conversation  # noqa: E402
from server.template_sandbox import RENDER_BUDGET, TemplateLimitError, TemplateLimits, TemplateTimeout  # noqa: E402
from tests.server_helpers import (  # noqa: E402
    QWEN_STYLE_TEMPLATE,
    TINY_MODEL_NAME,
    assert_error_shape,
    start_server,
    tiny_server_args,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
# transformers' extras: namespace, dict, tojson with its options, loop controls, {% generation %}, raise_exception.
EXTRAS_TEMPLATE = """{%- set ns = namespace(n=0, sys='') -%}
{%- for m in messages -%}
{%- if m.role == 'system' %}{% set ns.sys = m.content %}{% continue %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
{%- if m.role == 'assistant' %}{% generation %}<a>{{ m.content | trim }}</a>{% endgeneration %}
{%- elif m.role == 'tool' %}<t>{{ dict(id=m.tool_call_id, n=ns.n) | tojson(sort_keys=true) }}</t>
{%- else %}<u n="{{ ns.n }}">{{ m.content }}</u>{% endif -%}
{%- if m.tool_calls is defined %}{% for c in m.tool_calls %}{{ c.function | tojson(indent=2) }}{% endfor %}{% endif -%}
{%- endfor -%}
{%- if tools %}<tools>{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}</tools>{% endif -%}
{%- if ns.sys %}<s>{{ ns.sys }}</s>{% endif -%}{{ bos_token }}{% if flavour is defined %}[{{ flavour }}]{% endif -%}
{%- if add_generation_prompt %}<a>{% endif -%}
{%- if messages | length > 50 %}{{ raise_exception('too many messages') }}{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "one user message": [{"role": "user", "content": "What is the capital of France?"}],
    "system and an answer": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello there "}],
    "a tool call and its result": [{"role": "user", "content": "Weather in Paris?"},
                                   {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                   {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}],
}


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return transformers.AutoTokenizer.from_pretrained(default_model_path)


def rendered_both_ways(tokenizer, template: str, conversation: list[dict], **options) -> tuple[str, str]:
    kwargs = options.pop("kwargs", {})
    expected = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, **options,
                                             **kwargs)
    ours = render_conversation(template, conversation, options.get("tools"), options["add_generation_prompt"],
                               options.get("continue_final_message", False), {**tokenizer.special_tokens_map, **kwargs})
    return ours, expected


@pytest.mark.parametrize("template_name", ["default model", "qwen style", "parts", "extras"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS), ids=list(CONVERSATIONS))
@pytest.mark.parametrize("mode", ["generation prompt", "no generation prompt", "continue", "tools and kwargs"])
def test_the_text_is_transformers_text(tokenizer, template_name, conversation, mode):
    template = {"default model": tokenizer.chat_template, "qwen style": QWEN_STYLE_TEMPLATE.read_text(),
                "parts": PARTS_TEMPLATE, "extras": EXTRAS_TEMPLATE}[template_name]
    messages = [dict(m) for m in CONVERSATIONS[conversation]]
    options = {"add_generation_prompt": mode == "generation prompt"}
    if mode == "continue":
        if messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
            messages.append({"role": "assistant", "content": "The answer is"})
        options["continue_final_message"] = True
    if mode == "tools and kwargs":
        options.update(tools=TOOLS, add_generation_prompt=True, kwargs={"enable_thinking": False, "flavour": "x"})
    ours, expected = rendered_both_ways(tokenizer, template, messages, **options)
    assert ours == expected


def test_content_parts_and_errors_are_transformers_own(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"},
                                          {"type": "text", "text": "at this"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "It is a"}]}]
    ours, expected = rendered_both_ways(tokenizer, PARTS_TEMPLATE, parts, add_generation_prompt=False,
                                        continue_final_message=True)
    assert ours == expected and ours.endswith("ASSISTANT: It is a")
    too_many = [{"role": "user", "content": str(i)} for i in range(51)]
    with pytest.raises(Exception) as theirs:
        tokenizer.apply_chat_template(too_many, chat_template=EXTRAS_TEMPLATE, tokenize=False)
    with pytest.raises(Exception) as ours_error:
        render_conversation(EXTRAS_TEMPLATE, too_many)
    assert type(ours_error.value) is type(theirs.value) and str(ours_error.value) == "too many messages"


SMALL = TemplateLimits(max_chars=100_000, timeout_s=30.0)


@pytest.mark.parametrize("template, says", [
    ("{% set s = 'x' * 300000000 %}{{ s | length }}", "a repeated value of 300,000,000 characters"),
    ("{{ 'x' | center(1000000000) }}", "a centred string"),
    ("{{ 'x'.ljust(1000000000) }}", "a padded string"),
    ("{{ '{:>1000000000}'.format('x') }}", "a formatted field"),
    ("{{ '%1000000000s' % 'x' }}", "a formatted field"),
    ("{{ (['x' * 1000] * 100000) | join }}", "a joined string"),
    ("{{ ('x' * 1000) | replace('x', 'y' * 1000) }}", "a replaced string"),
    ("{{ ('\t' * 1000).expandtabs(100000) }}", "an expanded string"),
    ("{{ ([[1] * 1000] * 100000) | sum(start=[]) | length }}", "a summed list"),
    ("{{ [1] | batch(100000000, 'x') | list | length }}", "groups"),
    ("{{ range(100000) | map('center', 90000) | list | length }}", "characters and items in all"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "an operand of ~"),
    ("{% set b = 'x' * 90000 %}{% set c %}{% for i in range(100000) %}{{ b }}{% endfor %}{% endset %}",
     "characters and items in all"),
    ("{% set b = 'x' * 90000 %}{{ ([b] * 1000) | upper }}", r"\|upper's input"),
    ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "bits"),
    ("{{ lipsum(1000000) }}", r"lipsum\(\) is limited"),
    ("{{ [1] | tojson(indent=100000000) }}", "limited to 64 characters"),
], ids=["repeat", "center", "ljust", "format-width", "percent-width", "join", "replace", "expandtabs", "sum",
        "batch", "work", "doubling", "set-block", "container-text", "bigint", "lipsum", "tojson-indent"])
def test_what_a_render_would_make_is_bounded_before_it_is_made(template, says):
    with pytest.raises(TemplateLimitError, match=says):
        render_conversation(template, [{"role": "user", "content": "hi"}], limits=SMALL)


def test_a_render_stops_at_its_deadline_and_its_output_at_the_context():
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}" \
             "{% endfor %}{% endfor %}{% endfor %}"
    with pytest.raises(TemplateTimeout, match="longer than 0.5 s"):
        render_conversation(nested, [], limits=TemplateLimits(timeout_s=0.5))
    fanout = "{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}"
    with pytest.raises(TemplateTimeout):
        render_conversation(fanout, [], limits=TemplateLimits(timeout_s=0.5))
    long = [{"role": "user", "content": "y" * 600}]
    with pytest.raises(TemplateLimitError, match="an output"):
        render_conversation("{% for m in messages %}{{ m.content }}{% endfor %}", long, limits=TemplateLimits(500))


def test_a_render_that_ignores_its_budget_does_not_hold_up_the_next():
    """The runner answers a render that outlives its deadline (here: one that never checks it, blocked on an event)
    with TemplateTimeout and leaves its thread behind, a daemon; a render beside it is answered meanwhile, and a
    cancelled caller cancels its render's budget (the render sees it at its next check)."""
    release, seen_cancel = threading.Event(), threading.Event()
    threads = []

    def stuck() -> str:
        threads.append(threading.current_thread())
        release.wait(30)
        return "late"

    def cooperative() -> str:
        budget = RENDER_BUDGET.get()
        while not budget.cancelled:
            release.wait(0.01)
        seen_cancel.set()
        return "cancelled"

    async def main():
        runner = TemplateRunner(max_concurrent=2, grace_s=0.2)
        limits = TemplateLimits(timeout_s=0.3)
        stuck_one = asyncio.ensure_future(runner.run(limits, stuck))
        quick = await runner.run(TemplateLimits(), render_conversation, "{{ messages[0].content }}!",
                                 [{"role": "user", "content": "hello"}])
        with pytest.raises(TemplateTimeout):
            await stuck_one
        waiting = asyncio.ensure_future(runner.run(TemplateLimits(), cooperative))
        await asyncio.sleep(0)  # let it start its thread
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return quick

    assert asyncio.run(main()) == "hello!"
    assert seen_cancel.wait(10)
    assert threads and threads[0].daemon and threads[0].is_alive()
    release.set()


# ------------------------------------------------------------------------------ real servers

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
                "{% endfor %}{% endfor %}{% endfor %}")
LISTING = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def trusting(tmp_path_factory, tiny_model_path):
    server = start_server(tmp_path_factory.mktemp("servers"), "trusting",
                          tiny_server_args(tiny_model_path) + ["--trust-request-chat-template"])
    yield server
    server.stop()


@pytest.mark.server
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/invocations"])
def test_a_request_template_needs_the_trust_flag(tiny_server, path):
    body = {"messages": CHAT, "chat_template": LISTING, "max_tokens": 2}
    if path == "/tokenize":
        del body["max_tokens"]
    error = assert_error_shape(httpx.post(f"{tiny_server.url}{path}", json=body, timeout=60), 400)
    assert error["param"] == "chat_template"
    assert error["message"] == ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                                "Refused request with untrusted chat template.")


@pytest.mark.server
def test_with_the_flag_a_request_template_replaces_the_models(trusting):
    ids = httpx.post(f"{trusting.url}/tokenize", json={"messages": CHAT, "chat_template": LISTING}).json()["tokens"]
    text = httpx.post(f"{trusting.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "[user] What is the capital of France?\n[assistant]"
    client = openai.OpenAI(base_url=f"{trusting.url}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_tokens=2,
                                           extra_body={"chat_template": LISTING})
    assert reply.usage.prompt_tokens == len(ids)


@pytest.mark.server
def test_a_template_that_never_ends_is_a_400_and_holds_up_nobody(trusting):
    """Three nested loops of 100,000: a 400 naming the time bound. Meanwhile a chat completion (the model's own
    template) and text tokenization are answered, and afterwards nothing is left running."""
    outcome = {}

    def hostile():
        outcome["response"] = httpx.post(f"{trusting.url}/tokenize", json={"messages": CHAT,
                                                                          "chat_template": NESTED_LOOPS}, timeout=120)

    thread = threading.Thread(target=hostile)
    thread.start()
    chat = httpx.post(f"{trusting.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=120)
    text = httpx.post(f"{trusting.url}/tokenize", json={"prompt": "hello"}, timeout=120)
    thread.join()
    assert chat.status_code == 200 and text.status_code == 200
    error = assert_error_shape(outcome["response"], 400)
    assert error["code"] == "chat_template_limit" and "longer than 5 s" in error["message"]
    big = {"messages": CHAT, "chat_template": "{% set s = 'x' * 300000000 %}{{ s }}", "max_tokens": 2}
    error = assert_error_shape(httpx.post(f"{trusting.url}/v1/chat/completions", json=big, timeout=60), 400)
    assert "a repeated value of 300,000,000 characters" in error["message"]
    assert httpx.get(f"{trusting.url}/load").json() == {"server_load": 0}
    assert wait_until_idle(trusting.url)["minivllm:kv_cache_blocks_used"] == 0


@pytest.mark.server
def test_sigterm_ends_a_server_while_a_render_loops(tmp_path, tiny_model_path):
    """The request is sent on a connection kept open (so the render is not cancelled as its client leaves); a
    /health answered after it was sent shows the server took it in. SIGTERM then ends the server, exit code 0."""
    server = start_server(tmp_path, "sigterm", tiny_server_args(tiny_model_path) + ["--trust-request-chat-template"])
    try:
        body = json.dumps({"messages": CHAT, "chat_template": NESTED_LOOPS}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as conn:
            conn.sendall(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            server.send_signal()
            assert server.wait(60) == 0
    finally:
        server.stop()
