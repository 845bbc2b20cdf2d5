//! Running work in a store transaction with MongoDB's retry rules.
//!
//! The whole callback runs again after a `TransientTransactionError` (a write conflict, a
//! step-down); only the commit is sent again after an `UnknownTransactionCommitResult`. The
//! callback may therefore run more than once: side effects that do not go through the
//! transaction must be idempotent.

use std::time::{Duration, Instant};

use super::{Store, StoreError, StoreTransaction};

/// Retrying stops after this long with the last error (the drivers' convention).
pub const TRANSACTION_RETRY_LIMIT: Duration = Duration::from_secs(120);

/// Runs `work` in a transaction of `store` and commits it, retrying as described above.
/// Where the future must be `Send` (inside the store), loop with [`Retrying`] instead:
/// async closures cannot promise that yet.
pub async fn run_in_transaction<S, R, F>(store: &S, mut work: F) -> Result<R, StoreError>
where
    S: Store,
    F: AsyncFnMut(&mut S::Tx) -> Result<R, StoreError>,
{
    let mut retrying = Retrying::new();
    loop {
        let mut tx = store.begin().await?;
        let outcome = work(&mut tx).await;
        if let Some(result) = retrying.settle(tx, outcome).await {
            return result;
        }
    }
}

/// The retry rules of one transactional unit of work, for a loop written out by hand:
///
/// ```text
/// let mut retrying = Retrying::new();
/// loop {
///     let mut tx = store.begin().await?;
///     let outcome = work(&mut tx).await;
///     if let Some(result) = retrying.settle(tx, outcome).await {
///         return result;
///     }
/// }
/// ```
pub struct Retrying {
    started: Instant,
    attempts: u32,
}

impl Default for Retrying {
    fn default() -> Self {
        Self::new()
    }
}

impl Retrying {
    pub fn new() -> Self {
        Self { started: Instant::now(), attempts: 0 }
    }

    /// Commits `tx` after a successful attempt or aborts it after a failed one. `None` means
    /// the error was transient and the work should run again in a new transaction.
    pub async fn settle<T: StoreTransaction, R>(
        &mut self,
        tx: T,
        outcome: Result<R, StoreError>,
    ) -> Option<Result<R, StoreError>> {
        self.attempts += 1;
        let outcome = match outcome {
            Ok(value) => tx.commit().await.map(|()| value),
            Err(error) => {
                // An abort that fails changes nothing: the server aborts it on its own.
                let _ = tx.abort().await;
                Err(error)
            }
        };
        match outcome {
            Err(error) if error.is_transient() && self.started.elapsed() < TRANSACTION_RETRY_LIMIT => {
                tokio::time::sleep(backoff(self.attempts)).await;
                None
            }
            Err(error) if error.is_transient() => Some(Err(StoreError::RetriesExhausted {
                attempts: self.attempts,
                elapsed: self.started.elapsed(),
                last: Box::new(error),
            })),
            other => Some(other),
        }
    }
}

/// A short, growing pause with jitter, so that conflicting transactions stop colliding.
fn backoff(attempt: u32) -> Duration {
    let base = 2u64.saturating_pow(attempt.min(7)).min(100);
    let jitter = u64::from(rand_below(base as u32 + 1));
    Duration::from_millis(base / 2 + jitter / 2)
}

fn rand_below(bound: u32) -> u32 {
    use std::hash::{BuildHasher, RandomState};
    (RandomState::new().hash_one(Instant::now()) % u64::from(bound.max(1))) as u32
}
