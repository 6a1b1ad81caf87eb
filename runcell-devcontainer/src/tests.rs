//! Loading configurations from files (`testdata/`, snapshots of the specs) and the helpers
//! the modules' tests share.

use std::path::{Path, PathBuf};

use runcell_core::{Error, ErrorKind, Result, RunSpec};

use crate::{Context, FromDevcontainer as _, parse};

pub(crate) fn testdata(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/devcontainer")
        .join(case)
}

/// `case`'s `.devcontainer/devcontainer.json` (or `file` in it), with a fixed local env.
fn load_case(case: &str, file: &str) -> Result<RunSpec> {
    let path = testdata(case).join(file);
    let cx = Context::for_file(&path)?.local_env([("HOME", "/home/dev")]);
    parse(&std::fs::read_to_string(&path).unwrap(), &cx)
}

/// The host folder as `<testdata>/...`, the same on every machine.
macro_rules! assert_spec_snapshot {
        ($name:literal, $spec:expr) => {
            insta::assert_yaml_snapshot!($name, $spec, {
                ".workspace.host_dir" => insta::dynamic_redaction(|value, _| {
                    let root = std::fs::canonicalize(testdata("")).unwrap();
                    let path = PathBuf::from(value.as_str().unwrap());
                    format!("<testdata>/{}", path.strip_prefix(&root).unwrap().display())
                }),
            })
        };
    }

/// An error of `text` in a folder that exists.
pub(crate) fn error_of(text: &str) -> Error {
    let folder = testdata("python-app");
    let cx = Context::new(folder.join(".devcontainer/devcontainer.json"), &folder)
        .local_env([("SECRET_TOKEN", "s3cr3t")]);
    parse(text, &cx).expect_err(text)
}

pub(crate) fn spec_of(text: &str) -> RunSpec {
    let folder = testdata("python-app");
    let cx = Context::new(folder.join(".devcontainer/devcontainer.json"), &folder)
        .local_env([("SECRET_TOKEN", "s3cr3t")]);
    parse(text, &cx).unwrap_or_else(|e| panic!("{text}: {e}"))
}

#[test]
fn python_with_a_post_create_string_and_remote_user() {
    // Through the public entry point, from the project folder.
    let spec = RunSpec::from_devcontainer(testdata("python-app")).unwrap();
    assert_eq!(
        spec,
        load_case("python-app", ".devcontainer/devcontainer.json").unwrap()
    );
    assert_eq!(
        spec,
        RunSpec::from_devcontainer(testdata("python-app/.devcontainer/devcontainer.json")).unwrap()
    );
    assert_spec_snapshot!("python_app", spec);
}

#[test]
fn node_with_comments_trailing_commas_named_commands_and_local_env() {
    let spec = load_case("node-app", ".devcontainer/devcontainer.json").unwrap();
    assert_spec_snapshot!("node_app", spec);
}

#[test]
fn run_args_host_requirements_and_workspace_folder() {
    let spec = load_case("rust-workspace", ".devcontainer/devcontainer.json").unwrap();
    assert_spec_snapshot!("rust_workspace", spec);
}

#[test]
fn a_subfolder_configuration_mounting_its_repository() {
    let spec = load_case(
        "monorepo/services/api",
        ".devcontainer/api/devcontainer.json",
    )
    .unwrap();
    assert_eq!(
        spec.workspace.host_dir,
        Some(std::fs::canonicalize(testdata("monorepo")).unwrap())
    );
    assert_spec_snapshot!("monorepo_api", spec);
}

#[test]
fn build_and_features_are_unsupported_naming_the_property() {
    for (case, field, line) in [
        ("build-config", "devcontainer.build", "3"),
        ("features-config", "devcontainer.features", "3"),
    ] {
        let e = RunSpec::from_devcontainer(testdata(case)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert_eq!(e.field(), Some(field), "{e}");
        assert_eq!(e.context_value("line"), Some(line), "{e}");
        let file = e.context_value("file").unwrap();
        assert!(
            file.ends_with(&format!("{case}/.devcontainer/devcontainer.json")),
            "{e}"
        );
    }
    let e = RunSpec::from_devcontainer(testdata("features-config")).unwrap_err();
    assert!(
        e.message()
            .contains("ghcr.io/devcontainers/features/node:1"),
        "{e}"
    );
}

#[test]
fn an_unknown_property_is_an_error_with_the_closest_name() {
    let e = RunSpec::from_devcontainer(testdata("typo-config")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidSpec, "{e}");
    assert_eq!(e.field(), Some("devcontainer.postCreateComand"));
    assert!(
        e.message().contains("did you mean `postCreateCommand`"),
        "{e}"
    );
    assert_eq!(e.context_value("line"), Some("4"));
    assert_eq!(e.context_value("column"), Some("2"));
}

#[test]
fn files_are_found_where_the_reference_puts_them() {
    let root = std::env::temp_dir().join(format!("runcell-devcontainer-{}", std::process::id()));
    let project = root.join("my-project");
    std::fs::create_dir_all(project.join(".devcontainer/gpu")).unwrap();
    let result = std::panic::catch_unwind(|| {
        let e = RunSpec::from_devcontainer(&project).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        let e = RunSpec::from_devcontainer(project.join("nope.json")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");

        std::fs::write(
            project.join(".devcontainer.json"),
            r#"{"image": "root-file"}"#,
        )
        .unwrap();
        let spec = RunSpec::from_devcontainer(&project).unwrap();
        assert_eq!(spec.image, "root-file");
        assert_eq!(spec.workspace.path, "/workspaces/my-project");
        let folder = std::fs::canonicalize(&project).unwrap();
        assert_eq!(spec.workspace.host_dir.as_deref(), Some(folder.as_path()));

        // .devcontainer/devcontainer.json comes first.
        std::fs::write(
            project.join(".devcontainer/devcontainer.json"),
            r#"{"image": "in-folder"}"#,
        )
        .unwrap();
        assert_eq!(
            RunSpec::from_devcontainer(&project).unwrap().image,
            "in-folder"
        );

        let gpu = project.join(".devcontainer/gpu/devcontainer.json");
        std::fs::write(&gpu, r#"{"image": "sub"}"#).unwrap();
        let spec = RunSpec::from_devcontainer(&gpu).unwrap();
        assert_eq!(spec.image, "sub");
        assert_eq!(spec.workspace.host_dir.as_deref(), Some(folder.as_path()));

        // Anywhere else the folder cannot be told.
        let loose = root.join("loose.json");
        std::fs::write(&loose, r#"{"image": "x"}"#).unwrap();
        let e = RunSpec::from_devcontainer(&loose).unwrap_err();
        assert_eq!(
            (e.kind(), e.field()),
            (ErrorKind::InvalidSpec, Some("devcontainer")),
            "{e}"
        );
    });
    std::fs::remove_dir_all(&root).unwrap();
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}
