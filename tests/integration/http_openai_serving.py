"""Drives `stormo serve --http` with the real `openai` client: log-probabilities against
`stormo run --logits-out`, refusals of what the server does not implement, the API key and
the model name (run by tests/integration/http.rs).

Usage: python3 http_openai_serving.py BASE_URL API_KEY EXPECTED_JSON
EXPECTED_JSON (written by the Rust test) holds, for a chat and a completion request, the
greedy tokens `stormo run --logits-out` made for the same prompt ids and the log-softmax of
its logits at each step: {"chat": {...}, "text": {...}}, each with "steps": [{"id", "bytes",
"logprob", "top": [[bytes, logprob], ...]}].
Prints "openai serving: all checks passed" when every check holds; raises otherwise.
"""

import json
import sys

import openai

base, key, expected_path = sys.argv[1], sys.argv[2], sys.argv[3]
with open(expected_path) as f:
    expected = json.load(f)
TOL = 1e-4

client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
model = client.models.list().data[0].id


def close(a, b, what):
    assert abs(a - b) <= TOL, f"{what}: {a} vs {b} (more than {TOL} apart)"


def check_top(got, want, what):
    """`got`: [(bytes, logprob)] from the server, `want`: the same from run --logits-out."""
    assert len(got) == len(want), (what, got, want)
    for i, ((gb, gl), (wb, wl)) in enumerate(zip(got, want)):
        close(gl, wl, f"{what} top[{i}]")
        # Ties may be listed in another order only if their log-probabilities are equal.
        if gb != wb:
            assert abs(gl - wl) <= TOL and any(abs(x - gl) <= TOL and b == gb for b, x in want), (
                what,
                i,
                gb,
                wb,
            )


# ---- Chat: logprobs of every generated token, top 5 ----
chat = expected["chat"]
r = client.chat.completions.create(
    model=model,
    messages=chat["messages"],
    max_tokens=len(chat["steps"]),
    temperature=0,
    logprobs=True,
    top_logprobs=5,
)
content = r.choices[0].logprobs.content
assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
assert 1 <= len(content) <= len(chat["steps"]), len(content)
for i, (c, s) in enumerate(zip(content, chat["steps"])):
    assert c.bytes == s["bytes"], ("chat token", i, c.bytes, s["bytes"])
    close(c.logprob, s["logprob"], f"chat token {i}")
    check_top([(t.bytes, t.logprob) for t in c.top_logprobs], s["top"], f"chat token {i}")

# The same, streamed: the log-probabilities arrive with the chunks, in order.
stream = client.chat.completions.create(
    model=model,
    messages=chat["messages"],
    max_tokens=len(chat["steps"]),
    temperature=0,
    logprobs=True,
    top_logprobs=2,
    stream=True,
)
streamed = []
for chunk in stream:
    for ch in chunk.choices:
        if ch.logprobs is not None and ch.logprobs.content:
            streamed.extend(ch.logprobs.content)
assert [c.bytes for c in streamed] == [c.bytes for c in content], "streamed chat tokens differ"
for a, b in zip(streamed, content):
    close(a.logprob, b.logprob, "streamed chat logprob")
    assert len(a.top_logprobs) == 2

# ---- Completions: legacy logprobs (top 3) ----
text = expected["text"]
c = client.completions.create(
    model=model,
    prompt=text["prompt"],
    max_tokens=len(text["steps"]),
    temperature=0,
    logprobs=3,
)
lp = c.choices[0].logprobs
assert len(lp.token_logprobs) == c.usage.completion_tokens, (lp, c.usage)
for i, (tok, l, top, s) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, text["steps"])):
    assert tok == bytes(s["bytes"]).decode("utf-8", "replace"), ("text token", i, tok)
    close(l, s["logprob"], f"text token {i}")
    got = sorted(top.values(), reverse=True)
    want = [w for _, w in s["top"][:3]]
    # Tokens whose text is the same share one key in the legacy dict: compare what is there.
    assert len(got) <= 3 and len(got) >= 1, top
    for g in got:
        assert any(abs(g - w) <= TOL for w in want), ("text top", i, got, want)
assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset), lp.text_offset

# ---- What is not implemented is refused, naming the field ----
def refused(call, param, status=400):
    try:
        call()
    except openai.APIStatusError as e:
        assert e.status_code == status, (param, e.status_code, e)
        body = e.body if isinstance(e.body, dict) else {}
        err = body.get("error", body)
        assert err.get("param") == param, (param, e.body)
        return e
    raise AssertionError(f"{param}: the request was not refused")


messages = [{"role": "user", "content": "What is the weather in Paris?"}]
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
e = refused(lambda: client.chat.completions.create(model=model, messages=messages, tools=tools), "tools")
assert "tools" in str(e), e
refused(
    lambda: client.chat.completions.create(
        model=model, messages=messages, response_format={"type": "json_object"}
    ),
    "response_format",
)
refused(lambda: client.completions.create(model=model, prompt="Hi", echo=True), "echo")
refused(lambda: client.completions.create(model=model, prompt="Hi", suffix="end"), "suffix")
refused(
    lambda: client.chat.completions.create(model=model, messages=messages, top_logprobs=3),
    "top_logprobs",
)
# Accepted: the default response format, and tool_choice "none" without tools.
client.chat.completions.create(
    model=model, messages=messages, max_tokens=2, response_format={"type": "text"}, tool_choice="none"
)

# ---- An unknown model is a 404, as OpenAI's ----
try:
    client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=2)
    raise AssertionError("an unknown model was served")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found" if isinstance(e.body, dict) else True, e.body
    assert "gpt-4o" in str(e), e

# ---- The API key ----
for wrong in ["wrong-key", key + "x"]:
    bad = openai.OpenAI(base_url=base, api_key=wrong, max_retries=0, timeout=30)
    try:
        bad.models.list()
        raise AssertionError("a wrong API key was accepted")
    except openai.AuthenticationError as e:
        assert e.status_code == 401, e

print("openai serving: all checks passed")
