"""Continuous batching through the real `openai` client (run by tests/integration/http.rs):
four greedy streams at once each get exactly what the same request gets alone: the same
tokens, and the same log-probabilities to the last digit (the same logits bits give the same
floats).

Usage: python3 http_openai_batching.py BASE_URL
Prints "openai batching: all checks passed" when every check holds; raises otherwise.
"""

import re
import sys
import threading
import urllib.request

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
model = client.models.list().data[0].id
MAX_TOKENS = 48

# Prompts of different lengths: one longer than a prefill block (128 positions), so that its
# prefill goes in chunks while the others decode.
PROMPTS = [
    "Name three colours.",
    "Why is the sky blue? Answer briefly.",
    "Count: " + " ".join(str(i) for i in range(150)),
    "hello",
]


def stream(prompt):
    """One greedy streamed chat request: its content pieces and per-token logprobs."""
    s = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    text, tokens, finish = [], [], None
    for chunk in s:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if c.delta and c.delta.content:
            text.append(c.delta.content)
        if c.logprobs and c.logprobs.content:
            for t in c.logprobs.content:
                tokens.append(
                    (tuple(t.bytes or []), t.logprob, [(tuple(x.bytes or []), x.logprob) for x in t.top_logprobs])
                )
        if c.finish_reason:
            finish = c.finish_reason
    return "".join(text), tokens, finish


def metric(name):
    body = urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    assert m, (name, body)
    return float(m.group(1))


alone = [stream(p) for p in PROMPTS]
for i, (text, tokens, finish) in enumerate(alone):
    assert tokens, f"request {i} alone made no tokens"
    assert finish in ("stop", "length"), finish

steps0, seqs0 = metric("stormo_engine_steps_total"), metric("stormo_engine_step_sequences_total")
together = [None] * len(PROMPTS)
start = threading.Barrier(len(PROMPTS))
errors = []


def run(i):
    try:
        start.wait()
        together[i] = stream(PROMPTS[i])
    except Exception as e:  # reported below, with the request's index
        errors.append((i, repr(e)))


threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
steps = metric("stormo_engine_steps_total") - steps0
seqs = metric("stormo_engine_step_sequences_total") - seqs0
# The streams really ran together: some steps ran more than one request.
assert seqs > steps, f"{seqs} sequences in {steps} steps: the requests never shared a step"

for i, (a, b) in enumerate(zip(alone, together)):
    assert a[2] == b[2], (i, "finish", a[2], b[2])
    assert a[0] == b[0], (i, "text", a[0], b[0])
    assert len(a[1]) == len(b[1]), (i, "tokens", len(a[1]), len(b[1]))
    for j, (x, y) in enumerate(zip(a[1], b[1])):
        assert x == y, (i, "token", j, x, y)

print(f"mean batch {seqs / steps:.2f} over {steps:.0f} steps")
print("openai batching: all checks passed")
