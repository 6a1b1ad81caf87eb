//! Unpublished home of the benchmark (the `bench` binary, run by `cargo xtask bench`) and
//! of the README's Rust examples, compiled here as doctests (`cargo test --doc -p
//! runcell-bench`) so that they cannot rot and the published crates carry neither.

/// The README's Rust examples, compiled as doctests (with the drivers as dependencies)
/// so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
