"""Drives `stormo serve --http` with the real `openai` client (run by tests/integration/http.rs).

Usage: python3 http_openai_client.py BASE_URL   (e.g. http://127.0.0.1:8080/v1)
Prints "openai client: all checks passed" when every check holds; raises otherwise.
"""

import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)

models = client.models.list()
ids = [m.id for m in models.data]
assert len(ids) == 1 and ids[0], ids
model = ids[0]

messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]

# Chat, whole.
r = client.chat.completions.create(
    model=model, messages=messages, max_tokens=60, temperature=0.7, top_p=0.95, seed=42
)
assert r.object == "chat.completion", r
choice = r.choices[0]
assert choice.message.role == "assistant", choice
assert isinstance(choice.message.content, str), choice
assert choice.finish_reason in ("stop", "length"), choice
assert r.usage.prompt_tokens > 10, r.usage
assert 1 <= r.usage.completion_tokens <= 60, r.usage
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

# Chat, streamed with the same seed: the same text.
stream = client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=60,
    temperature=0.7,
    top_p=0.95,
    seed=42,
    stream=True,
    stream_options={"include_usage": True},
)
parts, finish, usage = [], None, None
for chunk in stream:
    assert chunk.object == "chat.completion.chunk", chunk
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert "".join(parts) == choice.message.content, ("".join(parts), choice.message.content)
assert finish == choice.finish_reason, (finish, choice.finish_reason)
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage

# A second turn resends the conversation (the server reuses its cached prefix).
messages2 = messages + [
    {"role": "assistant", "content": choice.message.content},
    {"role": "user", "content": "And three more?"},
]
r2 = client.chat.completions.create(model=model, messages=messages2, max_tokens=5, seed=1)
assert r2.usage.prompt_tokens > r.usage.prompt_tokens, (r2.usage, r.usage)

# Completions, whole and streamed.
c = client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0, seed=0)
assert c.object == "text_completion", c
text = c.choices[0].text
assert text, c
assert c.usage.completion_tokens == 12 and c.choices[0].finish_reason == "length", c
streamed = "".join(
    ch.choices[0].text
    for ch in client.completions.create(
        model=model, prompt="Hello", max_tokens=12, temperature=0, seed=0, stream=True
    )
    if ch.choices
)
assert streamed == text, (streamed, text)

# Errors come back as the client's exceptions with OpenAI's body.
try:
    client.chat.completions.create(model=model, messages=[], max_tokens=1)
    raise AssertionError("empty messages were accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400
    assert e.body and "messages" in e.body.get("message", ""), e.body

print("openai client: all checks passed")
