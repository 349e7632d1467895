//! Real nodes as processes of the `stormo` binary on 127.0.0.1, each behind a [`Relay`].
//!
//! A [`Cluster`] owns a scratch folder (keys, the manifest, logs), the `stormo serve`
//! processes and their relays. It kills every process it started when dropped, and its
//! [`Reaper`] can do the same from a signal handler.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use super::relay::{LinkCounts, LinkSpec, Relay, SharedLink};
use super::SwarmError;

/// The process ids a cluster has running, to kill from elsewhere (a Ctrl-C handler).
#[derive(Debug, Clone, Default)]
pub struct Reaper(Arc<Mutex<BTreeSet<u32>>>);

impl Reaper {
    fn add(&self, pid: u32) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).insert(pid);
    }
    fn remove(&self, pid: u32) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&pid);
    }
    /// Sends SIGKILL to every process still registered.
    pub fn kill_all(&self) {
        let pids: Vec<u32> = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
            .into_iter()
            .collect();
        for p in pids {
            signal(p, "KILL");
        }
    }
}

/// Sends a signal by name with the system's `kill` (this crate has no unsafe code).
fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// One serving node.
#[derive(Debug)]
pub struct Node {
    /// Its name in reports (`n0`, `n1`, ...).
    pub name: String,
    /// Its `--only-experts` spec (`None`: every expert).
    pub only: Option<String>,
    /// Its node key's public half (64 hex).
    pub public: String,
    key: PathBuf,
    /// Its state directory (usage counts, kept experts), in the scratch folder.
    pub state_dir: PathBuf,
    child: Option<Child>,
    /// Where it listens (behind its relay).
    pub listen: Option<SocketAddr>,
    relay: Relay,
    /// How many times it was started.
    pub starts: u32,
    /// How many times it was killed.
    pub kills: u32,
    /// Requests it reported serving when stopped gracefully (summed over its lives).
    pub served: Option<u64>,
    log: PathBuf,
    spec: NodeSpec,
}

/// How a node serves, beyond the experts it holds: what the fault matrix varies.
#[derive(Debug, Clone, Default)]
pub struct NodeSpec {
    /// Its `--only-experts` spec (`None`: every expert).
    pub only: Option<String>,
    /// The checkpoint it serves (`None`: the cluster's); the manifest is the cluster's.
    pub model: Option<PathBuf>,
    /// The key it admits (`None`: the cluster's client).
    pub allow: Option<String>,
    /// More `stormo serve` arguments (e.g. `--expert-cache 0`, or `--peer` for a node that
    /// fetches), after the cluster's `serve_args`.
    pub args: Vec<String>,
    /// Its node key (file, public half) made with [`Cluster::make_key`] (`None`: a new one).
    pub key: Option<(PathBuf, String)>,
    /// A bottleneck its relay's way to the client shares with other nodes' relays (`None`:
    /// the link's own).
    pub shared_down: Option<SharedLink>,
}

impl Node {
    /// `KEY@RELAY` for a client's `--peer`.
    pub fn peer(&self) -> String {
        format!("{}@{}", self.public, self.relay.addr())
    }
    /// What its link carried.
    pub fn link(&self) -> LinkCounts {
        self.relay.counts()
    }
    /// Whether its process is running.
    pub fn is_up(&self) -> bool {
        self.child.is_some()
    }
}

/// The processes, relays and files of one swarm.
#[derive(Debug)]
pub struct Cluster {
    exe: PathBuf,
    /// The checkpoint every node serves from.
    pub model: PathBuf,
    /// The scratch folder.
    pub work: PathBuf,
    /// The manifest, built and signed in the scratch folder.
    pub manifest: PathBuf,
    /// The publisher key that signed it (64 hex).
    pub publisher: String,
    /// The model id (64 hex).
    pub model_id: String,
    /// The client's node key file and public half.
    pub client_key: PathBuf,
    /// The client's public key (64 hex).
    pub client_public: String,
    /// The serving nodes.
    pub nodes: Vec<Node>,
    /// Extra arguments of every `stormo serve` it starts (e.g. `--congestion bbr`).
    pub serve_args: Vec<String>,
    reaper: Reaper,
    next_seed: u64,
}

/// Runs `exe args`, returning its stdout; its stderr goes into the error.
pub fn run_capture(exe: &Path, args: &[String], what: &str) -> Result<String, SwarmError> {
    let out = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| SwarmError::Spawn {
            what: what.into(),
            exe: exe.to_path_buf(),
            source,
        })?;
    if !out.status.success() {
        return Err(SwarmError::Failed {
            what: what.into(),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn s(x: impl AsRef<std::ffi::OsStr>) -> String {
    x.as_ref().to_string_lossy().into_owned()
}

/// How long a node may take to print its address.
const START_TIMEOUT: Duration = Duration::from_secs(60);

impl Cluster {
    /// Makes keys (a publisher, a client), builds and signs the manifest of `model` in
    /// `work` (created if missing), with `exe` as the `stormo` binary.
    pub fn prepare(exe: &Path, model: &Path, work: &Path) -> Result<Self, SwarmError> {
        std::fs::create_dir_all(work).map_err(|e| SwarmError::io(work, e))?;
        let key = |name: &str| -> Result<(PathBuf, String), SwarmError> {
            let p = work.join(format!("{name}.key"));
            let out = run_capture(
                exe,
                &["key".into(), "generate".into(), "--key".into(), s(&p)],
                &format!("making key {name}"),
            )?;
            Ok((p, out.trim().to_string()))
        };
        let (pub_key, publisher) = key("publisher")?;
        let (client_key, client_public) = key("client")?;
        let manifest = work.join("stormo-manifest.bin");
        run_capture(
            exe,
            &[
                "manifest".into(),
                "build".into(),
                "--model".into(),
                s(model),
                "--out".into(),
                s(&manifest),
            ],
            "building the manifest",
        )?;
        run_capture(
            exe,
            &[
                "manifest".into(),
                "sign".into(),
                "--model".into(),
                s(model),
                "--key".into(),
                s(&pub_key),
                "--manifest".into(),
                s(&manifest),
            ],
            "signing the manifest",
        )?;
        let shown = run_capture(
            exe,
            &[
                "manifest".into(),
                "show".into(),
                "--manifest".into(),
                s(&manifest),
            ],
            "reading the manifest",
        )?;
        let model_id = shown
            .lines()
            .find_map(|l| l.strip_prefix("model id"))
            .map(|v| v.trim().to_string())
            .filter(|v| v.len() == 64)
            .ok_or_else(|| SwarmError::Failed {
                what: "reading the manifest".into(),
                detail: format!("no model id in `stormo manifest show`: {shown}"),
            })?;
        Ok(Self {
            exe: exe.to_path_buf(),
            model: model.to_path_buf(),
            work: work.to_path_buf(),
            manifest,
            publisher,
            model_id,
            client_key,
            client_public,
            nodes: Vec::new(),
            serve_args: Vec::new(),
            reaper: Reaper::default(),
            next_seed: 1,
        })
    }

    /// The `stormo` binary.
    pub fn exe(&self) -> &Path {
        &self.exe
    }

    /// A handle that kills every process of this cluster.
    pub fn reaper(&self) -> Reaper {
        self.reaper.clone()
    }

    /// Makes a node key named `name` in the scratch folder: its file and public half.
    pub fn make_key(&self, name: &str) -> Result<(PathBuf, String), SwarmError> {
        let key = self.work.join(format!("{name}.key"));
        let public = run_capture(
            &self.exe,
            &["key".into(), "generate".into(), "--key".into(), s(&key)],
            &format!("making the key of {name}"),
        )?
        .trim()
        .to_string();
        Ok((key, public))
    }

    /// Adds and starts a node serving `only` (an `--only-experts` spec, `None`: all) behind a
    /// relay with `link`. Returns its index.
    pub fn add_node(&mut self, only: Option<String>, link: LinkSpec) -> Result<usize, SwarmError> {
        self.add_node_with(
            NodeSpec {
                only,
                ..NodeSpec::default()
            },
            link,
        )
    }

    /// Adds and starts a node serving as `spec` says behind a relay with `link`. Returns its
    /// index.
    pub fn add_node_with(&mut self, spec: NodeSpec, link: LinkSpec) -> Result<usize, SwarmError> {
        let i = self.nodes.len();
        let name = format!("n{i}");
        let (key, public) = match spec.key.clone() {
            Some(k) => k,
            None => self.make_key(&name)?,
        };
        // A placeholder target until the node says where it listens.
        let placeholder = "127.0.0.1:9".parse().expect("a literal address");
        let relay = match &spec.shared_down {
            Some(down) => Relay::start_shared(placeholder, link, self.next_seed, down),
            None => Relay::start(placeholder, link, self.next_seed),
        }
        .map_err(|e| SwarmError::Failed {
            what: format!("starting the relay of {name}"),
            detail: e.to_string(),
        })?;
        self.next_seed += 1;
        let state_dir = self.work.join(format!("{name}.state"));
        self.nodes.push(Node {
            log: self.work.join(format!("{name}.log")),
            name,
            only: spec.only.clone(),
            public,
            key,
            spec,
            state_dir,
            child: None,
            listen: None,
            relay,
            starts: 0,
            kills: 0,
            served: None,
        });
        self.start(i)?;
        Ok(i)
    }

    /// Starts node `i` (again), on its previous port if it had one.
    pub fn start(&mut self, i: usize) -> Result<(), SwarmError> {
        let n = &mut self.nodes[i];
        if n.child.is_some() {
            return Ok(());
        }
        let listen = n
            .listen
            .map_or_else(|| "127.0.0.1:0".to_string(), |a| a.to_string());
        let mut args = vec![
            "serve".into(),
            "--model".into(),
            s(n.spec.model.as_ref().unwrap_or(&self.model)),
            "--manifest".into(),
            s(&self.manifest),
            "--listen".into(),
            listen,
            "--key".into(),
            s(&n.key),
            "--allow".into(),
            n.spec
                .allow
                .clone()
                .unwrap_or_else(|| self.client_public.clone()),
            "--no-hot-store".into(),
            "--state-dir".into(),
            s(&n.state_dir),
        ];
        if let Some(o) = &n.only {
            args.extend(["--only-experts".into(), o.clone()]);
        }
        args.extend(self.serve_args.iter().cloned());
        args.extend(n.spec.args.iter().cloned());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&n.log)
            .map_err(|e| SwarmError::io(&n.log, e))?;
        let mut child = Command::new(&self.exe)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|source| SwarmError::Spawn {
                what: format!("starting {}", n.name),
                exe: self.exe.clone(),
                source,
            })?;
        self.reaper.add(child.id());
        let stdout = child.stdout.take().expect("stdout was piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(START_TIMEOUT).unwrap_or_default();
        let addr = line
            .trim()
            .rsplit_once('@')
            .and_then(|(_, a)| a.parse::<SocketAddr>().ok());
        let Some(addr) = addr else {
            let _ = child.kill();
            let _ = child.wait();
            self.reaper.remove(child.id());
            let log = std::fs::read_to_string(&n.log).unwrap_or_default();
            return Err(SwarmError::Failed {
                what: format!("starting {}", n.name),
                detail: format!(
                    "it printed no KEY@ADDR line within {}s; its log ({}):\n{}",
                    START_TIMEOUT.as_secs(),
                    n.log.display(),
                    tail(&log, 20)
                ),
            });
        };
        n.relay.set_target(addr);
        n.listen = Some(addr);
        n.child = Some(child);
        n.starts += 1;
        Ok(())
    }

    /// Kills node `i` at once (SIGKILL, a crash).
    pub fn kill(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        if let Some(mut c) = n.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            self.reaper.remove(c.id());
            n.kills += 1;
        }
    }

    /// Freezes node `i` (SIGSTOP): its process stays, silent, until [`Cluster::resume`].
    pub fn pause(&mut self, i: usize) {
        if let Some(c) = &self.nodes[i].child {
            signal(c.id(), "STOP");
        }
    }

    /// Lets a frozen node `i` go on (SIGCONT).
    pub fn resume(&mut self, i: usize) {
        if let Some(c) = &self.nodes[i].child {
            signal(c.id(), "CONT");
        }
    }

    /// Stops node `i` gracefully (SIGINT, as Ctrl-C) and reads how many requests it served
    /// from its last words.
    pub fn stop(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        let Some(mut c) = n.child.take() else {
            return;
        };
        // A frozen process would not see the SIGINT.
        signal(c.id(), "CONT");
        signal(c.id(), "INT");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        self.reaper.remove(c.id());
        // Only this life's line counts: earlier lives that ended gracefully were added then.
        let log = std::fs::read_to_string(&n.log).unwrap_or_default();
        if let Some(v) = log
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("served "))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
        {
            n.served = Some(n.served.unwrap_or(0) + v);
        }
    }

    /// Stops every node gracefully.
    pub fn stop_all(&mut self) {
        for i in 0..self.nodes.len() {
            self.stop(i);
        }
    }

    /// `--peer` arguments for the nodes `which`.
    pub fn peer_args(&self, which: impl IntoIterator<Item = usize>) -> Vec<String> {
        which
            .into_iter()
            .flat_map(|i| ["--peer".to_string(), self.nodes[i].peer()])
            .collect()
    }

    /// Starts `stormo run` with `args`, stdout and stderr to files named after `name` in the
    /// scratch folder.
    pub fn spawn_run(&self, name: &str, args: &[String]) -> Result<RunningClient, SwarmError> {
        self.spawn_command(name, "run", args)
    }

    /// Starts `stormo COMMAND args` (e.g. a `pull`), stdout and stderr to files named after
    /// `name` in the scratch folder.
    pub fn spawn_command(
        &self,
        name: &str,
        command: &str,
        args: &[String],
    ) -> Result<RunningClient, SwarmError> {
        let out = self.work.join(format!("{name}.json"));
        let err = self.work.join(format!("{name}.log"));
        let fo = File::create(&out).map_err(|e| SwarmError::io(&out, e))?;
        let fe = File::create(&err).map_err(|e| SwarmError::io(&err, e))?;
        let child = Command::new(&self.exe)
            .arg(command)
            .args(args)
            .stdin(Stdio::null())
            .stdout(fo)
            .stderr(fe)
            .spawn()
            .map_err(|source| SwarmError::Spawn {
                what: format!("starting the {name} run"),
                exe: self.exe.clone(),
                source,
            })?;
        self.reaper.add(child.id());
        Ok(RunningClient {
            name: name.into(),
            child,
            out,
            err,
            started: Instant::now(),
            reaper: self.reaper.clone(),
        })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A `stormo run` in progress.
#[derive(Debug)]
pub struct RunningClient {
    name: String,
    child: Child,
    out: PathBuf,
    err: PathBuf,
    /// When it started.
    pub started: Instant,
    reaper: Reaper,
}

impl RunningClient {
    /// Its name (`swarm`, `one-holder`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether it has exited.
    pub fn finished(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// `None` while it runs; then `Ok` if it exited successfully, or an error with its log's
    /// last lines.
    pub fn outcome(&mut self) -> Option<Result<(), SwarmError>> {
        let status = match self.child.try_wait() {
            Ok(Some(st)) => st,
            Ok(None) => return None,
            Err(e) => return Some(Err(SwarmError::io(&self.out, e))),
        };
        self.reaper.remove(self.child.id());
        if status.success() {
            return Some(Ok(()));
        }
        let err = std::fs::read_to_string(&self.err).unwrap_or_default();
        Some(Err(SwarmError::Failed {
            what: format!("the {} process", self.name),
            detail: format!(
                "{status}; its log ({}):\n{}",
                self.err.display(),
                tail(&err, 20)
            ),
        }))
    }

    /// Waits for it (killing it past `timeout`) and parses its `--json` output.
    pub fn wait(mut self, timeout: Duration) -> Result<(serde_json::Value, f64), SwarmError> {
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(st)) => break st,
                Ok(None) if self.started.elapsed() > timeout => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    self.reaper.remove(self.child.id());
                    return Err(SwarmError::Failed {
                        what: format!("the {} run", self.name),
                        detail: format!("still running after {}s; killed", timeout.as_secs()),
                    });
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => return Err(SwarmError::io(&self.out, e)),
            }
        };
        let wall = self.started.elapsed().as_secs_f64();
        self.reaper.remove(self.child.id());
        let err = std::fs::read_to_string(&self.err).unwrap_or_default();
        if !status.success() {
            return Err(SwarmError::Failed {
                what: format!("the {} run", self.name),
                detail: format!(
                    "{status}; its log ({}):\n{}",
                    self.err.display(),
                    tail(&err, 20)
                ),
            });
        }
        let text = std::fs::read_to_string(&self.out).map_err(|e| SwarmError::io(&self.out, e))?;
        let v = serde_json::from_str(text.trim()).map_err(|e| SwarmError::Failed {
            what: format!("the {} run", self.name),
            detail: format!("its --json output is not JSON ({e}): {text}"),
        })?;
        Ok((v, wall))
    }
}

impl Drop for RunningClient {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        self.reaper.remove(self.child.id());
    }
}
