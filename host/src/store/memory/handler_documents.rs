//! A handler's collections in the memory store: documents kept per collection in the state, so
//! that a transaction's abort takes its handler's writes back with everything else, filtered
//! and updated as [`super::query`] says. A call it refuses (a duplicate `_id`, an operator it
//! does not apply) dooms the transaction as MongoDB's server-side abort does: later calls and
//! the commit fail with a transient error naming the refused call. It never commits.

use bson::oid::ObjectId;
use bson::{Bson, Document};

use super::{MemoryTx, query};
use crate::store::StoreError;
use crate::store::handler_documents::{Found, HandlerDocuments, Update, take_within};

impl MemoryTx {
    /// Fails once a call was refused; refuses the call (and dooms the transaction) when
    /// `result` is an error.
    fn handler_call<R>(&mut self, call: impl FnOnce(&mut Self) -> Result<R, String>) -> Result<R, StoreError> {
        if let Some(refused) = &self.doomed {
            return Err(StoreError::TransactionAborted(refused.clone()));
        }
        call(self).map_err(|reason| {
            self.doomed = Some(reason.clone());
            StoreError::Refused(reason)
        })
    }
}

impl HandlerDocuments for MemoryTx {
    async fn insert_document(&mut self, collection: &str, mut document: Document) -> Result<Bson, StoreError> {
        self.handler_call(|tx| {
            let id = document.get("_id").cloned().unwrap_or_else(|| Bson::ObjectId(ObjectId::new()));
            document.insert("_id", id.clone());
            let documents = tx.state.collections.entry(collection.to_string()).or_default();
            if documents.iter().any(|existing| existing.get("_id") == Some(&id)) {
                return Err(format!("E11000 duplicate key error collection: {collection} dup key: {{ _id: {id} }}"));
            }
            documents.push(document);
            Ok(id)
        })
    }

    async fn update_documents(&mut self, collection: &str, filter: Document, update: Update) -> Result<u64, StoreError> {
        self.handler_call(|tx| {
            let Update::Document(update) = update else {
                return Err("an update pipeline is not supported by the memory store (test this handler on MongoDB)".into());
            };
            let Some(documents) = tx.state.collections.get_mut(collection) else { return Ok(0) };
            // All or nothing, as one statement.
            let mut changed = documents.clone();
            let mut matched = 0;
            for document in &mut changed {
                if query::matches(document, &filter)? {
                    query::apply(document, &update)?;
                    matched += 1;
                }
            }
            *documents = changed;
            Ok(matched)
        })
    }

    async fn delete_documents(&mut self, collection: &str, filter: Document) -> Result<u64, StoreError> {
        self.handler_call(|tx| {
            let Some(documents) = tx.state.collections.get_mut(collection) else { return Ok(0) };
            // All or nothing, as one statement: every document is judged before any goes.
            let doomed = documents.iter().map(|document| query::matches(document, &filter)).collect::<Result<Vec<bool>, String>>()?;
            let mut verdicts = doomed.into_iter();
            let before = documents.len();
            documents.retain(|_| !verdicts.next().unwrap_or(false));
            Ok((before - documents.len()) as u64)
        })
    }

    async fn find_documents(&mut self, collection: &str, filter: Document, limit: u32, max_bytes: usize) -> Result<Found, StoreError> {
        self.handler_call(|tx| {
            let (mut found, mut bytes) = (Vec::new(), 0_usize);
            let Some(documents) = tx.state.collections.get(collection) else { return Ok(Found::Documents(found)) };
            for document in documents {
                if found.len() >= limit.clamp(1, 1_000) as usize {
                    break;
                }
                if query::matches(document, &filter)? && !take_within(&mut found, &mut bytes, document.clone(), max_bytes) {
                    return Ok(Found::TooLarge);
                }
            }
            Ok(Found::Documents(found))
        })
    }
}
