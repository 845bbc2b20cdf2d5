//! The transaction capability of transactional handlers, over the delivery's store
//! transaction, whichever the store ([`HandlerDocuments`]).
//!
//! This module owns the translation between what a plugin asks through the `transaction`
//! import (relaxed extended JSON text) and the delivery's transaction, so that the handler's
//! writes, its follow-up events and the delivery's completion commit together. Grants and
//! limits are checked by the plugin layer before a call gets here; this module refuses what
//! no grant can make safe (server-side JavaScript) and stops a `find` at the bytes the plugin
//! may be handed. Follow-up events are kept until the handler returned and published just
//! before the commit ([`publish_follow_ups`]): a keyed one takes its key's counter then, so a
//! handler never holds a publisher's key for its run time. It must never commit or abort: the
//! runner does, after the handler returned.

use std::sync::Arc;

use bson::{Bson, Document};
use tokio::sync::Mutex;

use crate::event::NewEvent;
use crate::plugin::{CapabilityFuture, TransactionCapability};
use crate::store::handler_documents::{Found, Update};
use crate::store::{HandlerDocuments, Store, StoreError};

/// Operators that run JavaScript on the server: never accepted from a plugin.
const SERVER_SIDE_CODE: [&str; 3] = ["$where", "$function", "$accumulator"];

/// A delivery's transaction, shared between the running handler and the runner that commits
/// it afterwards.
pub type SharedTx<T> = Arc<Mutex<T>>;

/// What went wrong with a handler's transaction during its run, for the caller to decide on.
#[derive(Debug, Default)]
pub struct Trouble {
    /// The first transient error a call met (a write conflict with another transaction, a
    /// step-down). The transaction cannot commit after one, whatever the handler made of the
    /// error, so the caller runs the handler again in a new transaction.
    pub transient: Option<StoreError>,
    /// The first call that failed otherwise (the store refused it). The store aborts the
    /// transaction then, so a handler that goes on meets a transient error of its own making,
    /// which running it again would only repeat.
    pub failed_call: Option<String>,
}

/// The [`Trouble`] of one run, shared between the capability and the caller.
pub type SharedTrouble = Arc<std::sync::Mutex<Trouble>>;

/// The follow-up events a handler published, to be published at its commit.
pub type FollowUps = Arc<std::sync::Mutex<Vec<NewEvent>>>;

/// A write a handler's call made (kept while a plugin is tried, see [`Journal`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "call", rename_all = "lowercase")]
pub enum Write {
    Insert { collection: String, document: String },
    Update { collection: String, filter: String, update: String, matched: u64 },
    Delete { collection: String, filter: String, deleted: u64 },
}

/// The writes of one run, in order.
pub type Journal = Arc<std::sync::Mutex<Vec<Write>>>;

/// The `transaction` import of one transactional delivery.
pub struct HandlerTransaction<T> {
    tx: SharedTx<T>,
    follow_ups: FollowUps,
    transient: SharedTrouble,
    journal: Option<Journal>,
}

impl<T: HandlerDocuments> HandlerTransaction<T> {
    pub fn new(tx: SharedTx<T>, follow_ups: FollowUps, transient: SharedTrouble) -> Self {
        Self { tx, follow_ups, transient, journal: None }
    }

    /// The same, keeping each write it makes in `journal`.
    pub fn journaled(self, journal: Journal) -> Self {
        Self { journal: Some(journal), ..self }
    }

    fn keep(&self, write: impl FnOnce() -> Write) {
        if let Some(journal) = &self.journal {
            journal.lock().expect("the journal").push(write());
        }
    }

    /// The error as the plugin sees it; a transient one is also kept for the caller.
    fn failed(&self, error: StoreError) -> String {
        let message = match &error {
            StoreError::Mongo(error) => format!("MongoDB refused it: {error}"),
            other => other.to_string(),
        };
        let mut trouble = self.transient.lock().expect("transient error slot");
        if error.is_transient() {
            trouble.transient.get_or_insert(error);
        } else if matches!(error, StoreError::Mongo(_) | StoreError::Refused(_)) {
            trouble.failed_call.get_or_insert_with(|| message.clone());
        }
        message
    }
}

fn parse_document(what: &str, json: &str) -> Result<Document, String> {
    let value: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("{what} is not JSON: {e}"))?;
    match Bson::try_from(value).map_err(|e| format!("{what} is not extended JSON: {e}"))? {
        Bson::Document(document) => {
            refuse_server_side_code(what, &Bson::Document(document.clone()))?;
            Ok(document)
        }
        other => Err(format!("{what} must be a JSON object, found {}", crate::event::bson_type_name(&other))),
    }
}

fn refuse_server_side_code(what: &str, value: &Bson) -> Result<(), String> {
    match value {
        Bson::Document(document) => {
            for (key, inner) in document {
                if SERVER_SIDE_CODE.contains(&key.as_str()) {
                    return Err(format!("{what} uses `{key}`: server-side JavaScript is not available to plugins"));
                }
                refuse_server_side_code(what, inner)?;
            }
            Ok(())
        }
        Bson::Array(items) => items.iter().try_for_each(|item| refuse_server_side_code(what, item)),
        _ => Ok(()),
    }
}

fn to_json(value: Bson) -> String {
    value.into_relaxed_extjson().to_string()
}

impl<T: HandlerDocuments + 'static> TransactionCapability for HandlerTransaction<T> {
    fn insert<'a>(&'a mut self, collection: &'a str, document: &'a str) -> CapabilityFuture<'a, String> {
        Box::pin(async move {
            let document = parse_document("the document", document)?;
            let kept = self.journal.is_some().then(|| document.clone());
            let inserted = self.tx.lock().await.insert_document(collection, document).await.map_err(|e| self.failed(e))?;
            if let Some(mut document) = kept {
                document.insert("_id", inserted.clone());
                self.keep(|| Write::Insert { collection: collection.to_string(), document: to_json(Bson::Document(document)) });
            }
            Ok(to_json(inserted))
        })
    }

    fn update<'a>(&'a mut self, collection: &'a str, filter: &'a str, update: &'a str) -> CapabilityFuture<'a, u64> {
        Box::pin(async move {
            let filter = parse_document("the filter", filter)?;
            let update_text = self.journal.is_some().then(|| update.to_string());
            let value: serde_json::Value = serde_json::from_str(update).map_err(|e| format!("the update is not JSON: {e}"))?;
            let update = Bson::try_from(value).map_err(|e| format!("the update is not extended JSON: {e}"))?;
            refuse_server_side_code("the update", &update)?;
            let update = match update {
                Bson::Document(document) => Update::Document(document),
                Bson::Array(stages) => Update::Pipeline(
                    stages
                        .into_iter()
                        .map(|stage| match stage {
                            Bson::Document(stage) => Ok(stage),
                            _ => Err("every stage of an update pipeline must be an object".to_string()),
                        })
                        .collect::<Result<Vec<Document>, String>>()?,
                ),
                _ => return Err("the update must be an object or a pipeline".to_string()),
            };
            let shown = update_text.map(|update| (to_json(Bson::Document(filter.clone())), update));
            let matched = self.tx.lock().await.update_documents(collection, filter, update).await.map_err(|e| self.failed(e))?;
            if let Some((filter, update)) = shown {
                self.keep(|| Write::Update { collection: collection.to_string(), filter, update, matched });
            }
            Ok(matched)
        })
    }

    fn delete<'a>(&'a mut self, collection: &'a str, filter: &'a str) -> CapabilityFuture<'a, u64> {
        Box::pin(async move {
            let filter = parse_document("the filter", filter)?;
            let shown = self.journal.is_some().then(|| to_json(Bson::Document(filter.clone())));
            let deleted = self.tx.lock().await.delete_documents(collection, filter).await.map_err(|e| self.failed(e))?;
            if let Some(filter) = shown {
                self.keep(|| Write::Delete { collection: collection.to_string(), filter, deleted });
            }
            Ok(deleted)
        })
    }

    fn find<'a>(&'a mut self, collection: &'a str, filter: &'a str, limit: u32, max_bytes: usize) -> CapabilityFuture<'a, Vec<String>> {
        Box::pin(async move {
            let filter = parse_document("the filter", filter)?;
            let found = self.tx.lock().await.find_documents(collection, filter, limit, max_bytes).await;
            match found.map_err(|e| self.failed(e))? {
                Found::Documents(documents) => Ok(documents.into_iter().map(|document| to_json(Bson::Document(document))).collect()),
                Found::TooLarge => Err(format!(
                    "the documents found pass the {max_bytes} bytes a call may return (the plugin's `returned` limit); \
                     narrow the filter or lower the limit"
                )),
            }
        })
    }

    fn publish(&mut self, event: NewEvent) -> CapabilityFuture<'_, ()> {
        self.follow_ups.lock().expect("follow-ups").push(event);
        Box::pin(async { Ok(()) })
    }
}

/// Publishes the follow-ups a handler published, in its transaction, just before the commit.
/// An id that exists already is skipped, as any publisher's is.
pub async fn publish_follow_ups<S: Store>(store: &S, tx: &mut S::Tx, follow_ups: &FollowUps) -> Result<(), StoreError> {
    let events = std::mem::take(&mut *follow_ups.lock().expect("follow-ups"));
    for event in &events {
        store.publish(tx, event).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    #[test]
    fn server_side_javascript_is_refused_at_any_depth() {
        for hostile in [
            r#"{"$where": "sleep(100000)"}"#,
            r#"{"a": {"$expr": {"$function": {"body": "x", "args": [], "lang": "js"}}}}"#,
            r#"{"$or": [{"b": 1}, {"$where": "true"}]}"#,
        ] {
            let error = parse_document("the filter", hostile).unwrap_err();
            assert!(error.contains("server-side JavaScript"), "{error}");
        }
        assert_eq!(parse_document("the filter", r#"{"total": {"$gt": 10}}"#).unwrap(), doc! { "total": { "$gt": 10 } });
        assert!(parse_document("the document", "[1]").unwrap_err().contains("must be a JSON object"));
        let with_date = parse_document("the document", r#"{"at": {"$date": "2026-12-01T00:00:00Z"}}"#).unwrap();
        assert!(with_date.get_datetime("at").is_ok());
    }
}
