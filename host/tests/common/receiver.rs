//! A webhook receiver on a real local socket, for the HTTP capability's end-to-end tests.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A webhook receiver that holds every request open while `hold` is set and answers 200
/// otherwise (after `delay_ms`); it records each request, and the most requests it was
/// answering at once, in all and of one customer (a webhook body's `/payload/customer`).
pub struct Receiver {
    pub address: std::net::SocketAddr,
    pub hold: Arc<AtomicBool>,
    pub delay_ms: Arc<std::sync::atomic::AtomicU64>,
    /// Each request, in order of arrival.
    requests: Arc<Mutex<Vec<Request>>>,
    /// Requests being answered now, and the most ever at once.
    answering: Arc<Mutex<(usize, usize)>>,
    /// The same, by customer.
    by_customer: Arc<Mutex<std::collections::HashMap<String, (usize, usize)>>>,
}

impl Receiver {
    /// On 127.0.0.1.
    pub fn start() -> Self {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST)
    }

    /// On 127.0.0.1, answering every request after `delay_ms` instead of holding it.
    pub fn answering(delay_ms: u64) -> Self {
        let receiver = Self::start();
        receiver.hold.store(false, Ordering::SeqCst);
        receiver.delay_ms.store(delay_ms, Ordering::SeqCst);
        receiver
    }

    /// On `ip` (all interfaces for callers in a container).
    pub fn start_on(ip: std::net::Ipv4Addr) -> Self {
        let listener = std::net::TcpListener::bind((ip, 0)).unwrap();
        let address = listener.local_addr().unwrap();
        let hold = Arc::new(AtomicBool::new(true));
        let delay_ms = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let answering: Arc<Mutex<(usize, usize)>> = Arc::default();
        let by_customer: Arc<Mutex<std::collections::HashMap<String, (usize, usize)>>> = Arc::default();
        let requests: Arc<Mutex<Vec<Request>>> = Arc::default();
        let (holding, delay, log, counts) = (hold.clone(), delay_ms.clone(), requests.clone(), answering.clone());
        let customers = by_customer.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let arrived = std::time::Instant::now();
                let (target, headers, body) = read_request(&mut stream);
                let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let customer = body.pointer("/payload/customer").and_then(|c| c.as_str()).map(str::to_string);
                log.lock().unwrap().push(Request { arrived, target, headers, body });
                if holding.load(Ordering::SeqCst) {
                    held.push(stream);
                } else {
                    let delay = Duration::from_millis(delay.load(Ordering::SeqCst));
                    {
                        let (now, most) = &mut *counts.lock().unwrap();
                        *now += 1;
                        *most = (*most).max(*now);
                    }
                    if let Some(customer) = &customer {
                        let mut customers = customers.lock().unwrap();
                        let (now, most) = customers.entry(customer.clone()).or_default();
                        *now += 1;
                        *most = (*most).max(*now);
                    }
                    let (counts, customers) = (counts.clone(), customers.clone());
                    std::thread::spawn(move || {
                        std::thread::sleep(delay);
                        if let Some(customer) = &customer {
                            customers.lock().unwrap().get_mut(customer).expect("counted").0 -= 1;
                        }
                        counts.lock().unwrap().0 -= 1;
                        let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                    });
                }
            }
        });
        Self { address, hold, delay_ms, requests, answering, by_customer }
    }

    /// Each request so far, in order of arrival.
    pub fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }

    /// When each request arrived, in order.
    pub fn arrivals(&self) -> Vec<std::time::Instant> {
        self.requests().into_iter().map(|request| request.arrived).collect()
    }

    pub fn bodies(&self) -> Vec<serde_json::Value> {
        self.requests().into_iter().map(|request| request.body).collect()
    }

    /// Each request's header fields, in order of arrival (names in lower case).
    pub fn headers(&self) -> Vec<std::collections::HashMap<String, String>> {
        self.requests().into_iter().map(|request| request.headers).collect()
    }

    /// The most requests it was answering at once (held ones are not counted).
    pub fn most_at_once(&self) -> usize {
        self.answering.lock().unwrap().1
    }

    /// The most requests of one customer it was answering at once, by customer.
    pub fn most_at_once_by_customer(&self) -> std::collections::BTreeMap<String, usize> {
        self.by_customer.lock().unwrap().iter().map(|(customer, (_, most))| (customer.clone(), *most)).collect()
    }

    /// Counts the most at once from now on (from those it is answering now).
    pub fn reset_most(&self) {
        let (now, most) = &mut *self.answering.lock().unwrap();
        *most = *now;
    }
}

/// One request a [`Receiver`] took.
#[derive(Debug, Clone)]
pub struct Request {
    pub arrived: std::time::Instant,
    /// Its path and query.
    pub target: String,
    /// Its header fields, names in lower case.
    pub headers: std::collections::HashMap<String, String>,
    pub body: serde_json::Value,
}

/// One HTTP/1.1 request's target, header fields (names in lower case) and body (sized by
/// `content-length` or chunked).
fn read_request(stream: &mut std::net::TcpStream) -> (String, std::collections::HashMap<String, String>, Vec<u8>) {
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).unwrap_or(0);
        if n == 0 {
            return Default::default();
        }
        request.extend_from_slice(&buf[..n]);
        let Some(head_end) = request.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
        let head = String::from_utf8_lossy(&request[..head_end]).to_string();
        let target = head.lines().next().and_then(|line| line.split(' ').nth(1)).unwrap_or_default().to_string();
        let fields = head
            .lines()
            .skip(1)
            .filter_map(|line| line.split_once(':'))
            .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_string()))
            .collect();
        let head = head.to_ascii_lowercase();
        let body = &request[head_end + 4..];
        if head.contains("transfer-encoding: chunked") {
            if body.ends_with(b"0\r\n\r\n") {
                return (target, fields, dechunk(body));
            }
            continue;
        }
        let length = head.lines().find_map(|l| l.strip_prefix("content-length:").and_then(|v| v.trim().parse().ok())).unwrap_or(0);
        if body.len() >= length {
            return (target, fields, body[..length].to_vec());
        }
    }
}

fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = body.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&body[..line_end]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        out.extend_from_slice(&body[line_end + 2..line_end + 2 + size]);
        body = &body[line_end + 4 + size..];
    }
    out
}
