//! Mapping a parsed file to a [`RunSpec`]: property by property, with the origin of every
//! field kept so that a value the spec rejects is reported as the property it came from.
//! The workspace and mounts are in [`mounts`], `runArgs`, `securityOpt` and
//! `hostRequirements` in [`run_args`].

use std::collections::BTreeMap;

use jsonc_parser::ast::{Object, ObjectProp, Value};
use jsonc_parser::common::Range;
use runcell_core::{Error, ErrorKind, Result, RunSpec};

use crate::context::Context;
use crate::parse::{kind_of, line_column, value_range};

mod mounts;
mod run_args;

/// The lifecycle commands, in the order they run.
const LIFECYCLE: [&str; 5] = [
    "onCreateCommand",
    "updateContentCommand",
    "postCreateCommand",
    "postStartCommand",
    "postAttachCommand",
];

/// Properties mapped to the spec (or checked and accepted at some values).
const MAPPED: &[&str] = &[
    "image",
    "workspaceFolder",
    "workspaceMount",
    "containerEnv",
    "remoteEnv",
    "containerUser",
    "remoteUser",
    "onCreateCommand",
    "updateContentCommand",
    "postCreateCommand",
    "postStartCommand",
    "postAttachCommand",
    "hostRequirements",
    "runArgs",
    "securityOpt",
    "mounts",
    "privileged",
    "capAdd",
    "init",
    "overrideCommand",
    "features",
    "appPort",
];

/// Properties that configure an editor or tool, not the run: accepted and ignored.
const IGNORED: &[&str] = &[
    "name",
    "$schema",
    "customizations",
    "extensions",
    "settings",
    "forwardPorts",
    "portsAttributes",
    "otherPortsAttributes",
    "shutdownAction",
    "updateRemoteUserUID",
    "userEnvProbe",
    "waitFor",
    "secrets",
];

/// Properties a run cannot express, whatever their value, and why.
const UNSUPPORTED: &[(&str, &str)] = &[
    (
        "build",
        "building an image is not part of a run: build it first and name it in `image`",
    ),
    (
        "dockerFile",
        "building an image is not part of a run: build it first and name it in `image`",
    ),
    (
        "context",
        "building an image is not part of a run: build it first and name it in `image`",
    ),
    (
        "dockerComposeFile",
        "Docker Compose configurations are not supported: a run is one container, give its `image`",
    ),
    (
        "service",
        "Docker Compose configurations are not supported: a run is one container, give its `image`",
    ),
    (
        "runServices",
        "Docker Compose configurations are not supported: a run is one container, give its `image`",
    ),
    (
        "overrideFeatureInstallOrder",
        "features are not supported: install what they would into the image",
    ),
    (
        "initializeCommand",
        "it runs on the host, and loading a spec runs nothing on the host: run it yourself before starting",
    ),
];

/// A key of an object property as a path step: `parent["key"]`.
fn key_path(parent: &str, key: &str) -> String {
    format!("{parent}[{key:?}]")
}

/// The last path component of a Unix path (`/` and empty: empty).
fn basename(path: &str) -> String {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The spec field of a value, the devcontainer property it came from and where.
type Origins = BTreeMap<String, (String, Range)>;

/// Maps one parsed file.
pub(crate) struct Mapper<'a> {
    cx: &'a Context,
    text: &'a str,
    local_folder: String,
    local_basename: String,
    /// `${containerWorkspaceFolder}`: known once the workspace is mapped.
    container_folder: Option<String>,
    /// `${containerEnv:...}`: what the file sets on the container, once known.
    container_env: Option<BTreeMap<String, String>>,
    spec: RunSpec,
    /// The property of each `spec.env` entry, in step.
    env_origin: Vec<(String, Range)>,
    /// The property of each `spec.security.cap_drop` entry, in step.
    cap_origin: Vec<(String, Range)>,
    /// The property of each `spec.post_create` entry, in step.
    cmd_origin: Vec<(String, Range)>,
    /// The property of the other fields set.
    origins: Origins,
}

impl<'a> Mapper<'a> {
    pub(crate) fn new(cx: &'a Context, text: &'a str) -> Result<Mapper<'a>> {
        let local_folder = cx
            .workspace_folder
            .to_str()
            .ok_or_else(|| {
                Error::invalid_spec("devcontainer", "the workspace folder's path is not UTF-8")
                    .with("file", cx.file.display())
            })?
            .to_string();
        let mut spec = RunSpec::default();
        spec.security.no_new_privileges = false;
        Ok(Mapper {
            cx,
            text,
            local_basename: basename(&local_folder),
            local_folder,
            container_folder: None,
            container_env: None,
            spec,
            env_origin: Vec::new(),
            cap_origin: Vec::new(),
            cmd_origin: Vec::new(),
            origins: Origins::new(),
        })
    }

    // ---- errors ----

    fn error(
        &self,
        kind: ErrorKind,
        path: &str,
        range: Range,
        message: impl Into<String>,
    ) -> Error {
        let (line, column) = line_column(self.text, range.start);
        let field = if path.is_empty() {
            "devcontainer".to_string()
        } else if path.starts_with('[') {
            format!("devcontainer{path}")
        } else {
            format!("devcontainer.{path}")
        };
        Error::new(kind, message)
            .with_field(field)
            .with("file", self.cx.file.display())
            .with("line", line)
            .with("column", column)
    }

    pub(crate) fn invalid(&self, path: &str, range: Range, message: impl Into<String>) -> Error {
        self.error(ErrorKind::InvalidSpec, path, range, message)
    }

    fn unsupported(&self, path: &str, range: Range, message: impl Into<String>) -> Error {
        self.error(ErrorKind::Unsupported, path, range, message)
    }

    fn wrong_type(&self, path: &str, value: &Value<'_>, expected: &str) -> Error {
        self.invalid(
            path,
            value_range(value),
            format!("must be {expected}, not {}", kind_of(value)),
        )
    }

    // ---- typed access ----

    fn string(&self, path: &str, value: &Value<'_>) -> Result<String> {
        match value {
            Value::StringLit(s) => self.substitute(&s.value, path, s.range),
            other => Err(self.wrong_type(path, other, "a string")),
        }
    }

    fn boolean(&self, path: &str, value: &Value<'_>) -> Result<bool> {
        match value {
            Value::BooleanLit(b) => Ok(b.value),
            other => Err(self.wrong_type(path, other, "true or false")),
        }
    }

    fn object<'v>(&self, path: &str, value: &'v Value<'a>) -> Result<&'v Object<'a>> {
        match value {
            Value::Object(o) => Ok(o),
            other => Err(self.wrong_type(path, other, "an object")),
        }
    }

    fn array<'v>(&self, path: &str, value: &'v Value<'a>) -> Result<&'v [Value<'a>]> {
        match value {
            Value::Array(a) => Ok(&a.elements),
            other => Err(self.wrong_type(path, other, "an array")),
        }
    }

    /// The properties of an object, refusing duplicates (the later would win unseen).
    fn properties<'v>(
        &self,
        path: &str,
        object: &'v Object<'a>,
    ) -> Result<Vec<(String, &'v ObjectProp<'a>)>> {
        let mut seen = std::collections::BTreeSet::new();
        let mut props = Vec::with_capacity(object.properties.len());
        for prop in &object.properties {
            let name = prop.name.clone().into_string();
            if !seen.insert(name.clone()) {
                let p = if path.is_empty() {
                    name.clone()
                } else {
                    key_path(path, &name)
                };
                return Err(self.invalid(&p, prop.range, "is given twice"));
            }
            props.push((name, prop));
        }
        Ok(props)
    }

    // ---- variables ----

    fn substitute(&self, s: &str, path: &str, range: Range) -> Result<String> {
        let mut out = String::with_capacity(s.len());
        let mut rest = s;
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let Some(end) = after.find('}') else {
                out.push_str(&rest[start..]);
                return Ok(out);
            };
            let inner = &after[..end];
            match self.variable(inner, path, range)? {
                Some(value) => out.push_str(&value),
                None => out.push_str(&rest[start..start + 2 + end + 1]),
            }
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }

    /// The value of `${inner}`; `None` leaves it as written.
    fn variable(&self, inner: &str, path: &str, range: Range) -> Result<Option<String>> {
        let (name, args) = match inner.split_once(':') {
            Some((name, args)) => (name, Some(args)),
            None => (inner, None),
        };
        let var_and_default = |args: &str| -> (String, Option<String>) {
            match args.split_once(':') {
                Some((var, default)) => (var.to_string(), Some(default.to_string())),
                None => (args.to_string(), None),
            }
        };
        Ok(match (name, args) {
            ("localWorkspaceFolder", None) => Some(self.local_folder.clone()),
            ("localWorkspaceFolderBasename", None) => Some(self.local_basename.clone()),
            ("containerWorkspaceFolder", None) | ("containerWorkspaceFolderBasename", None) => {
                let Some(folder) = &self.container_folder else {
                    return Err(self.invalid(
                        path,
                        range,
                        format!(
                            "${{{name}}} is the workspace folder in the run, which this property defines"
                        ),
                    ));
                };
                Some(if name == "containerWorkspaceFolder" {
                    folder.clone()
                } else {
                    basename(folder)
                })
            }
            ("localEnv" | "env", Some(args)) => {
                let (var, default) = var_and_default(args);
                Some(self.cx.local_var(&var).or(default).unwrap_or_default())
            }
            ("containerEnv", Some(args)) => {
                let (var, _) = var_and_default(args);
                let Some(env) = &self.container_env else {
                    return Err(self.unsupported(
                        path,
                        range,
                        format!(
                            "${{containerEnv:{var}}}: the container's environment is not known where it is being defined"
                        ),
                    ));
                };
                match env.get(&var) {
                    Some(value) => Some(value.clone()),
                    None => {
                        return Err(self.unsupported(
                            path,
                            range,
                            format!(
                                "${{containerEnv:{var}}} refers to the image's environment, which is not known before the run exists (only containerEnv and runArgs --env of this file are): write the value out"
                            ),
                        ));
                    }
                }
            }
            ("devcontainerId", None) => {
                return Err(self.unsupported(
                    path,
                    range,
                    "${devcontainerId} is not supported: runcell gives each run its own id",
                ));
            }
            _ => None,
        })
    }

    // ---- the mapping ----

    pub(crate) fn map(mut self, root: &Object<'a>) -> Result<RunSpec> {
        let props: BTreeMap<String, &ObjectProp<'a>> = {
            let list = self.properties("", root)?;
            // Unknown and unsupported properties first, in the order written.
            for (name, prop) in &list {
                if let Some((_, why)) = UNSUPPORTED.iter().find(|(n, _)| n == name) {
                    return Err(self.unsupported(name, prop.range, *why));
                }
                if !MAPPED.contains(&name.as_str()) && !IGNORED.contains(&name.as_str()) {
                    let mut message = "is not a devcontainer.json property".to_string();
                    if let Some(close) = closest(name) {
                        message.push_str(&format!("; did you mean `{close}`?"));
                    }
                    return Err(self.invalid(name, prop.range, message));
                }
            }
            list.into_iter().collect()
        };
        let get = |name: &str| props.get(name).map(|p| &p.value);

        self.map_checked(&props)?;
        self.map_workspace(get("workspaceFolder"), get("workspaceMount"))?;
        if let Some(env) = get("containerEnv") {
            self.map_container_env(env)?;
        }
        if let Some(req) = get("hostRequirements") {
            self.map_host_requirements(req)?;
        }
        if let Some(opts) = get("securityOpt") {
            let path = "securityOpt";
            for (i, opt) in self.array(path, opts)?.iter().enumerate() {
                let p = format!("{path}[{i}]");
                let value = self.string(&p, opt)?;
                if !self.security_opt(&value, &p, value_range(opt)) {
                    return Err(self.unsupported(
                        &p,
                        value_range(opt),
                        format!("{value:?}: only no-new-privileges is supported"),
                    ));
                }
            }
        }
        if let Some(args) = get("runArgs") {
            self.map_run_args(args)?;
        }
        self.container_env = Some(self.spec.env.iter().cloned().collect());
        if let Some(env) = get("remoteEnv") {
            self.map_remote_env(env)?;
        }
        for name in ["containerUser", "remoteUser"] {
            if let Some(value) = get(name) {
                let user = self.string(name, value)?;
                self.spec.user = Some(user);
                self.origins
                    .insert("user".into(), (name.into(), value_range(value)));
            }
        }
        if let Some(mounts) = get("mounts") {
            self.map_mounts(mounts)?;
        }
        for name in LIFECYCLE {
            if let Some(value) = get(name) {
                self.map_command(name, value)?;
            }
        }
        match get("image") {
            Some(value) => {
                self.spec.image = self.string("image", value)?;
                self.origins
                    .insert("image".into(), ("image".into(), value_range(value)));
            }
            None => {
                return Err(self.invalid(
                    "image",
                    root.range,
                    "is required: runcell runs an existing image (build, Dockerfile and Docker Compose configurations are not supported)",
                ));
            }
        }
        self.validated()
    }

    /// Properties accepted at some values only.
    fn map_checked(&self, props: &BTreeMap<String, &ObjectProp<'a>>) -> Result<()> {
        if let Some(prop) = props.get("privileged")
            && self.boolean("privileged", &prop.value)?
        {
            return Err(self.unsupported(
                "privileged",
                prop.range,
                "a privileged container is not supported",
            ));
        }
        if let Some(prop) = props.get("capAdd") {
            let caps = self.array("capAdd", &prop.value)?;
            if let Some(first) = caps.first() {
                return Err(self.unsupported(
                    "capAdd[0]",
                    value_range(first),
                    "adding capabilities is not supported",
                ));
            }
        }
        if let Some(prop) = props.get("init") {
            self.boolean("init", &prop.value)?;
        }
        if let Some(prop) = props.get("overrideCommand")
            && !self.boolean("overrideCommand", &prop.value)?
        {
            return Err(self.unsupported(
                "overrideCommand",
                prop.range,
                "false asks for the image's command to run; a run's only process is its keep-alive, and the image's ENTRYPOINT and CMD never run",
            ));
        }
        if let Some(prop) = props.get("features") {
            let features = self.object("features", &prop.value)?;
            if !features.properties.is_empty() {
                let ids: Vec<String> = features
                    .properties
                    .iter()
                    .map(|p| p.name.clone().into_string())
                    .collect();
                return Err(self.unsupported(
                    "features",
                    prop.range,
                    format!(
                        "features are not supported ({}): install what they would into the image",
                        ids.join(", ")
                    ),
                ));
            }
        }
        if let Some(prop) = props.get("appPort") {
            let empty = matches!(&prop.value, Value::Array(a) if a.elements.is_empty());
            if !empty {
                return Err(self.unsupported(
                    "appPort",
                    prop.range,
                    "publishing ports is not supported",
                ));
            }
        }
        Ok(())
    }

    fn set_env(&mut self, name: String, value: String, origin: (String, Range)) {
        self.unset_env(&name);
        self.spec.env.push((name, value));
        self.env_origin.push(origin);
    }

    fn unset_env(&mut self, name: &str) {
        while let Some(i) = self.spec.env.iter().position(|(n, _)| n == name) {
            self.spec.env.remove(i);
            self.env_origin.remove(i);
        }
    }

    fn map_container_env(&mut self, env: &Value<'a>) -> Result<()> {
        let object = self.object("containerEnv", env)?;
        for (name, prop) in self.properties("containerEnv", object)? {
            let path = key_path("containerEnv", &name);
            let value = self.string(&path, &prop.value)?;
            self.set_env(name, value, (path, prop.range));
        }
        Ok(())
    }

    fn map_remote_env(&mut self, env: &Value<'a>) -> Result<()> {
        let object = self.object("remoteEnv", env)?;
        for (name, prop) in self.properties("remoteEnv", object)? {
            let path = key_path("remoteEnv", &name);
            match &prop.value {
                Value::NullKeyword(_) => self.unset_env(&name),
                value => {
                    let value = match value {
                        Value::StringLit(_) => self.string(&path, value)?,
                        other => return Err(self.wrong_type(&path, other, "a string or null")),
                    };
                    self.set_env(name, value, (path, prop.range));
                }
            }
        }
        Ok(())
    }

    fn map_command(&mut self, name: &str, value: &Value<'a>) -> Result<()> {
        match value {
            Value::Object(object) => {
                for (key, prop) in self.properties(name, object)? {
                    let path = key_path(name, &key);
                    match &prop.value {
                        Value::StringLit(_) | Value::Array(_) => {
                            self.push_command(&path, &prop.value)?
                        }
                        other => {
                            return Err(self.wrong_type(
                                &path,
                                other,
                                "a string or an array of strings",
                            ));
                        }
                    }
                }
                Ok(())
            }
            Value::StringLit(_) | Value::Array(_) => self.push_command(name, value),
            other => {
                Err(self.wrong_type(name, other, "a string, an array of strings or an object"))
            }
        }
    }

    fn push_command(&mut self, path: &str, value: &Value<'a>) -> Result<()> {
        let argv = match value {
            Value::StringLit(_) => {
                let script = self.string(path, value)?;
                if script.trim().is_empty() {
                    return Ok(());
                }
                vec!["sh".to_string(), "-c".to_string(), script]
            }
            Value::Array(array) => {
                let mut argv = Vec::with_capacity(array.elements.len());
                for (i, element) in array.elements.iter().enumerate() {
                    argv.push(self.string(&format!("{path}[{i}]"), element)?);
                }
                if argv.is_empty() {
                    return Ok(());
                }
                argv
            }
            _ => unreachable!("checked by the caller"),
        };
        self.spec.post_create.push(argv);
        self.cmd_origin.push((path.to_string(), value_range(value)));
        Ok(())
    }

    /// The spec, validated; a rejected field is reported as the property it came from.
    fn validated(mut self) -> Result<RunSpec> {
        for (i, origin) in self.env_origin.iter().enumerate() {
            self.origins.insert(format!("env[{i}]"), origin.clone());
        }
        if let Some(last) = self.env_origin.last() {
            let top = last
                .0
                .split(['[', '.'])
                .next()
                .unwrap_or_default()
                .to_string();
            self.origins.insert("env".into(), (top, last.1));
        }
        for (i, origin) in self.cap_origin.iter().enumerate() {
            self.origins
                .insert(format!("security.cap_drop[{i}]"), origin.clone());
        }
        for (i, origin) in self.cmd_origin.iter().enumerate() {
            self.origins
                .insert(format!("post_create[{i}]"), origin.clone());
        }
        let Err(e) = self.spec.validate() else {
            return Ok(self.spec);
        };
        let spec_field = e.field().unwrap_or_default().to_string();
        let (path, range) = self
            .origins
            .iter()
            .filter(|(key, _)| {
                spec_field == **key
                    || spec_field
                        .strip_prefix(key.as_str())
                        .is_some_and(|rest| rest.starts_with(['.', '[']))
            })
            .max_by_key(|(key, _)| key.len())
            .map(|(_, origin)| origin.clone())
            .unwrap_or((String::new(), Range::new(0, 0)));
        let mut mapped = self.error(e.kind(), &path, range, e.message());
        if !spec_field.is_empty() {
            mapped = mapped.with("spec field", spec_field);
        }
        Err(mapped)
    }
}

/// The known property closest to a misspelt one.
fn closest(name: &str) -> Option<&'static str> {
    let known = MAPPED
        .iter()
        .chain(IGNORED)
        .copied()
        .chain(UNSUPPORTED.iter().map(|(n, _)| *n));
    known
        .map(|k| (edit_distance(&name.to_lowercase(), &k.to_lowercase()), k))
        .filter(|(d, k)| *d <= 3.max(k.len() / 4))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(cur).min(row[j])
            };
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use runcell_core::{ErrorKind, Network, RunSpec};

    use crate::Context;
    use crate::tests::{error_of, spec_of, testdata};

    #[test]
    fn each_refusal_names_its_property() {
        // KIND FIELD | TEXT: I for InvalidSpec, U for Unsupported; FIELD after
        // `devcontainer.`; TEXT inside `{"image": "x", ...}` unless it is an object itself.
        let cases = r#"
            I image                    | {"name": "x"}
            I image                    | {"image": 3}
            I image                    | {"image": "x", "image": "y"}
            I image                    | {"image": "Not/An/Image"}
            U dockerComposeFile        | "dockerComposeFile": "c.yml", "service": "app"
            U dockerFile               | "dockerFile": "Dockerfile"
            U initializeCommand        | "initializeCommand": "echo host"
            U privileged               | "privileged": true
            I privileged               | "privileged": "yes"
            U capAdd[0]                | "capAdd": ["SYS_PTRACE"]
            U securityOpt[0]           | "securityOpt": ["seccomp=unconfined"]
            U overrideCommand          | "overrideCommand": false
            U appPort                  | "appPort": [3000]
            U features                 | "features": {"ghcr.io/devcontainers/features/git:1": {}}
            I features                 | "features": []
            I remoteenv                | "remoteenv": {}
            U hostRequirements.gpu     | "hostRequirements": {"gpu": true}
            I hostRequirements.memory  | "hostRequirements": {"memory": "lots"}
            I hostRequirements.cpu     | "hostRequirements": {"cpu": 2}
            I hostRequirements.cpus    | "hostRequirements": {"cpus": 0}
            I runArgs                  | "runArgs": "--init"
            U runArgs[2]               | "runArgs": ["--env", "A=1", "--privileged"]
            U runArgs[0]               | "runArgs": ["--cap-add=SYS_PTRACE"]
            U runArgs[0]               | "runArgs": ["--network=host"]
            U runArgs[1]               | "runArgs": ["--security-opt", "seccomp=unconfined"]
            U runArgs[0]               | "runArgs": ["-v", "/a:/b"]
            U runArgs[0]               | "runArgs": ["image-name"]
            I runArgs[0]               | "runArgs": ["--memory"]
            I runArgs[1]               | "runArgs": ["--memory", "lots"]
            I runArgs[0]               | "runArgs": ["--cpus=0"]
            I runArgs[3]               | "runArgs": ["-e", "A=1", "--label", "bad key=v"]
            I runArgs[1]               | "runArgs": ["--cap-drop", "net raw"]
            U mounts[0]                | "mounts": ["source=m,target=/workspaces/python-app/m,type=volume"]
            U mounts[0]                | "mounts": ["source=/etc,target=/host-etc,type=bind"]
            U mounts[0]                | "mounts": [{"source": "${localWorkspaceFolder}", "target": "/x", "type": "bind"}]
            U mounts[0]                | "mounts": ["src=${localWorkspaceFolder},dst=${containerWorkspaceFolder},type=bind,ro"]
            U workspaceMount           | "workspaceMount": "source=ws,target=/ws,type=volume"
            I workspaceMount           | "workspaceMount": "type=bind,source=/x"
            I workspaceFolder          | "workspaceFolder": "src"
            I workspaceFolder          | "workspaceFolder": "/tmp/ws"
            I workspaceFolder          | "workspaceFolder": "${containerWorkspaceFolder}/x"
            I containerEnv["A=B"]      | "containerEnv": {"A=B": "1"}
            I containerEnv["A"]        | "containerEnv": {"A": 1}
            I containerEnv["A"]        | "containerEnv": {"A": null}
            U containerEnv["A"]        | "containerEnv": {"A": "${containerEnv:B}"}
            U containerEnv["ID"]       | "containerEnv": {"ID": "${devcontainerId}"}
            U remoteEnv["PATH"]        | "remoteEnv": {"PATH": "${containerEnv:PATH}:/opt/bin"}
            U postCreateCommand        | "postCreateCommand": "echo ${containerEnv:HOME}"
            I remoteUser               | "remoteUser": "a b"
            I containerUser            | "containerUser": "-root"
            I postCreateCommand        | "postCreateCommand": 42
            I postCreateCommand        | "postCreateCommand": ["", "x"]
            I postCreateCommand[1]     | "postCreateCommand": ["echo", 1]
            I postStartCommand["b"]    | "postStartCommand": {"a": "true", "b": ["echo", "a\u0000b"]}
            I onCreateCommand["a"]     | "onCreateCommand": {"a": null}
        "#;
        for line in cases.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let (head, body) = line.split_once(" | ").unwrap();
            let (kind, field) = head.trim().split_once(' ').unwrap();
            let kind = if kind == "I" {
                ErrorKind::InvalidSpec
            } else {
                ErrorKind::Unsupported
            };
            let text = if body.starts_with('{') {
                body.to_string()
            } else {
                format!(r#"{{"image": "x", {body}}}"#)
            };
            let e = error_of(&text);
            let field = format!("devcontainer.{field}");
            assert_eq!(
                (e.kind(), e.field()),
                (kind, Some(field.as_str())),
                "{text}: {e}"
            );
            assert!(
                e.context_value("file")
                    .unwrap()
                    .ends_with("devcontainer.json"),
                "{e}"
            );
            assert!(e.context_value("line").is_some(), "{text}: {e}");
        }
        let e = error_of(r#"{"image": "x", "remoteenv": {}}"#);
        assert!(e.message().contains("did you mean `remoteEnv`"), "{e}");
        let e = error_of(r#"{"image": "x", "workspaceFolder": "/tmp/ws"}"#);
        assert_eq!(e.context_value("spec field"), Some("workspace.path"), "{e}");
    }

    #[test]
    fn errors_never_echo_environment_values() {
        for text in [
            r#"{"image": "x", "containerEnv": {"T": "${localEnv:SECRET_TOKEN}\u0000"}}"#,
            r#"{"image": "x", "remoteEnv": {"T": "${localEnv:SECRET_TOKEN}\u0000"}}"#,
        ] {
            let e = error_of(text);
            assert!(!format!("{e} {e:?}").contains("s3cr3t"), "{e:?}");
        }
        let cx =
            Context::new("/x/.devcontainer/devcontainer.json", "/x").local_env([("T", "s3cr3t")]);
        assert!(!format!("{cx:?}").contains("s3cr3t"), "{cx:?}");
    }

    #[test]
    fn variables_resolve_or_stay_for_the_shell() {
        let spec = spec_of(
            r#"{
                "image": "busybox:${localEnv:TAG:1.36}",
                "containerEnv": {
                    "TOKEN": "${localEnv:SECRET_TOKEN}",
                    "OLD_FORM": "${env:SECRET_TOKEN}",
                    "UNSET": "[${localEnv:NOT_SET_ANYWHERE}]",
                    "URL": "${localEnv:NOT_SET:http://mirror:8080/x}",
                    "NAMES": "${localWorkspaceFolderBasename} ${containerWorkspaceFolderBasename}",
                    "UNTERMINATED": "${localEnv:SECRET_TOKEN",
                },
                "remoteEnv": { "FROM_CONTAINER": "${containerEnv:TOKEN}-x" },
                "postCreateCommand": "echo ${HOME} $${PATH} ${localWorkspaceFolderBasename}",
            }"#,
        );
        assert_eq!(spec.image, "busybox:1.36");
        let env: BTreeMap<_, _> = spec.env.iter().cloned().collect();
        assert_eq!(env["TOKEN"], "s3cr3t");
        assert_eq!(env["OLD_FORM"], "s3cr3t");
        assert_eq!(env["UNSET"], "[]");
        assert_eq!(env["URL"], "http://mirror:8080/x");
        assert_eq!(env["NAMES"], "python-app python-app");
        assert_eq!(env["UNTERMINATED"], "${localEnv:SECRET_TOKEN");
        assert_eq!(env["FROM_CONTAINER"], "s3cr3t-x");
        assert_eq!(
            spec.post_create,
            [["sh", "-c", "echo ${HOME} $${PATH} python-app"]]
        );
    }

    #[test]
    fn env_layers_and_null_unsets() {
        let spec = spec_of(
            r#"{
                "image": "x",
                "containerEnv": { "A": "container", "B": "container", "C": "container" },
                "runArgs": ["-e", "B=run-arg", "--env", "SECRET_TOKEN", "-e", "NOT_SET_ANYWHERE"],
                "remoteEnv": { "C": "remote", "A": null, "D": "remote" },
            }"#,
        );
        assert_eq!(
            spec.env,
            [
                ("B".to_string(), "run-arg".to_string()),
                ("SECRET_TOKEN".into(), "s3cr3t".into()),
                ("C".into(), "remote".into()),
                ("D".into(), "remote".into()),
            ]
        );
    }

    #[test]
    fn users_resources_and_flags_take_their_precedence() {
        let spec = spec_of(
            r#"{
                "image": "x",
                "containerUser": "1000",
                "runArgs": ["-u", "2000", "--cpus=1.5", "-m512m", "--pids-limit=-1", "--net=none",
                            "--read-only=false", "-w=/workspaces/python-app/src", "--security-opt=no-new-privileges:true",
                            "-lowner=me", "--label", "bare"],
                "hostRequirements": { "cpus": 8, "memory": "16gb", "gpu": "optional", "storage": "64GB" },
            }"#,
        );
        assert_eq!(spec.user.as_deref(), Some("1000"));
        assert_eq!(spec.resources.cpus, Some(1.5));
        assert_eq!(spec.resources.memory_bytes, Some(512 << 20));
        assert_eq!(spec.resources.pids, None);
        assert_eq!(spec.network, Network::None);
        assert!(!spec.security.read_only_rootfs);
        assert!(spec.security.no_new_privileges);
        assert_eq!(
            spec.working_dir.as_deref(),
            Some("/workspaces/python-app/src")
        );
        assert_eq!(spec.labels["owner"], "me");
        assert_eq!(spec.labels["bare"], "");
        let spec = spec_of(r#"{"image": "x", "containerUser": "1000", "remoteUser": "vscode"}"#);
        assert_eq!(spec.user.as_deref(), Some("vscode"));
        // The devcontainer defaults: no no-new-privileges (sudo works), nothing else added.
        let spec = spec_of(r#"{"image": "x"}"#);
        assert!(!spec.security.no_new_privileges);
        assert_eq!(spec.workspace.path, "/workspaces/python-app");
        assert_eq!(spec.workspace.host_dir, Some(testdata("python-app")));
        assert!(spec.post_create.is_empty() && spec.env.is_empty() && spec.labels.is_empty());
        // Values accepted and mapped to nothing.
        let spec = spec_of(
            r#"{"image": "x", "privileged": false, "capAdd": [], "features": {}, "appPort": [],
                "init": false, "overrideCommand": true, "hostRequirements": {"gpu": false},
                "postCreateCommand": "", "postStartCommand": [], "postAttachCommand": {},
                "securityOpt": ["no-new-privileges=false"]}"#,
        );
        assert_eq!(spec, {
            let mut s = RunSpec::new("x").workspace_dir(testdata("python-app"));
            s.workspace.path = "/workspaces/python-app".into();
            s.security.no_new_privileges = false;
            s
        });
    }

    #[test]
    fn lifecycle_commands_run_in_lifecycle_order() {
        let spec = spec_of(
            r#"{
                "image": "x",
                "postAttachCommand": "attach",
                "postStartCommand": ["start", "${containerWorkspaceFolder}"],
                "postCreateCommand": { "z": "create z", "a": ["create", "a"] },
                "updateContentCommand": "update",
                "onCreateCommand": "on create",
            }"#,
        );
        let sh = |s: &str| vec!["sh".to_string(), "-c".into(), s.into()];
        assert_eq!(
            spec.post_create,
            [
                sh("on create"),
                sh("update"),
                sh("create z"),
                vec!["create".to_string(), "a".into()],
                vec!["start".to_string(), "/workspaces/python-app".into()],
                sh("attach"),
            ]
        );
    }
}
