//! `runcell-probe`: a hostile process for the isolation cases of the conformance suite,
//! built by the suite's build script (std only, static) and uploaded into the run.
//!
//! - `probe join <pid>`: tries every way a process has to get into the process group and
//!   session of process `<pid>` (another exec's), prints one line per attempt
//!   (`<what> ok` or `<what> refused <errno>`), then its own group and session, then
//!   sleeps for ever.
//! - `probe daemon <pidfile> <name>`: daemonises the usual way (fork, the parent exits,
//!   `setsid`, fork again, the middle one exits), writes its pid to `<pidfile>`, then
//!   runs itself again with an empty environment, `argv[0]` `<name>` and `<name>` as its
//!   command name (`comm`), and sleeps for ever.
//! - `probe swap <a> <b>`: exchanges the names `<a>` and `<b>` as fast as it can, for
//!   ever (an atomic `renameat2` exchange, or three renames where the file system cannot
//!   exchange): a directory and a symbolic link that trade places under a file operation.

use std::ffi::CString;
use std::os::raw::{c_char, c_int, c_uint, c_ulong};
use std::time::Duration;

unsafe extern "C" {
    fn setpgid(pid: c_int, pgid: c_int) -> c_int;
    fn getpgid(pid: c_int) -> c_int;
    fn getsid(pid: c_int) -> c_int;
    fn setsid() -> c_int;
    fn fork() -> c_int;
    fn prctl(option: c_int, arg2: c_ulong, arg3: c_ulong, arg4: c_ulong, arg5: c_ulong) -> c_int;
    fn execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char)
    -> c_int;
    fn renameat2(
        from_dir: c_int,
        from: *const c_char,
        to_dir: c_int,
        to: *const c_char,
        flags: c_uint,
    ) -> c_int;
    fn rename(from: *const c_char, to: *const c_char) -> c_int;
}

const AT_FDCWD: c_int = -100;
const RENAME_EXCHANGE: c_uint = 2;

fn swap(a: &str, b: &str) -> ! {
    let (a, b) = (CString::new(a).unwrap(), CString::new(b).unwrap());
    let c = CString::new(format!("{}.swap", a.to_str().unwrap())).unwrap();
    // SAFETY: NUL-terminated names that outlive the calls.
    let exchange = || unsafe {
        renameat2(AT_FDCWD, a.as_ptr(), AT_FDCWD, b.as_ptr(), RENAME_EXCHANGE)
    };
    if exchange() == 0 {
        println!("swapping by exchange");
        loop {
            exchange();
        }
    }
    println!("swapping by rename (exchange refused {})", errno());
    loop {
        // SAFETY: as above.
        unsafe {
            rename(a.as_ptr(), c.as_ptr());
            rename(b.as_ptr(), a.as_ptr());
            rename(c.as_ptr(), b.as_ptr());
        }
    }
}

const PR_SET_NAME: c_int = 15;

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Prints how an attempt went; true if it worked.
fn attempt(what: &str, r: c_int) -> bool {
    if r >= 0 {
        println!("{what} ok");
        true
    } else {
        println!("{what} refused {}", errno());
        false
    }
}

fn forever() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn set_name(name: &str) {
    let c = CString::new(name).unwrap_or_default();
    // SAFETY: PR_SET_NAME reads a NUL-terminated string that outlives the call.
    unsafe { prctl(PR_SET_NAME, c.as_ptr() as c_ulong, 0, 0, 0) };
}

fn join(target: c_int) -> ! {
    // SAFETY (all calls below): plain integer arguments.
    let (pgid, sid) = unsafe { (getpgid(target), getsid(target)) };
    println!("target {target} group {pgid} session {sid}");
    unsafe {
        let mut joined = attempt("setpgid-into-group", setpgid(0, pgid));
        joined |= attempt("setpgid-into-session-leader", setpgid(0, sid));
        attempt("setpgid-target-into-mine", setpgid(target, getpgid(0)));
        if !joined {
            // Leaving its own session first changes nothing: groups stay per session.
            attempt("setsid", setsid());
            attempt("setpgid-into-group-after-setsid", setpgid(0, pgid));
        }
        let child = fork();
        if child == 0 {
            // A child of ours, in a group of its own first, then into the target's.
            setpgid(0, 0);
            setpgid(0, pgid);
            forever();
        }
        attempt("setpgid-child-into-group", setpgid(child, pgid));
        println!("mine group {} session {}", getpgid(0), getsid(0));
    }
    forever()
}

fn daemon(pidfile: &str, name: &str) -> ! {
    // SAFETY: single-threaded here; the children only call async-signal-safe functions
    // until they exec or exit (std::process::exit flushes nothing of ours).
    unsafe {
        if fork() != 0 {
            std::process::exit(0);
        }
        setsid();
        if fork() != 0 {
            std::process::exit(0);
        }
    }
    let pid = std::process::id();
    let _ = std::fs::write(pidfile, format!("{pid}\n"));
    let exe = CString::new("/proc/self/exe").unwrap_or_default();
    let argv0 = CString::new(name).unwrap_or_default();
    let mode = CString::new("linger").unwrap_or_default();
    let argv = [argv0.as_ptr(), mode.as_ptr(), std::ptr::null()];
    let envp = [std::ptr::null()];
    // SAFETY: NUL-terminated strings and NULL-terminated arrays that outlive the call.
    unsafe { execve(exe.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
    std::process::exit(1)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("join") => join(args.get(2).and_then(|p| p.parse().ok()).unwrap_or(0)),
        Some("daemon") if args.len() == 4 => daemon(&args[2], &args[3]),
        Some("swap") if args.len() == 4 => swap(&args[2], &args[3]),
        Some("linger") => {
            set_name(&args[0]);
            forever()
        }
        _ => {
            eprintln!("usage: probe join <pid> | probe daemon <pidfile> <name> | probe swap <a> <b>");
            std::process::exit(2);
        }
    }
}
