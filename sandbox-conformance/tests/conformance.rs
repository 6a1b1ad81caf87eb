//! The conformance suite against our own drivers: `SANDBOX_TEST=docker cargo test -p
//! sandbox-conformance --test conformance` (or `cargo xtask conformance`).

use runcell_docker as _;
use runcell_k8s as _;

fn main() {
    runcell_conformance::harness::main()
}
