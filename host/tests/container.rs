//! The container image as users run it: built from the repository's `Dockerfile` with podman
//! (`scripts/container-image`, on base images made here from Debian's packages), run as its
//! non-root user with a named volume at `/data` and a plugins directory of this machine
//! mounted at `/plugins`; a pymongo publisher on this machine commits orders into the embedded
//! MongoDB through a published port; a plugin file copied into the mounted directory is
//! hot-swapped in; `podman stop` ends it gracefully with deliveries in flight; a new container
//! on the same volume has every event and delivery and finishes the cut-off ones as their first
//! charged attempt; the image's own health check reports healthy.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bson::{Document, doc};
use common::deployment::{repo_root, stdout, try_http_get};
use common::plugins_dir;
use common::receiver::Receiver;
use futures::TryStreamExt;

/// `podman` with this machine's limits (`scripts/podman`).
fn podman(args: &[&str]) -> Output {
    Command::new(repo_root().join("scripts/podman")).args(args).output().unwrap()
}

fn podman_ok(args: &[&str]) -> String {
    let output = podman(args);
    assert!(output.status.success(), "podman {args:?} failed: {}{}", stdout(&output), String::from_utf8_lossy(&output.stderr));
    stdout(&output).trim().to_string()
}

/// Containers and the volume of one test, removed however it ends.
struct Cleanup {
    containers: Vec<String>,
    volume: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for container in &self.containers {
            podman(&["rm", "--force", "--time", "0", container]);
        }
        podman(&["volume", "rm", "--force", &self.volume]);
    }
}

/// One `podman run` of the image as a user would start it.
struct Run<'a> {
    image: &'a str,
    volume: &'a str,
    plugins: &'a Path,
    config: &'a Path,
    webhook_url: &'a str,
    health: u16,
    mongodb: u16,
}

impl Run<'_> {
    fn start(&self, name: &str) {
        let volume = format!("{}:/data", self.volume);
        let plugins = format!("{}:/plugins:ro", self.plugins.display());
        let config = format!("{}:/etc/relayhost/relayhost.toml:ro", self.config.display());
        let (health, mongodb) = (format!("127.0.0.1:{}:8080", self.health), format!("127.0.0.1:{}:27017", self.mongodb));
        let webhook = format!("WEBHOOK_URL={}", self.webhook_url);
        podman_ok(&[
            "run",
            "--detach",
            "--name",
            name,
            "--publish",
            &health,
            "--publish",
            &mongodb,
            "--volume",
            &volume,
            "--volume",
            &plugins,
            "--volume",
            &config,
            "--env",
            "RELAYHOST_HOST_SHUTDOWN_TIMEOUT=2s",
            "--env",
            "RELAYHOST_HOST_COMPLETION_HISTORY=true",
            "--env",
            &webhook,
            self.image,
        ]);
        let deadline = Instant::now() + Duration::from_secs(180);
        let address = ([127, 0, 0, 1], self.health).into();
        while !matches!(try_http_get(address, "/readyz"), Ok((200, _))) {
            assert!(Instant::now() < deadline, "{name} never turned ready:\n{}", logs(name));
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

fn logs(name: &str) -> String {
    let output = podman(&["logs", name]);
    format!("{}{}", stdout(&output), String::from_utf8_lossy(&output.stderr))
}

/// The image's name, built (incrementally) by the repository's script.
fn image() -> String {
    let output = Command::new(repo_root().join("scripts/container-image")).output().unwrap();
    assert!(output.status.success(), "the image did not build:\n{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// A directory the container's user can read, holding copies of the named plugins.
fn plugins_directory(root: &Path, plugins: &[&str]) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = root.join("plugins");
    std::fs::create_dir_all(&dir).unwrap();
    for path in [root, dir.as_path()] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    for plugin in plugins {
        copy_plugin(&dir, plugin);
    }
    dir
}

/// Copies a plugin into `dir` as `cp` would, readable by everyone.
fn copy_plugin(dir: &Path, plugin: &str) {
    use std::os::unix::fs::PermissionsExt;
    let target = dir.join(format!("{plugin}.wasm"));
    std::fs::copy(plugins_dir().join(format!("{plugin}.wasm")), &target).unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).unwrap();
}

/// Commits `count` orders with the pymongo publisher (the odd ones abort) and returns the ids
/// of the committed ones' events.
fn publish(uri: &str, count: usize, prefix: &str) -> Vec<String> {
    let python_path = Command::new(repo_root().join("scripts/ensure-python-deps.sh")).output().unwrap();
    assert!(python_path.status.success(), "{}", stdout(&python_path));
    let run = Command::new("python3")
        .arg(repo_root().join("examples/publishers/python/publish.py"))
        .args([uri, "relayhost", &count.to_string(), "--abort-odd", &format!("--id-prefix={prefix}")])
        .env("PYTHONPATH", stdout(&python_path).trim())
        .output()
        .unwrap();
    assert!(run.status.success(), "{}{}", stdout(&run), String::from_utf8_lossy(&run.stderr));
    (0..count).step_by(2).map(|n| format!("order-placed-{prefix}o-{n}")).collect()
}

async fn documents(database: &mongodb::Database, collection: &str, filter: Document) -> Vec<Document> {
    database.collection::<Document>(collection).find(filter).await.unwrap().try_collect().await.unwrap()
}

async fn ids(database: &mongodb::Database, collection: &str, field: &str, filter: Document) -> Vec<String> {
    let mut ids: Vec<String> =
        documents(database, collection, filter).await.iter().map(|d| d.get_str(field).unwrap().to_string()).collect();
    ids.sort();
    ids
}

async fn wait_for(what: &str, name: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}:\n{}", logs(name));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_runs_as_users_run_it() {
    let image = image();
    let unique = format!("relayhost-test-{}-{}", std::process::id(), bson::oid::ObjectId::new());
    let (first, second) = (format!("{unique}-first"), format!("{unique}-second"));
    let volume = format!("{unique}-data");
    let _cleanup = Cleanup { containers: vec![first.clone(), second.clone()], volume: volume.clone() };
    podman_ok(&["volume", "create", &volume]);

    // The image's own configuration, and the webhook plugin's grant to reach this machine.
    let receiver = Receiver::start_on(std::net::Ipv4Addr::UNSPECIFIED);
    let webhook_host = format!("host.containers.internal:{}", receiver.address.port());
    let root = std::env::temp_dir().join(&unique);
    let plugins = plugins_directory(&root, &["audit_log"]);
    let config = root.join("relayhost.toml");
    let image_config = std::fs::read_to_string(repo_root().join("examples/docker/relayhost.toml")).unwrap();
    let webhook_grant = format!(
        "\n[plugin.webhook]\nwall_time = \"60s\"\ngrants = {{ environment = [\"WEBHOOK_URL\"], http_hosts = [\"{webhook_host}\"], private_networks = true }}\n"
    );
    std::fs::write(&config, image_config + &webhook_grant).unwrap();
    let (health, mongodb) = (relayhost::mongod::free_port().unwrap(), relayhost::mongod::free_port().unwrap());
    let webhook_url = format!("http://{webhook_host}/hooks");
    let run = Run { image: &image, volume: &volume, plugins: &plugins, config: &config, webhook_url: &webhook_url, health, mongodb };

    // Non-root, ready, and a publisher on this machine reaches the embedded MongoDB.
    run.start(&first);
    let status = podman_ok(&["exec", &first, "cat", "/proc/1/status"]);
    let uid = status.lines().find_map(|line| line.strip_prefix("Uid:")).unwrap().split_whitespace().next().unwrap().to_string();
    assert_eq!(uid, "10001", "relayhost runs as the image's user");
    let uri = format!("mongodb://127.0.0.1:{mongodb}/?directConnection=true");
    let database = mongodb::Client::with_uri_str(&uri).await.unwrap().database("relayhost");
    let before = publish(&uri, 8, "before-");
    wait_for("the audit log has the first orders", &first, async || ids(&database, "audit_log", "_id", doc! {}).await == before).await;

    // A new plugin file in the mounted directory is loaded without a restart.
    copy_plugin(&plugins, "webhook");
    wait_for("the webhook plugin is loaded", &first, async || logs(&first).contains("\"plugin\":\"webhook\"")).await;
    let during = publish(&uri, 8, "during-");
    // Three calls are held open (the fourth order's key waits behind the first's).
    wait_for("the webhook is called three times", &first, async || receiver.bodies().len() == 3).await;
    // And nothing else runs at the stop, so that exactly those three are handed back: the
    // audit log has every order (a transactional handler: its write commits its completion).
    let mut everything: Vec<String> = before.iter().chain(&during).cloned().collect();
    everything.sort();
    wait_for("the audit log has every order", &first, async || ids(&database, "audit_log", "_id", doc! {}).await == everything).await;

    // A graceful stop within the grace period, exit 0.
    let stopping = Instant::now();
    podman_ok(&["stop", "--time", "30", &first]);
    assert!(stopping.elapsed() < Duration::from_secs(30), "stopped by the signal, not the grace period's kill");
    assert_eq!(podman_ok(&["inspect", &first, "--format", "{{.State.ExitCode}}"]), "0", "{}", logs(&first));
    let log = logs(&first);
    let stopped = log
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find(|line| line["message"] == "relayhost stopped")
        .unwrap_or_else(|| panic!("no \"relayhost stopped\" line:\n{log}"));
    let counts = (&stopped["released"], &stopped["retried"], &stopped["dead"]);
    assert_eq!(counts, (&3.into(), &0.into(), &0.into()), "the three cut-off calls were handed back: {stopped}");

    // A new container on the same volume has every event and delivery, and runs the cut-off
    // calls as their first charged attempt.
    receiver.hold.store(false, Ordering::SeqCst);
    run.start(&second);
    assert_eq!(ids(&database, "relayhost_events", "_id", doc! { "type": "order.placed" }).await, everything);
    wait_for("every delivery completed", &second, async || {
        documents(&database, "relayhost_completed_deliveries", doc! {}).await.len() == everything.len() + during.len()
    })
    .await;
    assert_eq!(ids(&database, "audit_log", "_id", doc! {}).await, everything);
    assert_eq!(ids(&database, "relayhost_completed_deliveries", "eventId", doc! { "handler": "webhook" }).await, during);
    for record in documents(&database, "relayhost_completed_deliveries", doc! {}).await {
        assert_eq!(record.get("attempts").and_then(common::deployment::integer), Some(1), "nothing was charged twice: {record}");
    }
    let bodies = receiver.bodies();
    assert_eq!(bodies.len(), 7, "three cut off, then four delivered: {bodies:?}");
    assert!(bodies.iter().all(|body| body["attempt"] == 1), "{bodies:?}");

    // The image's health check.
    podman_ok(&["healthcheck", "run", &second]);
    assert_eq!(podman_ok(&["inspect", &second, "--format", "{{.State.Health.Status}}"]), "healthy");
    podman_ok(&["stop", "--time", "30", &second]);
    assert_eq!(podman_ok(&["inspect", &second, "--format", "{{.State.ExitCode}}"]), "0", "{}", logs(&second));
    let _ = std::fs::remove_dir_all(&root);
}
