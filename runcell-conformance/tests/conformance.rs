//! The conformance suite against our own drivers: `RUNCELL_TEST=docker cargo test -p
//! runcell-conformance --test conformance` (or `cargo xtask conformance`).

use runcell_docker as _;
use runcell_k8s as _;

fn main() {
    runcell_conformance::harness::main()
}
