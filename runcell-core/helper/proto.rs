//! The exec helper's wire protocol, shared word for word by the helper binary
//! (`helper/main.rs`, compiled by core's build script with std only) and core's client
//! (`src/helper/`). Std only: no crate may be used here.
//!
//! One exec stream carries it: the host writes frames to the helper's stdin, the helper
//! writes frames to its stdout (nothing else ever goes to its stdout; diagnostics go to
//! stderr). A frame is
//!
//! ```text
//! len: u32 LE (bytes that follow: 5 + payload) | kind: u8 | id: u32 LE | payload
//! ```
//!
//! `id` is the exec (or file operation) the frame belongs to, chosen by the host, unique
//! per helper connection; 0 is the connection itself. Payload fields are encoded with
//! [`Enc`] / [`Dec`]: integers little-endian, byte strings as `u32 LE length + bytes`,
//! lists as `u32 LE count + items`, options as `u8 (0|1) + value`.
//!
//! # Execs
//! - host `SPAWN` ([`Spawn`]) → helper `STARTED` (pid u32) or `SPAWN_ERROR` (kind u8, message).
//! - helper `STDOUT` / `STDERR` (data, at most [`CHUNK`] bytes each). The helper never sends
//!   more output bytes of one exec (stdout + stderr together) than the host granted:
//!   [`INITIAL_CREDIT`] at spawn, plus every `CREDIT` (u32) the host sends afterwards
//!   (what it holds is capped at [`MAX_CREDIT`]; a host never has more out). A
//!   command that prints faster than the host reads is blocked on its pipe: backpressure,
//!   never a buffer in the helper.
//! - host `STDIN` (data) and `STDIN_EOF`; the helper answers `STDIN_ACK` (u32 bytes) once
//!   it wrote them to the pipe (or dropped them because the process closed its stdin).
//!   The host never has more than [`STDIN_WINDOW`] unacknowledged bytes of one exec.
//! - helper `EXIT` (kind u8: [`EXITED`] / [`SIGNALED`], value i32), sent once the exec's
//!   root process was reaped (`waitpid`) and its stdout and stderr were drained: read to
//!   EOF, or, when a background process still holds them open, read until nothing more is
//!   buffered. `EXIT` is the last frame of an exec; the host may reuse nothing of it.
//! - host `KILL` → the helper kills the exec's whole process tree (see below) and answers
//!   `KILLED` once it is done (the `EXIT` of the root still follows, if not sent yet).
//!   `KILL` for an id the helper does not know (already exited) answers `KILLED` at once.
//!   `KILLED`'s payload is one byte: 1 when every process of the exec is gone, 0 when some
//!   outlived the kill's bound (the host then kills by the exec marker and never reports
//!   the kill as done); an empty payload is 1.
//!   `KILL` implies `DISCARD`.
//! - host `DISCARD`: the host's reader of this id is gone; see [`DISCARD`].
//! - A `SPAWN` with a terminal size ([`Spawn::tty`]) runs the command on a new
//!   pseudo-terminal (its stdin, stdout, stderr and controlling terminal; it leads a
//!   session of its own, still under its shepherd): its output comes as `STDOUT` only,
//!   `STDIN` is typed into the terminal, and host `RESIZE` (u32 rows, u32 columns, each
//!   1 to 65535) sets the terminal's size.
//! - The host counts what it receives against the credit it granted; a helper that sends
//!   more is a protocol error and the host drops the connection.
//!
//! # Kill
//! Every exec runs under a shepherd of its own (the helper's executable run again, in a
//! shepherd mode, started ahead of the exec that takes it): a child subreaper that leads a session of its own, starts the command
//! (in its own process group, with `RUNCELL_EXEC_ID` in its environment), reports its
//! real wait status to the helper, reaps every orphan of the exec, and stays while any
//! of the exec's processes lives. An exec's processes are exactly its shepherd's
//! descendants: a process cannot leave that tree (an orphan is re-parented to its
//! nearest subreaper, the shepherd), and no process of another exec can enter it or,
//! being in another session, join one of its process groups. A `KILL` has the shepherd
//! walk `/proc` parent links from its own pid, SIGSTOP everything found and walk again
//! until nothing new appears, send SIGTERM and SIGCONT, and SIGKILL (stopping first)
//! whatever is left after [`KILL_GRACE_MS`], until none is; each signal goes through a
//! pidfd checked against the start time the walk saw. `KILLED` is sent once the shepherd
//! exited (nothing of the exec is left), or after a bound. A kill needs no new process.
//!
//! # Files (no `tar` needed in the image)
//! - host `PUT` (path: absolute, of the directory to write into) then `ENTRY` frames
//!   ([`Entry`], `path` relative to that directory); a regular file's `ENTRY` is followed by
//!   exactly `size` bytes of `STDIN` frames (same window and `STDIN_ACK` as an exec); then
//!   `STDIN_EOF`. The helper creates directories, files, symlinks, fifos and hard links (to
//!   a regular file this same `PUT` wrote: through its still-open descriptor for the last
//!   256, by name and inode where no other user can change its directory; mode and owner
//!   are that file's), with mode (and owner when it runs as root) set through a
//!   descriptor of what it made (fifos and symlinks are made in a private staging
//!   directory beside their place); a directory already there keeps its owner and mode
//!   when another user can change the entries of its parent, replaces a regular file or symlink by a file, and never replaces a
//!   directory by a non-directory or the reverse. It answers `DONE` or `FILE_ERROR`
//!   ([`FileError`] kind u8, the relative path, message) for the first failure, after which
//!   it discards the operation's remaining frames. A file is written under a temporary
//!   name beside its destination and renamed over it once whole; a `PUT` that ends (by
//!   `STDIN_EOF` or the end of the connection) inside a file removes that temporary file.
//!   Whole [`HOLE_BLOCK`]-aligned blocks of zeros are not written but left as holes, so a
//!   sparse file is sparse again after it crossed (as its full size: the wire has no holes).
//! - host `GET` (path: absolute) → helper `ENTRY` frames for the path itself (its base name)
//!   and, for a directory, everything below it, depth first, each regular file followed by
//!   exactly `size` bytes of `STDOUT` frames, then `DONE`; or `FILE_ERROR`. `ENTRY` and
//!   `STDOUT` payload bytes both count against the id's credit (the exec rule). At most
//!   [`MAX_GETS`] run on one connection at once; one more is refused (`FILE_ERROR`).
//! - `DONE` is each operation's success marker: the host treats an operation as done only
//!   when it came. A `GET` that cannot send something whole ends with `FILE_ERROR` naming
//!   it, never with `DONE`: a file it cannot open or read, a directory it cannot list, a
//!   file that shrank while it was read (the data already sent is then short), a path
//!   asked for that is a fifo, socket or device. Below a directory, sockets and devices
//!   have no entry type and are skipped, as are entries removed before they were
//!   read; a file that grew is sent as long as it was when its `ENTRY` was sent.
//!   Since version 5 a `GET` keeps what an archive keeps: a named pipe below the path is a
//!   [`FIFO`] entry, and a regular file with more than one link that the same `GET` sent
//!   before (same device and inode, and still the same file: change time, modification
//!   time and size) is a [`HARDLINK`] entry naming that file's path. The first
//!   [`MAX_GET_LINKS`] such files are remembered, and marked [`LINK_TARGET`] in their own
//!   entry; later ones go as copies.
//!
//! # Snapshot layers (version 6)
//! A snapshot of a run's root filesystem as an OCI image layer: what changed since the
//! run started. The helper reads change times (`st_ctime`, which no user can set), so it
//! needs to know when the run started and what was there then: its *base listing*.
//! - host `BASE` (empty payload) → helper `DONE` or `FILE_ERROR`, once at create, before
//!   any user command. The helper takes T0 = now (`CLOCK_REALTIME`) less
//!   [`BASE_MARGIN_SECS`], walks the root filesystem from `/` through held descriptors
//!   (nothing followed) and writes, for every directory it walks, its path and the names
//!   in it to the file [`BASE_FILE`] in the daemon's directory (format below), made under
//!   a temporary name (`O_CREAT | O_EXCL | O_NOFOLLOW`, 0600) and linked to its name only
//!   when whole (never over one there). Skipped, with everything below them, and never
//!   recorded as names: `/proc`, `/sys`, `/dev`, [`HELPER_DIR`], the daemon's directory,
//!   every mount point of `/proc/self/mountinfo` but `/`, and a directory of another
//!   file system than `/` (a mount point moved while the walk ran; it is recorded as a
//!   name, never walked). Names starting with `.wh.` are walked but not recorded as
//!   names (no layer carries them). A base listing already there is kept (`DONE` at once: a
//!   restarted daemon must never take it again). A directory it cannot list fails it
//!   (`FILE_ERROR` naming it); so does a listing past [`MAX_BASE_BYTES`] or
//!   [`MAX_BASE_NAMES`].
//! - host `LAYER` (workspace: absolute path, or empty for none) → `ENTRY` and `STDOUT`
//!   frames exactly as a `GET`'s (same credit, hard links, fifos, shrink rule; counted
//!   among [`MAX_GETS`]), rooted at `/` (paths such as `usr/local/x`; `/` itself has no
//!   entry), then `DONE`; or `FILE_ERROR`. It holds every entry below `/` whose change
//!   time is at least the base's T0 (a directory's own entry likewise; every directory is
//!   walked, changed or not), with the skips of `BASE`, except that a workspace that is a
//!   mount point is sent whole (its change times ignored; mount points below it are
//!   still skipped) together with the entries of its ancestors, its own entry followed
//!   by the opaque whiteout `<ws>/.wh..wh..opq` (what was deleted from it stays deleted).
//!   A workspace that is no mount point is ordinary root filesystem. A workspace equal to
//!   or below `/proc`, `/sys`, `/dev`, [`HELPER_DIR`] or the daemon's directory is
//!   refused ([`FileError::Invalid`]); one that does not exist or is no directory (a
//!   link is not followed) is a `FILE_ERROR`. Sockets and devices are skipped, as below
//!   a `GET`'s directory. A directory of another file system than `/` that is no mount
//!   point (a btrfs subvolume, say) fails the `LAYER` (`FILE_ERROR` naming it) unless
//!   in the workspace.
//! - Moved directories: `rename(2)` changes the change time of the directory moved, not
//!   of what it holds. So a directory whose path the base does not list, or lists with
//!   another (device, inode), is sent whole (every entry below it, change times
//!   ignored): its own entry, then, when the base lists that path, the opaque whiteout
//!   `<dir>/.wh..wh..opq` (an empty [`REGULAR`] of mode 0: what lower layers held there
//!   is hidden), then everything below it (no other whiteouts in it).
//! - Whiteouts: for a directory whose change time is at least T0 and that the base
//!   lists, every name the base lists in it that is gone now (or is skipped now, or is
//!   a socket or device now) comes
//!   as an empty [`REGULAR`] entry of mode 0 named `.wh.<name>` in that directory, right
//!   after the directory's own entry (the OCI layer convention). An entry that would be
//!   sent whose name starts with `.wh.` fails the `LAYER` (`FILE_ERROR`, [`FileError::Invalid`]):
//!   only the helper makes whiteouts.
//! - No base listing is a `FILE_ERROR`; so is a malformed one. It lives where the run's
//!   code may write, so it is read as untrusted: bounded ([`MAX_BASE_BYTES`],
//!   [`MAX_BASE_NAMES`]), and a name that is empty, `.`, `..`, holds a `/`, starts with
//!   `.wh.`, or is not greater than the name before it in its directory is malformed.
//! - The base listing's format: the line `runcell-base 2 <t0 seconds> <t0 nanoseconds>\n`,
//!   then per directory walked (depth first; `/` first, as the empty path) its path
//!   relative to `/`, a NUL, its `<st_dev> <st_ino>` in decimal and a NUL, each name in
//!   it followed by a NUL (sorted bytewise, each once), and one more NUL.
//! - Every walk (`GET`, `BASE`, `LAYER`) goes at most [`MAX_WALK_DEPTH`] directory
//!   levels below its start: deeper is a `FILE_ERROR` naming the directory.
//!
//! # Daemon, relay and durable execs (version 3; `LEAVE` since version 4)
//! The program the host starts through the engine (`/.runcell/helper`, no argument) is a
//! *relay*. It makes sure the run's *daemon* is up, connects to it over a Unix socket and
//! copies bytes both ways between its own stdin/stdout and that socket until either side
//! ends. The daemon (the same executable, started by the first relay with
//! [`DAEMON_ARG`], in a session of its own, stdio on `/dev/null`, the relay's environment
//! and working directory) is the helper described in this file: it owns every exec of the
//! run and outlives any one connection, so a command outlives the stream it was started
//! on. Every other rule of this file holds per connection, unchanged.
//! - Where: the directory [`DAEMON_DIR`] beside the executable (normally `/.runcell/d`),
//!   created mode 0700, owned by the helper's user, never followed through a link; a
//!   directory there of another owner or mode is not used. Inside, per build (so that a
//!   relay never talks to a daemon of another build): the socket
//!   `<digest as 16 hex digits>.sock` and a lock file `<digest>.lock`. A relay takes the
//!   lock (`flock`, bounded), connects, and only when that fails (or the process that
//!   listens runs as another user, `SO_PEERCRED`) removes the stale socket, starts a
//!   daemon and waits (bounded) until it listens; then it unlocks. So two relays starting
//!   at once start one daemon. A directory of ours with another mode is made 0700; a
//!   lock file that is not a file of ours is not used.
//! - The daemon accepts only peers of its own uid (or root; `SO_PEERCRED`) that are not
//!   its own descendants (no process of an exec: the daemon and every shepherd are child
//!   subreapers, so an exec's processes stay below the daemon whatever they do; the
//!   relays the engine starts are not), at most [`MAX_CONNECTIONS`] at once, each with a
//!   reader and a writer thread of its own.
//! - Trust: code that runs as the helper's user (root by default, or the image's user)
//!   holds what the helper holds: it can signal, replace or impersonate the helper (kill
//!   the daemon, listen on its socket), and read the pipes of other execs of that user.
//!   The host is bounded whatever it does (it checks every frame and number), but only a
//!   different user keeps one exec's processes, output and stdin from another's: run
//!   untrusted code under an exec `user` that is not the helper's. Execs of other users
//!   reach neither the daemon's directory (0700) nor its socket (0600, `SO_PEERCRED`).
//! - When the daemon cannot be used (the directory is not ours, the file system is
//!   read-only, no socket can be bound), the relay serves its connection itself, as
//!   version 2 did: nothing outlives the stream, and its `HELLO` says so
//!   ([`Hello::durable`] false). When its stdin ends, a relay waits a few seconds at most
//!   for the daemon to end the connection (it first kills what has no grace), then exits.
//! - Exec ids are the daemon's, not the connection's: any connection may `ATTACH`, `KILL`
//!   or `RELEASE` any exec; a `SPAWN` of an id the daemon holds a record of is refused
//!   ([`SpawnError::IdInUse`]; so is one of an exec whose record was forgotten while a
//!   background process of it lives, and one this connection uses for a file operation);
//!   the host then tries another id. A `PUT` or `GET` is refused an id only when this
//!   connection uses it (for a file operation, or an exec attached to it). Since ids are
//!   shared, a frame for an id whose exec is over may reach a later exec of the same id
//!   (another connection's): a host sends nothing for an id after its record is gone
//!   (its `EXIT`, for a non-detached exec; `GONE`).
//! - Every frame of an exec goes to the connection attached to it, except the answers to
//!   a request, which go to the connection that asked: `KILLED` to the one that sent the
//!   `KILL`, a `STDIN_ACK` to the one that sent the data, `ATTACHED`/`GONE` and `EXECS`.
//!   `STARTED` and `SPAWN_ERROR` go to the spawning connection (another that attached
//!   before a spawn failed gets `GONE`). A `CREDIT` counts only from the connection
//!   attached (it grants what that connection was sent); a `DISCARD` from another
//!   connection is ignored.
//!
//! Every exec has a *record* in the daemon: its output (stdout and stderr together, in
//! the order the helper read them, each byte with an *offset* counted from 0), its state
//! and exit status.
//! - The record keeps the last [`Spawn::keep`] output bytes (clamped to [`MIN_KEEP`] to
//!   [`MAX_KEEP`]). While a connection is *attached* to the exec (the one that spawned it,
//!   or the last to `ATTACH` it), output goes out under the credit rule and a byte is
//!   dropped from the record only once it was sent and `keep` newer bytes exist: when the
//!   record is full of bytes not sent yet, the command is blocked on its pipe
//!   (backpressure, as before). While no connection is attached, the helper keeps reading
//!   the command's output and drops the oldest bytes beyond `keep`: the command never
//!   blocks on its output, and what was dropped is reported to the next `ATTACH`.
//! - host `ATTACH` (u64 `from`) → helper [`Attached`], then the exec's output from
//!   `Attached::at` on (under a fresh [`INITIAL_CREDIT`]), then `EXIT` once the command
//!   exited and every byte was sent; or `GONE` (no record of that id: never spawned,
//!   released, or another build's daemon). `from` = `u64::MAX` means "from the end" (no
//!   output, only what comes next and the `EXIT`). A connection that was attached to the
//!   exec gets `DETACHED` and no more frames of that id. The connection attached already
//!   may `ATTACH` again: its output starts over from `at` (what was still queued of it
//!   for that connection is dropped; no `DETACHED`). `STDIN`, `STDIN_EOF`, `RESIZE` and
//!   `KILL` of the exec are taken from any connection. [`Attached::stdin_taken`] counts
//!   the data of every `STDIN` frame the helper took (queued for the command, or
//!   acknowledged and dropped because stdin is not a pipe or had `STDIN_EOF`).
//! - When a connection ends (EOF, a broken stream, a protocol error): its file operations
//!   are abandoned; each exec attached to it is unattached. A detached exec
//!   ([`Spawn::detach`]) runs on. Any other exec still running is killed when
//!   [`Spawn::grace_ms`] passes without an `ATTACH` (as `KILL` does: `SIGTERM`, then
//!   `SIGKILL` after [`KILL_GRACE_MS`]; 0: `SIGKILL` at once, the version 2 rule, before
//!   the helper closes the connection); an exec that already exited keeps its record for
//!   the same time (so that a host that reconnects still gets its `EXIT`), then it is
//!   forgotten; one killed by its grace is forgotten once it exited.
//! - host `RELEASE`: the host is done with the exec: its record is forgotten once the
//!   exec exited (at once if it did; no more frames of it; a later `ATTACH` is `GONE`).
//!   A non-detached exec's record is also forgotten as soon as its `EXIT` went out to the
//!   connection attached (as in version 2: no `RELEASE` is needed), and any record at the
//!   latest when the container goes; a detached exec's record stays after its `EXIT`
//!   until a `RELEASE`. At most [`MAX_RECORDS`] records exist; a `SPAWN` beyond is
//!   refused ([`SpawnError::Resources`]); exited detached records (whose `EXIT` went out,
//!   or that no connection is attached to) are forgotten oldest first to make room for a
//!   new exec.
//! - host `LEAVE` (version 4): the connection stops reading an exec attached to it, as if
//!   the connection had ended for that exec alone: unattached, a detached one runs on,
//!   any other runs on for its grace (none: killed at once) and may be `ATTACH`ed by any
//!   connection meanwhile; no more frames of it come here. From another connection, or
//!   for an unknown id: ignored.
//! - `DISCARD` of a non-detached exec is as before (its output is drained and dropped,
//!   its `EXIT` still sent, then it is forgotten). `DISCARD` of a detached exec only
//!   unattaches it from this connection (its output is kept).
//! - host `LIST` (id: a request id, like a file operation's) → helper `EXECS` (same id):
//!   [`ExecInfo`] of every record, in the order they were made. Should they not fit in
//!   one frame ([`MAX_PAYLOAD`]: the bounds above allow a little more), each record's
//!   `argv` is cut to an equal share of what fits.
//!
//! # Connection
//! - helper `HELLO` (id 0) first: [`Hello`].
//! - host `PING` → helper `PONG`, same id.
//! - When a connection ends or breaks, the rule of "Daemon, relay and durable execs"
//!   applies: with [`Spawn::grace_ms`] 0 (and always when the relay serves the connection
//!   itself, which then exits) the process tree of every exec whose `EXIT` was not sent is
//!   killed at once (SIGKILL): a broken stream leaves no running command behind unless the
//!   host asked for it. Background processes of execs that already ended are left alone,
//!   as after a plain exec (their shepherds stay while they live). A helper that dies
//!   without exiting (killed) kills every exec it owned: a shepherd whose channel ends
//!   before its command's status went out kills the exec's processes at once.
//! - The helper never blocks reading stdin on a write to stdout (one writer thread with a
//!   queue; what it queues is bounded by the credits and windows above): on Kubernetes
//!   one task carries both directions, and a helper that stopped reading could deadlock it.
//!   The one exception bounds a peer that asks and never reads: with more than 64 MiB
//!   unwritten for a connection, the helper takes its next frame (of any kind: a flood of
//!   `PING`s is as bad as one of `LIST`s) only once that connection read some; with more
//!   than 256 MiB unwritten for all connections together, a connection's next frame only
//!   once everything of its own went out. A host that reads its stream only gets there
//!   with that much output in flight, and then waits only for its own reading (its ping
//!   timeout ends a connection that stalls for good, and its execs resume).

use std::fmt;

/// Bumped on any incompatible change; the host refuses a helper of another version.
pub const VERSION: u32 = 6;
/// The argument that starts the helper as the run's daemon (see the module docs).
pub const DAEMON_ARG: &str = "--daemon";
/// The daemon's directory, beside the helper's executable.
pub const DAEMON_DIR: &str = "d";
/// Where the host places the helper (its executable is `helper` in it); skipped by
/// `BASE` and `LAYER`.
pub const HELPER_DIR: &str = "/.runcell";
/// The base listing's file in the daemon's directory (see "Snapshot layers").
pub const BASE_FILE: &str = "base";
/// How far before the `BASE` its T0 is, in seconds: the kernel's change times come from
/// a coarse clock, and the runtime may have written files just before.
pub const BASE_MARGIN_SECS: u64 = 2;
/// The largest base listing, in bytes.
pub const MAX_BASE_BYTES: u64 = 512 << 20;
/// The most names a base listing holds.
pub const MAX_BASE_NAMES: usize = 4 << 20;
/// Connections the daemon serves at once; more are closed at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Exec records the daemon holds at most.
pub const MAX_RECORDS: usize = 1024;
/// Output bytes a record keeps at least ([`Spawn::keep`] is clamped up to it).
pub const MIN_KEEP: u32 = 64 * 1024;
/// Output bytes a record keeps at most.
pub const MAX_KEEP: u32 = 256 << 20;
/// What [`ExecInfo::argv`] keeps of a command: this many arguments, each cut to
/// [`INFO_ARG_BYTES`].
pub const INFO_ARGS: usize = 16;
/// See [`INFO_ARGS`].
pub const INFO_ARG_BYTES: usize = 256;
/// Largest frame payload either side accepts: a `SPAWN` of the largest exec the library
/// validates (argv and env up to 1 MiB each) fits.
pub const MAX_PAYLOAD: usize = 4 << 20;
/// Largest data chunk in one `STDOUT`/`STDERR`/`STDIN` frame.
pub const CHUNK: usize = 64 * 1024;
/// Output bytes (stdout + stderr) of one exec the helper may send before any `CREDIT`.
pub const INITIAL_CREDIT: u32 = 1024 * 1024;
/// The most credit an exec or a `GET` holds, whatever the host grants: four windows (a
/// host never has more than one outstanding; the rest is slack for grants that cross an
/// `ATTACH`).
pub const MAX_CREDIT: u64 = 4 * INITIAL_CREDIT as u64;
/// The most multiply-linked files one `GET` remembers to send their other names as
/// [`HARDLINK`]s (then copies).
pub const MAX_GET_LINKS: usize = 65_536;
/// The deepest a walk (`GET`, `BASE`, `LAYER`) goes below its start, in directory
/// levels: it holds a descriptor per level, so a deeper tree is a `FILE_ERROR` naming
/// the directory (its path's first 4096 bytes) rather than a daemon out of descriptors.
pub const MAX_WALK_DEPTH: usize = 4096;
/// The most `GET`s one connection runs at once (a host runs fewer: each takes a thread).
pub const MAX_GETS: usize = 128;
/// A `PUT` leaves each whole block of zeros this large, aligned in the file, as a hole.
pub const HOLE_BLOCK: u64 = 4096;
/// Unacknowledged stdin bytes of one exec the host may have in flight.
pub const STDIN_WINDOW: u32 = 1024 * 1024;
/// Time between SIGTERM and SIGKILL in a kill.
pub const KILL_GRACE_MS: u64 = 1000;

// Frame kinds, host → helper.
/// [`Spawn`].
pub const SPAWN: u8 = 1;
/// Data for an exec's stdin or a `PUT`'s file contents.
pub const STDIN: u8 = 2;
/// End of an exec's stdin, or of a `PUT`.
pub const STDIN_EOF: u8 = 3;
/// u32: more output bytes the helper may send for this id.
pub const CREDIT: u8 = 4;
/// Kill the exec's process tree.
pub const KILL: u8 = 5;
/// Answered by `PONG`.
pub const PING: u8 = 6;
/// Start a file upload: the directory (absolute path, byte string).
pub const PUT: u8 = 7;
/// Start a file download: the path (absolute, byte string).
pub const GET: u8 = 8;
/// u32 rows + u32 columns (each 1 to 65535): the new size of a terminal exec's terminal (the kernel then
/// signals `SIGWINCH` to its foreground process group); ignored for other execs.
pub const RESIZE: u8 = 10;
/// The host reads no more output of this id (its reader is gone): the helper stops
/// sending `STDOUT`/`STDERR`/`ENTRY` for it, keeps draining an exec's pipes (dropping the
/// data, so the process is never blocked on them) and still sends its `EXIT`; a `GET` is
/// abandoned (its file closed) with no further frame. A detached exec is only unattached
/// from this connection (its output is kept). `KILL` implies it.
pub const DISCARD: u8 = 9;
/// u64 `from`: attach this connection to the exec, its output from offset `from` on.
pub const ATTACH: u8 = 11;
/// The host is done with the exec: forget its record once it exited.
pub const RELEASE: u8 = 12;
/// List every exec record (answered by `EXECS`, same id).
pub const LIST: u8 = 13;
/// The connection stops reading an exec attached to it as if it had ended (version 4).
pub const LEAVE: u8 = 14;
/// Record the run's base listing (empty payload; version 6, "Snapshot layers").
pub const BASE: u8 = 15;
/// Stream what changed in the root filesystem since the base listing: the workspace
/// (absolute path, or empty for none; version 6, "Snapshot layers").
pub const LAYER: u8 = 16;

// Frame kinds, helper → host.
/// [`Hello`], id 0, the helper's first frame.
pub const HELLO: u8 = 64;
/// u32: the pid of the exec's root process.
pub const STARTED: u8 = 65;
/// [`SpawnError`] kind u8 + message.
pub const SPAWN_ERROR: u8 = 66;
/// Output data.
pub const STDOUT: u8 = 67;
/// Output data.
pub const STDERR: u8 = 68;
/// kind u8 ([`EXITED`] / [`SIGNALED`]) + i32.
pub const EXIT: u8 = 69;
/// u32: stdin bytes written (or dropped).
pub const STDIN_ACK: u8 = 70;
/// The kill of this exec is done.
pub const KILLED: u8 = 71;
/// Answer to `PING`.
pub const PONG: u8 = 72;
/// A `PUT`, `GET`, `BASE` or `LAYER` ended well.
pub const DONE: u8 = 73;
/// [`FileError`] kind u8 + relative path + message.
pub const FILE_ERROR: u8 = 74;
/// (both ways) [`Entry`] of a `PUT` or `GET`.
pub const ENTRY: u8 = 75;
/// A frame the helper could not decode: message. The helper ends the connection after
/// sending it.
pub const PROTOCOL_ERROR: u8 = 76;
/// [`Attached`]: the answer to `ATTACH`.
pub const ATTACHED: u8 = 77;
/// No record of this id (the answer to `ATTACH` of an unknown exec).
pub const GONE: u8 = 78;
/// Another connection attached to this exec: no more frames of it come here.
pub const DETACHED: u8 = 79;
/// The answer to `LIST`: u32 count + [`ExecInfo`] each.
pub const EXECS: u8 = 80;

/// `EXIT` kind: exited with the code.
pub const EXITED: u8 = 0;
/// `EXIT` kind: killed by the signal.
pub const SIGNALED: u8 = 1;

/// Why a `SPAWN` failed (`SPAWN_ERROR`'s kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpawnError {
    /// The program does not exist (or is not on `PATH`).
    NotFound = 1,
    /// The program exists but cannot be executed (permissions, format).
    NotExecutable = 2,
    /// The working directory does not exist or is not a directory.
    WorkingDirMissing = 3,
    /// The working directory exists but cannot be entered.
    WorkingDirDenied = 4,
    /// The user (or group) is not in the image's `/etc/passwd` (`/etc/group`).
    UnknownUser = 5,
    /// The helper may not switch to the user (it does not run as root).
    UserDenied = 6,
    /// The kernel refused a process (EAGAIN / ENOMEM: a pids or memory limit).
    Resources = 7,
    /// Anything else.
    Other = 8,
    /// The daemon holds a record of this id (another process's exec): try another id.
    IdInUse = 9,
}

impl SpawnError {
    /// From the wire.
    pub fn from_u8(v: u8) -> SpawnError {
        match v {
            1 => SpawnError::NotFound,
            2 => SpawnError::NotExecutable,
            3 => SpawnError::WorkingDirMissing,
            4 => SpawnError::WorkingDirDenied,
            5 => SpawnError::UnknownUser,
            6 => SpawnError::UserDenied,
            7 => SpawnError::Resources,
            9 => SpawnError::IdInUse,
            _ => SpawnError::Other,
        }
    }
}

/// Why a `PUT` or `GET` failed (`FILE_ERROR`'s kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileError {
    /// The path (or a parent directory) does not exist.
    NotFound = 1,
    /// A directory is where a non-directory goes, or the reverse.
    IsDir = 2,
    /// A non-directory is where a directory goes (or a parent is not a directory).
    NotDir = 3,
    /// Permission denied.
    Denied = 4,
    /// A malformed entry (absolute or `..` path, unknown type, short data).
    Invalid = 5,
    /// Anything else (disk full, ...).
    Other = 6,
    /// The path crosses a symbolic link in a directory that users other than root (or
    /// the helper's own user) can change: not followed, since such a user could have
    /// planted or swapped it.
    Untrusted = 7,
}

impl FileError {
    /// From the wire.
    pub fn from_u8(v: u8) -> FileError {
        match v {
            1 => FileError::NotFound,
            2 => FileError::IsDir,
            3 => FileError::NotDir,
            4 => FileError::Denied,
            5 => FileError::Invalid,
            7 => FileError::Untrusted,
            _ => FileError::Other,
        }
    }
}

/// The helper's first frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// [`VERSION`].
    pub version: u32,
    /// The helper's pid (in the target's pid namespace).
    pub pid: u32,
    /// The helper's real uid and gid: a per-exec user needs uid 0.
    pub uid: u32,
    /// See `uid`.
    pub gid: u32,
    /// Size and FNV-1a 64 digest of the helper's own executable (`/proc/self/exe`), so the
    /// host knows the upload is complete and current.
    pub size: u64,
    /// See `size`.
    pub digest: u64,
    /// The pid of the relay this connection came through (0: none, the relay serves it).
    pub relay: u32,
    /// True: the daemon serves this connection, execs outlive it (see the module docs).
    pub durable: bool,
}

impl Hello {
    /// Encodes the payload.
    pub fn encode(&self, e: &mut Enc) {
        e.u32(self.version)
            .u32(self.pid)
            .u32(self.uid)
            .u32(self.gid)
            .u64(self.size)
            .u64(self.digest)
            .u32(self.relay)
            .u8(self.durable as u8);
    }

    /// Decodes the payload.
    pub fn decode(d: &mut Dec<'_>) -> Result<Hello, DecodeError> {
        Ok(Hello {
            version: d.u32()?,
            pid: d.u32()?,
            uid: d.u32()?,
            gid: d.u32()?,
            size: d.u64()?,
            digest: d.u64()?,
            relay: d.u32()?,
            durable: d.u8()? != 0,
        })
    }
}

/// A `SPAWN` payload.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Spawn {
    /// Program and arguments; the program is looked up on `PATH` (of the exec's env) when
    /// it has no `/`.
    pub argv: Vec<Vec<u8>>,
    /// Variables set on top of the helper's own environment (the run's); later wins.
    pub env: Vec<(Vec<u8>, Vec<u8>)>,
    /// The working directory; `None`: the helper's (the run's).
    pub working_dir: Option<Vec<u8>>,
    /// `name`, `uid`, `name:group` or `uid:gid`; `None`: the helper's own user. Names are
    /// resolved from the image's `/etc/passwd` and `/etc/group`; supplementary groups are
    /// set from `/etc/group`; `HOME` is set to the user's home unless `env` sets it.
    pub user: Option<Vec<u8>>,
    /// True: stdin is a pipe fed by `STDIN` frames; false: `/dev/null`.
    pub stdin_piped: bool,
    /// Rows and columns: the command gets a new pseudo-terminal of this size as its
    /// stdin, stdout and stderr and as the controlling terminal of a session it leads;
    /// its output (one stream) comes as `STDOUT`, `STDIN` frames are typed into it
    /// (Ctrl-C, `\x03`, interrupts its foreground process group) and `STDIN_EOF` is not
    /// an end of input (a terminal has none: type `\x04`).
    pub tty: Option<(u16, u16)>,
    /// Runs on when every connection is gone, until it exits, a `KILL`, or the
    /// container's end (see the module docs).
    pub detach: bool,
    /// Output bytes its record keeps (clamped to [`MIN_KEEP`]..=[`MAX_KEEP`]).
    pub keep: u32,
    /// How long a non-detached exec outlives the end of the connection it is attached
    /// to (and an exited one keeps its record), in milliseconds; 0: killed at once.
    pub grace_ms: u32,
}

impl Spawn {
    /// Encodes the payload.
    pub fn encode(&self, e: &mut Enc) {
        e.list(&self.argv);
        e.u32(self.env.len() as u32);
        for (k, v) in &self.env {
            e.bytes(k).bytes(v);
        }
        e.opt(self.working_dir.as_deref())
            .opt(self.user.as_deref())
            .u8(self.stdin_piped as u8);
        match self.tty {
            Some((rows, cols)) => e.u8(1).u32(rows.into()).u32(cols.into()),
            None => e.u8(0),
        };
        e.u8(self.detach as u8).u32(self.keep).u32(self.grace_ms);
    }

    /// Decodes the payload.
    pub fn decode(d: &mut Dec<'_>) -> Result<Spawn, DecodeError> {
        let argv = d.list()?;
        let n = d.u32()? as usize;
        let mut env = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            env.push((d.bytes()?.to_vec(), d.bytes()?.to_vec()));
        }
        Ok(Spawn {
            argv,
            env,
            working_dir: d.opt()?,
            user: d.opt()?,
            stdin_piped: d.u8()? != 0,
            tty: match d.u8()? {
                0 => None,
                _ => Some((size(d.u32()?)?, size(d.u32()?)?)),
            },
            detach: d.u8()? != 0,
            keep: d.u32()?,
            grace_ms: d.u32()?,
        })
    }
}

/// The answer to `ATTACH`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Attached {
    /// Offset of the first output byte that follows: `from`, or the oldest byte the
    /// record still has when `from` is older (the bytes between were dropped while no
    /// connection was attached), or the end when `from` is past it (or `u64::MAX`).
    pub at: u64,
    /// Output bytes the exec produced so far (the record's end offset).
    pub end: u64,
    /// The command's pid.
    pub pid: u32,
    /// Stdin bytes the helper took for this exec so far (written or queued, or
    /// acknowledged and dropped), so that a host that reconnects sends only what follows.
    pub stdin_taken: u64,
    /// Its stdin is a pipe that has not had `STDIN_EOF`.
    pub stdin_open: bool,
    /// It runs on a terminal.
    pub tty: bool,
    /// It was spawned detached.
    pub detach: bool,
}

impl Attached {
    /// Encodes the payload.
    pub fn encode(&self, e: &mut Enc) {
        e.u64(self.at)
            .u64(self.end)
            .u32(self.pid)
            .u64(self.stdin_taken)
            .u8(self.stdin_open as u8)
            .u8(self.tty as u8)
            .u8(self.detach as u8);
    }

    /// Decodes the payload.
    pub fn decode(d: &mut Dec<'_>) -> Result<Attached, DecodeError> {
        Ok(Attached {
            at: d.u64()?,
            end: d.u64()?,
            pid: d.u32()?,
            stdin_taken: d.u64()?,
            stdin_open: d.u8()? != 0,
            tty: d.u8()? != 0,
            detach: d.u8()? != 0,
        })
    }
}

/// One exec record, as `EXECS` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExecInfo {
    /// Its id.
    pub id: u32,
    /// The command's pid (0 while starting).
    pub pid: u32,
    /// The command (at most [`INFO_ARGS`] arguments of at most [`INFO_ARG_BYTES`] each).
    pub argv: Vec<Vec<u8>>,
    /// Spawned detached.
    pub detach: bool,
    /// A connection is attached to it.
    pub attached: bool,
    /// Once the command exited: `EXIT`'s kind ([`EXITED`] / [`SIGNALED`]) and value.
    pub exit: Option<(u8, i32)>,
    /// Output bytes produced so far (the record's end offset).
    pub end: u64,
    /// Offset of the oldest output byte the record still has.
    pub kept_from: u64,
    /// When it started, milliseconds since the epoch.
    pub started_ms: u64,
}

impl ExecInfo {
    /// Encodes one item.
    pub fn encode(&self, e: &mut Enc) {
        e.u32(self.id).u32(self.pid).list(&self.argv);
        e.u8(self.detach as u8).u8(self.attached as u8);
        match self.exit {
            Some((kind, value)) => e.u8(1).u8(kind).u32(value as u32),
            None => e.u8(0),
        };
        e.u64(self.end).u64(self.kept_from).u64(self.started_ms);
    }

    /// Decodes one item.
    pub fn decode(d: &mut Dec<'_>) -> Result<ExecInfo, DecodeError> {
        Ok(ExecInfo {
            id: d.u32()?,
            pid: d.u32()?,
            argv: d.list()?,
            detach: d.u8()? != 0,
            attached: d.u8()? != 0,
            exit: match d.u8()? {
                0 => None,
                _ => Some((d.u8()?, d.i32()?)),
            },
            end: d.u64()?,
            kept_from: d.u64()?,
            started_ms: d.u64()?,
        })
    }
}

/// A terminal dimension from the wire: 1 to 65535.
pub fn size(v: u32) -> Result<u16, DecodeError> {
    u16::try_from(v).ok().filter(|v| *v > 0).ok_or(DecodeError)
}

/// `ENTRY` types.
pub const REGULAR: u8 = 0;
/// A directory.
pub const DIRECTORY: u8 = 1;
/// A symbolic link (`link` is its target).
pub const SYMLINK: u8 = 2;
/// (Since version 5) A hard link to a regular file of the same operation (`link` is that
/// file's path in it, relative like `path`): in a `PUT`, one it wrote; in a `GET`, one it
/// sent marked [`LINK_TARGET`].
pub const HARDLINK: u8 = 3;
/// (Since version 5) A named pipe (no data).
pub const FIFO: u8 = 4;
/// (Since version 5) In a `GET`'s [`REGULAR`] entry's `mode`: a later [`HARDLINK`] may
/// name this file (the host accepts a hard link only to such an entry sent before it).
pub const LINK_TARGET: u32 = 1 << 16;

/// One file-system entry of a `PUT` or `GET`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Entry {
    /// Relative, `/`-separated, no `.`/`..`/empty components (a `GET`'s first entry is
    /// the base name of the path asked for).
    pub path: Vec<u8>,
    /// [`REGULAR`], [`DIRECTORY`], [`SYMLINK`], [`HARDLINK`] or [`FIFO`].
    pub kind: u8,
    /// Permission bits (0o7777); a `GET` may add [`LINK_TARGET`].
    pub mode: u32,
    /// Owner; applied by a `PUT` only when the helper runs as root.
    pub uid: u32,
    /// See `uid`.
    pub gid: u32,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// For a regular file: the number of data bytes that follow.
    pub size: u64,
    /// For a symlink: its target; for a hard link: the path of the file it links to.
    pub link: Vec<u8>,
}

impl Entry {
    /// Encodes the payload.
    pub fn encode(&self, e: &mut Enc) {
        e.bytes(&self.path)
            .u8(self.kind)
            .u32(self.mode)
            .u32(self.uid)
            .u32(self.gid)
            .u64(self.mtime as u64)
            .u64(self.size)
            .bytes(&self.link);
    }

    /// Decodes the payload.
    pub fn decode(d: &mut Dec<'_>) -> Result<Entry, DecodeError> {
        Ok(Entry {
            path: d.bytes()?.to_vec(),
            kind: d.u8()?,
            mode: d.u32()?,
            uid: d.u32()?,
            gid: d.u32()?,
            mtime: d.u64()? as i64,
            size: d.u64()?,
            link: d.bytes()?.to_vec(),
        })
    }
}

/// A payload that ended early or carried an impossible length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError;

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("malformed frame payload")
    }
}

/// Builds one frame.
#[derive(Debug, Default)]
pub struct Enc {
    buf: Vec<u8>,
}

impl Enc {
    /// A frame of `kind` for `id`; add the payload, then [`Enc::finish`].
    pub fn frame(kind: u8, id: u32) -> Enc {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&[0; 4]);
        buf.push(kind);
        buf.extend_from_slice(&id.to_le_bytes());
        Enc { buf }
    }

    /// Appends a byte.
    pub fn u8(&mut self, v: u8) -> &mut Enc {
        self.buf.push(v);
        self
    }

    /// Appends a u32.
    pub fn u32(&mut self, v: u32) -> &mut Enc {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a u64.
    pub fn u64(&mut self, v: u64) -> &mut Enc {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a length-prefixed byte string.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Enc {
        self.u32(v.len() as u32);
        self.buf.extend_from_slice(v);
        self
    }

    /// Appends raw bytes (a data frame's payload).
    pub fn raw(&mut self, v: &[u8]) -> &mut Enc {
        self.buf.extend_from_slice(v);
        self
    }

    /// Appends a list of byte strings.
    pub fn list<T: AsRef<[u8]>>(&mut self, items: &[T]) -> &mut Enc {
        self.u32(items.len() as u32);
        for i in items {
            self.bytes(i.as_ref());
        }
        self
    }

    /// Appends an optional byte string.
    pub fn opt(&mut self, v: Option<&[u8]>) -> &mut Enc {
        match v {
            Some(v) => self.u8(1).bytes(v),
            None => self.u8(0),
        }
    }

    /// The frame's bytes, length filled in.
    pub fn finish(mut self) -> Vec<u8> {
        let len = (self.buf.len() - 4) as u32;
        self.buf[..4].copy_from_slice(&len.to_le_bytes());
        self.buf
    }
}

/// Reads a frame's payload.
#[derive(Debug)]
pub struct Dec<'a> {
    buf: &'a [u8],
}

impl<'a> Dec<'a> {
    /// Over a payload.
    pub fn new(buf: &'a [u8]) -> Dec<'a> {
        Dec { buf }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError);
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// A byte.
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    /// A u32.
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }

    /// An i32.
    pub fn i32(&mut self) -> Result<i32, DecodeError> {
        Ok(self.u32()? as i32)
    }

    /// A u64.
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }

    /// A length-prefixed byte string.
    pub fn bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    /// A list of byte strings.
    pub fn list(&mut self) -> Result<Vec<Vec<u8>>, DecodeError> {
        let n = self.u32()? as usize;
        if n > self.buf.len() / 4 {
            return Err(DecodeError);
        }
        (0..n).map(|_| self.bytes().map(<[u8]>::to_vec)).collect()
    }

    /// An optional byte string.
    pub fn opt(&mut self) -> Result<Option<Vec<u8>>, DecodeError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.bytes()?.to_vec())),
            _ => Err(DecodeError),
        }
    }

    /// What is left (a data frame's payload).
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
}

/// One frame split off a buffer: kind, id, payload, and the frame's whole length.
pub type Split<'a> = (u8, u32, &'a [u8], usize);

/// Splits one frame off the front of `buf`: `(kind, id, payload, frame length)`, `None`
/// while `buf` holds less than a whole frame; `Err` for a length over [`MAX_PAYLOAD`]
/// or under the header.
pub fn split_frame(buf: &[u8]) -> Result<Option<Split<'_>>, DecodeError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
    if !(5..=MAX_PAYLOAD + 5).contains(&len) {
        return Err(DecodeError);
    }
    if buf.len() < 4 + len {
        return Ok(None);
    }
    let kind = buf[4];
    let id = u32::from_le_bytes(buf[5..9].try_into().unwrap());
    Ok(Some((kind, id, &buf[9..4 + len], 4 + len)))
}

/// FNV-1a, 64 bits: the helper's self-check of its upload (size and digest of its own
/// executable). Not a security measure: the helper runs inside the sandbox, which could
/// lie about anything; it catches truncated or stale uploads.
#[derive(Debug, Clone, Copy)]
pub struct Fnv(pub u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    /// Adds bytes.
    pub fn update(&mut self, data: &[u8]) {
        for b in data {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}
