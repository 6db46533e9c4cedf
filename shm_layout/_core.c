/*
 * The admission core: the segment lock plus one ledger operation, on the mapped
 * memory, with the GIL released (R-A1..R-A6, R-A11, R-A12).
 *
 * Python calls one function per step (arrive, leave, pump, reap, register, ...).
 * Each takes the segment lock, does its few writes and releases the lock before it
 * returns, without ever running Python code or waiting for the GIL in between. This
 * is the only code that writes the admission fields (holder records, running,
 * waiting, tickets, member rows); shm_layout/ledger.py is the same protocol in plain
 * Python, kept as the test oracle.
 *
 * Byte offsets are not written here: layout.py hands them over at construction
 * (FIELDS below names what it must give), so the layout lives in one place.
 *
 * The lock (the header records which kind a segment uses; every process follows it):
 *   KIND_ROBUST  a process-shared robust pthread mutex inside the header (Linux). The
 *                kernel marks it when its owner dies (EOWNERDEAD); it is never taken
 *                from a live owner, however long that owner is paused.
 *   KIND_FILE    an fcntl record lock on byte 0 of a lock file beside the segment (macOS,
 *                where a shm_open descriptor cannot be locked and robust mutexes do not
 *                exist; forced on Linux for the tests). The kernel drops it when the
 *                process dies. Record locks belong to the process, so threads of one
 *                process are kept apart by an in-process mutex first.
 * A holder that dies inside a section leaves header.dirty = 1: the next holder
 * recounts running/waiting from the holder records (the records are the truth).
 *
 * Liveness (R-A5): every registered process holds a record lock on byte 1 + m of the
 * lock target (the shm object itself for KIND_ROBUST, as an OFD lock; the lock file
 * for KIND_FILE) for as long as it is registered as member m. The kernel drops it when
 * the process dies; a paused process or one in another PID namespace keeps it. A
 * record is alive while its member row carries the serial the record names and that
 * byte is locked. An error while asking the kernel answers "alive".
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__linux__) && defined(F_OFD_SETLK)
#define HAVE_ROBUST 1
#else
#define HAVE_ROBUST 0
#endif

enum { KIND_ROBUST = 1, KIND_FILE = 2 };
enum { FREE = 0, WAITING = 1, RUNNING = 2 };
enum { R_BUSY = 0, R_ADMIT = 1, R_WAIT = 2, R_FULL = 3, R_WAIT_REFUSED = 4 };
enum { OUT_RELEASED = 0, OUT_TIMEOUT = 1, OUT_CANCELLED = 2 };

#define MAX_MEMBERS 256
#define STAMP_AT 4096 /* where a lock file holds its segment's stamp (lock bytes are 0..256) */
#define MAX_TARGETS 64

/* Offsets and sizes layout.py must provide, in this order. */
static const char *const FIELD_NAMES[] = {
    "h.dirty", "h.lock_seq", "h.change_seq", "h.repairs", "h.mutex",
    "p.in_use", "p.flags", "p.id", "p.fallback_limit", "p.fallback_source",
    "p.published_limit", "p.expires_at", "p.discovered", "p.queue_bound", "p.running",
    "p.waiting", "p.next_ticket", "p.admitted_total", "p.rejected_total",
    "p.timeouts_total", "p.cancelled_total", "p.reclaimed_total", "p.peak_running",
    "p.peak_waiting", "p.reason", "p.hold_mean_s",
    "k.state", "k.pid", "k.member_serial", "k.ticket", "k.serial", "k.member", "k.since",
    "m.in_use", "m.pid", "m.start", "m.serial", "m.major", "m.minor", "m.attached_at",
    "m.label",
    "g.providers_base", "g.provider_row_size", "g.provider_count", "g.holders_base",
    "g.holder_row_size", "g.holders_per_provider", "g.members_base", "g.member_row_size",
    "g.member_count", "g.running_room", "g.id_bytes", "g.reason_bytes", "g.label_bytes",
    "g.total_size", "g.mutex_size",
};
enum {
    H_DIRTY, H_LOCK_SEQ, H_CHANGE_SEQ, H_REPAIRS, H_MUTEX,
    P_IN_USE, P_FLAGS, P_ID, P_FALLBACK, P_FALLBACK_SOURCE,
    P_PUBLISHED, P_EXPIRES, P_DISCOVERED, P_QUEUE_BOUND, P_RUNNING,
    P_WAITING, P_NEXT_TICKET, P_ADMITTED, P_REJECTED,
    P_TIMEOUTS, P_CANCELLED, P_RECLAIMED, P_PEAK_RUNNING,
    P_PEAK_WAITING, P_REASON, P_HOLD_MEAN,
    K_STATE, K_PID, K_MEMBER_SERIAL, K_TICKET, K_SERIAL, K_MEMBER, K_SINCE,
    M_IN_USE, M_PID, M_START, M_SERIAL, M_MAJOR, M_MINOR, M_ATTACHED_AT,
    M_LABEL,
    G_PROVIDERS_BASE, G_PROVIDER_ROW, G_PROVIDER_COUNT, G_HOLDERS_BASE,
    G_HOLDER_ROW, G_HOLDERS_PER, G_MEMBERS_BASE, G_MEMBER_ROW,
    G_MEMBER_COUNT, G_RUNNING_ROOM, G_ID_BYTES, G_REASON_BYTES, G_LABEL_BYTES,
    G_TOTAL_SIZE, G_MUTEX_SIZE,
    NFIELDS
};

/* --- the per-process table of lock targets ------------------------------------------ */
/* One descriptor per target file per process, never closed while this process may hold
 * a record lock on it: POSIX record locks vanish when *any* descriptor of the file is
 * closed by the process (the pitfall SQLite's os_unix.c describes at length). */
typedef struct {
    int used;
    int fd;
    dev_t dev;
    ino_t ino;
    int refs;
    int spare[4];                  /* duplicates opened in a race: kept open, see below */
    int nspare;
    pthread_mutex_t mu;            /* KIND_FILE: threads of this process, one at a time */
    uint64_t own[MAX_MEMBERS];     /* serial of each member row this process registered */
} Target;

static Target targets[MAX_TARGETS];
static pthread_mutex_t targets_mu = PTHREAD_MUTEX_INITIALIZER;
static volatile unsigned long fork_generation = 0;

static void after_fork_child(void)
{
    /* The child owns none of the parent's registrations; its copies of the parent's
     * objects refuse use (fork_generation). Closing the inherited descriptors keeps a
     * long-lived child from holding the parent's OFD locks (member liveness) alive. */
    fork_generation++;
    pthread_mutex_init(&targets_mu, NULL);
    for (int i = 0; i < MAX_TARGETS; i++) {
        if (targets[i].used) {
            close(targets[i].fd);
            for (int k = 0; k < targets[i].nspare; k++)
                close(targets[i].spare[k]);
        }
        memset(&targets[i], 0, sizeof(Target));
        pthread_mutex_init(&targets[i].mu, NULL);
    }
}

static int target_find(dev_t dev, ino_t ino)
{
    for (int i = 0; i < MAX_TARGETS; i++)
        if (targets[i].used && targets[i].dev == dev && targets[i].ino == ino)
            return i;
    return -1;
}

static int target_open(const char *path, int is_shm)
{
    if (!is_shm) {
        /* A file this process already uses is found by name, without opening it: to
         * close a second descriptor would drop every record lock this process holds on
         * the file (its member locks, and the segment lock another thread may hold). */
        struct stat st0;
        if (lstat(path, &st0) == 0) {
            pthread_mutex_lock(&targets_mu);
            int i = target_find(st0.st_dev, st0.st_ino);
            if (i >= 0) {
                targets[i].refs++;
                pthread_mutex_unlock(&targets_mu);
                return i;
            }
            pthread_mutex_unlock(&targets_mu);
        }
    }
    int fd = is_shm ? shm_open(path, O_RDWR, 0) : open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && (errno == EACCES || errno == EPERM))
        fd = is_shm ? shm_open(path, O_RDONLY, 0) : open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return -1;
    if (is_shm) {
        int flags = fcntl(fd, F_GETFD);
        if (flags >= 0)
            fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    pthread_mutex_lock(&targets_mu);
    int free_slot = -1;
    for (int i = 0; i < MAX_TARGETS; i++) {
        if (targets[i].used && targets[i].dev == st.st_dev && targets[i].ino == st.st_ino) {
            Target *t = &targets[i];
            t->refs++;
            if (is_shm)
                close(fd); /* OFD locks belong to their own open file description */
            else if (t->nspare < (int)(sizeof t->spare / sizeof t->spare[0]))
                t->spare[t->nspare++] = fd; /* closed with the target, never before */
            /* else: kept open for good; closing it would drop our record locks */
            pthread_mutex_unlock(&targets_mu);
            return i;
        }
        if (!targets[i].used && free_slot < 0)
            free_slot = i;
    }
    if (free_slot < 0) {
        pthread_mutex_unlock(&targets_mu);
        close(fd);
        errno = EMFILE;
        return -1;
    }
    Target *t = &targets[free_slot];
    memset(t->own, 0, sizeof(t->own));
    t->used = 1;
    t->fd = fd;
    t->dev = st.st_dev;
    t->ino = st.st_ino;
    t->refs = 1;
    t->nspare = 0;
    pthread_mutex_init(&t->mu, NULL);
    pthread_mutex_unlock(&targets_mu);
    return free_slot;
}

static void target_release(int i)
{
    pthread_mutex_lock(&targets_mu);
    Target *t = &targets[i];
    if (t->used && --t->refs <= 0) {
        int owns = 0;
        for (int m = 0; m < MAX_MEMBERS; m++)
            owns |= t->own[m] != 0;
        if (!owns) { /* never close while a registration of ours lives on it */
            close(t->fd);
            for (int k = 0; k < t->nspare; k++)
                close(t->spare[k]);
            t->nspare = 0;
            t->used = 0;
        }
    }
    pthread_mutex_unlock(&targets_mu);
}

/* F_GETLK / F_SETLK on one byte, for the kind's lock flavour. */
static int byte_cmd(int kind, int what)
{
#if HAVE_ROBUST
    if (kind == KIND_ROBUST)
        return what == 0 ? F_OFD_GETLK : (what == 1 ? F_OFD_SETLK : F_OFD_SETLKW);
#endif
    (void)kind;
    return what == 0 ? F_GETLK : (what == 1 ? F_SETLK : F_SETLKW);
}

static struct flock one_byte(short type, off_t at)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = at;
    fl.l_len = 1;
    return fl;
}

static int byte_lock(int fd, int kind, off_t at, short type, int wait)
{
    struct flock fl = one_byte(type, at);
    for (;;) {
        if (fcntl(fd, byte_cmd(kind, wait ? 2 : 1), &fl) == 0)
            return 0;
        if (errno != EINTR)
            return -1;
    }
}

/* 1: some process holds byte ``at``; 0: nobody does. Unknown answers 1 (R-A5). */
static int byte_held(int fd, int kind, off_t at)
{
    struct flock fl = one_byte(F_WRLCK, at);
    for (;;) {
        if (fcntl(fd, byte_cmd(kind, 0), &fl) == 0)
            return fl.l_type != F_UNLCK;
        if (errno != EINTR)
            return 1;
    }
}

/* --- the Core object ------------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int have_view;
    char *base;
    Py_ssize_t size;
    long o[NFIELDS];
    int kind;
    int target;                 /* index into targets[], -1 none */
    unsigned long fork_gen;
    int closed;
    int busy;                   /* calls in flight with the GIL released */
    int member;                 /* our registration, -1 none */
    uint64_t member_serial;
    char bell_prefix[64];       /* segment name: doorbell m is "<name>.d<m>" */
    sem_t *bells[MAX_MEMBERS];
    pthread_mutex_t bell_mu;
    uint64_t repaired;          /* repairs this object performed; Python logs them */
    long held;                  /* live tickets (running or waiting): the sweep is due */
} Core;

typedef struct {
    PyObject_HEAD
    Core *core;                 /* strong reference while live */
    int provider;
    int holder;
    uint64_t serial;
    int live;
    unsigned long fork_gen;
} Ticket;

static PyTypeObject CoreType;
static PyTypeObject TicketType;

/* typed access ------------------------------------------------------------------------ */
#define AT(c, off) ((void *)((c)->base + (off)))
static inline uint32_t ld32(Core *c, long off) { return __atomic_load_n((uint32_t *)AT(c, off), __ATOMIC_ACQUIRE); }
static inline void st32(Core *c, long off, uint32_t v) { __atomic_store_n((uint32_t *)AT(c, off), v, __ATOMIC_RELEASE); }
static inline int32_t ldi32(Core *c, long off) { return (int32_t)ld32(c, off); }
static inline uint64_t ld64(Core *c, long off) { return __atomic_load_n((uint64_t *)AT(c, off), __ATOMIC_ACQUIRE); }
static inline void st64(Core *c, long off, uint64_t v) { __atomic_store_n((uint64_t *)AT(c, off), v, __ATOMIC_RELEASE); }
static inline double ldd(Core *c, long off) { double d; uint64_t u = ld64(c, off); memcpy(&d, &u, 8); return d; }
static inline void std_(Core *c, long off, double d) { uint64_t u; memcpy(&u, &d, 8); st64(c, off, u); }
static inline void inc64(Core *c, long off) { st64(c, off, ld64(c, off) + 1); }

static inline long pbase(Core *c, int p) { return c->o[G_PROVIDERS_BASE] + (long)p * c->o[G_PROVIDER_ROW]; }
static inline long hbase(Core *c, int p, int h)
{
    return c->o[G_HOLDERS_BASE] + ((long)p * c->o[G_HOLDERS_PER] + h) * c->o[G_HOLDER_ROW];
}
static inline long mbase(Core *c, int m) { return c->o[G_MEMBERS_BASE] + (long)m * c->o[G_MEMBER_ROW]; }

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The wall clock for a section, read once the lock is held. A time the caller read
 * before waiting for the lock may be long stale (behind a stopped holder), and a
 * published limit that expired meanwhile must not be applied (R-A1, R-L7). A positive
 * ``given`` (the model tests' synthetic clock) is used as it is. */
static double section_now(double given)
{
    if (given > 0)
        return given;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* --- liveness ------------------------------------------------------------------------ */
typedef struct { signed char known[MAX_MEMBERS]; } AliveCache;

static int member_alive(Core *c, int m, uint64_t serial, AliveCache *cache)
{
    if (m < 0 || m >= c->o[G_MEMBER_COUNT])
        return 0; /* no process can hold a row that does not exist */
    long mb = mbase(c, m);
    if (!ld32(c, mb + c->o[M_IN_USE]) || ld64(c, mb + c->o[M_SERIAL]) != serial)
        return 0; /* the row was freed or handed to another process since */
    if (cache && cache->known[m] >= 0)
        return cache->known[m];
    Target *t = &targets[c->target];
    int alive = t->own[m] == serial ? 1 : byte_held(t->fd, c->kind, 1 + (off_t)m);
    if (cache)
        cache->known[m] = (signed char)alive;
    return alive;
}

static int holder_alive(Core *c, long hb, AliveCache *cache)
{
    return member_alive(c, ldi32(c, hb + c->o[K_MEMBER]), ld64(c, hb + c->o[K_MEMBER_SERIAL]), cache);
}

/* --- ledger pieces (the lock is held) ------------------------------------------------ */
typedef struct { uint64_t bits[MAX_MEMBERS / 64]; } Rings;

static void ring_add(Rings *r, int m)
{
    if (m >= 0 && m < MAX_MEMBERS)
        r->bits[m / 64] |= (uint64_t)1 << (m % 64);
}

static int limit_of(Core *c, int p, double now)
{
    long b = pbase(c, p);
    int32_t published = ldi32(c, b + c->o[P_PUBLISHED]);
    int32_t room = (int32_t)c->o[G_RUNNING_ROOM];
    if (published >= 0 && now < ldd(c, b + c->o[P_EXPIRES]))
        return published < room ? published : room;
    int32_t fallback = ldi32(c, b + c->o[P_FALLBACK]);
    if (fallback < 0)
        fallback = 0;
    return fallback < room ? fallback : room;
}

static void note_peak(Core *c, long b, long field, uint32_t value)
{
    if (value > ld32(c, b + c->o[field]))
        st32(c, b + c->o[field], value);
}

static void recount_provider(Core *c, int p)
{
    uint32_t running = 0, waiting = 0;
    for (int h = 0; h < c->o[G_HOLDERS_PER]; h++) {
        long hb = hbase(c, p, h);
        uint32_t s = ld32(c, hb + c->o[K_STATE]);
        if (s == RUNNING)
            running++;
        else if (s == WAITING)
            waiting++;
        else if (s != FREE) /* a torn write by a holder that died */
            st32(c, hb + c->o[K_STATE], FREE);
    }
    long b = pbase(c, p);
    st32(c, b + c->o[P_RUNNING], running);
    st32(c, b + c->o[P_WAITING], waiting);
}

static int head_waiter(Core *c, int p)
{
    int best = -1;
    uint64_t best_ticket = 0;
    for (int h = 0; h < c->o[G_HOLDERS_PER]; h++) {
        long hb = hbase(c, p, h);
        if (ld32(c, hb + c->o[K_STATE]) == WAITING) {
            uint64_t t = ld64(c, hb + c->o[K_TICKET]);
            if (best < 0 || t < best_ticket) {
                best = h;
                best_ticket = t;
            }
        }
    }
    return best;
}

/* Grant head waiters while there is room; a dead head is reclaimed, never granted. */
static void pump(Core *c, int p, double now, Rings *rings, AliveCache *cache)
{
    long b = pbase(c, p);
    uint32_t running = ld32(c, b + c->o[P_RUNNING]);
    uint32_t waiting = ld32(c, b + c->o[P_WAITING]);
    if (waiting == 0)
        return;
    uint32_t limit = (uint32_t)limit_of(c, p, now);
    int recounted = 0;
    while (waiting > 0 && running < limit) {
        int h = head_waiter(c, p);
        if (h < 0) { /* counters drifted: the records are the truth */
            if (recounted)
                break;
            recounted = 1;
            recount_provider(c, p);
            running = ld32(c, b + c->o[P_RUNNING]);
            waiting = ld32(c, b + c->o[P_WAITING]);
            continue;
        }
        long hb = hbase(c, p, h);
        waiting--;
        if (!holder_alive(c, hb, cache)) {
            st32(c, hb + c->o[K_STATE], FREE);
            inc64(c, b + c->o[P_RECLAIMED]);
            continue;
        }
        std_(c, hb + c->o[K_SINCE], now);
        st32(c, hb + c->o[K_STATE], RUNNING);
        running++;
        ring_add(rings, ldi32(c, hb + c->o[K_MEMBER]));
        inc64(c, b + c->o[P_ADMITTED]);
    }
    st32(c, b + c->o[P_WAITING], waiting);
    st32(c, b + c->o[P_RUNNING], running);
    note_peak(c, b, P_PEAK_RUNNING, running);
}

static void repair_all(Core *c)
{
    for (int p = 0; p < c->o[G_PROVIDER_COUNT]; p++)
        if (ld32(c, pbase(c, p) + c->o[P_IN_USE]))
            recount_provider(c, p);
}

/* Free every record of dead processes (and their member rows); then grant. */
static uint32_t reap(Core *c, double now, Rings *rings)
{
    AliveCache cache;
    memset(cache.known, -1, sizeof cache.known);
    uint32_t reclaimed = 0;
    for (int p = 0; p < c->o[G_PROVIDER_COUNT]; p++) {
        long b = pbase(c, p);
        if (!ld32(c, b + c->o[P_IN_USE]))
            continue;
        uint32_t freed = 0;
        for (int h = 0; h < c->o[G_HOLDERS_PER]; h++) {
            long hb = hbase(c, p, h);
            if (ld32(c, hb + c->o[K_STATE]) != FREE && !holder_alive(c, hb, &cache)) {
                st32(c, hb + c->o[K_STATE], FREE);
                freed++;
            }
        }
        if (freed) {
            reclaimed += freed;
            st64(c, b + c->o[P_RECLAIMED], ld64(c, b + c->o[P_RECLAIMED]) + freed);
            recount_provider(c, p);
        }
        pump(c, p, now, rings, &cache);
    }
    for (int m = 0; m < c->o[G_MEMBER_COUNT]; m++) {
        long mb = mbase(c, m);
        if (ld32(c, mb + c->o[M_IN_USE]) && !member_alive(c, m, ld64(c, mb + c->o[M_SERIAL]), &cache))
            st32(c, mb + c->o[M_IN_USE], 0);
    }
    return reclaimed;
}

/* --- the lock ------------------------------------------------------------------------ */
static void to_timespec(double t, struct timespec *ts)
{
    ts->tv_sec = (time_t)t;
    ts->tv_nsec = (long)((t - (double)ts->tv_sec) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* One pause of a poll for a lock that has no timed wait (fcntl record locks): from 0.2 ms,
 * doubling to 2 ms, so that many waiters behind a stopped holder do not spin a core. */
static void short_nap(long *ns)
{
    struct timespec ts = {0, *ns};
    nanosleep(&ts, NULL);
    if (*ns < 2000000L)
        *ns *= 2;
}

/* 0: entered; 1: busy (try) or deadline passed; -1: error (errno). ``deadline`` is
 * CLOCK_MONOTONIC seconds, 0 for none. */
static int enter(Core *c, int blocking, double deadline)
{
    if (c->kind == KIND_ROBUST) {
#if HAVE_ROBUST
        pthread_mutex_t *mu = (pthread_mutex_t *)AT(c, c->o[H_MUTEX]);
        int rc;
        if (!blocking)
            rc = pthread_mutex_trylock(mu);
        else if (deadline > 0) {
            struct timespec ts;
            to_timespec(deadline, &ts);
            rc = pthread_mutex_clocklock(mu, CLOCK_MONOTONIC, &ts);
        } else
            rc = pthread_mutex_lock(mu);
        if (rc == EOWNERDEAD) { /* its holder died inside: dirty tells what to repair */
            pthread_mutex_consistent(mu);
            rc = 0;
        }
        if (rc == EBUSY || rc == ETIMEDOUT)
            return 1;
        if (rc != 0) {
            errno = rc;
            return -1;
        }
#else
        errno = ENOSYS;
        return -1;
#endif
    } else {
        Target *t = &targets[c->target];
        long nap = 200000L;
        if (!blocking) {
            if (pthread_mutex_trylock(&t->mu) != 0)
                return 1;
        } else if (deadline > 0) {
#ifdef __linux__
            struct timespec ts;
            to_timespec(deadline, &ts);
            if (pthread_mutex_clocklock(&t->mu, CLOCK_MONOTONIC, &ts) != 0)
                return 1;
#else
            while (pthread_mutex_trylock(&t->mu) != 0) {
                if (mono_now() >= deadline)
                    return 1;
                short_nap(&nap);
            }
#endif
        } else
            pthread_mutex_lock(&t->mu);
        int wait = blocking && deadline <= 0;
        while (byte_lock(t->fd, c->kind, 0, F_WRLCK, wait) != 0) {
            int e = errno;
            if (e == EAGAIN || e == EACCES) {
                if (!blocking || mono_now() >= deadline) {
                    pthread_mutex_unlock(&t->mu);
                    return 1;
                }
                short_nap(&nap);
                continue;
            }
            pthread_mutex_unlock(&t->mu);
            errno = e;
            return -1;
        }
    }
    uint64_t seq = ld64(c, c->o[H_CHANGE_SEQ]);
    st64(c, c->o[H_CHANGE_SEQ], seq % 2 == 0 ? seq + 1 : seq + 2); /* odd: readers retry */
    inc64(c, c->o[H_LOCK_SEQ]);
    if (ld32(c, c->o[H_DIRTY])) { /* the last holder died mid-section (R-A6) */
        repair_all(c);
        st32(c, c->o[H_REPAIRS], ld32(c, c->o[H_REPAIRS]) + 1);
        c->repaired++;
    }
    st32(c, c->o[H_DIRTY], 1);
    return 0;
}

static void leave_lock(Core *c)
{
    st32(c, c->o[H_DIRTY], 0);
    st64(c, c->o[H_CHANGE_SEQ], ld64(c, c->o[H_CHANGE_SEQ]) + 1);
    if (c->kind == KIND_ROBUST) {
#if HAVE_ROBUST
        pthread_mutex_unlock((pthread_mutex_t *)AT(c, c->o[H_MUTEX]));
#endif
    } else {
        Target *t = &targets[c->target];
        byte_lock(t->fd, c->kind, 0, F_UNLCK, 0);
        pthread_mutex_unlock(&t->mu);
    }
}

static int any_ring(const Rings *r)
{
    for (int w = 0; w < MAX_MEMBERS / 64; w++)
        if (r->bits[w])
            return 1;
    return 0;
}

static void ring(Core *c, Rings *r)
{
    for (int w = 0; w < MAX_MEMBERS / 64; w++) {
        uint64_t bits = r->bits[w];
        while (bits) {
            int m = w * 64 + __builtin_ctzll(bits);
            bits &= bits - 1;
            pthread_mutex_lock(&c->bell_mu);
            sem_t *s = c->bells[m];
            if (s == NULL) {
                char name[80];
                snprintf(name, sizeof name, "%s.d%d", c->bell_prefix, m);
                s = sem_open(name, 0);
                if (s == SEM_FAILED)
                    s = NULL; /* its owner makes it when registering; nobody to wake */
                c->bells[m] = s;
            }
            pthread_mutex_unlock(&c->bell_mu);
            if (s)
                sem_post(s);
        }
    }
}

/* --- Python glue --------------------------------------------------------------------- */
/* Post the doorbells collected in a section, with the GIL released; nothing to do is free. */
#define RING(c, r)                                             \
    do {                                                       \
        if (any_ring(r)) {                                     \
            Py_BEGIN_ALLOW_THREADS                             \
            ring((c), (r));                                    \
            Py_END_ALLOW_THREADS                               \
        }                                                      \
    } while (0)
static PyObject *CoreError;

static int usable(Core *c)
{
    if (!c->closed && (!c->have_view || c->target < 0)) { /* Core.__new__ without __init__ */
        PyErr_SetString(CoreError, "the core was never opened");
        return 0;
    }
    if (c->closed) {
        PyErr_SetString(CoreError, "the segment was closed");
        return 0;
    }
    if (c->fork_gen != fork_generation) {
        PyErr_SetString(CoreError, "this segment was attached before fork(); attach again in the child");
        return 0;
    }
    return 1;
}

static PyObject *lock_error(void)
{
    return PyErr_Format(CoreError, "segment lock: %s", strerror(errno));
}

/* Run ``body`` under the lock. Sets rc: 0 done, 1 busy, -1 error.
 *
 * First one non-blocking try with the GIL held: an uncontended lock then costs no GIL
 * hand-off, and the section (pure C, microseconds, no waiting) runs while no other
 * thread of this process runs at all. Only when the lock is busy is the GIL released,
 * and then the wait, the section and the unlock all happen before it is taken back: the
 * lock is never held while this thread waits for the GIL (R-A11). */
#define LOCKED(c, blocking, deadline, rc, body)                \
    do {                                                      \
        (c)->busy++;                                          \
        rc = enter((c), 0, 0.0);                              \
        if (rc == 0) {                                        \
            body;                                             \
            leave_lock(c);                                    \
        } else if (rc == 1 && (blocking)) {                   \
            Py_BEGIN_ALLOW_THREADS                            \
            rc = enter((c), 1, (deadline));                   \
            if (rc == 0) {                                    \
                body;                                         \
                leave_lock(c);                                \
            }                                                 \
            Py_END_ALLOW_THREADS                              \
        }                                                     \
        (c)->busy--;                                          \
    } while (0)

/* Does target ``t`` carry ``stamp`` at STAMP_AT? Read through the table's descriptor
 * (opening and closing another would drop this process's record locks); the GIL is
 * released for the read. */
static int stamp_matches(int t, const char *stamp, Py_ssize_t stamp_len)
{
    char seen[256];
    ssize_t got;
    if (stamp_len > (Py_ssize_t)sizeof seen)
        return 0;
    Py_BEGIN_ALLOW_THREADS
    got = pread(targets[t].fd, seen, (size_t)stamp_len, STAMP_AT);
    Py_END_ALLOW_THREADS
    return got == stamp_len && memcmp(seen, stamp, (size_t)stamp_len) == 0;
}

static void Core_dealloc(Core *c)
{
    if (!c->closed && c->target >= 0 && c->fork_gen == fork_generation)
        target_release(c->target);
    for (int m = 0; m < MAX_MEMBERS; m++)
        if (c->bells[m])
            sem_close(c->bells[m]);
    if (c->have_view)
        PyBuffer_Release(&c->view);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Core *c = (Core *)type->tp_alloc(type, 0);
    if (c) { /* zero is a real index: a Core never opened must release no one's target */
        c->target = -1;
        c->member = -1;
    }
    return (PyObject *)c;
}

static int Core_init(Core *c, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "offsets", "kind", "target", "target_is_shm", "segment", "stamp", NULL};
    PyObject *buffer, *offsets;
    int kind, is_shm;
    const char *target, *segment, *stamp = NULL;
    Py_ssize_t stamp_len = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!isps|y#", kwlist, &buffer, &PyDict_Type, &offsets,
                                     &kind, &target, &is_shm, &segment, &stamp, &stamp_len))
        return -1;
    if (stamp_len > 256) {
        PyErr_SetString(PyExc_ValueError, "stamp too long");
        return -1;
    }
    if (c->have_view || c->target >= 0) {
        PyErr_SetString(PyExc_TypeError, "a Core is opened once");
        return -1;
    }
    c->target = -1;
    c->member = -1;
    pthread_mutex_init(&c->bell_mu, NULL);
    for (int i = 0; i < NFIELDS; i++) {
        PyObject *v = PyDict_GetItemString(offsets, FIELD_NAMES[i]);
        if (v == NULL) {
            PyErr_Format(PyExc_ValueError, "offsets lacks %s", FIELD_NAMES[i]);
            return -1;
        }
        c->o[i] = PyLong_AsLong(v);
        if (c->o[i] == -1 && PyErr_Occurred())
            return -1;
    }
    if (c->o[G_MEMBER_COUNT] > MAX_MEMBERS) {
        PyErr_SetString(PyExc_ValueError, "too many members for the core");
        return -1;
    }
    if (kind != KIND_FILE && !(kind == KIND_ROBUST && HAVE_ROBUST)) {
        PyErr_Format(CoreError, "lock kind %d is not available on this system", kind);
        return -1;
    }
    if (kind == KIND_ROBUST && c->o[G_MUTEX_SIZE] < (long)sizeof(pthread_mutex_t)) {
        PyErr_SetString(PyExc_ValueError, "the header's mutex field is too small");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &c->view, PyBUF_WRITABLE) != 0)
        return -1;
    c->have_view = 1;
    c->base = c->view.buf;
    c->size = c->view.len;
    if (c->size < c->o[G_TOTAL_SIZE]) {
        PyErr_SetString(PyExc_ValueError, "the buffer is smaller than the layout");
        return -1;
    }
    if (strlen(segment) >= sizeof c->bell_prefix) {
        PyErr_SetString(PyExc_ValueError, "segment name too long");
        return -1;
    }
    strcpy(c->bell_prefix, segment);
    c->kind = kind;
    c->fork_gen = fork_generation;
    int t;
    Py_BEGIN_ALLOW_THREADS
    t = target_open(target, is_shm);
    Py_END_ALLOW_THREADS
    if (t < 0) {
        PyErr_Format(CoreError, "cannot open the lock target %s: %s", target, strerror(errno));
        return -1;
    }
    if (stamp_len > 0) {
        /* The lock file must be the one the segment's creator made (it wrote the stamp):
         * another file (a different lock directory in this process's environment, or a
         * file removed and made again) would lock nothing the others lock, and every
         * other process's members would look dead through it. Read through the table's
         * descriptor: opening and closing another would drop our record locks. */
        if (!stamp_matches(t, stamp, stamp_len)) {
            target_release(t);
            PyErr_Format(CoreError,
                         "lock file %s is not the one this segment was created with (another "
                         "lock directory, or the file was removed and made again); give every "
                         "process the same lock directory, or stop every process of this "
                         "gateway and remove the segment",
                         target);
            return -1;
        }
    }
    c->target = t;
    return 0;
}

static PyObject *Core_close(Core *c, PyObject *unused)
{
    if (c->closed)
        Py_RETURN_NONE;
    if (c->busy) {
        PyErr_SetString(CoreError, "close() while another thread is inside the core");
        return NULL;
    }
    c->closed = 1;
    if (c->target >= 0 && c->fork_gen == fork_generation)
        target_release(c->target);
    if (c->have_view) {
        PyBuffer_Release(&c->view);
        c->have_view = 0;
    }
    Py_RETURN_NONE;
}

static double deadline_arg(double timeout)
{
    return timeout < 0 ? 0.0 : mono_now() + (timeout > 0 ? timeout : 1e-9);
}

/* arrive(ticket, provider, pid, now, may_wait, blocking, timeout) -> decision code */
static PyObject *Core_arrive(Core *c, PyObject *args)
{
    Ticket *tk;
    int p, may_wait, blocking;
    unsigned int pid;
    double now, timeout;
    if (!PyArg_ParseTuple(args, "O!iIdppd", &TicketType, &tk, &p, &pid, &now, &may_wait, &blocking, &timeout))
        return NULL;
    if (!usable(c))
        return NULL;
    if (c->member < 0) {
        PyErr_SetString(CoreError, "not registered");
        return NULL;
    }
    if (p < 0 || p >= c->o[G_PROVIDER_COUNT] || tk->live) {
        PyErr_SetString(PyExc_ValueError, "bad provider or a ticket in use");
        return NULL;
    }
    int rc, decision = R_FULL;
    double deadline = deadline_arg(timeout);
    Rings rings = {{0}};
    Py_XSETREF(tk->core, (Core *)Py_NewRef(c)); /* before: a live ticket always knows its core */
    LOCKED(c, blocking, deadline, rc, {
        now = section_now(now);
        long b = pbase(c, p);
        for (int attempt = 0; attempt < 2; attempt++) {
            uint32_t running = ld32(c, b + c->o[P_RUNNING]);
            uint32_t waiting = ld32(c, b + c->o[P_WAITING]);
            uint32_t bound = ld32(c, b + c->o[P_QUEUE_BOUND]);
            uint32_t limit = (uint32_t)limit_of(c, p, now);
            if (waiting == 0 && running < limit)
                decision = R_ADMIT;
            else if (waiting >= bound)
                decision = R_FULL;
            else
                decision = R_WAIT;
            int h = -1;
            if (decision != R_FULL) {
                for (int i = 0; i < c->o[G_HOLDERS_PER]; i++)
                    if (ld32(c, hbase(c, p, i) + c->o[K_STATE]) == FREE) {
                        h = i;
                        break;
                    }
                if (h < 0)
                    decision = R_FULL;
            }
            if (decision == R_FULL && attempt == 0) { /* dead processes may hold places */
                reap(c, now, &rings);
                continue;
            }
            if (decision == R_FULL) {
                inc64(c, b + c->o[P_REJECTED]);
                break;
            }
            if (decision == R_WAIT && !may_wait) {
                decision = R_WAIT_REFUSED;
                break;
            }
            long hb = hbase(c, p, h);
            uint64_t serial = ld64(c, hb + c->o[K_SERIAL]) + 1;
            uint64_t ticket = 0;
            if (decision == R_WAIT) {
                ticket = ld64(c, b + c->o[P_NEXT_TICKET]) + 1;
                st64(c, b + c->o[P_NEXT_TICKET], ticket);
            }
            st32(c, hb + c->o[K_PID], pid);
            st64(c, hb + c->o[K_MEMBER_SERIAL], c->member_serial);
            st64(c, hb + c->o[K_TICKET], ticket);
            st64(c, hb + c->o[K_SERIAL], serial);
            st32(c, hb + c->o[K_MEMBER], (uint32_t)c->member);
            std_(c, hb + c->o[K_SINCE], now);
            /* the ticket is ours before the lock is let go: an exception that lands
             * after this call returns still finds it (R-A12) */
            tk->provider = p;
            tk->holder = h;
            tk->serial = serial;
            tk->fork_gen = c->fork_gen;
            tk->live = 1;
            if (decision == R_ADMIT) {
                st32(c, hb + c->o[K_STATE], RUNNING); /* state last */
                st32(c, b + c->o[P_RUNNING], running + 1);
                note_peak(c, b, P_PEAK_RUNNING, running + 1);
                inc64(c, b + c->o[P_ADMITTED]);
            } else {
                st32(c, hb + c->o[K_STATE], WAITING);
                st32(c, b + c->o[P_WAITING], waiting + 1);
                note_peak(c, b, P_PEAK_WAITING, waiting + 1);
            }
            break;
        }
    });
    if (rc < 0)
        return lock_error();
    if (rc == 1)
        return PyLong_FromLong(R_BUSY);
    if (tk->live)
        c->held++;
    RING(c, &rings);
    return PyLong_FromLong(decision);
}

/* The decayed mean hold time of a provider's running slots (Retry-After hints): the
 * same arithmetic as ledger.py, in the same order (no fused multiply-add: setup.py). */
#define HOLD_MEAN_WEIGHT 0.2
static void note_hold(Core *c, long b, double hold)
{
    if (!(hold >= 0.0) || hold > 86400.0) /* a clock step, or garbage: not a hold time */
        return;
    double mean = ldd(c, b + c->o[P_HOLD_MEAN]);
    if (!(mean > 0.0) || mean > 86400.0)
        mean = hold;
    else
        mean = mean + (hold - mean) * HOLD_MEAN_WEIGHT;
    std_(c, b + c->o[P_HOLD_MEAN], mean);
}

/* The section of leave(): free the ticket's record if it is still ours. */
static int leave_locked(Core *c, Ticket *tk, int outcome, double now, Rings *rings)
{
    int was = 0; /* 0 stale, 1 running, 2 waiting */
    int p = tk->provider;
    long b = pbase(c, p);
    long hb = hbase(c, p, tk->holder);
    uint32_t state = ld32(c, hb + c->o[K_STATE]);
    if (ld64(c, hb + c->o[K_SERIAL]) == tk->serial && state != FREE &&
        ldi32(c, hb + c->o[K_MEMBER]) == c->member &&
        ld64(c, hb + c->o[K_MEMBER_SERIAL]) == c->member_serial) {
        st32(c, hb + c->o[K_STATE], FREE);
        uint32_t running = ld32(c, b + c->o[P_RUNNING]);
        uint32_t waiting = ld32(c, b + c->o[P_WAITING]);
        if (state == RUNNING) {
            st32(c, b + c->o[P_RUNNING], running ? running - 1 : 0);
            note_hold(c, b, now - ldd(c, hb + c->o[K_SINCE]));
            was = 1;
        } else {
            st32(c, b + c->o[P_WAITING], waiting ? waiting - 1 : 0);
            was = 2;
        }
        if (outcome == OUT_TIMEOUT)
            inc64(c, b + c->o[P_TIMEOUTS]);
        else if (outcome == OUT_CANCELLED)
            inc64(c, b + c->o[P_CANCELLED]);
        pump(c, p, now, rings, NULL);
    }
    tk->live = 0;
    return was;
}

/* leave(ticket, outcome, now, blocking) -> -1 busy, 0 stale, 1 was running, 2 was waiting */
static PyObject *Core_leave(Core *c, PyObject *args)
{
    Ticket *tk;
    int outcome, blocking;
    double now;
    if (!PyArg_ParseTuple(args, "O!idp", &TicketType, &tk, &outcome, &now, &blocking))
        return NULL;
    if (!tk->live)
        return PyLong_FromLong(0);
    if (!usable(c))
        return NULL;
    if (tk->core != c) /* another registration's ticket: not ours to touch */
        return PyLong_FromLong(0);
    if (tk->fork_gen != c->fork_gen) { /* a forked child's copy of its parent's ticket */
        tk->live = 0;
        return PyLong_FromLong(0);
    }
    int rc, was = 0;
    Rings rings = {{0}};
    LOCKED(c, blocking, 0.0, rc, { now = section_now(now); was = leave_locked(c, tk, outcome, now, &rings); });
    if (rc < 0)
        return lock_error();
    if (rc == 1)
        return PyLong_FromLong(-1);
    c->held--;
    Py_CLEAR(tk->core);
    RING(c, &rings);
    return PyLong_FromLong(was);
}

/* state(ticket) -> the record's state while it is this ticket's, else 0 (FREE). Lock-free:
 * every write here is one aligned store, so a reader sees the old or the new value. */
static PyObject *Core_state(Core *c, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, &TicketType)) {
        PyErr_SetString(PyExc_TypeError, "a Ticket");
        return NULL;
    }
    Ticket *tk = (Ticket *)arg;
    if (!usable(c))
        return NULL;
    if (!tk->live)
        return PyLong_FromLong(FREE);
    long hb = hbase(c, tk->provider, tk->holder);
    uint32_t state = ld32(c, hb + c->o[K_STATE]);
    if (ld64(c, hb + c->o[K_SERIAL]) != tk->serial)
        state = FREE;
    return PyLong_FromLong(state);
}

static PyObject *Core_reap(Core *c, PyObject *args)
{
    double now;
    int blocking = 1;
    if (!PyArg_ParseTuple(args, "d|p", &now, &blocking))
        return NULL;
    if (!usable(c))
        return NULL;
    int rc;
    uint32_t reclaimed = 0;
    Rings rings = {{0}};
    LOCKED(c, blocking, 0.0, rc, { now = section_now(now); reclaimed = reap(c, now, &rings); });
    if (rc < 0)
        return lock_error();
    if (rc == 1)
        return PyLong_FromLong(-1);
    RING(c, &rings);
    return PyLong_FromUnsignedLong(reclaimed);
}

static PyObject *Core_pump_all(Core *c, PyObject *args)
{
    double now;
    if (!PyArg_ParseTuple(args, "d", &now))
        return NULL;
    if (!usable(c))
        return NULL;
    int rc;
    Rings rings = {{0}};
    LOCKED(c, 1, 0.0, rc, {
        now = section_now(now);
        for (int p = 0; p < c->o[G_PROVIDER_COUNT]; p++)
            if (ld32(c, pbase(c, p) + c->o[P_IN_USE]))
                pump(c, p, now, &rings, NULL);
    });
    if (rc < 0)
        return lock_error();
    RING(c, &rings);
    Py_RETURN_NONE;
}

/* Free one member's records, recount and grant; the lock is held. */
static void drop_member_records(Core *c, int m, uint64_t serial, double now, Rings *rings)
{
    for (int p = 0; p < c->o[G_PROVIDER_COUNT]; p++) {
        long b = pbase(c, p);
        if (!ld32(c, b + c->o[P_IN_USE]))
            continue;
        int freed = 0;
        for (int h = 0; h < c->o[G_HOLDERS_PER]; h++) {
            long hb = hbase(c, p, h);
            if (ld32(c, hb + c->o[K_STATE]) != FREE && ldi32(c, hb + c->o[K_MEMBER]) == m &&
                ld64(c, hb + c->o[K_MEMBER_SERIAL]) == serial) {
                st32(c, hb + c->o[K_STATE], FREE);
                freed++;
            }
        }
        if (freed) {
            recount_provider(c, p);
            pump(c, p, now, rings, NULL);
        }
    }
}

/* register(pid, start, label, major, minor, now) -> (member, serial); -1 when full */
static PyObject *Core_register(Core *c, PyObject *args)
{
    unsigned int pid;
    double start, now;
    const char *label;
    Py_ssize_t label_len;
    int major, minor;
    if (!PyArg_ParseTuple(args, "Idy#iid", &pid, &start, &label, &label_len, &major, &minor, &now))
        return NULL;
    if (!usable(c))
        return NULL;
    if (c->member >= 0) {
        PyErr_SetString(CoreError, "already registered");
        return NULL;
    }
    if (label_len > c->o[G_LABEL_BYTES])
        label_len = c->o[G_LABEL_BYTES];
    int rc, got = -1;
    uint64_t serial = 0;
    Rings rings = {{0}};
    Target *t = &targets[c->target];
    LOCKED(c, 1, 0.0, rc, {
        now = section_now(now);
        for (int m = 0; m < c->o[G_MEMBER_COUNT] && got < 0; m++) {
            long mb = mbase(c, m);
            uint64_t old = ld64(c, mb + c->o[M_SERIAL]);
            if (ld32(c, mb + c->o[M_IN_USE])) {
                if (member_alive(c, m, old, NULL))
                    continue;
                drop_member_records(c, m, old, now, &rings); /* its owner died */
                st32(c, mb + c->o[M_IN_USE], 0);
            }
            if (t->own[m] != 0)
                continue;
            /* a process that inherited a dead owner's descriptor may still hold it */
            if (byte_lock(t->fd, c->kind, 1 + (off_t)m, F_WRLCK, 0) != 0)
                continue;
            serial = old + 1;
            st32(c, mb + c->o[M_PID], pid);
            std_(c, mb + c->o[M_START], start);
            st64(c, mb + c->o[M_SERIAL], serial);
            *(uint16_t *)AT(c, mb + c->o[M_MAJOR]) = (uint16_t)major;
            *(uint16_t *)AT(c, mb + c->o[M_MINOR]) = (uint16_t)minor;
            std_(c, mb + c->o[M_ATTACHED_AT], now);
            memset(AT(c, mb + c->o[M_LABEL]), 0, c->o[G_LABEL_BYTES]);
            memcpy(AT(c, mb + c->o[M_LABEL]), label, label_len);
            st32(c, mb + c->o[M_IN_USE], 1); /* last */
            t->own[m] = serial;
            got = m;
        }
    });
    if (rc < 0)
        return lock_error();
    if (got >= 0) {
        c->member = got;
        c->member_serial = serial;
    }
    RING(c, &rings);
    return Py_BuildValue("iK", got, (unsigned long long)serial);
}

/* unregister(now): free every record of this registration, the member row, its lock. */
static PyObject *Core_unregister(Core *c, PyObject *args)
{
    double now;
    if (!PyArg_ParseTuple(args, "d", &now))
        return NULL;
    if (!usable(c))
        return NULL;
    if (c->member < 0)
        Py_RETURN_NONE;
    int m = c->member, rc;
    uint64_t serial = c->member_serial;
    Rings rings = {{0}};
    Target *t = &targets[c->target];
    LOCKED(c, 1, 0.0, rc, {
        now = section_now(now);
        drop_member_records(c, m, serial, now, &rings);
        long mb = mbase(c, m);
        if (ld64(c, mb + c->o[M_SERIAL]) == serial)
            st32(c, mb + c->o[M_IN_USE], 0);
        t->own[m] = 0;
        byte_lock(t->fd, c->kind, 1 + (off_t)m, F_UNLCK, 0);
    });
    if (rc < 0)
        return lock_error();
    c->member = -1;
    c->held = 0;
    RING(c, &rings);
    Py_RETURN_NONE;
}

/* ensure_provider(id, fallback, source, flags, queue_bound, reason) -> (index, created);
 * index -1 when the table is full. ``id`` is matched in full, never by a prefix. */
static PyObject *Core_ensure_provider(Core *c, PyObject *args)
{
    const char *id, *reason;
    Py_ssize_t id_len, reason_len;
    int fallback, source, flags, bound;
    if (!PyArg_ParseTuple(args, "y#iiiiy#", &id, &id_len, &fallback, &source, &flags, &bound, &reason,
                          &reason_len))
        return NULL;
    if (!usable(c))
        return NULL;
    if (id_len < 1 || id_len > c->o[G_ID_BYTES] || memchr(id, 0, id_len)) {
        PyErr_SetString(PyExc_ValueError, "a provider id is 1 to ID_BYTES bytes without NUL");
        return NULL;
    }
    if (reason_len > c->o[G_REASON_BYTES])
        reason_len = c->o[G_REASON_BYTES];
    char padded[256];
    if (c->o[G_ID_BYTES] > (long)sizeof padded) {
        PyErr_SetString(PyExc_ValueError, "ID_BYTES too large");
        return NULL;
    }
    memset(padded, 0, sizeof padded);
    memcpy(padded, id, id_len);
    int rc, index = -1, created = 0;
    LOCKED(c, 1, 0.0, rc, {
        for (int p = 0; p < c->o[G_PROVIDER_COUNT]; p++) {
            long b = pbase(c, p);
            if (ld32(c, b + c->o[P_IN_USE])) {
                if (memcmp(AT(c, b + c->o[P_ID]), padded, c->o[G_ID_BYTES]) == 0) {
                    index = p;
                    break;
                }
                continue;
            }
            memcpy(AT(c, b + c->o[P_ID]), padded, c->o[G_ID_BYTES]);
            st32(c, b + c->o[P_QUEUE_BOUND], (uint32_t)bound);
            st32(c, b + c->o[P_PUBLISHED], (uint32_t)-1);
            st32(c, b + c->o[P_DISCOVERED], (uint32_t)-1);
            st32(c, b + c->o[P_FALLBACK], (uint32_t)fallback);
            st32(c, b + c->o[P_FALLBACK_SOURCE], (uint32_t)source);
            st32(c, b + c->o[P_FLAGS], (uint32_t)flags);
            memset(AT(c, b + c->o[P_REASON]), 0, c->o[G_REASON_BYTES]);
            memcpy(AT(c, b + c->o[P_REASON]), reason, reason_len);
            st32(c, b + c->o[P_IN_USE], 1); /* last */
            index = p;
            created = 1;
            break;
        }
    });
    if (rc < 0)
        return lock_error();
    return Py_BuildValue("ii", index, created);
}

/* transact(guards, writes, pump, now) -> bool. Under the lock: when every guard
 * (offset, bytes) matches, apply every write (offset, bytes) in order, then grant what
 * the new limits allow. Python's slow paths (the sidecar's publishing) decide on a
 * snapshot and commit here, so Python never holds the lock (R-A11). */
typedef struct { long off; Py_ssize_t len; const char *src; } Patch;

static int parse_patches(Core *c, PyObject *seq, Patch **out, Py_ssize_t *n, PyObject **keep)
{
    PyObject *fast = PySequence_Fast(seq, "a sequence of (offset, bytes)");
    if (!fast)
        return -1;
    *keep = fast;
    *n = PySequence_Fast_GET_SIZE(fast);
    *out = PyMem_Calloc(*n ? *n : 1, sizeof(Patch));
    if (!*out)
        return -1;
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        long off;
        const char *src;
        Py_ssize_t len;
        if (!PyArg_ParseTuple(item, "ly#", &off, &src, &len))
            return -1;
        if (off < 0 || len < 0 || off + len > c->o[G_TOTAL_SIZE]) {
            PyErr_SetString(PyExc_ValueError, "a patch outside the segment");
            return -1;
        }
        (*out)[i].off = off;
        (*out)[i].len = len;
        (*out)[i].src = src;
    }
    return 0;
}

static PyObject *Core_transact(Core *c, PyObject *args)
{
    PyObject *guards, *writes;
    int do_pump;
    double now;
    if (!PyArg_ParseTuple(args, "OOpd", &guards, &writes, &do_pump, &now))
        return NULL;
    if (!usable(c))
        return NULL;
    Patch *g = NULL, *w = NULL;
    Py_ssize_t ng = 0, nw = 0;
    PyObject *kg = NULL, *kw = NULL, *result = NULL;
    if (parse_patches(c, guards, &g, &ng, &kg) == 0 && parse_patches(c, writes, &w, &nw, &kw) == 0) {
        int rc, ok = 1;
        Rings rings = {{0}};
        LOCKED(c, 1, 0.0, rc, {
            now = section_now(now);
            for (Py_ssize_t i = 0; i < ng && ok; i++)
                ok = memcmp(AT(c, g[i].off), g[i].src, g[i].len) == 0;
            if (ok) {
                for (Py_ssize_t i = 0; i < nw; i++)
                    memcpy(AT(c, w[i].off), w[i].src, w[i].len);
                if (do_pump)
                    for (int p = 0; p < c->o[G_PROVIDER_COUNT]; p++)
                        if (ld32(c, pbase(c, p) + c->o[P_IN_USE]))
                            pump(c, p, now, &rings, NULL);
            }
        });
        if (rc < 0)
            lock_error();
        else {
            RING(c, &rings);
            result = PyBool_FromLong(ok);
        }
    }
    PyMem_Free(g);
    PyMem_Free(w);
    Py_XDECREF(kg);
    Py_XDECREF(kw);
    return result;
}

/* snapshot() -> bytes: the whole segment, copied under the lock. */
static PyObject *Core_snapshot(Core *c, PyObject *unused)
{
    if (!usable(c))
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, c->o[G_TOTAL_SIZE]);
    if (!out)
        return NULL;
    char *dst = PyBytes_AS_STRING(out);
    int rc;
    LOCKED(c, 1, 0.0, rc, { memcpy(dst, c->base, c->o[G_TOTAL_SIZE]); });
    if (rc < 0) {
        Py_DECREF(out);
        return lock_error();
    }
    return out;
}

/* hold_lock(dirty=False): tests only. Take the lock and never let it go, as a process
 * frozen inside a section would. */
static PyObject *Core_hold_lock(Core *c, PyObject *args)
{
    int dirty = 0;
    if (!PyArg_ParseTuple(args, "|p", &dirty))
        return NULL;
    if (!usable(c))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = enter(c, 1, 0.0);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return lock_error();
    if (dirty) /* as if killed mid-write: counters that disagree with the records */
        for (int p = 0; p < c->o[G_PROVIDER_COUNT]; p++)
            if (ld32(c, pbase(c, p) + c->o[P_IN_USE]))
                st32(c, pbase(c, p) + c->o[P_RUNNING], 999);
    Py_RETURN_NONE;
}

/* abandon(): tests only. What the kernel does to a registration when its process dies:
 * the member's lock byte is dropped; the row and the records stay as they were. This
 * object is unusable afterwards. */
static PyObject *Core_abandon(Core *c, PyObject *unused)
{
    if (!usable(c))
        return NULL;
    if (c->member >= 0) {
        Target *t = &targets[c->target];
        t->own[c->member] = 0;
        byte_lock(t->fd, c->kind, 1 + (off_t)c->member, F_UNLCK, 0);
        c->member = -1;
    }
    c->closed = 1;
    target_release(c->target);
    if (c->have_view) {
        PyBuffer_Release(&c->view);
        c->have_view = 0;
    }
    Py_RETURN_NONE;
}

/* die_in_section(running): tests only. Enter the lock, write ``running`` over every
 * provider's counter, and let the lock go with ``dirty`` still set, as the kernel does
 * when a holder dies in the middle of a section. */
static PyObject *Core_die_in_section(Core *c, PyObject *args)
{
    unsigned int running;
    if (!PyArg_ParseTuple(args, "I", &running))
        return NULL;
    if (!usable(c))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = enter(c, 1, 0.0);
    if (rc == 0) {
        for (int p = 0; p < c->o[G_PROVIDER_COUNT]; p++)
            if (ld32(c, pbase(c, p) + c->o[P_IN_USE]))
                st32(c, pbase(c, p) + c->o[P_RUNNING], running);
        if (c->kind == KIND_ROBUST) {
#if HAVE_ROBUST
            pthread_mutex_unlock((pthread_mutex_t *)AT(c, c->o[H_MUTEX]));
#endif
        } else {
            byte_lock(targets[c->target].fd, c->kind, 0, F_UNLCK, 0);
            pthread_mutex_unlock(&targets[c->target].mu);
        }
    }
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return lock_error();
    Py_RETURN_NONE;
}

static PyObject *Core_take_repaired(Core *c, PyObject *unused)
{
    uint64_t n = c->repaired;
    c->repaired = 0;
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *Core_get_member(Core *c, void *closure)
{
    return Py_BuildValue("iK", c->member, (unsigned long long)c->member_serial);
}

static PyMethodDef Core_methods[] = {
    {"arrive", (PyCFunction)Core_arrive, METH_VARARGS, "arrive(ticket, provider, pid, now, may_wait, blocking, timeout) -> code"},
    {"leave", (PyCFunction)Core_leave, METH_VARARGS, "leave(ticket, outcome, now, blocking) -> -1 busy, 0 stale, 1 running, 2 waiting"},
    {"state", (PyCFunction)Core_state, METH_O, "state(ticket) -> record state (lock-free)"},
    {"reap", (PyCFunction)Core_reap, METH_VARARGS, "reap(now, blocking=True) -> reclaimed, -1 busy"},
    {"pump_all", (PyCFunction)Core_pump_all, METH_VARARGS, "pump_all(now)"},
    {"register", (PyCFunction)Core_register, METH_VARARGS, "register(pid, start, label, major, minor, now) -> (member, serial)"},
    {"unregister", (PyCFunction)Core_unregister, METH_VARARGS, "unregister(now)"},
    {"ensure_provider", (PyCFunction)Core_ensure_provider, METH_VARARGS, "ensure_provider(id, fallback, source, flags, bound, reason) -> (index, created)"},
    {"transact", (PyCFunction)Core_transact, METH_VARARGS, "transact(guards, writes, pump, now) -> bool"},
    {"snapshot", (PyCFunction)Core_snapshot, METH_NOARGS, "snapshot() -> bytes"},
    {"hold_lock", (PyCFunction)Core_hold_lock, METH_VARARGS, "tests only: take the lock and keep it"},
    {"take_repaired", (PyCFunction)Core_take_repaired, METH_NOARGS, "repairs since the last call"},
    {"abandon", (PyCFunction)Core_abandon, METH_NOARGS, "tests only: drop the member lock as death does"},
    {"die_in_section", (PyCFunction)Core_die_in_section, METH_VARARGS, "tests only: a holder's death mid-section"},
    {"close", (PyCFunction)Core_close, METH_NOARGS, "release the buffer and the lock target"},
    {NULL}
};

static PyObject *Core_get_busy(Core *c, void *closure)
{
    return PyLong_FromLong(c->busy);
}

static PyObject *Core_get_held(Core *c, void *closure)
{
    return PyLong_FromLong(c->held);
}

static PyGetSetDef Core_getset[] = {
    {"member", (getter)Core_get_member, NULL, "(member, serial) of this registration", NULL},
    {"held", (getter)Core_get_held, NULL, "live tickets of this object (running or waiting)", NULL},
    {"busy", (getter)Core_get_busy, NULL, "calls of other threads inside the core now", NULL},
    {NULL}
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm_layout._core.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Core_new,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

/* --- Ticket: one holder record's handle; frees its record if dropped while live ------- */
static PyObject *Ticket_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Ticket *t = (Ticket *)type->tp_alloc(type, 0);
    if (t) {
        t->provider = -1;
        t->holder = -1;
    }
    return (PyObject *)t;
}

static void Ticket_dealloc(Ticket *t)
{
    /* The last line of defence of R-A12: a ticket dropped while its record lives (an
     * exception landed where no Python cleanup could run) frees the record now. */
    Core *c = t->core;
    if (t->live && c && !c->closed && t->fork_gen == fork_generation && c->fork_gen == fork_generation) {
        Rings rings = {{0}};
        int rc;
        double now = 0.0; /* read under the lock */
        LOCKED(c, 1, 0.0, rc, { now = section_now(now); leave_locked(c, t, OUT_CANCELLED, now, &rings); });
        if (rc == 0) {
            c->held--;
            RING(c, &rings);
        }
    }
    t->live = 0;
    Py_CLEAR(t->core);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMemberDef Ticket_members[] = {
    {"provider", T_INT, offsetof(Ticket, provider), READONLY, NULL},
    {"holder", T_INT, offsetof(Ticket, holder), READONLY, NULL},
    {"serial", T_ULONGLONG, offsetof(Ticket, serial), READONLY, NULL},
    {"live", T_BOOL, offsetof(Ticket, live), READONLY, NULL},
    {NULL}
};

static PyObject *Ticket_repr(Ticket *t)
{
    return PyUnicode_FromFormat("<Ticket provider=%d holder=%d serial=%llu%s>", t->provider, t->holder,
                                (unsigned long long)t->serial, t->live ? " live" : "");
}

static PyTypeObject TicketType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm_layout._core.Ticket",
    .tp_basicsize = sizeof(Ticket),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Ticket_new,
    .tp_dealloc = (destructor)Ticket_dealloc,
    .tp_members = Ticket_members,
    .tp_repr = (reprfunc)Ticket_repr,
};

/* --- module functions ------------------------------------------------------------------ */
static PyObject *mod_init_mutex(PyObject *self, PyObject *args)
{
    Py_buffer view;
    long off;
    if (!PyArg_ParseTuple(args, "w*l", &view, &off))
        return NULL;
#if HAVE_ROBUST
    if (off < 0 || off + (long)sizeof(pthread_mutex_t) > view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "mutex offset outside the buffer");
        return NULL;
    }
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    int rc = pthread_mutex_init((pthread_mutex_t *)((char *)view.buf + off), &a);
    pthread_mutexattr_destroy(&a);
    PyBuffer_Release(&view);
    if (rc != 0)
        return PyErr_Format(CoreError, "pthread_mutex_init: %s", strerror(rc));
    Py_RETURN_NONE;
#else
    PyBuffer_Release(&view);
    PyErr_SetString(CoreError, "robust mutexes are not available on this system");
    return NULL;
#endif
}

/* probe(target, is_shm, kind, [(m, serial), ...]) -> [bool, ...]: is each member's
 * process alive, by the kernel's word, for readers that hold no Core (views). Goes
 * through the per-process table, so it never closes a descriptor this process locks
 * through. ``serial`` 0 means "whoever holds the row". */
static PyObject *mod_probe(PyObject *self, PyObject *args)
{
    const char *target, *stamp = NULL;
    Py_ssize_t stamp_len = 0;
    int is_shm, kind;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "spiO|y#", &target, &is_shm, &kind, &seq, &stamp, &stamp_len))
        return NULL;
    if (stamp_len > 256)
        return PyErr_Format(PyExc_ValueError, "stamp too long");
    if (kind != KIND_FILE && !(kind == KIND_ROBUST && HAVE_ROBUST))
        return PyErr_Format(CoreError, "lock kind %d is not available on this system", kind);
    PyObject *fast = PySequence_Fast(seq, "a sequence of (member, serial)");
    if (!fast)
        return NULL;
    int t;
    Py_BEGIN_ALLOW_THREADS
    t = target_open(target, is_shm);
    Py_END_ALLOW_THREADS
    if (t < 0) {
        Py_DECREF(fast);
        return PyErr_Format(CoreError, "cannot open the lock target %s: %s", target, strerror(errno));
    }
    int unknown = 0; /* not the segment's lock file: nothing it says is known (alive) */
    if (stamp_len > 0)
        unknown = !stamp_matches(t, stamp, stamp_len);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        int m;
        unsigned long long serial;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iK", &m, &serial)) {
            Py_CLEAR(out);
            break;
        }
        int alive;
        if (m < 0 || m >= MAX_MEMBERS)
            alive = 0;
        else if (unknown)
            alive = 1;
        else if (targets[t].own[m] != 0 && (serial == 0 || targets[t].own[m] == serial))
            alive = 1;
        else
            alive = byte_held(targets[t].fd, kind, 1 + (off_t)m);
        PyList_SET_ITEM(out, i, PyBool_FromLong(alive));
    }
    target_release(t);
    Py_DECREF(fast);
    return out;
}

static PyObject *mod_fields(PyObject *self, PyObject *unused)
{
    PyObject *t = PyTuple_New(NFIELDS);
    for (int i = 0; t && i < NFIELDS; i++)
        PyTuple_SET_ITEM(t, i, PyUnicode_FromString(FIELD_NAMES[i]));
    return t;
}

static PyMethodDef module_methods[] = {
    {"init_mutex", mod_init_mutex, METH_VARARGS, "init_mutex(buffer, offset): a process-shared robust mutex"},
    {"fields", mod_fields, METH_NOARGS, "the offsets Core needs"},
    {"probe", mod_probe, METH_VARARGS, "probe(target, is_shm, kind, [(m, serial)]) -> [bool]"},
    {NULL}
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "shm_layout._core", "The admission core (see _core.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__core(void)
{
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&TicketType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    CoreError = PyErr_NewException("shm_layout._core.CoreError", PyExc_OSError, NULL);
    Py_INCREF(&CoreType);
    Py_INCREF(&TicketType);
    PyModule_AddObject(m, "Core", (PyObject *)&CoreType);
    PyModule_AddObject(m, "Ticket", (PyObject *)&TicketType);
    PyModule_AddObject(m, "CoreError", CoreError);
    PyModule_AddIntConstant(m, "HAVE_ROBUST", HAVE_ROBUST);
    PyModule_AddIntConstant(m, "KIND_ROBUST", KIND_ROBUST);
    PyModule_AddIntConstant(m, "KIND_FILE", KIND_FILE);
    PyModule_AddIntConstant(m, "BUSY", R_BUSY);
    PyModule_AddIntConstant(m, "ADMIT", R_ADMIT);
    PyModule_AddIntConstant(m, "WAIT", R_WAIT);
    PyModule_AddIntConstant(m, "FULL", R_FULL);
    PyModule_AddIntConstant(m, "WAIT_REFUSED", R_WAIT_REFUSED);
    PyModule_AddIntConstant(m, "RELEASED", OUT_RELEASED);
    PyModule_AddIntConstant(m, "TIMEOUT", OUT_TIMEOUT);
    PyModule_AddIntConstant(m, "CANCELLED", OUT_CANCELLED);
    PyModule_AddIntConstant(m, "MUTEX_SIZE", HAVE_ROBUST ? (long)sizeof(pthread_mutex_t) : 0);
    static int atfork_done = 0;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, after_fork_child);
        atfork_done = 1;
    }
    return m;
}
