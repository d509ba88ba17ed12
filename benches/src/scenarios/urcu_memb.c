/* The `srcu-read/urcu-memb` row: liburcu's default flavour (`urcu-memb`)
 * read side, in the loop shape of the other rows (lock, read through the
 * protected pointer, unlock), with liburcu's inline fast paths
 * (_LGPL_SOURCE). Built by benches/build.rs where liburcu-dev is
 * installed. */
#define _LGPL_SOURCE
#include <urcu/urcu-memb.h>

/* Runs `iters` read sections through `*ptr` on a registered thread;
 * returns the sum read (so the reads are kept). */
unsigned long kscale_urcu_memb_reads(unsigned long *const *ptr, unsigned long iters)
{
    unsigned long acc = 0;
    for (unsigned long i = 0; i < iters; i++) {
        urcu_memb_read_lock();
        acc += *rcu_dereference(*ptr);
        urcu_memb_read_unlock();
    }
    return acc;
}

void kscale_urcu_memb_register(void)
{
    urcu_memb_register_thread();
}

void kscale_urcu_memb_unregister(void)
{
    urcu_memb_unregister_thread();
}
