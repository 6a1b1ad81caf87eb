//! The `sandbox` binary against the Docker engine. Every run a test makes carries a label
//! unique to the test, and each test ends by checking that none is left.
//!
//! Without an engine these tests say so loudly and pass, unless `CI` is set or
//! `RUNCELL_REQUIRE` names `docker`: then they fail. They need the test image
//! (`cargo xtask test-images`, or `RUNCELL_CONFORMANCE_IMAGE`).

mod common;
#[path = "../../runcell-docker/tests/common/registry.rs"]
mod registry;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{Sandbox, code, eventually, run, run_with_stdin, signal, text};

fn sandbox(case: &str) -> Option<Sandbox> {
    Sandbox::new("docker", case)
}

#[test]
fn start_exec_stop_keeps_state_between_execs() {
    let Some(sb) = sandbox("start-exec-stop") else {
        return;
    };
    let ws = tempfile::tempdir().unwrap();
    let ws_path = ws.path().to_str().unwrap();
    let id = sb.start(&[
        "--workspace",
        ws_path,
        "--env",
        "GREETING=hello from the run env",
        "--post-create",
        "sh -c 'echo prepared-by-post-create > setup.txt'",
    ]);
    let exec = |argv: &[&str]| run(sb.exec_cmd(&id, &[], argv));

    let out = exec(&["pwd"]);
    assert_eq!((code(&out), text(&out.stdout)), (0, "/workspace\n".into()));
    let out = exec(&["sh", "-c", "echo $GREETING"]);
    assert_eq!(text(&out.stdout), "hello from the run env\n");
    let out = exec(&["sh", "-c", "echo written > notes.txt; export LOCAL=gone"]);
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    let out = exec(&[
        "sh",
        "-c",
        "cat setup.txt notes.txt; echo LOCAL=${LOCAL:-unset}",
    ]);
    assert_eq!(
        text(&out.stdout),
        "prepared-by-post-create\nwritten\nLOCAL=unset\n"
    );
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.txt")).unwrap(),
        "written\n"
    );
    // Per-exec env, working directory and user.
    let out = run(sb.exec_cmd(
        &id,
        &[
            "--env",
            "GREETING=override",
            "--workdir",
            "/tmp",
            "--user",
            "65534",
        ],
        &["sh", "-c", "echo $GREETING $(pwd) $(id -u)"],
    ));
    assert_eq!(
        text(&out.stdout),
        "override /tmp 65534\n",
        "{}",
        text(&out.stderr)
    );

    // ls: the table and JSON show it, detached, with its TTL.
    let out = run(sb.cmd(&["ls", "--label", &sb.selector()]));
    let table = text(&out.stdout);
    assert!(table.starts_with("RUN "), "{table}");
    assert!(
        table.contains(&id) && table.contains("running") && table.contains("detached"),
        "{table}"
    );
    assert!(
        table.contains("in 23h") || table.contains("in 1d"),
        "{table}"
    );
    let out = run(sb.cmd(&["ls", "--json", "--label", &sb.selector()]));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 1, "{rows}");
    assert_eq!(rows[0]["id"], id.as_str());
    assert_eq!(rows[0]["running"], true);
    assert!(rows[0]["owner"].is_null(), "{rows}");
    assert!(rows[0]["expires_at"].as_u64().is_some(), "{rows}");
    assert_eq!(
        rows[0]["labels"][common::TEST_LABEL],
        sb.label_value.as_str()
    );

    let out = run(sb.cmd(&["stop", &id]));
    assert_eq!((code(&out), text(&out.stdout)), (0, format!("{id}\n")));
    // Stopping again is fine; exec into it is not.
    let out = run(sb.cmd(&["stop", &id]));
    assert_eq!(code(&out), 0);
    assert!(
        text(&out.stderr).contains("no such run"),
        "{}",
        text(&out.stderr)
    );
    let out = exec(&["true"]);
    assert_eq!(code(&out), 125);
    assert!(
        text(&out.stderr).contains("sandbox: error: not found"),
        "{}",
        text(&out.stderr)
    );
    sb.assert_nothing_left();
}

#[test]
fn exit_codes_pass_through() {
    let Some(sb) = sandbox("exit-codes") else {
        return;
    };
    let id = sb.start(&[]);
    let exec = |args: &[&str], argv: &[&str]| run(sb.exec_cmd(&id, args, argv));

    let out = exec(&[], &["sh", "-c", "echo out; echo err >&2; exit 7"]);
    assert_eq!(code(&out), 7);
    assert_eq!(text(&out.stdout), "out\n");
    assert_eq!(text(&out.stderr), "err\n");
    assert_eq!(code(&exec(&[], &["sh", "-c", "kill -9 $$"])), 137);
    assert_eq!(code(&exec(&[], &["sh", "-c", "kill -TERM $$"])), 143);
    assert_eq!(code(&exec(&[], &["no-such-program"])), 127);

    let started = Instant::now();
    let out = exec(&["--timeout", "1s"], &["sleep", "30"]);
    assert_eq!(code(&out), 124, "{}", text(&out.stderr));
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    assert!(
        text(&out.stderr).contains("timed out"),
        "{}",
        text(&out.stderr)
    );
    // The run is still usable after a timeout.
    assert_eq!(code(&exec(&[], &["true"])), 0);

    let out = exec(&["--workdir", "/no/such/dir"], &["true"]);
    assert_eq!(code(&out), 123, "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("did not start (working_dir)"),
        "{}",
        text(&out.stderr)
    );

    // The target stopped behind the library's back: the run is lost.
    let killed = std::process::Command::new("docker")
        .args(["kill", &id])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(killed.success());
    let out = exec(&[], &["true"]);
    assert_eq!(code(&out), 121, "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("run lost"),
        "{}",
        text(&out.stderr)
    );
    // gc removes what is left of it.
    let out = run(sb.cmd(&["gc", "--label", &sb.selector()]));
    assert_eq!(
        text(&out.stdout),
        format!("removed {id} (no longer running)\n")
    );
    sb.assert_nothing_left();
}

#[test]
fn run_starts_execs_and_stops() {
    let Some(sb) = sandbox("run") else { return };
    let out = run(sb.run_cmd(
        &["--env", "X=42"],
        &["sh", "-c", "echo x=$X; echo e >&2; exit 3"],
    ));
    assert_eq!(code(&out), 3, "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "x=42\n");
    // Progress goes to stderr, plain lines when it is not a terminal.
    let stderr = text(&out.stderr);
    assert!(stderr.contains("creating the container"), "{stderr}");
    assert!(stderr.ends_with("e\n"), "{stderr}");
    let out = run(sb.run_cmd(&["--quiet"], &["sh", "-c", "kill -9 $$"]));
    assert_eq!(code(&out), 137);
    assert_eq!(text(&out.stderr), "");
    let out = run(sb.run_cmd(&["--timeout", "1"], &["sleep", "30"]));
    assert_eq!(code(&out), 124);
    sb.assert_nothing_left();
}

#[test]
fn stdin_is_streamed_when_not_a_terminal() {
    let Some(sb) = sandbox("stdin") else { return };
    let id = sb.start(&[]);
    let out = run_with_stdin(sb.exec_cmd(&id, &[], &["cat"]), b"hello\nworld\n");
    assert_eq!(text(&out.stdout), "hello\nworld\n");
    // 8 MiB in, counted inside: streamed, not a buffer of fixed size.
    let big: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
    let out = run_with_stdin(sb.exec_cmd(&id, &[], &["wc", "-c"]), &big);
    assert_eq!(text(&out.stdout).trim(), (8u32 << 20).to_string());
    // A conversation: the command answers before stdin ends.
    let mut child = sb
        .exec_cmd(
            &id,
            &[],
            &["sh", "-c", "read a; echo got $a; read b; echo got $b"],
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    use std::io::{BufRead, Write};
    stdin.write_all(b"one\n").unwrap();
    stdin.flush().unwrap();
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "got one\n");
    stdin.write_all(b"two\n").unwrap();
    drop(stdin);
    line.clear();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "got two\n");
    assert!(child.wait().unwrap().success());
    // --no-stdin: the command reads EOF at once.
    let out = run_with_stdin(sb.exec_cmd(&id, &["--no-stdin"], &["wc", "-c"]), b"ignored");
    assert_eq!(text(&out.stdout).trim(), "0");
    run(sb.cmd(&["stop", &id]));
    sb.assert_nothing_left();
}

#[test]
fn gc_removes_the_run_of_a_killed_owner() {
    let Some(sb) = sandbox("gc-owner-killed") else {
        return;
    };
    let mut owner = sb
        .run_cmd(&["--quiet"], &["sleep", "1000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(60), || sb.runs().len() == 1),
        "the run never showed"
    );
    let id = sb.runs().remove(0);
    // While the owner lives, gc keeps the run.
    let out = run(sb.cmd(&["gc", "--dry-run", "--label", &sb.selector()]));
    assert_eq!(text(&out.stdout), "");
    signal(owner.id(), "KILL");
    owner.wait().unwrap();
    let out = run(sb.cmd(&["ls", "--label", &sb.selector()]));
    assert!(
        text(&out.stdout).contains("(gone)"),
        "{}",
        text(&out.stdout)
    );
    let out = run(sb.cmd(&["gc", "--dry-run", "--label", &sb.selector()]));
    assert_eq!(
        text(&out.stdout),
        format!("would remove {id} (its owner process is gone)\n")
    );
    assert_eq!(sb.runs(), vec![id.clone()], "a dry run removes nothing");
    let out = run(sb.cmd(&["gc", "--label", &sb.selector()]));
    assert_eq!(
        text(&out.stdout),
        format!("removed {id} (its owner process is gone)\n")
    );
    sb.assert_nothing_left();
}

#[test]
fn sigint_during_run_leaves_nothing() {
    let Some(sb) = sandbox("sigint") else { return };
    for phase in ["exec", "create", "start"] {
        let mut command = if phase == "start" {
            let image = common::image();
            let mut args = vec!["start", "--image", image.as_str()];
            let labels = sb.labels();
            args.extend(labels.iter().map(String::as_str));
            sb.cmd(&args)
        } else {
            sb.run_cmd(&[], &["sleep", "1000"])
        };
        let mut child = command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        // Progress lines tell where the create is; the rest is drained until the end.
        let drain = std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let _ = tx.send(line);
            }
        });
        match phase {
            // Once the command runs.
            "exec" => assert!(
                eventually(Duration::from_secs(60), || sb.runs().len() == 1),
                "the run never showed"
            ),
            // While the container is being made, by `run` or `start`.
            _ => loop {
                let line = rx.recv_timeout(Duration::from_secs(60)).expect("progress");
                if line.contains("creating the container") {
                    break;
                }
            },
        }
        signal(child.id(), "INT");
        let started = Instant::now();
        let status = child.wait().unwrap();
        drain.join().unwrap();
        assert_eq!(status.code(), Some(130), "{phase}");
        assert!(started.elapsed() < Duration::from_secs(30), "{phase}");
        assert_eq!(sb.runs(), Vec::<String>::new(), "{phase}: a run was left");
    }
    sb.assert_nothing_left();
}

#[test]
fn sigint_during_exec_kills_the_command_in_the_run() {
    let Some(sb) = sandbox("sigint-exec") else {
        return;
    };
    let id = sb.start(&[]);
    let (mut child, line) =
        common::mux::first_line(sb.exec_cmd(&id, &[], &["sh", "-c", "echo started; sleep 1000"]));
    assert_eq!(line, "started\n");
    signal(child.id(), "INT");
    assert_eq!(child.wait().unwrap().code(), Some(130));
    // The exec's processes are gone; the run stays.
    let out = run(sb.exec_cmd(&id, &[], &["sh", "-c", "ps | grep -c '[s]leep 1000'"]));
    assert_eq!(text(&out.stdout).trim(), "0", "{}", text(&out.stderr));
    run(sb.cmd(&["stop", &id]));
    sb.assert_nothing_left();
}

#[test]
fn cp_files_and_directories_both_ways() {
    let Some(sb) = sandbox("cp") else { return };
    let id = sb.start(&[]);
    let host = tempfile::tempdir().unwrap();
    let h = |p: &str| host.path().join(p);
    // A file in, to a name and into a directory.
    std::fs::write(h("a.txt"), "file a\n").unwrap();
    let a = h("a.txt");
    let cp = |src: &str, dst: &str| {
        let out = run(sb.cmd(&["cp", src, dst]));
        assert_eq!(code(&out), 0, "cp {src} {dst}: {}", text(&out.stderr));
    };
    cp(a.to_str().unwrap(), &format!("{id}:/workspace/b.txt"));
    cp(a.to_str().unwrap(), &format!("{id}:/workspace/"));
    let out = run(sb.exec_cmd(&id, &[], &["cat", "b.txt", "a.txt"]));
    assert_eq!(text(&out.stdout), "file a\nfile a\n");
    // A directory in, with a nested file and a symlink (kept as a symlink).
    std::fs::create_dir_all(h("tree/sub")).unwrap();
    std::fs::write(h("tree/sub/deep.txt"), "deep\n").unwrap();
    std::os::unix::fs::symlink("sub/deep.txt", h("tree/link")).unwrap();
    cp(h("tree").to_str().unwrap(), &format!("{id}:/workspace"));
    cp(
        h("tree").to_str().unwrap(),
        &format!("{id}:/workspace/renamed"),
    );
    let out = run(sb.exec_cmd(
        &id,
        &[],
        &[
            "sh",
            "-c",
            "cat tree/sub/deep.txt renamed/link; readlink tree/link",
        ],
    ));
    assert_eq!(
        text(&out.stdout),
        "deep\ndeep\nsub/deep.txt\n",
        "{}",
        text(&out.stderr)
    );

    // Out: a file to a name and into a directory; a directory to a new name and into one.
    run(sb.exec_cmd(
        &id,
        &[],
        &[
            "sh",
            "-c",
            "mkdir -p out/in && echo one > out/one && echo two > out/in/two && chmod 750 out/one",
        ],
    ));
    let out_dir = tempfile::tempdir().unwrap();
    let o = |p: &str| out_dir.path().join(p);
    cp(
        &format!("{id}:/workspace/out/one"),
        o("first").to_str().unwrap(),
    );
    cp(
        &format!("{id}:/workspace/out/one"),
        out_dir.path().to_str().unwrap(),
    );
    cp(&format!("{id}:/workspace/out"), o("copy").to_str().unwrap());
    cp(
        &format!("{id}:/workspace/out"),
        out_dir.path().to_str().unwrap(),
    );
    for (path, want) in [
        ("first", "one\n"),
        ("one", "one\n"),
        ("copy/in/two", "two\n"),
        ("out/one", "one\n"),
    ] {
        assert_eq!(std::fs::read_to_string(o(path)).unwrap(), want, "{path}");
    }
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(o("first")).unwrap().permissions().mode() & 0o777,
        0o750
    );

    // Never through a symlink out of the destination: a symlink at the file's name is
    // replaced, and a directory reached through a symlink is refused.
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("victim"), "untouched\n").unwrap();
    std::os::unix::fs::symlink(outside.path().join("victim"), o("link-file")).unwrap();
    cp(
        &format!("{id}:/workspace/out/one"),
        o("link-file").to_str().unwrap(),
    );
    assert_eq!(
        std::fs::read_to_string(outside.path().join("victim")).unwrap(),
        "untouched\n"
    );
    assert_eq!(std::fs::read_to_string(o("link-file")).unwrap(), "one\n");
    let merge = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), merge.path().join("out")).unwrap();
    let res = run(sb.cmd(&[
        "cp",
        &format!("{id}:/workspace/out"),
        merge.path().to_str().unwrap(),
    ]));
    assert_eq!(code(&res), 125, "{}", text(&res.stderr));
    assert!(
        !outside.path().join("one").exists(),
        "wrote through a symlink"
    );
    assert!(
        !outside.path().join("in").exists(),
        "wrote through a symlink"
    );

    // Missing source: a clear error.
    let res = run(sb.cmd(&[
        "cp",
        &format!("{id}:/workspace/nope"),
        o("x").to_str().unwrap(),
    ]));
    assert_eq!(code(&res), 125);
    assert!(
        text(&res.stderr).contains("not found"),
        "{}",
        text(&res.stderr)
    );
    run(sb.cmd(&["stop", &id]));
    sb.assert_nothing_left();
}

#[test]
fn a_spec_file_starts_a_run_and_a_bad_one_creates_nothing() {
    let Some(sb) = sandbox("spec-file") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("spec.yaml");
    std::fs::write(
        &good,
        format!(
            "image: {}\nenv:\n  GREETING: from the file\npost_create:\n  - sh -c 'echo ready > /workspace/setup.txt'\nlabels:\n  {}: {}\nttl: 10m\n",
            common::image(),
            common::TEST_LABEL,
            sb.label_value
        ),
    )
    .unwrap();
    let out = run(sb.cmd(&[
        "start",
        "--spec",
        good.to_str().unwrap(),
        "--env",
        "EXTRA=flag",
    ]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    let id = text(&out.stdout).trim().to_string();
    let out = run(sb.exec_cmd(
        &id,
        &[],
        &["sh", "-c", "echo $GREETING $EXTRA; cat setup.txt"],
    ));
    assert_eq!(text(&out.stdout), "from the file flag\nready\n");
    let out = run(sb.cmd(&["ls", "--label", &sb.selector()]));
    assert!(
        text(&out.stdout).contains("in 9m") || text(&out.stdout).contains("in 10m"),
        "{}",
        text(&out.stdout)
    );
    run(sb.cmd(&["stop", &id]));

    // Bad files: the field and the line, exit 125, nothing created.
    let cases = [
        (
            "bad.yaml",
            "image: {image}\nlabels:\n  {label}\nresources:\n  cpus: 0\n",
            "bad.yaml:5: invalid spec (resources.cpus): must be a number of cores from 0.01",
        ),
        (
            "bad.toml",
            "image = \"{image}\"\nimgae = \"typo\"\n[labels]\n{label_toml}\n",
            "bad.toml:2: invalid spec: unknown field `imgae`",
        ),
        (
            "bad.json",
            "{\n  \"image\": \"{image}\",\n  \"env\": {\"OK\": \"1\",\n    \"A=B\": \"x\"}\n}\n",
            "bad.json:4: invalid spec (env[1].name)",
        ),
    ];
    for (name, template, want) in cases {
        let text_of = template
            .replace("{image}", &common::image())
            .replace(
                "{label}",
                &format!("{}: {}", common::TEST_LABEL, sb.label_value),
            )
            .replace(
                "{label_toml}",
                &format!("\"{}\" = \"{}\"", common::TEST_LABEL, sb.label_value),
            );
        let path = dir.path().join(name);
        std::fs::write(&path, text_of).unwrap();
        for command in ["start", "run"] {
            let mut args = vec![command, "--spec", path.to_str().unwrap()];
            if command == "run" {
                args.extend(["--", "true"]);
            }
            let out = run(sb.cmd(&args));
            assert_eq!(code(&out), 125, "{name} {command}");
            let stderr = text(&out.stderr);
            let first = stderr.lines().next().unwrap_or("");
            let want = format!(
                "sandbox: error: {}",
                want.replace(name, &path.display().to_string())
            );
            assert!(first.starts_with(&want), "{name} {command}: {stderr}");
        }
    }
    sb.assert_nothing_left();
}

#[test]
fn an_unreachable_engine_is_one_line_and_a_hint() {
    let Some(sb) = sandbox("unreachable") else {
        return;
    };
    let out = run(sb.cmd(&["--config", "host=unix:///no/such/docker.sock", "ls"]));
    assert_eq!(code(&out), 125);
    let stderr = text(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(
        lines[0].starts_with("sandbox: error: backend unavailable: "),
        "{stderr}"
    );
    assert!(lines[0].contains("/no/such/docker.sock"), "{stderr}");
    assert!(
        lines[1].starts_with("sandbox: hint: is the Docker engine running?"),
        "{stderr}"
    );
    let out = run(sb.cmd(&["--config", "hostt=x", "ls"]));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("unknown config key hostt; valid: ")
            && stderr.contains(" host,")
            && stderr.contains("timeout_secs"),
        "{stderr}"
    );
    let out = run(sb.cmd(&[
        "start",
        "--image",
        "sandbox-test/never-built:x",
        "--pull",
        "never",
    ]));
    assert_eq!(code(&out), 125);
    assert!(
        text(&out.stderr).contains("sandbox: hint: pull policy never?"),
        "{}",
        text(&out.stderr)
    );
    sb.assert_nothing_left();
}

/// A pull from a registry on loopback (Debian's docker-registry) shows progress lines.
#[test]
fn a_pull_shows_progress() {
    let Some(sb) = sandbox("pull-progress") else {
        return;
    };
    let Some(registry) = loopback_registry() else {
        return;
    };
    let tag = format!("127.0.0.1:{}/t/busybox:{}", registry.port, sb.label_value);
    let docker = |args: &[&str]| {
        let out = std::process::Command::new("docker")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "docker {args:?}: {}",
            text(&out.stderr)
        );
    };
    // A layer of its own (3 MB), so that the pull has bytes to move: the base layers
    // are already here and would only show "Already exists".
    let dockerfile = format!(
        "FROM {}\nRUN head -c 3000000 /dev/urandom > /blob-{}\n",
        common::image(),
        sb.label_value
    );
    let mut build = std::process::Command::new("docker")
        // No network for the RUN step; no intermediate container left even if it fails.
        .args([
            "build",
            "-q",
            "--network",
            "none",
            "--force-rm",
            "-t",
            &tag,
            "-",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut build.stdin.take().unwrap(), dockerfile.as_bytes()).unwrap();
    let built = build.wait_with_output().unwrap();
    assert!(
        built.status.success(),
        "docker build: {}",
        text(&built.stderr)
    );
    docker(&["push", &tag]);
    docker(&["rmi", &tag]);
    let mut args = vec!["start", "--pull", "always", "--image", &tag];
    let labels = sb.labels();
    args.extend(labels.iter().map(String::as_str));
    let out = run(sb.cmd(&args));
    let _ = std::process::Command::new("docker")
        .args(["rmi", "-f", &tag])
        .output();
    let stderr = text(&out.stderr);
    assert_eq!(code(&out), 0, "{stderr}");
    assert!(stderr.contains(&format!("pulling {tag}")), "{stderr}");
    let layer_lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with(&format!("pull {tag}: layer ")))
        .collect();
    assert!(
        layer_lines.iter().any(|l| l.contains("Pull complete")),
        "no per-layer progress: {stderr}"
    );
    assert!(
        layer_lines
            .iter()
            .any(|l| l.contains("Download") || l.contains("Extracting")),
        "no byte progress: {stderr}"
    );
    let id = text(&out.stdout).trim().to_string();
    run(sb.cmd(&["stop", &id]));
    sb.assert_nothing_left();
}

/// `docker-registry serve` on 127.0.0.1, without auth (the shared test helper), when the
/// binary is there (installed with apt-get in CI).
fn loopback_registry() -> Option<registry::Registry> {
    let binary = "/usr/bin/docker-registry";
    if !std::path::Path::new(binary).exists() {
        let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
        let root = std::process::Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| text(&o.stdout).trim() == "0");
        if ci && root {
            eprintln!("installing docker-registry (apt-get) for the pull test");
            let _ = std::process::Command::new("apt-get")
                .args(["update", "-qq"])
                .status();
            let _ = std::process::Command::new("apt-get")
                .args(["install", "-y", "-qq", "docker-registry"])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status();
        }
        if !std::path::Path::new(binary).exists() {
            if common::strict("docker") {
                panic!("{binary} is missing: apt-get install docker-registry");
            }
            eprintln!(
                "\n*** SKIPPED a_pull_shows_progress: {binary} is missing (apt-get install docker-registry)"
            );
            return None;
        }
    }
    Some(registry::Registry::open())
}

#[test]
fn a_devcontainer_json_is_the_base_spec() {
    let Some(sb) = sandbox("devcontainer") else {
        return;
    };
    let repo = tempfile::tempdir().unwrap();
    std::fs::create_dir(repo.path().join(".devcontainer")).unwrap();
    std::fs::write(
        repo.path().join(".devcontainer/devcontainer.json"),
        format!(
            r#"{{
  // comments and trailing commas, as editors write them
  "image": "{}",
  "containerEnv": {{ "FROM_DEVCONTAINER": "yes", }},
  "workspaceFolder": "/workspace",
  "postCreateCommand": "echo made-by-post-create > dc.txt",
}}"#,
            common::image()
        ),
    )
    .unwrap();
    let dir = repo.path().to_str().unwrap();
    let out = run(sb.run_cmd(
        &["--devcontainer", dir, "--network", "none", "-q"],
        &["sh", "-c", "echo $FROM_DEVCONTAINER; cat dc.txt; pwd"],
    ));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "yes\nmade-by-post-create\n/workspace\n",
        "{}",
        text(&out.stderr)
    );
    // The workspace is the repository: the post-create file shows on the host.
    assert!(repo.path().join("dc.txt").exists());
    // What devcontainer.json asks for and runcell cannot do is refused, naming it.
    std::fs::write(
        repo.path().join(".devcontainer/devcontainer.json"),
        r#"{ "build": { "dockerfile": "Dockerfile" } }"#,
    )
    .unwrap();
    let out = run(sb.run_cmd(&["--devcontainer", dir], &["true"]));
    assert_eq!(code(&out), 125, "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("build"), "{}", text(&out.stderr));
    sb.assert_nothing_left();
}

/// Each outcome means exactly what it says: a spec field of the wrong type is an error, an
/// image never matches by ID prefix, a limit engines refuse is an invalid spec, a kill that
/// could not happen is 120 (never 124), and a run removed under a command is 121.
#[test]
fn outcomes_say_exactly_what_happened() {
    let Some(sb) = sandbox("outcomes") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let labels = sb.labels();
    let with_labels = |args: &[&str]| {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let at = all.iter().position(|a| a == "--").unwrap_or(all.len());
        for (i, l) in labels.iter().enumerate() {
            all.insert(at + i, l.clone());
        }
        all
    };
    let refused = |args: &[&str], want: &str| {
        let all = with_labels(args);
        let started = Instant::now();
        let out = run(sb.cmd(&all.iter().map(String::as_str).collect::<Vec<_>>()));
        let stderr = text(&out.stderr);
        assert_eq!(code(&out), 125, "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert!(started.elapsed() < Duration::from_secs(30), "{args:?}");
    };
    // A number is not an image name.
    let typed = dir.path().join("typed.toml");
    std::fs::write(&typed, "image = 5\n").unwrap();
    refused(
        &["run", "--spec", typed.to_str().unwrap(), "--", "true"],
        "typed.toml:1: invalid spec (image): expected a string, found an integer",
    );
    // A YAML alias bomb of under 1 KiB fails at once.
    let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for c in b'b'..=b'l' {
        let (this, prev) = (c as char, (c - 1) as char);
        bomb.push_str(&format!(
            "{this}: &{this} [{}]\n",
            vec![format!("*{prev}"); 10].join(", ")
        ));
    }
    let bomb_path = dir.path().join("bomb.yaml");
    std::fs::write(&bomb_path, bomb).unwrap();
    refused(
        &["run", "--spec", bomb_path.to_str().unwrap(), "--", "true"],
        "more than 100000 values",
    );
    // Image IDs only whole; a hex name is a name, never an ID prefix.
    refused(
        &["run", "--image", "sha256:0a", "--", "true"],
        "invalid spec (image)",
    );
    for hex in ["0", "3", "5", "f", "a", "c"] {
        refused(
            &["run", "--image", hex, "--pull", "never", "--", "true"],
            "not present",
        );
    }
    // A memory limit engines refuse.
    refused(
        &[
            "run",
            "--image",
            &common::image(),
            "--memory",
            "4m",
            "--",
            "true",
        ],
        "invalid spec (resources.memory_bytes)",
    );

    // A command filling the pids limit times out: killed (124, nothing left) or said not
    // to be (120), on both exec paths.
    for helper in ["required", "off"] {
        let spec = dir.path().join(format!("pids-{helper}.yaml"));
        std::fs::write(
            &spec,
            format!(
                "image: {}\nresources:\n  pids: 64\nexec_helper: {helper}\n",
                common::image()
            ),
        )
        .unwrap();
        let id = sb.start(&["--spec", spec.to_str().unwrap()]);
        let out = run(sb.exec_cmd(
            &id,
            &["--timeout", "2s", "--env", "RUNCELL_TEST_BOMB=1"],
            &[
                "sh",
                "-c",
                "( while :; do sleep 1000 & done ) 2>/dev/null; sleep 1000 & exec sleep 1000",
            ],
        ));
        let stderr = text(&out.stderr);
        match code(&out) {
            124 => {
                let left = run(sb.exec_cmd(
                    &id,
                    &[],
                    &[
                        "sh",
                        "-c",
                        "for d in /proc/[0-9]*; do if tr '\\0' '\\n' 2>/dev/null < $d/environ | grep -qx RUNCELL_TEST_BOMB=1; then echo $d; fi; done",
                    ],
                ));
                assert_eq!(
                    code(&left),
                    0,
                    "{helper}: said 124 but: {}",
                    text(&left.stderr)
                );
                assert_eq!(text(&left.stdout), "", "{helper}: said 124, yet alive");
            }
            120 => assert!(stderr.contains("could not be killed"), "{helper}: {stderr}"),
            other => panic!("{helper}: exit {other}: {stderr}"),
        }
        run(sb.cmd(&["stop", &id]));
    }

    // The run removed under a command: 121, never the engine's 137.
    let id = sb.start(&[]);
    let child = sb
        .exec_cmd(&id, &[], &["sleep", "600"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let removed = std::process::Command::new("docker")
        // With its anonymous volumes (`-v`), as the driver removes a container.
        .args(["rm", "-f", "-v", &id])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(removed.success());
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(
        matches!(code(&out), 121 | 122),
        "exit {}: {stderr}",
        code(&out)
    );
    sb.assert_nothing_left();
}

/// A tmux server of the test's own, with one 90x20 window running `command`.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn start(socket: &str, command: &str) -> Tmux {
        let t = Tmux {
            socket: socket.into(),
        };
        let ok = t
            .cmd(&[
                "new-session",
                "-d",
                "-s",
                "t",
                "-x",
                "90",
                "-y",
                "20",
                command,
            ])
            .status()
            .expect("tmux (installed by `cargo xtask test`)")
            .success();
        assert!(ok, "tmux new-session failed");
        t
    }

    fn cmd(&self, args: &[&str]) -> std::process::Command {
        let mut c = std::process::Command::new("tmux");
        c.args(["-L", &self.socket]).args(args);
        c
    }

    fn screen(&self) -> String {
        text(
            &self
                .cmd(&["capture-pane", "-p", "-t", "t"])
                .output()
                .unwrap()
                .stdout,
        )
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "t"];
        args.extend(keys);
        assert!(self.cmd(&args).status().unwrap().success());
    }

    /// Waits (bounded) until the screen shows `want`.
    fn wait_for(&self, want: &str) {
        let shown = eventually(Duration::from_secs(30), || self.screen().contains(want));
        assert!(shown, "no {want:?} on the screen:\n{}", self.screen());
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]).status();
    }
}

#[test]
fn exec_it_drives_a_terminal_in_the_run_and_restores_this_one() {
    let Some(sb) = sandbox("exec-it") else {
        return;
    };
    let id = sb.start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let after = dir.path().join("stty-after");
    let mut argv = vec![env!("CARGO_BIN_EXE_sandbox").to_string()];
    argv.extend(sb.global.iter().cloned());
    argv.extend(["exec", "-it", &id, "--", "sh"].map(String::from));
    let command = format!(
        "{}; echo EXIT=$?; stty -a > {}; sleep 600",
        shell_words::join(&argv),
        shell_words::quote(after.to_str().unwrap())
    );
    let tmux = Tmux::start(&sb.label_value, &command);
    tmux.keys(&[
        "[ -t 0 ] && [ -t 1 ] && echo TTY-$(stty size | tr ' ' x)",
        "Enter",
    ]);
    tmux.wait_for("TTY-20x90");
    tmux.cmd(&["resize-window", "-t", "t", "-x", "120", "-y", "30"])
        .status()
        .unwrap();
    tmux.keys(&["echo NOW-$(stty size | tr ' ' x)", "Enter"]);
    tmux.wait_for("NOW-30x120");
    tmux.keys(&["sleep 1000", "Enter"]);
    std::thread::sleep(Duration::from_millis(500));
    tmux.keys(&["C-c"]);
    tmux.keys(&["echo AFTER-$?", "Enter"]);
    // The shell's status of a command killed by SIGINT.
    tmux.wait_for("AFTER-130");
    tmux.keys(&["exit 5", "Enter"]);
    tmux.wait_for("EXIT=5");
    let restored = eventually(Duration::from_secs(10), || after.exists());
    assert!(restored, "the shell after the exec did not run");
    let stty = std::fs::read_to_string(&after).unwrap();
    let words: Vec<&str> = stty.split_whitespace().collect();
    for mode in ["icanon", "echo", "isig", "opost"] {
        assert!(
            words.contains(&mode),
            "the terminal is not restored ({mode}): {stty}"
        );
    }
    drop(tmux);
    run(sb.cmd(&["stop", &id]));
    sb.assert_nothing_left();
}

/// The table row of `sandbox ps` for exec `exec`, split into cells (STATE `exited 3` is
/// two).
fn ps_row(sb: &Sandbox, run_id: &str, exec: &str) -> Option<Vec<String>> {
    let out = run(sb.cmd(&["ps", run_id]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(table.starts_with("ID "), "{table}");
    table
        .lines()
        .map(|l| l.split_whitespace().map(String::from).collect::<Vec<_>>())
        .find(|cells| cells.first().map(String::as_str) == Some(exec))
}

/// `sandbox exec -d`: prints the exec id and nothing else.
fn exec_detached(sb: &Sandbox, run_id: &str, argv: &[&str]) -> String {
    let out = run(sb.exec_cmd(run_id, &["-d"], argv));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let id = stdout.trim_end_matches('\n');
    assert!(
        stdout.ends_with('\n')
            && !id.contains('\n')
            && !id.starts_with('0')
            && id.parse::<u32>().is_ok(),
        "not an exec id: {stdout:?}"
    );
    id.to_string()
}

#[test]
fn detached_execs_are_listed_waited_for_read_and_killed() {
    let Some(sb) = sandbox("durable-execs") else {
        return;
    };
    let id = sb.start(&[]);
    let script = "for i in $(seq 1 50); do echo line$i; sleep 0.05; done; exit 3";
    let lines = exec_detached(&sb, &id, &["sh", "-c", script]);

    // Listed while it runs, detached.
    let row = ps_row(&sb, &id, &lines).expect("ps lists the exec");
    assert_eq!(
        (row[2].as_str(), row[3].as_str()),
        ("running", "yes"),
        "{row:?}"
    );
    let out = run(sb.cmd(&["ps", "--json", &id]));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let entry = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"].as_u64() == lines.parse().ok())
        .unwrap_or_else(|| panic!("{rows}"));
    assert_eq!(entry["detached"], true, "{entry}");
    assert_eq!(entry["argv"][0], "sh", "{entry}");

    // wait: its exit code; logs: every line, exactly; -f of an ended exec: its code too.
    let out = run(sb.cmd(&["wait", &id, &lines]));
    assert_eq!(code(&out), 3, "{}", text(&out.stderr));
    let all: String = (1..=50).map(|i| format!("line{i}\n")).collect();
    let out = run(sb.cmd(&["logs", &id, &lines]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), all);
    assert_eq!(text(&out.stderr), "");
    let out = run(sb.cmd(&["logs", "--from", "6", &id, &lines]));
    assert_eq!(text(&out.stdout), all["line1\n".len()..]);
    let out = run(sb.cmd(&["logs", "-f", &id, &lines]));
    assert_eq!((code(&out), text(&out.stdout)), (3, all.clone()));
    let row = ps_row(&sb, &id, &lines).unwrap();
    assert_eq!(row[2..4], ["exited", "3"], "{row:?}");

    // A second one, killed: `logs` stops at what there is now; `wait` and `logs -f` give
    // the signal's code (TERM first: 143).
    let sleeper = exec_detached(&sb, &id, &["sh", "-c", "echo started; exec sleep 1000"]);
    let printed = eventually(Duration::from_secs(10), || {
        ps_row(&sb, &id, &sleeper).is_some_and(|r| r[5] == "8")
    });
    assert!(printed, "{:?}", ps_row(&sb, &id, &sleeper));
    let out = run(sb.cmd(&["logs", &id, &sleeper]));
    assert_eq!((code(&out), text(&out.stdout)), (0, "started\n".into()));
    let waiter = sb.cmd(&["wait", &id, &sleeper]);
    let waiter = std::thread::spawn(move || run(waiter));
    let follower = sb.cmd(&["logs", "-f", &id, &sleeper]);
    let follower = std::thread::spawn(move || run(follower));
    std::thread::sleep(Duration::from_millis(500));
    let out = run(sb.cmd(&["kill", &id, &sleeper]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    let out = waiter.join().unwrap();
    assert!(
        [143, 137].contains(&code(&out)),
        "{}: {}",
        code(&out),
        text(&out.stderr)
    );
    let killed = code(&out);
    let out = follower.join().unwrap();
    assert_eq!(code(&out), killed, "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "started\n");
    assert_eq!(code(&run(sb.cmd(&["wait", &id, &sleeper]))), killed);

    // Unknown ids are not-found errors naming the id; a bad one is a usage error.
    for command in ["wait", "kill", "logs", "rm-exec"] {
        let out = run(sb.cmd(&[command, &id, "4000000000"]));
        let stderr = text(&out.stderr);
        assert_eq!(code(&out), 125, "{command}: {stderr}");
        assert!(
            stderr.contains("not found (exec_id)") && stderr.contains("exec 4000000000"),
            "{command}: {stderr}"
        );
        let out = run(sb.cmd(&[command, &id, "x"]));
        assert_eq!(code(&out), 125, "{command}: {}", text(&out.stderr));
    }
    // What makes no sense with -d is refused before anything starts.
    for flags in [&["-d", "-i"][..], &["-d", "--timeout", "5s"]] {
        let out = run(sb.exec_cmd(&id, flags, &["true"]));
        assert_eq!(code(&out), 125, "{flags:?}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("--detach with"),
            "{}",
            text(&out.stderr)
        );
    }

    // rm-exec forgets an ended record.
    let out = run(sb.cmd(&["rm-exec", &id, &lines]));
    assert_eq!(
        (code(&out), text(&out.stdout)),
        (0, format!("{lines}\n")),
        "{}",
        text(&out.stderr)
    );
    assert!(ps_row(&sb, &id, &lines).is_none());
    assert!(ps_row(&sb, &id, &sleeper).is_some());
    assert_eq!(code(&run(sb.cmd(&["logs", &id, &lines]))), 125);

    run(sb.cmd(&["stop", &id]));
    sb.assert_nothing_left();
}

#[test]
fn snapshots_start_and_fork_runs_and_are_removed() {
    let Some(sb) = sandbox("snapshots") else {
        return;
    };
    let id = sb.start(&["--env", "ONLY_SOURCE=1"]);
    let exec = |run: &str, script: &str| run_out(sb.exec_cmd(run, &[], &["sh", "-c", script]));
    assert_eq!(
        exec(&id, "echo kept > /usr/local/kept; echo ws > state.txt"),
        ""
    );
    let out = run(sb.cmd(&["snapshot", &id, "--name", "cli-test", "--ttl", "1h"]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    let snap = text(&out.stdout).trim().to_string();
    assert!(snap.starts_with("snap-"), "{snap:?}");
    let out = run(sb.cmd(&["snapshots", "--json"]));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == snap.as_str())
        .expect("listed");
    assert_eq!(
        (row["name"].as_str(), row["source_run"].as_str()),
        (Some("cli-test"), Some(id.as_str()))
    );
    // A run from it: the files, its own env, none of the source's.
    let labels = sb.labels();
    let mut start = vec!["start", "--from-snapshot", &snap, "--env", "MINE=2"];
    start.extend(labels.iter().map(String::as_str));
    let out = run(sb.cmd(&start));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    let from = text(&out.stdout).trim().to_string();
    let script = "cat /usr/local/kept state.txt; echo ${ONLY_SOURCE-unset} ${MINE-unset}";
    assert_eq!(exec(&from, script), "kept\nws\nunset 2\n");
    let mut fork = vec!["fork", &snap, "-n", "2"];
    fork.extend(labels.iter().map(String::as_str));
    let out = run(sb.cmd(&fork));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    let forks: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    assert_eq!(forks.len(), 2, "{forks:?}");
    for run in &forks {
        assert_eq!(exec(run, script), "kept\nws\nunset unset\n");
    }
    // In use: refused, named; after the runs stop: removed.
    let out = run(sb.cmd(&["rm-snapshot", &snap]));
    assert_ne!(code(&out), 0);
    assert!(
        text(&out.stderr).contains("in use"),
        "{}",
        text(&out.stderr)
    );
    let mut stop = vec!["stop", id.as_str(), from.as_str()];
    stop.extend(forks.iter().map(String::as_str));
    assert_eq!(code(&run(sb.cmd(&stop))), 0);
    let out = run(sb.cmd(&["rm-snapshot", &snap]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    let out = run(sb.cmd(&["snapshots", "--json"]));
    assert!(!text(&out.stdout).contains(&snap));
    // Unknown: a typed failure naming the flag, nothing created.
    let mut start = vec!["start", "--from-snapshot", "snap-0000000000000000"];
    start.extend(labels.iter().map(String::as_str));
    let out = run(sb.cmd(&start));
    assert_ne!(code(&out), 0);
    assert!(
        text(&out.stderr).contains("from_snapshot"),
        "{}",
        text(&out.stderr)
    );
    sb.assert_nothing_left();
}

/// Images of the engine whose labels hold `label` (`key=value`).
fn images_labelled(label: &str) -> Vec<String> {
    let out = std::process::Command::new("docker")
        .args([
            "images",
            "-q",
            "--no-trunc",
            "--filter",
            &format!("label={label}"),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout).lines().map(str::to_string).collect()
}

/// A `sandbox snapshot` SIGKILLed once its commit exists (that image carries the run's
/// env and labels): `sandbox gc` removes it, as the commit of a snapshot whose taker
/// died; before, it stayed for good.
#[test]
fn a_snapshot_killed_midway_leaves_nothing_after_gc() {
    let Some(sb) = sandbox("snapshot-killed") else {
        return;
    };
    let id = sb.start(&["--env", "SECRET_ISH=1"]);
    // Enough to change that the commit stands a while before the snapshot's own image.
    let script =
        "head -c 30000000 /dev/urandom > /usr/local/big; head -c 30000000 /dev/urandom > big";
    assert_eq!(run_out(sb.exec_cmd(&id, &[], &["sh", "-c", script])), "");
    let of = format!("sandbox.dev/snapshot-of={id}");
    let mut killed_midway = false;
    for _ in 0..5 {
        let mut taker = sb
            .cmd(&["snapshot", &id])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            if !images_labelled(&of).is_empty() {
                break;
            }
            if taker.try_wait().unwrap().is_some() || std::time::Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = taker.kill();
        let status = taker.wait().unwrap();
        if !status.success() && !images_labelled("sandbox.dev/snapshot-commit").is_empty() {
            killed_midway = true;
            break;
        }
        // Done before the kill: remove it and try again.
        let out = run(sb.cmd(&["gc", "--label", &sb.selector()]));
        assert_eq!(code(&out), 0, "{}", text(&out.stderr));
        for snap in images_labelled(&of) {
            let _ = std::process::Command::new("docker")
                .args(["rmi", &snap])
                .output();
        }
    }
    assert!(
        killed_midway,
        "no try killed the snapshot while its commit stood"
    );
    let out = run(sb.cmd(&["gc", "--label", &sb.selector()]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("snap-") || text(&out.stderr).contains("snap-"),
        "gc said nothing of the snapshot: {} {}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let left = images_labelled(&of);
    assert!(
        left.is_empty(),
        "images of the killed snapshot left: {left:?}"
    );
    run(sb.cmd(&["stop", &id]));
    sb.assert_nothing_left();
}

/// A command's stdout, after checking it exited 0.
fn run_out(cmd: std::process::Command) -> String {
    let out = run(cmd);
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    text(&out.stdout)
}
