//! What a create is doing, on stderr: a bar per image layer on a terminal, plain lines
//! otherwise (a log, CI, a pipe).

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use runcell_core::{CreateOptions, Progress};

use crate::units::human_bytes;

/// How often a plain line repeats a layer's byte count while its status stays the same.
const PLAIN_EVERY: Duration = Duration::from_secs(1);

enum Mode {
    Quiet,
    Plain {
        /// Per layer: the status last printed and when.
        last: HashMap<String, (String, Instant)>,
    },
    Bars {
        multi: MultiProgress,
        bars: HashMap<String, ProgressBar>,
    },
}

/// The progress display of one create.
#[derive(Clone)]
pub struct View {
    mode: Arc<Mutex<Mode>>,
}

impl View {
    /// Bars when stderr is a terminal, lines otherwise, nothing when `quiet`.
    pub fn new(quiet: bool) -> View {
        let mode = if quiet {
            Mode::Quiet
        } else if std::io::stderr().is_terminal() {
            Mode::Bars {
                multi: MultiProgress::with_draw_target(ProgressDrawTarget::stderr()),
                bars: HashMap::new(),
            }
        } else {
            Mode::Plain {
                last: HashMap::new(),
            }
        };
        View {
            mode: Arc::new(Mutex::new(mode)),
        }
    }

    /// Create options reporting to this view.
    pub fn options(&self) -> CreateOptions {
        let view = self.clone();
        CreateOptions::default().progress(move |event| view.show(event))
    }

    fn show(&self, event: Progress) {
        let mut mode = self.mode.lock().unwrap_or_else(|p| p.into_inner());
        match &mut *mode {
            Mode::Quiet => {}
            Mode::Plain { last } => plain(last, event),
            Mode::Bars { multi, bars } => bar(multi, bars, event),
        }
    }

    /// The create is over: the bars stay on screen as they ended.
    pub fn finish(&self) {
        let mut mode = self.mode.lock().unwrap_or_else(|p| p.into_inner());
        if let Mode::Bars { bars, .. } = &mut *mode {
            for bar in bars.values() {
                if !bar.is_finished() {
                    bar.abandon();
                }
            }
            bars.clear();
        }
    }
}

fn short(layer: &str) -> &str {
    &layer[..layer.len().min(12)]
}

fn bytes(current: Option<u64>, total: Option<u64>) -> String {
    match (current, total) {
        (Some(c), Some(t)) if t > 0 => format!(" {}/{}", human_bytes(c), human_bytes(t)),
        (Some(c), _) => format!(" {}", human_bytes(c)),
        _ => String::new(),
    }
}

fn plain(last: &mut HashMap<String, (String, Instant)>, event: Progress) {
    match event {
        Progress::Pull {
            image,
            layer,
            status,
            current,
            total,
        } => {
            if layer.is_empty() || status.starts_with("Pulling from") {
                eprintln!("pull {image}: {status}");
                return;
            }
            let now = Instant::now();
            let due = match last.get(&layer) {
                Some((s, at)) => *s != status || now.duration_since(*at) >= PLAIN_EVERY,
                None => true,
            };
            if due {
                eprintln!(
                    "pull {image}: layer {}: {status}{}",
                    short(&layer),
                    bytes(current, total)
                );
                last.insert(layer, (status, now));
            }
        }
        other => eprintln!("{other}"),
    }
}

fn bar(multi: &MultiProgress, bars: &mut HashMap<String, ProgressBar>, event: Progress) {
    match event {
        Progress::Pull {
            image,
            layer,
            status,
            current,
            total,
        } => {
            if layer.is_empty() || status.starts_with("Pulling from") {
                let _ = multi.println(format!("pull {image}: {status}"));
                return;
            }
            let bar = bars.entry(layer.clone()).or_insert_with(|| {
                let bar = multi.add(ProgressBar::new(0));
                bar.set_style(
                    ProgressStyle::with_template(
                        "{prefix:12} {msg:18} [{bar:30}] {bytes:>10}/{total_bytes:10}",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
                );
                bar.set_prefix(short(&layer).to_string());
                bar
            });
            if let Some(t) = total {
                bar.set_length(t);
            }
            if let Some(c) = current {
                bar.set_position(c);
            }
            let done = matches!(status.as_str(), "Pull complete" | "Already exists");
            bar.set_message(status);
            if done {
                if let Some(len) = bar.length() {
                    bar.set_position(len);
                }
                bar.finish();
            }
        }
        other => {
            let _ = multi.println(other.to_string());
        }
    }
}
