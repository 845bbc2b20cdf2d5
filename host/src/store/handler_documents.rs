//! What a transactional handler does to its collections, inside its delivery's transaction:
//! the four calls of the plugins' `transaction` import, over each store's own transaction type,
//! so that one runner and one capability serve both stores (see `handler_transaction`). Each
//! store implements it ([`HandlerDocuments`]); this module only says what each call means. It
//! never checks grants (the plugin layer does) and never commits (the runner does).

use std::future::Future;

use bson::{Bson, Document};

use super::StoreError;

/// An update: modifications (`{"$set": ...}`) or a replacement document, or a pipeline.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    Document(Document),
    Pipeline(Vec<Document>),
}

/// What a `find` handed back: the documents, or that they passed the bytes a call may return
/// (reading stopped there).
#[derive(Debug, Clone, PartialEq)]
pub enum Found {
    Documents(Vec<Document>),
    TooLarge,
}

/// The collections of a store transaction, as a handler uses them. A call the store refuses
/// (a duplicate `_id`, an operator it cannot apply) leaves the transaction unable to commit,
/// as MongoDB's server-side abort does: every later call and the commit fail with a transient
/// error, so that the caller tells a handler that went on after a failed call from one that
/// met a conflict.
pub trait HandlerDocuments: Send {
    /// Inserts `document` (an `_id` is made when it has none) and returns its `_id`.
    fn insert_document(&mut self, collection: &str, document: Document) -> impl Future<Output = Result<Bson, StoreError>> + Send;

    /// Applies `update` to every document `filter` matches; how many matched.
    fn update_documents(&mut self, collection: &str, filter: Document, update: Update)
    -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes every document `filter` matches; how many.
    fn delete_documents(&mut self, collection: &str, filter: Document) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// At most `limit` (1 to 1,000) documents `filter` matches, reading no further once their
    /// relaxed extended JSON passes `max_bytes`.
    fn find_documents(&mut self, collection: &str, filter: Document, limit: u32, max_bytes: usize)
    -> impl Future<Output = Result<Found, StoreError>> + Send;
}

/// How many bytes `document` counts toward a `find`'s `max_bytes`: its relaxed extended JSON.
pub fn json_bytes(document: &Document) -> usize {
    Bson::Document(document.clone()).into_relaxed_extjson().to_string().len()
}

/// Adds `document` to `found` unless that passes `max_bytes` (`bytes` so far); false when it
/// would.
pub fn take_within(found: &mut Vec<Document>, bytes: &mut usize, document: Document, max_bytes: usize) -> bool {
    *bytes += json_bytes(&document);
    if *bytes > max_bytes {
        return false;
    }
    found.push(document);
    true
}
