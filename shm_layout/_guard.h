/*
 * Guarded mappings: a segment truncated under us, the SIGBUS guard (_core.c section 1b).
 *
 * Whoever may write the segment may also shrink it (ftruncate, `truncate -s 0`): a
 * member of its group in group-shared mode, root's own tooling. Every access past the
 * new end is then a SIGBUS, which left to itself kills the process. The way
 * libwayland-server's wl_shm survives a client that shrinks its pool: a SIGBUS handler
 * that, when the faulting address lies in a mapping registered here, maps anonymous zero
 * pages over that mapping from the faulting page to its end (mmap MAP_FIXED|MAP_PRIVATE|
 * MAP_ANONYMOUS: one system call, the address stays valid), marks the mapping damaged
 * and returns, so the access is retried and reads zeros. The pages before it are left
 * to the object: what is still there (the header, with the lock word, after a shrink to
 * a page) stays shared, so a lock this process holds is still let go where the others
 * look for it; a later fault below mends from there on. Any other SIGBUS (an address of
 * no registered mapping, or a kill()) goes to the disposition that was there before
 * ours, as the kernel would have given it (bus_chain), and ours stays installed: the
 * guard is armed for the life of the mapping, whatever came first. SIG_DFL still kills,
 * SIG_IGN discards a sent signal, a handler is called (docs/DESIGN.md says which). Every
 * mapping of a segment is made by segment.py's ``Mapping``, which registers it here
 * when it is mapped and unregisters it when it is unmapped; the core reads the damaged
 * flag of the mapping it was given (``lost``).
 *
 * Self-contained (libc and the compiler's atomics, nothing of Python or of the core): the
 * table, the handler, and the table's edits that _core.c's guard(), unguard(), damaged()
 * and guard_armed() bind. Static throughout; included once, by _core.c.
 */
#ifndef GWCAP_GUARD_H
#define GWCAP_GUARD_H

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_GUARDS 256
typedef struct {
    uintptr_t start; /* 0: a free slot */
    size_t len;
    int prot;
    int damaged;     /* set by the handler (async-signal-safe: an atomic store) */
} Guard;

static Guard guards[MAX_GUARDS];
static pthread_mutex_t guards_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction bus_previous;
static int bus_previous_reset; /* the previous handler was SA_RESETHAND and has run once */
static int bus_installed;
static uintptr_t bus_page = 4096; /* the page size, read before the handler is installed */

/* A SIGBUS that is not ours, given to the disposition that was there before ours as the
 * kernel would have given it, while this handler stays installed. */
static void bus_chain(int sig, siginfo_t *info, void *ctx)
{
    int sent = info == NULL || info->si_code <= 0; /* kill(), sigqueue(), raise() */
    struct sigaction prev = bus_previous;
    if (__atomic_load_n(&bus_previous_reset, __ATOMIC_ACQUIRE)) {
        prev.sa_handler = SIG_DFL;
        prev.sa_flags = 0;
    }
    if (prev.sa_handler == SIG_IGN && sent)
        return; /* an ignored signal is discarded */
    if (prev.sa_handler == SIG_DFL || prev.sa_handler == SIG_IGN) {
        /* SIG_DFL: the process dies of it (with a core), as without us. SIG_IGN and a
         * fault: the kernel would not ignore it either (force_sig_fault resets an ignored
         * synchronous signal to SIG_DFL), so it dies. Uninstalling costs nothing here. */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(SIGBUS, &dfl, NULL);
        if (sent)
            raise(SIGBUS); /* delivered once this handler returns (SIGBUS is blocked here) */
        return;            /* a fault: returning retries it, under SIG_DFL */
    }
    /* a handler: call it as the kernel would (its sa_mask added, SIGBUS blocked unless
     * SA_NODEFER, one call only with SA_RESETHAND) and keep ours installed */
    sigset_t mask, old;
    memcpy(&mask, &prev.sa_mask, sizeof mask);
    if (prev.sa_flags & SA_RESETHAND)
        __atomic_store_n(&bus_previous_reset, 1, __ATOMIC_RELEASE);
    int saved = errno;
    pthread_sigmask(SIG_BLOCK, &mask, &old);
    if (prev.sa_flags & SA_NODEFER) {
        sigemptyset(&mask);
        sigaddset(&mask, SIGBUS);
        pthread_sigmask(SIG_UNBLOCK, &mask, NULL);
    }
    errno = saved;
    if (prev.sa_flags & SA_SIGINFO)
        prev.sa_sigaction(sig, info, ctx);
    else
        prev.sa_handler(sig);
    saved = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    errno = saved;
}

static void on_sigbus(int sig, siginfo_t *info, void *ctx)
{
    if (info != NULL && info->si_code > 0) { /* a fault (si_code <= 0: sent by a process) */
        uintptr_t at = (uintptr_t)info->si_addr;
        int mended = 0, failed = 0;
        /* every registration that holds the address is told (two may, for a moment, while
         * one mapping is unregistered after a new one took its addresses) */
        for (int i = 0; i < MAX_GUARDS; i++) {
            uintptr_t start = __atomic_load_n(&guards[i].start, __ATOMIC_ACQUIRE);
            size_t len = __atomic_load_n(&guards[i].len, __ATOMIC_ACQUIRE);
            if (start == 0 || at < start || at - start >= len)
                continue;
            uintptr_t from = at - (at - start) % bus_page;
            int saved = errno;
            void *p = mmap((void *)from, len - (from - start), guards[i].prot,
                           MAP_FIXED | MAP_PRIVATE | MAP_ANON, -1, 0);
            errno = saved;
            if (p == MAP_FAILED) {
                failed = 1;
                continue;
            }
            __atomic_store_n(&guards[i].damaged, 1, __ATOMIC_RELEASE);
            mended = 1;
        }
        if (mended && !failed)
            return; /* the access is retried, on zero pages */
    }
    bus_chain(sig, info, ctx);
}

static int install_bus_handler(void)
{
    if (bus_installed)
        return 0;
    long page = sysconf(_SC_PAGESIZE);
    if (page > 0)
        bus_page = (uintptr_t)page;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    /* SA_ONSTACK: a previous handler that wanted the alternate stack still runs there */
    sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &bus_previous) != 0)
        return -1;
    bus_installed = 1;
    return 0;
}

/* The slot of the registered mapping that holds ``addr``, or -1. */
static int guard_find(const void *addr)
{
    uintptr_t at = (uintptr_t)addr;
    for (int i = 0; i < MAX_GUARDS; i++) {
        uintptr_t start = __atomic_load_n(&guards[i].start, __ATOMIC_ACQUIRE);
        if (start != 0 && at >= start && at - start < guards[i].len)
            return i;
    }
    return -1;
}

static int guard_damaged(int i)
{
    return i >= 0 && i < MAX_GUARDS && __atomic_load_n(&guards[i].damaged, __ATOMIC_ACQUIRE);
}

/* Register the mapping [start, start + len) (whole pages): its slot, or -1 when the table
 * is full or the handler cannot be installed (the mapping is then unguarded). */
static int guard_add(uintptr_t start, size_t len, int writable)
{
    int slot = -1;
    pthread_mutex_lock(&guards_mu);
    if (install_bus_handler() == 0)
        for (int i = 0; i < MAX_GUARDS; i++)
            if (__atomic_load_n(&guards[i].start, __ATOMIC_ACQUIRE) == 0) {
                guards[i].prot = PROT_READ | (writable ? PROT_WRITE : 0);
                __atomic_store_n(&guards[i].damaged, 0, __ATOMIC_RELEASE);
                __atomic_store_n(&guards[i].len, len, __ATOMIC_RELEASE);
                __atomic_store_n(&guards[i].start, start, __ATOMIC_RELEASE);
                slot = i;
                break;
            }
    pthread_mutex_unlock(&guards_mu);
    return slot;
}

/* The mapping of slot ``i`` is about to be unmapped (or was): its slot is free again. */
static void guard_remove(int i)
{
    if (i >= 0 && i < MAX_GUARDS) {
        pthread_mutex_lock(&guards_mu);
        __atomic_store_n(&guards[i].start, 0, __ATOMIC_RELEASE);
        __atomic_store_n(&guards[i].len, 0, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&guards_mu);
    }
}

/* 1: our handler is the process's SIGBUS disposition now; 0: one set after it replaced
 * it (the guard is gone); -1: sigaction failed (errno). */
static int guard_armed(void)
{
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) != 0)
        return -1;
    return (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus;
}

#endif /* GWCAP_GUARD_H */
