//! A transactional handler end to end: the audit-log plugin (a real component) writes through
//! the transaction capability into the delivery's store transaction, and its write and the
//! delivery's completion commit together or not at all. The first two tests run on both
//! stores (the memory store's transaction is what `relayhost test-plugin` uses); the rest are
//! about MongoDB's own conflicts, on a real replica set.

#[macro_use]
mod common;

use relayhost::store::{Administration, Outbox};
use std::sync::Arc;
use std::time::Duration;

use bson::{Document, doc};
use common::*;
use relayhost::handler_transaction::HandlerTransaction;
use relayhost::plugin::capability::transaction::Grant as TransactionGrant;
use relayhost::plugin::{DeliveryInfo, Grants, Limits, Outcome, PluginPolicy};
use relayhost::store::handler_documents::Found;
use relayhost::store::{ClaimedDelivery, HandlerDocuments, Store, StoreTransaction, Subscription, Subscriptions};

/// The `_id`s of `collection`'s documents, sorted, read in a transaction of `store`.
async fn ids_in<S: Store>(store: &S, collection: &str) -> Vec<String> {
    let mut tx = store.begin().await.unwrap();
    let Found::Documents(documents) = tx.find_documents(collection, doc! {}, 1_000, 1 << 24).await.unwrap() else { panic!("too large") };
    tx.abort().await.unwrap();
    let mut ids: Vec<String> = documents.iter().map(|d| d.get_str("_id").unwrap().to_string()).collect();
    ids.sort();
    ids
}


both_stores!(the_handlers_write_and_the_completion_commit_together, the_dispatcher_runs_plugins_into_an_exact_projection);

async fn the_handlers_write_and_the_completion_commit_together<F: Fixture>() {
    let fixture = F::new().await;
    let store = fixture.store();
    let runtime = plugin_runtime();
    let policy = PluginPolicy {
        limits: Limits { wall_time: Duration::from_secs(10), ..Limits::default() },
        grants: Grants { transaction: TransactionGrant { collections: vec!["audit_log".into(), "audit_order".into()], ..Default::default() }, ..Default::default() },
    };
    let plugin = runtime.load(&plugins_dir().join("audit_log.wasm"), policy).await.unwrap();
    let subscriptions = Subscriptions::new(
        plugin.subscriptions.iter().map(|s| Subscription::new(s.handler.clone(), s.event_types.iter().cloned())),
    )
    .unwrap();
    publish_all(store, vec![keyed("order-1", "order.placed", "c-1"), keyed("order-2", "order.placed", "c-2")]).await;
    fan_out_all(store, &subscriptions, bson::DateTime::now()).await;
    let claimed = store.claim(&handlers(&["audit-log"]), 10, bson::DateTime::now()).await.unwrap();
    assert_eq!(claimed.len(), 2);

    // Run each delivery in its own transaction; commit the first, abort the second.
    for (delivery, commit) in claimed.iter().zip([true, false]) {
        let outcome = run_transactional(store, &runtime, &plugin, delivery, commit).await;
        assert_eq!(outcome, Outcome::Completed);
    }
    assert_eq!(ids_in(store, "audit_log").await, [claimed[0].event.id.clone()], "only the committed delivery's write exists");
    let key = claimed[0].event.key.clone().unwrap();
    assert_eq!(ids_in(store, "audit_order").await, [key], "the committed delivery's key projection, alone");
    // The committed delivery is gone; the aborted one is still pending and runs again.
    let pending = list_all(store, Default::default()).await;
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].event_id, claimed[1].event.id);
}

async fn run_transactional<S: Store>(
    store: &S,
    runtime: &relayhost::plugin::PluginRuntime,
    plugin: &relayhost::plugin::LoadedPlugin,
    delivery: &ClaimedDelivery,
    commit: bool,
) -> Outcome {
    let shared = Arc::new(tokio::sync::Mutex::new(store.begin().await.unwrap()));
    let capability = HandlerTransaction::new(shared.clone(), Default::default(), Default::default());
    let info = DeliveryInfo { handler: delivery.handler.clone(), attempt: 1, max_attempts: 5, deadline: 0, trace_context: Vec::new() };
    let (ran, returned) = runtime.invoke_transactional(plugin, &delivery.event, &info, Box::new(capability)).await;
    drop(returned);
    let mut tx = Arc::try_unwrap(shared).ok().expect("the handler released the transaction").into_inner();
    store.complete_in(&mut tx, &delivery.lease, bson::DateTime::now()).await.unwrap();
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.abort().await.unwrap();
    }
    ran.outcome
}

async fn the_dispatcher_runs_plugins_into_an_exact_projection<F: Fixture>() {
    use relayhost::dispatch::{Dispatcher, DispatcherOptions, RetryPolicy};
    use relayhost::plugin::PluginRegistry;
    use relayhost::plugin_runner::PluginRunner;

    let fixture = F::new().await;
    let store = Arc::new(fixture.worker("dispatcher"));
    let plugins = std::env::temp_dir().join(format!("relayhost-runner-{}-{}", std::process::id(), F::name()));
    let _ = std::fs::remove_dir_all(&plugins);
    std::fs::create_dir_all(&plugins).unwrap();
    for file in ["audit_log", "noop"] {
        std::fs::copy(plugins_dir().join(format!("{file}.wasm")), plugins.join(format!("{file}.wasm"))).unwrap();
    }
    let registry = Arc::new(PluginRegistry::new(Arc::new(plugin_runtime()), &plugins, |name| PluginPolicy {
        grants: Grants {
            transaction: TransactionGrant {
                collections: if name == "audit_log" { vec!["audit_log".into(), "audit_order".into()] } else { vec![] },
                ..Default::default()
            },
            ..Default::default()
        },
        ..Default::default()
    }));
    registry.scan().await.unwrap();
    let events: Vec<_> = (0..30).map(|n| keyed(&format!("order-{n}"), "order.placed", &format!("c-{}", n % 4))).collect();
    publish_all(&*store, events).await;

    let runner = Arc::new(PluginRunner::new(registry, store.clone(), Arc::new(|_: &str, _: &str| RetryPolicy::default())));
    let options = DispatcherOptions { concurrency: 4, poll_interval: Duration::from_millis(20), ..Default::default() };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let loop_store = store.clone();
    let handle = tokio::spawn(async move {
        Dispatcher::new(loop_store, runner, options).run(async { let _ = stopped.await; }).await.unwrap();
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let stats = store.statistics(bson::DateTime::now()).await.unwrap();
        let fanned = fixture.raw_event("order-29").await.unwrap().contains_key("fannedOutAt");
        if fanned && stats.iter().all(|s| s.pending == 0 && s.running == 0) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{stats:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(()).unwrap();
    handle.await.unwrap();

    let ids = ids_in(&*store, "audit_log").await;
    let mut expected: Vec<String> = (0..30).map(|n| format!("order-{n}")).collect();
    expected.sort();
    assert_eq!(ids, expected, "the projection equals the set of events: no gap, no duplicate");
    assert!(dead(&*store).await.is_empty());
    std::fs::remove_dir_all(plugins).unwrap();
}

/// A fresh database, a store instance on it, and a registry of the audit-log plugin (granted
/// its two collections, with `reruns` as its re-runs limit) loaded from a plugin directory of
/// its own, which the caller removes.
async fn audit_log_in_a_fresh_database(
    reruns: u32,
) -> (MongoFixture, Arc<relayhost::store::mongo::MongoStore>, Arc<relayhost::plugin::PluginRegistry>, std::path::PathBuf) {
    let fixture = MongoFixture::new().await;
    let store = Arc::new(fixture.worker("runner"));
    let plugins = std::env::temp_dir().join(format!("relayhost-audit-{}", fixture.database));
    std::fs::create_dir_all(&plugins).unwrap();
    std::fs::copy(plugins_dir().join("audit_log.wasm"), plugins.join("audit_log.wasm")).unwrap();
    let registry = Arc::new(relayhost::plugin::PluginRegistry::new(Arc::new(plugin_runtime()), &plugins, move |_| {
        let mut policy = PluginPolicy {
            grants: Grants { transaction: TransactionGrant { collections: vec!["audit_log".into(), "audit_order".into()], ..Default::default() }, ..Default::default() },
            ..Default::default()
        };
        policy.limits.transaction.reruns = reruns;
        policy
    }));
    registry.scan().await.unwrap();
    (fixture, store, registry, plugins)
}

/// Runs an audit-log delivery while another transaction holds its audit document's id,
/// uncommitted, for `held`; with the plugin's `reruns` limit. The run's result, and the audit
/// document afterwards.
async fn run_beside_a_conflict(reruns: u32, held: Duration) -> (relayhost::dispatch::RunResult, Option<Document>) {
    use relayhost::dispatch::{RetryPolicy, Runner};
    use relayhost::plugin_runner::PluginRunner;

    let (fixture, store, registry, plugins) = audit_log_in_a_fresh_database(reruns).await;
    publish_all(&*store, vec![keyed("order-1", "order.placed", "c-1")]).await;
    fan_out_all(&*store, &subs(&[("audit-log", &["order.placed"])]), bson::DateTime::now()).await;
    let delivery = store.claim(&handlers(&["audit-log"]), 1, bson::DateTime::now()).await.unwrap().remove(0);

    // Another transaction (a killed host's, say) holds the audit document's id, uncommitted.
    // (The collection exists first: two transactions that each create it do not conflict.)
    let audit = fixture.client.database(&fixture.database).collection::<Document>("audit_log");
    fixture.client.database(&fixture.database).create_collection("audit_log").await.unwrap();
    let mut other = fixture.client.start_session().await.unwrap();
    other.start_transaction().await.unwrap();
    audit.insert_one(doc! { "_id": "order-1", "by": "someone else" }).session(&mut other).await.unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(held).await;
        other.abort_transaction().await.unwrap();
    });

    let runner = PluginRunner::new(registry, store.clone(), Arc::new(|_: &str, _: &str| RetryPolicy::default()));
    let result = runner.run(delivery).await;
    release.await.unwrap();
    let record = audit.find_one(doc! { "_id": "order-1" }).await.unwrap();
    std::fs::remove_dir_all(plugins).unwrap();
    (result, record)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactional_plugins_first_deliveries_on_a_fresh_database_run_once_each() {
    // Its granted collections do not exist yet. Created inside the deliveries' transactions,
    // running at once, they would conflict and the plugin would run again; with no re-runs
    // allowed, such a conflict charges the attempt, which the results would show.
    use relayhost::dispatch::{RetryPolicy, RunResult, Runner};
    use relayhost::plugin_runner::PluginRunner;

    let (fixture, store, registry, plugins) = audit_log_in_a_fresh_database(0).await;
    let orders: Vec<_> = (0..8).map(|n| keyed(&format!("order-{n}"), "order.placed", &format!("c-{n}"))).collect();
    publish_all(&*store, orders).await;
    fan_out_all(&*store, &subs(&[("audit-log", &["order.placed"])]), bson::DateTime::now()).await;
    let claimed = store.claim(&handlers(&["audit-log"]), 8, bson::DateTime::now()).await.unwrap();
    assert_eq!(claimed.len(), 8);

    let runner = PluginRunner::new(registry, store.clone(), Arc::new(|_: &str, _: &str| RetryPolicy::default()));
    let results = futures::future::join_all(claimed.into_iter().map(|delivery| runner.run(delivery))).await;
    std::fs::remove_dir_all(plugins).unwrap();
    assert!(results.iter().all(|result| *result == RunResult::CompletedInTransaction), "{results:?}");
    let audit = fixture.client.database(&fixture.database).collection::<Document>("audit_log");
    assert_eq!(audit.count_documents(doc! {}).await.unwrap(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflicting_transaction_makes_the_handler_run_again_not_fail() {
    let (result, record) = run_beside_a_conflict(20, Duration::from_millis(500)).await;
    assert_eq!(result, relayhost::dispatch::RunResult::CompletedInTransaction, "the write conflict re-ran the handler until it went through");
    let record = record.unwrap();
    assert_eq!(record.get_str("type").unwrap(), "order.placed");
    assert_eq!(record.get("attempt").and_then(|a| a.as_i32().map(i64::from).or(a.as_i64())), Some(1), "no attempt was charged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_that_outlasts_the_reruns_charges_the_attempt() {
    // Two re-runs pause 50 and 100 ms: the conflict, held for 3 s, outlasts them.
    let (result, record) = run_beside_a_conflict(2, Duration::from_secs(3)).await;
    match result {
        relayhost::dispatch::RunResult::Attempt(relayhost::dispatch::AttemptResult::Failed(reason)) => {
            assert!(reason.contains("met a transient error 3 times in this attempt (the plugin's `reruns` limit is 2)"), "{reason}");
            assert!(reason.contains("WriteConflict"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(record.is_none(), "nothing of the charged attempt was committed");
}

/// The results of the runs it passes on, in order.
struct Recording<R> {
    inner: R,
    results: Arc<std::sync::Mutex<Vec<(String, relayhost::dispatch::RunResult)>>>,
}

impl<R: relayhost::dispatch::Runner> relayhost::dispatch::Runner for Recording<R> {
    fn handlers(&self) -> Vec<relayhost::dispatch::HandlerSpec> {
        self.inner.handlers()
    }

    fn run(&self, delivery: ClaimedDelivery) -> std::pin::Pin<Box<dyn Future<Output = relayhost::dispatch::RunResult> + Send>> {
        let (run, results) = (self.inner.run(delivery.clone()), self.results.clone());
        Box::pin(async move {
            let result = run.await;
            results.lock().unwrap().push((delivery.handler.clone(), result.clone()));
            result
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactional_handler_beside_another_handler_of_unkeyed_events_runs_once_each() {
    // The no-op plugin completes the same events while the audit log's transactions are open.
    // With no re-runs allowed, a write conflict between the two completions would charge the
    // audit log's attempt, which its recorded results would show.
    use relayhost::dispatch::{Dispatcher, DispatcherOptions, RetryPolicy, RunResult};
    use relayhost::plugin_runner::PluginRunner;

    let (fixture, store, registry, plugins) = audit_log_in_a_fresh_database(0).await;
    std::fs::copy(plugins_dir().join("noop.wasm"), plugins.join("noop.wasm")).unwrap();
    registry.scan().await.unwrap();
    let runner = PluginRunner::new(registry, store.clone(), Arc::new(|_: &str, _: &str| RetryPolicy::default()));
    let results = Arc::default();
    let runner = Arc::new(Recording { inner: runner, results: Arc::clone(&results) });
    let options = DispatcherOptions { concurrency: 8, poll_interval: Duration::from_millis(20), ..Default::default() };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let dispatcher = Dispatcher::new(store.clone(), runner, options);
    let handle = tokio::spawn(async move { dispatcher.run(async { let _ = stopped.await; }).await.unwrap() });
    // Published while the dispatcher runs, so that each is handed out with its fan-out.
    let orders: Vec<_> = (0..40).map(|n| relayhost::event::NewEvent::new(format!("order-{n}"), "order.placed", doc! { "n": n })).collect();
    for chunk in orders.chunks(4) {
        publish_all(&*store, chunk.to_vec()).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while results.lock().unwrap().len() < 80 {
        assert!(std::time::Instant::now() < deadline, "{:?}", results.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(()).unwrap();
    handle.await.unwrap();
    std::fs::remove_dir_all(plugins).unwrap();
    let results = results.lock().unwrap();
    let audited: Vec<&RunResult> = results.iter().filter(|(handler, _)| handler == "audit-log").map(|(_, result)| result).collect();
    assert_eq!(audited.len(), 40, "{results:?}");
    assert!(audited.iter().all(|result| **result == RunResult::CompletedInTransaction), "{audited:?}");
    let audit = fixture.client.database(&fixture.database).collection::<Document>("audit_log");
    assert_eq!(audit.count_documents(doc! {}).await.unwrap(), 40);
}
