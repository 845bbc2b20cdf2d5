//! Limiter documents in MongoDB (`<prefix>limiters`, one per handler limited across hosts):
//! read one, and replace it only at the version read (see [`crate::store::limiter`], which
//! owns what a share is). It must never decide a share.

use bson::{Bson, DateTime, Document, doc};

use super::MongoStore;
use crate::store::StoreError;
use crate::store::limiter::{LimiterBackend, LimiterState, Share};

/// The duplicate key error a first insert meets when another host's came first.
const DUPLICATE_KEY: i32 = 11000;

pub(super) struct Limiters<'a> {
    pub store: &'a MongoStore,
}

impl LimiterBackend for Limiters<'_> {
    async fn read(&self, handler: &str) -> Result<LimiterState, StoreError> {
        let found = self.store.collections.limiters.find_one(doc! { "_id": handler }).await?;
        Ok(found.map(|document| from_document(&document)).unwrap_or_default())
    }

    async fn write_if(&self, handler: &str, state: &LimiterState) -> Result<bool, StoreError> {
        let collection = &self.store.collections.limiters;
        let document = to_document(handler, state);
        match state.version {
            None => match collection.insert_one(document).await {
                Ok(_) => Ok(true),
                Err(error) if StoreError::from(error.clone()).server_code() == Some(DUPLICATE_KEY) => Ok(false),
                Err(error) => Err(error.into()),
            },
            Some(version) => {
                let replaced = collection.replace_one(doc! { "_id": handler, "v": version }, document).await?;
                Ok(replaced.matched_count == 1)
            }
        }
    }
}

fn count(value: usize) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn to_document(handler: &str, state: &LimiterState) -> Document {
    let shares: Vec<Bson> = state
        .shares
        .iter()
        .map(|share| {
            Bson::Document(doc! {
                "host": &share.host,
                "share": count(share.share),
                "wanted": count(share.wanted),
                "until": DateTime::from_millis(share.until_ms),
            })
        })
        .collect();
    doc! {
        "_id": handler,
        "v": state.version.map_or(1, |version| version + 1),
        "shares": shares,
        "tokens": state.tokens,
        "refilledAt": DateTime::from_millis(state.refilled_at_ms),
    }
}

/// A limiter document as written by [`to_document`]; a field unreadable counts as absent
/// (a share without its fields lapses at once).
fn from_document(document: &Document) -> LimiterState {
    let number = |d: &Document, field: &str| d.get_i64(field).ok().or_else(|| d.get_i32(field).ok().map(i64::from)).unwrap_or(0);
    let shares = document
        .get_array("shares")
        .map(|shares| {
            shares
                .iter()
                .filter_map(Bson::as_document)
                .map(|share| Share {
                    host: share.get_str("host").unwrap_or_default().to_string(),
                    share: usize::try_from(number(share, "share")).unwrap_or(0),
                    wanted: usize::try_from(number(share, "wanted")).unwrap_or(0),
                    until_ms: share.get_datetime("until").map_or(0, |until| until.timestamp_millis()),
                })
                .collect()
        })
        .unwrap_or_default();
    LimiterState {
        version: Some(number(document, "v")),
        shares,
        tokens: document.get_f64("tokens").unwrap_or(0.0),
        refilled_at_ms: document.get_datetime("refilledAt").map_or(0, |at| at.timestamp_millis()),
    }
}
