//! `Account`: a shared charge count that pins its owner only while non-zero.

use std::sync::Arc;

use crossbeam_utils::CachePadded;
use pcpu::unstable::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering, fence};

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
    /// [`Account::charge_holding`] was given an `Arc` that is not the
    /// owner of the account charged (another `Arc`, or an account whose
    /// owner is not an [`Owner::arc`]). Nothing was charged: a held charge
    /// may only skip the checked pin for the reference it proves alive.
    NotOwner,
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
            Self::NotOwner => f.write_str("the Arc given as held is not the account's owner"),
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
/// - [`charge`](Self::charge) is **one atomic increment** per level
///   between its transitions (count above 0, owner pinned), and the limit
///   is checked against the value the increment returned (never a second
///   read, which another thread may already have changed);
/// - the charge that takes a level 0 -> 1 pins its [`Owner`] and the
///   uncharge that takes it 1 -> 0 releases it, now or deferred
///   ([`Release`]): the kernel's `get_uid` after `atomic_inc_return` /
///   `free_uid` after `atomic_dec_and_test`;
/// - a refused charge undoes exactly what it did (a level it took from
///   0 -> 1 releases its pin again);
/// - uncharging (dropping the [`Charge`]) is one atomic decrement per
///   level between the transitions, and the 1 -> 0 one `fetch_sub`
///   (count and pin off together) until a charge first races it; from
///   then on that level's 1 -> 0 takes two steps (a decrement, then the
///   pin off unless a charge came in between), which keep the pin for a
///   charge that lands between them.
///
/// **Held charges.** [`charge_holding`](Self::charge_holding) is the
/// kernel's own case: the task that queues a signal holds the user it
/// charges (through its credentials), so `get_uid` is a plain increment.
/// A caller that holds the owner's `Arc` passes it; the 0 -> 1 pin is then
/// one increment of the strong count that cannot fail (the account keeps
/// only a `Weak`, so [`charge`](Self::charge) must upgrade it, a
/// compare-and-swap loop that may find the owner gone), and a held charge
/// that reads the level idle takes it to "1, pinned" with one
/// compare-and-swap. Use `charge_holding` wherever the charging code has
/// the owner's `Arc` at hand; `charge` where it has only the account (a
/// signal handler charging a consumer it does not hold, say), or to be
/// told when the owner is gone.
///
/// **Owner gone.** The count and the owner's state share one word, so the
/// value a charge's increment returns also says whether the owner is
/// pinned, gone, or being pinned by a concurrent 0 -> 1 charge. In the
/// last case the charge never waits (the pinning charge may be the thread
/// its signal handler interrupted): it pins the owner itself, and a charge
/// that fails to pin an [`Owner::arc`] whose last strong reference is gone
/// is refused with [`ChargeError::OwnerGone`], as is every later one, even
/// one that raced the charge that found out. A [held](Self::charge_holding)
/// charge never finds gone the owner it holds.
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
    /// A charge raced a one-step 1 -> 0 here once: uncharges take two
    /// steps from now on (see "The 1 -> 0 transition"). Apart from the
    /// word, so that reading it costs no transfer of the word's line.
    shared: AtomicBool,
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
//
// Held charges. A caller of `charge_holding` holds a strong reference on
// the owner (checked: the `Arc` it passes is the allocation the account's
// `Weak` points to, and the `Weak` keeps that allocation, so no other
// `Arc` can be at the same address). That reference proves three things
// for as long as the charge runs: the strong count is above 0, so a pin
// is a plain increment that cannot fail (no `upgrade` loop); no pin of
// this owner can fail meanwhile (a pin fails only at strong count 0,
// which is final); and `GONE` was never set (it is set only after a pin
// failed, so the count would have been 0 before, and it never leaves 0).
// So the held charge skips everything that exists for the owner being
// gone:
//
// - a held charge whose (relaxed) load reads the word as exactly 0 tries
//   `compare_exchange(0, PINNED | 1)` and, having won, increments the
//   strong count *afterwards*. Publishing `PINNED` before the reference
//   exists is sound here and only here: a charge that reads `PINNED`
//   relies on the reference only to keep the owner alive while it is
//   counted, which the caller's own reference does until the increment;
//   and the reference can only be released by the uncharge that takes
//   the count back to 0, which needs this charge uncharged first, after
//   it returned (its decrement is Release and sequenced after the
//   increment; the releasing uncharge acquires it in `release_owner`,
//   so the increment precedes the release in the strong count's order).
//   A failed compare-and-swap costs nothing but the attempt: nothing was
//   pinned, and the charge goes on with the increment below.
// - otherwise the general protocol, whose pin (for a level whose owner is
//   the caller's `Arc`: the charged account, and any ancestor with the
//   same owner) is the plain increment; an extra one is released at once
//   as before (never the last strong count: the caller holds one).
//
// No shortcut for `charge`'s 0 -> 1 (pin first, then the same
// compare-and-swap): measured, it saves an atomic with one thread and
// costs more than it saves with two.
//
// The 1 -> 0 transition, in one step or two.
//
// - Two steps: a decrement (`fetch_sub(1)`); if it took a pinned level to
//   0, a compare-and-swap from "pinned, count 0" to 0 and the release.
//   The compare-and-swap fails, keeping the pin, if a charge came in
//   between: that charge found `PINNED` and relies on the reference, and
//   the last uncharge of its epoch releases it instead.
// - One step: an uncharge that reads the word as exactly `PINNED | 1`
//   takes both off with one `fetch_sub(PINNED | 1)` and, if that is what
//   the word still held, releases: one atomic, the kernel's
//   `atomic_dec_and_test`. The subtraction borrows nothing: `PINNED` is
//   cleared only at count 0, and this uncharge is counted. If a charge
//   came in between the load and the decrement (it found `PINNED`, and
//   counts on it), the word is left with that charge counted and
//   `PINNED` clear, and this uncharge still holds the reference it took
//   off: it puts it back (`republish`) as a 0 -> 1 charge publishes its
//   pin, with `fetch_or(PINNED)`. Meanwhile the level is a level "being
//   pinned" (see above): charges that find it pin for themselves (they
//   cannot find the owner gone: this uncharge's reference keeps it) and
//   publish, and whichever reference finds `PINNED` set is extra. If
//   `republish` finds the count back at 0, it releases the reference it
//   just published with the two-step compare-and-swap, unless a charge
//   came in again. An extra reference of `republish` is released as the
//   account's mode says (now or deferred), not as `release_extra` does
//   (at once): the published one may meanwhile be released by the last
//   of its charges, and this one be the last.
//
// Both are correct on their own and mix: each takes one count and the
// pin only at count 0. They differ in cost. With one thread (every item
// takes the level 0 -> 1 -> 0) the one step saves an atomic per item;
// where charges from several threads meet the level near 0 it releases
// the owner at every crossing of 0 where two steps keep the pin for a
// charge that lands between them, and the release and the next pin
// bounce the owner's count between the threads (`sigpending-signal1`
// with two threads: 1.8x - 2.2x get-put with two steps, 0.9x - 1.3x
// with one). So a level starts with one step, and the first time a
// charge races one (`republish`), it is marked `shared`, for good, and
// its uncharges take two steps from then on. The mark is a hint read
// before the word, in a field of its own: once set it stays in every
// core's cache, where a load of the contended word would cost a transfer
// of its line before the decrement.
//
// Between the transitions (count above 0, `PINNED` set) a charge and an
// uncharge stay one `fetch_add` / `fetch_sub` each (after a plain load of
// the word), wait-free.

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
            shared: AtomicBool::new(false),
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
    #[inline]
    pub fn charge(self: &Arc<Self>) -> Result<Charge<'_>, ChargeError> {
        self.charge_from(self, None)
    }

    /// Charges one unit, like [`charge`](Self::charge), for a caller that
    /// holds the account's owner: `owner` must be the `Arc` the account
    /// was built with ([`Owner::arc`]) or a clone of it. The caller's
    /// reference proves the owner alive, so the 0 -> 1 pin is a plain
    /// increment of its strong count that cannot fail (the kernel's
    /// `get_uid` by the task that holds the user), where `charge` upgrades
    /// a `Weak` and may find the owner gone. Ancestors whose owner is the
    /// same `Arc` are pinned the same way; other ancestors as by `charge`
    /// (and may still refuse with [`ChargeError::OwnerGone`]).
    ///
    /// The returned [`Charge`] does not borrow `owner`: the account keeps
    /// its owner pinned while charged, whatever the caller does with its
    /// `Arc` afterwards.
    ///
    /// # Errors
    /// [`ChargeError::NotOwner`] if `owner` is not the account's owner
    /// (checked by address, nothing charged); otherwise as `charge`.
    ///
    /// **Async-signal-safe** (lock-free, no allocation), under the same
    /// terms as `charge`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use sigpending::{Account, ChargeError, Owner};
    ///
    /// let user = Arc::new("alice");
    /// let pending = Account::new(8, Owner::arc(&user));
    /// let sender = Arc::clone(&user); // what the charging thread holds
    /// drop(user);
    /// let c = pending.charge_holding(&sender)?; // 0 -> 1: one increment
    /// drop(sender);                             // the account's pin stays
    /// assert_eq!(pending.charged(), 1);
    /// drop(c);                                  // 1 -> 0: frees "alice"
    /// let stranger = Arc::new("alice");
    /// assert_eq!(pending.charge_holding(&stranger).unwrap_err(), ChargeError::NotOwner);
    /// # Ok::<(), ChargeError>(())
    /// ```
    #[inline]
    pub fn charge_holding<T: ?Sized>(
        self: &Arc<Self>,
        owner: &Arc<T>,
    ) -> Result<Charge<'_>, ChargeError> {
        let held = Arc::as_ptr(owner).cast::<()>();
        if !self.owner.is_arc_at(held) {
            return Err(ChargeError::NotOwner);
        }
        // Held fast path of 0 -> 1 (see "The owner pin"): the idle word
        // to "pinned, one charge" in one step, then the pin. Acquire: as
        // the increment of the general path.
        if self.state.load(Ordering::Relaxed) == 0
            && self
                .state
                .compare_exchange(0, PINNED | 1, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        {
            // SAFETY: the caller holds `owner`, which is this account's
            // owner (checked above).
            unsafe { self.owner.pin_held() };
            self.check_limit(1, 0)?;
            return match &self.parent {
                None => Ok(Charge { account: self }),
                Some(parent) => self.charge_from(parent, Some(held)),
            };
        }
        self.charge_from(self, Some(held))
    }

    /// Charges every level from `first` (`self` or one of its ancestors)
    /// to the root, undoing all of `self`'s levels below the one that
    /// refuses. `held`: the value pointer of the owner `Arc` the caller
    /// holds, if any (see "The owner pin").
    #[inline]
    fn charge_from<'a>(
        self: &'a Arc<Self>,
        first: &Self,
        held: Option<*const ()>,
    ) -> Result<Charge<'a>, ChargeError> {
        let mut level: &Self = first;
        loop {
            if let Err(err) = level.charge_one(self.depth - level.depth, held) {
                self.undo_below(level);
                return Err(err);
            }
            match &level.parent {
                Some(parent) => level = parent,
                None => return Ok(Charge { account: self }),
            }
        }
    }

    /// Charges this level (`depth` levels above the account charged);
    /// a refusal leaves nothing charged here. See "The owner pin" at
    /// `Account`.
    #[inline]
    fn charge_one(&self, depth: usize, held: Option<*const ()>) -> Result<(), ChargeError> {
        let old = self.state.fetch_add(1, Ordering::Acquire);
        if old & (PINNED | GONE) == PINNED {
            // The level between its transitions: covered by the
            // account's reference, one atomic.
            return self.check_limit((old & COUNT) + 1, depth);
        }
        self.charge_unpinned(old, depth, held)
    }

    /// The rest of a charge whose increment returned `old` without
    /// `PINNED`: a pin to make and publish, or the owner gone.
    #[inline(never)]
    fn charge_unpinned(
        &self,
        old: usize,
        depth: usize,
        held: Option<*const ()>,
    ) -> Result<(), ChargeError> {
        let covered = old & GONE == 0 && self.publish_pin(old & COUNT == 0, held);
        if !covered {
            self.decrement();
            return Err(ChargeError::OwnerGone { depth });
        }
        self.check_limit((old & COUNT) + 1, depth)
    }

    /// Refuses (undoing this level's charge) if `count`, the value this
    /// level's increment produced, is over the limit.
    #[inline]
    fn check_limit(&self, count: usize, depth: usize) -> Result<(), ChargeError> {
        if count > self.limit {
            return Err(self.over_limit(depth));
        }
        Ok(())
    }

    /// Undoes this level's charge, refused over the limit.
    #[cold]
    fn over_limit(&self, depth: usize) -> ChargeError {
        self.decrement();
        ChargeError::OverLimit {
            depth,
            limit: self.limit,
        }
    }

    /// Pins the owner for a charge that found no reference published
    /// (`first`: it took the count from 0 to 1); `held` as in
    /// `charge_from`. On failure, marks the owner gone. Returns whether
    /// the pin succeeded.
    #[inline]
    fn pin(&self, first: bool, held: Option<*const ()>) -> bool {
        let pinned = match held {
            Some(p) if self.owner.is_arc_at(p) => {
                // SAFETY: the caller of `charge_holding` holds the `Arc`
                // at `p`, which is this level's owner.
                unsafe { self.owner.pin_held() };
                true
            }
            _ => self.owner.pin(),
        };
        #[cfg(feature = "test-hooks")]
        if first {
            crate::hooks::at(crate::hooks::Point::PinTried { pinned });
        }
        #[cfg(not(feature = "test-hooks"))]
        let _ = first;
        if !pinned {
            self.mark_gone();
        }
        pinned
    }

    /// Records that a pin failed: the owner is gone for good.
    #[cold]
    fn mark_gone(&self) {
        // A failed `upgrade` reads the strong count with a relaxed load;
        // this fence orders `GONE` after the release that took that count
        // to zero, and so after every increment of the word made by a
        // charge while it held a pin: none of them can read `GONE`.
        fence(Ordering::Acquire);
        self.state.fetch_or(GONE, Ordering::Relaxed);
    }

    /// For a charge whose increment found neither `PINNED` nor `GONE`:
    /// pins the owner and publishes the reference as the account's,
    /// releasing it again if another charge published one first. Returns
    /// whether the charge is covered. Lock-free: see "The owner pin" at
    /// `Account`.
    fn publish_pin(&self, first: bool, held: Option<*const ()>) -> bool {
        if !self.pin(first, held) {
            return false;
        }
        if self.state.fetch_or(PINNED, Ordering::AcqRel) & PINNED != 0 {
            // Another charge of this epoch published its reference first:
            // ours is extra.
            self.release_extra();
        }
        true
    }

    /// Drops a reference this charge took that is not the account's: the
    /// account's was published by another charge, and this charge is
    /// counted, so the account's stays at least as long as this one.
    fn release_extra(&self) {
        if self.owner.can_fail() {
            // SAFETY: balances this charge's successful `pin` of an `Arc`;
            // the published reference stays while this charge is counted,
            // so this is not the last strong count and frees nothing
            // (async-signal-safe).
            unsafe { self.owner.unpin() };
        } else {
            // A callback pair: released like any other pin, now or
            // deferred, as this account's mode says.
            self.release_owner();
        }
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
    #[inline]
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
    #[inline]
    fn decrement_levels(&self, stop: Option<&Self>) {
        let mut level = Some(self);
        while let Some(l) = level.filter(|l| !stop.is_some_and(|s| core::ptr::eq(*l, s))) {
            // Read the parent before the release: nothing of a level is
            // touched after its owner may be gone.
            level = l.parent.as_deref();
            l.decrement();
        }
    }

    /// One decrement at this level, releasing on 1 -> 0 (see "The
    /// 1 -> 0 transition" at `Account`).
    #[inline]
    fn decrement(&self) {
        // One step, for a level that has never seen a charge race its
        // 1 -> 0: the count and the pin off together.
        if !self.shared.load(Ordering::Relaxed) && self.state.load(Ordering::Relaxed) == PINNED | 1
        {
            // `PINNED` is still set at the decrement (clearing it takes a
            // count of 0, and this uncharge's count is in), so this
            // borrows nothing from `GONE`.
            let old = self.state.fetch_sub(PINNED | 1, Ordering::Release);
            if old == PINNED | 1 {
                return self.release_owner();
            }
            return self.republish();
        }
        let old = self.state.fetch_sub(1, Ordering::Release);
        if old & (GONE | PINNED | COUNT) == PINNED | 1 {
            self.unpin_idle();
        }
    }

    /// After a one-step 1 -> 0 that a charge raced (it incremented
    /// between the load and the decrement, finding `PINNED`): the
    /// reference taken off the word with this uncharge's count is still
    /// held, here, and goes back, and the level is marked shared. If
    /// another charge published a reference meanwhile, this one is extra;
    /// if the level went idle meanwhile, it is released unless a charge
    /// comes in.
    #[cold]
    fn republish(&self) {
        self.shared.store(true, Ordering::Relaxed);
        let old = self.state.fetch_or(PINNED, Ordering::AcqRel);
        if old & PINNED != 0 {
            // Released as the account's mode says, not as `release_extra`
            // does: the published reference may be released concurrently
            // (its charges gone), so this one may be the last.
            self.release_owner();
        } else if old & COUNT == 0 {
            self.unpin_idle();
        }
    }

    /// With the level pinned at count 0 (a decrement took it 1 -> 0, or
    /// a reference went back to an idle level): release, unless a charge
    /// came in since (it found `PINNED` and relies on the reference; the
    /// last of its epoch releases it instead).
    #[inline(never)]
    fn unpin_idle(&self) {
        if self
            .state
            .compare_exchange(PINNED, 0, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            self.release_owner();
        }
    }

    /// Drops the owner reference taken on 0 -> 1, now or deferred.
    #[inline]
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
