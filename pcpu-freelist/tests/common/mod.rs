//! What the pool and stress tests share.

use pcpu_freelist::EmptyHint;

/// Every hint; under Miri (which runs these tests with many seeds) the
/// patch's flags alone are left out: they are the summary's flags, walked
/// one by one.
pub const HINTS: &[EmptyHint] = if cfg!(miri) {
    &[EmptyHint::Summary, EmptyHint::Head, EmptyHint::None]
} else {
    &[
        EmptyHint::Summary,
        EmptyHint::Flag,
        EmptyHint::Head,
        EmptyHint::None,
    ]
};
