//! A request's parts as the endpoints take them: the JSON body read within its bound, the
//! generation settings checked (sampling, `max_tokens` against the context, stop strings),
//! a completion's prompt as token ids, a chat's messages as turns.

use super::*;

/// Reads the body (at most `max_body` bytes) as the JSON object `shape` describes.
pub(super) async fn read_json<T: serde::de::DeserializeOwned>(
    state: &State,
    req: Request<Incoming>,
    shape: &BodyShape,
) -> Result<T, ApiError> {
    let too_large = || {
        ApiError::bad(format!(
            "the request body is larger than {} bytes",
            state.max_body
        ))
        .status(StatusCode::PAYLOAD_TOO_LARGE)
    };
    if let Some(len) = req.headers().get(CONTENT_LENGTH) {
        let len: u64 = len
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| ApiError::bad("the Content-Length header is not a number"))?;
        if len > state.max_body as u64 {
            return Err(too_large());
        }
    }
    let collect = Limited::new(req.into_body(), state.max_body).collect();
    let Ok(body) = tokio::time::timeout(state.timeout, collect).await else {
        return Err(ApiError::bad(format!(
            "the request body did not arrive within {} s",
            state.timeout.as_secs_f64()
        ))
        .status(StatusCode::REQUEST_TIMEOUT));
    };
    let body = match body {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => return Err(too_large()),
        Err(e) => return Err(ApiError::bad(format!("reading the request body: {e}"))),
    };
    parse_body(&body, shape)
}

/// What a field the server reads must hold. The body is checked against these before it is
/// read into the request's type, so that a wrong value is refused with the field's name and
/// what it must be, in the API's terms (serde's own errors name no field and speak of Rust
/// types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
    /// Any number.
    Number,
    /// A whole number from 0 up.
    Count,
    /// A whole number from 1 up (a number of tokens or choices to make).
    Positive,
    /// A whole number in i64's range (a seed).
    Integer,
    Bool,
    Text,
    /// A string or an array of strings (`stop`).
    Stop,
    /// `stream_options`: an object whose `include_usage` is a boolean.
    StreamOptions,
    /// A chat's `messages`.
    Messages,
    /// Read as any JSON value; checked where it is used (a completion's `prompt`, fields that
    /// are refused unless empty).
    Any,
}

/// The fields of one endpoint's body that the server reads: the required ones (with what to
/// give) and every field's [`Shape`].
#[derive(Debug)]
pub(super) struct BodyShape {
    pub(super) required: &'static [(&'static str, &'static str)],
    pub(super) fields: &'static [&'static [(&'static str, Shape)]],
}

/// The fields both endpoints read ([`Common`]).
const COMMON_FIELDS: &[(&str, Shape)] = &[
    ("temperature", Shape::Number),
    ("top_p", Shape::Number),
    ("top_k", Shape::Count),
    ("repetition_penalty", Shape::Number),
    ("max_tokens", Shape::Positive),
    ("max_completion_tokens", Shape::Positive),
    ("seed", Shape::Integer),
    ("stop", Shape::Stop),
    ("stream", Shape::Bool),
    ("stream_options", Shape::StreamOptions),
    ("n", Shape::Positive),
    ("model", Shape::Text),
    ("presence_penalty", Shape::Number),
    ("frequency_penalty", Shape::Number),
    ("logit_bias", Shape::Any),
    ("user", Shape::Text),
];

/// `POST /v1/chat/completions` ([`ChatRequest`]).
pub(super) const CHAT: BodyShape = BodyShape {
    required: &[("messages", "the conversation, an array of messages")],
    fields: &[
        COMMON_FIELDS,
        &[
            ("messages", Shape::Messages),
            ("reasoning_effort", Shape::Text),
            ("logprobs", Shape::Bool),
            ("top_logprobs", Shape::Count),
            ("tools", Shape::Any),
            ("tool_choice", Shape::Any),
            ("functions", Shape::Any),
            ("function_call", Shape::Any),
            ("response_format", Shape::Any),
        ],
    ],
};

/// `POST /v1/completions` ([`CompletionRequest`]).
pub(super) const COMPLETION: BodyShape = BodyShape {
    required: &[("prompt", "a string or an array of token ids")],
    fields: &[
        COMMON_FIELDS,
        &[
            ("prompt", Shape::Any),
            ("logprobs", Shape::Count),
            ("echo", Shape::Bool),
            ("suffix", Shape::Text),
            ("best_of", Shape::Count),
        ],
    ],
};

/// Parses a request body: JSON, an object, each field the server reads of its [`Shape`],
/// then the request type.
pub(super) fn parse_body<T: serde::de::DeserializeOwned>(
    body: &[u8],
    shape: &BodyShape,
) -> Result<T, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("the request body is not valid JSON: {e}")))?;
    check_body(&v, shape)?;
    // Every field read was checked above, so this fails only if a check is missing (the
    // unit tests try every field with values of every kind).
    serde_json::from_value(v)
        .map_err(|e| ApiError::bad(format!("the request body does not fit this endpoint: {e}")))
}

/// Checks the body against `shape` (see [`parse_body`]).
pub(super) fn check_body(v: &Value, shape: &BodyShape) -> Result<(), ApiError> {
    let Value::Object(o) = v else {
        return Err(ApiError::bad(format!(
            "the body must be a JSON object, not {}",
            json_kind(v)
        )));
    };
    for &(name, what) in shape.required {
        if !o.contains_key(name) {
            return Err(ApiError::bad(format!("{name} is missing: give {what}")).param(name));
        }
    }
    for &(name, field) in shape.fields.iter().copied().flatten() {
        if let Some(v) = o.get(name) {
            check_field(name, field, v)?;
        }
    }
    Ok(())
}

/// Checks one field's value (at `path`, as `param` names it) against its shape. `null` is
/// absent for every optional field.
fn check_field(path: &str, shape: Shape, v: &Value) -> Result<(), ApiError> {
    let wrong = |what: &str| {
        Err(ApiError::bad(format!("{path} must be {what}, not {}", got(v))).param(path.to_string()))
    };
    if v.is_null() && shape != Shape::Messages {
        return Ok(());
    }
    match shape {
        Shape::Any => Ok(()),
        Shape::Number if v.is_number() => Ok(()),
        Shape::Number => wrong("a number"),
        Shape::Count if v.as_u64().is_some() => Ok(()),
        Shape::Count => wrong("a whole number from 0 up"),
        Shape::Positive if v.as_u64().is_some_and(|n| n >= 1) => Ok(()),
        Shape::Positive => wrong("a whole number from 1 up"),
        Shape::Integer if v.as_i64().is_some() => Ok(()),
        Shape::Integer => wrong("a whole number from -2^63 to 2^63 - 1"),
        Shape::Bool if v.is_boolean() => Ok(()),
        Shape::Bool => wrong("true or false"),
        Shape::Text if v.is_string() => Ok(()),
        Shape::Text => wrong("a string"),
        Shape::Stop => match v {
            Value::String(_) => Ok(()),
            Value::Array(a) if a.iter().all(Value::is_string) => Ok(()),
            Value::Array(a) => {
                let (i, x) = a
                    .iter()
                    .enumerate()
                    .find(|(_, x)| !x.is_string())
                    .expect("an array that is not all strings has a non-string");
                Err(ApiError::bad(format!(
                    "stop must be a string or an array of strings, but stop[{i}] is {}",
                    got(x)
                ))
                .param(path.to_string()))
            }
            _ => wrong("a string or an array of strings"),
        },
        Shape::StreamOptions => match v {
            Value::Object(o) => match o.get("include_usage") {
                Some(u) => check_field(&format!("{path}.include_usage"), Shape::Bool, u),
                None => Ok(()),
            },
            _ => wrong("an object (such as {\"include_usage\": true})"),
        },
        Shape::Messages => {
            let Value::Array(messages) = v else {
                return wrong("an array of messages");
            };
            for (i, m) in messages.iter().enumerate() {
                check_message(&format!("{path}[{i}]"), m)?;
            }
            Ok(())
        }
    }
}

/// Checks one chat message (at `path`, `messages[i]`): an object with a string `role` and
/// `content` a string or an array of content parts.
fn check_message(path: &str, m: &Value) -> Result<(), ApiError> {
    let Value::Object(o) = m else {
        return Err(ApiError::bad(format!(
            "{path} must be an object with a role and content, not {}",
            got(m)
        ))
        .param(path.to_string()));
    };
    match o.get("role") {
        None => {
            return Err(ApiError::bad(format!(
                "{path}.role is missing: give system, developer, user, assistant or tool"
            ))
            .param(format!("{path}.role")))
        }
        Some(r) if !r.is_string() => {
            return Err(ApiError::bad(format!(
                "{path}.role must be a string (system, developer, user, assistant or tool), not {}",
                got(r)
            ))
            .param(format!("{path}.role")))
        }
        Some(_) => {}
    }
    for f in ["name", "reasoning_content"] {
        if let Some(v) = o.get(f) {
            check_field(&format!("{path}.{f}"), Shape::Text, v)?;
        }
    }
    let content = format!("{path}.content");
    let wrong = |x: &Value| {
        Err(ApiError::bad(format!(
            "{content} must be a string or an array of text parts, not {}",
            got(x)
        ))
        .param(content.clone()))
    };
    match o.get("content") {
        None | Some(Value::Null | Value::String(_)) => Ok(()),
        Some(Value::Array(parts)) => {
            for (j, p) in parts.iter().enumerate() {
                let at = format!("{content}[{j}]");
                let part = |what: String| Err(ApiError::bad(what).param(at.clone()));
                let Value::Object(p) = p else {
                    return part(format!(
                        "{at} must be a content part ({{\"type\": \"text\", \"text\": \"...\"}}), \
                         not {}",
                        got(p)
                    ));
                };
                match p.get("type") {
                    Some(Value::String(_)) => {}
                    None => return part(format!("{at}.type is missing (text parts: \"text\")")),
                    Some(t) => return part(format!("{at}.type must be a string, not {}", got(t))),
                }
                match p.get("text") {
                    None | Some(Value::Null | Value::String(_)) => {}
                    Some(t) => return part(format!("{at}.text must be a string, not {}", got(t))),
                }
            }
            Ok(())
        }
        Some(x) => wrong(x),
    }
}

/// What a wrong value is, for messages: a number as sent (compactly), a short string
/// quoted, otherwise its kind (never a large value).
pub(super) fn got(v: &Value) -> String {
    match v {
        Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(u), _, _) => u.to_string(),
            (None, Some(i), _) => i.to_string(),
            (None, None, Some(f)) => compact(f),
            _ => "a number".into(),
        },
        Value::String(s) if s.chars().count() <= 24 => format!("the string {s:?}"),
        v => json_kind(v).into(),
    }
}

/// A number for a message: as written when it is short, else in scientific notation
/// (`1e308`, not 309 digits).
pub(super) fn compact(v: f64) -> String {
    if v == 0.0 || (1e-4..1e6).contains(&v.abs()) {
        format!("{v}")
    } else {
        format!("{v:e}")
    }
}

/// The completion's length as a request asked it: the value and the field that gave it
/// (`max_tokens` or `max_completion_tokens`).
pub(super) type MaxTokens = Option<(u64, &'static str)>;

/// Generation settings from the request, checked. `prompt_field` names what the prompt came
/// from (`messages` or `prompt`), for the error when it leaves no room for a reply.
pub(super) fn settings(
    state: &State,
    c: &Common,
    max_tokens: MaxTokens,
    default_max: usize,
    prompt_len: usize,
    prompt_field: &'static str,
) -> Result<(SamplingParams, usize, Vec<String>), ApiError> {
    check_model(state, c.model.as_deref())?;
    if let Some(n) = c.n {
        if n != 1 {
            return Err(ApiError::bad(format!("n is {n}; only n = 1 is supported")).param("n"));
        }
    }
    for (field, v) in [
        ("presence_penalty", c.presence_penalty),
        ("frequency_penalty", c.frequency_penalty),
    ] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(ApiError::unsupported(
                field,
                "use repetition_penalty, which this server implements",
            ));
        }
    }
    match &c.logit_bias {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) if m.is_empty() => {}
        Some(_) => return Err(ApiError::unsupported("logit_bias", "not implemented")),
    }
    // Each value as sent (read as f64, so one beyond f32's range is reported as it is, not as
    // the inf it would round to; numbers are shown compactly). Values that pass are in
    // f32's range.
    if let Some(t) = c.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(
                ApiError::bad(format!("temperature {} is outside [0, 2]", compact(t)))
                    .param("temperature"),
            );
        }
    }
    if let Some(p) = c.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::bad(format!(
                "top_p {} is outside (0, 1] (1: no top-p cut)",
                compact(p)
            ))
            .param("top_p"));
        }
    }
    if let Some(r) = c.repetition_penalty {
        let f = r as f32;
        if !(f > 0.0 && f.is_finite()) {
            return Err(ApiError::bad(format!(
                "repetition_penalty {} must be above 0 and at most {:e} (1: no penalty)",
                compact(r),
                f32::MAX
            ))
            .param("repetition_penalty"));
        }
    }
    // What the request leaves out: the model's generation_config.json, else OpenAI's.
    let d = &state.sampling;
    let params = SamplingParams {
        temperature: c
            .temperature
            .map_or_else(|| d.temperature.unwrap_or(1.0), |v| v as f32),
        top_p: c.top_p.map_or(d.top_p.unwrap_or(1.0), |v| v as f32),
        top_k: c.top_k.or(d.top_k).unwrap_or(0),
        repetition_penalty: c
            .repetition_penalty
            .map_or(d.repetition_penalty.unwrap_or(1.0), |v| v as f32),
        seed: c.seed.map(|s| s as u64).unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        }),
    };
    // The request's own values passed above: what fails here came from the model folder.
    params.validate().map_err(|e| {
        ApiError::server(format!(
            "the model's sampling defaults (generation_config.json) are not usable: {e}"
        ))
    })?;
    let max = max_length(state.context, prompt_len, prompt_field, max_tokens)?
        .unwrap_or_else(|| default_max.min(state.context - prompt_len));
    let stop = match &c.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    if stop.len() > 4 || stop.iter().any(|s| s.is_empty() || s.len() > 256) {
        return Err(
            ApiError::bad("stop takes up to 4 non-empty strings of at most 256 bytes")
                .param("stop"),
        );
    }
    Ok((params, max, stop))
}

/// The completion's length, checked against the context: `Some` when the request gave one,
/// `None` to take a default (there is room for at least one token then). As OpenAI answers,
/// a completion that cannot fit is refused, not cut short; a prompt that leaves no room at
/// all is its own fault, whether or not a length was asked.
pub(super) fn max_length(
    context: usize,
    prompt_len: usize,
    prompt_field: &'static str,
    max_tokens: MaxTokens,
) -> Result<Option<usize>, ApiError> {
    let refuse = |asked: String, field: &'static str, shorten: &str| {
        Err(ApiError::bad(format!(
            "This model's maximum context length is {context} tokens. However, you requested \
             {asked}. Please reduce the length of {shorten}."
        ))
        .param(field)
        .code("context_length_exceeded"))
    };
    if prompt_len >= context {
        let reply = match max_tokens {
            Some((m, _)) => format!("{m} in the completion"),
            None => "at least 1 in the completion".into(),
        };
        let total = u64::try_from(prompt_len)
            .unwrap_or(u64::MAX)
            .saturating_add(max_tokens.map_or(1, |(m, _)| m));
        return refuse(
            format!("{total} tokens ({prompt_len} in the {prompt_field}, {reply})"),
            prompt_field,
            &format!("the {prompt_field}"),
        );
    }
    match max_tokens {
        None => Ok(None),
        Some((0, field)) => Err(ApiError::bad(format!("{field} must be at least 1")).param(field)),
        Some((m, field)) if usize::try_from(m).map_or(true, |m| m > context - prompt_len) => {
            let total = u64::try_from(prompt_len)
                .unwrap_or(u64::MAX)
                .saturating_add(m);
            refuse(
                format!(
                    "{total} tokens ({prompt_len} in the {prompt_field}, {m} in the completion)"
                ),
                field,
                &format!("the {prompt_field} or the completion ({field})"),
            )
        }
        Some((m, _)) => Ok(Some(usize::try_from(m).expect("checked to fit above"))),
    }
}

/// The token ids of a completion's prompt: a string, an array of one string, an array of
/// token ids, or an array of one array of token ids (OpenAI's batches of one).
pub(super) fn prompt_ids(tokenizer: &Tokenizer, prompt: &Value) -> Result<Vec<TokenId>, ApiError> {
    let bad = |m: String| ApiError::bad(m).param("prompt");
    let empty = || {
        bad("the prompt is empty; give a non-empty string or a non-empty array of token ids".into())
    };
    let text = |t: &str| {
        if t.is_empty() {
            return Err(empty());
        }
        tokenizer
            .encode(t, false)
            .map_err(|e| bad(format!("tokenizing the prompt: {e}")))
    };
    let ids = |v: &[Value]| {
        v.iter()
            .map(|x| match x {
                Value::Number(n) => n
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| bad(format!("token id {n} is out of range"))),
                x => Err(bad(format!(
                    "the prompt's token ids include {}; an array prompt is strings or token ids",
                    json_kind(x)
                ))),
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let wrong = |what: &str| {
        bad(format!(
            "the prompt {what}; give a string, an array of one string, or an array of token ids"
        ))
    };
    let ids = match prompt {
        Value::String(t) => text(t)?,
        Value::Array(v) => match v.first() {
            None => return Err(empty()),
            Some(_) if v.len() > 1 && !v[0].is_number() => {
                return Err(bad("only one prompt per request is supported".into()))
            }
            Some(Value::String(t)) => text(t)?,
            Some(Value::Number(_)) => ids(v)?,
            Some(Value::Array(inner)) => ids(inner)?,
            Some(x) => return Err(wrong(&format!("holds {}", json_kind(x)))),
        },
        x => return Err(wrong(&format!("is {}", json_kind(x)))),
    };
    if ids.is_empty() {
        return Err(empty());
    }
    Ok(ids)
}

/// What a JSON value is, for messages (never the value itself, which may be large).
pub(super) use stormo_text::transcript::json_kind;

pub(super) fn turns_of(messages: &[ChatMessage]) -> Result<Vec<Turn>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad("messages is empty").param("messages"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = TurnRole::parse(&m.role).ok_or_else(|| {
                ApiError::bad(format!(
                    "messages[{i}].role {:?} is not system, developer, user, assistant or tool",
                    m.role
                ))
                .param(format!("messages[{i}].role"))
            })?;
            let content = match &m.content {
                None => String::new(),
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => s.push_str(t),
                            (k, _) => {
                                return Err(ApiError::bad(format!(
                                    "messages[{i}].content: content parts of type {k:?} are not supported (text only)"
                                ))
                                .param(format!("messages[{i}].content")))
                            }
                        }
                    }
                    s
                }
            };
            Ok(Turn {
                reasoning: m.reasoning_content.clone(),
                name: m.name.clone(),
                ..Turn::new(role, content)
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words of serde's own errors and Rust's type names, which a client must never see.
    const RUST_WORDS: &[&str] = &[
        "untagged",
        "variant",
        "struct ",
        "enum ",
        "u64",
        "i64",
        "f64",
        "usize",
        "invalid type",
        "sequence",
        "map",
    ];

    /// Parses `body` as the chat endpoint does (`chat`) or the completions endpoint.
    fn parse(chat: bool, body: &Value) -> Result<(), ApiError> {
        let bytes = body.to_string().into_bytes();
        if chat {
            parse_body::<ChatRequest>(&bytes, &CHAT).map(drop)
        } else {
            parse_body::<CompletionRequest>(&bytes, &COMPLETION).map(drop)
        }
    }

    fn assert_user_terms(e: &ApiError, what: &str) {
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{what}: {e:?}");
        for w in RUST_WORDS {
            assert!(!e.message.contains(w), "{what}: {w:?} in {:?}", e.message);
        }
    }

    /// Every field the server reads, given a value of every kind: either the checks refuse it
    /// with `param` naming the field and a message in the API's terms, or the body parses.
    /// So serde's own errors (no field, Rust type names) never reach a client.
    #[test]
    fn every_field_of_every_kind_is_refused_by_name_or_parses() {
        let values = [
            json!(null),
            json!(true),
            json!(5),
            json!(-3),
            json!(1.5),
            json!(1e308),
            json!(18446744073709551615_u64),
            json!("3"),
            json!([]),
            json!([1]),
            json!(["a"]),
            json!([{ "role": "user" }]),
            json!({}),
            json!({ "include_usage": 5 }),
            json!({ "include_usage": true, "other": 1 }),
        ];
        for (chat, shape, base) in [
            (
                true,
                &CHAT,
                json!({ "messages": [{ "role": "user", "content": "hi" }] }),
            ),
            (false, &COMPLETION, json!({ "prompt": "hi" })),
        ] {
            for &(name, _) in shape.fields.iter().copied().flatten() {
                for v in &values {
                    let mut body = base.clone();
                    body[name] = v.clone();
                    let what = format!("{name}: {v}");
                    if let Err(e) = parse(chat, &body) {
                        assert_user_terms(&e, &what);
                        let param = e.param.as_deref().unwrap_or_default();
                        assert!(param.starts_with(name), "{what}: param {param:?}");
                        assert!(e.message.starts_with(name), "{what}: {:?}", e.message);
                    }
                }
            }
        }
    }

    /// The messages' own fields are checked the same way, each error at its path.
    #[test]
    fn a_wrong_message_is_named_by_its_path() {
        let cases = [
            (
                json!(5),
                "messages",
                "messages must be an array of messages, not 5",
            ),
            (
                json!(null),
                "messages",
                "messages must be an array of messages, not null",
            ),
            (json!([5]), "messages[0]", "messages[0] must be an object"),
            (
                json!([{ "content": "x" }]),
                "messages[0].role",
                "messages[0].role is missing",
            ),
            (
                json!([{ "role": 5 }]),
                "messages[0].role",
                "messages[0].role must be a string",
            ),
            (
                json!([{ "role": "user", "content": "a" }, { "role": "user", "content": 5 }]),
                "messages[1].content",
                "messages[1].content must be a string or an array of text parts, not 5",
            ),
            (
                json!([{ "role": "user", "content": {} }]),
                "messages[0].content",
                "not an object",
            ),
            (
                json!([{ "role": "user", "content": [5] }]),
                "messages[0].content[0]",
                "messages[0].content[0] must be a content part",
            ),
            (
                json!([{ "role": "user", "content": [{ "text": "x" }] }]),
                "messages[0].content[0]",
                "messages[0].content[0].type is missing",
            ),
            (
                json!([{ "role": "user", "content": [{ "type": "text", "text": 5 }] }]),
                "messages[0].content[0]",
                "messages[0].content[0].text must be a string",
            ),
            (
                json!([{ "role": "user", "content": "x", "name": 5 }]),
                "messages[0].name",
                "messages[0].name must be a string, not 5",
            ),
        ];
        for (messages, param, want) in cases {
            let what = format!("messages {messages}");
            let e = parse(true, &json!({ "messages": messages })).expect_err(&what);
            assert_user_terms(&e, &what);
            assert_eq!(e.param.as_deref(), Some(param), "{what}: {e:?}");
            assert!(e.message.contains(want), "{what}: {:?}", e.message);
        }
        for (body, want) in [
            (
                json!({ "messages": [] , "stop": 5 }),
                "stop must be a string or an array of strings, not 5",
            ),
            (json!({ "messages": [], "stop": ["a", 5] }), "stop[1] is 5"),
            (
                json!({ "messages": [], "max_tokens": "3" }),
                "max_tokens must be a whole number from 1 up, not the string \"3\"",
            ),
            (
                json!({ "messages": [], "temperature": "hot" }),
                "temperature must be a number",
            ),
            (
                json!({ "messages": [], "stream_options": { "include_usage": 1 } }),
                "stream_options.include_usage must be true or false",
            ),
            (json!({}), "messages is missing"),
        ] {
            let e = parse(true, &body).expect_err(&body.to_string());
            assert_user_terms(&e, &body.to_string());
            assert!(e.message.contains(want), "{body}: {:?}", e.message);
            assert!(e.param.is_some(), "{body}: {e:?}");
        }
        let e = parse_body::<ChatRequest>(b"[1]", &CHAT).expect_err("an array body");
        assert_eq!(e.message, "the body must be a JSON object, not an array");
        let e = parse_body::<CompletionRequest>(b"{}", &COMPLETION).expect_err("no prompt");
        assert_eq!(e.param.as_deref(), Some("prompt"));
    }

    /// A prompt that leaves no room for a reply is refused in the same words, naming the
    /// prompt's field, whether or not a length was asked; a length past the room names the
    /// field that asked it.
    #[test]
    fn a_prompt_or_length_past_the_context_names_its_field() {
        let none = max_length(256, 300, "messages", None).expect_err("no room");
        let asked =
            max_length(256, 300, "messages", Some((10, "max_tokens"))).expect_err("no room");
        for e in [&none, &asked] {
            assert_eq!(e.param.as_deref(), Some("messages"), "{e:?}");
            assert_eq!(e.code, Some("context_length_exceeded"));
            assert!(
                e.message.starts_with(
                    "This model's maximum context length is 256 tokens. \
                                       However, you requested "
                ) && e.message.contains("(300 in the messages, ")
                    && e.message
                        .ends_with("Please reduce the length of the messages."),
                "{e:?}"
            );
        }
        assert!(none
            .message
            .contains("301 tokens (300 in the messages, at least 1 in the completion)"));
        let long = max_length(256, 6, "prompt", Some((251, "max_completion_tokens")))
            .expect_err("too long");
        assert_eq!(long.param.as_deref(), Some("max_completion_tokens"));
        assert!(long
            .message
            .contains("257 tokens (6 in the prompt, 251 in the completion)"));
        assert_eq!(
            max_length(256, 6, "prompt", Some((250, "max_tokens"))).ok(),
            Some(Some(250))
        );
        assert_eq!(max_length(256, 255, "prompt", None).ok(), Some(None));
        let zero =
            max_length(256, 6, "prompt", Some((0, "max_completion_tokens"))).expect_err("zero");
        assert_eq!(zero.param.as_deref(), Some("max_completion_tokens"));
    }

    #[test]
    fn large_and_tiny_numbers_are_shown_compactly() {
        assert_eq!(compact(1e308), "1e308");
        assert_eq!(compact(-1e300), "-1e300");
        assert_eq!(compact(2.5), "2.5");
        assert_eq!(compact(0.0), "0");
        assert_eq!(compact(1e-9), "1e-9");
        assert_eq!(got(&json!(1e308)), "1e308");
        assert_eq!(got(&json!("3")), "the string \"3\"");
        assert_eq!(got(&json!("x".repeat(100))), "a string");
    }
}
