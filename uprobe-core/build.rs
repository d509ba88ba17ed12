//! Chooses the engine the crate builds: `uprobe_arch` is `"x86_64"` or
//! `"aarch64"` where there is one (and `uprobe_engine` is set), `"generic"`
//! elsewhere (the error type only). `--cfg pcpu_force_generic` (the family's switch, see `pcpu`)
//! selects the generic build on any target, so CI can build it on x86-64.

fn main() {
    println!(
        "cargo::rustc-check-cfg=cfg(uprobe_arch, values(\"x86_64\", \"aarch64\", \"generic\"))"
    );
    println!("cargo::rustc-check-cfg=cfg(pcpu_force_generic)");
    println!("cargo::rustc-check-cfg=cfg(uprobe_engine)");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let forced = std::env::var_os("CARGO_CFG_PCPU_FORCE_GENERIC").is_some();
    let paths = match arch.as_str() {
        "x86_64" | "aarch64" if !forced => arch.as_str(),
        _ => "generic",
    };
    println!("cargo::rustc-cfg=uprobe_arch=\"{paths}\"");
    if paths != "generic" {
        // The probe engine is built (x86-64 or aarch64).
        println!("cargo::rustc-cfg=uprobe_engine");
    }
}
