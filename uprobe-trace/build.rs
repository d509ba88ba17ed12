//! Declares the family's `pcpu_force_generic` cfg (see `pcpu`): with it,
//! uprobe-core has no engine, and the agent is not built.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(pcpu_force_generic)");
}
