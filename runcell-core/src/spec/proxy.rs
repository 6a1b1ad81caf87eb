//! The outbound HTTP proxy: the variables it sets and a `Debug` without credentials.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::env::validate_value;
use crate::error::{Error, Result};

/// Outbound HTTP proxy settings, injected in both upper and lower case. `Debug` hides
/// credentials in the URLs.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Proxy {
    /// `HTTP_PROXY` / `http_proxy`.
    pub http: Option<String>,
    /// `HTTPS_PROXY` / `https_proxy`.
    pub https: Option<String>,
    /// Hosts that bypass the proxy; `localhost,127.0.0.1,::1` are always added.
    pub no_proxy: Vec<String>,
}

impl Proxy {
    /// The hosts always present in `no_proxy`.
    pub const ALWAYS_NO_PROXY: [&'static str; 3] = ["localhost", "127.0.0.1", "::1"];

    /// True when no proxy is configured at all.
    pub fn is_empty(&self) -> bool {
        self.http.is_none() && self.https.is_none() && self.no_proxy.is_empty()
    }

    /// The environment this proxy adds to the run, in both cases, `no_proxy` always
    /// including loopback. Empty when no proxy is set.
    pub fn env(&self) -> Vec<(String, String)> {
        if self.is_empty() {
            return Vec::new();
        }
        let mut env = Vec::new();
        let mut both = |name: &str, value: &str| {
            env.push((name.to_ascii_uppercase(), value.to_string()));
            env.push((name.to_string(), value.to_string()));
        };
        if let Some(v) = &self.http {
            both("http_proxy", v);
        }
        if let Some(v) = &self.https {
            both("https_proxy", v);
        }
        let mut hosts: Vec<&str> = Vec::new();
        for h in self
            .no_proxy
            .iter()
            .map(String::as_str)
            .chain(Self::ALWAYS_NO_PROXY)
        {
            if !h.is_empty() && !hosts.contains(&h) {
                hosts.push(h);
            }
        }
        both("no_proxy", &hosts.join(","));
        env
    }

    /// Checks the URLs (no NUL) and that each `no_proxy` entry is one host, naming
    /// `proxy.http`, `proxy.https` or `proxy.no_proxy[i]`.
    pub(crate) fn validate(&self) -> Result<()> {
        for (name, value) in [("proxy.http", &self.http), ("proxy.https", &self.https)] {
            if let Some(v) = value {
                validate_value(name, v)?;
            }
        }
        for (i, h) in self.no_proxy.iter().enumerate() {
            if h.contains(',') || h.contains('\0') {
                return Err(Error::invalid_spec(
                    format!("proxy.no_proxy[{i}]"),
                    "must be one host without ',' or NUL",
                ));
            }
        }
        Ok(())
    }
}

/// A URL with everything between the scheme (if any) and the last `@` hidden, whatever
/// the URL's form (`http://u:p@h`, `u:p@h:3128`, a password holding `/` or `@`).
fn redact_url(url: &str) -> String {
    let Some(at) = url.rfind('@') else {
        return url.to_string();
    };
    let start = url.find("://").map_or(0, |i| i + 3);
    if start > at {
        return url.to_string();
    }
    format!("{}***@{}", &url[..start], &url[at + 1..])
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("http", &self.http.as_deref().map(redact_url))
            .field("https", &self.https.as_deref().map(redact_url))
            .field("no_proxy", &self.no_proxy)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RunSpec;

    #[test]
    fn proxy_credentials_are_hidden_whatever_the_form() {
        for url in [
            "http://user:pa55@proxy:3128",
            "user:pa55@proxy:3128",
            "http://user:pa/55@proxy:3128",
            "http://us@er:pa55@proxy:3128/",
            "socks5h://:pa55@proxy",
        ] {
            let mut spec = RunSpec::new("img");
            spec.proxy.https = Some(url.into());
            let text = format!("{spec:?}");
            assert!(
                !text.contains("pa55") && text.contains("proxy"),
                "{url}: {text}"
            );
        }
    }

    #[test]
    fn proxy_env_sets_both_cases_and_loopback() {
        let p = Proxy {
            http: Some("http://proxy:3128".into()),
            https: None,
            no_proxy: vec!["internal".into(), "localhost".into()],
        };
        let env = p.env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("HTTP_PROXY"), Some("http://proxy:3128"));
        assert_eq!(get("http_proxy"), Some("http://proxy:3128"));
        assert_eq!(get("HTTPS_PROXY"), None);
        assert_eq!(get("no_proxy"), Some("internal,localhost,127.0.0.1,::1"));
        assert_eq!(get("NO_PROXY"), get("no_proxy"));
        assert!(Proxy::default().env().is_empty());
    }

    #[test]
    fn bad_urls_and_hosts_name_their_field() {
        let field = |p: Proxy| p.validate().unwrap_err().field().unwrap().to_string();
        let http = Proxy {
            http: Some("http://proxy\0".into()),
            ..Proxy::default()
        };
        assert_eq!(field(http), "proxy.http");
        let https = Proxy {
            https: Some("\0".into()),
            ..Proxy::default()
        };
        assert_eq!(field(https), "proxy.https");
        let hosts = Proxy {
            no_proxy: vec!["ok".into(), "a,b".into()],
            ..Proxy::default()
        };
        assert_eq!(field(hosts), "proxy.no_proxy[1]");
        Proxy::default().validate().unwrap();
    }
}
