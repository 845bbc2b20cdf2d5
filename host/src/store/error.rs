//! The store's typed errors, and which of them a transaction may retry.

use std::time::Duration;

use mongodb::error::{ErrorKind, TRANSIENT_TRANSACTION_ERROR, UNKNOWN_TRANSACTION_COMMIT_RESULT};

use crate::event::EventError;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "relayhost needs multi-document transactions, and {0} does not offer them. Run mongod as a replica set \
         (`mongod --replSet rs0`, then `rs.initiate()` in mongosh; one node is enough for development), \
         or connect to a sharded cluster"
    )]
    NeedsReplicaSet(String),
    #[error("MongoDB {found} is too old: relayhost needs MongoDB 6.0 or newer")]
    ServerTooOld { found: String },
    #[error("invalid event: {0}")]
    InvalidEvent(#[from] EventError),
    #[error(
        "publish needs a session inside a started transaction (call `session.start_transaction()` first); \
         without one MongoDB would commit the event on its own, apart from your data"
    )]
    NoTransaction,
    #[error("lease {0} is no longer held; nothing was changed")]
    LeaseLost(String),
    #[error("the transaction ran past its time budget of {0:?} and was aborted with all its writes")]
    TransactionTimeout(Duration),
    #[error("delivery {0:?} does not exist")]
    DeliveryNotFound(String),
    #[error("delivery {0:?} is not dead; only dead deliveries can be requeued")]
    NotDead(String),
    #[error("delivery {id:?} cannot be buried: {why}")]
    NotBuriable { id: String, why: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("stored document is malformed: {0}")]
    Corrupt(String),
    #[error("another worker did this first, and nothing was written: {0}")]
    Raced(String),
    /// A transaction's snapshot did not hold a write that was acknowledged already (one
    /// acknowledged once applied, not yet majority-committed): run it again.
    #[error("the transaction's snapshot is behind a write acknowledged already: {0}")]
    SnapshotBehind(String),
    /// A takeover's charge did not finish in time: something still holds the lost
    /// deliveries (a dead host's open transaction, until the server aborts it).
    #[error("the charge of a lane's lost deliveries waited {0:?} and is left for a later claim")]
    ChargeWaiting(Duration),
    #[error("transaction gave up after {attempts} attempts over {elapsed:?}: {last}")]
    RetriesExhausted { attempts: u32, elapsed: Duration, last: Box<StoreError> },
    /// A handler's call the memory store refused (MongoDB's own refusals are `Mongo`).
    #[error("the store refused it: {0}")]
    Refused(String),
    /// A handler's call after one the memory store refused, or the commit after it: as after
    /// MongoDB's server-side abort, the transaction can only run again.
    #[error("the transaction was aborted by an earlier call the store refused ({0})")]
    TransactionAborted(String),
    #[error("MongoDB: {0}")]
    Mongo(#[from] mongodb::error::Error),
}

impl StoreError {
    /// The whole transaction may be run again (a write conflict, a primary step-down).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Mongo(error) => error.contains_label(TRANSIENT_TRANSACTION_ERROR),
            Self::SnapshotBehind(_) | Self::TransactionAborted(_) => true,
            _ => false,
        }
    }

    /// The commit may have happened; only the commit may be sent again.
    pub fn is_unknown_commit_result(&self) -> bool {
        matches!(self, Self::Mongo(error) if error.contains_label(UNKNOWN_TRANSACTION_COMMIT_RESULT))
    }

    /// The server's error code, when MongoDB answered with one.
    pub fn server_code(&self) -> Option<i32> {
        match self {
            Self::Mongo(error) => match error.kind.as_ref() {
                ErrorKind::Command(command) => Some(command.code),
                ErrorKind::Write(mongodb::error::WriteFailure::WriteError(write)) => Some(write.code),
                _ => None,
            },
            _ => None,
        }
    }
}
