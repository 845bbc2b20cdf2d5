//! What only the MongoDB store has: server checks, the Rust publisher on a driver session,
//! publishers in other languages, command counts and write concerns, and large backlogs on a
//! real replica set.

#![allow(async_fn_in_trait)]

mod common;

use relayhost::store::{Administration, Hosts, Outbox};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{Document, doc};
use futures::TryStreamExt;
use common::*;
use mongodb::Client;
use mongodb::event::EventHandler;
use mongodb::event::command::CommandEvent;
use mongodb::options::ClientOptions;
use relayhost::publish::Publisher;
use relayhost::store::mongo::{EventWakeups, MongoLocation, MongoStore};
use relayhost::store::{
    ClaimedDelivery, DeliveryFilter, FanOutReport, PurgeOptions, Published, Settlement, StoreError, StoreOptions, StoreTransaction, Subscriptions,
};

fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[tokio::test]
async fn a_standalone_server_is_refused_with_what_to_run_instead() {
    let binary = relayhost::mongod::find_binary().unwrap();
    let port = relayhost::mongod::free_port().unwrap();
    let dir = std::env::temp_dir().join(format!("relayhost-standalone-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let child = Command::new(binary)
        .args(["--port", &port.to_string(), "--bind_ip", "127.0.0.1", "--dbpath"])
        .arg(&dir)
        .arg("--logpath")
        .arg(dir.join("log"))
        .spawn()
        .unwrap();
    struct Kill(std::process::Child, std::path::PathBuf);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
            let _ = std::fs::remove_dir_all(&self.1);
        }
    }
    let _guard = Kill(child, dir.clone());
    let uri = format!("mongodb://127.0.0.1:{port}/?directConnection=true&serverSelectionTimeoutMS=20000");
    let client = Client::with_uri_str(&uri).await.unwrap();
    let store = MongoStore::new(client, MongoLocation::with_default_prefix("standalone").unwrap(), StoreOptions::default());
    let error = store.setup().await.unwrap_err();
    assert!(matches!(error, StoreError::NeedsReplicaSet(_)), "{error}");
    let message = error.to_string();
    assert!(message.contains("mongod --replSet rs0") && message.contains("rs.initiate()"), "{message}");
}

#[tokio::test]
async fn bad_database_and_prefix_names_are_refused() {
    assert!(MongoLocation::new("shop", "relayhost_").is_ok());
    for (database, prefix) in [("", "p_"), ("a.b", "p_"), ("x".repeat(64).as_str(), "p_"), ("shop", "a$b"), ("shop", "system.")] {
        let error = MongoLocation::new(database, prefix).unwrap_err();
        assert!(matches!(error, StoreError::InvalidArgument(_)), "{database:?} {prefix:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_publisher_needs_a_started_transaction_and_commits_with_the_data() {
    let fixture = MongoFixture::new().await;
    let database = fixture.client.database(&fixture.database);
    let publisher = Publisher::new(&database, "relayhost_");
    let mut session = fixture.client.start_session().await.unwrap();

    let error = publisher.publish(&mut session, &event("e-0", "t")).await.unwrap_err();
    assert!(matches!(error, StoreError::NoTransaction), "{error}");
    assert!(error.to_string().contains("start_transaction"));
    assert!(fixture.raw_event("e-0").await.is_none());

    session.start_transaction().await.unwrap();
    database.collection::<Document>("orders").insert_one(doc! { "_id": "o-1" }).session(&mut session).await.unwrap();
    assert_eq!(
        publisher.publish(&mut session, &keyed("e-1", "order.placed", "o-1")).await.unwrap(),
        Published::New { sequence: Some(1) }
    );
    session.abort_transaction().await.unwrap();
    assert!(fixture.raw_event("e-1").await.is_none());

    session.start_transaction().await.unwrap();
    database.collection::<Document>("orders").insert_one(doc! { "_id": "o-1" }).session(&mut session).await.unwrap();
    publisher.publish(&mut session, &keyed("e-1", "order.placed", "o-1")).await.unwrap();
    session.commit_transaction().await.unwrap();
    assert_eq!(fixture.raw_event("e-1").await.unwrap().get_i64("sequence").unwrap(), 1);
}

/// Runs a publisher program (8 orders, the odd ones aborted) against a fresh database and
/// checks that exactly the committed orders' events are delivered, keyed and in sequence.
async fn committed_orders_are_delivered(program: &str, script: &std::path::Path, env: (&str, String)) {
    let fixture = MongoFixture::new().await;
    let uri = relayhost::mongod::process_server().unwrap();
    let run = Command::new(program)
        .arg(script)
        .args([uri, &fixture.database, "8", "--abort-odd"])
        .env(env.0, env.1)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));

    let store = fixture.store();
    let subscriptions = subs(&[("projector", &["order.placed"])]);
    fan_out_all(store, &subscriptions, bson::DateTime::now()).await;
    let mut delivered = Vec::new();
    for _ in 0..10 {
        let claimed = store.claim(&handlers(&["projector"]), 10, bson::DateTime::now()).await.unwrap();
        for c in &claimed {
            delivered.push((c.event.id.clone(), c.event.key.clone().unwrap(), c.event.sequence.unwrap()));
            assert_eq!(c.event.payload.get_str("orderId").unwrap(), c.event.id.trim_start_matches("order-placed-"));
        }
        let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
        store.complete_many(&leases, bson::DateTime::now()).await.unwrap();
    }
    delivered.sort();
    // Orders 1, 3, 5, 7 were aborted: neither the order nor its event exists.
    let expected: Vec<(String, String, i64)> = [(0, 1), (2, 1), (4, 1), (6, 2)]
        .iter()
        .map(|(n, sequence)| (format!("order-placed-o-{n}"), format!("customer-{}", n % 3), *sequence))
        .collect();
    assert_eq!(delivered, expected, "{program}");
    let orders = fixture.client.database(&fixture.database).collection::<Document>("orders");
    assert_eq!(orders.count_documents(doc! {}).await.unwrap(), 4);
}

/// The README shows exactly the publish function of the example that a test runs.
fn assert_readme_shows(example: &str, separator: &str) {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let code = std::fs::read_to_string(repo_root().join(example)).unwrap();
    let function = code.split(separator).next().unwrap();
    let function = function.split_once("\n\n").map_or(function, |(_, rest)| rest);
    assert!(readme.contains(function.trim()), "README.md must show the publish function of {example}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pymongo_publishers_are_delivered_and_aborted_transactions_are_not() {
    assert_readme_shows("examples/publishers/python/publish.py", "\n\n\ndef place_order");
    let python_path = Command::new(repo_root().join("scripts/ensure-python-deps.sh")).output().unwrap();
    assert!(python_path.status.success(), "{}", String::from_utf8_lossy(&python_path.stderr));
    let path = String::from_utf8(python_path.stdout).unwrap().trim().to_string();
    committed_orders_are_delivered("python3", &repo_root().join("examples/publishers/python/publish.py"), ("PYTHONPATH", path)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_publishers_are_delivered_and_aborted_transactions_are_not() {
    assert_readme_shows("examples/publishers/node/publish.mjs", "\n\nasync function placeOrder");
    let script = Command::new(repo_root().join("scripts/ensure-node-deps.sh")).output().unwrap();
    assert!(script.status.success(), "{}", String::from_utf8_lossy(&script.stderr));
    let script = std::path::PathBuf::from(String::from_utf8(script.stdout).unwrap().trim());
    committed_orders_are_delivered("node", &script, ("NODE_NO_WARNINGS", "1".into())).await;
}

/// A client that records every command it sends.
async fn recording_client() -> (Client, Arc<Mutex<Vec<(String, Document)>>>) {
    let uri = relayhost::mongod::process_server().unwrap();
    let mut options = ClientOptions::parse(uri).await.unwrap();
    // The client's default is a weak write concern; the store must not inherit it.
    options.write_concern = Some(mongodb::options::WriteConcern::nodes(1));
    let log: Arc<Mutex<Vec<(String, Document)>>> = Arc::default();
    let sink = log.clone();
    options.command_event_handler = Some(EventHandler::callback(move |event: CommandEvent| {
        if let CommandEvent::Started(started) = event {
            sink.lock().unwrap().push((started.command_name.clone(), started.command.clone()));
        }
    }));
    (Client::with_options(options).unwrap(), log)
}

/// A set-up store in a fresh database, on a client that records every command it sends.
struct Recorded {
    client: Client,
    log: Arc<Mutex<Vec<(String, Document)>>>,
    database: String,
    store: MongoStore,
}

/// How many `find`s of `store`'s events `log` recorded from its entry `since` on.
fn finds_of_events(log: &Mutex<Vec<(String, Document)>>, store: &MongoStore, since: usize) -> usize {
    let events = store.events_collection().name();
    log.lock().unwrap()[since..].iter().filter(|(name, command)| name == "find" && command.get_str("find") == Ok(events)).count()
}

async fn recorded_store() -> Recorded {
    let (client, log) = recording_client().await;
    let database = fresh_database();
    let store = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(&database).unwrap(), options());
    store.setup().await.unwrap();
    Recorded { client, log, database, store }
}

/// A keyed event of type `t` created at `at_ms`: at the fan-outs' `now` (`T0`) it is not stale,
/// so the split of the lanes alone says whose it is.
fn keyed_at(id: &str, key: &str, at_ms: i64) -> relayhost::event::NewEvent {
    keyed(id, "t", key).with_created_at(at(at_ms))
}

/// `store`'s change stream feeding its fan-outs, after a fan-out that read every unfanned
/// event: from then on, what the stream reports is all there is. Stopped when dropped.
struct Hearing {
    waker: Arc<tokio::sync::Notify>,
    wakeups: tokio::task::JoinHandle<()>,
}

impl Hearing {
    async fn start(store: &MongoStore, subscriptions: &Subscriptions) -> Self {
        let waker = Arc::new(tokio::sync::Notify::new());
        let wakeups = EventWakeups::default().spawn(store, waker.clone());
        let hearing = Self { waker, wakeups };
        hearing.woken().await;
        assert_eq!(store.fan_out(subscriptions, 100, 5, at(T0)).await.unwrap().events, 0);
        hearing
    }

    /// Drops a report left over from events heard before (a wakeup is kept until waited
    /// for), so that the next [`Hearing::woken`] is the stream reporting what comes next.
    async fn forget_earlier_reports(&self) {
        let _ = tokio::time::timeout(Duration::from_millis(200), self.waker.notified()).await;
    }

    /// Waits for the stream's report of what was just published, then until it has reported
    /// nothing for half a second: all of it has been heard.
    async fn quiet(&self) {
        self.woken().await;
        while tokio::time::timeout(Duration::from_millis(500), self.waker.notified()).await.is_ok() {}
    }

    /// Waits for the stream's next report (the first is the stream opening).
    async fn woken(&self) {
        tokio::time::timeout(Duration::from_secs(10), self.waker.notified()).await.expect("a wakeup");
    }
}

impl Drop for Hearing {
    fn drop(&mut self) {
        self.wakeups.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_hands_out_heard_events_without_reading_them_and_never_one_fanned_out_already() {
    let Recorded { log, store, .. } = recorded_store().await;
    let subscriptions = subs(&[("h", &["t"])]);
    let hearing = Hearing::start(&store, &subscriptions).await;
    let reads_of_events = |since: usize| finds_of_events(&log, &store, since);

    publish_all(&store, vec![event("e-1", "t")]).await;
    hearing.woken().await;
    let before = log.lock().unwrap().len();
    let report = store.fan_out(&subscriptions, 100, 5, at(T0)).await.unwrap();
    assert_eq!(ids(&report.claimed), ["e-1/h"]);
    assert_eq!(reads_of_events(before), 0, "a heard event is not read again");
    assert_eq!(store.complete_many(&[report.claimed[0].lease], at(T0)).await.unwrap(), [Settlement::Completed]);

    // Another worker fans out, runs and completes a heard event first: the fan-out finds the
    // event marked already and creates nothing again (its delivery is gone, so only that
    // check can tell).
    publish_all(&store, vec![event("e-2", "t")]).await;
    hearing.woken().await;
    let other = store.instance("other");
    assert_eq!(other.fan_out(&subscriptions, 100, 0, at(T0)).await.unwrap().events, 1);
    let claimed = other.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap();
    assert_eq!(ids(&claimed), ["e-2/h"]);
    assert_eq!(other.complete_many(&[claimed[0].lease], at(T0)).await.unwrap(), [Settlement::Completed]);
    let before = log.lock().unwrap().len();
    let report = store.fan_out(&subscriptions, 100, 5, at(T0)).await.unwrap();
    assert_eq!((report.events, report.claimed.len()), (0, 0));
    assert!(list_all(&store, DeliveryFilter::default()).await.is_empty(), "nothing was created again");
    assert_eq!(reads_of_events(before), 1, "it read the collection instead");

    // That read reached the end: a heard keyed event is fanned out from the stream too (its
    // key's lower unfanned events are all among the heard ones); nothing of its key is
    // pending, so it is handed out as its head, in its key's lane.
    publish_all(&store, vec![keyed("k-0", "t", "key")]).await;
    hearing.woken().await;
    let before = log.lock().unwrap().len();
    let report = store.fan_out(&subscriptions, 100, 5, at(T0)).await.unwrap();
    assert_eq!(reads_of_events(before), 0, "a heard keyed event is not read again");
    assert_eq!(ids(&report.claimed), ["k-0/h"]);
    assert_eq!(report.claimed[0].lease.lane, relayhost::lane::lane_of("key"));
    assert!(report.lanes.is_empty());
}

/// A heard keyed event comes from the stream only while the heard events hold every lower
/// unfanned event of its key: its key's next event waits for the head that runs, and when
/// the split of the lanes changes, a lower event an earlier fan-out left to another host is
/// read and runs first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heard_keyed_events_come_from_the_stream_only_while_it_holds_their_keys_lower_events() {
    let Recorded { log, store, .. } = recorded_store().await;
    let subscriptions = subs(&[("h", &["t"])]);
    let hearing = Hearing::start(&store, &subscriptions).await;
    let reads_of_events = |since: usize| finds_of_events(&log, &store, since);

    // The head runs; its key's next event, heard, is created without being read, and waits.
    publish_all(&store, vec![keyed_at("a-1", "a", T0)]).await;
    hearing.woken().await;
    let head = store.fan_out(&subscriptions, 100, 5, at(T0)).await.unwrap();
    assert_eq!(ids(&head.claimed), ["a-1/h"]);
    publish_all(&store, vec![keyed_at("a-2", "a", T0)]).await;
    hearing.woken().await;
    let before = log.lock().unwrap().len();
    let next = store.fan_out(&subscriptions, 100, 5, at(T0)).await.unwrap();
    assert_eq!((next.events, next.claimed.len(), reads_of_events(before)), (1, 0, 0), "created, not handed out, not read");
    assert!(store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap().is_empty(), "its head still runs");
    assert_eq!(store.complete_many(&[head.claimed[0].lease], at(T0)).await.unwrap(), [Settlement::Completed]);
    assert_eq!(ids(&store.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap()), ["a-2/h"]);
    hearing.forget_earlier_reports().await;

    // Two live hosts: the first events of twenty keys, heard here; this host fans out only
    // those of its own lanes, and the others are left to the other host.
    let other = store.instance("other");
    assert_eq!(store.announce(at(T0)).await.unwrap(), 1);
    assert_eq!(other.announce(at(T0)).await.unwrap(), 2);
    assert_eq!(store.announce(at(T0)).await.unwrap(), 2);
    publish_all(&store, (0..20).map(|k| keyed_at(&format!("k{k}-1"), &format!("key-{k}"), T0)).collect()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mine = store.fan_out(&subscriptions, 100, 100, at(T0)).await.unwrap();
    assert!(mine.events > 0 && mine.events < 20, "a split in two: {} of 20", mine.events);
    let theirs = (0..20).find(|k| !ids(&mine.claimed).contains(&format!("k{k}-1/h"))).expect("a key of the other host's");

    // The other host leaves: its lanes are this host's now. Its key's second event is heard;
    // the first, never fanned out, is read with it and runs first, the second waits for it.
    other.relinquish().await.unwrap();
    assert_eq!(store.announce(at(T0)).await.unwrap(), 1);
    hearing.forget_earlier_reports().await;
    publish_all(&store, vec![keyed_at(&format!("k{theirs}-2"), &format!("key-{theirs}"), T0)]).await;
    hearing.woken().await;
    let before = log.lock().unwrap().len();
    let taken = store.fan_out(&subscriptions, 100, 100, at(T0)).await.unwrap();
    assert!(reads_of_events(before) > 0, "the split changed: the stream's events are not all there is");
    let handed: Vec<String> = ids(&taken.claimed).into_iter().filter(|id| id.starts_with(&format!("k{theirs}-"))).collect();
    assert_eq!(handed, [format!("k{theirs}-1/h")], "the key's first event runs first, and alone");
}

/// Two live hosts, `store` and another instance of it, each of which fanned out and
/// completed the first events of its own keys among `key-0`, `key-1`, ... (created at `T0`,
/// so none is stale), then a read to the end under their split: the stream's keyed events
/// would do from here on.
struct Split {
    other: MongoStore,
    /// The keys (their numbers) of this host's lanes, and of the other's.
    mine: Vec<usize>,
    theirs: Vec<usize>,
}

impl Split {
    async fn in_two(store: &MongoStore, hearing: &Hearing, subscriptions: &Subscriptions, keys: usize) -> Self {
        let other = store.instance("other");
        assert_eq!(store.announce(at(T0)).await.unwrap(), 1);
        assert_eq!(other.announce(at(T0)).await.unwrap(), 2);
        assert_eq!(store.announce(at(T0)).await.unwrap(), 2);
        publish_all(store, (0..keys).map(|k| keyed_at(&format!("p{k}"), &format!("key-{k}"), T0)).collect()).await;
        hearing.quiet().await;
        // Each fans out (and runs) the first events of its own keys only.
        let probe = Self::fan_out_and_complete(store, subscriptions, keys * 2).await;
        let mine: Vec<usize> = (0..keys).filter(|k| ids(&probe.claimed).contains(&format!("p{k}/h"))).collect();
        let theirs: Vec<usize> = (0..keys).filter(|k| !mine.contains(k)).collect();
        let by_other = Self::fan_out_and_complete(&other, subscriptions, keys * 2).await;
        assert_eq!(by_other.events, theirs.len(), "the other's, by the other");
        assert_eq!(store.fan_out(subscriptions, 10, 0, at(T0)).await.unwrap().events, 0, "a read to the end");
        Self { other, mine, theirs }
    }

    async fn fan_out_and_complete(host: &MongoStore, subscriptions: &Subscriptions, limit: usize) -> FanOutReport {
        let fanned = host.fan_out(subscriptions, limit, limit, at(T0)).await.unwrap();
        let leases: Vec<_> = fanned.claimed.iter().map(|c| c.lease).collect();
        assert!(host.complete_many(&leases, at(T0)).await.unwrap().iter().all(|s| *s == Settlement::Completed));
        fanned
    }
}

/// A fan-out whose heard events are all another host's reads nothing while the stream missed
/// nothing since a read to the end under this split: nothing of this host's is unfanned. A
/// fan-out with nothing heard (the poll's) still reads, and leaves the event to its host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heard_events_all_another_hosts_leave_nothing_to_read_unless_the_stream_missed_some() {
    let Recorded { log, store, .. } = recorded_store().await;
    let subscriptions = subs(&[("h", &["t"])]);
    let hearing = Hearing::start(&store, &subscriptions).await;
    let Split { other, mine, theirs } = Split::in_two(&store, &hearing, &subscriptions, 20).await;
    let (my_lane, their_lane) = (relayhost::lane::lane_of(&format!("key-{}", mine[0])), relayhost::lane::lane_of(&format!("key-{}", theirs[0])));
    let theirs = id_in_lane("theirs", their_lane);

    // Created at the fan-outs' now: fresh, so the split alone says whose it is.
    publish_all(&store, vec![event(&theirs, "t").with_created_at(at(T0))]).await;
    hearing.woken().await;
    let before = log.lock().unwrap().len();
    assert_eq!(store.fan_out(&subscriptions, 100, 5, at(T0)).await.unwrap().events, 0);
    assert_eq!(finds_of_events(&log, &store, before), 0, "nothing read");
    assert_eq!(store.fan_out(&subscriptions, 100, 5, at(T0)).await.unwrap().events, 0);
    assert_eq!(finds_of_events(&log, &store, before), 1, "the poll's fan-out reads");
    assert_eq!(other.fan_out(&subscriptions, 10, 0, at(T0)).await.unwrap().events, 1, "the other host's to fan out");

    // Once the stream may have missed some (more were heard than are kept), a fan-out that
    // heard only the other host's events reads all the same, and finds this host's.
    let ours: Vec<_> = (0..257).map(|n| event(&id_in_lane(&format!("ours{n}"), my_lane), "t").with_created_at(at(T0))).collect();
    publish_all(&store, ours).await;
    hearing.quiet().await;
    publish_all(&store, vec![event(&id_in_lane("theirs-again", their_lane), "t").with_created_at(at(T0))]).await;
    hearing.woken().await;
    assert_eq!(store.fan_out(&subscriptions, 100, 5, at(T0)).await.unwrap().events, 100, "this host's, read");
}

/// A read that left some of this host's events unfanned (more than a batch of them, past a
/// page of other hosts' events) did not reach the end: a key's next event heard afterwards
/// is read with its first, which runs first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_cut_its_batch_short_leaves_heard_keyed_events_to_reading() {
    let Recorded { store, .. } = recorded_store().await;
    let subscriptions = subs(&[("h", &["t"])]);
    let hearing = Hearing::start(&store, &subscriptions).await;
    let Split { mine, theirs, .. } = Split::in_two(&store, &hearing, &subscriptions, 60).await;
    assert!(mine.len() >= 12 && theirs.len() >= 6, "a split in two: {} and {}", mine.len(), theirs.len());

    // Oldest first: four of this host's, six of the other's, then eight of this host's. A read
    // of ten finds four of its own in its first page, eight more in the second (which starts
    // at the first's last event), the end of the unfanned events: twelve, more than a batch.
    let order: Vec<usize> = mine[..4].iter().chain(&theirs[..6]).chain(&mine[4..12]).copied().collect();
    publish_all(&store, order.iter().enumerate().map(|(n, k)| keyed_at(&format!("s{k}-2"), &format!("key-{k}"), T0 + 1 + n as i64)).collect())
        .await;
    // Every one of them heard (more than a batch: the fan-out reads instead).
    hearing.quiet().await;
    let read = store.fan_out(&subscriptions, 10, 10, at(T0 + 100)).await.unwrap();
    assert_eq!(read.events, 10, "a batch of ten of this host's");
    let left: Vec<usize> = mine[..12].iter().copied().filter(|k| !ids(&read.claimed).contains(&format!("s{k}-2/h"))).collect();
    assert_eq!(left.len(), 2, "two of this host's were cut off: {:?}", ids(&read.claimed));

    // The next event of a key whose event was cut off, heard: read with it, and it waits.
    let key = left[0];
    publish_all(&store, vec![keyed_at(&format!("s{key}-3"), &format!("key-{key}"), T0 + 100)]).await;
    hearing.quiet().await;
    let next = store.fan_out(&subscriptions, 10, 10, at(T0 + 100)).await.unwrap();
    let handed: Vec<String> = ids(&next.claimed).into_iter().filter(|id| id.starts_with(&format!("s{key}-"))).collect();
    assert_eq!(handed, [format!("s{key}-2/h")], "the key's earlier event runs first, and alone");
}

/// A keyed event the stream heard that is another host's but stale (its publisher's clock
/// said it is old) is not fanned out from the stream: its key's lower event, fresh and so left
/// to the other host, is read with it and runs first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_heard_keyed_event_of_another_hosts_lane_waits_for_its_keys_lower_event() {
    let Recorded { store, .. } = recorded_store().await;
    let subscriptions = subs(&[("h", &["t"])]);
    let hearing = Hearing::start(&store, &subscriptions).await;
    let Split { other, theirs, .. } = Split::in_two(&store, &hearing, &subscriptions, 20).await;
    let theirs = *theirs.first().expect("a key of the other host's");

    // Its second event, fresh: the other host's. Its third, stamped ten minutes old: stale,
    // so anyone's to fan out, but only with the second.
    let key = format!("key-{theirs}");
    publish_all(&store, vec![keyed_at(&format!("s{theirs}-2"), &key, T0), keyed_at(&format!("s{theirs}-3"), &key, T0 - 600_000)]).await;
    hearing.quiet().await;
    let report = store.fan_out(&subscriptions, 10, 10, at(T0)).await.unwrap();
    assert_eq!((report.events, report.claimed.len()), (2, 0), "both read and fanned out; the lane is the other host's");
    let claimed = other.claim(&handlers(&["h"]), 10, at(T0)).await.unwrap();
    assert_eq!(ids(&claimed), [format!("s{theirs}-2/h")], "the key's lower event runs first, and alone");
}

/// A heard event another fan-out has marked, in a transaction still open, is not handed out:
/// the mark, the first thing a fan-out writes, is what makes it the only one, and a hand-out
/// is sent early only after it. (Sent after the inserts instead, this one would be, since the
/// other fan-out inserted nothing yet that they could conflict with.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heard_event_another_open_fan_out_marked_is_not_handed_out_early() {
    let Recorded { client, store, .. } = recorded_store().await;
    let subscriptions = subs(&[("h", &["t"])]);
    let hearing = Hearing::start(&store, &subscriptions).await;

    publish_all(&store, vec![event("e-1", "t")]).await;
    hearing.woken().await;
    let mut other = client.start_session().await.unwrap();
    other.start_transaction().await.unwrap();
    store
        .events_collection()
        .update_one(doc! { "_id": "e-1" }, doc! { "$set": { "fannedOutAt": at(T0), "handlers": ["h"] } })
        .session(&mut other)
        .await
        .unwrap();
    let (early, mut sent) = tokio::sync::mpsc::unbounded_channel();
    let fan_out = store.fan_out_early(&subscriptions, 100, 5, &early, at(T0));
    let other_commits = async {
        // Long enough for the heard fan-out to meet the open mark; the reading fan-out that
        // follows retries until the other commits.
        tokio::time::sleep(Duration::from_millis(300)).await;
        other.commit_transaction().await.unwrap();
    };
    let (report, ()) = tokio::join!(fan_out, other_commits);
    let report = report.unwrap();
    assert!(sent.try_recv().is_err(), "nothing was sent early");
    assert_eq!((report.events, report.claimed.len(), report.sent_early), (0, 0, 0));
    assert!(list_all(&store, DeliveryFilter::default()).await.is_empty(), "nothing was created");
}

/// Two hosts hear the same event in a lane the first holds: the second's fan-out marks it
/// first (so its delivery lands in a lane only the first can claim from), and the first's
/// hand-out fails. The first's fan-out then names that lane for a claim, which finds the
/// delivery at once instead of at the first host's next poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_out_that_lost_its_events_to_another_fan_out_names_its_lanes_for_a_claim() {
    let Recorded { store: a, .. } = recorded_store().await;
    let b = a.instance("b");
    let subscriptions = subs(&[("h", &["t"])]);
    let hearing = Hearing::start(&a, &subscriptions).await;

    // The first host holds the lane: it runs an event of it.
    let lane = 42;
    let (first, second) = (id_in_lane("first", lane), id_in_lane("second", lane));
    publish_all(&a, vec![event(&first, "t")]).await;
    hearing.woken().await;
    let (early, _sent) = tokio::sync::mpsc::unbounded_channel();
    let report = a.fan_out_early(&subscriptions, 100, 5, &early, at(T0)).await.unwrap();
    assert_eq!(report.claimed.len() + report.sent_early, 1, "the first host runs {first}");

    // The second host fans the next event of that lane out first; it cannot take the lane.
    publish_all(&a, vec![event(&second, "t")]).await;
    hearing.woken().await;
    let report = b.fan_out(&subscriptions, 100, 5, at(T0)).await.unwrap();
    assert_eq!((report.events, report.claimed.len()), (1, 0));
    assert!(b.claim_in(&handlers(&["h"]), &[lane], 10, at(T0)).await.unwrap().is_empty(), "the lane is the first host's");

    // The first host's fan-out of what it heard finds it marked: it names the lane it listed
    // in, and a claim there finds the second host's delivery.
    let report = a.fan_out_early(&subscriptions, 100, 5, &early, at(T0)).await.unwrap();
    assert_eq!((report.events, report.claimed.len(), report.sent_early), (0, 0, 0));
    assert!(report.lanes.contains(&lane), "{:?}", report.lanes);
    let lanes: Vec<_> = report.lanes.iter().copied().collect();
    let claimed = a.claim_in(&handlers(&["h"]), &lanes, 10, at(T0)).await.unwrap();
    assert_eq!(ids(&claimed), [format!("{second}/h")]);

    // The same when the first host lists the event in another lane it holds, one that lists
    // less (see `a_hand_out_gathers_…`): the lane its event hashes to is named all the same,
    // since the second host's delivery lands there.
    let quiet = id_in_lane("quiet", 43);
    publish_all(&a, vec![event(&quiet, "t")]).await;
    hearing.woken().await;
    assert_eq!(a.fan_out(&subscriptions, 100, 0, at(T0)).await.unwrap().events, 1);
    assert_eq!(ids(&a.claim_in(&handlers(&["h"]), &[43], 10, at(T0)).await.unwrap()), [format!("{quiet}/h")]);
    let third = id_in_lane("third", lane);
    publish_all(&a, vec![event(&third, "t")]).await;
    hearing.woken().await;
    let report = b.fan_out(&subscriptions, 100, 5, at(T0)).await.unwrap();
    assert_eq!((report.events, report.claimed.len()), (1, 0));
    let report = a.fan_out_early(&subscriptions, 100, 5, &early, at(T0)).await.unwrap();
    assert_eq!((report.events, report.claimed.len(), report.sent_early), (0, 0, 0));
    assert!(report.lanes.contains(&lane), "{:?}", report.lanes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_many_takes_a_fixed_number_of_commands_without_a_transaction_and_claims_write_with_majority() {
    let Recorded { log, store, .. } = recorded_store().await;
    publish_all(&store, (0..400).map(|n| event(&format!("e-{n}"), "t")).collect()).await;
    let before_fan_out = log.lock().unwrap().len();
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0)).await;
    let before_claim = log.lock().unwrap().len();
    let claimed = store.claim(&handlers(&["h"]), 400, at(T0)).await.unwrap();
    assert_eq!(claimed.len(), 400);

    // The fan-out commits without waiting for durability; the claim's lane record, which
    // comes after it on the same primary and before anything is handed out, waits for a
    // majority, and so makes the fan-out durable first.
    let write_concern = |command: &Document| command.get_document("writeConcern").ok().and_then(|c| c.get("w").cloned());
    let commands = log.lock().unwrap().clone();
    let fan_out_commits: Vec<&Document> =
        commands[before_fan_out..before_claim].iter().filter(|(name, _)| name == "commitTransaction").map(|(_, c)| c).collect();
    assert!(!fan_out_commits.is_empty());
    for command in &fan_out_commits {
        assert_eq!(write_concern(command), Some(bson::Bson::Int32(1)), "{command}");
    }
    let lane_writes: Vec<&Document> = commands[before_claim..]
        .iter()
        .filter(|(name, command)| name == "update" && command.get_str("update").is_ok_and(|c| c.ends_with("lanes")))
        .map(|(_, command)| command)
        .collect();
    assert!(!lane_writes.is_empty());
    for command in &lane_writes {
        assert_eq!(write_concern(command), Some(bson::Bson::String("majority".into())), "{command}");
    }

    let mut counts = Vec::new();
    for batch in [&claimed[0..5], &claimed[5..400]] {
        let leases: Vec<_> = batch.iter().map(|c| c.lease).collect();
        let before = log.lock().unwrap().len();
        let settled = store.complete_many(&leases, at(T0)).await.unwrap();
        assert!(settled.iter().all(|s| *s == Settlement::Completed));
        let sent = log.lock().unwrap()[before..].to_vec();
        counts.push(sent.len());
        // Outside any transaction (each transactional write pays for every index of its
        // collection), and the deliveries, all of one claim generation, go by one statement
        // of a delete acknowledged once applied: the next delivery of a completed one's key
        // runs only after a claim's majority record, which comes after it and makes it durable.
        for (name, command) in &sent {
            assert!(name != "commitTransaction" && !command.contains_key("txnNumber"), "{name}: {command}");
        }
        let deletes: Vec<&Document> = sent.iter().filter(|(name, _)| name == "delete").map(|(_, c)| c).collect();
        assert_eq!(deletes.len(), 1, "{deletes:?}");
        assert_eq!(deletes[0].get_array("deletes").unwrap().len(), 1, "{}", deletes[0]);
        assert_eq!(write_concern(deletes[0]), Some(bson::Bson::Int32(1)));
    }
    assert_eq!(counts[0], counts[1], "commands for 5 and for 395 completions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_of_many_event_types_marks_its_events_with_one_command() {
    let Recorded { client, log, database, store } = recorded_store().await;
    let types: Vec<String> = (0..12).map(|n| format!("type-{n}")).collect();
    publish_all(&store, types.iter().map(|t| event(t, t)).collect()).await;
    // Every type gets its own list of handlers: handler h-n serves the first n + 1 types.
    let subscriptions = relayhost::store::Subscriptions::new(
        (0..types.len()).map(|n| relayhost::store::Subscription::new(format!("h-{n}"), types[..=n].to_vec())),
    )
    .unwrap();
    let before = log.lock().unwrap().len();
    let report = store.fan_out(&subscriptions, 100, 0, at(T0)).await.unwrap();
    assert_eq!((report.events, report.deliveries), (12, (1..=12).sum()));
    let event_updates = log.lock().unwrap()[before..]
        .iter()
        .filter(|(name, command)| name == "update" && command.get_str("update").is_ok_and(|c| c.ends_with("events")))
        .count();
    assert_eq!(event_updates, 1);
    // ...and each event got its own list.
    let events = client.database(&database).collection::<Document>("relayhost_events");
    for (n, event_type) in types.iter().enumerate() {
        let stored = events.find_one(doc! { "_id": event_type }).await.unwrap().unwrap();
        assert!(stored.get_datetime("fannedOutAt").is_ok(), "{stored}");
        let mut listed: Vec<&str> = stored.get_array("handlers").unwrap().iter().filter_map(bson::Bson::as_str).collect();
        listed.sort();
        let mut expected: Vec<String> = (n..types.len()).map(|h| format!("h-{h}")).collect();
        expected.sort();
        assert_eq!(listed, expected, "{event_type}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_sends_the_same_commands_for_one_handler_as_for_twenty() {
    let (client, log) = recording_client().await;
    let twenty: Vec<String> = (0..20).map(|n| format!("h{n}")).collect();
    let mut sent = Vec::new();
    for wanted in [handlers(&["h0"]), twenty] {
        let store = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(&fresh_database()).unwrap(), options());
        store.setup().await.unwrap();
        publish_all(&store, (0..3).map(|n| keyed(&format!("e-{n}"), "t", &format!("k{n}"))).collect()).await;
        fan_out_all(&store, &subs(&[("h0", &["t"])]), at(T0)).await;
        let before = log.lock().unwrap().len();
        assert_eq!(store.claim(&wanted, 10, at(T0)).await.unwrap().len(), 3);
        let mut names: Vec<String> = log.lock().unwrap()[before..].iter().map(|(name, _)| name.clone()).collect();
        names.sort();
        sent.push(names);
    }
    assert_eq!(sent[0], sent[1], "commands of a claim for one handler and for twenty");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_reads_no_lane_it_holds_and_rewrites_only_lanes_with_new_picks_or_an_ending_lease() {
    let Recorded { client, log, database, store } = recorded_store().await;
    let h = handlers(&["h"]);
    let lanes_commands = |since: usize, name: &str| -> Vec<Document> {
        log.lock().unwrap()[since..]
            .iter()
            .filter(|(n, command)| n == name && command.get_str(name).is_ok_and(|c| c.ends_with("lanes")))
            .map(|(_, command)| command.clone())
            .collect()
    };
    let rewritten = |updates: &[Document]| -> Vec<i32> {
        let mut lanes: Vec<i32> = updates
            .iter()
            .flat_map(|u| u.get_array("updates").unwrap().clone())
            .flat_map(|statement| {
                // A lane the claim takes has a statement of its own; those it holds share one.
                let filter = statement.as_document().unwrap().get_document("q").unwrap().clone();
                match filter.get_i32("_id") {
                    Ok(lane) => vec![lane],
                    Err(_) => filter.get_document("_id").unwrap().get_array("$in").unwrap().iter().map(|id| id.as_i32().unwrap()).collect(),
                }
            })
            .collect();
        lanes.sort();
        lanes
    };
    let (a1, a2, b1) = (id_in_lane("a1", 3), id_in_lane("a2", 3), id_in_lane("b1", 7));
    publish_all(&store, vec![event(&a1, "t"), event(&b1, "t")]).await;
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0)).await;
    assert_eq!(store.claim(&h, 10, at(T0)).await.unwrap().len(), 2);

    // New work in lane 3 only: the claim trusts what it wrote to both lanes, and lane 7, which
    // runs b1 and got nothing new, keeps its record as it is.
    publish_all(&store, vec![event(&a2, "t")]).await;
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0 + 1_000)).await;
    let before = log.lock().unwrap().len();
    assert_eq!(ids(&store.claim(&h, 10, at(T0 + 1_000)).await.unwrap()), vec![format!("{a2}/h")]);
    // (The search for free lanes with due work reads the lanes collection too, by owner.)
    let by_id: Vec<Document> =
        lanes_commands(before, "find").into_iter().filter(|find| find.get_document("filter").unwrap().contains_key("_id")).collect();
    assert!(by_id.is_empty(), "a held lane was read again: {by_id:?}");
    assert_eq!(rewritten(&lanes_commands(before, "update")), vec![3]);
    let lanes = client.database(&database).collection::<Document>("relayhost_lanes");
    let listed = |lane: i32| {
        let lanes = lanes.clone();
        async move {
            let document = lanes.find_one(doc! { "_id": lane }).await.unwrap().unwrap();
            (document.get_array("inFlight").unwrap().len(), document.get_datetime("leaseExpiresAt").unwrap().timestamp_millis())
        }
    };
    assert_eq!(listed(3).await, (2, T0 + 31_000));
    assert_eq!(listed(7).await, (1, T0 + 30_000));

    // Past half of the lease, both lanes still run something: a claim rewrites both, which
    // extends their leases, although it picked nothing.
    let before = log.lock().unwrap().len();
    assert!(store.claim(&h, 10, at(T0 + 16_000)).await.unwrap().is_empty());
    assert_eq!(rewritten(&lanes_commands(before, "update")), vec![3, 7]);
    assert_eq!(listed(3).await, (2, T0 + 46_000));
    assert_eq!(listed(7).await, (1, T0 + 46_000));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_record_applies_only_at_the_epoch_its_holder_knows() {
    // The records of held lanes share one statement, which matches each lane at its own epoch:
    // a lane whose epoch moved behind its holder's back (as a take moves it) keeps its list.
    let Recorded { client, database, store, .. } = recorded_store().await;
    let h = handlers(&["h"]);
    let (a1, a2) = (id_in_lane("a1", 3), id_in_lane("a2", 3));
    publish_all(&store, vec![event(&a1, "t")]).await;
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0)).await;
    assert_eq!(store.claim(&h, 10, at(T0)).await.unwrap().len(), 1);
    let lanes = client.database(&database).collection::<Document>("relayhost_lanes");
    lanes.update_one(doc! { "_id": 3 }, doc! { "$inc": { "epoch": 1_i64 } }).await.unwrap();

    publish_all(&store, vec![event(&a2, "t")]).await;
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0 + 1_000)).await;
    assert!(store.claim(&h, 10, at(T0 + 1_000)).await.unwrap().is_empty(), "a2 was claimed in a lane its holder lost");
    let lane = lanes.find_one(doc! { "_id": 3 }).await.unwrap().unwrap();
    assert_eq!(lane.get_array("inFlight").unwrap().len(), 1, "the lane's list was rewritten: {lane}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_looks_up_the_heads_of_many_keys_with_one_command_per_handler() {
    let Recorded { client, log, database, store } = recorded_store().await;
    // Thirty keys, two events each, for two handlers; one key looks like a field path, which
    // must stay data on its way into the lookup.
    let keys: Vec<String> = (0..29).map(|n| format!("k-{n}")).chain(["$k".to_string()]).collect();
    let events: Vec<_> =
        (0..2).flat_map(|round| keys.iter().map(move |key| keyed(&format!("{key}-{round}"), "t", key))).collect();
    publish_all(&store, events).await;
    fan_out_all(&store, &subs(&[("h", &["t"]), ("g", &["t"])]), at(T0)).await;

    let before = log.lock().unwrap().len();
    let claimed = store.claim(&handlers(&["h", "g"]), 200, at(T0)).await.unwrap();
    let mut expected: Vec<String> =
        ["h", "g"].iter().flat_map(|h| keys.iter().map(move |key| format!("{key}-0/{h}"))).collect();
    expected.sort();
    assert_eq!(ids(&claimed), expected, "each key's first event, for each handler");

    let commands: Vec<Document> = log.lock().unwrap()[before..]
        .iter()
        .filter(|(name, _)| name == "aggregate" || name == "find")
        .map(|(_, command)| command.clone())
        .collect();
    let point_lookups = commands.iter().filter(|c| c.get_document("sort").is_ok_and(|s| s.contains_key("sequence"))).count();
    assert_eq!(point_lookups, 0, "heads looked up one by one");
    let lookups: Vec<&Document> = commands.iter().filter(|c| c.contains_key("aggregate")).collect();
    assert_eq!(lookups.len(), 2, "one head lookup per handler: {lookups:?}");

    // It reads the keys' pending deliveries from the `ordering` index, nothing else: the
    // command as the store sent it, explained.
    let mut sent = doc! {
        "aggregate": lookups[0].get_str("aggregate").unwrap(),
        "pipeline": lookups[0].get_array("pipeline").unwrap().clone(),
        "cursor": {},
    };
    if let Some(hint) = lookups[0].get("hint") {
        sent.insert("hint", hint.clone());
    }
    let explained = client
        .database(&database)
        .run_command(doc! { "explain": sent, "verbosity": "executionStats" })
        .await
        .unwrap();
    let text = explained.to_string();
    assert!(text.contains("\"indexName\": \"ordering\"") && !text.contains("COLLSCAN"), "{explained}");
    let number = |field: &str| {
        let at = text.find(&format!("\"{field}\": ")).unwrap_or_else(|| panic!("{field} in {explained}")) + field.len() + 4;
        text[at..].chars().take_while(char::is_ascii_digit).collect::<String>().parse::<usize>().unwrap()
    };
    // Each key has two deliveries pending for this handler: 60 in all.
    assert!(number("totalDocsExamined") <= 2 * keys.len(), "{explained}");
    assert!(number("totalKeysExamined") <= 2 * keys.len(), "{explained}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_takes_the_follower_created_behind_a_completed_delivery_without_looking_its_key_up() {
    let Recorded { log, store, .. } = recorded_store().await;
    let h = handlers(&["h"]);
    publish_all(&store, (1..=3).map(|n| keyed(&format!("k-{n}"), "t", "key")).collect()).await;
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0)).await;
    let lookups = |since: usize| log.lock().unwrap()[since..].iter().filter(|(name, _)| name == "aggregate").count();
    let first = store.claim(&h, 10, at(T0 + 1)).await.unwrap();
    assert_eq!(ids(&first), ["k-1/h"]);
    store.complete_many(&[first[0].lease], at(T0 + 2)).await.unwrap();
    let before = log.lock().unwrap().len();
    let second = store.claim(&h, 10, at(T0 + 3)).await.unwrap();
    assert_eq!(ids(&second), ["k-2/h"]);
    assert_eq!(lookups(before), 0, "k-2 was created behind k-1, which is gone: it leads its key");
    // This store completed k-1 itself: it knows k-1 is gone without reading whether it is pending.
    let pending_reads: Vec<Document> = log.lock().unwrap()[before..]
        .iter()
        .filter(|(name, command)| name == "find" && command.get_document("filter").is_ok_and(|f| f.contains_key("_id") && f.contains_key("status")))
        .map(|(_, command)| command.clone())
        .collect();
    assert!(pending_reads.is_empty(), "a completed delivery was read again: {pending_reads:?}");

    // A retried one is still pending: its follower waits, and that is read.
    store.reschedule(&second[0].lease, at(T0 + 60_000), "try again", at(T0 + 4)).await.unwrap();
    let before = log.lock().unwrap().len();
    let third = store.claim(&h, 10, at(T0 + 5)).await.unwrap();
    assert!(third.is_empty(), "{:?} ran while k-2 waits for its retry", ids(&third));
    let pending_reads = log.lock().unwrap()[before..]
        .iter()
        .filter(|(name, command)| name == "find" && command.get_document("filter").is_ok_and(|f| f.contains_key("_id") && f.contains_key("status")))
        .count();
    assert_eq!(pending_reads, 1, "whether the retried k-2 is pending is read once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_unpark_leaves_the_follower_leading_its_key_without_the_delivery_it_was_behind() {
    // The operator's burial and the sweep unpark as a claim after a completion does (and as
    // the memory store does): the follower is ready and no longer names its predecessor.
    let Recorded { client, database, store, .. } = recorded_store().await;
    let deliveries = client.database(&database).collection::<Document>("relayhost_deliveries");
    let h = handlers(&["h"]);
    publish_all(&store, (1..=3).map(|n| keyed(&format!("k-{n}"), "t", "key")).collect()).await;
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0)).await;
    let head = store.claim(&h, 10, at(T0 + 1)).await.unwrap().remove(0);
    store.reschedule(&head.lease, at(T0 + 3_600_000), "flaky", at(T0 + 2)).await.unwrap();
    store.relinquish().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    store.bury_pending_in(&mut tx, &head.lease.delivery.to_hex(), "stuck", at(T0 + 3)).await.unwrap();
    tx.commit().await.unwrap();
    let follower = |event: &'static str| {
        let deliveries = deliveries.clone();
        async move { deliveries.find_one(doc! { "eventId": event }).await.unwrap().unwrap() }
    };
    let k2 = follower("k-2").await;
    assert_eq!((k2.get_str("lane").unwrap(), k2.contains_key("behind")), ("ready", false), "unparked by the burial: {k2}");
    // Another instance runs k-2 and stops: this one never settled it, so k-3, parked behind
    // k-2, is unparked by this one's sweep of the parked keys.
    let other = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(&database).unwrap(), options());
    let second = other.claim(&h, 10, at(T0 + 4)).await.unwrap();
    assert_eq!(ids(&second), ["k-2/h"]);
    other.complete_many(&[second[0].lease], at(T0 + 5)).await.unwrap();
    other.relinquish().await.unwrap();
    assert!(follower("k-3").await.contains_key("behind"), "k-3 waits parked behind k-2");
    let third = store.claim(&h, 10, at(T0 + 10_000)).await.unwrap();
    assert_eq!(ids(&third), ["k-3/h"]);
    let k3 = follower("k-3").await;
    assert!(!k3.contains_key("behind"), "unparked by the sweep: {k3}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactional_completion_never_conflicts_with_another_handlers_completion_of_its_event() {
    // A transactional handler's transaction starts with its own first write; another handler of
    // the same event completes meanwhile. Were the event stamped inside the transaction, it
    // would meet that stamp as a write conflict, and the handler would run again.
    let recorded = recorded_store().await;
    let store = &recorded.store;
    publish_all(store, vec![keyed("order-1", "t", "c-1")]).await;
    fan_out_all(store, &subs(&[("tx", &["t"]), ("plain", &["t"])]), at(T0)).await;
    let claimed = store.claim(&handlers(&["tx", "plain"]), 10, at(T0)).await.unwrap();
    let by_handler = |name: &str| claimed.iter().find(|d| d.handler == name).unwrap().lease;
    complete_beside_an_open_transaction(&recorded, by_handler("tx"), by_handler("plain")).await;

    assert!(list_all(store, Default::default()).await.is_empty(), "both deliveries completed");
    let event = store.events_collection().find_one(doc! { "_id": "order-1" }).await.unwrap().unwrap();
    assert_eq!(event.get_datetime("completedAt").unwrap().timestamp_millis(), T0 + 2, "its latest completion: {event}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactional_hand_out_never_conflicts_with_another_handlers_completion_of_its_event() {
    // Handed out without a document, a transactional handler's completion would be its
    // unkeyed event's `handedOut`, written in its transaction, where another handler's
    // completion committed meanwhile is a write conflict (which runs the handler again). Such
    // a hand-out keeps its document (`store_contract`
    // `a_transactional_handlers_hand_out_keeps_its_document_while_other_handlers_share_its_event`).
    use relayhost::store::Subscription;
    let recorded = recorded_store().await;
    let store = &recorded.store;
    publish_all(store, vec![event("order-1", "t")]).await;
    let subscriptions =
        Subscriptions::new([Subscription::new("tx", ["t"]).completing_in_transaction(true), Subscription::new("plain", ["t"])]).unwrap();
    let report = store.fan_out(&subscriptions, 100, 10, at(T0)).await.unwrap();
    let by_handler = |name: &str| report.claimed.iter().find(|d| d.handler == name).unwrap().lease;
    complete_beside_an_open_transaction(&recorded, by_handler("tx"), by_handler("plain")).await;
    assert!(store.claim(&handlers(&["tx", "plain"]), 10, at(T0 + 100_000)).await.unwrap().is_empty(), "each ran once");
}

/// Completes `plain` while the transaction of `transactional` (of event `order-1`), opened
/// by a write of its own, is open; then completes `transactional` in it and commits.
async fn complete_beside_an_open_transaction(recorded: &Recorded, transactional: relayhost::store::Lease, plain: relayhost::store::Lease) {
    use relayhost::store::StoreTransaction;
    let Recorded { client, database, store, .. } = recorded;
    let business = client.database(database).collection::<Document>("business");
    client.database(database).create_collection("business").await.unwrap();
    let mut tx = store.begin().await.unwrap();
    business.insert_one(doc! { "_id": "order-1" }).session(tx.session()).await.unwrap();
    assert_eq!(store.complete_many(&[plain], at(T0 + 1)).await.unwrap().len(), 1);
    store.complete_in(&mut tx, &transactional, at(T0 + 2)).await.unwrap();
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_followers_of_many_settled_keys_come_in_one_batch() {
    // More settled keys than the server's first batch (101 documents): reading their followers,
    // whether they are still pending and their keys' heads must not cost the claim a `getMore`.
    let Recorded { log, store, .. } = recorded_store().await;
    let h = handlers(&["h"]);
    let keys: Vec<String> = (0..240).map(|n| format!("k{n}")).collect();
    let events = (1..=2).flat_map(|n| keys.iter().map(move |key| keyed(&format!("{key}-{n}"), "t", key))).collect();
    publish_all(&store, events).await;
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0)).await;
    let heads = store.claim(&h, 300, at(T0 + 1)).await.unwrap();
    assert_eq!(heads.len(), keys.len(), "each key's first event");
    // Over 101 retried (the claim reads whether they are pending), over 101 completed (their
    // followers are read).
    let (retried, completed) = heads.split_at(110);
    for delivery in retried {
        store.reschedule(&delivery.lease, at(T0 + 2), "again", at(T0 + 2)).await.unwrap();
    }
    let leases: Vec<_> = completed.iter().map(|d| d.lease).collect();
    store.complete_many(&leases, at(T0 + 2)).await.unwrap();
    let before = log.lock().unwrap().len();
    let next = store.claim(&h, 300, at(T0 + 3)).await.unwrap();
    assert_eq!(next.len(), keys.len(), "the retried heads again and the followers of the completed ones: {:?}", ids(&next));
    let get_mores = log.lock().unwrap()[before..].iter().filter(|(name, _)| name == "getMore").count();
    assert_eq!(get_mores, 0, "a claim read its followers, pending deliveries or keys' heads in more than one batch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_does_not_look_up_again_a_head_an_earlier_claim_found() {
    let Recorded { log, store, .. } = recorded_store().await;
    let h = handlers(&["h"]);
    let (ka, kb) = keys_in_two_lanes();
    publish_all(&store, vec![keyed("ka-1", "t", &ka)]).await;
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0)).await;
    publish_all(&store, vec![keyed("kb-1", "t", &kb)]).await;
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0 + 1)).await;
    let lookups = |since: usize| log.lock().unwrap()[since..].iter().filter(|(name, _)| name == "aggregate").count();

    let before = log.lock().unwrap().len();
    assert_eq!(ids(&store.claim(&h, 1, at(T0 + 2)).await.unwrap()), ["ka-1/h"]);
    assert_eq!(lookups(before), 1, "the first claim looks up both heads at once");
    let before = log.lock().unwrap().len();
    assert_eq!(ids(&store.claim(&h, 10, at(T0 + 3)).await.unwrap()), ["kb-1/h"]);
    assert_eq!(lookups(before), 0, "kb-1 was known as its key's head");
}

/// How many keys each index of `collection` holds, from `validate`.
async fn keys_per_index(client: &Client, database: &str, collection: &str) -> Document {
    let report = client.database(database).run_command(doc! { "validate": collection }).await.unwrap();
    report.get_document("keysPerIndex").unwrap().clone()
}

/// The explained winning plan of the last `find` on `collection` that `log` recorded since
/// `since`, sent with its own filter, sort, hint and limit.
async fn plan_of_find(client: &Client, database: &str, log: &Mutex<Vec<(String, Document)>>, since: usize, collection: &str) -> String {
    let find = log.lock().unwrap()[since..]
        .iter()
        .rev()
        .find(|(name, command)| name == "find" && command.get_str("find") == Ok(collection))
        .map(|(_, command)| command.clone())
        .unwrap_or_else(|| panic!("no find on {collection}"));
    let mut explained = doc! {};
    for field in ["find", "filter", "sort", "hint", "limit"] {
        if let Some(value) = find.get(field) {
            explained.insert(field, value.clone());
        }
    }
    let report =
        client.database(database).run_command(doc! { "explain": explained, "verbosity": "queryPlanner" }).await.unwrap();
    report.get_document("queryPlanner").unwrap().get_document("winningPlan").unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_replaces_superseded_indexes_and_pending_deliveries_stay_out_of_the_dead_letter_ones() {
    let (client, log) = recording_client().await;
    let database = fresh_database();
    let deliveries = client.database(&database).collection::<Document>("relayhost_deliveries");
    let events = client.database(&database).collection::<Document>("relayhost_events");
    // What an earlier version created: every delivery paid for these at fan-out and completion.
    for (collection, keys, name) in [
        (&deliveries, doc! { "handler": 1, "_id": 1 }, "by_handler"),
        (&deliveries, doc! { "status": 1, "updatedAt": 1 }, "status_updated"),
        (&events, doc! { "completedAt": 1 }, "completed"),
        (&events, doc! { "fannedOutAt": 1, "createdAt": 1, "_id": 1 }, "fan_out"),
        (&events, doc! { "createdAt": 1, "_id": 1 }, "unfanned"),
    ] {
        let options = mongodb::options::IndexOptions::builder().name(name.to_string()).build();
        collection.create_index(mongodb::IndexModel::builder().keys(keys).options(options).build()).await.unwrap();
    }
    let store = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(&database).unwrap(), options());
    store.setup().await.unwrap();
    store.setup().await.unwrap();
    let names = deliveries.list_index_names().await.unwrap();
    for gone in ["by_handler", "status_updated", "by_status", "by_event_type", "due"] {
        assert!(!names.iter().any(|n| n == gone), "{gone} is still there: {names:?}");
    }
    let mut event_names = events.list_index_names().await.unwrap();
    event_names.sort();
    assert_eq!(event_names, ["_id_", "by_key", "created", "key_unfanned", "unfanned_by_depth"]);
    let history_names = client.database(&database).collection::<Document>("relayhost_completed_deliveries").list_index_names().await.unwrap();
    assert!(history_names.iter().any(|n| n == "completed"), "the history's own index stays: {history_names:?}");
    let dead_letter_indexes = ["dead_by_id", "dead_updated", "dead_by_handler", "dead_by_event_type"];
    for wanted in dead_letter_indexes.iter().chain(&["claim", "event_handler"]) {
        assert!(names.iter().any(|n| n == wanted), "{wanted} is missing: {names:?}");
    }

    // The fan-out's indexes hold the backlog only: its stamp takes an event out of them.
    publish_all(&store, (0..20).map(|n| event(&format!("e-{n}"), "t")).collect()).await;
    publish_all(&store, (0..3).map(|n| keyed(&format!("k-{n}"), "t", "key")).collect()).await;
    let keys = keys_per_index(&client, &database, "relayhost_events").await;
    assert_eq!((keys.get_i32("unfanned_by_depth").unwrap(), keys.get_i32("key_unfanned").unwrap()), (23, 3), "{keys}");
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0)).await;
    let keys = keys_per_index(&client, &database, "relayhost_events").await;
    assert_eq!((keys.get_i32("unfanned_by_depth").unwrap(), keys.get_i32("key_unfanned").unwrap()), (0, 0), "{keys}");
    assert_eq!(keys.get_i32("created").unwrap(), 23, "{keys}");
    // The purge's look-up of a key's remaining events holds the keyed events only.
    assert_eq!(keys.get_i32("by_key").unwrap(), 3, "{keys}");
    let keys = keys_per_index(&client, &database, "relayhost_deliveries").await;
    // The key's two followers are created parked, behind their predecessors.
    assert_eq!(keys.get_i32("claim").unwrap(), 21, "{keys}");
    assert_eq!((keys.get_i32("parked").unwrap(), keys.get_i32("parked_behind").unwrap()), (2, 2), "{keys}");
    for index in dead_letter_indexes {
        assert_eq!(keys.get_i32(index).unwrap(), 0, "pending deliveries are not dead letters: {keys}");
    }
    let claimed = store.claim(&handlers(&["h"]), 1, at(T0)).await.unwrap();
    store.bury(&claimed[0].lease, "poison", true, at(T0)).await.unwrap();
    let keys = keys_per_index(&client, &database, "relayhost_deliveries").await;
    for index in dead_letter_indexes {
        assert_eq!(keys.get_i32(index).unwrap(), 1, "{keys}");
    }
    // The operator's dead-letter listings, all and by handler or event type, read the
    // dead-letter indexes: their own find commands, explained.
    let dead = Some(relayhost::store::DeliveryStatus::Dead);
    for filter in [
        DeliveryFilter { status: dead, ..Default::default() },
        DeliveryFilter { status: dead, handler: Some("h".into()), ..Default::default() },
        DeliveryFilter { status: dead, event_type: Some("t".into()), ..Default::default() },
    ] {
        let before = log.lock().unwrap().len();
        assert_eq!(store.list_deliveries(&filter).await.unwrap().deliveries.len(), 1);
        let winning = plan_of_find(&client, &database, &log, before, "relayhost_deliveries").await;
        assert!(winning.contains("\"indexName\": \"dead_by_"), "{filter:?}: {winning}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_move_no_event_index_key_and_the_purge_walks_events_in_creation_order() {
    let (client, log) = recording_client().await;
    let database = fresh_database();
    let events = client.database(&database).collection::<Document>("relayhost_events");
    let store = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(&database).unwrap(), options());
    store.setup().await.unwrap();
    publish_all(&store, (0..20).map(|n| event(&format!("e-{n}"), "t")).collect()).await;
    fan_out_all(&store, &subs(&[("h", &["t"])]), at(T0)).await;
    let claimed = store.claim(&handlers(&["h"]), 20, at(T0)).await.unwrap();
    assert_eq!(claimed.len(), 20);

    // A completion stamps its event (`completedAt`) without moving any of the event's index keys.
    let event_keys = keys_per_index(&client, &database, "relayhost_events").await;
    let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
    assert!(store.complete_many(&leases, at(T0)).await.unwrap().iter().all(|s| *s == Settlement::Completed));
    assert_eq!(keys_per_index(&client, &database, "relayhost_events").await, event_keys);
    let stamped = events.count_documents(doc! { "completedAt": { "$type": "date" } }).await.unwrap();
    assert_eq!(stamped, 20);

    // The purge finds expired events by walking `created`, reading `completedAt` on the way,
    // never by sorting what another index returned.
    let before = log.lock().unwrap().len();
    let report = store.purge(&PurgeOptions { dead_before: None, completed_before: Some(at(T0 + 1)) }, at(T0 + 2)).await.unwrap();
    assert_eq!(report.events, 20);
    let plan = plan_of_find(&client, &database, &log, before, "relayhost_events").await;
    assert!(plan.contains("\"indexName\": \"created\"") && !plan.contains("\"stage\": \"SORT\""), "{plan}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_fan_out_hands_out_gets_a_document_only_when_an_outcome_needs_one() {
    let (client, _log) = recording_client().await;
    let database = fresh_database();
    let db = client.database(&database);
    let events = db.collection::<Document>("relayhost_events");
    let deliveries = db.collection::<Document>("relayhost_deliveries");
    let store = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(&database).unwrap(), options());
    store.setup().await.unwrap();
    publish_all(&store, (0..3).map(|n| event(&format!("e-{n}"), "t")).collect()).await;
    let report = store.fan_out(&subs(&[("h", &["t"])]), 100, 10, at(T0)).await.unwrap();
    assert_eq!(report.claimed.len(), 3);
    assert_eq!(deliveries.count_documents(doc! {}).await.unwrap(), 0);
    assert_eq!(events.count_documents(doc! { "handedOut": "h" }).await.unwrap(), 3);
    let lease = |n: usize| report.claimed.iter().find(|c| c.event.id == format!("e-{n}")).unwrap().lease;

    // A completion takes the handler out of its event's list as it stamps the event.
    assert_eq!(store.complete_many(&[lease(0)], at(T0 + 1)).await.unwrap(), [Settlement::Completed]);
    let done = events.find_one(doc! { "_id": "e-0" }).await.unwrap().unwrap();
    assert!(done.get_array("handedOut").unwrap().is_empty());
    assert!(done.get_datetime("completedAt").is_ok());
    assert_eq!(deliveries.count_documents(doc! {}).await.unwrap(), 0);
    // A retry needs a document: it gets one, charged, and the list no longer names it.
    assert_eq!(store.reschedule(&lease(1), at(T0 + 5_000), "503", at(T0 + 1)).await.unwrap(), Settlement::Completed);
    let retried = deliveries.find_one(doc! { "eventId": "e-1" }).await.unwrap().unwrap();
    assert_eq!((retried.get_i32("attempts").unwrap(), retried.get_str("lastError").unwrap()), (1, "503"));
    assert_eq!(retried.get_object_id("_id").unwrap(), lease(1).delivery);
    assert_eq!(events.count_documents(doc! { "handedOut": "h" }).await.unwrap(), 1);

    // With completion history, whose records copy the delivery's document, every one has one.
    let database = fresh_database();
    let history = StoreOptions { completion_history: true, ..options() };
    let store = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(&database).unwrap(), history);
    store.setup().await.unwrap();
    publish_all(&store, (0..3).map(|n| event(&format!("e-{n}"), "t")).collect()).await;
    let report = store.fan_out(&subs(&[("h", &["t"])]), 100, 10, at(T0)).await.unwrap();
    assert_eq!(report.claimed.len(), 3);
    let deliveries = client.database(&database).collection::<Document>("relayhost_deliveries");
    assert_eq!(deliveries.count_documents(doc! {}).await.unwrap(), 3);
}

/// A hand-out lists what it hands out without a document in lanes it holds already, not in
/// the lanes its events hash to: a few lane documents for a batch instead of one for almost
/// every delivery. A takeover of those lanes gives each delivery its document in its event's
/// lane, charged once, and every one runs again from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_out_gathers_deliveries_without_a_document_in_held_lanes_and_a_takeover_places_each_in_its_events_lane() {
    let Recorded { client, log, database, store } = recorded_store().await;
    let db = client.database(&database);
    let (lanes, deliveries) = (db.collection::<Document>("relayhost_lanes"), db.collection::<Document>("relayhost_deliveries"));
    let subscriptions = subs(&[("h", &["t"])]);

    // The first hand-out takes the lanes of its three events; they run and complete.
    let first: Vec<String> = [3, 7, 11].into_iter().map(|lane| id_in_lane("first", lane)).collect();
    publish_all(&store, first.iter().map(|id| event(id, "t")).collect()).await;
    let report = store.fan_out(&subscriptions, 100, 10, at(T0)).await.unwrap();
    let leases: Vec<_> = report.claimed.iter().map(|c| c.lease).collect();
    assert_eq!(store.complete_many(&leases, at(T0)).await.unwrap(), [Settlement::Completed; 3]);

    // 150 events of lanes all over: listed in the three lanes held, up to 64 in each, with
    // one statement.
    let more: Vec<String> = (0..150).map(|n| format!("more-{n}")).collect();
    assert!(more.iter().filter(|id| ![3, 7, 11].contains(&relayhost::lane::lane_of(id))).count() > 100);
    publish_all(&store, more.iter().map(|id| event(id, "t")).collect()).await;
    let before = log.lock().unwrap().len();
    let report = store.fan_out(&subscriptions, 200, 150, at(T0 + 1_000)).await.unwrap();
    assert_eq!(report.claimed.len(), 150);
    // (A take of a lane is a `findAndModify` of its own.)
    let lane_writes: usize = log.lock().unwrap()[before..]
        .iter()
        .filter(|(name, command)| command.get_str(name).is_ok_and(|c| c.ends_with("lanes")))
        .map(|(name, command)| match name.as_str() {
            "update" => command.get_array("updates").unwrap().len(),
            "findAndModify" => 1,
            _ => 0,
        })
        .sum();
    assert_eq!(lane_writes, 1, "one statement for the three lanes held");
    let mut listed: Vec<(i32, usize)> = lanes
        .find(doc! { "owner": { "$ne": null } })
        .await
        .unwrap()
        .try_collect::<Vec<Document>>()
        .await
        .unwrap()
        .iter()
        .map(|lane| (lane.get_i32("_id").unwrap(), lane.get_array("inFlight").unwrap().len()))
        .collect();
    listed.sort();
    assert_eq!(listed, [(3, 64), (7, 64), (11, 22)], "no other lane was taken");
    assert!(report.claimed.iter().all(|c| [3, 7, 11].contains(&c.lease.lane)));
    assert_eq!(deliveries.count_documents(doc! {}).await.unwrap(), 0);

    // The host is gone. Once its leases ran out, another instance takes the three lanes: each
    // delivery gets its document in its event's lane, one attempt charged, and runs again.
    let other = store.instance("other");
    let later = at(T0 + 1_000 + 31_000);
    let mut claimed = Vec::new();
    for _ in 0..10 {
        let more = other.claim(&handlers(&["h"]), 200, later).await.unwrap();
        if more.is_empty() {
            break;
        }
        claimed.extend(more);
    }
    let mut expected: Vec<String> = more.iter().map(|id| format!("{id}/h")).collect();
    expected.sort();
    assert_eq!(ids(&claimed), expected);
    let documents: Vec<Document> = deliveries.find(doc! {}).await.unwrap().try_collect().await.unwrap();
    assert_eq!(documents.len(), 150);
    for document in &documents {
        let event = document.get_str("eventId").unwrap();
        assert_eq!(document.get_i32("laneId").unwrap(), i32::from(relayhost::lane::lane_of(event)), "{document}");
        assert_eq!(document.get_i32("attempts").unwrap(), 1, "{document}");
    }
    assert!(claimed.iter().all(|c| c.attempts == 1));
}

/// A backlog batch whose deliveries all fit in lanes the host holds is listed there first and
/// then marked fanned out without a transaction, in two commands sent at once; its runs get
/// word that their fan-out is done, and complete like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_batch_handed_out_whole_is_listed_first_and_marked_without_a_transaction() {
    let Recorded { log, store, .. } = recorded_store().await;
    let subscriptions = subs(&[("h", &["t"])]);
    hold_lanes(&store, &subscriptions, "first", &[3, 7, 11]).await;
    let events = store.events_collection().clone();

    let more: Vec<String> = (0..150).map(|n| format!("more-{n}")).collect();
    publish_all(&store, more.iter().map(|id| event(id, "t")).collect()).await;
    let before = log.lock().unwrap().len();
    let (early, mut sent) = tokio::sync::mpsc::unbounded_channel();
    let report = store.fan_out_early(&subscriptions, 150, 150, &early, at(T0 + 1_000)).await.unwrap();
    assert_eq!((report.events, report.sent_early, report.lanes.len()), (150, 150, 0));
    let handed = sent.try_recv().unwrap();
    assert_eq!(handed.len(), 150);
    assert!(commit_word(&handed).committed().await);

    let commands: Vec<(String, Document)> = log.lock().unwrap()[before..].to_vec();
    assert!(commands.iter().all(|(name, _)| name != "commitTransaction" && name != "abortTransaction"), "{commands:?}");
    let marks: Vec<&Document> = commands
        .iter()
        .filter(|(name, command)| name == "update" && command.get_str("update") == Ok(events.name()))
        .map(|(_, command)| command)
        .collect();
    assert_eq!(marks.len(), 2, "two commands, one per half of the batch");
    assert!(marks.iter().all(|mark| !mark.contains_key("txnNumber")), "{marks:?}");
    // The lanes were written before the mark.
    let first_mark = commands.iter().position(|(name, command)| name == "update" && command.get_str("update") == Ok(events.name()));
    let lane_write = commands.iter().position(|(name, command)| name == "update" && command.get_str("update").is_ok_and(|c| c.ends_with("lanes")));
    assert!(lane_write.unwrap() < first_mark.unwrap());
    assert_eq!(events.count_documents(doc! { "fanOut": { "$exists": true }, "handedOut": "h" }).await.unwrap(), 150);

    let leases: Vec<_> = handed.iter().map(|c| c.lease).collect();
    assert!(store.complete_many(&leases, at(T0 + 2_000)).await.unwrap().iter().all(|s| *s == Settlement::Completed));
    assert_eq!(events.count_documents(doc! { "handedOut.0": { "$exists": true } }).await.unwrap(), 0);
    assert!(list_all(&store, DeliveryFilter::default()).await.is_empty());
}

/// A plain mark that fails may have marked any of its events: the hand-out sends all it
/// listed as not run, and handing them back gives each marked one its document, while the
/// others stay unfanned for the next fan-out. Nothing is lost or run twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_mark_that_fails_halfway_hands_back_what_it_listed_and_loses_nothing() {
    let Recorded { client, database, store, .. } = recorded_store().await;
    let subscriptions = subs(&[("h", &["t"])]);
    hold_lanes(&store, &subscriptions, "first", &[3, 7, 11]).await;
    let backlog: Vec<String> = (0..100).map(|n| format!("{}-{n:02}", if n % 2 == 0 { "even" } else { "odd" })).collect();
    publish_all(&store, backlog.iter().map(|id| event(id, "t")).collect()).await;
    // The server refuses the mark of the odd events, every time it is sent.
    let db = client.database(&database);
    refuse_marks_but_of(&db, doc! { "_id": { "$regex": "^even-" } }).await;

    let (early, mut sent) = tokio::sync::mpsc::unbounded_channel();
    assert!(store.fan_out_early(&subscriptions, 100, 100, &early, at(T0 + 1_000)).await.is_err());
    hand_back_as_not_run(&store, sent.try_recv().unwrap(), 100).await;
    refuse_marks_but_of(&db, doc! {}).await;
    assert_every_event_runs_once(&store, &subscriptions, backlog).await;
}

/// A plain mark is sent as two commands at once. When one fails while the other is still on
/// its way (here: held up by a transaction that changed its event), the mark gives up only
/// once that one is answered too: had it handed its events back first, the late half would
/// mark its event after the hand-back found it unmarked and left it out of its lane's list,
/// a marked event that nothing lists and nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_mark_gives_up_only_once_neither_half_is_on_its_way() {
    let Recorded { client, database, store, .. } = recorded_store().await;
    let subscriptions = subs(&[("h", &["t"])]);
    hold_lanes(&store, &subscriptions, "first", &[3, 7, 11]).await;
    // One event per half.
    let backlog = vec!["held-up".to_string(), "refused".to_string()];
    publish_all(&store, backlog.iter().map(|id| event(id, "t")).collect()).await;
    let db = client.database(&database);
    refuse_marks_but_of(&db, doc! { "_id": "held-up" }).await;
    let mut holding = client.start_session().await.unwrap();
    holding.start_transaction().await.unwrap();
    let change = doc! { "$set": { "changedBy": "an open transaction" } };
    store.events_collection().update_one(doc! { "_id": "held-up" }, change).session(&mut holding).await.unwrap();
    // Longer than the mark's retries take (1.5 s of pauses).
    let held = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        holding.abort_transaction().await.unwrap();
    });

    let (early, mut sent) = tokio::sync::mpsc::unbounded_channel();
    assert!(store.fan_out_early(&subscriptions, 2, 2, &early, at(T0 + 1_000)).await.is_err());
    assert!(held.is_finished(), "the mark gave up while its held-up half was still on its way");
    hand_back_as_not_run(&store, sent.try_recv().unwrap(), 2).await;
    held.await.unwrap();
    refuse_marks_but_of(&db, doc! {}).await;
    assert_every_event_runs_once(&store, &subscriptions, backlog).await;
}

/// Makes the server refuse to mark an event fanned out unless it matches `allowed` (every
/// event, given `{}`).
async fn refuse_marks_but_of(db: &mongodb::Database, allowed: Document) {
    let validator = match allowed.is_empty() {
        true => doc! {},
        false => doc! { "$or": [{ "fanOut": { "$exists": false } }, allowed] },
    };
    db.run_command(doc! { "collMod": "relayhost_events", "validator": validator, "validationAction": "error" }).await.unwrap();
}

/// The word of the fan-out commit that `handed`, sent together before it, all carry.
fn commit_word(handed: &[ClaimedDelivery]) -> relayhost::store::FanOutCommit {
    let word = handed[0].before_commit.clone().expect("handed out before the commit, with its word");
    assert!(handed.iter().all(|c| c.before_commit.as_ref() == Some(&word)), "one word for the batch");
    word
}

/// Does with a hand-out whose fan-out failed what the dispatcher does: hands its `expected`
/// deliveries back, uncharged.
async fn hand_back_as_not_run(store: &MongoStore, handed: Vec<ClaimedDelivery>, expected: usize) {
    assert_eq!(handed.len(), expected);
    assert!(!commit_word(&handed).committed().await, "their fan-out is not done");
    let leases: Vec<_> = handed.iter().map(|c| c.lease).collect();
    store.release(&leases, at(T0 + 1_000)).await.unwrap();
}

/// Fans out, claims and completes until nothing is left; every event of `backlog` must have
/// run exactly once, uncharged.
async fn assert_every_event_runs_once(store: &MongoStore, subscriptions: &Subscriptions, backlog: Vec<String>) {
    let mut ran = Vec::new();
    for _ in 0..10 {
        let report = store.fan_out(subscriptions, 100, 100, at(T0 + 2_000)).await.unwrap();
        let mut claimed = report.claimed;
        claimed.extend(store.claim(&handlers(&["h"]), 200, at(T0 + 2_000)).await.unwrap());
        if claimed.is_empty() && report.events == 0 {
            break;
        }
        assert!(claimed.iter().all(|c| c.attempts == 0), "handed back uncharged");
        ran.extend(claimed.iter().map(|c| c.event.id.clone()));
        let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
        store.complete_many(&leases, at(T0 + 2_000)).await.unwrap();
    }
    ran.sort();
    let mut expected = backlog;
    expected.sort();
    assert_eq!(ran, expected);
}

/// A host killed while committing its handler's completion leaves its transaction open, and
/// the event it was writing locked, until the server aborts it. A host that takes that lane
/// over cannot charge the lost attempt meanwhile: it leaves the lane waiting and claims from
/// its other lanes, and once the transaction is gone its next claim charges the attempt and
/// runs the delivery again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_held_up_by_a_dead_hosts_transaction_does_not_hold_up_other_lanes() {
    let Recorded { client, store: a, .. } = recorded_store().await;
    let b = a.instance("b");
    let subscriptions = subs(&[("h", &["t"])]);
    let (stuck, other) = (id_in_lane("stuck", 3), id_in_lane("other", 9));
    publish_all(&a, vec![event(&stuck, "t")]).await;
    assert_eq!(a.fan_out(&subscriptions, 10, 10, at(T0)).await.unwrap().claimed.len(), 1);
    // a's handler transaction took the handler out of the event's list, and a died.
    let mut dead = client.start_session().await.unwrap();
    dead.start_transaction().await.unwrap();
    a.events_collection().update_one(doc! { "_id": &stuck }, doc! { "$pull": { "handedOut": "h" } }).session(&mut dead).await.unwrap();
    // Another event waits in a lane nobody holds.
    publish_all(&a, vec![event(&other, "t")]).await;
    assert_eq!(a.fan_out(&subscriptions, 10, 0, at(T0)).await.unwrap().events, 1);

    let later = |ms| at(T0 + 31_000 + ms);
    let h = handlers(&["h"]);
    let claim = b.claim(&h, 10, later(0));
    let claimed = tokio::time::timeout(Duration::from_secs(60), claim).await.expect("the claim does not wait on the lock").unwrap();
    assert_eq!(ids(&claimed), [format!("{other}/h")]);
    dead.abort_transaction().await.unwrap();
    let claimed = b.claim(&h, 10, later(1)).await.unwrap();
    assert_eq!(ids(&claimed), [format!("{stuck}/h")]);
    assert_eq!(claimed[0].attempts, 1, "the lost attempt is charged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_parked_followers_leave_other_keys_flowing() {
    let fixture = MongoFixture::new().await;
    let store = fixture.store();
    let subscriptions = subs(&[("h", &["t"])]);
    let database = fixture.client.database(&fixture.database);
    // Written the way any driver would, in bulk, to keep the test quick.
    let events = database.collection::<Document>("relayhost_events");
    let documents: Vec<Document> = (1..=10_001_i64)
        .map(|n| {
            doc! {
                "_id": format!("hot-{n}"), "type": "t", "payload": {}, "key": "hot", "sequence": n,
                "createdAt": at(T0 - 1_000_000 + n),
            }
        })
        .collect();
    events.insert_many(documents).await.unwrap();
    database
        .collection::<Document>("relayhost_key_sequences")
        .insert_one(doc! { "_id": "hot", "value": 10_001_i64 })
        .await
        .unwrap();
    while store.fan_out(&subscriptions, 1_000, 0, at(T0)).await.unwrap().events > 0 {}

    let head = store.claim(&handlers(&["h"]), 50, at(T0)).await.unwrap();
    assert_eq!(head.len(), 1);
    assert_eq!(head[0].event.sequence, Some(1));
    let stats = store.statistics(at(T0)).await.unwrap();
    assert_eq!(stats[0].parked, 10_000);
    // Every claim asks which handlers have parked deliveries: one index entry per handler
    // read, however many are parked.
    let explained = database
        .run_command(doc! {
            "explain": { "distinct": "relayhost_deliveries", "key": "handler", "query": { "lane": "parked", "handler": { "$in": ["h", "g"] } } },
            "verbosity": "executionStats",
        })
        .await
        .unwrap();
    let examined = explained.get_document("executionStats").unwrap().get("totalKeysExamined").and_then(bson::Bson::as_i32);
    assert!(examined.is_some_and(|keys| keys <= 4), "{explained}");

    // While the head runs, other keys keep flowing, claim after claim.
    for round in 0..5_i64 {
        let now = at(T0 + 1 + round);
        publish_all(store, (0..10).map(|n| keyed(&format!("o-{round}-{n}"), "t", &format!("other-{n}"))).collect()).await;
        fan_out_all(store, &subscriptions, now).await;
        let claimed = store.claim(&handlers(&["h"]), 50, now).await.unwrap();
        assert_eq!(claimed.len(), 10, "round {round}");
        assert!(claimed.iter().all(|c| c.event.key.as_deref() != Some("hot")));
        let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
        store.complete_many(&leases, now).await.unwrap();
    }
    // When the head completes, the key resumes in order.
    store.complete_many(&[head[0].lease], at(T0 + 10)).await.unwrap();
    let next = store.claim(&handlers(&["h"]), 50, at(T0 + 11)).await.unwrap();
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].event.sequence, Some(2));
    let parked = list_all(store, DeliveryFilter { key: Some("hot".into()), limit: 1_000, ..Default::default() }).await;
    assert_eq!(parked.iter().filter(|d| d.lane == "parked").count(), 9_999);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_conflicts_are_retried_until_both_publishers_commit() {
    let fixture = MongoFixture::new().await;
    let store = fixture.store();
    let started = Instant::now();
    // Ten publishers of one key at once: all conflict on the counter, all eventually commit.
    let workers: Vec<MongoStore> = (0..10).map(|n| fixture.worker(&format!("p{n}"))).collect();
    let results = futures::future::join_all(
        workers.iter().enumerate().map(|(n, w)| publish(w, keyed(&format!("e-{n}"), "t", "contended"))),
    )
    .await;
    let mut sequences: Vec<i64> = results
        .into_iter()
        .map(|r| match r.unwrap() {
            Published::New { sequence: Some(n) } => n,
            other => panic!("{other:?}"),
        })
        .collect();
    sequences.sort();
    assert_eq!(sequences, (1..=10).collect::<Vec<_>>());
    assert!(started.elapsed() < Duration::from_secs(120));
    assert_eq!(fan_out_all(store, &subs(&[("h", &["t"])]), at(T0)).await, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_server_keeps_its_data_across_restarts_on_another_port() {
    use relayhost::mongod::{Mongod, MongodOptions, find_binary};
    let dir = std::env::temp_dir().join(format!("relayhost-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = Mongod::start(MongodOptions::new(find_binary().unwrap(), dir.clone())).await.unwrap();
    let client = Client::with_uri_str(first.uri()).await.unwrap();
    client.database("kept").collection::<Document>("things").insert_one(doc! { "_id": 1 }).await.unwrap();
    drop(client);
    let first_port = first.port();
    first.stop();
    // The replica set config names the first port; the restart must adopt its new one.
    let second = Mongod::start(MongodOptions::new(find_binary().unwrap(), dir.clone())).await.unwrap();
    assert_ne!(second.port(), first_port);
    let client = Client::with_uri_str(second.uri()).await.unwrap();
    assert!(client.database("kept").collection::<Document>("things").find_one(doc! { "_id": 1 }).await.unwrap().is_some());
    let store = MongoStore::new(client, MongoLocation::with_default_prefix("restarted").unwrap(), options());
    store.setup().await.unwrap();
    drop(store);
    second.stop();
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_open_transactions_of_a_host_that_stopped_announcing_itself_are_ended_once() {
    // A killed host's open transaction keeps the documents it wrote locked until the server's
    // transaction lifetime (15 s on the test server, a minute by default). Its client named
    // itself in its announcement: a third of a lease after that lapsed, a live host ends its
    // sessions. A live host's, or a host's that lapsed only just, stay open.
    let lease = Duration::from_secs(3);
    let own_name = format!("relayhost self-{}", fresh_database());
    let fixture =
        MongoFixture::with_options(StoreOptions { lease_duration: lease, client_app_name: Some(own_name.clone()), ..options() }).await;
    let database = fixture.client.database(&fixture.database);
    let projections = database.collection::<Document>("projections");
    let hosts = database.collection::<Document>("relayhost_hosts");
    let uri = relayhost::mongod::process_server().unwrap();
    let now = bson::DateTime::now();
    let shifted = |ms: i64| bson::DateTime::from_millis(now.timestamp_millis() + ms);
    let lease_ms = lease.as_millis() as i64;
    let mut open = Vec::new();
    // (The sibling is another instance of this process, on its client: its own sessions.)
    let hosts_before = [("dead", shifted(-lease_ms)), ("alive", shifted(lease_ms)), ("recent", shifted(-1)), ("sibling", shifted(-lease_ms))];
    for (name, expires_at) in hosts_before {
        projections.insert_one(doc! { "_id": name }).await.unwrap();
        let app_name = if name == "sibling" { own_name.clone() } else { format!("relayhost {name}-{}", fixture.database) };
        let mut client_options = ClientOptions::parse(uri.to_string()).await.unwrap();
        client_options.app_name = Some(app_name.clone());
        let client = Client::with_options(client_options).unwrap();
        let mut session = client.start_session().await.unwrap();
        session.start_transaction().await.unwrap();
        let theirs = client.database(&fixture.database).collection::<Document>("projections");
        theirs.update_one(doc! { "_id": name }, doc! { "$set": { "by": name } }).session(&mut session).await.unwrap();
        hosts.insert_one(doc! { "_id": format!("{name}/1"), "owner": name, "expiresAt": expires_at, "appName": app_name }).await.unwrap();
        open.push((name, client, session));
    }
    // A lapsed host whose client had no name: nothing to end.
    hosts.insert_one(doc! { "_id": "anonymous/1", "owner": "anonymous", "expiresAt": shifted(-lease_ms) }).await.unwrap();
    // Whether a transaction may write the document now (a held one conflicts at once).
    let free = async |id: &str| {
        let mut session = fixture.client.start_session().await.unwrap();
        session.start_transaction().await.unwrap();
        let written = projections.update_one(doc! { "_id": id }, doc! { "$set": { "next": true } }).session(&mut session).await;
        let _ = session.abort_transaction().await;
        written.is_ok()
    };
    assert!(!free("dead").await && !free("alive").await && !free("recent").await, "every one is held before");

    assert_eq!(fixture.store.announce(now).await.unwrap(), 2, "itself and the live host");
    assert_eq!(fixture.store.dead_hosts_sessions_ended(), 1, "counted for /metrics");
    assert!(free("dead").await, "the dead host's transaction is ended");
    assert!(!free("alive").await, "a live host's is not");
    assert!(!free("recent").await, "nor one that lapsed less than a third of a lease ago");
    assert!(!free("sibling").await, "nor this host's own client's");
    let ended_at = |id: &str| {
        let (hosts, id) = (hosts.clone(), id.to_string());
        async move { hosts.find_one(doc! { "_id": id }).await.unwrap().unwrap().get_datetime("endedAt").ok().copied() }
    };
    assert_eq!(ended_at("dead/1").await, Some(now));
    assert_eq!((ended_at("anonymous/1").await, ended_at("sibling/1").await), (None, None));

    // Later, the one that lapsed just now is ended too; the dead one is not ended again.
    let later = shifted(lease_ms / 3 + 1);
    assert_eq!(fixture.store.announce(later).await.unwrap(), 2);
    assert!(free("recent").await && !free("alive").await);
    assert_eq!(fixture.store.dead_hosts_sessions_ended(), 2);
    assert_eq!((ended_at("dead/1").await, ended_at("recent/1").await), (Some(now), Some(later)));
    for (name, _client, mut session) in open {
        let committed = session.commit_transaction().await;
        assert_eq!(committed.is_ok(), name == "alive" || name == "sibling", "{name}: {committed:?}");
    }
    // A host ended while it was alive after all is live again at its next announcement.
    let own = hosts.find_one(doc! { "owner": "test-worker" }).await.unwrap().unwrap().get_str("_id").unwrap().to_string();
    hosts.update_one(doc! { "_id": &own }, doc! { "$set": { "endedAt": now } }).await.unwrap();
    fixture.store.announce(later).await.unwrap();
    assert_eq!(ended_at(&own).await, None);
}
