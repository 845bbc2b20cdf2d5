//! Wakeups for new events: a change stream on the events collection, so a host hears of a
//! commit within milliseconds instead of at its next poll.
//!
//! This module owns the stream's life: opening it, resuming it after errors from the last
//! token seen (or afresh when that history is gone), and polling in its place, logged with the
//! reason, while it cannot be opened. It never decides what is delivered: it passes the
//! inserted events on to the fan-out as a hint (which saves that fan-out reading them, and
//! which it checks in its transaction) and says "look now"; fan-out and claims decide.

use std::sync::Arc;
use std::time::Duration;

use bson::{Bson, Document, doc};
use futures::StreamExt;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::MongoStore;

/// Largest event passed on with its change; a larger one is read by the fan-out instead.
const HEARD_DOCUMENT_BYTES: i32 = 1024 * 1024;

/// Longest pause between attempts to reopen a failed change stream.
const MAX_REOPEN_BACKOFF: Duration = Duration::from_secs(30);

/// Change-stream wakeups of one host.
#[derive(Debug, Clone)]
pub struct EventWakeups {
    /// How often the waker is poked while the change stream is down.
    pub fallback_poll: Duration,
}

impl Default for EventWakeups {
    fn default() -> Self {
        Self { fallback_poll: Duration::from_millis(250) }
    }
}

impl EventWakeups {
    /// Pokes `waker` for every batch of inserted events until the returned task is aborted.
    pub fn spawn(self, store: &MongoStore, waker: Arc<Notify>) -> JoinHandle<()> {
        let events = store.events_collection().clone();
        let heard = store.heard.clone();
        tokio::spawn(async move {
            let mut resume = None;
            let mut backoff = self.fallback_poll;
            loop {
                // Only inserts matter: the event, and the fields the driver needs to resume. A
                // large event comes without its document (and is read by the fan-out): the
                // heard events a host keeps are bounded in bytes, not only in number.
                let opened = events
                    .watch()
                    .pipeline([
                        doc! { "$match": { "operationType": "insert" } },
                        doc! { "$project": {
                            "_id": 1, "operationType": 1, "ns": 1,
                            "fullDocument": { "$cond": [
                                { "$lte": [{ "$bsonSize": "$fullDocument" }, HEARD_DOCUMENT_BYTES] },
                                "$fullDocument",
                                "$$REMOVE",
                            ] },
                        } },
                    ])
                    .resume_after(resume.clone())
                    .await;
                let reason = match opened {
                    Ok(stream) => {
                        let mut stream = stream.with_type::<Document>();
                        tracing::debug!("change stream on the events collection is open");
                        // Events may have been committed while the stream was down.
                        if resume.is_none() {
                            heard.missed_some();
                        }
                        waker.notify_one();
                        backoff = self.fallback_poll;
                        loop {
                            match stream.next().await {
                                Some(Ok(mut change)) => {
                                    tracing::trace!("new event");
                                    match change.remove("fullDocument") {
                                        Some(Bson::Document(event)) => heard.push(event),
                                        _ => heard.missed_some(),
                                    }
                                    waker.notify_one();
                                    resume = stream.resume_token();
                                }
                                Some(Err(error)) => break error.to_string(),
                                None => break "the change stream ended".to_string(),
                            }
                            resume = stream.resume_token().or(resume);
                        }
                    }
                    Err(error) => {
                        if is_history_lost(&error) {
                            // Resuming is impossible; start afresh (the poke below covers the gap).
                            resume = None;
                        }
                        error.to_string()
                    }
                };
                tracing::warn!(
                    %reason,
                    poll = ?self.fallback_poll,
                    retry_in = ?backoff,
                    "change stream on the events collection failed; polling until it reopens"
                );
                let until = tokio::time::Instant::now() + backoff;
                while tokio::time::Instant::now() < until {
                    tokio::time::sleep(self.fallback_poll).await;
                    waker.notify_one();
                }
                backoff = (backoff * 2).min(MAX_REOPEN_BACKOFF);
            }
        })
    }
}

/// The resume point fell off the oplog (`ChangeStreamHistoryLost` 286, or a fatal stream error 280).
fn is_history_lost(error: &mongodb::error::Error) -> bool {
    matches!(*error.kind, mongodb::error::ErrorKind::Command(ref c) if c.code == 286 || c.code == 280)
}
