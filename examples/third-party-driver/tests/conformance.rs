//! The shared suite on this third-party driver:
//! `RUNCELL_TEST=audit cargo test -p sandbox-driver-audit --test conformance`.

use sandbox_driver_audit as _;

fn main() {
    runcell_conformance::harness::main()
}
