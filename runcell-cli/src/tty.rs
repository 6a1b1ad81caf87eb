//! This process's terminal: its size, and raw mode for `sandbox exec -it` (every key
//! goes to the command's terminal in the run; restored when the guard drops, on every
//! way out of the command, errors included).

use std::io::IsTerminal;

use rustix::termios::{OptionalActions, Termios, tcgetattr, tcgetwinsize, tcsetattr};

/// The terminal's size (rows, columns), read from stdout, else stdin; `None` when
/// neither is a terminal.
pub fn size() -> Option<(u16, u16)> {
    let of = |fd: rustix::fd::BorrowedFd<'_>| {
        tcgetwinsize(fd)
            .ok()
            .filter(|w| w.ws_row > 0 && w.ws_col > 0)
            .map(|w| (w.ws_row, w.ws_col))
    };
    let (stdout, stdin) = (std::io::stdout(), std::io::stdin());
    (stdout
        .is_terminal()
        .then(|| of(rustix::stdio::stdout()))
        .flatten())
    .or_else(|| {
        stdin
            .is_terminal()
            .then(|| of(rustix::stdio::stdin()))
            .flatten()
    })
}

/// Stdin's terminal in raw mode until dropped.
pub struct RawMode {
    saved: Termios,
}

impl RawMode {
    /// Puts stdin's terminal in raw mode; `None` when stdin is not a terminal.
    pub fn enter() -> std::io::Result<Option<RawMode>> {
        if !std::io::stdin().is_terminal() {
            return Ok(None);
        }
        let stdin = rustix::stdio::stdin();
        let saved = tcgetattr(stdin)?;
        let mut raw = saved.clone();
        raw.make_raw();
        tcsetattr(stdin, OptionalActions::Now, &raw)?;
        Ok(Some(RawMode { saved }))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = tcsetattr(rustix::stdio::stdin(), OptionalActions::Now, &self.saved);
    }
}
