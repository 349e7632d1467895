//! The OpenAI API's names and limits (issue 60): `--alias` names the served model, and a
//! `max_tokens` past the context is refused as OpenAI refuses it.

use serde_json::{json, Value};

use crate::http::{assert_openai_error, post, request, Server};

/// Issue 60: `--alias` names the model (every alias works in requests, /v1/models lists
/// them), and a `max_tokens` beyond what the context leaves is a 400 in OpenAI's shape, not a
/// completion silently cut to the context.
#[test]
fn aliases_name_the_model_and_max_tokens_past_the_context_is_refused() {
    let srv = Server::start_with(2, 256, |c| {
        c.aliases = vec!["my-model".into(), "other-name".into()];
    });
    let a = srv.addr;
    let (st, text) = request(a, "GET", "/v1/models", b"");
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    let ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, ["my-model", "other-name"], "{v}");
    for name in ["my-model", "other-name"] {
        let (st, v) = post(
            a,
            "/v1/chat/completions",
            &json!({"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        );
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["model"], "my-model", "{v}");
    }
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"model": "not-served", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(st, 404, "{v}");
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}),
    );
    assert_openai_error(st, &v, 400, "invalid_request_error", "max_tokens");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    let msg = v["error"]["message"].as_str().expect("message");
    assert!(msg.contains("256") && msg.contains("100000"), "{msg}");
    let (st, v) = post(
        a,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 100000}),
    );
    assert_eq!(st, 400, "{v}");
}
