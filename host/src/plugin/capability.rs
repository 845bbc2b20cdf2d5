//! The transaction capability as the plugin layer sees it: a narrow interface that the
//! dispatcher implements over the delivery's MongoDB transaction. Grant checks happen before
//! a call reaches it, so an implementation never has to think about which plugin is calling.

use std::future::Future;
use std::pin::Pin;

/// A boxed future of a capability call; errors are messages for the plugin's logs.
pub type CapabilityFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, String>> + Send + 'a>>;

/// A follow-up event a plugin publishes in its delivery's transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowUpEvent {
    pub id: String,
    pub event_type: String,
    pub key: Option<String>,
    /// Relaxed extended JSON of a document.
    pub payload: String,
    pub headers: Vec<(String, String)>,
}

/// Reads and writes inside one delivery's transaction. Documents and filters are relaxed
/// extended JSON text.
pub trait TransactionCapability: Send {
    fn insert<'a>(&'a mut self, collection: &'a str, document: &'a str) -> CapabilityFuture<'a, String>;
    fn update<'a>(&'a mut self, collection: &'a str, filter: &'a str, update: &'a str) -> CapabilityFuture<'a, u64>;
    fn delete<'a>(&'a mut self, collection: &'a str, filter: &'a str) -> CapabilityFuture<'a, u64>;
    fn find<'a>(&'a mut self, collection: &'a str, filter: &'a str, limit: u32) -> CapabilityFuture<'a, Vec<String>>;
    fn publish(&mut self, event: FollowUpEvent) -> CapabilityFuture<'_, ()>;
}
