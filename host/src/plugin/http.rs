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
        let uri = request.uri();
        let host = uri.host().unwrap_or_default().to_string();
        let port = uri.port_u16();
        if !self.policy.grants.allows_http(&host, port) {
            tracing::warn!(plugin = %self.plugin, %host, ?port, "HTTP request to a host not granted was denied");
            return Box::new(async { Err(Error::HttpRequestDenied) });
        }
        Box::new(async move {
            use http_body_util::BodyExt;
            let (response, io) = wasmtime_wasi_http::default_send_request(request, options).await?;
            Ok((response.map(BodyExt::boxed_unsync), Box::new(io) as Box<dyn Future<Output = _> + Send>))
        })
    }
}
