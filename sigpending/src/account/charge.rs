//! Charging: one increment per level, the limit checked against the
//! value it returned, and the 0 -> 1 charge pinning the owner (see "The
//! owner pin" in the parent module).

use std::sync::Arc;

use pcpu::unstable::sync::atomic::{Ordering, fence};

use super::{Account, COUNT, GONE, PINNED};

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
    /// [`Owner::arc`](crate::Owner::arc) whose last strong reference is gone): the account
    /// can no longer be charged.
    OwnerGone {
        /// Which level's owner is gone.
        depth: usize,
    },
    /// [`Account::charge_holding`] was given an `Arc` that is not the
    /// owner of the account charged (another `Arc`, or an account whose
    /// owner is not an [`Owner::arc`](crate::Owner::arc)). Nothing was charged: a held charge
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

impl Account {
    /// Charges one unit here and at every ancestor; the returned
    /// [`Charge`] uncharges when dropped. **Async-signal-safe.**
    #[inline]
    pub fn charge(self: &Arc<Self>) -> Result<Charge<'_>, ChargeError> {
        self.charge_from(self, None)
    }

    /// Charges one unit, like [`charge`](Self::charge), for a caller that
    /// holds the account's owner: `owner` must be the `Arc` the account
    /// was built with ([`Owner::arc`](crate::Owner::arc)) or a clone of it. The caller's
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
        first: &Arc<Self>,
        held: Option<*const ()>,
    ) -> Result<Charge<'a>, ChargeError> {
        let mut level: &Arc<Self> = first;
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
    fn charge_one(
        self: &Arc<Self>,
        depth: usize,
        held: Option<*const ()>,
    ) -> Result<(), ChargeError> {
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
        self: &Arc<Self>,
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
    fn check_limit(self: &Arc<Self>, count: usize, depth: usize) -> Result<(), ChargeError> {
        if count > self.limit {
            return Err(self.over_limit(depth));
        }
        Ok(())
    }

    /// Undoes this level's charge, refused over the limit.
    #[cold]
    fn over_limit(self: &Arc<Self>, depth: usize) -> ChargeError {
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
    fn publish_pin(self: &Arc<Self>, first: bool, held: Option<*const ()>) -> bool {
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
    fn release_extra(self: &Arc<Self>) {
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
}
