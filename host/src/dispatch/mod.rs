//! The dispatcher: from claimed deliveries to settled ones.
//!
//! This module owns what happens around a handler's run: deciding how an attempt settles
//! (complete, retry with backoff, bury) and the dead-letter hook. It must never know how a
//! handler runs (WebAssembly lives in `plugin`) nor how the outbox stores anything (that is
//! the `store`). The claim loop, wakeups, batching and renewals build on these pieces.

mod announcements;
mod completion;
mod dead_letter;
mod dispatcher;
mod fan_out_task;
mod flight;
mod global_limits;
mod known_handlers;
mod options;
mod runner;
mod sequence_watch;
mod settle;
mod starts;
mod throttle;

pub use dispatcher::Dispatcher;
pub use known_handlers::KnownHandlers;
pub use options::{DispatcherCounters, DispatcherOptions};
pub use runner::{Controls, HandlerSpec, KeyLimit, RunResult, Runner};
pub use dead_letter::{DEAD_LETTER_EVENT_TYPE, bury_by_operator, bury_with_dead_letter, dead_letter_event};
pub use settle::{AttemptResult, Backoff, Jitter, RetryPolicy, Settle, decide};
pub use throttle::{RateLimit, Throttle};
