//! Custom CA certificates: parsing and the files and variables a run gets.
//!
//! The file-valued variables (`SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`, `CURL_CA_BUNDLE`,
//! `GIT_SSL_CAINFO`) replace a tool's default store, so they point at a full bundle: the
//! image's system roots followed by the injected certificates. `NODE_EXTRA_CA_CERTS` is
//! additive and points at the injected certificates alone.

use crate::error::{Error, Result};

/// Directory inside the run holding the CA files.
pub const DIR: &str = "/etc/sandbox";
/// The injected certificates alone.
pub const CA_FILE: &str = "/etc/sandbox/ca.pem";
/// System roots followed by the injected certificates.
pub const BUNDLE_FILE: &str = "/etc/sandbox/ca-bundle.pem";

/// Where images keep their system bundle, most common first.
pub const SYSTEM_BUNDLES: [&str; 3] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

/// Where Debian-like images take extra CAs from (`update-ca-certificates`).
pub const SYSTEM_EXTRA_DIR_FILE: &str = "/usr/local/share/ca-certificates/sandbox-ca.crt";

/// The environment that points tools at the CA files.
pub fn env() -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "GIT_SSL_CAINFO",
    ]
    .iter()
    .map(|k| (k.to_string(), BUNDLE_FILE.to_string()))
    .collect();
    env.push(("NODE_EXTRA_CA_CERTS".into(), CA_FILE.into()));
    env
}

/// The largest CA bundle a spec may carry (a Kubernetes Secret holds at most 1 MiB).
pub const MAX_CA_BUNDLE_BYTES: usize = 512 << 10;

/// Parses a PEM text that must hold at least one X.509 certificate and nothing else.
/// Returns the certificates re-encoded as normalized PEM.
pub fn parse_certificates(pem_text: &str) -> Result<String> {
    if pem_text.len() > MAX_CA_BUNDLE_BYTES {
        return Err(Error::invalid_spec(
            "ca_bundle",
            format!(
                "is {} bytes, more than {MAX_CA_BUNDLE_BYTES}: a whole public trust store is about 220 KiB",
                pem_text.len()
            ),
        ));
    }
    let blocks = pem::parse_many(pem_text.as_bytes())
        .map_err(|e| Error::invalid_spec("ca_bundle", format!("is not valid PEM: {e}")))?;
    if blocks.is_empty() {
        return Err(Error::invalid_spec("ca_bundle", "holds no PEM certificate"));
    }
    let mut out = String::new();
    for (i, block) in blocks.iter().enumerate() {
        if block.tag() != "CERTIFICATE" {
            return Err(Error::invalid_spec(
                "ca_bundle",
                format!("PEM block {i} is a {:?}, not a CERTIFICATE", block.tag()),
            ));
        }
        let (_, cert) = x509_parser::parse_x509_certificate(block.contents()).map_err(|e| {
            Error::invalid_spec(
                "ca_bundle",
                format!("PEM block {i} is not an X.509 certificate: {e}"),
            )
        })?;
        // A certificate no TLS client will accept now is a mistake to report here, not
        // a handshake failure to puzzle over later.
        let validity = cert.validity();
        if !validity.is_valid() {
            return Err(Error::invalid_spec(
                "ca_bundle",
                format!(
                    "certificate {i} ({}) is not valid now: valid from {} to {}",
                    cert.subject(),
                    validity.not_before,
                    validity.not_after
                ),
            ));
        }
        out.push_str(&pem::encode_config(
            block,
            pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF),
        ));
    }
    Ok(out)
}

/// `text` (a PEM bundle) without the last copy of each certificate of `injected`: what a
/// snapshot keeps of a system bundle the library appended the run's CA to (an image's own
/// copy of the same certificate stays).
pub fn without_last_copies(text: &str, injected: &str) -> String {
    const END: &str = "-----END CERTIFICATE-----";
    let mut out = text.to_string();
    let mut rest = injected;
    while let Some(begin) = rest.find("-----BEGIN CERTIFICATE-----") {
        let Some(end) = rest[begin..].find(END) else {
            break;
        };
        let block = &rest[begin..begin + end + END.len()];
        if let Some(at) = out.rfind(block) {
            let mut stop = at + block.len();
            if out[stop..].starts_with('\n') {
                stop += 1;
            }
            out.replace_range(at..stop, "");
        }
        rest = &rest[begin + end + END.len()..];
    }
    out
}

/// The full bundle: the system roots (may be empty) and then the injected certificates.
pub fn full_bundle(system: &str, injected: &str) -> String {
    let mut out = system.to_string();
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(injected);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed test CA (no private key anywhere in the repo needs to be secret).
    pub(crate) const TEST_CA: &str = include_str!("../testdata/test-ca.pem");

    #[test]
    fn parses_a_certificate_and_rejects_other_pem() {
        let norm = parse_certificates(TEST_CA).unwrap();
        assert!(norm.starts_with("-----BEGIN CERTIFICATE-----\n"));
        assert_eq!(
            parse_certificates(&format!("{TEST_CA}\n{TEST_CA}"))
                .unwrap()
                .matches("BEGIN")
                .count(),
            2
        );
        let key = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
        assert_eq!(
            parse_certificates(key).unwrap_err().field(),
            Some("ca_bundle")
        );
        let junk = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert!(parse_certificates(junk).is_err());
        assert!(parse_certificates("").is_err());
    }

    #[test]
    fn bundle_appends_after_system_roots() {
        assert_eq!(full_bundle("A", "B\n"), "A\nB\n");
        assert_eq!(full_bundle("", "B\n"), "B\n");
    }
}
