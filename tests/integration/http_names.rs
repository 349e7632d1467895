//! The OpenAI API's names, limits and defaults (issue 60): `--alias` names the served model,
//! a `max_tokens` past the context is refused as OpenAI refuses it, and a request without
//! sampling settings takes the model folder's.

use std::time::Duration;

use serde_json::{json, Value};
use stormo_node::http::{self, HttpConfig};

use crate::http::{assert_openai_error, post, request, synth_model, text_model, Server};

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

/// A request that gives no temperature samples as the model folder's
/// generation_config.json says: with `do_sample: false` it is greedy, so two requests with
/// different seeds give the same tokens; a request's own temperature still wins.
#[test]
fn http_takes_default_sampling_from_generation_config() {
    let model = synth_model();
    let path = model.path().join("generation_config.json");
    let mut g: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("generation_config.json"))
            .expect("JSON");
    g["do_sample"] = json!(false);
    std::fs::write(&path, g.to_string()).expect("write");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let cfg = HttpConfig {
        context: 1024,
        ..HttpConfig::new("127.0.0.1:0".parse().expect("addr")).with_model_defaults(model.path())
    };
    let srv = rt
        .block_on(http::start(text_model(model.path(), 1024), cfg))
        .expect("server starts");
    let a = srv.local_addr();
    let ids = |body: Value| -> Vec<String> {
        let (st, v) = post(a, "/v1/completions", &body);
        assert_eq!(st, 200, "{v}");
        let lp = &v["choices"][0]["logprobs"]["tokens"];
        lp.as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_str().expect("token").to_string())
            .collect()
    };
    let req = |seed: u64, temperature: Option<f64>| {
        let mut b = json!({ "prompt": "Once upon a time", "max_tokens": 24, "seed": seed,
                            "logprobs": 0 });
        if let Some(t) = temperature {
            b["temperature"] = json!(t);
        }
        b
    };
    let greedy = ids(req(1, None));
    assert_eq!(greedy.len(), 24);
    assert_eq!(ids(req(2, None)), greedy, "the model's default is greedy");
    assert_eq!(ids(req(3, Some(0.0))), greedy);
    // Sampling at 2.0 over a random model's nearly flat distribution: two seeds differ.
    let hot = [ids(req(4, Some(2.0))), ids(req(5, Some(2.0)))];
    assert!(
        hot.iter().any(|h| *h != greedy),
        "a request's temperature wins"
    );
    srv.close();
    rt.shutdown_timeout(Duration::from_secs(2));
}

/// `GET /v1/models/{id}` takes the id percent-encoded, as clients send a name with a space
/// or a slash; an unknown id's 404 lists every served name.
#[test]
fn a_model_id_in_the_path_is_percent_decoded() {
    let srv = Server::start_with(2, 256, |c| {
        c.aliases = vec!["my model".into(), "openai/gpt-oss-20b".into()];
    });
    let a = srv.addr;
    for (path, id) in [
        ("/v1/models/my%20model", "my model"),
        ("/v1/models/openai%2Fgpt-oss-20b", "openai/gpt-oss-20b"),
        ("/v1/models/openai/gpt-oss-20b", "openai/gpt-oss-20b"),
    ] {
        let (st, text) = request(a, "GET", path, b"");
        assert_eq!(st, 200, "{path}: {text}");
        let v: Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(v["id"], id, "{path}: {v}");
    }
    let (st, text) = request(a, "GET", "/v1/models/other", b"");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert_openai_error(st, &v, 404, "invalid_request_error", "an unknown id");
    let m = v["error"]["message"].as_str().expect("message");
    assert!(m.contains("`my model` and `openai/gpt-oss-20b`"), "{m}");
}
