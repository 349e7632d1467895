//! A request's parts as the endpoints take them: the JSON body read within its bound, the
//! generation settings checked (sampling, `max_tokens` against the context, stop strings),
//! a completion's prompt as token ids, a chat's messages as turns.

use super::*;

/// Reads the body (at most `max_body` bytes) as JSON.
pub(super) async fn read_json<T: serde::de::DeserializeOwned>(
    state: &State,
    req: Request<Incoming>,
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
    serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad(format!(
            "the request body is not valid JSON for this endpoint: {e}"
        ))
    })
}

/// Generation settings from the request, checked.
pub(super) fn settings(
    state: &State,
    c: &Common,
    max_tokens: Option<u64>,
    default_max: usize,
    prompt_len: usize,
) -> Result<(SamplingParams, usize, Vec<String>), ApiError> {
    check_model(state, c.model.as_deref())?;
    if let Some(n) = c.n {
        if n != 1 {
            return Err(ApiError::bad("only n = 1 is supported").param("n"));
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
    // What the request leaves out: the model's generation_config.json, else OpenAI's.
    let d = &state.sampling;
    let temperature = c
        .temperature
        .unwrap_or_else(|| d.temperature.map_or(1.0, f64::from));
    if !(0.0..=2.0).contains(&temperature) {
        return Err(
            ApiError::bad(format!("temperature {temperature} is outside [0, 2]"))
                .param("temperature"),
        );
    }
    // Read as f64 so a value beyond f32's range is reported as sent, not as inf; values
    // that pass the checks below are in f32's range.
    let params = SamplingParams {
        temperature: temperature as f32,
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
    params
        .validate()
        .map_err(|e| ApiError::bad(format!("sampling settings: {e}")))?;
    let max = match max_tokens {
        Some(0) => return Err(ApiError::bad("max_tokens must be at least 1").param("max_tokens")),
        // As OpenAI answers: a completion that cannot fit is refused, not cut short.
        Some(m)
            if usize::try_from(m)
                .map_or(true, |m| m > state.context.saturating_sub(prompt_len)) =>
        {
            return Err(ApiError::bad(format!(
                "This model's maximum context length is {} tokens. However, you requested {} \
                 tokens ({prompt_len} in the prompt, {m} in the completion). Please reduce the \
                 length of the prompt or the completion (max_tokens).",
                state.context,
                u64::try_from(prompt_len)
                    .unwrap_or(u64::MAX)
                    .saturating_add(m),
            ))
            .param("max_tokens")
            .code("context_length_exceeded"));
        }
        Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
        None => default_max.min(state.context.saturating_sub(prompt_len).max(1)),
    };
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
pub(super) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

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
                .param("messages")
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
                                    "messages[{i}]: content parts of type {k:?} are not supported (text only)"
                                ))
                                .param("messages"))
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
