//! The probe table's read side: SRCU by default, with the alternatives
//! selectable for benchmarks.
//!
//! In 2024 the kernel moved its uprobe lookup lock to a per-CPU RW
//! semaphore; the kernel later moved to a lockless lookup. This engine
//! reads its table inside an SRCU read section (per-CPU counts, never
//! parks), and keeps `percpu-rwsem` and a plain `std::sync::RwLock` as
//! [`testing::set_lookup`](crate::testing::set_lookup) choices so the
//! `bench` binary can measure all three on the trap path. Under a lock,
//! attach and detach mutate the table and free what they unpublished with
//! the write side held (no grace period); under SRCU they wait one grace
//! period before freeing.

#[cfg(feature = "bench-variants")]
use std::sync::atomic::{AtomicU8, Ordering};

#[cfg(feature = "bench-variants")]
use percpu_rwsem::PercpuRwSem;

use super::DOMAIN;
use crate::base::thread::{set_writing, writing};

/// How the trap handler protects its table lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// An SRCU read section (the default): no lock, never parks.
    Srcu,
    /// The read side of a `percpu-rwsem` (the kernel's 2024 patch): per-CPU, but a
    /// reader waits while attach/detach write.
    #[cfg_attr(not(feature = "bench-variants"), allow(dead_code))]
    PercpuRwsem,
    /// `std::sync::RwLock::read`: one shared word; a reader waits while
    /// attach/detach write.
    #[cfg_attr(not(feature = "bench-variants"), allow(dead_code))]
    RwLock,
}

/// The switch (benchmark builds only: without the `bench-variants`
/// feature the lookup is SRCU, a constant).
#[cfg(feature = "bench-variants")]
static MODE: AtomicU8 = AtomicU8::new(0);
#[cfg(feature = "bench-variants")]
static RWSEM: PercpuRwSem<()> = PercpuRwSem::new(());
#[cfg(feature = "bench-variants")]
static RWLOCK: std::sync::RwLock<()> = std::sync::RwLock::new(());

#[cfg(not(feature = "bench-variants"))]
pub(crate) fn mode() -> Lookup {
    Lookup::Srcu
}

#[cfg(feature = "bench-variants")]
pub(crate) fn mode() -> Lookup {
    match MODE.load(Ordering::Relaxed) {
        1 => Lookup::PercpuRwsem,
        2 => Lookup::RwLock,
        _ => Lookup::Srcu,
    }
}

#[cfg(feature = "bench-variants")]
pub(crate) fn set_mode(m: Lookup) {
    MODE.store(
        match m {
            Lookup::Srcu => 0,
            Lookup::PercpuRwsem => 1,
            Lookup::RwLock => 2,
        },
        Ordering::Relaxed,
    );
}

/// Runs the handler's lookup-and-hit `f` under the read side. The
/// common case (SRCU, no attach of our own in progress) is the only one
/// inlined, so that `f` inlines there once: a hit through a jump pays for
/// every register a call has to save.
#[inline]
pub(crate) fn with_read_side<R>(f: impl FnOnce() -> R) -> R {
    if writing() || mode() != Lookup::Srcu {
        return with_other_read_side(f);
    }
    let _g = DOMAIN.read_lock();
    f()
}

/// [`with_read_side`] within our own attach or detach, or under a
/// benchmark's lock.
#[cold]
#[inline(never)]
fn with_other_read_side<R>(f: impl FnOnce() -> R) -> R {
    if writing() {
        // Our own attach/detach holds the table: nothing is freed under
        // us until it returns.
        return f();
    }
    match mode() {
        Lookup::Srcu => {
            let _g = DOMAIN.read_lock();
            f()
        }
        #[cfg(feature = "bench-variants")]
        Lookup::PercpuRwsem => {
            let _g = RWSEM.read();
            f()
        }
        #[cfg(feature = "bench-variants")]
        Lookup::RwLock => {
            let _g = RWLOCK
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            f()
        }
        #[cfg(not(feature = "bench-variants"))]
        Lookup::PercpuRwsem | Lookup::RwLock => {
            unreachable!("the lookup is SRCU without bench-variants")
        }
    }
}

/// The write side, held by attach and detach while they change the table.
pub(crate) enum WriteSide {
    Srcu,
    #[cfg(feature = "bench-variants")]
    PercpuRwsem(#[allow(dead_code)] percpu_rwsem::WriteGuard<'static, ()>),
    #[cfg(feature = "bench-variants")]
    RwLock(#[allow(dead_code)] std::sync::RwLockWriteGuard<'static, ()>),
}

pub(crate) fn write_side() -> WriteSide {
    let side = match mode() {
        Lookup::Srcu => WriteSide::Srcu,
        #[cfg(feature = "bench-variants")]
        Lookup::PercpuRwsem => WriteSide::PercpuRwsem(RWSEM.write()),
        #[cfg(feature = "bench-variants")]
        Lookup::RwLock => WriteSide::RwLock(
            RWLOCK
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        ),
        #[cfg(not(feature = "bench-variants"))]
        Lookup::PercpuRwsem | Lookup::RwLock => {
            unreachable!("the lookup is SRCU without bench-variants")
        }
    };
    set_writing(true);
    side
}

impl WriteSide {
    /// Whether holding it keeps every reader out (so what was unpublished
    /// can be freed at once, without a grace period).
    pub(crate) fn excludes_readers(&self) -> bool {
        !matches!(self, Self::Srcu)
    }
}

impl Drop for WriteSide {
    fn drop(&mut self) {
        set_writing(false);
    }
}
