//! Builds the liburcu peer of `srcu-read` (the `urcu-memb` row) where
//! Debian's `liburcu-dev` (or another install of liburcu 0.13+) is
//! present; elsewhere that row is skipped with the reason.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(has_liburcu)");
    println!("cargo::rerun-if-changed=src/scenarios/urcu_memb.c");
    // Debian puts it under the multiarch directory.
    let multiarch = format!(
        "/usr/include/{}-linux-gnu/urcu/urcu-memb.h",
        std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default()
    );
    let header = [
        "/usr/include/urcu/urcu-memb.h",
        "/usr/local/include/urcu/urcu-memb.h",
        &multiarch,
    ]
    .into_iter()
    .any(|h| std::path::Path::new(h).exists());
    // Only for the machine's own architecture (a cross build has no
    // liburcu of the target's).
    let native = std::env::var("HOST").ok() == std::env::var("TARGET").ok();
    if !header || !native {
        return;
    }
    cc::Build::new()
        .file("src/scenarios/urcu_memb.c")
        .opt_level(2)
        // The bench is an executable: liburcu's globals and thread-local
        // reader word are reached the way a C program reaches them (as
        // PIE code: a `-fPIC` object would go through the GOT for each,
        // and call `__tls_get_addr` on every lock and unlock).
        .pic(false)
        .flag("-fPIE")
        .compile("kscale_urcu_memb");
    println!("cargo::rustc-link-lib=urcu-memb");
    println!("cargo::rustc-cfg=has_liburcu");
}
