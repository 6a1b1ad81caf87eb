//! A Docker daemon behind TLS on loopback: the test's own TLS front on
//! `127.0.0.1:<port>` (rustls, client certificates required, as `dockerd --tlsverify`
//! does) passing each connection on to the engine's unix socket, and certificates made
//! here with `openssl` (a CA, a server certificate for 127.0.0.1, client certificates).
//! The driver connects with `cert_path`, starts a run (on the exec helper path), execs,
//! moves a file and stops; a client certificate of another CA, plain HTTP and missing
//! files are typed errors. (A second `dockerd` on TLS would do too, but it shares the
//! host's network namespace, and a second daemon without a bridge deletes `docker0`
//! under the first.) Skipped without the engine or `openssl`, unless `CI` is set or
//! `RUNCELL_REQUIRE` names docker: then it fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use runcell_core::ErrorKind;
use runcell_docker::{DockerConfig, DockerDriver};

mod common;
use common::{can_run, issue, new_ca, whole_run};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

const SOCKET: &str = "/var/run/docker.sock";

fn missing() -> Option<String> {
    let openssl = Command::new("openssl")
        .arg("version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !openssl {
        return Some("openssl is not installed".into());
    }
    if !Path::new(SOCKET).exists() {
        return Some(format!("no Docker engine at {SOCKET}"));
    }
    None
}

/// A client cert directory as the docker CLI lays it out.
fn client_dir(dir: &Path, name: &str, ca: &str, client: &str) -> PathBuf {
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(dir.join(format!("{ca}-cert.pem")), out.join("ca.pem")).unwrap();
    std::fs::copy(dir.join(format!("{client}-cert.pem")), out.join("cert.pem")).unwrap();
    std::fs::copy(dir.join(format!("{client}-key.pem")), out.join("key.pem")).unwrap();
    out
}

/// The TLS front: requires a client certificate of the CA, then relays the connection to
/// the engine's socket. Returns its `tcp://` address.
async fn tls_front(dir: &Path) -> String {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let certs = CertificateDer::pem_file_iter(dir.join("server-cert.pem"))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(dir.join("server-key.pem")).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(dir.join("ca-cert.pem")).unwrap() {
        roots.add(ca.unwrap()).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
        .build()
        .unwrap();
    let config = rustls::ServerConfig::builder()
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut engine) = tokio::net::UnixStream::connect(SOCKET).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut engine).await;
            });
        }
    });
    address
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_daemon_on_loopback() {
    if !can_run("the TLS test", missing()) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    new_ca(dir, "ca");
    new_ca(dir, "other-ca");
    issue(
        dir,
        "ca",
        "server",
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    issue(dir, "ca", "client", "extendedKeyUsage=clientAuth\n");
    issue(dir, "other-ca", "stranger", "extendedKeyUsage=clientAuth\n");
    let good = client_dir(dir, "client", "ca", "client");
    let stranger = client_dir(dir, "stranger", "ca", "stranger");
    let tcp = tls_front(dir).await;

    // The driver with the client's cert directory: a whole run through TLS, and the same
    // through the registry's config keys.
    let driver = DockerDriver::connect(DockerConfig::default().host(&tcp).cert_path(&good))
        .await
        .expect("connect over TLS");
    whole_run(
        &driver,
        "tls",
        vec![
            ("host", tcp.clone()),
            ("cert_path", good.display().to_string()),
        ],
    )
    .await;

    // A client certificate of another CA: refused, a typed error naming the address.
    let err = DockerDriver::connect(DockerConfig::default().host(&tcp).cert_path(&stranger))
        .await
        .expect_err("a stranger's certificate was accepted");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains(&tcp), "{err}");

    // No TLS at all against the TLS port.
    let err = DockerDriver::connect(DockerConfig::default().host(tcp.replace("tcp://", "http://")))
        .await
        .expect_err("plain HTTP was accepted");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");

    // Missing files: a configuration error naming cert_path, before any connection.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let err = DockerDriver::connect(DockerConfig::default().host(&tcp).cert_path(&empty))
        .await
        .expect_err("an empty cert directory was accepted");
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert_eq!(err.field(), Some("cert_path"), "{err}");
}
