//! What the container is given: `hostRequirements`, `securityOpt` and the `runArgs` flags
//! runcell can express, and the size formats they are written in.

use jsonc_parser::ast::Value;
use jsonc_parser::common::Range;
use runcell_core::{Network, Result};

use super::Mapper;
use crate::parse::value_range;

impl<'a> Mapper<'a> {
    pub(super) fn map_host_requirements(&mut self, req: &Value<'a>) -> Result<()> {
        let object = self.object("hostRequirements", req)?;
        for (name, prop) in self.properties("hostRequirements", object)? {
            let path = format!("hostRequirements.{name}");
            let range = prop.range;
            match name.as_str() {
                "cpus" => {
                    let cpus = match &prop.value {
                        Value::NumberLit(n) => n.value.parse::<f64>().ok(),
                        other => return Err(self.wrong_type(&path, other, "a number")),
                    };
                    let Some(cpus) = cpus else {
                        return Err(self.invalid(&path, range, "is not a number"));
                    };
                    self.spec.resources.cpus = Some(cpus);
                    self.origins.insert("resources.cpus".into(), (path, range));
                }
                "memory" => {
                    let text = self.string(&path, &prop.value)?;
                    let bytes = host_size(&text).ok_or_else(|| {
                        self.invalid(
                            &path,
                            range,
                            format!(
                                "{text:?} is not a size such as \"8gb\" (tb, gb, mb, kb or bytes)"
                            ),
                        )
                    })?;
                    self.spec.resources.memory_bytes = Some(bytes);
                    self.origins
                        .insert("resources.memory_bytes".into(), (path, range));
                }
                "storage" => {
                    let text = self.string(&path, &prop.value)?;
                    if host_size(&text).is_none() {
                        return Err(self.invalid(
                            &path,
                            range,
                            format!(
                                "{text:?} is not a size such as \"32gb\" (tb, gb, mb, kb or bytes)"
                            ),
                        ));
                    }
                }
                "gpu" => match &prop.value {
                    Value::BooleanLit(b) if !b.value => {}
                    Value::StringLit(s) if s.value == "optional" => {}
                    Value::BooleanLit(_) | Value::Object(_) => {
                        return Err(self.unsupported(&path, range, "GPUs are not supported"));
                    }
                    other => {
                        return Err(self.wrong_type(
                            &path,
                            other,
                            "true, false, \"optional\" or an object",
                        ));
                    }
                },
                _ => {
                    return Err(self.invalid(
                        &path,
                        range,
                        "is not a host requirement (cpus, memory, storage, gpu)",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Applies a security option; false when it is not one runcell has.
    pub(super) fn security_opt(&mut self, opt: &str, path: &str, range: Range) -> bool {
        let on = match opt {
            "no-new-privileges" | "no-new-privileges:true" | "no-new-privileges=true" => true,
            "no-new-privileges:false" | "no-new-privileges=false" => false,
            _ => return false,
        };
        self.spec.security.no_new_privileges = on;
        self.origins
            .insert("security.no_new_privileges".into(), (path.into(), range));
        true
    }

    pub(super) fn map_run_args(&mut self, args: &Value<'a>) -> Result<()> {
        let elements = self.array("runArgs", args)?;
        let mut args = Vec::with_capacity(elements.len());
        for (i, element) in elements.iter().enumerate() {
            let path = format!("runArgs[{i}]");
            args.push((self.string(&path, element)?, path, value_range(element)));
        }
        let mut i = 0;
        while i < args.len() {
            let (arg, path, range) = args[i].clone();
            i += 1;
            let (flag, inline) = split_flag(&arg);
            let Some(flag) = RunFlag::of(flag) else {
                let why = if arg.starts_with('-') {
                    format!(
                        "{arg:?} cannot be expressed in a run spec (see the runArgs table of runcell_devcontainer)"
                    )
                } else {
                    format!("{arg:?} is not a flag")
                };
                return Err(self.unsupported(&path, range, why));
            };
            if flag.is_switch() {
                let on = match inline.as_deref() {
                    None | Some("true") => true,
                    Some("false") => false,
                    Some(_) => {
                        return Err(self.invalid(
                            &path,
                            range,
                            format!("{arg:?}: the value must be true or false"),
                        ));
                    }
                };
                // --init: every run has one.
                if flag == RunFlag::ReadOnly {
                    self.spec.security.read_only_rootfs = on;
                    self.origins
                        .insert("security.read_only_rootfs".into(), (path, range));
                }
                continue;
            }
            let (value, vpath, vrange) = match inline {
                Some(value) => (value, path, range),
                None => match args.get(i) {
                    Some((value, vpath, vrange)) => {
                        i += 1;
                        (value.clone(), vpath.clone(), *vrange)
                    }
                    None => {
                        return Err(self.invalid(&path, range, format!("{arg:?} needs a value")));
                    }
                },
            };
            self.run_flag(flag, &value, vpath, vrange)?;
        }
        Ok(())
    }

    fn run_flag(&mut self, flag: RunFlag, value: &str, path: String, range: Range) -> Result<()> {
        match flag {
            RunFlag::Env => match value.split_once('=') {
                Some((name, v)) => self.set_env(name.into(), v.into(), (path, range)),
                None => {
                    if let Some(v) = self.cx.local_value(value) {
                        self.set_env(value.into(), v, (path, range));
                    }
                }
            },
            RunFlag::User => {
                self.spec.user = Some(value.into());
                self.origins.insert("user".into(), (path, range));
            }
            RunFlag::Workdir => {
                self.spec.working_dir = Some(value.into());
                self.origins.insert("working_dir".into(), (path, range));
            }
            RunFlag::Memory => {
                let bytes = docker_size(value).ok_or_else(|| {
                    self.invalid(
                        &path,
                        range,
                        format!("{value:?} is not a memory size such as 512m or 2g"),
                    )
                })?;
                self.spec.resources.memory_bytes = Some(bytes);
                self.origins
                    .insert("resources.memory_bytes".into(), (path, range));
            }
            RunFlag::Cpus => {
                let cpus = value.trim().parse::<f64>().map_err(|_| {
                    self.invalid(&path, range, format!("{value:?} is not a number of CPUs"))
                })?;
                self.spec.resources.cpus = Some(cpus);
                self.origins.insert("resources.cpus".into(), (path, range));
            }
            RunFlag::Pids => {
                let pids = value.trim().parse::<i64>().map_err(|_| {
                    self.invalid(
                        &path,
                        range,
                        format!("{value:?} is not a number of processes"),
                    )
                })?;
                self.spec.resources.pids =
                    if pids <= 0 {
                        None
                    } else {
                        Some(u32::try_from(pids).map_err(|_| {
                            self.invalid(&path, range, format!("{pids} is too large"))
                        })?)
                    };
                self.origins.insert("resources.pids".into(), (path, range));
            }
            RunFlag::Network => {
                self.spec.network = match value {
                    "none" => Network::None,
                    "default" | "bridge" => Network::Default,
                    other => {
                        return Err(self.unsupported(
                            &path,
                            range,
                            format!(
                                "network {other:?} is not supported (none, or the engine's default)"
                            ),
                        ));
                    }
                };
                self.origins.insert("network".into(), (path, range));
            }
            RunFlag::CapDrop => {
                let upper = value.to_ascii_uppercase();
                let cap = upper.strip_prefix("CAP_").unwrap_or(&upper).to_string();
                self.spec.security.cap_drop.push(cap);
                self.cap_origin.push((path, range));
            }
            RunFlag::SecurityOpt => {
                if !self.security_opt(value, &path, range) {
                    return Err(self.unsupported(
                        &path,
                        range,
                        format!(
                            "security option {value:?} is not supported (only no-new-privileges)"
                        ),
                    ));
                }
            }
            RunFlag::Label => {
                let (key, v) = value.split_once('=').unwrap_or((value, ""));
                self.spec.labels.insert(key.into(), v.into());
                self.origins
                    .insert(format!("labels[{key:?}]"), (path, range));
            }
            RunFlag::ReadOnly | RunFlag::Init => unreachable!("switches are handled by the caller"),
        }
        Ok(())
    }
}

/// A size in `hostRequirements`: digits, then `kb`, `mb`, `gb` or `tb` (powers of 1024) or
/// nothing (bytes), any case.
fn host_size(text: &str) -> Option<u64> {
    let lower = text.trim().to_ascii_lowercase();
    let digits_end = lower
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(lower.len());
    let (digits, unit) = lower.split_at(digits_end);
    let n: u64 = digits.parse().ok()?;
    let shift = match unit {
        "" => 0,
        "kb" => 10,
        "mb" => 20,
        "gb" => 30,
        "tb" => 40,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

/// A size as Docker's `--memory` takes it: a number (with decimals), then `b`, `k`, `m`,
/// `g`, `t` or `p` (powers of 1024), optionally with `i` and `b` after, any case.
fn docker_size(text: &str) -> Option<u64> {
    let lower = text.trim().to_ascii_lowercase();
    let number_end = lower
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(lower.len());
    let (number, unit) = lower.split_at(number_end);
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return None;
    }
    let n: f64 = number.parse().ok()?;
    let unit = unit.trim_start();
    let unit = unit.strip_suffix('b').unwrap_or(unit);
    let unit = unit.strip_suffix('i').unwrap_or(unit);
    let shift = match unit {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        "p" => 50,
        _ => return None,
    };
    let bytes = n * (1u64 << shift) as f64;
    (bytes.is_finite() && bytes < u64::MAX as f64).then_some(bytes as u64)
}

/// A `runArgs` flag runcell can express.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunFlag {
    Env,
    User,
    Workdir,
    Memory,
    Cpus,
    Pids,
    Network,
    CapDrop,
    SecurityOpt,
    Label,
    ReadOnly,
    Init,
}

impl RunFlag {
    fn of(flag: &str) -> Option<RunFlag> {
        Some(match flag {
            "-e" | "--env" => RunFlag::Env,
            "-u" | "--user" => RunFlag::User,
            "-w" | "--workdir" => RunFlag::Workdir,
            "-m" | "--memory" => RunFlag::Memory,
            "--cpus" => RunFlag::Cpus,
            "--pids-limit" => RunFlag::Pids,
            "--network" | "--net" => RunFlag::Network,
            "--cap-drop" => RunFlag::CapDrop,
            "--security-opt" => RunFlag::SecurityOpt,
            "-l" | "--label" => RunFlag::Label,
            "--read-only" => RunFlag::ReadOnly,
            "--init" => RunFlag::Init,
            _ => return None,
        })
    }

    /// A flag without a value (`--read-only`, `--init`; `=true`/`=false` allowed).
    fn is_switch(self) -> bool {
        matches!(self, RunFlag::ReadOnly | RunFlag::Init)
    }
}

/// `--flag=value` → (`--flag`, `value`); `-fvalue` and `-f=value` → (`-f`, `value`) for the
/// one-letter flags runcell knows; anything else as it is.
fn split_flag(arg: &str) -> (&str, Option<String>) {
    if let Some(long) = arg.strip_prefix("--") {
        return match long.split_once('=') {
            Some((name, value)) => (&arg[..2 + name.len()], Some(value.to_string())),
            None => (arg, None),
        };
    }
    if arg.len() > 2
        && arg.is_char_boundary(2)
        && matches!(&arg[..2], "-e" | "-u" | "-w" | "-m" | "-l")
    {
        let value = &arg[2..];
        return (
            &arg[..2],
            Some(value.strip_prefix('=').unwrap_or(value).to_string()),
        );
    }
    (arg, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_their_formats() {
        assert_eq!(host_size("8gb"), Some(8 << 30));
        assert_eq!(host_size("512MB"), Some(512 << 20));
        assert_eq!(host_size("1tb"), Some(1 << 40));
        assert_eq!(host_size("4096"), Some(4096));
        for bad in ["", "gb", "8 gb", "8g", "1.5gb", "-1gb", "99999999999999tb"] {
            assert_eq!(host_size(bad), None, "{bad}");
        }
        assert_eq!(docker_size("512m"), Some(512 << 20));
        assert_eq!(docker_size("1.5g"), Some(3 << 29));
        assert_eq!(docker_size("2GiB"), Some(2 << 30));
        assert_eq!(docker_size("2 GB"), Some(2 << 30));
        assert_eq!(docker_size("1024"), Some(1024));
        assert_eq!(docker_size("64k"), Some(64 << 10));
        for bad in ["", "m", ".5g", "1.g", "1x", "1e9", "-1m", "99999999999p"] {
            assert_eq!(docker_size(bad), None, "{bad}");
        }
    }

    #[test]
    fn flags_split_as_the_docker_cli_splits_them() {
        assert_eq!(split_flag("--env=A=1"), ("--env", Some("A=1".into())));
        assert_eq!(split_flag("--env"), ("--env", None));
        assert_eq!(split_flag("-eA=1"), ("-e", Some("A=1".into())));
        assert_eq!(split_flag("-e=A=1"), ("-e", Some("A=1".into())));
        assert_eq!(split_flag("-e"), ("-e", None));
        assert_eq!(split_flag("-it"), ("-it", None));
        assert_eq!(split_flag("-é"), ("-é", None));
    }
}
