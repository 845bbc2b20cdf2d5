//! What operators use beside the delivery path: actions on deliveries by filter (`bulk`, for
//! the command line and the API alike), the admin HTTP API (`api`) and the dashboard
//! (`dashboard`), on their own listener, every request authenticated by the admin token
//! (`access`, which both build on).
//!
//! It reads and acts only through the store's operator methods (listing, requeue, bury,
//! purge, the registry) and the plugin registry's answers: it never claims, never changes a
//! delivery without its store operation's fencing, and never lets a request's text become a
//! query operator or reach a log line raw.

mod access;
pub mod api;
pub mod bulk;
mod dashboard;
pub mod filters;
