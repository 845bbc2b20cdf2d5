//! Joining the commands one store operation sends at once. A command dropped on its way
//! still reaches the server, and may change data after its caller gave up and set out to
//! repair what it believed had happened: a plain mark's half that landed after its fan-out
//! handed its events back left marked events that no lane listed, and nothing ran them (one
//! chaos run; `mongo_store` `a_plain_mark_gives_up_only_once_neither_half_is_on_its_way`).
//!
//! So writes sent together are joined with these, which await every part to its answer and
//! only then return the first error. This module owns that rule; a store operation must never
//! join writes with `try_join!` or `try_join_all`, which return at the first error and drop
//! the rest on their way. Reads may: one dropped changes nothing.

use std::future::Future;

/// Both answers, or the first error once both are answered.
pub(crate) async fn both<A, B, E>(a: impl Future<Output = Result<A, E>>, b: impl Future<Output = Result<B, E>>) -> Result<(A, B), E> {
    let (a, b) = futures::join!(a, b);
    Ok((a?, b?))
}

/// All three answers, or the first error once all are answered.
pub(crate) async fn all_three<A, B, C, E>(
    a: impl Future<Output = Result<A, E>>,
    b: impl Future<Output = Result<B, E>>,
    c: impl Future<Output = Result<C, E>>,
) -> Result<(A, B, C), E> {
    let (a, b, c) = futures::join!(a, b, c);
    Ok((a?, b?, c?))
}

/// Every answer in order, or the first error once all are answered.
pub(crate) async fn every<T, E, F: Future<Output = Result<T, E>>>(parts: impl IntoIterator<Item = F>) -> Result<Vec<T>, E> {
    futures::future::join_all(parts).await.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::*;

    /// A part still on its way when another fails is awaited to its end.
    #[tokio::test]
    async fn an_error_is_returned_only_once_every_part_is_answered() {
        let landed = Arc::new(AtomicBool::new(false));
        let slow = |landed: Arc<AtomicBool>| async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            landed.store(true, Ordering::SeqCst);
            Ok::<u8, &str>(1)
        };
        let failed = async { Err::<u8, &str>("refused") };
        assert_eq!(both(failed, slow(landed.clone())).await, Err("refused"));
        assert!(landed.swap(false, Ordering::SeqCst));
        assert_eq!(all_three(slow(landed.clone()), async { Err::<u8, &str>("refused") }, async { Ok(3) }).await, Err("refused"));
        assert!(landed.swap(false, Ordering::SeqCst));
        let parts: Vec<std::pin::Pin<Box<dyn Future<Output = Result<u8, &str>>>>> =
            vec![Box::pin(async { Err("refused") }), Box::pin(slow(landed.clone()))];
        assert_eq!(every(parts).await, Err("refused"));
        assert!(landed.load(Ordering::SeqCst));
        assert_eq!(both(async { Ok::<u8, &str>(1) }, async { Ok(2) }).await, Ok((1, 2)));
    }
}
