//! The image reference grammar engines accept.

use crate::error::{Error, Result};

/// Checks an image reference against the grammar engines accept
/// (`[host[:port]/]path[:tag][@algorithm:hex]`, path components lowercase), so that a
/// reference no engine can use is an invalid spec naming `image`, not a backend error.
pub fn validate_image(image: &str) -> Result<()> {
    let bad = |why: String| Error::invalid_spec("image", format!("{image:?} {why}"));
    if image.is_empty() {
        return Err(Error::invalid_spec("image", "must not be empty"));
    }
    if image.len() > 4096 || image.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad(
            "is not an image reference (whitespace, control characters or too long)".into(),
        ));
    }
    // Engines take a hex string for an image ID, or for the prefix of one: an ID is
    // accepted only whole, so that a reference never picks an image by a prefix.
    if let Some(hex) = image.strip_prefix("sha256:") {
        if hex.len() != 64 || !is_lower_hex(hex) {
            return Err(bad(
                "is not a whole image ID: an ID is sha256: and all 64 lowercase hex digits (engines match a shorter one as a prefix of any image's ID)".into(),
            ));
        }
        return Ok(());
    }
    if image.len() == 64 && is_lower_hex(image) {
        return Err(bad(
            "is an image ID without its algorithm: write sha256:<id>".into(),
        ));
    }
    let (rest, digest) = match image.split_once('@') {
        Some((rest, digest)) => (rest, Some(digest)),
        None => (image, None),
    };
    if let Some(digest) = digest {
        let (algorithm, hex) = digest
            .split_once(':')
            .ok_or_else(|| bad("has a digest without algorithm:hex".into()))?;
        let algorithm_ok = !algorithm.is_empty()
            && algorithm.split(['+', '.', '_', '-']).all(|c| {
                c.chars().next().is_some_and(|f| f.is_ascii_alphabetic())
                    && c.chars().all(|x| x.is_ascii_alphanumeric())
            });
        if !algorithm_ok || hex.len() < 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad(format!("has an invalid digest {digest:?}")));
        }
    }
    // A tag is after the last ':' that follows the last '/'.
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match rest[last_slash..].rfind(':') {
        Some(i) => (&rest[..last_slash + i], Some(&rest[last_slash + i + 1..])),
        None => (rest, None),
    };
    if let Some(tag) = tag {
        let ok = !tag.is_empty()
            && tag.len() <= 128
            && tag
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
            && tag
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if !ok {
            return Err(bad(format!("has an invalid tag {tag:?}")));
        }
    }
    if name.is_empty() || name.len() > 255 {
        return Err(bad(
            "has no repository name, or one over 255 characters".into()
        ));
    }
    let mut components: Vec<&str> = name.split('/').collect();
    // The first component is a registry host when it looks like one.
    if components.len() > 1 {
        let first = components[0];
        if first.contains(['.', ':'])
            || first == "localhost"
            || first.chars().any(|c| c.is_ascii_uppercase())
        {
            validate_registry_host(first).map_err(bad)?;
            components.remove(0);
        }
    }
    for component in components {
        if !is_path_component(component) {
            return Err(bad(format!(
                "has an invalid repository component {component:?} (lowercase letters, digits and . _ __ - separators)"
            )));
        }
    }
    Ok(())
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether an engine could take this name for the prefix of an image ID: Docker and Podman
/// resolve a hex string (`5`, `0a1b`) that names no local image as the ID prefix of any
/// local image, and containerd's CRI does the same. A driver sending such a name makes the
/// engine resolve it as a name: it checks the image it finds carries the name, or sends
/// [`qualified_name`].
pub fn could_be_id_prefix(image: &str) -> bool {
    !image.is_empty() && image.len() < 64 && is_lower_hex(image)
}

/// The reference with its registry and tag written out as Docker normalizes them (`5` →
/// `docker.io/library/5:latest`, `team/app` → `docker.io/team/app:latest`): the same image,
/// in a form no engine reads as an image ID. Image IDs (`sha256:...`) stay as they are.
pub fn qualified_name(image: &str) -> String {
    if image.starts_with("sha256:") {
        return image.to_string();
    }
    let (rest, digest) = match image.split_once('@') {
        Some((rest, digest)) => (rest, Some(digest)),
        None => (image, None),
    };
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let has_tag = rest[last_slash..].contains(':');
    let mut out = match rest.split_once('/') {
        Some((first, _))
            if first.contains(['.', ':'])
                || first == "localhost"
                || first.chars().any(|c| c.is_ascii_uppercase()) =>
        {
            rest.to_string()
        }
        Some(_) => format!("docker.io/{rest}"),
        None => format!("docker.io/library/{rest}"),
    };
    match digest {
        Some(digest) => {
            out.push('@');
            out.push_str(digest);
        }
        None if !has_tag => out.push_str(":latest"),
        None => {}
    }
    out
}

fn validate_registry_host(host: &str) -> std::result::Result<(), String> {
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        let (ip, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("has an invalid registry host {host:?}"))?;
        if ip.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("has an invalid registry host {host:?}"));
        }
        (None, after.strip_prefix(':'))
    } else {
        match host.split_once(':') {
            Some((n, p)) => (Some(n), Some(p)),
            None => (Some(host), None),
        }
    };
    if let Some(name) = name {
        let ok = name.split('.').all(|c| {
            !c.is_empty()
                && c.chars().all(|x| x.is_ascii_alphanumeric() || x == '-')
                && !c.starts_with('-')
                && !c.ends_with('-')
        });
        if !ok {
            return Err(format!("has an invalid registry host {host:?}"));
        }
    }
    if let Some(port) = port
        && (port.is_empty() || port.parse::<u16>().is_err())
    {
        return Err(format!("has an invalid registry port in {host:?}"));
    }
    Ok(())
}

/// `[a-z0-9]+` joined by `.`, `_`, `__` or runs of `-`.
fn is_path_component(c: &str) -> bool {
    let bytes = c.as_bytes();
    if bytes.is_empty()
        || !bytes[0].is_ascii_alphanumeric()
        || !bytes[bytes.len() - 1].is_ascii_alphanumeric()
    {
        return false;
    }
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b.is_ascii_lowercase() || b.is_ascii_digit() {
            i += 1;
            continue;
        }
        // A separator: ".", "_", "__" or "-"+, always between alphanumerics.
        let start = i;
        match b {
            b'.' => i += 1,
            b'_' => {
                i += 1;
                if i < bytes.len() && bytes[i] == b'_' {
                    i += 1;
                }
            }
            b'-' => {
                while i < bytes.len() && bytes[i] == b'-' {
                    i += 1;
                }
            }
            _ => return false,
        }
        if i >= bytes.len()
            || !(bytes[i].is_ascii_lowercase() || bytes[i].is_ascii_digit())
            || start == 0
        {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_references_follow_the_engines_grammar() {
        for ok in [
            "busybox",
            "busybox:latest",
            "library/busybox:1.36",
            "sandbox-test/busybox:latest",
            "localhost:5000/team/img:v1",
            "registry.example.com/a/b/c",
            "Registry.Example.com/a",
            "[::1]:5000/img",
            "img@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "my_img__x.y-z---w:TAG_1.2-3",
            "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "5",
            "deadbeef:latest",
        ] {
            validate_image(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "",
            "team/UPPER",
            "Busybox",
            "garbage:::",
            "a b",
            "img:",
            "img:-tag",
            "/img",
            "img/",
            "a//b",
            "-img",
            "img-",
            "img@sha256:short",
            "img@:0123456789abcdef0123456789abcdef",
            "host:99999/img",
            "img\n",
            // Image IDs only whole, never a prefix.
            "sha256:0123",
            "sha256:0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef",
            "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde",
            "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ] {
            let e = validate_image(bad).expect_err(bad);
            assert_eq!(e.field(), Some("image"), "{bad}");
        }
    }

    #[test]
    fn hex_names_are_qualified_so_no_engine_reads_an_id_prefix() {
        for (image, risky) in [
            ("5", true),
            ("0a1b", true),
            ("deadbeef", true),
            ("5:latest", false),
            ("team/5", false),
            ("busybox", false),
            ("ABC", false),
            (
                "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                false,
            ),
        ] {
            assert_eq!(could_be_id_prefix(image), risky, "{image}");
        }
        for (image, qualified) in [
            ("5", "docker.io/library/5:latest"),
            ("busybox:1.36", "docker.io/library/busybox:1.36"),
            ("team/app", "docker.io/team/app:latest"),
            ("localhost:5000/app", "localhost:5000/app:latest"),
            ("localhost/app:v1", "localhost/app:v1"),
            ("reg.io/a/b@sha256:00ff", "reg.io/a/b@sha256:00ff"),
            ("sha256:0123", "sha256:0123"),
        ] {
            assert_eq!(qualified_name(image), qualified, "{image}");
            assert!(!could_be_id_prefix(&qualified_name(image)), "{image}");
        }
    }
}
