//! The API client: kube's own stack, with `TCP_NODELAY` on its connections.
//!
//! kube-client 5.0 leaves Nagle's algorithm on (kube-rs#2056): a request whose headers and
//! body leave in two TLS records waits for the server's delayed ACK of the first, ~40 ms
//! on Linux. That was most of a pooled claim's PATCH on the test cluster. kube has no
//! switch for it, so the client is assembled from kube's public parts as kube assembles
//! it (timeouts, TLS, base URI, retries, auth, extra headers), on an `HttpConnector` with
//! `TCP_NODELAY`. With a proxy in the kubeconfig, kube builds the client itself.
//! Left out: kube's `HTTP` debug spans, and `Client::valid_until` (the expiry of an exec
//! plugin's client certificate, computed by kube internally; nothing here reads it).

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use kube::client::retry::RetryPolicy;
use kube::{Client, Config};
use tower::retry::RetryLayer;
use tower::{BoxError, ServiceBuilder};

/// A client for `config`, as `Client::try_from(config)` makes it, with `TCP_NODELAY`.
pub(crate) fn build(config: Config) -> kube::Result<Client> {
    if config.proxy_url.is_some() {
        return Client::try_from(config);
    }
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_nodelay(true);
    let mut connector =
        hyper_timeout::TimeoutConnector::new(config.rustls_https_connector_with_connector(tcp)?);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let http = hyper_util::client::legacy::Builder::new(TokioExecutor::new()).build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(http);
    Ok(Client::new(service, config.default_namespace))
}
