//! The stores a claim test runs on (test code only): both, each with three instances sharing
//! their data ([`both_stores`]), a MongoDB store on the test process's replica set, and the
//! claim's parts of each ([`Parts`]). `faults` and `takeover_states` run every scenario here.

use std::future::Future;

use bson::DateTime;

use super::ClaimBackend;
use crate::store::memory::MemoryStore;
use crate::store::mongo::{MongoLocation, MongoStore};
use crate::store::{Outbox, StoreOptions};

pub(super) const T0: i64 = 1_900_000_000_000;

pub(super) fn options(owner: &str) -> StoreOptions {
    StoreOptions { owner: owner.to_string(), ..StoreOptions::default() }
}

pub(super) async fn mongo_store() -> MongoStore {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let uri = crate::mongod::process_server().unwrap_or_else(|e| panic!("starting the test mongod: {e}"));
    let client = mongodb::Client::with_uri_str(uri).await.unwrap();
    let database = format!("f{}_{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
    let store = MongoStore::new(client, MongoLocation::with_default_prefix(database).unwrap(), options("a"));
    store.setup().await.unwrap();
    store
}

macro_rules! both_stores {
    ($name:ident, $body:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                let first = super::MemoryStore::new(super::options("a"));
                let second = first.instance("b");
                let third = first.instance("c");
                super::$body(&first, &second, &third).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mongo() {
                let first = super::mongo_store().await;
                let (second, third) = (first.instance("b"), first.instance("c"));
                super::$body(&first, &second, &third).await;
            }
        }
    };
}
pub(super) use both_stores;

pub(super) trait Parts {
    fn parts(&self) -> (impl ClaimBackend + Send + '_, &super::Claimer);
    /// The plain mark of the fan-out `fan_out`, which listed `event`'s delivery to `handler`
    /// and handed it out, landing only now; whether it marked the event.
    fn mark_late(&self, event: &str, handler: &str, fan_out: bson::oid::ObjectId, now: DateTime) -> impl Future<Output = bool>;
}
impl Parts for MemoryStore {
    fn parts(&self) -> (impl ClaimBackend + Send + '_, &super::Claimer) {
        self.claim_parts()
    }
    fn mark_late(&self, event: &str, handler: &str, fan_out: bson::oid::ObjectId, now: DateTime) -> impl Future<Output = bool> {
        MemoryStore::mark_late(self, event, handler, fan_out, now)
    }
}
impl Parts for MongoStore {
    fn parts(&self) -> (impl ClaimBackend + Send + '_, &super::Claimer) {
        self.claim_parts()
    }
    fn mark_late(&self, event: &str, handler: &str, fan_out: bson::oid::ObjectId, _now: DateTime) -> impl Future<Output = bool> {
        MongoStore::mark_late(self, event, handler, fan_out, false)
    }
}

