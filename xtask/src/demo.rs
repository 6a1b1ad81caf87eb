//! `cargo xtask demo`: the main job, through the `sandbox` command line. Starts a run,
//! execs into it several times (workspace, environment and files persist; a shell's
//! own state does not), pipes stdin, shows exit codes and a timeout, copies a file out,
//! stops the run, runs a one-shot `sandbox run`, and checks that nothing is left.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::images::BUSYBOX;

/// The label every run of the demo carries.
const DEMO_LABEL: &str = "sandbox.example/demo";

/// The `sandbox` binary of this workspace (built by the caller).
fn binary() -> PathBuf {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the repo")
        .to_path_buf();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|t| if t.is_absolute() { t } else { repo.join(t) })
        .unwrap_or_else(|| repo.join("target"));
    target.join("debug/sandbox")
}

/// Quotes an argument for the printed command line, as a POSIX shell would read it.
fn quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@,+%".contains(c));
    if plain {
        arg.to_string()
    } else if arg.contains('\'') && !arg.contains(['"', '$', '`', '\\', '!']) {
        format!("\"{arg}\"")
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

struct Demo {
    sandbox: PathBuf,
    label: String,
}

struct Step {
    code: i32,
    /// Stdout and stderr as they came, interleaved as on a terminal.
    output: String,
}

impl Demo {
    /// Runs `sandbox ARGS` (with `input` on stdin when given), printing it as a transcript:
    /// the command with its time and exit code, then its output as a terminal shows it.
    fn step(&self, args: &[&str], input: Option<&str>) -> Result<Step> {
        let shown: Vec<String> = args.iter().map(|a| quote(a)).collect();
        let mut line = format!("$ sandbox {}", shown.join(" "));
        if let Some(input) = input {
            line = format!("$ echo {} | {}", quote(input.trim_end()), &line[2..]);
        }
        let started = Instant::now();
        let (mut reader, writer) = std::io::pipe()?;
        let mut child = Command::new(&self.sandbox)
            .args(args)
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(writer.try_clone()?)
            .stderr(writer)
            .spawn()
            .with_context(|| format!("running {}", self.sandbox.display()))?;
        if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
            std::io::Write::write_all(&mut stdin, input.as_bytes())?;
        }
        let mut output = String::new();
        std::io::Read::read_to_string(&mut reader, &mut output)?;
        let status = child.wait()?;
        let elapsed = started.elapsed();
        let code = status.code().unwrap_or(-1);
        let note = if code == 0 {
            format!("{:.2} s", elapsed.as_secs_f64())
        } else {
            format!("exit {code}, {:.2} s", elapsed.as_secs_f64())
        };
        println!("{line:<78} # {note}");
        print!("{output}");
        Ok(Step { code, output })
    }

    fn expect(&self, args: &[&str], input: Option<&str>, code: i32) -> Result<Step> {
        let step = self.step(args, input)?;
        if step.code != code {
            bail!(
                "sandbox {} exited {}, not {code}",
                args.join(" "),
                step.code
            );
        }
        Ok(step)
    }
}

pub fn run() -> Result<()> {
    let demo = Demo {
        sandbox: binary(),
        label: format!("{DEMO_LABEL}=demo-{}", std::process::id()),
    };
    let workspace = tempfile_dir("sandbox-demo-ws")?;
    let copies = tempfile_dir("sandbox-demo-out")?;
    let result = transcript(&demo, &workspace, &copies);
    // Whatever happened: stop what the demo left, then say whether it had to.
    let left = leftovers(&demo)?;
    for id in &left {
        let _ = Command::new(&demo.sandbox).args(["stop", id]).output();
    }
    let _ = std::fs::remove_dir_all(&workspace);
    let _ = std::fs::remove_dir_all(&copies);
    result?;
    if !left.is_empty() {
        bail!("the demo left runs behind: {}", left.join(" "));
    }
    Ok(())
}

fn transcript(demo: &Demo, workspace: &Path, copies: &Path) -> Result<()> {
    let ws = workspace.to_str().context("a UTF-8 temporary path")?;
    let label = demo.label.as_str();
    let start = demo.expect(
        &[
            "start",
            "--image",
            BUSYBOX,
            "--workspace",
            ws,
            "--env",
            "GREETING=hello from the run env",
            "--network",
            "none",
            "--post-create",
            "sh -c 'echo prepared-by-post-create > setup.txt'",
            "--label",
            label,
            "--ttl",
            "10m",
        ],
        None,
        0,
    )?;
    let id = start
        .output
        .lines()
        .find(|l| l.starts_with("sbx-"))
        .context("start printed no run id")?
        .to_string();
    let exec = |argv: &[&str], extra: &[&str], input: Option<&str>, code: i32| {
        let mut args = vec!["exec", id.as_str()];
        args.extend(extra);
        args.push("--");
        args.extend(argv);
        demo.expect(&args, input, code)
    };
    exec(&["pwd"], &[], None, 0)?;
    exec(&["sh", "-c", "echo $GREETING"], &[], None, 0)?;
    exec(
        &[
            "sh",
            "-c",
            "echo 'written by exec 3' > notes.txt; export LOCAL=gone",
        ],
        &[],
        None,
        0,
    )?;
    let persisted = exec(
        &[
            "sh",
            "-c",
            "cat setup.txt notes.txt; echo LOCAL=${LOCAL:-unset}",
        ],
        &[],
        None,
        0,
    )?;
    if persisted.output != "prepared-by-post-create\nwritten by exec 3\nLOCAL=unset\n" {
        bail!("state did not persist as it should: {:?}", persisted.output);
    }
    exec(&["tr", "a-z", "A-Z"], &[], Some("piped through stdin\n"), 0)?;
    exec(&["sh", "-c", "echo to stderr >&2; exit 7"], &[], None, 7)?;
    exec(&["sleep", "60"], &["--timeout", "1s"], None, 124)?;
    let copy = copies.join("notes-copy.txt");
    let copy_str = copy.to_str().context("a UTF-8 temporary path")?;
    demo.expect(
        &["cp", &format!("{id}:/workspace/notes.txt"), copy_str],
        None,
        0,
    )?;
    println!(
        "# the host side of the workspace, notes.txt: {:?}; the copy: {:?}",
        std::fs::read_to_string(workspace.join("notes.txt"))?,
        std::fs::read_to_string(&copy)?
    );
    demo.expect(&["ls", "--label", label], None, 0)?;
    demo.expect(&["stop", &id], None, 0)?;
    demo.expect(
        &[
            "run",
            "--image",
            BUSYBOX,
            "--label",
            label,
            "--quiet",
            "--",
            "sh",
            "-c",
            "echo one-shot in $(hostname); exit 3",
        ],
        None,
        3,
    )?;
    demo.expect(&["ls", "--all", "--label", label], None, 0)?;
    let left = leftovers(demo)?;
    println!("# runs left with the demo's label: {}", left.len());
    Ok(())
}

/// The runs carrying the demo's label, in any state.
fn leftovers(demo: &Demo) -> Result<Vec<String>> {
    let out = Command::new(&demo.sandbox)
        .args(["ls", "--all", "--json", "--label", &demo.label])
        .output()?;
    if !out.status.success() {
        bail!(
            "sandbox ls: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // `"id": "sbx-..."` lines of the JSON array (xtask has no JSON parser).
    Ok(text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("\"id\": \""))
        .map(|rest| rest.trim_end_matches(['"', ',']).to_string())
        .collect())
}

fn tempfile_dir(prefix: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
