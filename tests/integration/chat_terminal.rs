//! `stormo chat` on a terminal, driven through tmux: history recall, Ctrl-C stopping a reply
//! without ending the chat, and /save. Moved out of `chat.rs` (tokenizers, formats,
//! sessions), which kept it over 1,500 lines.

use std::process::Command;

use serde_json::Value;

// ---- `stormo chat` on a terminal (tmux) ----

/// A tmux server of the test's own (its own socket), killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    /// A tmux server on `socket` running `command` (a `stormo chat`) in a 200x50 window,
    /// once the chat's banner shows.
    fn chat(socket: String, command: &str) -> Self {
        let t = Self { socket };
        let o = t.cmd(&[
            "new-session",
            "-d",
            "-s",
            "chat",
            "-x",
            "200",
            "-y",
            "50",
            command,
        ]);
        assert!(
            o.status.success(),
            "tmux: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        t.wait("the banner", |s| s.contains("stormo chat with"));
        t
    }

    fn cmd(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux")
            .args(["-L", &self.socket])
            .args(args)
            .output()
            .expect("tmux runs")
    }

    /// The pane's text, scrollback included, wrapped lines joined.
    fn screen(&self) -> String {
        let o = self.cmd(&["capture-pane", "-p", "-J", "-S", "-", "-t", "chat"]);
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Waits (at most 60 s) until the screen satisfies `done`; returns it.
    fn wait(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let t0 = std::time::Instant::now();
        loop {
            let s = self.screen();
            if done(&s) {
                return s;
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(60),
                "waited 60 s for {what}; the screen:\n{s}"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "chat"];
        args.extend_from_slice(keys);
        assert!(self.cmd(&args).status.success(), "send-keys {keys:?}");
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

/// The last line of the screen that is not blank.
fn last_line(screen: &str) -> &str {
    screen
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim_end()
}

/// `stormo chat` driven through a terminal (tmux): the Up arrow recalls the last message
/// (from the history file in the state directory), Ctrl-C stops a reply without ending the
/// chat, and the next message continues the same conversation (its prompt reuses the cached
/// first turn and the stopped reply); /save writes the conversation with the stopped reply.
#[test]
fn chat_on_a_terminal_recalls_history_and_ctrl_c_stops_a_reply() {
    let have = Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        have,
        "tmux is needed to drive chat on a terminal (apt-get install tmux; .ci/run installs it)"
    );
    let model = crate::http::synth_model();
    let tmp = tempfile::tempdir().expect("temp dir");
    let state = tmp.path().join("state");
    let saved = tmp.path().join("saved.json");
    let q = |p: &std::path::Path| format!("'{}'", p.display());
    // Greedy (a random-weight model then repeats itself rather than ending its reply), with
    // room for a reply far longer than the test waits.
    let command = format!(
        "env XDG_STATE_HOME={} XDG_CACHE_HOME={} {} chat --model {} --context 32768 \
         --max-new-tokens 30000 --temperature 0 --no-hot-store; echo CHAT-EXITED $?; sleep 60",
        q(&state),
        q(tmp.path()),
        q(&crate::demo::stormo_exe()),
        q(model.path())
    );
    let t = Tmux::chat(format!("stormo-test-{}", std::process::id()), &command);

    // A reply, stopped with Ctrl-C once it has started.
    t.keys(&["Hello there", "Enter"]);
    let shown = t.wait("the reply to start", |s| {
        s.lines()
            .skip_while(|l| !l.starts_with("> Hello there"))
            .skip(1)
            .any(|l| !l.trim().is_empty())
    });
    assert!(
        !shown.contains("[prompt"),
        "the reply ended by itself:\n{shown}"
    );
    t.keys(&["C-c"]);
    let s = t.wait("the stopped reply's note", |s| s.contains("[prompt"));
    assert!(
        s.contains("(stopped; the reply so far stays in the conversation)"),
        "{s}"
    );
    let first = s
        .lines()
        .find(|l| l.contains("[prompt"))
        .expect("a stats line")
        .to_string();
    assert!(first.contains("(stopped)"), "{first}");
    let first_prompt: usize = first
        .split("[prompt ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the prompt size in {first}"));
    t.wait("the next prompt", |s| last_line(s) == ">");

    // Up recalls the message; it is kept in the history file too.
    t.keys(&["Up"]);
    t.wait("the recalled message", |s| last_line(s) == "> Hello there");
    let history = std::fs::read_to_string(state.join("stormo/chat_history")).expect("history file");
    assert!(history.contains("Hello there"), "{history}");

    // The next message continues the conversation: its prompt reuses the first turn and the
    // stopped reply from the cache.
    t.keys(&["C-u", "And again?", "Enter"]);
    let s = t.wait("the second reply to start", |s| {
        s.lines()
            .skip_while(|l| !l.starts_with("> And again?"))
            .skip(1)
            .any(|l| !l.trim().is_empty())
    });
    assert_eq!(s.matches("[prompt").count(), 1, "{s}");
    t.keys(&["C-c"]);
    let s = t.wait("the second stats line", |s| {
        s.matches("[prompt").count() == 2
    });
    let second = s
        .lines()
        .filter(|l| l.contains("[prompt"))
        .nth(1)
        .expect("stats")
        .to_string();
    let reused: usize = second
        .split(", ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the reuse count in {second}"));
    assert!(
        reused >= first_prompt,
        "the second turn reuses the first prompt ({first_prompt}) from the cache: {second}"
    );

    // /save keeps both turns, the stopped replies included; /quit leaves with status 0.
    t.wait("the next prompt", |s| last_line(s) == ">");
    t.keys(&[&format!("/save {}", saved.display()), "Enter"]);
    t.wait("the save note", |s| s.contains("(saved 4 messages to"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&saved).expect("saved file"))
        .expect("saved JSON");
    let roles: Vec<&str> = v["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["role"].as_str().expect("role"))
        .collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"], "{v}");
    assert_eq!(v["messages"][0]["content"], "Hello there");
    assert_eq!(v["messages"][2]["content"], "And again?");
    // The stopped reply is in the conversation as far as it was shown.
    let m = &v["messages"][1];
    let text = |k: &str| m[k].as_str().unwrap_or("").trim().to_string();
    assert!(
        !text("content").is_empty() || !text("reasoning_content").is_empty(),
        "{v}"
    );

    // A line ending in a backslash continues the message on the next line.
    t.keys(&["first line\\", "Enter"]);
    t.wait("the continuation line", |s| s.contains("first line\\"));
    t.keys(&["second line", "Enter"]);
    t.wait("the third reply to start", |s| {
        s.lines()
            .skip_while(|l| !l.contains("second line"))
            .skip(1)
            .any(|l| !l.trim().is_empty())
    });
    t.keys(&["C-c"]);
    t.wait("the third stats line", |s| {
        s.matches("[prompt").count() == 3
    });
    t.wait("the next prompt", |s| last_line(s) == ">");
    let saved6 = tmp.path().join("six.json");
    t.keys(&[&format!("/save {}", saved6.display()), "Enter"]);
    t.wait("the second save", |s| {
        s.contains(&format!("(saved 6 messages to {})", saved6.display()))
    });
    let v6: Value = serde_json::from_str(&std::fs::read_to_string(&saved6).expect("saved"))
        .expect("saved JSON");
    assert_eq!(
        v6["messages"][4]["content"], "first line\nsecond line",
        "{v6}"
    );

    // /load: a bad file is a clear error and changes nothing; a good one replaces the
    // conversation (saving again gives its four messages).
    let bad = tmp.path().join("bad.json");
    std::fs::write(
        &bad,
        "{\"format\": \"stormo-chat\", \"version\": 1, \"messages\": 5}",
    )
    .expect("write");
    t.keys(&[&format!("/load {}", bad.display()), "Enter"]);
    let s = t.wait("the load error", |s| {
        s.contains("cannot load the conversation")
    });
    assert!(s.contains("bad.json is not a saved chat"), "{s}");
    assert!(s.contains("(the conversation is unchanged)"), "{s}");
    t.keys(&[&format!("/load {}", saved.display()), "Enter"]);
    t.wait("the load note", |s| s.contains("(loaded 4 messages from"));
    let again = tmp.path().join("again.json");
    t.keys(&[&format!("/save {}", again.display()), "Enter"]);
    t.wait("the third save", |s| {
        s.contains(&format!("(saved 4 messages to {})", again.display()))
    });
    let v4: Value =
        serde_json::from_str(&std::fs::read_to_string(&again).expect("saved")).expect("saved JSON");
    assert_eq!(v4["messages"], v["messages"]);
    t.keys(&["/quit", "Enter"]);
    t.wait("the chat to exit", |s| s.contains("CHAT-EXITED 0"));
}

/// Ctrl-C while a long prompt is computed (a loaded conversation of about 25,000 tokens)
/// stops it within a fraction of a second: the turn ends with a note, the message is dropped
/// (the conversation is as before it) and the chat goes on.
#[test]
fn ctrl_c_stops_a_long_prompt_and_the_chat_goes_on() {
    let have = Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        have,
        "tmux is needed to drive chat on a terminal (apt-get install tmux; .ci/run installs it)"
    );
    let model = crate::http::synth_model();
    let tmp = tempfile::tempdir().expect("temp dir");
    let long = tmp.path().join("long.json");
    let words: Vec<String> = (0..9000).map(|i| format!("word{i}")).collect();
    let v = serde_json::json!({"format": "stormo-chat", "version": 1, "messages": [
        {"role": "user", "content": words.join(" ")},
        {"role": "assistant", "content": "Noted."},
    ]});
    std::fs::write(&long, v.to_string()).expect("write the long chat");
    let q = |p: &std::path::Path| format!("'{}'", p.display());
    let command = format!(
        "env XDG_STATE_HOME={} XDG_CACHE_HOME={} {} chat --model {} --context 32768 \
         --max-new-tokens 16 --temperature 0 --no-hot-store --no-history; echo CHAT-EXITED $?; \
         sleep 60",
        q(tmp.path()),
        q(tmp.path()),
        q(&crate::demo::stormo_exe()),
        q(model.path())
    );
    let t = Tmux::chat(
        format!("stormo-test-prefill-{}", std::process::id()),
        &command,
    );
    t.keys(&[&format!("/load {}", long.display()), "Enter"]);
    t.wait("the load note", |s| s.contains("(loaded 2 messages from"));
    t.keys(&["Go on.", "Enter"]);
    // Well into the prompt (it takes seconds), with nothing shown yet.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(!t.screen().contains("[prompt"), "{}", t.screen());
    t.keys(&["C-c"]);
    let sent = std::time::Instant::now();
    let s = t.wait("the stopped prompt's note", |s| {
        s.contains("(stopped while reading the prompt")
    });
    let took = sent.elapsed();
    assert!(s.contains("the message is dropped"), "{s}");
    assert!(!s.contains("[prompt"), "no reply: {s}");
    // 0.5 s on an idle machine (a layer of this model takes milliseconds); the bound leaves
    // room for a loaded one and for tmux's polling.
    assert!(
        took < std::time::Duration::from_millis(1500),
        "Ctrl-C took {took:?} to stop the prompt:\n{s}"
    );
    eprintln!("Ctrl-C stopped the prompt in {took:?}");
    t.wait("the next prompt", |s| last_line(s) == ">");
    // The conversation is the loaded one; the chat goes on.
    let saved = tmp.path().join("after.json");
    t.keys(&[&format!("/save {}", saved.display()), "Enter"]);
    t.wait("the save note", |s| s.contains("(saved 2 messages to"));
    t.wait("the next prompt", |s| last_line(s) == ">");
    t.keys(&["/reset", "Enter"]);
    t.wait("the reset note", |s| s.contains("(conversation reset)"));
    t.wait("the next prompt", |s| last_line(s) == ">");
    t.keys(&["Hello", "Enter"]);
    t.wait("a reply's stats line", |s| s.contains("[prompt"));
    t.wait("the next prompt", |s| last_line(s) == ">");
    t.keys(&["/quit", "Enter"]);
    t.wait("the chat to exit", |s| s.contains("CHAT-EXITED 0"));
}
