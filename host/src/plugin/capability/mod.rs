//! What a plugin's instance may be given beyond its own memory, one unit per capability, as
//! Spin's factors are: each unit owns its grant (what the operator allows; nothing by
//! default), its limits, its linking into the engine and its per-instance state, so a new
//! bound on a capability is written in one place.
//!
//! - [`log`]: log lines and stdout/stderr, within an output budget (every plugin);
//! - [`environment`]: host environment variables, by name;
//! - [`directory`]: one host directory, read-only at `/data`;
//! - [`http`]: outgoing requests to granted hosts, private networks only if granted;
//! - [`transaction`]: reads, writes and follow-up events in the delivery's transaction.
//!
//! The runtime composes them into one instance's state; no unit knows another, and none knows
//! lanes, leases or documents of the outbox.

pub mod directory;
pub mod environment;
pub mod http;
pub mod log;
pub mod transaction;
