//! A reply on its way to the client: the generated pieces with stop strings applied
//! ([`Reply`]), and the answer built from them, whole or streamed as server-sent events
//! ([`Answer`]), in OpenAI's shapes.

use super::*;

/// Text pieces of one reply as they are made, with stop strings applied to the answer.
pub(super) struct Reply {
    pub(super) events: mpsc::UnboundedReceiver<Event>,
    pub(super) stream: ReplyStream,
    pub(super) stop: StopMatcher,
    pub(super) tokens: usize,
    pub(super) ready: std::collections::VecDeque<Step>,
    pub(super) finished: bool,
    /// Log-probabilities of the tokens received and not yet sent (when asked).
    pub(super) logprobs: Vec<(TokenId, TokenLogprobs)>,
    /// Prompt tokens that came from a cache.
    pub(super) cached: usize,
}

/// One step of a [`Reply`].
#[derive(Debug)]
pub(super) enum Step {
    Delta(OutputDelta),
    /// Finished: OpenAI's finish reason and the completion's token count.
    End(&'static str, usize),
}

impl Reply {
    pub(super) fn new(
        events: mpsc::UnboundedReceiver<Event>,
        stream: ReplyStream,
        stop: Vec<String>,
    ) -> Self {
        Self {
            events,
            stream,
            stop: StopMatcher::new(stop),
            tokens: 0,
            ready: Default::default(),
            finished: false,
            logprobs: Vec::new(),
            cached: 0,
        }
    }

    pub(super) fn content(&mut self, t: &str) -> bool {
        let (emit, hit) = self.stop.push(t);
        if !emit.is_empty() {
            self.ready
                .push_back(Step::Delta(OutputDelta::Content(emit)));
        }
        hit
    }

    pub(super) async fn next(&mut self) -> Result<Option<Step>, ApiError> {
        loop {
            if let Some(s) = self.ready.pop_front() {
                return Ok(Some(s));
            }
            if self.finished {
                return Ok(None);
            }
            let ev = self.events.recv().await;
            self.take(ev)?;
        }
    }

    /// Takes one event from the engine (`None`: it dropped the request).
    pub(super) fn take(&mut self, ev: Option<Event>) -> Result<(), ApiError> {
        let Some(ev) = ev else {
            return Err(ApiError::server("the engine dropped the request"));
        };
        match ev {
            Event::Cached(n) => self.cached = n,
            Event::Token(id, lp) => {
                self.tokens += 1;
                if let Some(lp) = lp {
                    self.logprobs.push((id, lp));
                }
                match self.stream.push(id) {
                    Some(OutputDelta::Content(t)) => {
                        let hit = self.content(&t);
                        if hit {
                            // Closing the channel cancels the generation.
                            self.events.close();
                            self.finished = true;
                            self.ready.push_back(Step::End("stop", self.tokens));
                        }
                    }
                    Some(d) => self.ready.push_back(Step::Delta(d)),
                    None => {}
                }
            }
            Event::Done(g) => {
                self.finished = true;
                let mut hit = false;
                if let Some(OutputDelta::Content(t)) = self.stream.finish() {
                    hit = self.content(&t);
                }
                if !hit {
                    let tail = self.stop.finish();
                    if !tail.is_empty() {
                        self.ready
                            .push_back(Step::Delta(OutputDelta::Content(tail)));
                    }
                }
                let reason = if hit { "stop" } else { g.finish.openai() };
                self.ready.push_back(Step::End(reason, self.tokens));
            }
            Event::Failed(msg) => return Err(ApiError::server(msg)),
            Event::Unavailable(msg) => return Err(ApiError::unavailable(msg)),
        }
        Ok(())
    }
}

/// Why a chat reply's `content` is empty though tokens were generated, for the choice's
/// `content_empty_reason` (a stormo field: OpenAI's shape has none, and an empty answer with
/// no word of why is what a client would otherwise get): the reply was all reasoning
/// (GPT-OSS's analysis channel, Qwen3's think block), cut by `max_tokens` or ended there, or
/// its tokens held no message text at all. `None` when there is content or nothing was made.
pub(super) fn empty_content_reason(
    content_empty: bool,
    reasoning_empty: bool,
    finish: &str,
    tokens: usize,
) -> Option<String> {
    if !content_empty || tokens == 0 {
        return None;
    }
    Some(match (reasoning_empty, finish) {
        (false, "length") => format!(
            "the reply reached max_tokens ({tokens} tokens) while the model was still \
             reasoning: its text so far is in reasoning_content; allow more tokens for an answer"
        ),
        (false, _) => "the model wrote only reasoning (in reasoning_content) and no final \
                       answer"
            .into(),
        (true, _) => format!(
            "the {tokens} generated tokens held no message text (only the chat format's own \
             tokens, or output that does not follow the chat format)"
        ),
    })
}

/// OpenAI's `usage`: `cached` of the prompt's tokens came from a cache (a slot's KV cache in
/// RAM, or the prompt cache on disk) instead of being computed.
pub(super) fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": { "cached_tokens": cached },
    })
}

pub(super) fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Which endpoint a reply is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Chat,
    Text,
}

/// Everything needed to answer once the request is queued.
pub(super) struct Answer {
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) model: String,
    pub(super) created: u64,
    pub(super) prompt_tokens: usize,
    pub(super) include_usage: bool,
    pub(super) reply: Reply,
    /// Whether log-probabilities were asked.
    pub(super) logprobs: bool,
    pub(super) tokenizer: Arc<Tokenizer>,
    /// Characters of completion text covered by the log-probabilities sent so far (the
    /// completions endpoint's `text_offset`).
    pub(super) offset: usize,
    pub(super) phase: tokio::sync::watch::Receiver<Phase>,
}

/// A log-probability for JSON: a number, never infinity (JSON has none; OpenAI's API uses
/// -9999 for "impossible").
pub(super) fn lp_json(v: f32) -> f64 {
    if v.is_finite() {
        f64::from(v)
    } else {
        -9999.0
    }
}

impl Answer {
    pub(super) fn token_text(&self, id: TokenId) -> (String, Vec<u8>) {
        let b = self.tokenizer.token_bytes(id).unwrap_or_default().to_vec();
        (String::from_utf8_lossy(&b).into_owned(), b)
    }

    /// The `logprobs` value of a choice for the tokens `lps` (`null` when not asked).
    pub(super) fn logprobs_json(&mut self, lps: &[(TokenId, TokenLogprobs)]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => {
                let entry = |this: &Self, id: TokenId, lp: f32| {
                    let (token, bytes) = this.token_text(id);
                    json!({ "token": token, "logprob": lp_json(lp), "bytes": bytes })
                };
                let content: Vec<Value> = lps
                    .iter()
                    .map(|(id, lp)| {
                        let mut e = entry(self, *id, lp.logprob);
                        e["top_logprobs"] = lp
                            .top
                            .iter()
                            .map(|&(t, l)| entry(self, t, l))
                            .collect::<Vec<_>>()
                            .into();
                        e
                    })
                    .collect();
                json!({ "content": content, "refusal": null })
            }
            Kind::Text => {
                let (mut tokens, mut token_lps, mut tops, mut offsets) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for (id, lp) in lps {
                    let (t, _) = self.token_text(*id);
                    offsets.push(self.offset);
                    self.offset += t.chars().count();
                    tokens.push(t);
                    token_lps.push(lp_json(lp.logprob));
                    let top: serde_json::Map<String, Value> = lp
                        .top
                        .iter()
                        .map(|&(t, l)| (self.token_text(t).0, json!(lp_json(l))))
                        .collect();
                    tops.push(Value::Object(top));
                }
                json!({ "tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                        "text_offset": offsets })
            }
        }
    }

    pub(super) fn chunk(&mut self, delta: Value, finish: Option<&str>) -> Value {
        let lps = std::mem::take(&mut self.reply.logprobs);
        let logprobs = self.logprobs_json(&lps);
        match self.kind {
            Kind::Chat => json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model,
                "choices": [{ "index": 0, "delta": delta, "logprobs": logprobs,
                              "finish_reason": finish }],
            }),
            Kind::Text => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{ "index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")),
                              "logprobs": logprobs, "finish_reason": finish }],
            }),
        }
    }

    /// The next step of the reply, or an error when the server cuts running replies (on
    /// shutdown, past the grace period): the generation is cancelled.
    pub(super) async fn next(&mut self) -> Result<Option<Step>, ApiError> {
        let mut phase = self.phase.clone();
        tokio::select! {
            r = self.reply.next() => r,
            true = phase_reached(&mut phase, Phase::Cutting) => {
                // Closing the channel cancels the generation.
                self.reply.events.close();
                Err(ApiError::server(format!(
                    "the server is shutting down: the reply was cut after {} tokens",
                    self.reply.tokens
                ))
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .code("server_shutting_down"))
            }
        }
    }

    /// Waits until the engine starts the request (its first event: the request has a slot,
    /// or it failed). A request still waiting when the server begins to shut down is refused
    /// with a 503 instead, and leaves the queue: only running replies get the grace period.
    async fn start(&mut self) -> Result<(), ApiError> {
        let mut phase = self.phase.clone();
        tokio::select! {
            // An event already there wins: that request had started.
            biased;
            ev = self.reply.events.recv() => self.reply.take(ev),
            true = phase_reached(&mut phase, Phase::Draining) => {
                // Closing the channel takes it out of the queue (or, had the engine just
                // started it, cancels it at its next step).
                self.reply.events.close();
                Err(ApiError::server(
                    "the server is shutting down: the request was waiting for a free slot and \
                     was not started; send it again",
                )
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .code("server_shutting_down")
                .header(hyper::header::RETRY_AFTER, "5"))
            }
        }
    }

    pub(super) async fn whole(mut self) -> Result<Response<Body>, ApiError> {
        self.start().await?;
        let (mut content, mut reasoning) = (String::new(), String::new());
        let (mut reason, mut tokens) = ("stop", 0);
        while let Some(step) = self.next().await? {
            match step {
                Step::Delta(OutputDelta::Content(t)) => content.push_str(&t),
                Step::Delta(OutputDelta::Reasoning(t)) => reasoning.push_str(&t),
                Step::End(r, n) => (reason, tokens) = (r, n),
            }
        }
        let usage = usage(self.prompt_tokens, tokens, self.reply.cached);
        let lps = std::mem::take(&mut self.reply.logprobs);
        let logprobs = self.logprobs_json(&lps);
        let v = match self.kind {
            Kind::Chat => {
                let mut message = json!({ "role": "assistant", "content": content });
                if !reasoning.is_empty() {
                    message["reasoning_content"] = json!(reasoning);
                }
                let mut choice = json!({ "index": 0, "message": message, "logprobs": logprobs,
                                         "finish_reason": reason });
                let why =
                    empty_content_reason(content.is_empty(), reasoning.is_empty(), reason, tokens);
                if let Some(why) = why {
                    choice["content_empty_reason"] = json!(why);
                }
                json!({
                    "id": self.id, "object": "chat.completion", "created": self.created,
                    "model": self.model,
                    "choices": [choice],
                    "usage": usage,
                })
            }
            Kind::Text => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{ "index": 0, "text": content, "logprobs": logprobs,
                              "finish_reason": reason }],
                "usage": usage,
            }),
        };
        Ok(json_response(StatusCode::OK, &v))
    }

    /// The reply as server-sent events, once the request has started: while it waits in the
    /// queue no head is sent, so a request refused before it runs (the server shutting down,
    /// the engine failing it) gets an HTTP error rather than a 200 and an error event.
    pub(super) async fn streamed(mut self) -> Result<Response<Body>, ApiError> {
        self.start().await?;
        let (tx, rx) = mpsc::channel::<Bytes>(32);
        tokio::spawn(async move {
            let event = |v: &Value| Bytes::from(format!("data: {v}\n\n"));
            if self.kind == Kind::Chat {
                let first = self.chunk(json!({ "role": "assistant", "content": "" }), None);
                if tx.send(event(&first)).await.is_err() {
                    return;
                }
            }
            // What the stream has carried, for `content_empty_reason` on its last chunk.
            let (mut content_sent, mut reasoning_sent) = (false, false);
            loop {
                // A client that hangs up (the connection drops the body) ends the task at once,
                // so a request still waiting in the queue leaves it (see `batch.rs`).
                let step = tokio::select! {
                    step = self.next() => step,
                    () = tx.closed() => return,
                };
                let v = match step {
                    Ok(Some(Step::Delta(OutputDelta::Content(t)))) => {
                        content_sent |= !t.is_empty();
                        self.chunk(json!({ "content": t }), None)
                    }
                    Ok(Some(Step::Delta(OutputDelta::Reasoning(t)))) => {
                        if self.kind == Kind::Text {
                            continue;
                        }
                        reasoning_sent |= !t.is_empty();
                        self.chunk(json!({ "reasoning_content": t }), None)
                    }
                    Ok(Some(Step::End(reason, tokens))) => {
                        let mut last = self.chunk(json!({}), Some(reason));
                        let why =
                            empty_content_reason(!content_sent, !reasoning_sent, reason, tokens)
                                .filter(|_| self.kind == Kind::Chat);
                        if let Some(why) = why {
                            last["choices"][0]["content_empty_reason"] = json!(why);
                        }
                        if self.include_usage {
                            if tx.send(event(&last)).await.is_err() {
                                return;
                            }
                            last = self.chunk(json!({}), None);
                            last["choices"] = json!([]);
                            last["usage"] = usage(self.prompt_tokens, tokens, self.reply.cached);
                        }
                        last
                    }
                    Ok(None) => break,
                    Err(e) => e.body(),
                };
                let is_err = v.get("error").is_some();
                if tx.send(event(&v)).await.is_err() {
                    return;
                }
                if is_err {
                    // The stream still ends as a stream does, so clients see a clean end.
                    break;
                }
            }
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        });
        let mut r = Response::new(Body::Stream(rx));
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert(
            hyper::header::CACHE_CONTROL,
            HeaderValue::from_static("no-cache"),
        );
        Ok(r)
    }
}

impl State {
    pub(super) fn answer(
        &self,
        kind: Kind,
        common: &Common,
        prompt_tokens: usize,
        reply: Reply,
        logprobs: bool,
    ) -> Answer {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Text => "cmpl",
        };
        Answer {
            kind,
            id: format!("{prefix}-{:x}{n:06x}", self.created),
            model: self.name.clone(),
            created: now_s(),
            prompt_tokens,
            include_usage: common
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage == Some(true)),
            reply,
            logprobs,
            tokenizer: self.tokenizer.clone(),
            offset: 0,
            phase: self.phase.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::empty_content_reason;

    #[test]
    fn an_empty_answer_says_why() {
        assert_eq!(empty_content_reason(false, false, "length", 9), None);
        assert_eq!(empty_content_reason(true, true, "stop", 0), None);
        let cut = empty_content_reason(true, false, "length", 9).expect("a reason");
        assert!(cut.contains("max_tokens (9 tokens)") && cut.contains("reasoning_content"));
        let only = empty_content_reason(true, false, "stop", 9).expect("a reason");
        assert!(only.contains("only reasoning"), "{only}");
        let none = empty_content_reason(true, true, "stop", 9).expect("a reason");
        assert!(
            none.contains("9 generated tokens held no message text"),
            "{none}"
        );
    }
}
