//! `Account`: a shared charge count that pins its owner only while non-zero.

use std::sync::Arc;

use crossbeam_utils::CachePadded;
use pcpu::unstable::sync::atomic::{AtomicPtr, AtomicUsize, Ordering, fence};

use crate::Owner;

/// When an account drops its owner reference on the 1 -> 0 transition.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Release {
    /// In the uncharge itself. Dropping the owner may
    /// free memory, so an account released this way must not be uncharged
    /// in a signal handler (unless its owner is [`Owner::none`] or callbacks
    /// that are signal-safe).
    #[default]
    Immediate,
    /// Recorded (lock-free, no allocation) and carried out later by
    /// [`release_deferred`](crate::release_deferred) in ordinary context:
    /// the mode for accounts charged and uncharged in signal handlers.
    Deferred,
}

/// Why a charge was refused. Nothing stays charged after a refusal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChargeError {
    /// The account at `depth` (0: the account charged, 1: its parent, ...)
    /// already holds `limit` charges.
    OverLimit {
        /// Which level refused: 0 for the account itself.
        depth: usize,
        /// That level's limit.
        limit: usize,
    },
    /// The owner of the account at `depth` was dropped (an
    /// [`Owner::arc`] whose last strong reference is gone): the account
    /// can no longer be charged.
    OwnerGone {
        /// Which level's owner is gone.
        depth: usize,
    },
}

impl core::fmt::Display for ChargeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::OverLimit { depth: 0, limit } => {
                write!(f, "account is at its limit of {limit} charges")
            }
            Self::OverLimit { depth, limit } => write!(
                f,
                "ancestor account {depth} level(s) up is at its limit of {limit} charges"
            ),
            Self::OwnerGone { depth } => write!(
                f,
                "the owner of the account {depth} level(s) up was dropped"
            ),
        }
    }
}

impl std::error::Error for ChargeError {}

/// One unit charged to an [`Account`] (and its ancestors); dropping it
/// uncharges. The only way to uncharge in safe code, so an account is never
/// uncharged more often than it was charged.
///
/// [`forget`](Self::forget) keeps the charge without the token (for
/// charges recorded in plain data, like a queue's length), to be undone
/// later by [`Account::uncharge_unchecked`].
#[must_use = "dropping a Charge uncharges it at once"]
pub struct Charge<'a> {
    account: &'a Arc<Account>,
}

impl<'a> Charge<'a> {
    /// The account charged.
    #[must_use]
    pub fn account(&self) -> &'a Arc<Account> {
        self.account
    }

    /// Uncharges (the same as dropping). Async-signal-safe under the same
    /// terms as [`Account::uncharge_unchecked`].
    pub fn uncharge(self) {
        drop(self);
    }

    /// Keeps the charge but drops the token; undo it with
    /// [`Account::uncharge_unchecked`]. Async-signal-safe.
    pub fn forget(self) {
        core::mem::forget(self);
    }
}

impl Drop for Charge<'_> {
    fn drop(&mut self) {
        // SAFETY: the token stands for one charge of this account.
        unsafe { self.account.uncharge_unchecked() };
    }
}

impl core::fmt::Debug for Charge<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Charge")
            .field("account", self.account)
            .finish()
    }
}

/// The deepest hierarchy [`Account::child`] builds (a guard against
/// cycles of thought, not of memory: parents are fixed at construction).
pub const MAX_DEPTH: usize = 16;

/// A shared account that stays pinned to its owner while anything is
/// charged to it: the kernel's per-user pending-signal count after the seed
/// patch, generalised.
///
/// - [`charge`](Self::charge) is **one atomic increment** per level; the
///   level that goes 0 -> 1 pins its [`Owner`], and the limit is checked
///   against the value the increment returned (never a second read, which
///   another thread may already have changed);
/// - a refused charge undoes exactly what it did (a level it took from
///   0 -> 1 releases its pin again);
/// - uncharging (dropping the [`Charge`]) is one atomic decrement per
///   level; the level that goes 1 -> 0 releases its owner, now or deferred
///   ([`Release`]).
///
/// **Owner gone.** The count and the owner's state share one word, so the
/// value a charge's increment returns also says whether the owner is
/// pinned, gone, or being pinned by a concurrent 0 -> 1 charge. In the
/// last case the charge never waits (the pinning charge may be the thread
/// its signal handler interrupted): it pins the owner itself, and a charge
/// that fails to pin an [`Owner::arc`] whose last strong reference is gone
/// is refused with [`ChargeError::OwnerGone`], as is every later one, even
/// one that raced the charge that found out.
///
/// **Hierarchy.** A [`child`](Self::child) account's charges also count
/// against its parent (and its parent's parent...), each level with its own
/// limit and owner; the child holds its parent, so a parent outlives its
/// children. Uncharging walks up reading each parent before releasing the
/// level below, so the last uncharge of a child that is also the last of
/// its parent releases both, in order, with nothing touched after it was
/// released.
///
/// **Async-signal safety.** Charging and uncharging are lock-free and
/// allocate nothing. Pinning ([`Owner::arc`], [`Owner::none`]) is
/// signal-safe; releasing an `Arc` owner may free it, so accounts that are
/// uncharged in signal handlers use [`Release::Deferred`]. `new`, `child`
/// and [`release_deferred`](crate::release_deferred) are not signal-safe.
///
/// ```
/// use std::sync::Arc;
/// use sigpending::{Account, ChargeError, Owner};
///
/// struct User { name: String }
/// let user = Arc::new(User { name: "alice".into() });
/// let pending = Account::new(2, Owner::arc(&user));
/// let a = pending.charge()?;                  // 0 -> 1: pins `user`
/// assert_eq!(Arc::strong_count(&user), 2);
/// let b = pending.charge()?;
/// assert_eq!(pending.charge().unwrap_err(), ChargeError::OverLimit { depth: 0, limit: 2 });
/// drop(a);
/// b.uncharge();                               // 1 -> 0: unpins
/// assert_eq!(Arc::strong_count(&user), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Account {
    /// The charge count (low bits) and the owner's state ([`PINNED`],
    /// [`GONE`]) in one word: see "The owner pin" below.
    state: CachePadded<AtomicUsize>,
    limit: usize,
    /// Distance from the root (0 for a root account).
    depth: usize,
    owner: Owner,
    release: Release,
    parent: Option<Arc<Account>>,
    /// Deferred releases owed (see `deferred.rs`).
    pub(crate) owed: AtomicUsize,
    /// The next account on the deferred-release list.
    pub(crate) next_owed: AtomicPtr<Account>,
}

// The owner pin.
//
// The count and the owner's state share one word, so that every charge
// learns both from the value its one `fetch_add` returns:
//
// - `PINNED`: the account holds one reference on its owner. Set by the
//   charge that pinned it, cleared (with a compare-and-swap from exactly
//   `PINNED`, count 0) by the uncharge that releases it. A charge whose
//   increment returned `PINNED` is covered by that reference: the
//   reference can only be released once the count is 0 again, and this
//   charge keeps it above 0.
// - `GONE`: a pin failed (the `Arc`'s strong count was 0, which is final);
//   every later charge is refused. Never set together with `PINNED`.
// - neither, count 0: no reference is held. The charge that increments
//   from here (0 -> 1) pins the owner, then publishes the outcome with a
//   `fetch_or`.
// - neither, count > 0: a 0 -> 1 charge is between its pin and publishing
//   it (possibly on the very thread a signal handler interrupted, so
//   nobody may wait for it). The charge decides for itself: it pins too,
//   so that it is covered by a reference of its own when it returns. If
//   that fails, the owner is gone for good (had the first pin succeeded,
//   the strong count could not have reached 0 while this charge holds the
//   count above 0), so it sets `GONE` and is refused. If it succeeds, it
//   publishes its reference with `fetch_or(PINNED)`; whichever pin finds
//   `PINNED` already set is extra and is released again: an `Arc`'s at
//   once (never the last strong count: the published one stays while the
//   charge is counted), a callback pair's like any release (now or
//   deferred, per the account's `Release`).
//
// Before this word existed, a "gone" flag was stored after the failed pin,
// and a second charge that incremented in between saw neither the flag
// nor a reason to refuse: it was charged to an owner already dropped.

/// The account holds a reference on its owner.
const PINNED: usize = 1 << (usize::BITS - 2);
/// The owner was found gone: every charge is refused.
const GONE: usize = 1 << (usize::BITS - 1);
/// The charge count.
const COUNT: usize = PINNED - 1;

impl Account {
    /// A root account allowing `limit` charges, pinning `owner` while
    /// charged, releasing immediately. Not async-signal-safe.
    #[must_use]
    pub fn new(limit: usize, owner: Owner) -> Arc<Self> {
        Self::build(limit, owner, Release::Immediate, None)
    }

    /// Like [`new`](Self::new) with the given release mode.
    #[must_use]
    pub fn with_release(limit: usize, owner: Owner, release: Release) -> Arc<Self> {
        Self::build(limit, owner, release, None)
    }

    /// A child account: its charges also count against `self` (and its
    /// ancestors). Not async-signal-safe.
    ///
    /// # Panics
    /// If the hierarchy would be deeper than [`MAX_DEPTH`].
    #[must_use]
    pub fn child(self: &Arc<Self>, limit: usize, owner: Owner, release: Release) -> Arc<Self> {
        assert!(
            self.depth + 1 < MAX_DEPTH,
            "account hierarchies are at most {MAX_DEPTH} levels deep"
        );
        Self::build(limit, owner, release, Some(Arc::clone(self)))
    }

    fn build(limit: usize, owner: Owner, release: Release, parent: Option<Arc<Self>>) -> Arc<Self> {
        Arc::new(Self {
            state: CachePadded::new(AtomicUsize::new(0)),
            limit,
            depth: parent.as_ref().map_or(0, |p| p.depth + 1),
            owner,
            release,
            parent,
            owed: AtomicUsize::new(0),
            next_owed: AtomicPtr::new(core::ptr::null_mut()),
        })
    }

    /// The charges currently counted here (this account's and its
    /// descendants'). A racy snapshot. Async-signal-safe.
    #[must_use]
    pub fn charged(&self) -> usize {
        self.state.load(Ordering::Relaxed) & COUNT
    }

    /// This account's limit.
    #[must_use]
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The parent account, if any.
    #[must_use]
    pub fn parent(&self) -> Option<&Arc<Self>> {
        self.parent.as_ref()
    }

    /// Charges one unit here and at every ancestor; the returned
    /// [`Charge`] uncharges when dropped. **Async-signal-safe.**
    pub fn charge(self: &Arc<Self>) -> Result<Charge<'_>, ChargeError> {
        let mut level: &Self = self;
        loop {
            let depth = self.depth - level.depth;
            let old = level.state.fetch_add(1, Ordering::Acquire);
            let covered = if old & GONE != 0 {
                false
            } else if old & PINNED != 0 {
                true
            } else {
                level.pin_owner(old & COUNT == 0)
            };
            let refused = if covered {
                ((old & COUNT) + 1 > level.limit).then_some(ChargeError::OverLimit {
                    depth,
                    limit: level.limit,
                })
            } else {
                Some(ChargeError::OwnerGone { depth })
            };
            if let Some(err) = refused {
                level.decrement();
                self.undo_below(level);
                return Err(err);
            }
            match &level.parent {
                Some(parent) => level = parent,
                None => return Ok(Charge { account: self }),
            }
        }
    }

    /// Pins the owner for a charge that found no reference published
    /// (`first`: it took the count from 0 to 1) and publishes the outcome;
    /// returns whether the charge is covered. Lock-free: see "The owner
    /// pin" at `Account`.
    fn pin_owner(&self, first: bool) -> bool {
        let pinned = self.owner.pin();
        #[cfg(feature = "test-hooks")]
        if first {
            crate::hooks::at(crate::hooks::Point::PinTried { pinned });
        }
        #[cfg(not(feature = "test-hooks"))]
        let _ = first;
        if !pinned {
            self.state.fetch_or(GONE, Ordering::Relaxed);
            return false;
        }
        if self.state.fetch_or(PINNED, Ordering::AcqRel) & PINNED != 0 {
            // Another charge of this epoch published its reference first:
            // ours is extra.
            if self.owner.can_fail() {
                // SAFETY: balances our successful `pin` of an `Arc`; the
                // published reference stays while our charge is counted,
                // so this is not the last strong count and frees nothing
                // (async-signal-safe).
                unsafe { self.owner.unpin() };
            } else {
                // A callback pair: released like any other pin, now or
                // deferred, as this account's mode says.
                self.release_owner();
            }
        }
        true
    }

    /// Uncharges one unit here and at every ancestor, releasing each
    /// level's owner on its 1 -> 0 transition: the undo of a charge whose
    /// [`Charge`] was [forgotten](Charge::forget). **Async-signal-safe**
    /// for [`Release::Deferred`] accounts (and for owners whose release
    /// is); otherwise the release runs here.
    ///
    /// # Safety
    /// Balances one earlier charge of this account whose token was
    /// forgotten (more uncharges than charges would release an owner
    /// reference that was never taken).
    pub unsafe fn uncharge_unchecked(self: &Arc<Self>) {
        self.decrement_levels(None);
    }

    /// Undoes a charge at every level strictly below `stop` (from `self`
    /// up to, not including, `stop`).
    fn undo_below(self: &Arc<Self>, stop: &Self) {
        self.decrement_levels(Some(stop));
    }

    /// One decrement at each level from `self` up to (not including)
    /// `stop`, or to the root; each level releases its owner on 1 -> 0.
    fn decrement_levels(&self, stop: Option<&Self>) {
        let mut level = Some(self);
        while let Some(l) = level.filter(|l| !stop.is_some_and(|s| core::ptr::eq(*l, s))) {
            // Read the parent before the release: nothing of a level is
            // touched after its owner may be gone.
            level = l.parent.as_deref();
            l.decrement();
        }
    }

    /// One decrement at this level, releasing on 1 -> 0.
    fn decrement(&self) {
        let old = self.state.fetch_sub(1, Ordering::Release);
        // 1 -> 0 with the owner pinned: release, unless a charge came in
        // since (it found `PINNED` and relies on the reference; the last
        // of its epoch releases it instead).
        if old & (GONE | PINNED | COUNT) == PINNED | 1
            && self
                .state
                .compare_exchange(PINNED, 0, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        {
            self.release_owner();
        }
    }

    /// Drops the owner reference taken on 0 -> 1, now or deferred.
    fn release_owner(&self) {
        // Every decrement was Release: see all uses before the owner goes.
        fence(Ordering::Acquire);
        match self.release {
            // SAFETY: balanced with the pin of the 0 -> 1 transition this
            // 1 -> 0 transition ends.
            Release::Immediate => unsafe { self.owner.unpin() },
            Release::Deferred => crate::deferred::defer(self),
        }
    }

    /// Runs `owed` deferred releases (ordinary context).
    pub(crate) fn run_owed(&self, owed: usize) {
        for _ in 0..owed {
            // SAFETY: each owed release ends a 0 -> 1 pin.
            unsafe { self.owner.unpin() };
        }
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        // Charges still outstanding (forgotten ones) hold this account's
        // pin; nothing will uncharge them now, so release it (they stay
        // counted upwards).
        if self.state.load(Ordering::Relaxed) & PINNED != 0 {
            // SAFETY: `PINNED` stands for one reference taken by a pin.
            unsafe { self.owner.unpin() };
        }
    }
}

impl core::fmt::Debug for Account {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Account")
            .field("charged", &self.charged())
            .field("limit", &self.limit)
            .field("depth", &self.depth)
            .field("release", &self.release)
            .finish_non_exhaustive()
    }
}
