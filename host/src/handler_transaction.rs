//! The transaction capability of transactional handlers, over a MongoDB store transaction.
//!
//! This module owns the translation between what a plugin asks through the `transaction`
//! import (relaxed extended JSON text) and the delivery's `MongoTx`, so that the handler's
//! writes, its follow-up events and the delivery's completion commit together. Grants are
//! checked by the plugin layer before a call gets here; this module refuses what no grant can
//! make safe (server-side JavaScript). It must never commit or abort: the dispatcher does,
//! after the handler returned.

use std::sync::Arc;

use bson::{Bson, Document};
use futures::TryStreamExt;
use mongodb::Database;
use tokio::sync::Mutex;

use crate::event::NewEvent;
use crate::plugin::{CapabilityFuture, FollowUpEvent, TransactionCapability};
use crate::publish::Publisher;
use crate::store::StoreError;
use crate::store::mongo::MongoTx;

/// Operators that run JavaScript on the server: never accepted from a plugin.
const SERVER_SIDE_CODE: [&str; 3] = ["$where", "$function", "$accumulator"];

/// A delivery's transaction, shared between the running handler and the dispatcher that
/// commits it afterwards.
pub type SharedTx = Arc<Mutex<MongoTx>>;

/// The first transient transaction error a handler's call met (a write conflict with another
/// transaction, a step-down). The transaction cannot commit after one, whatever the handler
/// made of the error, so the caller runs the handler again in a new transaction.
pub type TransientError = Arc<std::sync::Mutex<Option<StoreError>>>;

/// The `transaction` import of one transactional delivery.
pub struct MongoHandlerTransaction {
    tx: SharedTx,
    database: Database,
    publisher: Publisher,
    /// The id of the event being handled: the causation id of follow-up events.
    causation_id: String,
    transient: TransientError,
}

impl MongoHandlerTransaction {
    pub fn new(tx: SharedTx, database: Database, publisher: Publisher, causation_id: String, transient: TransientError) -> Self {
        Self { tx, database, publisher, causation_id, transient }
    }

    /// The error as the plugin sees it; a transient one is also kept for the caller.
    fn failed(&self, error: impl Into<StoreError>) -> String {
        let error = error.into();
        let message = match &error {
            StoreError::Mongo(error) => format!("MongoDB refused it: {error}"),
            other => other.to_string(),
        };
        if error.is_transient() {
            self.transient.lock().expect("transient error slot").get_or_insert(error);
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

    fn find<'a>(&'a mut self, collection: &'a str, filter: &'a str, limit: u32) -> CapabilityFuture<'a, Vec<String>> {
        Box::pin(async move {
            let filter = parse_document("the filter", filter)?;
            let mut tx = self.tx.lock().await;
            let session = tx.session();
            let documents: Vec<Document> = self
                .database
                .collection::<Document>(collection)
                .find(filter)
                .limit(i64::from(limit.clamp(1, 1_000)))
                .session(&mut *session)
                .await
                .map_err(|e| self.failed(e))?
                .stream(&mut *session)
                .try_collect()
                .await
                .map_err(|e| self.failed(e))?;
            Ok(documents.into_iter().map(|d| to_json(Bson::Document(d))).collect())
        })
    }

    fn publish(&mut self, event: FollowUpEvent) -> CapabilityFuture<'_, ()> {
        Box::pin(async move {
            let payload = parse_document("the payload", &event.payload)?;
            let mut new_event = NewEvent::new(event.id, event.event_type, payload);
            new_event.key = event.key;
            new_event.headers = event.headers.into_iter().collect();
            new_event.causation_id = Some(self.causation_id.clone());
            let mut tx = self.tx.lock().await;
            self.publisher.publish(tx.session(), &new_event).await.map(|_| ()).map_err(|e| self.failed(e))
        })
    }
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
