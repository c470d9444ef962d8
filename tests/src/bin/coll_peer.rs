//! Test helper: the collectives scenarios of `collectives/src/bin/coll-scenario.rs`
//! (included as they are), for the two-namespace test in this crate.

#[path = "../../../collectives/src/bin/coll-scenario.rs"]
#[allow(dead_code, unreachable_pub)]
mod scenario;

fn main() {
    scenario::main()
}
