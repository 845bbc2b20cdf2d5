//! Limiter documents in memory, as `mongo/limiters.rs` keeps them: read one, replace it only
//! at the version read. It must never decide a share (see [`crate::store::limiter`]).

use super::MemoryStore;
use crate::store::StoreError;
use crate::store::limiter::{LimiterBackend, LimiterState};

pub(super) struct Limiters<'a> {
    pub store: &'a MemoryStore,
}

impl LimiterBackend for Limiters<'_> {
    async fn read(&self, handler: &str) -> Result<LimiterState, StoreError> {
        Ok(self.store.state.lock().await.limiters.get(handler).cloned().unwrap_or_default())
    }

    async fn write_if(&self, handler: &str, state: &LimiterState) -> Result<bool, StoreError> {
        let mut stored = self.store.state.lock().await;
        let current = stored.limiters.get(handler).and_then(|limiter| limiter.version);
        if current != state.version {
            return Ok(false);
        }
        let written = LimiterState { version: Some(state.version.map_or(1, |version| version + 1)), ..state.clone() };
        stored.limiters.insert(handler.to_string(), written);
        Ok(true)
    }
}
