//! Chooses the architecture paths the crate builds: `pcpu_arch` is
//! `"x86_64"` or `"aarch64"` where this crate has code for the target's
//! thread pointer and rseq sections, `"generic"` elsewhere (atomics and
//! `sched_getcpu` instead of rseq). `--cfg pcpu_force_generic` selects the
//! generic paths on any target, so CI can build and test them on x86-64.
//! So does Miri (`CARGO_CFG_MIRI`), which runs neither inline assembly nor
//! rseq.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(pcpu_arch, values(\"x86_64\", \"aarch64\", \"generic\"))");
    println!("cargo::rustc-check-cfg=cfg(pcpu_force_generic)");
    // ThreadSanitizer builds: fences modelled as it can see them
    // (`unstable::sync::atomic::fence`).
    println!("cargo::rustc-check-cfg=cfg(pcpu_tsan)");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let forced = std::env::var_os("CARGO_CFG_PCPU_FORCE_GENERIC").is_some()
        || std::env::var_os("CARGO_CFG_MIRI").is_some();
    let paths = match arch.as_str() {
        "x86_64" | "aarch64" if !forced => arch.as_str(),
        _ => "generic",
    };
    println!("cargo::rustc-cfg=pcpu_arch=\"{paths}\"");
}
