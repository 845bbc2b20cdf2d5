//! Claim latency against backlog size, on a real replica set (the pinned mongod).
//!
//! Prints p50 claim latency (a fresh worker taking 100 deliveries, lane discovery included)
//! with 1,000 vs 100,000 pending unkeyed deliveries, and with vs without one key holding
//! 10,000 parked followers, as ratios measured in the same run. Goal: both ratios ≤ 1.5.
//!
//! `cargo bench -p relayhost --bench claim` (set RELAYHOST_MONGOD or run
//! scripts/ensure-mongod.sh first).

use relayhost::store::{Administration, Hosts, Outbox};
use std::time::{Duration, Instant};

use bson::{DateTime, Document, doc};
use mongodb::Client;
use relayhost::store::mongo::{MongoLocation, MongoStore};
use relayhost::store::{StoreOptions, Subscription, Subscriptions};

const ROUNDS: usize = 40;
const BATCH: usize = 100;

fn subscriptions() -> Subscriptions {
    Subscriptions::new([Subscription::new("h", ["t"])]).unwrap()
}

async fn store(client: &Client, name: &str) -> MongoStore {
    let store = MongoStore::new(client.clone(), MongoLocation::with_default_prefix(name).unwrap(), StoreOptions::default());
    client.database(name).drop().await.unwrap();
    store.setup().await.unwrap();
    store
}

/// Inserts events the way any driver would, then fans them out through the store.
async fn backlog(store: &MongoStore, documents: Vec<Document>, due: DateTime) {
    for chunk in documents.chunks(10_000) {
        store.events_collection().insert_many(chunk.to_vec()).await.unwrap();
    }
    while store.fan_out(&subscriptions(), 2_000, 0, due).await.unwrap().events > 0 {}
}

fn unkeyed(count: usize) -> Vec<Document> {
    (0..count)
        .map(|n| doc! { "_id": format!("u-{n}"), "type": "t", "payload": { "n": n as i64 }, "createdAt": DateTime::now() })
        .collect()
}

/// A key with a head and `followers` waiting behind it.
fn hot_key(followers: usize) -> Vec<Document> {
    (1..=followers as i64 + 1)
        .map(|n| doc! { "_id": format!("hot-{n}"), "type": "t", "payload": {}, "key": "hot", "sequence": n, "createdAt": DateTime::now() })
        .collect()
}

/// p50 of a fresh worker's claim of `BATCH`, handed back after each round.
async fn claim_p50(store: &MongoStore) -> Duration {
    let handlers = vec!["h".to_string()];
    let mut samples = Vec::with_capacity(ROUNDS);
    for round in 0..ROUNDS + 3 {
        let worker = store.instance(&format!("bench-{round}"));
        let started = Instant::now();
        let claimed = worker.claim(&handlers, BATCH, DateTime::now()).await.unwrap();
        let elapsed = started.elapsed();
        assert!(!claimed.is_empty());
        let leases: Vec<_> = claimed.iter().map(|c| c.lease).collect();
        worker.release(&leases, DateTime::now()).await.unwrap();
        worker.relinquish().await.unwrap();
        if round >= 3 {
            samples.push(elapsed);
        }
    }
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    let uri = relayhost::mongod::process_server().unwrap_or_else(|e| panic!("starting mongod: {e}"));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let client = Client::with_uri_str(uri).await.unwrap();

        let started = Instant::now();
        let small = store(&client, "bench_small").await;
        backlog(&small, unkeyed(1_000), DateTime::now()).await;
        let large = store(&client, "bench_large").await;
        backlog(&large, unkeyed(100_000), DateTime::now()).await;
        let parked = store(&client, "bench_parked").await;
        // The hot key is due first, so a worker's first claim of one takes its head; its second
        // claim scans the followers (all blocked behind the running head) and parks them.
        let earlier = DateTime::from_millis(DateTime::now().timestamp_millis() - 60_000);
        backlog(&parked, hot_key(10_000), earlier).await;
        backlog(&parked, unkeyed(1_000), DateTime::now()).await;
        let head_worker = parked.instance("head");
        let h = vec!["h".to_string()];
        let head = head_worker.claim(&h, 1, DateTime::now()).await.unwrap();
        assert_eq!(head[0].event.key.as_deref(), Some("hot"));
        let other = head_worker.claim(&h, 1, DateTime::now()).await.unwrap();
        let leases: Vec<_> = other.iter().map(|c| c.lease).collect();
        head_worker.release(&leases, DateTime::now()).await.unwrap();
        let stats = parked.statistics(DateTime::now()).await.unwrap();
        eprintln!("backlogs ready in {:.1} s", started.elapsed().as_secs_f64());
        assert_eq!(stats[0].parked, 10_000, "the followers are parked");

        let small_p50 = claim_p50(&small).await;
        let large_p50 = claim_p50(&large).await;
        let parked_p50 = claim_p50(&parked).await;
        let baseline_p50 = claim_p50(&small).await;

        println!("claim of {BATCH} by a fresh worker, p50 over {ROUNDS} rounds:");
        println!("  1,000 pending unkeyed              {:>8.2} ms", ms(small_p50));
        println!("  100,000 pending unkeyed            {:>8.2} ms", ms(large_p50));
        println!("  1,000 + a key with 10,000 parked   {:>8.2} ms", ms(parked_p50));
        println!("  1,000 again (baseline, re-measured) {:>7.2} ms", ms(baseline_p50));
        let base = small_p50.min(baseline_p50);
        println!("ratio 100,000 / 1,000 pending:     {:.2} (goal <= 1.5)", ratio(large_p50, base));
        println!("ratio 10,000 parked / none:        {:.2} (goal <= 1.5)", ratio(parked_p50, base));
        for name in ["bench_small", "bench_large", "bench_parked"] {
            client.database(name).drop().await.unwrap();
        }
    });
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1_000.0
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}
