//! Tries, one handler each, what a plugin must never manage: run forever, take all memory,
//! blow the stack, sleep past its time, read host files and environment, open sockets, call
//! hosts and write collections it was not granted, flood the logs; and hand the host what it
//! must bound: huge failure reasons, follow-up events of any shape, type, id, number and
//! depth, endless transient errors, finds over large documents, keys held while it sleeps.
//!
//! With `HOSTILE_SQUAT` in its (granted) environment it offers only the `audit-log` handler of
//! another plugin; with `HOSTILE_SLOW_SUBSCRIPTIONS` it takes a minute to list its handlers;
//! with `HOSTILE_MANY_SUBSCRIPTIONS` it offers 10,002 handlers.
//!
//! A handler returns `unprocessable("blocked: ...")` when the sandbox held and `Ok` when it
//! got through, so the tests can tell which happened.

use std::hint::black_box;

use relayhost_guest::prelude::*;
use serde_json::Value;

struct Hostile;

const HANDLERS: [&str; 12] = [
    "spin", "memory-bomb", "recursion", "sleep", "read-passwd", "read-env", "read-data", "write-data", "socket",
    "http", "log-flood", "untransactional-write",
];

fn blocked(what: impl std::fmt::Display) -> Failure {
    Failure::unprocessable(format!("blocked: {what}"))
}

impl Plugin for Hostile {
    fn subscriptions() -> Vec<Subscription> {
        if std::env::var("HOSTILE_SQUAT").is_ok() {
            return vec![Subscription::new("audit-log", ["order.placed"]).transactional()];
        }
        if std::env::var("HOSTILE_MANY_SUBSCRIPTIONS").is_ok() {
            return (0..10_002).map(|n| Subscription::new(&format!("greedy-{n}"), ["order.placed"])).collect();
        }
        if std::env::var("HOSTILE_SLOW_SUBSCRIPTIONS").is_ok() {
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
        // `attack` reaches every one of them, `attack.<handler>` only that one.
        let mut subscriptions: Vec<Subscription> =
            HANDLERS.iter().map(|h| Subscription::new(h, ["attack".to_string(), format!("attack.{h}")])).collect();
        subscriptions.push(Subscription::new("write-collection", ["attack"]).transactional());
        // Traps on every event it gets: the dead-letter path end to end.
        subscriptions.push(Subscription::new("poison", ["poison"]));
        // Hands the host a failure reason of the payload's `bytes` (retried, not before the
        // end of time, when `retry` is set; unprocessable otherwise).
        subscriptions.push(Subscription::new("huge-reason", ["huge-reason"]));
        // Never returns (within its wall time): the tests kill the host running it, as a
        // poison event that crashes its host would.
        subscriptions.push(Subscription::new("hang", ["hang"]));
        // Publishes the follow-ups its payload describes (see `publish`).
        subscriptions.push(Subscription::new("publish", ["publish"]).transactional());
        // Publishes two more events of its own type for every one it gets.
        subscriptions.push(Subscription::new("chain", ["chain"]).transactional());
        // Publishes sixteen more events of its own type for every one it gets (a chain burst).
        subscriptions.push(Subscription::new("burst", ["burst"]).transactional());
        // Logs lines that would rewrite an operator's terminal or forge a host line if shown raw.
        subscriptions.push(Subscription::new("log-forgery", ["log-forgery"]));
        // Makes its transaction unusable (a failed server call, then another call) every time.
        subscriptions.push(Subscription::new("rerun", ["rerun"]).transactional());
        // Reads everything of the target collection (up to 1,000 documents).
        subscriptions.push(Subscription::new("find-all", ["find-all"]).transactional());
        // Counts its run in the target's `held` document, then, on its first attempt, never
        // returns: the tests kill its host while its transaction holds that document.
        subscriptions.push(Subscription::new("hold", ["hold"]).transactional());
        // Writes the event into the target collection, then fails (unless `fail` is false).
        subscriptions.push(Subscription::new("write-then-fail", ["write-then-fail"]).transactional());
        subscriptions
    }

    fn handle(event: Event, context: DeliveryContext) -> Result<(), Failure> {
        let payload: Value = event.payload()?;
        let target = payload["target"].as_str().unwrap_or_default().to_string();
        match context.handler.as_str() {
            "spin" => {
                let mut n: u64 = 0;
                loop {
                    n = black_box(n.wrapping_add(1));
                }
            }
            "memory-bomb" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(black_box(vec![1u8; 1 << 20]));
                }
            }
            "recursion" => Err(Failure::retry(format!("depth {}", deep(black_box(1))))),
            "sleep" => {
                std::thread::sleep(std::time::Duration::from_secs(3_600));
                Ok(())
            }
            "read-passwd" => std::fs::read_to_string("/etc/passwd").map(|_| ()).map_err(blocked),
            "read-env" => match std::env::vars().map(|(k, _)| k).collect::<Vec<_>>() {
                names if names.is_empty() => Err(blocked("no environment")),
                names => {
                    log::info(&format!("environment: {}", names.join(",")));
                    Ok(())
                }
            },
            "read-data" => std::fs::read_to_string(&target).map(|_| ()).map_err(blocked),
            "write-data" => std::fs::write(&target, b"overwritten").map_err(blocked),
            "socket" => std::net::TcpStream::connect(&target).map(|_| ()).map_err(blocked),
            "http" => http_get(&target).map_err(blocked),
            "write-collection" | "untransactional-write" => {
                transaction::insert(&target, r#"{"stolen": true}"#).map(|_| ()).map_err(blocked)
            }
            "poison" => panic!("poisoned by event {}", event.id),
            "huge-reason" => {
                let reason = "E".repeat(payload["bytes"].as_u64().unwrap_or(1_100_000) as usize);
                if payload["retry"] == Value::Bool(true) {
                    Err(Failure::retry_at(reason, i64::MAX))
                } else {
                    Err(Failure::unprocessable(reason))
                }
            }
            "publish" => {
                publish(&event, &payload).map_err(blocked)?;
                std::thread::sleep(std::time::Duration::from_millis(payload["sleep_ms"].as_u64().unwrap_or(0)));
                Ok(())
            }
            "chain" => {
                // A careless plugin: a refused publish ends the chain, and the delivery completes.
                for n in 0..2 {
                    let next = NewEvent::new(format!("hostile:{}-{n}", event.id), "chain", &serde_json::json!({}));
                    if let Err(error) = transaction::publish(&next) {
                        log::warn(&error);
                    }
                }
                Ok(())
            }
            "burst" => {
                for n in 0..16 {
                    let next = NewEvent::new(format!("hostile:{}-{n}", short_id(&event.id)), "burst", &serde_json::json!({}));
                    if let Err(error) = transaction::publish(&next) {
                        log::debug(&error);
                        break;
                    }
                }
                Ok(())
            }
            "log-forgery" => {
                log::info("\r\u{1b}[2K2026-01-01T00:00:00Z  INFO relayhost: forged line");
                log::warn("nul\0byte and bell\u{7}");
                println!("carriage\rreturn");
                Ok(())
            }
            "rerun" => {
                let _ = transaction::update(&target, "{}", r#"[{"$out": "elsewhere"}]"#);
                if payload["complete"] == Value::Bool(true) {
                    // Completes as if nothing failed: the commit finds the transaction ended.
                    return Ok(());
                }
                transaction::find(&target, "{}", 1).map(|_| ()).map_err(Failure::retry)
            }
            "find-all" => transaction::find(&target, "{}", 1_000).map(|found| log::info(&format!("found {}", found.len()))).map_err(blocked),
            "hold" => {
                transaction::update(&target, r#"{"_id": "held"}"#, r#"{"$inc": {"runs": 1}}"#).map_err(Failure::retry)?;
                if context.attempt == 1 {
                    log::info("holding the document");
                    std::thread::sleep(std::time::Duration::from_secs(3_600));
                }
                Ok(())
            }
            "write-then-fail" => {
                transaction::insert(&target, &serde_json::json!({ "_id": event.id, "written": true }).to_string()).map_err(blocked)?;
                if payload["fail"] == Value::Bool(false) {
                    return Ok(());
                }
                Err(Failure::retry("failed after its write"))
            }
            "hang" if payload["hang"] == Value::Bool(false) => Ok(()),
            "hang" => {
                std::thread::sleep(std::time::Duration::from_secs(3_600));
                Ok(())
            }
            "log-flood" => {
                let line = "x".repeat(1_000);
                for _ in 0..20_000 {
                    log::info(&line);
                    println!("{line}");
                }
                Ok(())
            }
            other => Err(Failure::unprocessable(format!("unknown handler {other}"))),
        }
    }
}

/// Publishes `count` follow-ups (default 1) of `type`, ids `id` + n, on `key`, with a payload
/// of `payload_bytes` and `headers` headers named `header_name` + n of `header_bytes` each.
fn publish(event: &Event, payload: &Value) -> Result<(), String> {
    let text = |name: &str, default: &str| payload[name].as_str().unwrap_or(default).to_string();
    let number = |name: &str, default: u64| payload[name].as_u64().unwrap_or(default) as usize;
    for n in 0..number("count", 1) {
        let body = serde_json::json!({ "of": event.id, "filler": "p".repeat(number("payload_bytes", 0)) });
        let mut next = NewEvent::new(format!("{}{n}", text("id", "hostile:")), text("type", "hostile.note"), &body);
        if let Some(key) = payload["key"].as_str() {
            next = next.with_key(key);
        }
        let value = payload["header_value"].as_str().map(str::to_string).unwrap_or_else(|| "v".repeat(number("header_bytes", 1)));
        next.headers = (0..number("headers", 0)).map(|h| (format!("{}{h}", text("header_name", "h")), value.clone())).collect();
        transaction::publish(&next)?;
    }
    Ok(())
}

/// A short, unique stand-in for an event id (ids of a burst would otherwise nest and grow).
fn short_id(id: &str) -> String {
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x100_0000_01b3));
    format!("{hash:016x}")
}

#[allow(unconditional_recursion)]
fn deep(n: u64) -> u64 {
    let frame = black_box([n; 128]);
    deep(n + 1).wrapping_add(frame[(n % 128) as usize])
}

fn http_get(authority: &str) -> Result<(), String> {
    use wasi::http::outgoing_handler;
    use wasi::http::types::{Fields, OutgoingRequest, Scheme};
    let request = OutgoingRequest::new(Fields::new());
    request.set_scheme(Some(&Scheme::Http)).map_err(|()| "scheme")?;
    request.set_authority(Some(authority)).map_err(|()| "authority")?;
    request.set_path_with_query(Some("/")).map_err(|()| "path")?;
    let pending = outgoing_handler::handle(request, None).map_err(|e| format!("{e:?}"))?;
    pending.subscribe().block();
    let response = pending.get().ok_or("no response")?.map_err(|()| "taken")?.map_err(|e| format!("{e:?}"))?;
    log::info(&format!("got HTTP {}", response.status()));
    Ok(())
}

relayhost_guest::export_plugin!(Hostile);
