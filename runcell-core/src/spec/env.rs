//! Checks shared by run and exec specs: env, argv, absolute paths and users against what
//! engines and the kernel accept, and the size limits.

use std::fmt;

use crate::error::{Error, Result};

/// The kernel's limit for one argument or `NAME=value` string, with its NUL
/// (`MAX_ARG_STRLEN`, 128 KiB).
pub const MAX_ARG_STRLEN: usize = 128 << 10;

/// The most the library lets argv, or the environment, weigh in all (1 MiB; the kernel
/// allows a quarter of the stack limit for both together, usually 2 MiB).
pub const MAX_ENV_TOTAL: usize = 1 << 20;

/// A program and its arguments: a non-empty program, no NUL, each string and the whole
/// within the limits. Errors name `field` or `field[i]`.
pub(crate) fn validate_argv(field: &str, argv: &[String]) -> Result<()> {
    if argv.is_empty() || argv[0].is_empty() {
        return Err(Error::invalid_spec(field, "must name a program"));
    }
    if let Some(i) = argv.iter().position(|a| a.contains('\0')) {
        return Err(Error::invalid_spec(
            format!("{field}[{i}]"),
            "must not contain NUL",
        ));
    }
    if let Some(i) = argv.iter().position(|a| a.len() + 1 > MAX_ARG_STRLEN) {
        return Err(Error::invalid_spec(
            format!("{field}[{i}]"),
            format!(
                "is {} bytes, over the kernel's {MAX_ARG_STRLEN}-byte limit for one argument: pass large data on stdin or as a file",
                argv[i].len()
            ),
        ));
    }
    let total: usize = argv.iter().map(|a| a.len() + 1).sum();
    if total > MAX_ENV_TOTAL {
        return Err(Error::invalid_spec(
            field,
            format!(
                "is {total} bytes in all, over {MAX_ENV_TOTAL}: pass large data on stdin or as a file"
            ),
        ));
    }
    Ok(())
}

/// A user name or `uid[:gid]` an engine can take, naming `user`.
pub(crate) fn validate_user(user: &str) -> Result<()> {
    if user.is_empty() || user.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(Error::invalid_spec(
            "user",
            "must be a non-empty name or uid[:gid] without whitespace or control characters",
        ));
    }
    if user.starts_with('-') || user.matches(':').count() > 1 {
        return Err(Error::invalid_spec(
            "user",
            format!("{user:?} is not a user name or uid[:gid]"),
        ));
    }
    Ok(())
}

/// Env pairs: names without `=` or control characters, values without NUL, each pair
/// within [`MAX_ARG_STRLEN`]. Errors name `field[i].name` or `field[i].value` and never
/// echo a value.
pub(crate) fn validate_env(field: &str, env: &[(String, String)]) -> Result<()> {
    for (i, (name, value)) in env.iter().enumerate() {
        if name.is_empty() {
            return Err(Error::invalid_spec(
                format!("{field}[{i}].name"),
                "must not be empty",
            ));
        }
        if name.contains('=') || name.chars().any(char::is_control) {
            return Err(Error::invalid_spec(
                format!("{field}[{i}].name"),
                format!("{name:?} must not contain '=', NUL, newlines or other control characters"),
            ));
        }
        if value.contains('\0') {
            // The value is not echoed: it may be a secret.
            return Err(Error::invalid_spec(
                format!("{field}[{i}].value"),
                format!("the value of {name} must not contain NUL"),
            ));
        }
        if name.len() + value.len() + 2 > MAX_ARG_STRLEN {
            return Err(Error::invalid_spec(
                format!("{field}[{i}].value"),
                format!(
                    "{name}={{{} bytes}} is over the kernel's {MAX_ARG_STRLEN}-byte limit for one variable: pass large data as a file or on stdin",
                    value.len()
                ),
            ));
        }
    }
    Ok(())
}

/// A value without NUL, naming `field`.
pub(crate) fn validate_value(field: &str, value: &str) -> Result<()> {
    if value.contains('\0') {
        return Err(Error::invalid_spec(field, "must not contain NUL"));
    }
    Ok(())
}

/// An absolute path without control characters, shorter than `PATH_MAX`, naming `field`.
pub(crate) fn validate_abs_path(field: &str, path: &str) -> Result<()> {
    if !path.starts_with('/') {
        return Err(Error::invalid_spec(
            field,
            format!("{path:?} must be an absolute path"),
        ));
    }
    if path.chars().any(char::is_control) {
        return Err(Error::invalid_spec(
            field,
            "must not contain NUL, newlines or other control characters",
        ));
    }
    if path.len() >= 4096 {
        return Err(Error::invalid_spec(field, "is longer than PATH_MAX"));
    }
    Ok(())
}

/// Env for `Debug`: names only, values may be secrets.
pub(crate) struct EnvNames<'a>(pub(crate) &'a [(String, String)]);

impl fmt::Debug for EnvNames<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(k, _)| format!("{k}=***")))
            .finish()
    }
}
