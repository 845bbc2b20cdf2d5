//! Chaos: three `relayhost run` processes on a real three-member replica set, a pymongo
//! publisher following the README's protocol in its own transactions (keyed and unkeyed
//! events, several threads with skewed clocks, some transactions aborted), hosts killed with
//! SIGKILL every few seconds (sometimes two at once) and restarted, the primary killed and
//! later stepped down. At the end the transactional projection holds exactly the committed
//! events, each key's events were handled in sequence, nothing is pending or dead, and the
//! drain ended within a lease, a transaction lifetime and a stated margin of the last kill.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bson::{Document, doc};
use futures::TryStreamExt;
use mongodb::Client;

const RELAYHOST: &str = env!("CARGO_BIN_EXE_relayhost");
const SET: &str = "chaos";
/// The hosts' lease, and the server's transaction lifetime: a killed host's open transaction
/// holds its locks until the server aborts it.
const LEASE: Duration = Duration::from_secs(2);
const TRANSACTION_LIFETIME: Duration = Duration::from_secs(10);
/// What the drain may take beyond those after the last kill: the backlog the kills let pile
/// up, run by three hosts on two cores beside three `mongod`s.
const MARGIN: Duration = Duration::from_secs(45);
/// How long the kills go on.
const CHAOS: Duration = Duration::from_secs(60);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A small deterministic generator, so that a failing schedule can be run again.
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from))
    }
}

/// Writes a line to stderr as it happens, past libtest's capture (which takes only the
/// `print!` macros): CI shows the lines before a failure's report and may cut the report.
fn say(line: impl std::fmt::Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "chaos: {line}");
}

fn kill(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// One member of the replica set; its data survives its kills.
struct Member {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Member {
    fn start(&mut self) {
        let binary = relayhost::mongod::find_binary().unwrap();
        let child = Command::new(binary)
            .args(["--replSet", SET, "--bind_ip", "127.0.0.1", "--port", &self.port.to_string()])
            .arg("--dbpath")
            .arg(&self.dir)
            .arg("--logpath")
            .arg(self.dir.join("mongod.log"))
            .args(["--logappend", "--wiredTigerCacheSizeGB", "0.25", "--oplogSize", "128"])
            .args(["--wiredTigerEngineConfigString", relayhost::mongod::JOURNAL])
            .args(["--setParameter", "diagnosticDataCollectionEnabled=false"])
            .args(["--setParameter", &format!("transactionLifetimeLimitSeconds={}", TRANSACTION_LIFETIME.as_secs())])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// Starts it and waits until its port takes connections. Its first start may find the
    /// port taken since it was chosen (by a connection's local port, say): its `mongod` then
    /// exits saying so, and it starts again on another. Any other failure (a full disk, say)
    /// fails the test with the `mongod`'s errors. Restarts later keep the port the set knows.
    async fn start_listening(&mut self) {
        for _ in 0..3 {
            let log_from = std::fs::metadata(self.log()).map_or(0, |log| log.len() as usize);
            self.start();
            let deadline = Instant::now() + Duration::from_secs(30);
            let admin = self.direct().await.database("admin");
            while self.alive() {
                if admin.run_command(doc! { "ping": 1 }).await.is_ok() {
                    return;
                }
                if Instant::now() >= deadline {
                    kill(&mut self.child);
                    panic!("the member on port {} did not answer in 30 s:\n{}", self.port, self.errors(0));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let errors = self.errors(log_from);
            assert!(errors.contains("Address already in use"), "the member on port {} exited:\n{errors}", self.port);
            say(format!("the member's port {} was taken since it was chosen; another", self.port));
            self.port = relayhost::mongod::free_port().unwrap();
        }
        panic!("a member's port was taken three times over");
    }

    /// Whether its `mongod` runs.
    fn alive(&mut self) -> bool {
        self.child.as_mut().is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    fn log(&self) -> PathBuf {
        self.dir.join("mongod.log")
    }

    /// For a failure's message: the last errors its log has from byte `from` on (a `mongod`
    /// logs its shutdown after the error that caused it), each from its context on.
    fn errors(&self, from: usize) -> String {
        let log = std::fs::read(self.log()).unwrap_or_default();
        let log = String::from_utf8_lossy(log.get(from..).unwrap_or_default());
        let errors: Vec<&str> = log.lines().filter(|line| line.contains(r#""s":"E""#) || line.contains(r#""s":"F""#)).collect();
        let errors: Vec<String> = errors[errors.len().saturating_sub(3)..]
            .iter()
            .map(|line| line[line.find(r#""ctx""#).unwrap_or(0)..].chars().take(300).collect())
            .collect();
        if errors.is_empty() { "(no errors in its log)".to_string() } else { errors.join("\n") }
    }

    async fn direct(&self) -> Client {
        let uri = format!("mongodb://127.0.0.1:{}/?directConnection=true&serverSelectionTimeoutMS=2000", self.port);
        Client::with_uri_str(uri).await.unwrap()
    }

    async fn is_primary(&self) -> bool {
        match self.direct().await.database("admin").run_command(doc! { "hello": 1 }).await {
            Ok(hello) => hello.get_bool("isWritablePrimary").unwrap_or(false),
            Err(_) => false,
        }
    }
}

struct ReplicaSet {
    members: Vec<Member>,
}

impl ReplicaSet {
    async fn start(root: &Path) -> Self {
        let mut members: Vec<Member> = (0..3)
            .map(|n| {
                let dir = root.join(format!("member-{n}"));
                std::fs::create_dir_all(&dir).unwrap();
                Member { port: relayhost::mongod::free_port().unwrap(), dir, child: None }
            })
            .collect();
        for member in &mut members {
            member.start_listening().await;
        }
        let hosts: Vec<Document> = members
            .iter()
            .enumerate()
            .map(|(n, m)| doc! { "_id": n as i32, "host": format!("127.0.0.1:{}", m.port) })
            .collect();
        // Elections within seconds, so that a primary's death costs the test seconds.
        let config = doc! {
            "_id": SET,
            "members": hosts,
            "settings": { "electionTimeoutMillis": 2000, "heartbeatIntervalMillis": 500 },
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        let first = members[0].direct().await;
        while let Err(error) = first.database("admin").run_command(doc! { "replSetInitiate": config.clone() }).await {
            if Instant::now() >= deadline {
                let mut set = Self { members };
                panic!("replSetInitiate: {error}\n{}", set.members_state());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut set = Self { members };
        set.wait_for_primary().await;
        set
    }

    /// Whether each member runs, and how its log ends.
    fn members_state(&mut self) -> String {
        self.members
            .iter_mut()
            .map(|member| {
                let running = member.alive();
                format!("member on port {}, running: {running}; its last errors:\n{}", member.port, member.errors(0))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn uri(&self) -> String {
        let hosts: Vec<String> = self.members.iter().map(|m| format!("127.0.0.1:{}", m.port)).collect();
        format!("mongodb://{}/?replicaSet={SET}", hosts.join(","))
    }

    async fn primary(&self) -> Option<usize> {
        for (n, member) in self.members.iter().enumerate() {
            if member.child.is_some() && member.is_primary().await {
                return Some(n);
            }
        }
        None
    }

    async fn wait_for_primary(&mut self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(primary) = self.primary().await {
                return primary;
            }
            if Instant::now() >= deadline {
                panic!("no primary was elected\n{}", self.members_state());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for ReplicaSet {
    fn drop(&mut self) {
        for member in &mut self.members {
            kill(&mut member.child);
        }
    }
}

/// The hosts, each restarted under its own name with its log appended.
struct Hosts {
    config: PathBuf,
    dir: PathBuf,
    children: Vec<Option<Child>>,
}

impl Hosts {
    fn start(&mut self, n: usize) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join(format!("host-{n}.log"))).unwrap();
        let child = Command::new(RELAYHOST)
            .args(["run", "--config"])
            .arg(&self.config)
            .env("RUST_LOG", "info")
            // The seed replays a schedule; relayhost refuses `RELAYHOST_*` it does not know.
            .env_remove(SEED)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.children[n] = Some(child);
    }

    fn kill(&mut self, n: usize) {
        kill(&mut self.children[n]);
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for child in &mut self.children {
            kill(child);
        }
        if std::thread::panicking() {
            say(format!("the hosts' and members' logs are kept in {}", self.dir.display()));
        }
    }
}

async fn all(collection: &mongodb::Collection<Document>, filter: Document) -> Vec<Document> {
    collection.find(filter).await.unwrap().try_collect().await.unwrap()
}

/// What a key's events (`ids`, in sequence order) say of their fan-out and handling, one line
/// each: for the next engineer when a key was handled out of order (the members' data is kept,
/// but reading it needs a standalone `mongod` recovering from the oplog).
async fn key_history(db: &mongodb::Database, ids: &[String]) -> String {
    let events = all(&db.collection("relayhost_events"), doc! { "_id": { "$in": ids } }).await;
    let audits = all(&db.collection("audit_log"), doc! { "_id": { "$in": ids } }).await;
    let mut lines = Vec::new();
    for id in ids {
        let event = events.iter().find(|e| e.get_str("_id") == Ok(id.as_str()));
        let audit = audits.iter().find(|a| a.get_str("_id") == Ok(id.as_str()));
        let field = |name: &str| event.and_then(|e| e.get(name)).map_or("-".to_string(), |v| v.to_string());
        let attempt = audit.and_then(|a| a.get("attempt")).map_or("-".to_string(), |v| v.to_string());
        lines.push(format!(
            "{id}: sequence {}, createdAt {}, fannedOutAt {}, fanOut {}, handedOut {}, audited at attempt {attempt}",
            field("sequence"),
            field("createdAt"),
            field("fannedOutAt"),
            field("fanOut"),
            field("handedOut"),
        ));
    }
    lines.join("\n")
}

/// Set to a seed an earlier run printed, replays its schedule of kills.
const SEED: &str = "RELAYHOST_CHAOS_SEED";

/// Nothing is left to deliver: every committed order's event is audited, nothing is
/// unfanned, pending or dead. `Err` says what is left.
async fn drained(db: &mongodb::Database) -> Result<(), String> {
    let count = async |collection: &str, filter: Document| {
        db.collection::<Document>(collection).count_documents(filter).await.map_err(|error| error.to_string())
    };
    let unfanned = count("relayhost_events", doc! { "fannedOutAt": null }).await?;
    let deliveries = count("relayhost_deliveries", doc! {}).await?;
    let handed_out = count("relayhost_events", doc! { "handedOut.0": { "$exists": true } }).await?;
    let orders = count("relayhost_events", doc! { "type": "order.placed" }).await?;
    let audited = count("audit_log", doc! {}).await?;
    match (unfanned, deliveries, handed_out) {
        (0, 0, 0) if audited == orders => Ok(()),
        _ => {
            let left: Vec<Document> = db
                .collection::<Document>("relayhost_deliveries")
                .find(doc! {})
                .limit(5)
                .await
                .map_err(|error| error.to_string())?
                .try_collect()
                .await
                .map_err(|error| error.to_string())?;
            Err(format!(
                "unfanned {unfanned}, delivery documents {deliveries}, handed out {handed_out}, audited {audited} of \
                 {orders}; documents: {left:?}"
            ))
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_and_the_primary_killed_over_and_over_lose_nothing_duplicate_nothing_and_keep_every_keys_order() {
    let seed: u64 = std::env::var(SEED).ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    say(format!("chaos seed {seed} ({SEED}={seed} runs this schedule again)"));
    // A failure's message, where CI shows it: before the test's report.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        say(info);
        report(info);
    }));
    let mut dice = Dice(seed);
    let dir = std::env::temp_dir().join(format!("relayhost-chaos-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("plugins")).unwrap();
    std::fs::copy(common::plugins_dir().join("audit_log.wasm"), dir.join("plugins/audit_log.wasm")).unwrap();
    let mut set = ReplicaSet::start(&dir).await;
    let uri = set.uri();
    say(format!("{uri} elected a primary"));

    // Without completion history: what fan-outs hand out runs without a delivery document,
    // the riskiest way a delivery can take.
    let config = dir.join("relayhost.toml");
    let text = format!(
        "[mongodb]\nuri = {uri:?}\ndatabase = \"chaos\"\n\n[plugins]\ndirectory = {plugins:?}\n\n\
         [host]\nartifact_cache = {artifacts:?}\ncompletion_history = false\nconcurrency = 8\n\
         lease = \"{lease}s\"\npoll_interval = \"200ms\"\n\n[defaults]\nwall_time = \"5s\"\n\n\
         [plugin.audit_log]\ngrants = {{ collections = [\"audit_log\", \"audit_order\"] }}\n",
        plugins = dir.join("plugins"),
        artifacts = repo_root().join("target/relayhost-test-artifacts"),
        lease = LEASE.as_secs(),
    );
    std::fs::write(&config, text).unwrap();
    let mut hosts = Hosts { config, dir: dir.clone(), children: vec![None, None, None] };
    for n in 0..3 {
        hosts.start(n);
    }

    let python_path = Command::new(repo_root().join("scripts/ensure-python-deps.sh")).output().unwrap();
    assert!(python_path.status.success());
    let deps = String::from_utf8(python_path.stdout).unwrap().trim().to_string();
    let readme = repo_root().join("examples/publishers/python");
    let stop_file = dir.join("stop-publishing");
    let mut publisher = Command::new("python3")
        .arg(repo_root().join("host/tests/chaos/publisher.py"))
        .args([uri.as_str(), "chaos"])
        .arg(&stop_file)
        .arg("3")
        .env("PYTHONPATH", format!("{deps}:{}", readme.display()))
        .stderr(std::fs::File::create(dir.join("publisher.log")).unwrap())
        .spawn()
        .unwrap();

    // The kills: one host, or two at once, every 2-5 s; the primary killed once and
    // restarted, and stepped down once later.
    let started = Instant::now();
    let mut round = 0;
    let mut last_kill = Instant::now();
    while started.elapsed() < CHAOS {
        tokio::time::sleep(dice.millis(2_000, 5_000)).await;
        round += 1;
        match round {
            4 => {
                let primary = set.wait_for_primary().await;
                say(format!("{:?}: killing the primary, member {primary}", started.elapsed()));
                kill(&mut set.members[primary].child);
                tokio::time::sleep(dice.millis(2_000, 4_000)).await;
                set.members[primary].start();
            }
            9 => {
                let primary = set.wait_for_primary().await;
                say(format!("{:?}: stepping the primary, member {primary}, down", started.elapsed()));
                let admin = set.members[primary].direct().await;
                let _ = admin.database("admin").run_command(doc! { "replSetStepDown": 10, "secondaryCatchUpPeriodSecs": 5 }).await;
            }
            _ => {
                let two = round % 3 == 0;
                let first = dice.below(3) as usize;
                let victims = if two { vec![first, (first + 1 + dice.below(2) as usize) % 3] } else { vec![first] };
                say(format!("{:?}: SIGKILL host(s) {victims:?}", started.elapsed()));
                for &n in &victims {
                    hosts.kill(n);
                }
                last_kill = Instant::now();
                tokio::time::sleep(dice.millis(300, 1_500)).await;
                for &n in &victims {
                    hosts.start(n);
                }
            }
        }
    }
    std::fs::write(&stop_file, b"").unwrap();
    let status = publisher.wait().unwrap();
    assert!(status.success(), "the publisher failed: see {}", dir.join("publisher.log").display());

    let client = Client::with_uri_str(&uri).await.unwrap();
    let db = client.database("chaos");
    let deadline = last_kill + LEASE + TRANSACTION_LIFETIME + MARGIN;
    loop {
        let left = drained(&db).await;
        if left.is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "not drained within lease + transaction lifetime + {MARGIN:?} of the last kill: {left:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    say(format!("drained {:?} after the last kill", last_kill.elapsed()));

    // Exactly the committed events, each once: the orders committed are those whose event
    // exists (their transaction wrote both), and aborted ones left neither.
    let events = all(&db.collection("relayhost_events"), doc! { "type": "order.placed" }).await;
    assert!(events.len() > 500, "the publisher committed {} events", events.len());
    let committed: BTreeSet<String> = events.iter().map(|e| e.get_str("_id").unwrap().to_string()).collect();
    let orders: BTreeSet<String> =
        all(&db.collection("orders"), doc! {}).await.iter().map(|o| format!("order-placed-{}", o.get_str("_id").unwrap())).collect();
    assert_eq!(orders, committed, "business data and events committed together");
    let audited: Vec<String> = all(&db.collection("audit_log"), doc! {}).await.iter().map(|a| a.get_str("_id").unwrap().to_string()).collect();
    assert_eq!(audited.len(), committed.len(), "no duplicate");
    assert_eq!(audited.into_iter().collect::<BTreeSet<_>>(), committed, "no loss, no phantom");

    // Each key's events were handled one at a time, in sequence (commit) order.
    let mut by_key: BTreeMap<String, Vec<(i64, String)>> = BTreeMap::new();
    for event in &events {
        if let Ok(key) = event.get_str("key") {
            let sequence = event.get_i64("sequence").or_else(|_| event.get_i32("sequence").map(i64::from)).unwrap();
            by_key.entry(key.to_string()).or_default().push((sequence, event.get_str("_id").unwrap().to_string()));
        }
    }
    assert!(by_key.len() > 5);
    let handled = common::deployment::handling_order(&all(&db.collection("audit_order"), doc! {}).await);
    for (key, mut sequence) in by_key {
        sequence.sort();
        let expected: Vec<String> = sequence.into_iter().map(|(_, id)| id).collect();
        if handled.get(&key) != Some(&expected) {
            say(format!("key {key}, each event as stored and audited:\n{}", key_history(&db, &expected).await));
        }
        assert_eq!(handled.get(&key), Some(&expected), "key {key} was handled in sequence");
    }
    let dead = db.collection::<Document>("relayhost_deliveries").count_documents(doc! { "status": "dead" }).await.unwrap();
    assert_eq!(dead, 0);
    say(format!("{} events, {} rounds of kills", committed.len(), round));
    // Passed: the members' data (about 900 MB) goes; a failure keeps it (see `Hosts`).
    drop(hosts);
    drop(set);
    std::fs::remove_dir_all(&dir).unwrap();
}
