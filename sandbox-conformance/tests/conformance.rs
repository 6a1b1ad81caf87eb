//! The conformance suite against our own drivers: `SANDBOX_TEST=docker cargo test -p
//! sandbox-conformance --test conformance` (or `cargo xtask conformance`).

use sandbox_docker as _;
use sandbox_k8s as _;

fn main() {
    sandbox_conformance::harness::main()
}
