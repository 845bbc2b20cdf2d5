//! Fixtures for the store contract suite: the same test functions run against a
//! [`MemoryStore`] and a [`MongoStore`] on a real replica set started from the pinned wheel.

#![allow(dead_code, unused_imports, unused_macros, async_fn_in_trait)]

/// Each named `async fn name<F: Fixture>()` as two tests, `memory::name` and `mongo::name`:
/// one behaviour, both stores (the store contract's way).
macro_rules! both_stores {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name::<super::MemoryFixture>().await
                }
            )*
        }
        mod mongo {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name::<super::MongoFixture>().await
                }
            )*
        }
    };
}

pub mod deployment;
pub mod receiver;

use relayhost::store::{Administration, Outbox};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bson::{DateTime, Document, doc};
use mongodb::Client;
use relayhost::event::NewEvent;
use relayhost::store::memory::MemoryStore;
use relayhost::store::mongo::{MongoLocation, MongoStore};
use relayhost::store::{
    ClaimedDelivery, DeliveryFilter, DeliveryStatus, DeliveryView, Published, Store, StoreError, StoreOptions,
    Subscription, Subscriptions, run_in_transaction,
};

/// A store under test, plus what the suite needs to reach around it (raw documents, more
/// workers on the same data).
pub trait Fixture: Sized + Send + Sync + 'static {
    type S: Store;
    fn name() -> &'static str;
    async fn with_options(options: StoreOptions) -> Self;
    fn store(&self) -> &Self::S;
    /// Another worker on the same data.
    fn worker(&self, owner: &str) -> Self::S;
    /// Inserts an event document exactly as given, as another driver would.
    async fn insert_raw_event(&self, document: Document);
    async fn raw_event(&self, id: &str) -> Option<Document>;

    async fn new() -> Self {
        Self::with_options(options()).await
    }
}

pub fn options() -> StoreOptions {
    StoreOptions { owner: "test-worker".into(), lease_duration: Duration::from_secs(30), ..StoreOptions::default() }
}

pub struct MemoryFixture(MemoryStore);

impl Fixture for MemoryFixture {
    type S = MemoryStore;
    fn name() -> &'static str {
        "memory"
    }
    async fn with_options(options: StoreOptions) -> Self {
        Self(MemoryStore::new(options))
    }
    fn store(&self) -> &MemoryStore {
        &self.0
    }
    fn worker(&self, owner: &str) -> MemoryStore {
        self.0.instance(owner)
    }
    async fn insert_raw_event(&self, document: Document) {
        self.0.insert_event_document(document).await.unwrap();
    }
    async fn raw_event(&self, id: &str) -> Option<Document> {
        self.0.event_document(id).await
    }
}

pub struct MongoFixture {
    pub store: MongoStore,
    pub client: Client,
    pub database: String,
}

static DATABASES: AtomicUsize = AtomicUsize::new(0);

/// A client of the process-wide test replica set (started on first use; never skipped).
pub async fn mongo_client() -> Client {
    let uri = relayhost::mongod::process_server().unwrap_or_else(|error| panic!("starting the test mongod: {error}"));
    Client::with_uri_str(uri).await.expect("client of the test mongod")
}

/// A fresh database name for one test.
pub fn fresh_database() -> String {
    format!("t{}_{}", std::process::id(), DATABASES.fetch_add(1, Ordering::SeqCst))
}

impl Fixture for MongoFixture {
    type S = MongoStore;
    fn name() -> &'static str {
        "mongo"
    }
    async fn with_options(options: StoreOptions) -> Self {
        let client = mongo_client().await;
        let database = fresh_database();
        let store = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(&database).unwrap(), options);
        store.setup().await.expect("setup");
        Self { store, client, database }
    }
    fn store(&self) -> &MongoStore {
        &self.store
    }
    fn worker(&self, owner: &str) -> MongoStore {
        self.store.instance(owner)
    }
    async fn insert_raw_event(&self, document: Document) {
        self.store.events_collection().insert_one(document).await.unwrap();
    }
    async fn raw_event(&self, id: &str) -> Option<Document> {
        self.store.events_collection().find_one(doc! { "_id": id }).await.unwrap()
    }
}

// ---- plugins ----

/// The components of `plugins/`, built once per test process by the project's own script.
pub fn plugins_dir() -> &'static std::path::Path {
    use std::path::{Path, PathBuf};
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/build-plugins.sh");
        let output = std::process::Command::new(script).output().expect("run scripts/build-plugins.sh");
        assert!(output.status.success(), "building the plugins failed:\n{}", String::from_utf8_lossy(&output.stderr));
        PathBuf::from(String::from_utf8(output.stdout).unwrap().trim())
    })
}

/// A plugin runtime whose compiled artifacts are shared by the tests (and kept across runs),
/// like a host's artifact cache across restarts.
pub fn plugin_runtime() -> relayhost::plugin::PluginRuntime {
    let cache = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/relayhost-test-artifacts");
    relayhost::plugin::PluginRuntime::new(Some(cache)).unwrap()
}

// ---- small helpers shared by the suites ----

pub fn subs(pairs: &[(&str, &[&str])]) -> Subscriptions {
    Subscriptions::new(pairs.iter().map(|(handler, types)| Subscription::new(*handler, types.iter().copied()))).unwrap()
}

pub fn handlers(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| n.to_string()).collect()
}

pub fn at(ms: i64) -> DateTime {
    DateTime::from_millis(ms)
}

/// A fixed "now" far from the real clock, so lease arithmetic is exact.
pub const T0: i64 = 1_900_000_000_000;

pub async fn publish<S: Store>(store: &S, event: NewEvent) -> Result<Published, StoreError> {
    run_in_transaction(store, async |tx| store.publish(tx, &event).await).await
}

pub async fn publish_all<S: Store>(store: &S, events: Vec<NewEvent>) {
    run_in_transaction(store, async |tx| {
        for event in &events {
            store.publish(tx, event).await?;
        }
        Ok(())
    })
    .await
    .unwrap();
}

pub fn event(id: &str, event_type: &str) -> NewEvent {
    NewEvent::new(id, event_type, doc! { "n": id })
}

pub fn keyed(id: &str, event_type: &str, key: &str) -> NewEvent {
    event(id, event_type).with_key(key)
}

pub async fn fan_out_all<S: Store>(store: &S, subscriptions: &Subscriptions, now: DateTime) -> usize {
    let mut total = 0;
    loop {
        let report = store.fan_out(subscriptions, 100, 0, now).await.unwrap();
        total += report.deliveries;
        if report.events == 0 {
            return total;
        }
    }
}

pub async fn list_all<S: Store>(store: &S, mut filter: DeliveryFilter) -> Vec<DeliveryView> {
    let mut all = Vec::new();
    loop {
        let page = store.list_deliveries(&filter).await.unwrap();
        all.extend(page.deliveries);
        match page.next {
            Some(next) => filter.after = Some(next),
            None => return all,
        }
    }
}

pub async fn dead<S: Store>(store: &S) -> Vec<DeliveryView> {
    list_all(store, DeliveryFilter { status: Some(DeliveryStatus::Dead), ..Default::default() }).await
}

pub fn ids(claimed: &[ClaimedDelivery]) -> Vec<String> {
    let mut ids: Vec<String> = claimed.iter().map(|c| format!("{}/{}", c.event.id, c.handler)).collect();
    ids.sort();
    ids
}

/// Two ordering keys whose lanes differ.
pub fn keys_in_two_lanes() -> (String, String) {
    let first = "ka".to_string();
    let second = (0..)
        .map(|n| format!("kb-{n}"))
        .find(|key| relayhost::lane::lane_of(key) != relayhost::lane::lane_of(&first))
        .expect("some key lies in another lane");
    (first, second)
}

/// An unkeyed event id whose lane is `lane`.
pub fn id_in_lane(prefix: &str, lane: u8) -> String {
    (0..).map(|n| format!("{prefix}-{n}")).find(|id| relayhost::lane::lane_of(id) == lane).unwrap()
}

/// Has `store` hold `lanes` (with known lists, nothing running): one event in each, handed out
/// by a fan-out and completed.
pub async fn hold_lanes<S: Store>(store: &S, subscriptions: &relayhost::store::Subscriptions, prefix: &str, lanes: &[u8]) {
    let ids: Vec<String> = lanes.iter().map(|lane| id_in_lane(prefix, *lane)).collect();
    publish_all(store, ids.iter().map(|id| event(id, "t")).collect()).await;
    let report = store.fan_out(subscriptions, 100, 10, at(T0)).await.unwrap();
    assert_eq!(report.claimed.len(), lanes.len());
    let leases: Vec<_> = report.claimed.iter().map(|c| c.lease).collect();
    assert!(store.complete_many(&leases, at(T0)).await.unwrap().iter().all(|s| *s == relayhost::store::Settlement::Completed));
}
