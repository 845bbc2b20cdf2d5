//! Publishing from Rust applications: one event document written in the caller's MongoDB
//! transaction, together with its business data.
//!
//! This module owns the write side of the publishing protocol ([`crate::event`] owns the
//! document). It must never commit, abort or start a transaction: the caller's transaction
//! decides whether the event exists.

use bson::{Bson, Document, doc};
use mongodb::error::ErrorKind;
use mongodb::options::ReadConcern;
use mongodb::{ClientSession, Collection, Database};

use crate::event::{DEFAULT_MAX_PAYLOAD_BYTES, NewEvent, field};
use crate::store::{Published, StoreError};

/// Name of the per-key counter field in `<prefix>key_sequences`.
pub const COUNTER_FIELD: &str = "value";

/// Default collection prefix.
pub const DEFAULT_PREFIX: &str = "relayhost_";

/// Writes events into `<prefix>events` inside the caller's transaction.
#[derive(Clone, Debug)]
pub struct Publisher {
    events: Collection<Document>,
    key_sequences: Collection<Document>,
    max_payload_bytes: usize,
    schemas: crate::event_schema::Schemas,
}

impl Publisher {
    pub fn new(database: &Database, collection_prefix: &str) -> Self {
        Self {
            events: database.collection(&format!("{collection_prefix}events")),
            key_sequences: database.collection(&format!("{collection_prefix}key_sequences")),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            schemas: crate::event_schema::Schemas::default(),
        }
    }

    /// The same, refusing a payload that does not match its type's schema (the failing path
    /// in the error), as the hosts' fan-out would make it dead.
    pub fn with_schemas(self, schemas: crate::event_schema::Schemas) -> Self {
        Self { schemas, ..self }
    }

    pub fn with_max_payload_bytes(mut self, max: usize) -> Self {
        self.max_payload_bytes = max;
        self
    }

    /// Writes `event` in the transaction started on `session`. A keyed event takes its key's
    /// next sequence; the increment makes concurrent publishers of one key conflict, so
    /// sequence order is commit order. Publishing an id that exists already writes nothing.
    ///
    /// Refuses a session without a started transaction: MongoDB would commit the event on
    /// its own, apart from the business data.
    pub async fn publish(&self, session: &mut ClientSession, event: &NewEvent) -> Result<Published, StoreError> {
        event.validate(self.max_payload_bytes)?;
        self.schemas.check(&event.event_type, &event.payload).map_err(|e| StoreError::InvalidEvent(crate::event::EventError::Schema(e)))?;
        ensure_transaction(&self.events, session).await?;
        let existing =
            self.events.find_one(doc! { field::ID: &event.id }).projection(doc! { field::ID: 1 }).session(&mut *session).await?;
        if existing.is_some() {
            return Ok(Published::Duplicate);
        }
        let sequence = match &event.key {
            Some(key) => {
                let counter = self
                    .key_sequences
                    .find_one_and_update(doc! { field::ID: key }, doc! { "$inc": { COUNTER_FIELD: 1_i64 } })
                    .upsert(true)
                    .return_document(mongodb::options::ReturnDocument::After)
                    .session(&mut *session)
                    .await?
                    .ok_or_else(|| StoreError::Corrupt(format!("key counter {key:?} vanished during its upsert")))?;
                match counter.get(COUNTER_FIELD) {
                    Some(Bson::Int64(n)) => Some(*n),
                    Some(Bson::Int32(n)) => Some(i64::from(*n)),
                    _ => return Err(StoreError::Corrupt(format!("key counter {key:?} is not an integer: {counter}"))),
                }
            }
            None => None,
        };
        let mut document = event.to_document(sequence, bson::DateTime::now());
        document.remove(field::ID);
        // An upsert, not an insert: two transactions racing on one id then meet as a
        // retryable write conflict instead of a duplicate-key error that aborts the caller.
        self.events
            .update_one(doc! { field::ID: &event.id }, doc! { "$setOnInsert": document })
            .upsert(true)
            .session(&mut *session)
            .await?;
        Ok(Published::New { sequence })
    }
}

/// Succeeds only if `session` has a started transaction. The driver refuses an explicit
/// read concern inside a transaction before sending anything, which is what this probes;
/// outside one, the probe is a harmless read.
pub(crate) async fn ensure_transaction(
    collection: &Collection<Document>,
    session: &mut ClientSession,
) -> Result<(), StoreError> {
    let probe = collection
        .find_one(doc! { field::ID: Bson::MinKey })
        .read_concern(ReadConcern::local())
        .session(&mut *session)
        .await;
    match probe {
        Err(error) if matches!(error.kind.as_ref(), ErrorKind::InvalidArgument { message, .. } if message.contains("transaction")) => {
            Ok(())
        }
        Err(error) => Err(error.into()),
        Ok(_) => Err(StoreError::NoTransaction),
    }
}
