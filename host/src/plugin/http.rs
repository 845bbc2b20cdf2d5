//! Outgoing HTTP of plugins (wasi:http), allowed only to the hosts the operator granted.

use std::future::Future;
use std::sync::Arc;

use wasmtime_wasi_http::{Error, RequestOptions, WasiBody, WasiHttpHooks};

use super::PluginPolicy;

type ResponseFuture = Box<
    dyn Future<Output = Result<(http::Response<WasiBody>, Box<dyn Future<Output = Result<(), Error>> + Send>), Error>>
        + Send,
>;

/// The HTTP hooks of one delivery: a request to a host not granted fails with
/// `HTTP-request-denied` before anything leaves the process.
pub(crate) struct GrantedHosts {
    plugin: Arc<str>,
    policy: Arc<PluginPolicy>,
}

impl GrantedHosts {
    pub fn new(plugin: Arc<str>, policy: Arc<PluginPolicy>) -> Self {
        Self { plugin, policy }
    }
}

impl WasiHttpHooks for GrantedHosts {
    fn send_request(
        &mut self,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
        _fut: Box<dyn Future<Output = Result<(), Error>> + Send>,
    ) -> ResponseFuture {
        if let Err(reason) = granted(&self.policy, request.uri()) {
            tracing::warn!(plugin = %self.plugin, %reason, "an HTTP request was denied");
            return Box::new(async { Err(Error::HttpRequestDenied) });
        }
        Box::new(async move {
            use http_body_util::BodyExt;
            let (response, io) = wasmtime_wasi_http::default_send_request(request, options).await?;
            Ok((response.map(BodyExt::boxed_unsync), Box::new(io) as Box<dyn Future<Output = _> + Send>))
        })
    }
}

/// Whether the policy grants a request to `uri`; the reason when not. An authority with user
/// information (`x@host`) is refused whatever its host: the grant names hosts, not accounts.
fn granted(policy: &PluginPolicy, uri: &http::Uri) -> Result<(), String> {
    let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
    if authority.contains('@') {
        return Err(format!("user information in the authority of {:?}", uri.host().unwrap_or_default()));
    }
    let host = uri.host().unwrap_or_default();
    let default_port = if uri.scheme_str() == Some("https") { 443 } else { 80 };
    if policy.grants.allows_http(host, uri.port_u16(), default_port) {
        Ok(())
    } else {
        Err(format!("{host}:{} is not granted", uri.port_u16().unwrap_or(default_port)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::Grants;

    #[test]
    fn userinfo_is_refused_and_ports_are_those_granted() {
        let grants = Grants { http_hosts: vec!["127.0.0.1:8080".into(), "hooks.example.com".into()], ..Default::default() };
        let policy = PluginPolicy { grants, ..Default::default() };
        let check = |uri: &str| granted(&policy, &uri.parse().unwrap());
        assert!(check("http://127.0.0.1:8080/x").is_ok());
        assert!(check("https://hooks.example.com/x").is_ok());
        assert!(check("http://x@127.0.0.1:8080/x").unwrap_err().contains("user information"));
        assert!(check("http://hooks.example.com@127.0.0.1:8080/").is_err());
        assert!(check("https://hooks.example.com:8443/x").unwrap_err().contains("hooks.example.com:8443 is not granted"));
        assert!(check("http://127.0.0.1/x").is_err());
    }
}
