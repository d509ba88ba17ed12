//! `Account`: a shared charge count that pins its owner only while
//! non-zero. The type, its state word and its constructors are here;
//! charging (the 0 -> 1 pin) is in `charge`, uncharging (the 1 -> 0
//! release) in `uncharge`, and releases owed by signal handlers in
//! `deferred`.

use std::sync::Arc;

use crossbeam_utils::CachePadded;
use pcpu::unstable::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

use crate::Owner;

mod charge;
pub(crate) mod deferred;
mod uncharge;

pub use charge::{Charge, ChargeError};

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

/// The deepest hierarchy [`Account::child`] builds (a guard against
/// cycles of thought, not of memory: parents are fixed at construction).
pub const MAX_DEPTH: usize = 16;

/// A shared account that stays pinned to its owner while anything is
/// charged to it: the kernel's per-user pending-signal count since its
/// 2020 change (a reference only on 0 -> 1), generalised.
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
    /// Deferred releases owed (see `deferred`).
    owed: AtomicUsize,
    /// The next account on the deferred-release list.
    next_owed: AtomicPtr<Account>,
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
// bounce the owner's count between the threads (`bench
// sigpending-signal1` with two threads shows the difference). So a level starts with one step, and the first time a
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
