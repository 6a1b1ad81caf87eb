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
//! Added: an idempotent request (GET, HEAD, PUT, DELETE; never an exec, attach or
//! port-forward upgrade) that met a pooled connection the
//! server had just closed ("connection closed before message completed": the server's
//! idle close crossed our request) is sent again, once or twice, on a new connection
//! ([`StaleConnectionRetry`]); kube's own retries look at status codes only.

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::Body;
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
        .layer(RetryLayer::new(StaleConnectionRetry { left: 2 }))
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

/// Sends an idempotent request again when the connection it went out on was closed by the
/// server before any answer: nothing of it was processed, or processing it twice is the
/// same (GET, HEAD, PUT, DELETE). At most `left` more times.
#[derive(Clone, Copy, Debug)]
struct StaleConnectionRetry {
    left: u8,
}

impl StaleConnectionRetry {
    /// Whether `e` says the connection closed under the request before any answer.
    fn stale(e: &(dyn std::error::Error + 'static)) -> bool {
        let mut next = Some(e);
        while let Some(e) = next {
            if let Some(h) = e.downcast_ref::<hyper::Error>()
                && (h.is_incomplete_message() || h.is_canceled())
            {
                return true;
            }
            if let Some(io) = e.downcast_ref::<std::io::Error>()
                && matches!(
                    io.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                )
            {
                return true;
            }
            next = e.source();
        }
        false
    }
}

impl<Res> tower::retry::Policy<http::Request<Body>, http::Response<Res>, BoxError>
    for StaleConnectionRetry
{
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        req: &mut http::Request<Body>,
        result: &mut Result<http::Response<Res>, BoxError>,
    ) -> Option<Self::Future> {
        // Never an upgrade (exec, attach, port-forward): the kubelet may have started the
        // command before the connection broke, and a second one would run it twice.
        let upgrade = req.headers().contains_key(http::header::UPGRADE)
            || ["/exec", "/attach", "/portforward"]
                .iter()
                .any(|s| req.uri().path().ends_with(s));
        let idempotent = !upgrade
            && matches!(
                *req.method(),
                http::Method::GET | http::Method::HEAD | http::Method::PUT | http::Method::DELETE
            );
        match result {
            Err(e) if self.left > 0 && idempotent && Self::stale(&**e) => {
                self.left -= 1;
                tracing::debug!(method = %req.method(), uri = %req.uri(), "a pooled connection was closed under the request: sending it again");
                Some(std::future::ready(()))
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &http::Request<Body>) -> Option<http::Request<Body>> {
        let body = req.body().try_clone()?;
        let mut copy = http::Request::builder()
            .method(req.method().clone())
            .uri(req.uri().clone())
            .version(req.version())
            .body(body)
            .ok()?;
        *copy.headers_mut() = req.headers().clone();
        *copy.extensions_mut() = req.extensions().clone();
        Some(copy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exec_is_never_sent_again() {
        let stale = || -> Result<http::Response<()>, BoxError> {
            Err(Box::new(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "reset",
            )))
        };
        let request = |method: http::Method, uri: &str, upgrade: bool| {
            let mut b = http::Request::builder().method(method).uri(uri);
            if upgrade {
                b = b.header(http::header::UPGRADE, "websocket");
            }
            b.body(Body::empty()).unwrap()
        };
        let retried = |mut req: http::Request<Body>| {
            let mut policy = StaleConnectionRetry { left: 2 };
            tower::retry::Policy::retry(&mut policy, &mut req, &mut stale()).is_some()
        };
        assert!(retried(request(
            http::Method::GET,
            "/api/v1/namespaces/n/pods/p",
            false
        )));
        assert!(retried(request(
            http::Method::DELETE,
            "/api/v1/namespaces/n/pods/p",
            false
        )));
        assert!(!retried(request(
            http::Method::POST,
            "/api/v1/namespaces/n/pods",
            false
        )));
        assert!(!retried(request(
            http::Method::PATCH,
            "/api/v1/namespaces/n/pods/p",
            false
        )));
        assert!(!retried(request(
            http::Method::GET,
            "/api/v1/namespaces/n/pods/p/exec?command=true",
            true
        )));
        assert!(!retried(request(
            http::Method::GET,
            "/api/v1/namespaces/n/pods/p/exec",
            false
        )));
        assert!(!retried(request(
            http::Method::GET,
            "/api/v1/namespaces/n/pods/p/attach",
            false
        )));
    }

    #[test]
    fn a_closed_connection_is_stale_and_other_errors_are_not() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("client error (SendRequest)")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let reset = || std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert!(StaleConnectionRetry::stale(&reset()));
        let wrapped: BoxError = Box::new(Outer(reset()));
        assert!(StaleConnectionRetry::stale(&*wrapped));
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(!StaleConnectionRetry::stale(&refused));
    }
}
