//! The HTTP capability: outgoing requests (`wasi:http`) to the hosts the operator granted.
//!
//! This unit owns the grant (authorities, and whether private networks may be reached), the
//! linking of `wasi:http`'s outgoing handler and the per-instance hooks that check every
//! request before anything leaves the process. A named host is resolved here, once: a name
//! that resolves to a loopback, private, link-local (cloud metadata) or unspecified address
//! is refused unless the grant allows private networks, and a plain `http` request then
//! connects to the very address checked (no second lookup an attacker's DNS could answer
//! differently). An `https` request connects by name, for its certificate; a rebinding there
//! would also need a certificate for the name. It must never send a request it did not check.
//! A plugin being tried rather than deployed has its granted requests recorded and answered
//! from fixtures instead ([`recording`]). A request carries its delivery attempt's W3C trace
//! context (`traceparent`, `tracestate`) unless the plugin set a `traceparent` of its own, so
//! that the service called continues the delivery's trace.

pub mod recording;

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use wasmtime::component::Linker;
use wasmtime_wasi_http::{Error, RequestOptions, WasiBody, WasiHttpHooks, WasiHttpView};

/// Where a plugin may send HTTP requests. Nothing by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grant {
    /// `host` or `host:port` authorities; a grant without a port allows the scheme's default
    /// port only.
    pub hosts: Vec<String>,
    /// Whether a granted host may resolve to a loopback, private, link-local or unspecified
    /// address (an internal service, or the machine itself).
    pub private_networks: bool,
}

impl Grant {
    /// Whether a request to `host` on `port` is granted; `port` is the one the request names,
    /// or its scheme's default (`default_port`).
    pub(crate) fn allows(&self, host: &str, port: Option<u16>, default_port: u16) -> bool {
        let port = port.unwrap_or(default_port);
        self.hosts.iter().any(|granted| match granted.rsplit_once(':') {
            Some((granted_host, granted_port)) if granted_port.parse::<u16>().is_ok() => {
                granted_host.eq_ignore_ascii_case(host) && granted_port.parse::<u16>() == Ok(port)
            }
            _ => granted.eq_ignore_ascii_case(host) && port == default_port,
        })
    }
}

/// Links `wasi:http`'s outgoing handler (the WASI ctx and tables come from the instance).
pub fn link<T: WasiHttpView + 'static>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    wasmtime_wasi_http::p2::add_only_http_to_linker_async(linker)
}

type ResponseFuture = Box<
    dyn Future<Output = Result<(http::Response<WasiBody>, Box<dyn Future<Output = Result<(), Error>> + Send>), Error>>
        + Send,
>;

/// The HTTP hooks of one delivery: a request the grant does not allow fails with
/// `HTTP-request-denied` before anything leaves the process.
pub struct GrantedHosts {
    plugin: Arc<str>,
    grant: Grant,
    recording: Option<recording::Recording>,
    /// The attempt's trace context headers, which its requests carry.
    trace_context: Vec<(http::HeaderName, http::HeaderValue)>,
}

impl GrantedHosts {
    /// `recording`, when given, records the granted requests and answers them (see
    /// [`recording`]); `trace_context` is the attempt's (none outside a delivery).
    pub fn prepare(plugin: Arc<str>, grant: &Grant, recording: Option<recording::Recording>, trace_context: &[(String, String)]) -> Self {
        let trace_context = trace_context
            .iter()
            .filter_map(|(name, value)| Some((http::HeaderName::from_bytes(name.as_bytes()).ok()?, http::HeaderValue::from_str(value).ok()?)))
            .collect();
        Self { plugin, grant: grant.clone(), recording, trace_context }
    }
}

impl WasiHttpHooks for GrantedHosts {
    fn send_request(
        &mut self,
        mut request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
        _fut: Box<dyn Future<Output = Result<(), Error>> + Send>,
    ) -> ResponseFuture {
        let plugin = self.plugin.clone();
        let denied = move |reason: String| {
            tracing::warn!(%plugin, %reason, "an HTTP request was denied");
            Error::HttpRequestDenied
        };
        let target = match granted(&self.grant, request.uri()) {
            Ok(target) => target,
            Err(reason) => {
                if let Some(recording) = &self.recording {
                    recording.refused(request.method().as_str(), &request.uri().to_string(), &reason);
                }
                return Box::new(async move { Err(denied(reason)) });
            }
        };
        carry_trace_context(request.headers_mut(), &self.trace_context);
        let private_networks = self.grant.private_networks;
        let recording = self.recording.clone();
        Box::new(async move {
            use http_body_util::BodyExt;
            let (mut request, sent) = match recording {
                None => (request, None),
                Some(recording) => match recording.exchange(request).await? {
                    recording::Exchanged::Answered(response) => {
                        return Ok((response, Box::new(async { Ok(()) }) as Box<dyn Future<Output = _> + Send>));
                    }
                    recording::Exchanged::Send { request, sent } => (request, Some(sent)),
                },
            };
            let address = match reachable(&target, private_networks).await {
                Ok(address) => address,
                Err(reason) => {
                    if let Some(sent) = sent {
                        sent.answered(recording::Answer::Refused(reason.clone()));
                    }
                    return Err(denied(reason));
                }
            };
            if !target.tls {
                // Connect to the address checked; the `Host` header keeps the name.
                let path = request.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
                *request.uri_mut() = http::Uri::builder()
                    .scheme("http")
                    .authority(address.to_string())
                    .path_and_query(path)
                    .build()
                    .map_err(|_| Error::HttpRequestUriInvalid)?;
            }
            let sending = wasmtime_wasi_http::default_send_request(request, options).await;
            if let Some(sent) = sent {
                sent.answered(match &sending {
                    Ok((response, _)) => recording::Answer::Sent(response.status().as_u16()),
                    Err(error) => recording::Answer::Refused(error.to_string()),
                });
            }
            let (response, io) = sending?;
            Ok((response.map(BodyExt::boxed_unsync), Box::new(io) as Box<dyn Future<Output = _> + Send>))
        })
    }
}

/// A granted request's destination.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    host: String,
    port: u16,
    tls: bool,
}

/// Whether the grant allows a request to `uri`; the reason when not. An authority with user
/// information (`x@host`) is refused whatever its host: the grant names hosts, not accounts.
fn granted(grant: &Grant, uri: &http::Uri) -> Result<Target, String> {
    let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
    if authority.contains('@') {
        return Err(format!("user information in the authority of {:?}", uri.host().unwrap_or_default()));
    }
    let host = uri.host().unwrap_or_default();
    let tls = uri.scheme_str() == Some("https");
    let default_port = if tls { 443 } else { 80 };
    let port = uri.port_u16().unwrap_or(default_port);
    if grant.allows(host, uri.port_u16(), default_port) {
        Ok(Target { host: host.trim_start_matches('[').trim_end_matches(']').to_string(), port, tls })
    } else {
        Err(format!("{host}:{port} is not granted"))
    }
}

/// The address to connect to: the first the host resolves to, once every address it
/// resolves to is allowed.
async fn reachable(target: &Target, private_networks: bool) -> Result<SocketAddr, String> {
    let addresses: Vec<SocketAddr> = tokio::net::lookup_host((target.host.as_str(), target.port))
        .await
        .map_err(|e| format!("{} does not resolve: {e}", target.host))?
        .collect();
    if !private_networks {
        if let Some(private) = addresses.iter().find(|a| is_private(a.ip())) {
            return Err(format!(
                "{} resolves to {}, a private, loopback or link-local address, and the grant does not allow private networks",
                target.host,
                private.ip()
            ));
        }
    }
    addresses.first().copied().ok_or_else(|| format!("{} resolves to no address", target.host))
}

/// Loopback, private, shared (carrier NAT), link-local, unspecified, broadcast or unique-local
/// addresses, and IPv4 ones mapped into IPv6.
fn is_private(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || a == 0
                || (a == 100 && (b & 0xc0) == 64)
        }
        IpAddr::V6(v6) => {
            let first = v6.segments()[0];
            v6.is_loopback()
                || v6.is_unspecified()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || v6.to_ipv4_mapped().is_some_and(|v4| is_private(IpAddr::V4(v4)))
        }
    }
}

/// Gives a request's `headers` the attempt's `trace_context`, unless the plugin set a
/// `traceparent` of its own (its `tracestate` then goes with it, untouched).
fn carry_trace_context(headers: &mut http::HeaderMap, trace_context: &[(http::HeaderName, http::HeaderValue)]) {
    if headers.contains_key("traceparent") {
        return;
    }
    for (name, value) in trace_context {
        headers.insert(name.clone(), value.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request gets the attempt's trace context; one whose plugin set a `traceparent` keeps
    /// its own, and gets no `tracestate` of the attempt's beside it.
    #[test]
    fn a_request_carries_the_attempts_trace_context_unless_its_plugin_set_one() {
        let context = [
            (http::HeaderName::from_static("traceparent"), http::HeaderValue::from_static("00-attempt-01")),
            (http::HeaderName::from_static("tracestate"), http::HeaderValue::from_static("vendor=1")),
        ];
        let mut plain = http::HeaderMap::new();
        carry_trace_context(&mut plain, &context);
        assert_eq!((plain["traceparent"].to_str().unwrap(), plain["tracestate"].to_str().unwrap()), ("00-attempt-01", "vendor=1"));
        let mut own = http::HeaderMap::new();
        own.insert("traceparent", http::HeaderValue::from_static("00-plugin-01"));
        carry_trace_context(&mut own, &context);
        assert_eq!(own["traceparent"], "00-plugin-01");
        assert!(!own.contains_key("tracestate"));
    }

    #[test]
    fn hosts_and_ports_are_those_granted_and_a_grant_without_port_means_the_default_one() {
        let grant = Grant { hosts: vec!["api.example.com".into(), "127.0.0.1:8080".into()], private_networks: false };
        assert!(grant.allows("api.example.com", Some(443), 443));
        assert!(grant.allows("API.example.com", None, 443));
        assert!(grant.allows("api.example.com", None, 80));
        assert!(!grant.allows("api.example.com", Some(8443), 443), "no port granted: not every port");
        assert!(!grant.allows("api.example.com", Some(22), 80));
        assert!(grant.allows("127.0.0.1", Some(8080), 80));
        assert!(!grant.allows("127.0.0.1", Some(8081), 80));
        assert!(!grant.allows("127.0.0.1", None, 80));
        assert!(!grant.allows("evil.example.com", Some(443), 443));
        assert!(!grant.allows("api.example.com.evil", None, 443));
    }

    #[test]
    fn userinfo_is_refused_and_ports_are_those_granted() {
        let grant = Grant { hosts: vec!["127.0.0.1:8080".into(), "hooks.example.com".into()], private_networks: false };
        let check = |uri: &str| granted(&grant, &uri.parse().unwrap());
        assert_eq!(check("http://127.0.0.1:8080/x").unwrap(), Target { host: "127.0.0.1".into(), port: 8080, tls: false });
        assert!(check("https://hooks.example.com/x").unwrap().tls);
        assert!(check("http://x@127.0.0.1:8080/x").unwrap_err().contains("user information"));
        assert!(check("http://hooks.example.com@127.0.0.1:8080/").is_err());
        assert!(check("https://hooks.example.com:8443/x").unwrap_err().contains("hooks.example.com:8443 is not granted"));
        assert!(check("http://127.0.0.1/x").is_err());
    }

    #[test]
    fn private_loopback_and_metadata_addresses_are_private() {
        for private in ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0", "100.64.0.1", "::1", "fd00::1", "fe80::1", "::ffff:127.0.0.1", "::"] {
            assert!(is_private(private.parse().unwrap()), "{private}");
        }
        for public in ["93.184.216.34", "8.8.8.8", "100.128.0.1", "2606:4700::1111"] {
            assert!(!is_private(public.parse().unwrap()), "{public}");
        }
    }

    #[tokio::test]
    async fn a_name_resolving_to_loopback_is_refused_unless_private_networks_are_granted() {
        let target = Target { host: "localhost".into(), port: 8080, tls: false };
        let error = reachable(&target, false).await.unwrap_err();
        assert!(error.contains("localhost resolves to") && error.contains("does not allow private networks"), "{error}");
        assert!(reachable(&target, true).await.unwrap().ip().is_loopback());
    }
}
