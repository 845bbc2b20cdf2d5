//! Write relayhost handler plugins in Rust.
//!
//! A plugin implements [`Plugin`] and exports it with [`export_plugin!`]:
//!
//! ```ignore
//! use relayhost_guest::prelude::*;
//!
//! struct Greeter;
//!
//! impl Plugin for Greeter {
//!     fn subscriptions() -> Vec<Subscription> {
//!         vec![Subscription::new("greeter", ["user.created"])]
//!     }
//!
//!     fn handle(event: Event, _context: DeliveryContext) -> Result<(), Failure> {
//!         let user: serde_json::Value = event.payload()?;
//!         log::info(&format!("hello, {}", user["name"]));
//!         Ok(())
//!     }
//! }
//!
//! relayhost_guest::export_plugin!(Greeter);
//! ```
//!
//! Build it with `cargo build --target wasm32-wasip2 --release`; the `.wasm` file in
//! `target/wasm32-wasip2/release/` is the component to drop into the plugins directory.

// The bindings name this crate by its public path, which must also resolve in here.
extern crate self as relayhost_guest;

/// The generated bindings of the `relayhost:plugin` world.
pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "plugin",
        pub_export_macro: true,
        export_macro_name: "export_plugin",
        default_bindings_module: "relayhost_guest::bindings",
        runtime_path: "relayhost_guest::wit_bindgen::rt",
    });
}

#[doc(hidden)]
pub use wit_bindgen;

pub use bindings::export_plugin;
pub use bindings::exports::relayhost::plugin::handler::Guest as Plugin;
pub use bindings::relayhost::plugin::transaction::{self, NewEvent};
pub use bindings::relayhost::plugin::types::{DeliveryContext, Event, Failure, Retry, Subscription};

/// Everything a plugin usually needs.
pub mod prelude {
    pub use crate::{DeliveryContext, Event, Failure, NewEvent, Plugin, Subscription, log, transaction};
}

impl Subscription {
    /// A handler of `event_types`.
    pub fn new<I, T>(handler: &str, event_types: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        Self {
            handler: handler.to_string(),
            event_types: event_types.into_iter().map(Into::into).collect(),
            transactional: false,
        }
    }

    /// Runs in the delivery's MongoDB transaction: [`transaction`] writes and the completion
    /// commit together.
    pub fn transactional(mut self) -> Self {
        self.transactional = true;
        self
    }
}

impl Event {
    /// The payload as `T`; a payload that does not fit is unprocessable (retrying cannot fix
    /// it).
    pub fn payload<T: serde::de::DeserializeOwned>(&self) -> Result<T, Failure> {
        serde_json::from_str(&self.payload)
            .map_err(|error| Failure::unprocessable(format!("payload of {} does not fit: {error}", self.event_type)))
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(key, _)| key == name).map(|(_, value)| value.as_str())
    }
}

impl Failure {
    /// Try again after the host's backoff.
    pub fn retry(reason: impl Into<String>) -> Self {
        Self::Retry(Retry { reason: reason.into(), not_before: None })
    }

    /// Try again, not before `not_before` (milliseconds since the Unix epoch).
    pub fn retry_at(reason: impl Into<String>, not_before: i64) -> Self {
        Self::Retry(Retry { reason: reason.into(), not_before: Some(not_before) })
    }

    /// Retrying cannot help: the delivery is dead at once.
    pub fn unprocessable(reason: impl Into<String>) -> Self {
        Self::Unprocessable(reason.into())
    }
}

/// A failed host call (a transaction write, say) is retryable by default.
impl From<String> for Failure {
    fn from(reason: String) -> Self {
        Self::retry(reason)
    }
}

impl NewEvent {
    /// A follow-up event with a JSON payload.
    pub fn new(id: impl Into<String>, event_type: impl Into<String>, payload: &serde_json::Value) -> Self {
        Self { id: id.into(), event_type: event_type.into(), key: None, payload: payload.to_string(), headers: Vec::new() }
    }

    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }
}

/// Log lines, routed to the host's logs under the plugin's name.
pub mod log {
    use crate::bindings::relayhost::plugin::log::{Level, log};

    pub fn trace(message: &str) {
        log(Level::Trace, message);
    }
    pub fn debug(message: &str) {
        log(Level::Debug, message);
    }
    pub fn info(message: &str) {
        log(Level::Info, message);
    }
    pub fn warn(message: &str) {
        log(Level::Warn, message);
    }
    pub fn error(message: &str) {
        log(Level::Error, message);
    }
}
