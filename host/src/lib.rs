//! relayhost: a transactional-outbox event bus for MongoDB whose handlers are sandboxed
//! WebAssembly components.
//!
//! Data flows one way: applications [`publish`] events in their own transactions; the
//! [`store`] fans them out into deliveries, leases lanes to claimers and fences every outcome;
//! the [`plugin`] runtime runs each delivery in a sandboxed WebAssembly instance, and
//! [`handler_transaction`] lets a transactional handler write in its delivery's transaction.

pub mod admin;
pub mod author;
pub mod config;
pub mod death;
pub mod dispatch;
pub mod event;
pub mod event_schema;
pub mod handler_transaction;
pub mod lane;
pub mod metrics;
pub mod mongod;
pub mod plugin;
pub mod plugin_runner;
pub mod publish;
pub mod service;
pub mod store;
pub mod telemetry;
pub mod trial;
