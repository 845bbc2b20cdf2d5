//! The transaction capability of transactional handlers, over a MongoDB store transaction.
//!
//! This module owns the translation between what a plugin asks through the `transaction`
//! import (relaxed extended JSON text) and the delivery's `MongoTx`, so that the handler's
//! writes, its follow-up events and the delivery's completion commit together. Grants and
//! limits are checked by the plugin layer before a call gets here; this module refuses what
//! no grant can make safe (server-side JavaScript) and stops reading a `find` at the bytes
//! the plugin may be handed. Follow-up events are kept until the handler returned and
//! published just before the commit ([`publish_follow_ups`]): a keyed one takes its key's
//! counter then, so a handler never holds a publisher's key for its run time. It must never
//! commit or abort: the dispatcher does, after the handler returned.

use std::sync::Arc;

use bson::{Bson, Document};
use futures::TryStreamExt;
use mongodb::Database;
use tokio::sync::Mutex;

use crate::event::NewEvent;
use crate::plugin::{CapabilityFuture, TransactionCapability};
use crate::publish::Publisher;
use crate::store::StoreError;
use crate::store::mongo::MongoTx;

/// Operators that run JavaScript on the server: never accepted from a plugin.
const SERVER_SIDE_CODE: [&str; 3] = ["$where", "$function", "$accumulator"];

/// A delivery's transaction, shared between the running handler and the dispatcher that
/// commits it afterwards.
pub type SharedTx = Arc<Mutex<MongoTx>>;

/// What went wrong with a handler's transaction during its run, for the caller to decide on.
#[derive(Debug, Default)]
pub struct Trouble {
    /// The first transient error a call met (a write conflict with another transaction, a
    /// step-down). The transaction cannot commit after one, whatever the handler made of the
    /// error, so the caller runs the handler again in a new transaction.
    pub transient: Option<StoreError>,
    /// The first call that failed otherwise (MongoDB refused it). The server aborts the
    /// transaction then, so a handler that goes on meets a transient error of its own making,
    /// which running it again would only repeat.
    pub failed_call: Option<String>,
}

/// The [`Trouble`] of one run, shared between the capability and the caller.
pub type SharedTrouble = Arc<std::sync::Mutex<Trouble>>;

/// The follow-up events a handler published, to be published at its commit.
pub type FollowUps = Arc<std::sync::Mutex<Vec<NewEvent>>>;

/// The `transaction` import of one transactional delivery.
pub struct MongoHandlerTransaction {
    tx: SharedTx,
    database: Database,
    follow_ups: FollowUps,
    transient: SharedTrouble,
}

impl MongoHandlerTransaction {
    pub fn new(tx: SharedTx, database: Database, follow_ups: FollowUps, transient: SharedTrouble) -> Self {
        Self { tx, database, follow_ups, transient }
    }

    /// The error as the plugin sees it; a transient one is also kept for the caller.
    fn failed(&self, error: impl Into<StoreError>) -> String {
        let error = error.into();
        let message = match &error {
            StoreError::Mongo(error) => format!("MongoDB refused it: {error}"),
            other => other.to_string(),
        };
        let mut trouble = self.transient.lock().expect("transient error slot");
        if error.is_transient() {
            trouble.transient.get_or_insert(error);
        } else if matches!(error, StoreError::Mongo(_)) {
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

impl TransactionCapability for MongoHandlerTransaction {
    fn insert<'a>(&'a mut self, collection: &'a str, document: &'a str) -> CapabilityFuture<'a, String> {
        Box::pin(async move {
            let document = parse_document("the document", document)?;
            let mut tx = self.tx.lock().await;
            let result = self
                .database
                .collection::<Document>(collection)
                .insert_one(document)
                .session(tx.session())
                .await
                .map_err(|e| self.failed(e))?;
            Ok(to_json(result.inserted_id))
        })
    }

    fn update<'a>(&'a mut self, collection: &'a str, filter: &'a str, update: &'a str) -> CapabilityFuture<'a, u64> {
        Box::pin(async move {
            let filter = parse_document("the filter", filter)?;
            let value: serde_json::Value = serde_json::from_str(update).map_err(|e| format!("the update is not JSON: {e}"))?;
            let update = Bson::try_from(value).map_err(|e| format!("the update is not extended JSON: {e}"))?;
            refuse_server_side_code("the update", &update)?;
            let update: mongodb::options::UpdateModifications = match update {
                Bson::Document(document) => document.into(),
                Bson::Array(stages) => stages
                    .into_iter()
                    .map(|stage| match stage {
                        Bson::Document(stage) => Ok(stage),
                        _ => Err("every stage of an update pipeline must be an object".to_string()),
                    })
                    .collect::<Result<Vec<Document>, String>>()?
                    .into(),
                _ => return Err("the update must be an object or a pipeline".to_string()),
            };
            let mut tx = self.tx.lock().await;
            let result = self
                .database
                .collection::<Document>(collection)
                .update_many(filter, update)
                .session(tx.session())
                .await
                .map_err(|e| self.failed(e))?;
            Ok(result.matched_count)
        })
    }

    fn delete<'a>(&'a mut self, collection: &'a str, filter: &'a str) -> CapabilityFuture<'a, u64> {
        Box::pin(async move {
            let filter = parse_document("the filter", filter)?;
            let mut tx = self.tx.lock().await;
            let result = self
                .database
                .collection::<Document>(collection)
                .delete_many(filter)
                .session(tx.session())
                .await
                .map_err(|e| self.failed(e))?;
            Ok(result.deleted_count)
        })
    }

    fn find<'a>(&'a mut self, collection: &'a str, filter: &'a str, limit: u32, max_bytes: usize) -> CapabilityFuture<'a, Vec<String>> {
        Box::pin(async move {
            let filter = parse_document("the filter", filter)?;
            let mut tx = self.tx.lock().await;
            let session = tx.session();
            // Small batches, read one document at a time: the host holds at most one batch
            // beyond what the plugin may be handed.
            let mut cursor = self
                .database
                .collection::<Document>(collection)
                .find(filter)
                .limit(i64::from(limit.clamp(1, 1_000)))
                .batch_size(16)
                .session(&mut *session)
                .await
                .map_err(|e| self.failed(e))?;
            let (mut found, mut bytes) = (Vec::new(), 0_usize);
            let mut stream = cursor.stream(&mut *session);
            while let Some(document) = stream.try_next().await.map_err(|e| self.failed(e))? {
                let json = to_json(Bson::Document(document));
                bytes += json.len();
                if bytes > max_bytes {
                    return Err(format!(
                        "the documents found pass the {max_bytes} bytes a call may return (the plugin's `returned` limit); \
                         narrow the filter or lower the limit"
                    ));
                }
                found.push(json);
            }
            Ok(found)
        })
    }

    fn publish(&mut self, event: NewEvent) -> CapabilityFuture<'_, ()> {
        self.follow_ups.lock().expect("follow-ups").push(event);
        Box::pin(async { Ok(()) })
    }
}

/// Publishes the follow-ups a handler published, in its transaction, just before the commit.
/// An id that exists already is skipped, as any publisher's is.
pub async fn publish_follow_ups(tx: &mut MongoTx, publisher: &Publisher, follow_ups: &FollowUps) -> Result<(), StoreError> {
    let events = std::mem::take(&mut *follow_ups.lock().expect("follow-ups"));
    for event in &events {
        publisher.publish(tx.session(), event).await?;
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
