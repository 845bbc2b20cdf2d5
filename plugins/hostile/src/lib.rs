//! Tries, one handler each, what a plugin must never manage: run forever, take all memory,
//! blow the stack, sleep past its time, read host files and environment, open sockets, call
//! hosts and write collections it was not granted, flood the logs.
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
        let mut subscriptions: Vec<Subscription> = HANDLERS.iter().map(|h| Subscription::new(h, ["attack"])).collect();
        subscriptions.push(Subscription::new("write-collection", ["attack"]).transactional());
        // Traps on every event it gets: the dead-letter path end to end.
        subscriptions.push(Subscription::new("poison", ["poison"]));
        // Hands the host a failure reason of the payload's `bytes` (retried, not before the
        // end of time, when `retry` is set; unprocessable otherwise).
        subscriptions.push(Subscription::new("huge-reason", ["huge-reason"]));
        // Never returns (within its wall time): the tests kill the host running it, as a
        // poison event that crashes its host would.
        subscriptions.push(Subscription::new("hang", ["hang"]));
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
