/*
 * The admission core: the segment lock, liveness, and every admission step, on the
 * mapped segment, with the GIL released while waiting (R-A1..R-A7, R-A11, R-A12,
 * R-A14..R-A21). shm_layout/ledger.py is the same protocol in plain Python, the test
 * oracle; its docstring holds the state table (every transition and the step that makes
 * it, cancel_waiting() and unregister() included) and the rules of admission classes,
 * and docs/DESIGN.md sections 6 and 6b say the same for people: the table is kept there
 * once, not copied here. Every step below has the name of the model's step it mirrors.
 *
 * Invariants whenever the lock is free: running/waiting equal the RUNNING/WAITING
 * records (derived; recounted from the records when in doubt, R-A6, R-A16);
 * waiting <= 32; nobody waits while running < limit (with classes: no waiter waits that
 * may run, DESIGN.md 6b); a record is alive exactly while
 * its member row's lock byte is held. Damage (R-A16): values no writer produces are
 * checked and put right (ledger.py's docstring lists them); a consistent lie by a
 * process that may write the segment is out of scope (docs/SECURITY.md).
 *
 * Sections of this file, each owning one thing:
 *   1. targets and liveness   the per-process table of lock files/objects, byte locks
 *   1b. guarded mappings      a segment truncated under us: the SIGBUS guard, in _guard.h
 *   2. the Core object        what one attachment knows; typed access to the mapping
 *   3. clocks                 the deadline clock (monotonic, counts suspend) and wall
 *   4. locked steps           every step run under the lock (arrive .. ensure_provider,
 *                             transact): ledger.py's steps, same names and order
 *   5. the lock               robust mutex or lock file; entry repairs after a death
 *   6. wake-ups               doorbells (named, per registration) and futexes
 *   7. bindings               the Core methods: parse, lock, call the step, unlock;
 *                             the GIL released to wait
 *   8. Ticket                 one holder record's handle; the slot context manager
 *   9. tests only             hold_lock, abandon, die_in_section (a test build only)
 *  10. module                 init_mutex, probe, mutex_state, the types
 *
 * Byte offsets and the constants shared with Python are not written here: they come
 * from _layout.h, generated from layout.py (python -m shm_layout.gen_header), so the
 * layout lives in one place; Core() refuses a layout.py that is not the one built in.
 *
 * Built against the stable ABI (Py_LIMITED_API 3.11, setup.py): one wheel per
 * platform serves every CPython from 3.11 on.
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>
#include "_layout.h"
#include "_guard.h" /* section 1b */

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#if defined(__linux__) && defined(F_OFD_SETLK)
#define HAVE_ROBUST 1
#else
#define HAVE_ROBUST 0
#endif
#if defined(__linux__) && defined(SYS_futex)
#define HAVE_FUTEX 1
#else
#define HAVE_FUTEX 0
#endif
/* sem_timedwait is POSIX's Timeouts option: macOS declares _POSIX_TIMEOUTS -1 and has no
 * sem_timedwait at all (R-A10); there a ticker thread posts the doorbell instead. */
#if defined(_POSIX_TIMEOUTS) && _POSIX_TIMEOUTS > 0
#define HAVE_TIMEDWAIT 1
#else
#define HAVE_TIMEDWAIT 0
#endif
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
#define HAVE_CLOCKWAIT 1 /* sem_clockwait, pthread_mutex_clocklock: immune to clock steps */
#else
#define HAVE_CLOCKWAIT 0
#endif

enum { KIND_ROBUST = LOCK_ROBUST, KIND_FILE = LOCK_FILE }; /* the lock kinds */
enum { FREE = HOLDER_FREE, WAITING = HOLDER_WAITING, RUNNING = HOLDER_RUNNING }; /* a record's states */
/* arrive() decisions (ledger.Decision) and leave() outcomes (ledger.Outcome) */
enum { R_BUSY = 0, R_ADMIT = 1, R_WAIT = 2, R_FULL = 3, R_WAIT_REFUSED = 4, R_CLOSED = 5, R_MOVED = 6, R_TOO_LARGE = 7 };
enum { OUT_RELEASED = 0, OUT_TIMEOUT = 1, OUT_CANCELLED = 2 };
/* wait() results */
enum { W_GRANTED = 1, W_GONE = 2, W_TIMEOUT = 3, W_CLOSED = 4, W_MOVED = 5, W_DISPLACED = 6 };
/* platform flags (platform.core_flags) */
enum { F_NO_FUTEX = CORE_NO_FUTEX, F_NO_SEM_TIMEOUT = CORE_NO_SEM_TIMEOUT, F_NO_SEM_OWNER = CORE_NO_SEM_OWNER };

#define MAX_MEMBERS 256
#define MAX_OWNERS 8
#define MAX_TARGETS 64
#define MAX_FUTEX 512  /* futex wakes collected in one section; more: wake every waiter */
#define BELL_FORMAT DOORBELL_PREFIX "%016llx" /* names.doorbell_name */


/* ===== 1. targets and liveness ========================================================
 * One descriptor per lock target (the shm object for the robust kind, the lock file for
 * the file kind) per process, never closed while this process may hold a record lock on
 * it: POSIX record locks vanish when *any* descriptor of the file is closed by the
 * process (the pitfall SQLite's os_unix.c describes at length). A registered process
 * holds byte 1 + m of its target for as long as it is member m: the kernel drops it at
 * the process's death, and only then (R-A5). */
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

/* F_GETLK / F_SETLK / F_SETLKW on one byte, for the kind's lock flavour. */
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

/* ===== 2. the Core object ==============================================================
 * One attachment of one process to one segment: the mapping, the lock
 * target, this process's registration (member row, serial, doorbell), and what Python
 * gave it to call back for the slow paths of the slot context managers. */
typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int have_view;
    char *base;
    Py_ssize_t size;
    int kind;
    int flags;                  /* F_* platform flags */
    int target;                 /* index into targets[], -1 none */
    unsigned long fork_gen;
    int closed;
    int closing;                /* close() began: arrivals refused, waiters told (R-A14) */
    int moved;                  /* the name leads to another segment now (R-A15) */
    int lost;                   /* ... because the object was truncated under us: the
                                 * mapping reads zeros now (_guard.h); never read again */
    int guard;                  /* our mapping's slot in guards[], -1 none */
    double named_checked_at;    /* when the name was last compared with the mapping */
    int busy;                   /* calls in flight with the GIL released */
    int member;                 /* our registration, -1 none */
    uint64_t member_serial;
    unsigned int pid;           /* the pid registered with the row, for the records' pid
                                 * field (for people: liveness never reads it); kept so no
                                 * slot pays a getpid() system call (0.3-0.5 us on a VM) */
    uint64_t bell;              /* our doorbell's id (names.doorbell_name) */
    sem_t *own_bell;            /* our doorbell, waited on by dispatch() */
    char name[64];              /* the segment's name, for identity checks */
    dev_t seg_dev;              /* the object we mapped (R-A15) */
    ino_t seg_ino;
    uid_t owners[MAX_OWNERS];   /* who may own a doorbell we post (R-G6) */
    int nowners;
    long group;                 /* group-shared: the group a doorbell must have; -1 none */
    sem_t *bells[MAX_MEMBERS];  /* other members' doorbells, opened when first rung */
    uint64_t bell_ids[MAX_MEMBERS];
    pthread_mutex_t bell_mu;
    uint64_t repaired;          /* lock repairs this object performed; Python logs them */
    uint64_t damage;            /* damage repairs this object performed (R-A16) */
    char damage_note[64];       /* what it found last */
    long held;                  /* live tickets (running or waiting) */
    long held_running;          /* of them running */
    double lock_report_at;      /* when a stuck lock was last reported (deadline clock) */
    int lock_suspect;           /* a long-held lock names a thread that is not here */
    PyObject *slow_enter;       /* callables for the slot context managers' slow paths */
    PyObject *slow_aenter;
    PyObject *slow_aexit;
} Core;

typedef struct {
    PyObject_HEAD
    Core *core;                 /* strong reference while set */
    int provider;
    int holder;
    uint64_t serial;
    int live;                   /* the record is ours (running or waiting) */
    int running;                /* ... and running */
    int busy;                   /* an operation on it is in flight (GIL released) */
    int futex;                  /* its owner thread waits on the record itself */
    int cls;                    /* the admission class asked for; -1 the default */
    uint32_t tokens;            /* the tokens it is charged; 0 slots only (DESIGN.md 6c) */
    double timeout;             /* for the context managers: < 0 none */
    double started;             /* deadline clock when __enter__ began: the timeout counts
                                 * from here, waits for the lock included */
    unsigned long fork_gen;
} Ticket;

static PyTypeObject *CoreType;
static PyTypeObject *TicketType;
static PyTypeObject *DoneType;
static PyObject *DONE;          /* an awaitable that is already done (fast __aenter__) */
static PyObject *CoreError;     /* shm_layout.errors.CoreError, a GatewayCapacityError */
static unsigned long main_thread; /* where Python runs signal handlers */
static PyObject *DamagedLock;   /* shm_layout.errors.DamagedLock */

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
static inline uint32_t ld16(Core *c, long off) { return __atomic_load_n((uint16_t *)AT(c, off), __ATOMIC_ACQUIRE); }
static inline uint32_t ld8(Core *c, long off) { return __atomic_load_n((uint8_t *)AT(c, off), __ATOMIC_ACQUIRE); }
static inline void st8(Core *c, long off, uint32_t v) { __atomic_store_n((uint8_t *)AT(c, off), (uint8_t)v, __ATOMIC_RELEASE); }

#define BUSY_ADD(c, n) __atomic_add_fetch(&(c)->busy, (n), __ATOMIC_RELAXED)

static inline long pbase(Core *c, int p) { return PROVIDERS_BASE + (long)p * PROVIDER_ROW_SIZE; }
static inline long hbase(Core *c, int p, int h)
{
    return HOLDERS_BASE + ((long)p * HOLDERS_PER_PROVIDER + h) * HOLDER_ROW_SIZE;
}
static inline long mbase(Core *c, int m) { return MEMBERS_BASE + (long)m * MEMBER_ROW_SIZE; }

/* ===== 3. clocks ======================================================================
 * Deadlines (a published limit's expiry, sweeps, hold times) are on the deadline clock:
 * monotonic, the same for every process of the host, counting time suspended (Linux
 * CLOCK_BOOTTIME; macOS CLOCK_MONOTONIC counts sleep). A step of the wall clock moves
 * none of them (R-L7). The wall clock is only written for people (since, attached_at). */
static double clock_read(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double deadline_clock(void)
{
#ifdef CLOCK_BOOTTIME
    return clock_read(CLOCK_BOOTTIME);
#else
    return clock_read(CLOCK_MONOTONIC);
#endif
}

typedef struct { double wall, mono; } Now;

/* The clocks for a section, read once the lock is held: a time read before a long wait
 * for the lock (behind a stopped holder) could apply a limit that expired meanwhile
 * (R-A1, R-L7). A positive ``given`` (the model tests' synthetic clock) is both. */
static Now section_now(double given)
{
    Now n;
    if (given > 0) {
        n.wall = n.mono = given;
        return n;
    }
    n.wall = clock_read(CLOCK_REALTIME);
    n.mono = deadline_clock();
    return n;
}

#if HAVE_ROBUST || HAVE_TIMEDWAIT || HAVE_FUTEX /* the timed waits; macOS has none */
static void to_timespec(double t, struct timespec *ts)
{
    if (t < 0)
        t = 0;
    ts->tv_sec = (time_t)t;
    ts->tv_nsec = (long)((t - (double)ts->tv_sec) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}
#endif

/* ===== 4. locked steps (the lock is held) ==============================================
 * Every function that runs with the segment lock held and touches the ledger: the steps
 * of ledger.Ledger, with the same names (arrive_locked, leave_locked, register_locked ..
 * where the binding of the same name is in section 7; register is a C keyword) and the
 * same order of writes, in ledger.py's order after the pieces they use:
 * tests/shm/test_core_model.py requires the same bytes after every step. A step takes
 * the time of its section (Now) and collects its wake-ups in Rings; it does not enter or
 * leave the segment lock, wait, or call into Python. */

/* What the wake-ups of one section are: doorbells to post and record words to wake,
 * collected under the lock and delivered after it (section 6). */
typedef struct {
    uint64_t bits[MAX_MEMBERS / 64];
    long futex[MAX_FUTEX];
    int nfutex;
    int futex_overflow;
    uint64_t unlink[MAX_MEMBERS]; /* doorbells of dead members, removed after the section */
    int nunlink;
} Rings;

static void ring_member(Rings *r, int m)
{
    if (m >= 0 && m < MAX_MEMBERS)
        r->bits[m / 64] |= (uint64_t)1 << (m % 64);
}

static void ring_record(Core *c, Rings *r, long hb)
{
    if (ld32(c, hb + HOLDER_WAKER) == WAKE_FUTEX) {
        if (r->nfutex < MAX_FUTEX)
            r->futex[r->nfutex++] = hb + HOLDER_STATE;
        else
            r->futex_overflow = 1;
    } else
        ring_member(r, ldi32(c, hb + HOLDER_MEMBER));
}

/* Damage found and put right, under the lock: counted in the header with when and what
 * (inspect, --check), and in this object, whose process logs it once (R-A16). */
static void note_damage(Core *c, const char *what)
{
    c->damage++;
    snprintf(c->damage_note, sizeof c->damage_note, "%s", what);
    st32(c, HEADER_DAMAGE_REPAIRS, ld32(c, HEADER_DAMAGE_REPAIRS) + 1);
    std_(c, HEADER_DAMAGE_MONO, deadline_clock());
    memset(AT(c, HEADER_DAMAGE_NOTE), 0, 64);
    memcpy(AT(c, HEADER_DAMAGE_NOTE), c->damage_note, strnlen(c->damage_note, 63));
}

/* A published deadline further ahead than any publication can set (30 s after an
 * observation at most 5 s in the future, R-K4) is damage, never obeyed (R-A16). */
static int published_in_force(Core *c, long b, double now)
{
    if (ldi32(c, b + PROVIDER_PUBLISHED_LIMIT) < 0)
        return 0;
    double expires = ldd(c, b + PROVIDER_EXPIRES_MONO);
    return now < expires && expires - now <= DEADLINE_SLACK_S;
}

static int limit_value(Core *c, int p, double now)
{
    long b = pbase(c, p);
    int32_t room = (int32_t)RUNNING_ROOM;
    int32_t value = published_in_force(c, b, now) ? ldi32(c, b + PROVIDER_PUBLISHED_LIMIT)
                                                  : ldi32(c, b + PROVIDER_FALLBACK_LIMIT);
    if (value < 0)
        value = 0;
    return value < room ? value : room;
}

static void note_peak(Core *c, long b, long field, uint32_t value)
{
    if (value > ld32(c, b + field))
        st32(c, b + field, value);
}

/* running and waiting, always written with their check word (layout.counts_check). */
static inline uint64_t counts_word(uint32_t running, uint32_t waiting)
{
    return ~(((uint64_t)waiting << 32) | running);
}

static void put_counts(Core *c, long b, uint32_t running, uint32_t waiting)
{
    st32(c, b + PROVIDER_RUNNING, running);
    st32(c, b + PROVIDER_WAITING, waiting);
    st64(c, b + PROVIDER_COUNTS_CHECK, counts_word(running, waiting));
}

static void free_record(Core *c, long hb) { st32(c, hb + HOLDER_STATE, FREE); }

/* Rebuild running/waiting from the records (the records are the truth): a state word
 * that is none of FREE, WAITING, RUNNING is freed. Returns 1 when the stored counters or
 * a state word were wrong. */
static int recount_provider(Core *c, int p)
{
    uint32_t running = 0, waiting = 0;
    uint64_t tokens = 0;
    int wrong = 0;
    for (int h = 0; h < HOLDERS_PER_PROVIDER; h++) {
        long hb = hbase(c, p, h);
        uint32_t s = ld32(c, hb + HOLDER_STATE);
        if (s != FREE && s != RUNNING && s != WAITING) {
            free_record(c, hb); /* garbage: no writer of ours wrote it */
            s = FREE;
            wrong = 1;
        }
        if (s == RUNNING) {
            running++;
            tokens += ld32(c, hb + HOLDER_TOKENS);
        } else if (s == WAITING)
            waiting++;
    }
    long b = pbase(c, p);
    /* rebuilt, but no damage when it differed: an older minor's core frees records
     * without knowing their tokens (ledger.Ledger.recount_provider) */
    st32(c, b + PROVIDER_TOKENS_RUNNING, tokens > UINT32_MAX ? UINT32_MAX : (uint32_t)tokens);
    wrong |= ld32(c, b + PROVIDER_RUNNING) != running || ld32(c, b + PROVIDER_WAITING) != waiting ||
             ld64(c, b + PROVIDER_COUNTS_CHECK) != counts_word(running, waiting);
    put_counts(c, b, running, waiting);
    return wrong;
}

/* Counters no writer of ours produces (R-A16): out of range, or not matching the check
 * word written with them. Never obeyed: recounted first. */
static int counters_damaged(Core *c, long b)
{
    uint32_t running = ld32(c, b + PROVIDER_RUNNING);
    uint32_t waiting = ld32(c, b + PROVIDER_WAITING);
    return running > (uint32_t)HOLDERS_PER_PROVIDER || waiting > (uint32_t)QUEUE_BOUND ||
           ld64(c, b + PROVIDER_COUNTS_CHECK) != counts_word(running, waiting);
}

static int head_waiter(Core *c, int p)
{
    int best = -1;
    uint64_t best_ticket = 0;
    for (int h = 0; h < HOLDERS_PER_PROVIDER; h++) {
        long hb = hbase(c, p, h);
        if (ld32(c, hb + HOLDER_STATE) == WAITING) {
            uint64_t t = ld64(c, hb + HOLDER_TICKET);
            if (best < 0 || t < best_ticket) {
                best = h;
                best_ticket = t;
            }
        }
    }
    return best;
}

/* --- the token budget (rows.py: token_budget .. too_large; DESIGN.md 6c) ----------- */
/* Is a request charged n one no worker could hold (rows.too_large)? Above the most one
 * request may hold, or above the whole budget, as published and in force. */
static int too_large(Core *c, long b, uint32_t n, double now)
{
    if (n == 0 || !published_in_force(c, b, now))
        return 0;
    uint32_t per_request = ld32(c, b + PROVIDER_REQUEST_TOKEN_LIMIT), all = ld32(c, b + PROVIDER_TOKEN_LIMIT);
    return (per_request && n > per_request) || (all && n > all);
}

/* The token limit the steps apply (rows.token_limit_in_force): the published one while
 * in force and no handler of an older minor is registered; 0 slots alone. */
static uint32_t token_limit_in_force(Core *c, long b, double now)
{
    if (!published_in_force(c, b, now) || ld32(c, HEADER_TOKENLESS_MEMBERS))
        return 0;
    return ld32(c, b + PROVIDER_TOKEN_LIMIT);
}

/* rows.tokens_fit: no budget, no charge or nobody running (alone, a request always
 * runs), else the sum within the budget. */
static inline int tokens_fit(uint32_t running, uint32_t n, uint32_t limit)
{
    return limit == 0 || n == 0 || running == 0 || (uint64_t)running + n <= limit;
}

static inline void add_tokens(Core *c, long b, uint32_t n)
{
    uint64_t total = (uint64_t)ld32(c, b + PROVIDER_TOKENS_RUNNING) + n;
    st32(c, b + PROVIDER_TOKENS_RUNNING, total > UINT32_MAX ? UINT32_MAX : (uint32_t)total);
}

/* --- admission classes (ledger.py: classes_in_force .. may_run; DESIGN.md 6b) ------ */
typedef struct {
    int count;                  /* classes in force; 0: one FIFO */
    uint32_t reserve[CLASS_COUNT];
    uint32_t cap[CLASS_COUNT];  /* 0 none */
    double max_wait[CLASS_COUNT]; /* seconds; 0 never promoted */
} Rules;

static inline long cbase(Core *c, int p, int k) { return pbase(c, p) + CLASS_BASE + (long)k * CLASS_ROW_SIZE; }

/* The number of classes the steps apply: 0 without classes, or while a handler of an
 * older minor is registered (it knows nothing of them); never more than the rows. */
static int classes_in_force(Core *c, int p)
{
    uint32_t count = ld32(c, pbase(c, p) + PROVIDER_CLASS_COUNT);
    if (count == 0 || ld32(c, HEADER_OLDER_MEMBERS))
        return 0;
    return count < CLASS_COUNT ? (int)count : CLASS_COUNT;
}

static void class_rules(Core *c, int p, int count, Rules *r)
{
    r->count = count;
    for (int k = 0; k < count; k++) {
        long cb = cbase(c, p, k);
        r->reserve[k] = ld16(c, cb + CLASS_RESERVE);
        r->cap[k] = ld16(c, cb + CLASS_CAP);
        r->max_wait[k] = ld32(c, cb + CLASS_MAX_WAIT_MS) / 1000.0;
    }
}

/* The class an arrival or a record counts in: its own when the provider has it, else the
 * default class (the last one when that is out of range too); 0 without classes. */
static int resolve_class(Core *c, int p, int cls)
{
    uint32_t count = ld32(c, pbase(c, p) + PROVIDER_CLASS_COUNT);
    if (count > CLASS_COUNT)
        count = CLASS_COUNT;
    if (count == 0)
        return 0;
    if (cls >= 0 && (uint32_t)cls < count)
        return cls;
    uint32_t def = ld32(c, pbase(c, p) + PROVIDER_DEFAULT_CLASS);
    return def < count ? (int)def : (int)count - 1;
}

/* May a request of class k take a slot? The total below the limit, the class below its
 * cap and (unless promoted) the total plus every higher class's unused reserve below
 * the limit: strict order when the reserves exceed the limit. */
static int may_run(const Rules *r, int k, int promoted, uint32_t running, const uint32_t *run, uint32_t limit)
{
    if (running >= limit)
        return 0;
    if (r->cap[k] && run[k] >= r->cap[k])
        return 0;
    if (promoted)
        return 1;
    uint32_t withheld = 0;
    for (int j = 0; j < k; j++)
        withheld += r->reserve[j] > run[j] ? r->reserve[j] - run[j] : 0;
    return running + withheld < limit;
}

static void class_running(Core *c, int p, uint32_t *run)
{
    memset(run, 0, CLASS_COUNT * sizeof *run);
    for (int h = 0; h < HOLDERS_PER_PROVIDER; h++) {
        long hb = hbase(c, p, h);
        if (ld32(c, hb + HOLDER_STATE) == RUNNING)
            run[resolve_class(c, p, (int)ld8(c, hb + HOLDER_CLS) - 1)]++;
    }
}

/* A waiting record's class, and its rank: the top class once it waited maxWait. */
static int record_rank(Core *c, int p, long hb, const Rules *r, double now, int *k, int *promoted)
{
    *k = resolve_class(c, p, (int)ld8(c, hb + HOLDER_CLS) - 1);
    double wait = r->max_wait[*k];
    *promoted = *k > 0 && wait > 0 && now - ldd(c, hb + HOLDER_SINCE_MONO) >= wait;
    return *promoted ? 0 : *k;
}

static inline void bump_class(Core *c, int p, int k) { inc64(c, cbase(c, p, k) + CLASS_ADMITTED_TOTAL); }

/* What a record's cls byte holds (ledger.stored_class): 1 + the class asked for when
 * the provider has it, else 0, the default class (resolved when read: a record made
 * before the classes were written counts in the default class, never the top one). */
static uint32_t stored_class(Core *c, int p, int cls)
{
    uint32_t count = ld32(c, pbase(c, p) + PROVIDER_CLASS_COUNT);
    return cls >= 0 && (uint32_t)cls < count && cls < CLASS_COUNT ? (uint32_t)cls + 1 : 0;
}

/* --- liveness ------------------------------------------------------------------------ */
typedef struct { signed char held[MAX_MEMBERS]; } AliveCache;

static int member_byte_held(Core *c, int m, AliveCache *cache)
{
    if (cache && cache->held[m] >= 0)
        return cache->held[m];
    Target *t = &targets[c->target];
    int held = t->own[m] != 0 ? 1 : byte_held(t->fd, c->kind, 1 + (off_t)m);
    if (cache)
        cache->held[m] = (signed char)held;
    return held;
}

/* Is a record of member row m alive? The kernel's word alone: somebody holds row m's
 * lock byte (a row out of range: nobody can). A row is handed to a new registration only
 * after the old one's records are freed (register, reap), so a held row's records are
 * its holder's; the row's in_use and serial words are not consulted (R-A5, R-A16). */
static int member_alive(Core *c, int m, AliveCache *cache)
{
    if (m < 0 || m >= MEMBER_COUNT)
        return 0; /* no process can hold a row that does not exist */
    return member_byte_held(c, m, cache);
}

static int holder_alive(Core *c, long hb, AliveCache *cache)
{
    return member_alive(c, ldi32(c, hb + HOLDER_MEMBER), cache);
}

/* The hold time of a record that stops running, into the provider's decayed mean (for
 * Retry-After). Negative or absurd hold times are no sample. */
static void note_hold(Core *c, long b, double hold)
{
    if (!(hold >= 0.0) || hold > 86400.0)
        return;
    double mean = ldd(c, b + PROVIDER_HOLD_MEAN_S);
    if (!(mean > 0.0) || mean > 86400.0)
        mean = hold;
    else
        mean = mean + (hold - mean) * HOLD_MEAN_WEIGHT;
    std_(c, b + PROVIDER_HOLD_MEAN_S, mean);
}

/* --- the steps ------------------------------------------------------------------------ */
static void repair_all(Core *c)
{
    for (int p = 0; p < PROVIDER_COUNT; p++)
        if (ld32(c, pbase(c, p) + PROVIDER_IN_USE))
            recount_provider(c, p);
}

static void pump(Core *c, int p, Now now, Rings *rings, AliveCache *cache);
static void free_member_row(Core *c, int m, Rings *rings);
static int count_older_members(Core *c);

/* The first free record; one that holds a displacement note (its owner may not have read
 * it yet) only when no other is free (ledger.Ledger._free_place). */
static int first_free(Core *c, int p)
{
    int noted = -1;
    for (int i = 0; i < HOLDERS_PER_PROVIDER; i++) {
        long ib = hbase(c, p, i);
        if (ld32(c, ib + HOLDER_STATE) == FREE) {
            if (!ld8(c, ib + HOLDER_DISPLACED))
                return i;
            if (noted < 0)
                noted = i;
        }
    }
    return noted;
}

/* The newest waiter of the lowest rank below class k (ledger.Ledger._displaceable), -1
 * none: promoted waiters rank as the top class and are never displaced. */
static int displaceable(Core *c, int p, int k, const Rules *r, double now)
{
    int best = -1, best_rank = 0;
    uint64_t best_ticket = 0;
    for (int h = 0; h < HOLDERS_PER_PROVIDER; h++) {
        long hb = hbase(c, p, h);
        if (ld32(c, hb + HOLDER_STATE) != WAITING)
            continue;
        int rk, promoted;
        int rank = record_rank(c, p, hb, r, now, &rk, &promoted);
        uint64_t t = ld64(c, hb + HOLDER_TICKET);
        if (rank > k && (best < 0 || rank > best_rank || (rank == best_rank && t > best_ticket))) {
            best = h;
            best_rank = rank;
            best_ticket = t;
        }
    }
    return best;
}

/* FIFO admission (ledger.decide_arrival): nobody overtakes a waiter (R-A3), the queue is
 * bounded (R-A2). */
static int decide_arrival(uint32_t running, uint32_t waiting, uint32_t limit, uint32_t bound, int fits)
{
    if (waiting == 0 && running < limit && fits)
        return R_ADMIT;
    return waiting >= bound ? R_FULL : R_WAIT;
}

/* An arrival of class k with classes in force (ledger.Ledger._decide_classed): the
 * decision, and in *victim the waiter it displaces from a full queue (-1 none). */
static int best_waiter(Core *c, int p, uint32_t running, const uint32_t *run, uint32_t limit, const Rules *r,
                       double now, int *cls, int *promoted_only, int *anyone);

static int decide_classed(Core *c, int p, int k, const Rules *r, uint32_t running, uint32_t waiting,
                          uint32_t limit, double now, int fits, uint32_t budget, int *victim)
{
    uint32_t run[CLASS_COUNT];
    class_running(c, p, run);
    if (may_run(r, k, 0, running, run, limit) && fits) {
        int held_back = 0;
        if (budget) { /* a waiter of its rank or above that only tokens hold back */
            int bk = 0, promoted_only = 0, anyone = 0, rk, promoted;
            int h = best_waiter(c, p, running, run, limit, r, now, &bk, &promoted_only, &anyone);
            held_back = h >= 0 && record_rank(c, p, hbase(c, p, h), r, now, &rk, &promoted) <= k;
        }
        if (!held_back)
            return R_ADMIT;
    }
    if (waiting < (uint32_t)QUEUE_BOUND)
        return R_WAIT;
    *victim = displaceable(c, p, k, r, now);
    return *victim < 0 ? R_FULL : R_WAIT;
}

/* Write free record h for an arrival, admitted or queued with the next ticket, and count
 * it (ledger.Ledger._claim_record); the ticket is made ours. */
static void claim_record(Core *c, Ticket *tk, int p, int h, unsigned int pid, Now now, int futex, int decision,
                         uint32_t running, uint32_t waiting)
{
    long b = pbase(c, p);
    long hb = hbase(c, p, h);
    uint64_t serial = ld64(c, hb + HOLDER_SERIAL) + 1;
    uint64_t ticket = 0;
    if (decision == R_WAIT) {
        ticket = ld64(c, b + PROVIDER_NEXT_TICKET);
        if (ticket != UINT64_MAX) /* written to the top: it stays there, never wraps */
            ticket++;
        st64(c, b + PROVIDER_NEXT_TICKET, ticket);
    }
    st64(c, hb + HOLDER_SERIAL, serial);
    st32(c, hb + HOLDER_MEMBER, (uint32_t)c->member);
    st32(c, hb + HOLDER_PID, pid);
    st64(c, hb + HOLDER_MEMBER_SERIAL, c->member_serial);
    st32(c, hb + HOLDER_TOKENS, tk->tokens);
    st64(c, hb + HOLDER_TICKET, ticket);
    std_(c, hb + HOLDER_SINCE, now.wall);
    std_(c, hb + HOLDER_SINCE_MONO, now.mono);
    st32(c, hb + HOLDER_WAKER, futex ? WAKE_FUTEX : WAKE_DOORBELL);
    st8(c, hb + HOLDER_CLS, stored_class(c, p, tk->cls));
    st8(c, hb + HOLDER_DISPLACED, 0);
    /* the ticket is ours before the lock is let go: an exception that lands after
     * this call returns still finds it (R-A12) */
    tk->provider = p;
    tk->holder = h;
    tk->serial = serial;
    tk->fork_gen = c->fork_gen;
    tk->futex = futex;
    tk->live = 1;
    tk->running = decision == R_ADMIT;
    if (decision == R_ADMIT) {
        st32(c, hb + HOLDER_STATE, RUNNING); /* state last */
        put_counts(c, b, running + 1, waiting);
        add_tokens(c, b, tk->tokens);
        note_peak(c, b, PROVIDER_PEAK_RUNNING, running + 1);
        inc64(c, b + PROVIDER_ADMITTED_TOTAL);
    } else {
        st32(c, hb + HOLDER_STATE, WAITING);
        put_counts(c, b, running, waiting + 1);
        note_peak(c, b, PROVIDER_PEAK_WAITING, waiting + 1);
    }
}

/* The arrival section (ledger.Ledger.arrive): FIFO without classes in force; with them
 * (class k), a pump first (a waiter may have been promoted meanwhile), then the class
 * runs at once when it may, else queues, displacing the newest waiter of the lowest rank
 * below k from a full queue. */
static int arrive_locked(Core *c, Ticket *tk, int p, unsigned int pid, Now now, int may_wait, int futex,
                         Rings *rings)
{
    if (c->member < 0 || c->closing)
        return R_CLOSED; /* unregistered or closing meanwhile: nothing may run (R-A14) */
    long b = pbase(c, p);
    if (too_large(c, b, tk->tokens, now.mono))
        return R_TOO_LARGE; /* no worker could hold it: refused at once, never queued */
    int k = resolve_class(c, p, tk->cls);
    int count = classes_in_force(c, p);
    if (counters_damaged(c, b) && recount_provider(c, p))
        note_damage(c, "provider counters were written over");
    Rules r;
    if (count)
        pump(c, p, now, rings, NULL);
    class_rules(c, p, count, &r);
    int decision = R_FULL;
    for (int attempt = 0; attempt < 2; attempt++) {
        uint32_t running = ld32(c, b + PROVIDER_RUNNING);
        uint32_t waiting = ld32(c, b + PROVIDER_WAITING);
        uint32_t limit = (uint32_t)limit_value(c, p, now.mono);
        uint32_t budget = token_limit_in_force(c, b, now.mono);
        int fits = tokens_fit(ld32(c, b + PROVIDER_TOKENS_RUNNING), tk->tokens, budget);
        int victim = -1;
        if (count)
            decision = decide_classed(c, p, k, &r, running, waiting, limit, now.mono, fits, budget, &victim);
        else
            decision = decide_arrival(running, waiting, limit, (uint32_t)QUEUE_BOUND, fits);
        int h = decision != R_FULL ? first_free(c, p) : -1;
        if (h < 0)
            h = victim;
        if (h < 0)
            decision = R_FULL;
        if (decision == R_FULL && attempt == 0) {
            /* Before refusing: are the counters true? (Dead places are the sweep's.) */
            if (recount_provider(c, p))
                note_damage(c, "provider counters disagreed with the records");
            continue;
        }
        if (decision == R_FULL) {
            inc64(c, b + PROVIDER_REJECTED_TOTAL);
            break;
        }
        if (decision == R_WAIT && !may_wait) {
            decision = R_WAIT_REFUSED;
            break;
        }
        if (victim >= 0) {
            long vb = hbase(c, p, victim);
            free_record(c, vb);
            st8(c, vb + HOLDER_DISPLACED, 1);
            waiting--;
            put_counts(c, b, running, waiting);
            inc64(c, b + PROVIDER_DISPLACED_TOTAL);
            inc64(c, b + PROVIDER_REJECTED_TOTAL);
            ring_record(c, rings, vb);
        }
        claim_record(c, tk, p, h, pid, now, futex, decision, running, waiting);
        if (decision == R_ADMIT && count)
            bump_class(c, p, k);
        break;
    }
    return decision;
}

/* The leave section (ledger.Ledger.leave): free the ticket's record if it is still ours.
 * 0 stale, 1 was running, 2 was waiting. */
static int leave_locked(Core *c, Ticket *tk, int outcome, Now now, Rings *rings)
{
    int was = 0;
    int p = tk->provider;
    long b = pbase(c, p);
    long hb = hbase(c, p, tk->holder);
    uint32_t state = ld32(c, hb + HOLDER_STATE);
    if (ld64(c, hb + HOLDER_SERIAL) == tk->serial && (state == RUNNING || state == WAITING) &&
        ldi32(c, hb + HOLDER_MEMBER) == c->member &&
        ld64(c, hb + HOLDER_MEMBER_SERIAL) == c->member_serial) {
        if (counters_damaged(c, b) && recount_provider(c, p))
            note_damage(c, "provider counters were written over");
        free_record(c, hb);
        uint32_t running = ld32(c, b + PROVIDER_RUNNING);
        uint32_t waiting = ld32(c, b + PROVIDER_WAITING);
        if (state == RUNNING) {
            put_counts(c, b, running ? running - 1 : 0, waiting);
            uint32_t tokens = ld32(c, b + PROVIDER_TOKENS_RUNNING), charge = ld32(c, hb + HOLDER_TOKENS);
            st32(c, b + PROVIDER_TOKENS_RUNNING, tokens > charge ? tokens - charge : 0);
            note_hold(c, b, now.mono - ldd(c, hb + HOLDER_SINCE_MONO));
            was = 1;
        } else {
            put_counts(c, b, running, waiting ? waiting - 1 : 0);
            was = 2;
        }
        if (outcome == OUT_TIMEOUT)
            inc64(c, b + PROVIDER_TIMEOUTS_TOTAL);
        else if (outcome == OUT_CANCELLED)
            inc64(c, b + PROVIDER_CANCELLED_TOTAL);
        pump(c, p, now, rings, NULL);
    }
    return was;
}

/* Free provider p's records of registration (m, serial) that wait, and those that run
 * too when running_too (ledger.Ledger._free_own_records); how many. *running_freed, when
 * given, counts the running ones among them. */
static uint32_t free_own_records(Core *c, int p, int m, uint64_t serial, int running_too,
                                 uint32_t *running_freed)
{
    uint32_t freed = 0;
    for (int h = 0; h < HOLDERS_PER_PROVIDER; h++) {
        long hb = hbase(c, p, h);
        uint32_t s = ld32(c, hb + HOLDER_STATE);
        if ((s == WAITING || (s == RUNNING && running_too)) && ldi32(c, hb + HOLDER_MEMBER) == m &&
            ld64(c, hb + HOLDER_MEMBER_SERIAL) == serial) {
            if (s == RUNNING && running_freed)
                (*running_freed)++;
            free_record(c, hb);
            freed++;
        }
    }
    return freed;
}

/* Free this registration's WAITING records, as cancellations (ledger.cancel_waiting):
 * what close() does first, so that nothing of ours can be granted any more (R-A14). */
static uint32_t cancel_own_waiting(Core *c, Now now, Rings *rings)
{
    uint32_t freed = 0;
    for (int p = 0; p < PROVIDER_COUNT; p++) {
        long b = pbase(c, p);
        if (!ld32(c, b + PROVIDER_IN_USE))
            continue;
        uint32_t here = free_own_records(c, p, c->member, c->member_serial, 0, NULL);
        if (here) {
            freed += here;
            st64(c, b + PROVIDER_CANCELLED_TOTAL, ld64(c, b + PROVIDER_CANCELLED_TOTAL) + here);
            recount_provider(c, p);
            pump(c, p, now, rings, NULL);
        }
    }
    return freed;
}

/* The waiter that may run with the highest rank and the oldest ticket
 * (ledger.Ledger._best_waiter): -1 none; *anyone: some record waits at all. */
static int best_waiter(Core *c, int p, uint32_t running, const uint32_t *run, uint32_t limit, const Rules *r,
                       double now, int *cls, int *promoted_only, int *anyone)
{
    int best = -1, best_rank = 0;
    uint64_t best_ticket = 0;
    *anyone = 0;
    for (int h = 0; h < HOLDERS_PER_PROVIDER; h++) {
        long hb = hbase(c, p, h);
        if (ld32(c, hb + HOLDER_STATE) != WAITING)
            continue;
        *anyone = 1;
        int k, promoted;
        int rank = record_rank(c, p, hb, r, now, &k, &promoted);
        if (!may_run(r, k, promoted, running, run, limit))
            continue;
        uint64_t t = ld64(c, hb + HOLDER_TICKET);
        if (best < 0 || rank < best_rank || (rank == best_rank && t < best_ticket)) {
            best = h;
            best_rank = rank;
            best_ticket = t;
            *cls = k;
            *promoted_only = promoted && !may_run(r, k, 0, running, run, limit);
        }
    }
    return best;
}

/* May the waiting record at hb be granted as far as tokens go (ledger.Ledger._tokens_allow)?
 * Its charge fits beside the tokens running, or its owner is dead (the grant reclaims it). */
static int tokens_allow(Core *c, long b, long hb, uint32_t budget, AliveCache *cache)
{
    return tokens_fit(ld32(c, b + PROVIDER_TOKENS_RUNNING), ld32(c, hb + HOLDER_TOKENS), budget) ||
           !holder_alive(c, hb, cache);
}

/* Grant the waiting record at hb (ledger.Ledger._grant): RUNNING from now, its owner
 * woken after the section, its tokens counted; a dead one is reclaimed instead, never
 * granted. 1: granted. */
static int grant(Core *c, long b, long hb, Now now, Rings *rings, AliveCache *cache)
{
    if (!holder_alive(c, hb, cache)) {
        free_record(c, hb);
        inc64(c, b + PROVIDER_RECLAIMED_TOTAL);
        return 0;
    }
    add_tokens(c, b, ld32(c, hb + HOLDER_TOKENS));
    std_(c, hb + HOLDER_SINCE, now.wall);
    std_(c, hb + HOLDER_SINCE_MONO, now.mono);
    st32(c, hb + HOLDER_STATE, RUNNING);
    ring_record(c, rings, hb);
    inc64(c, b + PROVIDER_ADMITTED_TOTAL);
    return 1;
}

/* Grant, while some waiter may run, the one of the highest rank, oldest first
 * (ledger.Ledger._pump_classed); a dead one is reclaimed, never granted. */
static void pump_classed(Core *c, int p, uint32_t running, uint32_t waiting, uint32_t limit, Now now,
                         Rings *rings, AliveCache *cache)
{
    long b = pbase(c, p);
    Rules r;
    class_rules(c, p, classes_in_force(c, p), &r);
    uint32_t run[CLASS_COUNT];
    class_running(c, p, run);
    uint32_t budget = token_limit_in_force(c, b, now.mono);
    int recounted = 0;
    while (running < limit && waiting > 0) {
        int k = 0, promoted_only = 0, anyone = 0;
        int h = best_waiter(c, p, running, run, limit, &r, now.mono, &k, &promoted_only, &anyone);
        if (h < 0) {
            if (anyone || recounted)
                break; /* nobody who waits may run */
            recounted = 1; /* somebody waits by the counters and no record does */
            recount_provider(c, p);
            running = ld32(c, b + PROVIDER_RUNNING);
            waiting = ld32(c, b + PROVIDER_WAITING);
            continue;
        }
        if (!tokens_allow(c, b, hbase(c, p, h), budget, cache))
            break; /* strict order: the best waiter waits for tokens, and those behind it */
        waiting--;
        if (!grant(c, b, hbase(c, p, h), now, rings, cache))
            continue;
        running++;
        run[k]++;
        bump_class(c, p, k);
        if (promoted_only)
            inc64(c, b + PROVIDER_PROMOTED_TOTAL);
    }
    put_counts(c, b, running, waiting);
    note_peak(c, b, PROVIDER_PEAK_RUNNING, running);
}

/* Grant head waiters while there is room; a dead head is reclaimed, never granted. */
static void pump(Core *c, int p, Now now, Rings *rings, AliveCache *cache)
{
    long b = pbase(c, p);
    if (counters_damaged(c, b) && recount_provider(c, p))
        note_damage(c, "provider counters were written over");
    uint32_t running = ld32(c, b + PROVIDER_RUNNING);
    uint32_t waiting = ld32(c, b + PROVIDER_WAITING);
    if (waiting == 0)
        return;
    uint32_t limit = (uint32_t)limit_value(c, p, now.mono);
    if (classes_in_force(c, p)) {
        pump_classed(c, p, running, waiting, limit, now, rings, cache);
        return;
    }
    uint32_t budget = token_limit_in_force(c, b, now.mono);
    int recounted = 0;
    while (running < limit && waiting > 0) {
        /* somebody waits by the counters and no record does: the records decide, once */
        int h = head_waiter(c, p);
        if (h < 0) {
            if (recounted)
                break;
            recounted = 1;
            recount_provider(c, p);
            running = ld32(c, b + PROVIDER_RUNNING);
            waiting = ld32(c, b + PROVIDER_WAITING);
            continue;
        }
        if (!tokens_allow(c, b, hbase(c, p, h), budget, cache))
            break; /* strict order: the head waits for tokens, and those behind it too */
        waiting--;
        if (grant(c, b, hbase(c, p, h), now, rings, cache))
            running++;
    }
    put_counts(c, b, running, waiting);
    note_peak(c, b, PROVIDER_PEAK_RUNNING, running);
}

/* Pump every provider in use (ledger.Ledger.pump_all): after limits changed. */
static void pump_all(Core *c, Now now, Rings *rings)
{
    for (int p = 0; p < PROVIDER_COUNT; p++)
        if (ld32(c, pbase(c, p) + PROVIDER_IN_USE))
            pump(c, p, now, rings, NULL);
}

/* Free every record of dead processes (and their member rows); then grant. */
static uint32_t reap(Core *c, Now now, Rings *rings)
{
    AliveCache cache;
    memset(cache.held, -1, sizeof cache.held);
    uint32_t reclaimed = 0;
    for (int p = 0; p < PROVIDER_COUNT; p++) {
        long b = pbase(c, p);
        if (!ld32(c, b + PROVIDER_IN_USE))
            continue;
        uint32_t freed = 0;
        for (int h = 0; h < HOLDERS_PER_PROVIDER; h++) {
            long hb = hbase(c, p, h);
            if (ld32(c, hb + HOLDER_STATE) != FREE && !holder_alive(c, hb, &cache)) {
                free_record(c, hb);
                freed++;
            }
        }
        if (freed) {
            reclaimed += freed;
            st64(c, b + PROVIDER_RECLAIMED_TOTAL, ld64(c, b + PROVIDER_RECLAIMED_TOTAL) + freed);
            recount_provider(c, p);
        }
        pump(c, p, now, rings, &cache);
    }
    for (int m = 0; m < MEMBER_COUNT; m++) {
        long mb = mbase(c, m);
        if (ld32(c, mb + MEMBER_IN_USE) && !member_byte_held(c, m, &cache))
            free_member_row(c, m, rings);
    }
    if (count_older_members(c)) /* a 3.0 handler registered by its own core: one FIFO */
        pump_all(c, now, rings);
    return reclaimed;
}

/* The sweep (R-A5, R-A16): reap, then check every provider's counters against its
 * records and values against their ranges, and record when it ran. Done at least every
 * SWEEP_S by whoever needs it first (a waiter, the sidecar's heartbeat): once per host,
 * not once per process. */
static uint32_t sweep(Core *c, Now now, Rings *rings)
{
    for (int p = 0; p < PROVIDER_COUNT; p++) {
        long b = pbase(c, p);
        uint32_t in_use = ld32(c, b + PROVIDER_IN_USE);
        if (!in_use)
            continue;
        if (in_use != 1) { /* claimed (never freed), but not by a word of ours */
            st32(c, b + PROVIDER_IN_USE, 1);
            note_damage(c, "a provider row's in_use was written over");
        }
        if (ld32(c, b + PROVIDER_QUEUE_BOUND) != (uint32_t)QUEUE_BOUND) {
            st32(c, b + PROVIDER_QUEUE_BOUND, (uint32_t)QUEUE_BOUND);
            note_damage(c, "a provider's queue bound was written over");
        }
        if (recount_provider(c, p))
            note_damage(c, "provider counters disagreed with the records");
        if (ldi32(c, b + PROVIDER_PUBLISHED_LIMIT) >= 0 &&
            ldd(c, b + PROVIDER_EXPIRES_MONO) - now.mono > DEADLINE_SLACK_S) {
            st32(c, b + PROVIDER_PUBLISHED_LIMIT, (uint32_t)-1); /* never obeyed: the fallback */
            note_damage(c, "a published limit's deadline lies too far ahead");
        }
    }
    uint32_t reclaimed = reap(c, now, rings);
    for (int m = 0; m < MEMBER_COUNT; m++) {
        long mb = mbase(c, m);
        if (ld32(c, mb + MEMBER_IN_USE) > 1) { /* its lock byte is held: reap kept it */
            st32(c, mb + MEMBER_IN_USE, 1);
            note_damage(c, "a member row's in_use was written over");
        }
    }
    std_(c, HEADER_SWEEP_MONO, now.mono);
    return reclaimed;
}

/* Is a sweep due? Lock-free: a racing reader sees the old or the new time. */
static int sweep_due(Core *c)
{
    double last = ldd(c, HEADER_SWEEP_MONO);
    double now = deadline_clock();
    return !(now - last < SWEEP_S) || last > now + 1.0; /* garbage ahead: due */
}


/* Registered handlers that speak an older minor of this major
 * (ledger.Ledger._count_older_members): while one below 3.1 is, the classes are
 * suspended; while one below 3.2 is, the token budget. 1 when either just was; when the
 * last one below 3.2 left, every provider's tokens are recounted from the records. */
static int count_older_members(Core *c)
{
    uint32_t before = ld32(c, HEADER_OLDER_MEMBERS), tokenless_before = ld32(c, HEADER_TOKENLESS_MEMBERS);
    uint32_t older = 0, tokenless = 0;
    for (int m = 0; m < MEMBER_COUNT; m++) {
        long mb = mbase(c, m);
        if (!ld32(c, mb + MEMBER_IN_USE))
            continue;
        uint32_t major = *(uint16_t *)AT(c, mb + MEMBER_MAJOR), minor = *(uint16_t *)AT(c, mb + MEMBER_MINOR);
        if (major > LAYOUT_MAJOR)
            continue;
        older += major < LAYOUT_MAJOR || minor < 1;
        tokenless += major < LAYOUT_MAJOR || minor < 2;
    }
    st32(c, HEADER_OLDER_MEMBERS, older);
    st32(c, HEADER_TOKENLESS_MEMBERS, tokenless);
    if (tokenless_before && !tokenless)
        repair_all(c); /* their cores left tokens_running behind: the records say */
    return (before == 0 && older > 0) || (tokenless_before == 0 && tokenless > 0);
}

/* Free the member row of a process that is gone; its doorbell is removed after the
 * section (sem_unlink is a file system call). */
static void free_member_row(Core *c, int m, Rings *rings)
{
    long mb = mbase(c, m);
    st32(c, mb + MEMBER_IN_USE, 0);
    uint64_t bell = ld64(c, mb + MEMBER_BELL);
    if (bell && rings->nunlink < MAX_MEMBERS)
        rings->unlink[rings->nunlink++] = bell;
    st64(c, mb + MEMBER_BELL, 0);
}

/* Free one registration's live records, recount and grant. */
static void drop_member_records(Core *c, int m, uint64_t serial, Now now, Rings *rings, uint32_t *running_freed)
{
    for (int p = 0; p < PROVIDER_COUNT; p++) {
        long b = pbase(c, p);
        if (!ld32(c, b + PROVIDER_IN_USE))
            continue;
        if (free_own_records(c, p, m, serial, 1, running_freed)) {
            recount_provider(c, p);
            pump(c, p, now, rings, NULL);
        }
    }
}

/* The registration section (ledger.Ledger.register): claim a free member row, or the
 * row of a process that died (its records freed first), take its lock byte and write
 * the row, in_use last. Returns the row and sets ``*serial``; -1 when every row is
 * taken. */
static int register_locked(Core *c, unsigned int pid, double start, const char *label, Py_ssize_t label_len,
                           int major, int minor, uint64_t bell, Now now, Rings *rings, uint64_t *serial)
{
    Target *t = &targets[c->target];
    for (int m = 0; m < MEMBER_COUNT; m++) {
        long mb = mbase(c, m);
        uint64_t old = ld64(c, mb + MEMBER_SERIAL);
        if (ld32(c, mb + MEMBER_IN_USE)) {
            if (member_byte_held(c, m, NULL))
                continue;
            drop_member_records(c, m, old, now, rings, NULL); /* its owner died */
            free_member_row(c, m, rings);
        }
        if (t->own[m] != 0)
            continue;
        /* a process that inherited a dead owner's descriptor may still hold it */
        if (byte_lock(t->fd, c->kind, 1 + (off_t)m, F_WRLCK, 0) != 0)
            continue;
        *serial = old + 1;
        st32(c, mb + MEMBER_PID, pid);
        std_(c, mb + MEMBER_START, start);
        st64(c, mb + MEMBER_SERIAL, *serial);
        *(uint16_t *)AT(c, mb + MEMBER_MAJOR) = (uint16_t)major;
        *(uint16_t *)AT(c, mb + MEMBER_MINOR) = (uint16_t)minor;
        std_(c, mb + MEMBER_ATTACHED_AT, now.wall);
        memset(AT(c, mb + MEMBER_LABEL), 0, LABEL_BYTES);
        memcpy(AT(c, mb + MEMBER_LABEL), label, label_len);
        st64(c, mb + MEMBER_BELL, bell);
        st32(c, mb + MEMBER_IN_USE, 1); /* last */
        t->own[m] = *serial;
        c->member = m;
        c->member_serial = *serial;
        c->pid = pid;
        c->bell = bell;
        if (count_older_members(c))
            pump_all(c, now, rings); /* one FIFO from now on: grant what it allows */
        return m;
    }
    if (count_older_members(c))
        pump_all(c, now, rings);
    return -1;
}

/* The unregistration section (ledger.Ledger.unregister): every record of registration
 * (m, serial), the member row and its lock byte go at once. Returns the running records
 * it freed. */
static uint32_t unregister_locked(Core *c, int m, uint64_t serial, Now now, Rings *rings)
{
    Target *t = &targets[c->target];
    uint32_t cut = 0;
    c->member = -1; /* inside the section: an arrival waiting for the lock sees it */
    drop_member_records(c, m, serial, now, rings, &cut);
    long mb = mbase(c, m);
    if (ld64(c, mb + MEMBER_SERIAL) == serial) {
        st32(c, mb + MEMBER_IN_USE, 0);
        st64(c, mb + MEMBER_BELL, 0);
    }
    count_older_members(c);
    t->own[m] = 0;
    byte_lock(t->fd, c->kind, 1 + (off_t)m, F_UNLCK, 0);
    return cut;
}

/* The head of a class row as a writer gives it (writer.CLASS_ROW): name, reserve, cap,
 * maxWait; the admission counter after it is the core's. */
#define CLASS_SPEC_BYTES CLASS_ADMITTED_TOTAL

/* The provider section (ledger.Ledger.ensure_provider): the row whose id is ``padded``
 * (ID_BYTES, NUL-padded, matched in full), or a free row claimed for it with its class
 * table (``nclasses`` rows of CLASS_SPEC_BYTES, and the default class) in the same step,
 * in_use last (``*created`` = 1): no arrival ever sees the row without its classes.
 * Returns the row; -1 when the table is full. */
static int ensure_provider_locked(Core *c, const char *padded, int fallback, int source, int flags, int bound,
                                  const char *reason, Py_ssize_t reason_len, const char *classes, int nclasses,
                                  uint32_t default_class, int *created)
{
    for (int p = 0; p < PROVIDER_COUNT; p++) {
        long b = pbase(c, p);
        if (ld32(c, b + PROVIDER_IN_USE)) {
            if (memcmp(AT(c, b + PROVIDER_ID), padded, ID_BYTES) == 0)
                return p;
            continue;
        }
        memcpy(AT(c, b + PROVIDER_ID), padded, ID_BYTES);
        st32(c, b + PROVIDER_QUEUE_BOUND, (uint32_t)bound);
        put_counts(c, b, 0, 0);
        st32(c, b + PROVIDER_PUBLISHED_LIMIT, (uint32_t)-1);
        st32(c, b + PROVIDER_DISCOVERED, (uint32_t)-1);
        st32(c, b + PROVIDER_FALLBACK_LIMIT, (uint32_t)fallback);
        st32(c, b + PROVIDER_FALLBACK_SOURCE, (uint32_t)source);
        st32(c, b + PROVIDER_FLAGS, (uint32_t)flags);
        memset(AT(c, b + PROVIDER_REASON), 0, REASON_BYTES);
        memcpy(AT(c, b + PROVIDER_REASON), reason, reason_len);
        for (int k = 0; k < CLASS_COUNT; k++) {
            long cb = cbase(c, p, k);
            if (k < nclasses)
                memcpy(AT(c, cb), classes + (long)k * CLASS_SPEC_BYTES, CLASS_SPEC_BYTES);
            else
                memset(AT(c, cb), 0, CLASS_SPEC_BYTES);
        }
        st32(c, b + PROVIDER_DEFAULT_CLASS, default_class);
        st32(c, b + PROVIDER_CLASS_COUNT, (uint32_t)nclasses);
        st32(c, b + PROVIDER_IN_USE, 1); /* last */
        *created = 1;
        return p;
    }
    return -1;
}

/* The transaction section (Core.transact, ledger.Ledger.transact): when every guard's
 * bytes match, apply every write in order, relabel the records of every class table
 * written over, then sweep (``do_sweep``) or pump every provider (``do_pump``). 1
 * applied, 0 a guard differed (nothing written). */
typedef struct { long off; Py_ssize_t len; const char *src; } Patch;

#define CLASS_NAME_BYTES (CLASS_RESERVE - CLASS_NAME) /* the name field, NUL-padded */

/* A provider's class names as its rows hold them (the first ``count``, at most
 * CLASS_COUNT; the rest zero). */
typedef struct { uint32_t count; char name[CLASS_COUNT][CLASS_NAME_BYTES]; } ClassNames;

static void class_names(Core *c, int p, ClassNames *n)
{
    uint32_t count = ld32(c, pbase(c, p) + PROVIDER_CLASS_COUNT);
    n->count = count < CLASS_COUNT ? count : CLASS_COUNT;
    memset(n->name, 0, sizeof n->name);
    for (uint32_t k = 0; k < n->count; k++)
        memcpy(n->name[k], AT(c, cbase(c, p, (int)k) + CLASS_NAME), CLASS_NAME_BYTES);
}

/* The class table of ``p`` was written over (ledger.Ledger._relabel): every running and
 * waiting record keeps the class it asked for, found by its whole name in the new rows
 * (whatever row it moved to); a record whose class is gone, or that counted in the
 * default class, holds 0: the default class, resolved when read. */
static void relabel(Core *c, int p, const ClassNames *was)
{
    ClassNames is;
    class_names(c, p, &is);
    if (is.count == was->count && memcmp(is.name, was->name, sizeof is.name) == 0)
        return;
    for (int h = 0; h < HOLDERS_PER_PROVIDER; h++) {
        long hb = hbase(c, p, h);
        uint32_t state = ld32(c, hb + HOLDER_STATE), v = ld8(c, hb + HOLDER_CLS), to = 0;
        if ((state != RUNNING && state != WAITING) || v == 0)
            continue;
        for (uint32_t k = 0; v - 1 < was->count && k < is.count && !to; k++)
            if (memcmp(was->name[v - 1], is.name[k], CLASS_NAME_BYTES) == 0)
                to = k + 1;
        if (to != v)
            st8(c, hb + HOLDER_CLS, to);
    }
}

static int transact_locked(Core *c, const Patch *g, Py_ssize_t ng, const Patch *w, Py_ssize_t nw, int do_pump,
                           int do_sweep, Now now, Rings *rings)
{
    for (Py_ssize_t i = 0; i < ng; i++)
        if (memcmp(AT(c, g[i].off), g[i].src, g[i].len) != 0)
            return 0;
    ClassNames was[PROVIDER_COUNT];
    int used[PROVIDER_COUNT];
    for (int p = 0; p < PROVIDER_COUNT; p++)
        if ((used[p] = nw > 0 && ld32(c, pbase(c, p) + PROVIDER_IN_USE) != 0))
            class_names(c, p, &was[p]);
    for (Py_ssize_t i = 0; i < nw; i++)
        memcpy(AT(c, w[i].off), w[i].src, w[i].len);
    for (int p = 0; p < PROVIDER_COUNT; p++)
        if (used[p])
            relabel(c, p, &was[p]);
    if (do_sweep)
        sweep(c, now, rings);
    else if (do_pump)
        pump_all(c, now, rings);
    return 1;
}

/* ===== 5. the lock ======================================================================
 *   KIND_ROBUST  a process-shared robust pthread mutex inside the header (Linux). The
 *                kernel marks it when its owner dies (EOWNERDEAD); it is never taken
 *                from a live owner, however long that owner is paused.
 *   KIND_FILE    an fcntl record lock on byte 0 of a lock file beside the segment (macOS,
 *                where a shm_open descriptor cannot be locked and robust mutexes do not
 *                exist; forced on Linux for the tests). The kernel drops it when the
 *                process dies. Record locks belong to the process, so threads of one
 *                process are kept apart by an in-process mutex first.
 * A holder that dies inside a section leaves header.dirty = 1: the next holder recounts
 * running/waiting from the holder records (R-A6). A lock word no pthread call of ours
 * can have written is refused before glibc sees it (R-A16). */

#if HAVE_ROBUST && defined(__GLIBC__)
static int template_kind = -1; /* __kind of a process-shared robust mutex, as glibc sets it */

static void learn_template_kind(void)
{
    pthread_mutex_t probe;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&probe, &a);
    template_kind = probe.__data.__kind;
    pthread_mutex_destroy(&probe);
    pthread_mutexattr_destroy(&a);
}

/* 1 when the mutex could be one pthread_mutex_init of ours made, 0 when its bytes say
 * otherwise (glibc aborts, or fails with EINVAL, or waits for good on such words). */
static int mutex_sane(const pthread_mutex_t *mu)
{
    if (template_kind < 0)
        learn_template_kind();
    int kind = __atomic_load_n(&mu->__data.__kind, __ATOMIC_RELAXED);
    unsigned int count = __atomic_load_n(&mu->__data.__count, __ATOMIC_RELAXED);
    return kind == template_kind && count <= 1; /* glibc keeps 1 in a robust one once locked */
}
#elif HAVE_ROBUST
static int mutex_sane(const void *mu) { (void)mu; return 1; }
#endif

/* One pause of a poll for a lock that has no timed wait (fcntl record locks): from 0.2 ms,
 * doubling to 2 ms, so that many waiters behind a stopped holder do not spin a core. */
static void short_nap(long *ns)
{
    struct timespec ts = {0, *ns};
    nanosleep(&ts, NULL);
    if (*ns < 2000000L)
        *ns *= 2;
}

#define E_DAMAGED_LOCK (-2)
#define E_LOST (-3) /* the segment was truncated under us: see lost() */
static int lost(Core *c);

/* 0: entered; 1: busy (try) or deadline passed; -1: error (errno); E_DAMAGED_LOCK.
 * ``deadline`` is on the deadline clock, 0 for none. */
static int enter(Core *c, int blocking, double deadline)
{
    if (lost(c))
        return E_LOST;
    if (c->kind == KIND_ROBUST) {
#if HAVE_ROBUST
        pthread_mutex_t *mu = (pthread_mutex_t *)AT(c, MUTEX_OFFSET);
        if (!mutex_sane(mu))
            return E_DAMAGED_LOCK;
        int rc;
        if (!blocking)
            rc = pthread_mutex_trylock(mu);
        else if (deadline > 0) {
            /* the deadline clock may be BOOTTIME; the wait is on MONOTONIC: convert */
            struct timespec ts;
            to_timespec(clock_read(CLOCK_MONOTONIC) + (deadline - deadline_clock()), &ts);
#if HAVE_CLOCKWAIT
            rc = pthread_mutex_clocklock(mu, CLOCK_MONOTONIC, &ts);
#else
            rc = pthread_mutex_timedlock(mu, &ts);
#endif
        } else
            rc = pthread_mutex_lock(mu);
        if (rc == EOWNERDEAD) { /* its holder died inside: dirty tells what to repair */
            pthread_mutex_consistent(mu);
            rc = 0;
        }
        if (rc == EBUSY || rc == ETIMEDOUT)
            return 1;
        if (rc == EINVAL || rc == ENOTRECOVERABLE)
            return E_DAMAGED_LOCK;
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
            while (pthread_mutex_trylock(&t->mu) != 0) {
                if (deadline_clock() >= deadline)
                    return 1;
                short_nap(&nap);
            }
        } else
            pthread_mutex_lock(&t->mu);
        int wait = blocking && deadline <= 0;
        while (byte_lock(t->fd, c->kind, 0, F_WRLCK, wait) != 0) {
            int e = errno;
            if (e == EAGAIN || e == EACCES) {
                if (!blocking || deadline_clock() >= deadline) {
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
    uint64_t seq = ld64(c, HEADER_CHANGE_SEQ);
    st64(c, HEADER_CHANGE_SEQ, seq % 2 == 0 ? seq + 1 : seq + 2); /* odd: readers retry */
    inc64(c, HEADER_LOCK_SEQ);
    if (ld32(c, HEADER_DIRTY)) { /* the last holder died mid-section (R-A6) */
        repair_all(c);
        st32(c, HEADER_REPAIRS, ld32(c, HEADER_REPAIRS) + 1);
        c->repaired++;
    }
    st32(c, HEADER_DIRTY, 1);
    return 0;
}

static void leave_lock(Core *c)
{
    st32(c, HEADER_DIRTY, 0);
    st64(c, HEADER_CHANGE_SEQ, ld64(c, HEADER_CHANGE_SEQ) + 1);
    if (c->kind == KIND_ROBUST) {
#if HAVE_ROBUST
        pthread_mutex_unlock((pthread_mutex_t *)AT(c, MUTEX_OFFSET));
#endif
    } else {
        Target *t = &targets[c->target];
        byte_lock(t->fd, c->kind, 0, F_UNLCK, 0);
        pthread_mutex_unlock(&t->mu);
    }
}

/* ===== 6. wake-ups ======================================================================
 * A granted record's owner is told after the lock is let go, one of two ways, chosen by
 * the owner when it arrived (the record's ``waker``):
 *   WAKE_FUTEX     its waiting thread sleeps on the record's state word itself (Linux):
 *                  one wake-up per hand-off, no name, nothing another user can touch.
 *   WAKE_DOORBELL  its process's doorbell, a named semaphore, is posted; the process's
 *                  dispatcher looks (async waiters everywhere, every waiter on macOS).
 * A doorbell's name comes from a random id its owner wrote into its member row when it
 * registered (names.doorbell_name): nobody who cannot read the segment can guess it,
 * and a doorbell of another segment or registration is never posted (R-A15). Where the
 * platform shows a semaphore's owner (Linux), a doorbell is posted only when its owner
 * is one this segment trusts (R-G6). */
static int bell_owner_ok(Core *c, const char *name)
{
    if (c->flags & F_NO_SEM_OWNER)
        return 1; /* macOS: unguessable names instead */
#ifdef __linux__
    char path[96];
    snprintf(path, sizeof path, "/dev/shm/sem.%s", name + 1);
    struct stat st;
    if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode) || (st.st_mode & (S_IWOTH | S_IROTH)))
        return 0;
    if (c->group >= 0 && (long)st.st_gid != c->group)
        return 0;
    for (int i = 0; i < c->nowners; i++)
        if (st.st_uid == c->owners[i])
            return 1;
    return 0;
#else
    return 1;
#endif
}

static void post_member(Core *c, int m)
{
    uint64_t bell = ld64(c, mbase(c, m) + MEMBER_BELL);
    if (bell == 0)
        return; /* no doorbell (not registered any more) */
    pthread_mutex_lock(&c->bell_mu);
    sem_t *s = c->bells[m];
    if (s == NULL || c->bell_ids[m] != bell) {
        if (s)
            sem_close(s);
        char name[40];
        snprintf(name, sizeof name, BELL_FORMAT, (unsigned long long)bell);
        s = bell_owner_ok(c, name) ? sem_open(name, 0) : SEM_FAILED;
        if (s == SEM_FAILED)
            s = NULL;
        c->bells[m] = s;
        c->bell_ids[m] = bell;
    }
    if (s)
        sem_post(s);
    pthread_mutex_unlock(&c->bell_mu);
}

#if HAVE_FUTEX
static long futex_op(void *addr, int op, uint32_t val, const struct timespec *rel)
{
    return syscall(SYS_futex, addr, op, val, rel, NULL, 0);
}
#endif

static void wake_records(Core *c, Rings *r)
{
#if HAVE_FUTEX
    for (int i = 0; i < r->nfutex; i++)
        futex_op(AT(c, r->futex[i]), FUTEX_WAKE, INT32_MAX, NULL);
    if (r->futex_overflow) /* more than one section's room: wake every futex waiter */
        for (int p = 0; p < PROVIDER_COUNT; p++)
            for (int h = 0; h < HOLDERS_PER_PROVIDER; h++) {
                long hb = hbase(c, p, h);
                if (ld32(c, hb + HOLDER_WAKER) == WAKE_FUTEX)
                    futex_op(AT(c, hb + HOLDER_STATE), FUTEX_WAKE, INT32_MAX, NULL);
            }
#else
    (void)c;
    (void)r;
#endif
}

static int rings_pending(const Rings *r)
{
    for (int w = 0; w < MAX_MEMBERS / 64; w++)
        if (r->bits[w])
            return 1;
    return r->nfutex || r->futex_overflow || r->nunlink;
}

static void deliver(Core *c, Rings *r)
{
    wake_records(c, r);
    for (int w = 0; w < MAX_MEMBERS / 64; w++) {
        uint64_t bits = r->bits[w];
        while (bits) {
            int m = w * 64 + __builtin_ctzll(bits);
            bits &= bits - 1;
            post_member(c, m);
        }
    }
    for (int i = 0; i < r->nunlink; i++) {
        char name[40];
        snprintf(name, sizeof name, BELL_FORMAT, (unsigned long long)r->unlink[i]);
        sem_unlink(name);
    }
}

/* Deliver the wake-ups collected in a section, with the GIL released; none is free. */
#define DELIVER(c, r)                                          \
    do {                                                       \
        if (rings_pending(r)) {                                \
            Py_BEGIN_ALLOW_THREADS                             \
            deliver((c), (r));                                 \
            Py_END_ALLOW_THREADS                               \
        }                                                      \
    } while (0)

/* ===== 7. bindings: the Core methods =====================================================
 * One Python call = one locked step of section 4: a method parses its arguments, enters
 * the lock, calls the step, leaves the lock, delivers the wake-ups and builds its result.
 * The lock is tried once with the GIL held: an uncontended lock then costs no GIL
 * hand-off, and the section (pure C, microseconds, never waiting) runs while no other
 * thread of this process runs at all. Only when the lock is busy is the GIL released,
 * and then the wait, the section and the unlock all happen before it is taken back: the
 * lock is never held while this thread waits for the GIL (R-A11). */

/* The segment was truncated under us: our mapping was mended by the SIGBUS handler
 * (_guard.h), or the name check saw the very object we mapped (same inode) smaller than
 * the layout. Treated as a segment removed by hand (R-A15): arrivals move, waiters are
 * told, leaves touch nothing, and no section is entered on it again. */
static int lost(Core *c)
{
    if (!c->lost && guard_damaged(c->guard)) {
        c->lost = 1;
        c->moved = 1;
    }
    return c->lost;
}

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

static PyObject *lock_error(Core *c, int rc)
{
    if (rc == E_LOST || lost(c))
        return PyErr_Format(CoreError,
                            "segment %s was truncated under this process (by hand, or by a member "
                            "of its group, who may write it): it is treated as removed; see "
                            "'gateway-capacity inspect --segment %s --check'",
                            c->name, c->name);
    if (rc == E_DAMAGED_LOCK)
        return PyErr_Format(DamagedLock,
                            "segment %s: its lock word is damaged (no lock call of ours wrote it); stop "
                            "its handlers and sidecar, then 'gateway-capacity inspect --segment %s "
                            "--unlink --force' and start them again",
                            c->name, c->name);
    return PyErr_Format(CoreError, "segment %s: lock: %s", c->name, strerror(errno));
}

#define LOCKED(c, blocking, deadline, rc, body)                \
    do {                                                      \
        BUSY_ADD(c, 1);                                       \
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
        BUSY_ADD(c, -1);                                      \
    } while (0)

/* Does target ``t`` carry ``stamp`` at STAMP_AT? Read through the table's descriptor
 * (opening and closing another would drop this process's record locks). */
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
    PyTypeObject *tp = Py_TYPE((PyObject *)c);
    if (!c->closed && c->target >= 0 && c->fork_gen == fork_generation)
        target_release(c->target);
    for (int m = 0; m < MAX_MEMBERS; m++)
        if (c->bells[m])
            sem_close(c->bells[m]);
    if (c->own_bell && c->fork_gen == fork_generation)
        sem_close(c->own_bell);
    if (c->have_view)
        PyBuffer_Release(&c->view);
    Py_XDECREF(c->slow_enter);
    Py_XDECREF(c->slow_aenter);
    Py_XDECREF(c->slow_aexit);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(c);
    Py_DECREF(tp);
}

/* The layout this core was built for (_layout.h, generated from layout.py). Core() is
 * handed layout.core_offsets() and refuses a layout that is not this one: a core built
 * before layout.py changed must be rebuilt, never read the segment at the old offsets. */
static const struct { const char *key; long value; } LAYOUT[] = {
#define LAYOUT_ENTRY(key, value) {key, value},
    LAYOUT_OFFSETS(LAYOUT_ENTRY)
#undef LAYOUT_ENTRY
};
#define NLAYOUT ((int)(sizeof LAYOUT / sizeof LAYOUT[0]))

/* 0 when ``offsets`` (layout.core_offsets()) is the layout compiled in, else -1 with
 * CoreError naming the first difference. */
static int check_layout(PyObject *offsets)
{
    for (int i = 0; i < NLAYOUT; i++) {
        PyObject *v = PyDict_GetItemString(offsets, LAYOUT[i].key);
        long have = v ? PyLong_AsLong(v) : -1;
        if (have == -1 && PyErr_Occurred())
            return -1;
        if (have != LAYOUT[i].value) {
            PyErr_Format(CoreError,
                         "the admission core was built for another layout (%s is %ld in the "
                         "build, %ld in layout.py): reinstall gateway-capacity, or rebuild the "
                         "core in a checkout",
                         LAYOUT[i].key, LAYOUT[i].value, have);
            return -1;
        }
    }
    return 0;
}

static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    Core *c = (Core *)alloc(type, 0);
    if (c) { /* zero is a real index: a Core never opened must release no one's target */
        c->target = -1;
        c->member = -1;
        c->group = -1;
        c->guard = -1;
    }
    return (PyObject *)c;
}

/* Core(buffer, offsets, kind, target, target_is_shm, segment, stamp, flags, owners,
 *      group, identity) */
static int Core_init(Core *c, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "offsets", "kind", "target", "target_is_shm", "segment", "stamp",
                             "flags", "owners", "group", "identity", NULL};
    PyObject *buffer, *offsets, *owners = NULL, *identity = NULL;
    int kind, is_shm, flags = 0;
    long group = -1;
    const char *target, *segment, *stamp = NULL;
    Py_ssize_t stamp_len = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!isps|y#iOlO", kwlist, &buffer, &PyDict_Type, &offsets,
                                     &kind, &target, &is_shm, &segment, &stamp, &stamp_len, &flags,
                                     &owners, &group, &identity))
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
    c->flags = flags;
    c->group = group;
    pthread_mutex_init(&c->bell_mu, NULL);
    if (check_layout(offsets) < 0)
        return -1;
    if (MEMBER_COUNT > MAX_MEMBERS) {
        PyErr_SetString(PyExc_ValueError, "too many members for the core");
        return -1;
    }
    if (owners && owners != Py_None) {
        PyObject *seq = PySequence_Tuple(owners);
        if (!seq)
            return -1;
        Py_ssize_t n = PyTuple_Size(seq);
        for (Py_ssize_t i = 0; i < n && c->nowners < MAX_OWNERS; i++) {
            long uid = PyLong_AsLong(PyTuple_GetItem(seq, i));
            if (uid == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return -1;
            }
            c->owners[c->nowners++] = (uid_t)uid;
        }
        Py_DECREF(seq);
    } else
        c->owners[c->nowners++] = geteuid();
    if (kind != KIND_FILE && !(kind == KIND_ROBUST && HAVE_ROBUST)) {
        PyErr_Format(CoreError, "lock kind %d is not available on this system", kind);
        return -1;
    }
    if (kind == KIND_ROBUST && MUTEX_SIZE < (long)sizeof(pthread_mutex_t)) {
        PyErr_SetString(PyExc_ValueError, "the header's mutex field is too small");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &c->view, PyBUF_WRITABLE) != 0)
        return -1;
    c->have_view = 1;
    c->base = c->view.buf;
    c->size = c->view.len;
    c->guard = guard_find(c->base);
    PyObject *slot = PyObject_GetAttrString(buffer, "_guard"); /* segment.Mapping's own */
    if (slot != NULL) {
        long i = PyLong_AsLong(slot);
        if (!(i == -1 && PyErr_Occurred()) && i >= 0 && i < MAX_GUARDS)
            c->guard = (int)i;
        Py_DECREF(slot);
    }
    PyErr_Clear();
    if (c->size < TOTAL_SIZE) {
        PyErr_SetString(PyExc_ValueError, "the buffer is smaller than the layout");
        return -1;
    }
    if (strlen(segment) >= sizeof c->name) {
        PyErr_SetString(PyExc_ValueError, "segment name too long");
        return -1;
    }
    strcpy(c->name, segment);
    if (identity && identity != Py_None) {
        unsigned long long dev, ino;
        if (!PyArg_ParseTuple(identity, "KK", &dev, &ino))
            return -1;
        c->seg_dev = (dev_t)dev;
        c->seg_ino = (ino_t)ino;
    }
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
    if (stamp_len > 0 && !stamp_matches(t, stamp, stamp_len)) {
        /* The lock file must be the one the segment's creator made (it wrote the stamp):
         * another file would lock nothing the others lock, and every other process's
         * members would look dead through it. */
        target_release(t);
        PyErr_Format(CoreError,
                     "lock file %s is not the one this segment was created with (another "
                     "lock directory, or the file was removed and made again); give every "
                     "process the same lock directory, or stop every process of this "
                     "gateway and remove the segment",
                     target);
        return -1;
    }
    c->target = t;
    return 0;
}

/* set_slow_paths(enter, aenter, aexit): the Python callables the slot context managers
 * call when the fast path (admitted at once / released at once) does not apply. */
static PyObject *Core_set_slow_paths(Core *c, PyObject *args)
{
    PyObject *e, *ae, *ax;
    if (!PyArg_ParseTuple(args, "OOO", &e, &ae, &ax))
        return NULL;
    Py_XDECREF(c->slow_enter);
    Py_XDECREF(c->slow_aenter);
    Py_XDECREF(c->slow_aexit);
    c->slow_enter = Py_NewRef(e);
    c->slow_aenter = Py_NewRef(ae);
    c->slow_aexit = Py_NewRef(ax);
    Py_RETURN_NONE;
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
    if (c->own_bell && c->fork_gen == fork_generation)
        sem_close(c->own_bell); /* no thread waits on it: busy was 0 */
    c->own_bell = NULL;
    if (c->have_view) {
        PyBuffer_Release(&c->view);
        c->have_view = 0;
    }
    Py_RETURN_NONE;
}

static double deadline_arg(double timeout)
{
    return timeout < 0 ? 0.0 : deadline_clock() + (timeout > 0 ? timeout : 1e-9);
}

/* 1 the name leads to the object we mapped, 0 it does not (removed or replaced by hand),
 * -1 cannot tell (R-A15). Opens and closes a descriptor of the shm object, which drops
 * no lock of ours (OFD locks belong to their own descriptions; the file kind locks the
 * lock file, not the object). */
/* Does ``fd`` (an object of ``size`` bytes) carry our creation stamp: the creator's
 * created_at, pid and start time, which no two creations share? How a segment instance
 * is told where the platform gives shm objects no identity: macOS's fstat of one fills
 * in mode, owner, group and size only (XNU pshm_stat), dev and ino are 0. */
static int same_creation(Core *c, int fd, off_t size)
{
    long fields[] = {HEADER_CREATED_AT, HEADER_CREATOR_PID, HEADER_CREATOR_START};
    long widths[] = {8, 4, 8};
    size_t len = 0;
    for (int i = 0; i < 3; i++)
        if ((size_t)(fields[i] + widths[i]) > len)
            len = (size_t)(fields[i] + widths[i]);
    if (size < (off_t)len)
        return 0; /* not even a header yet: a creation in progress, not ours */
    void *p = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return -1;
    int same = 1;
    for (int i = 0; i < 3; i++)
        same &= memcmp((char *)p + fields[i], c->base + fields[i], (size_t)widths[i]) == 0;
    munmap(p, len);
    return same;
}

static int name_leads_here(Core *c)
{
    if (lost(c))
        return 0;
    int fd = shm_open(c->name, O_RDONLY, 0);
    if (fd < 0)
        return errno == ENOENT ? 0 : -1;
    struct stat st;
    int answer = -1;
    if (fstat(fd, &st) == 0) {
        if (c->seg_ino != 0) { /* Linux: the object's device and inode */
            answer = st.st_dev == c->seg_dev && st.st_ino == c->seg_ino;
            if (answer && st.st_size < TOTAL_SIZE) { /* ours, truncated in place */
                c->lost = 1;
                c->moved = 1;
                answer = 0;
            }
        } else /* macOS (no identity given): its creation stamp */
            answer = same_creation(c, fd, st.st_size);
    }
    close(fd);
    return answer;
}

/* At most every SWEEP_S, an arrival compares the name with the mapping first: a handler
 * notices within one sweep that the name leads elsewhere (R-A15). */
static int name_moved(Core *c)
{
    if (c->moved)
        return 1;
    double now = deadline_clock();
    if (now - c->named_checked_at < SWEEP_S)
        return 0;
    c->named_checked_at = now;
    if (name_leads_here(c) == 0)
        c->moved = 1;
    return c->moved;
}

static void set_core(Ticket *tk, Core *c)
{
    if (tk->core != c) {
        Core *old = tk->core;
        tk->core = (Core *)Py_NewRef((PyObject *)c);
        Py_XDECREF((PyObject *)old);
    }
}

/* The arrival, on ticket ``tk``, as one call. Returns the decision, or -1 with an
 * exception set. */
static int do_arrive(Core *c, Ticket *tk, int p, unsigned int pid, double given, int may_wait, int blocking,
                     double timeout, int futex)
{
    if (!usable(c))
        return -1;
    if (p < 0 || p >= PROVIDER_COUNT || tk->live || tk->busy) {
        PyErr_SetString(PyExc_ValueError, "bad provider or a ticket in use");
        return -1;
    }
    if (futex && ((c->flags & F_NO_FUTEX) || !HAVE_FUTEX))
        futex = 0;
    if (!c->closing && (lost(c) || (given <= 0 && name_moved(c))))
        return R_MOVED; /* the caller moves to what the name leads to now */
    int rc, decision = R_FULL;
    double deadline = deadline_arg(timeout);
    Rings rings;
    memset(&rings, 0, sizeof rings);
    set_core(tk, c); /* ahead of the section: a live ticket always knows its core */
    tk->busy = 1;
    LOCKED(c, blocking, deadline, rc, {
        Now now = section_now(given);
        decision = arrive_locked(c, tk, p, pid, now, may_wait, futex, &rings);
    });
    tk->busy = 0;
    if (!c->closing && lost(c)) { /* truncated during the section: what it wrote is gone */
        tk->live = 0;
        tk->running = 0;
        return R_MOVED;
    }
    if (rc < 0 || rc == E_DAMAGED_LOCK) {
        lock_error(c, rc);
        return -1;
    }
    if (rc == 1)
        return R_BUSY;
    if (tk->live) {
        c->held++;
        if (tk->running)
            c->held_running++;
    }
    DELIVER(c, &rings);
    return decision;
}

/* A ticket's charge: 0..MAX_CHARGE tokens (ValueError otherwise; the shim refuses a
 * larger request with RequestTooLarge before it gets here). */
static int set_tokens(Ticket *t, PyObject *tokens)
{
    long long n = PyLong_AsLongLong(tokens);
    if (n == -1 && PyErr_Occurred())
        return -1;
    if (n < 0 || n > MAX_CHARGE) {
        PyErr_Format(PyExc_ValueError, "tokens must be 0..%d, not %lld", MAX_CHARGE, n);
        return -1;
    }
    t->tokens = (uint32_t)n;
    return 0;
}

/* A flag every caller must name (``may_wait=``, ``blocking=``): PyArg_ParseTupleAndKeywords
 * has no required keyword-only arguments, so it starts at -1 and is checked here. */
static int named(int flag, const char *call, const char *name)
{
    if (flag >= 0)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() missing required keyword-only argument: '%s'", call, name);
    return -1;
}

/* arrive(ticket, provider, pid, now, *, may_wait, blocking, timeout=-1.0, futex=False,
 * cls=None) -> code; ``cls`` (a class index, -1 the default) replaces the ticket's */
static PyObject *Core_arrive(Core *c, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ticket", "provider", "pid", "now", "may_wait", "blocking", "timeout", "futex", "cls",
                             "tokens", NULL};
    PyObject *tko, *cls = Py_None, *tokens = Py_None;
    int p, may_wait = -1, blocking = -1, futex = 0;
    unsigned int pid;
    double now, timeout = -1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!iId|$ppdpOO", kwlist, TicketType, &tko, &p, &pid, &now,
                                     &may_wait, &blocking, &timeout, &futex, &cls, &tokens))
        return NULL;
    if (named(may_wait, "arrive", "may_wait") < 0 || named(blocking, "arrive", "blocking") < 0)
        return NULL;
    if (cls != Py_None && !((Ticket *)tko)->live) {
        long k = PyLong_AsLong(cls);
        if (k == -1 && PyErr_Occurred())
            return NULL;
        ((Ticket *)tko)->cls = k < 0 || k >= CLASS_COUNT ? -1 : (int)k;
    }
    if (tokens != Py_None && !((Ticket *)tko)->live && set_tokens((Ticket *)tko, tokens) < 0)
        return NULL;
    int code = do_arrive(c, (Ticket *)tko, p, pid, now, may_wait, blocking, timeout, futex);
    return code < 0 ? NULL : PyLong_FromLong(code);
}

/* Bookkeeping after a ticket stopped being live. */
static void ticket_done(Core *c, Ticket *tk)
{
    if (tk->live) {
        c->held--;
        if (tk->running)
            c->held_running--;
    }
    tk->live = 0;
    tk->running = 0;
}

/* A leave on a truncated segment: there is no record left to free (the object's pages
 * are gone, ours read zeros); forget the ticket, as if it had been freed. */
static int leave_lost(Core *c, Ticket *tk)
{
    int was = tk->running ? 1 : 2;
    ticket_done(c, tk);
    return was;
}

/* leave ``tk`` with ``outcome``: -1 busy (non-blocking), 0 stale, 1 running, 2 waiting;
 * -2 with an exception set. */
static int do_leave(Ticket *tk, int outcome, double given, int blocking)
{
    Core *c = tk->core;
    if (!tk->live || tk->busy || c == NULL)
        return 0;
    if (c->closed || c->fork_gen != fork_generation || tk->fork_gen != c->fork_gen) {
        tk->live = 0; /* close() released it already, or a forked child's copy */
        tk->running = 0;
        return 0;
    }
    if (lost(c))
        return leave_lost(c, tk);
    int rc, was = 0;
    Rings rings;
    memset(&rings, 0, sizeof rings);
    tk->busy = 1; /* a second release in another thread is a no-op, never a double free */
    LOCKED(c, blocking, 0.0, rc, {
        Now now = section_now(given);
        was = leave_locked(c, tk, outcome, now, &rings);
    });
    tk->busy = 0;
    if ((rc < 0 || rc == E_DAMAGED_LOCK) && lost(c))
        return leave_lost(c, tk);
    if (rc < 0 || rc == E_DAMAGED_LOCK) {
        lock_error(c, rc);
        return -2;
    }
    if (rc == 1)
        return -1;
    ticket_done(c, tk);
    DELIVER(c, &rings);
    return was;
}

/* leave(ticket, outcome, now, *, blocking) -> -1 busy, 0 stale, 1 was running, 2 was waiting */
static PyObject *Core_leave(Core *c, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ticket", "outcome", "now", "blocking", NULL};
    PyObject *tko;
    int outcome, blocking = -1;
    double now;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!id|$p", kwlist, TicketType, &tko, &outcome, &now,
                                     &blocking))
        return NULL;
    if (named(blocking, "leave", "blocking") < 0)
        return NULL;
    Ticket *tk = (Ticket *)tko;
    if (tk->core != c || !tk->live)
        return PyLong_FromLong(0); /* another registration's ticket, or done: not ours */
    if (!c->closed && !usable(c))
        return NULL;
    int was = do_leave(tk, outcome, now, blocking);
    return was == -2 ? NULL : PyLong_FromLong(was);
}

/* The record's state while it is this ticket's, else FREE. Lock-free: every write of a
 * record is one aligned store, so a reader sees the old or the new value. */
static uint32_t ticket_state(Core *c, Ticket *tk)
{
    if (!tk->live || tk->core != c || c->closed)
        return FREE;
    long hb = hbase(c, tk->provider, tk->holder);
    uint32_t state = ld32(c, hb + HOLDER_STATE);
    if (ld64(c, hb + HOLDER_SERIAL) != tk->serial) /* taken meanwhile by another arrival */
        return FREE;
    return state;
}

/* Was the ticket's record displaced from a full queue by a higher class (R-A20)? Its
 * record is free with its serial and its displaced byte set. */
static int ticket_displaced(Core *c, Ticket *tk)
{
    if (!tk->live || tk->core != c || c->closed || tk->provider < 0 || tk->holder < 0)
        return 0;
    long hb = hbase(c, tk->provider, tk->holder);
    return ld64(c, hb + HOLDER_SERIAL) == tk->serial && ld32(c, hb + HOLDER_STATE) == FREE &&
           ld8(c, hb + HOLDER_DISPLACED) == 1;
}

static PyObject *Core_displaced(Core *c, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, TicketType)) {
        PyErr_SetString(PyExc_TypeError, "a Ticket");
        return NULL;
    }
    if (!usable(c))
        return NULL;
    return PyBool_FromLong(ticket_displaced(c, (Ticket *)arg));
}

static PyObject *Core_state(Core *c, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, TicketType)) {
        PyErr_SetString(PyExc_TypeError, "a Ticket");
        return NULL;
    }
    if (!usable(c))
        return NULL;
    Ticket *tk = (Ticket *)arg;
    uint32_t state = ticket_state(c, tk);
    if (state == RUNNING && tk->live && !tk->running) {
        tk->running = 1;
        c->held_running++;
    }
    return PyLong_FromLong(state);
}

/* A sweep if one is due, when the lock is free at once (a try: whoever has it is doing
 * something, maybe the sweep). Returns what it reclaimed; the GIL may be released. */
static uint32_t sweep_if_due(Core *c)
{
    uint32_t reclaimed = 0;
    if (!sweep_due(c))
        return 0;
    Rings rings;
    memset(&rings, 0, sizeof rings);
    BUSY_ADD(c, 1);
    int rc = enter(c, 0, 0.0);
    if (rc == 0) {
        if (sweep_due(c)) /* someone else may have swept between the look and the lock */
            reclaimed = sweep(c, section_now(0.0), &rings);
        leave_lock(c);
    }
    BUSY_ADD(c, -1);
    if (rc == 0)
        deliver(c, &rings);
    return reclaimed;
}

/* wait(ticket, timeout) -> W_*: the waiting thread sleeps on its record's state word
 * (Linux futex) until it is granted, freed, the timeout passes, close() or a move tells
 * it to stop. Every SWEEP_S it looks whether the host's sweep is due (R-A5) and does it.
 * The GIL is released throughout; a signal returns to Python long enough to run its
 * handlers (a KeyboardInterrupt then propagates, and the caller leaves the record). */
static PyObject *Core_wait(Core *c, PyObject *args)
{
    PyObject *tko;
    double timeout;
    if (!PyArg_ParseTuple(args, "O!d", TicketType, &tko, &timeout))
        return NULL;
    if (!usable(c))
        return NULL;
#if HAVE_FUTEX
    Ticket *tk = (Ticket *)tko;
    if (!tk->futex || tk->core != c) {
        PyErr_SetString(PyExc_ValueError, "wait() is for a ticket that arrived with futex=True");
        return NULL;
    }
    double deadline = timeout < 0 ? 0.0 : deadline_clock() + timeout;
    long hb = hbase(c, tk->provider, tk->holder);
    uint32_t *word = (uint32_t *)AT(c, hb + HOLDER_STATE);
    int result = 0;
    uint32_t reclaimed = 0;
    int on_main = PyThread_get_thread_ident() == main_thread;
    for (;;) {
        int interrupted = 0;
        BUSY_ADD(c, 1);
        Py_BEGIN_ALLOW_THREADS
        for (;;) {
            uint32_t word_now = __atomic_load_n(word, __ATOMIC_ACQUIRE);
            uint32_t state = ticket_state(c, tk);
            if (lost(c)) { /* what was read came from zero pages */
                result = W_MOVED;
                break;
            }
            if (state == RUNNING) {
                result = W_GRANTED;
                break;
            }
            if (state != WAITING) {
                result = ticket_displaced(c, tk) ? W_DISPLACED : W_GONE;
                break;
            }
            if (c->closing) {
                result = W_CLOSED;
                break;
            }
            if (c->moved) {
                result = W_MOVED;
                break;
            }
            double now = deadline_clock();
            if (deadline > 0 && now >= deadline) {
                result = W_TIMEOUT;
                break;
            }
            reclaimed += sweep_if_due(c);
            /* a little jitter, so that many waiters do not look all at once */
            double nap = SWEEP_S * (0.75 + 0.5 * ((double)(hb % 97) / 97.0));
            if (deadline > 0 && deadline - now < nap)
                nap = deadline - now;
            struct timespec rel;
            to_timespec(nap, &rel);
            long r = futex_op(word, FUTEX_WAIT, word_now, &rel); /* not WAITING: see ticket_state */
            if (r != 0 && errno == EINTR) {
                interrupted = 1;
                break;
            }
            if (on_main && r != 0 && errno == ETIMEDOUT) {
                /* a signal taken by another thread does not interrupt this wait: the
                 * main thread looks for pending handlers between naps (<= 0.5 s) */
                interrupted = 1;
                break;
            }
        }
        Py_END_ALLOW_THREADS
        BUSY_ADD(c, -1);
        if (!interrupted)
            break;
        if (PyErr_CheckSignals() < 0)
            return NULL; /* a handler raised: the caller's cleanup leaves the record */
    }
    if (result == W_GRANTED && !tk->running) {
        tk->running = 1;
        c->held_running++;
    }
    return Py_BuildValue("iI", result, reclaimed);
#else
    PyErr_SetString(PyExc_NotImplementedError, "futex waits need Linux");
    return NULL;
#endif
}

/* dispatch(period, watched, always=False) -> (changed, reclaimed, posts): this process's
 * doorbell waiter. Sleeps on the doorbell and comes back to Python only when there is
 * something to do: a post (a grant for a watched ticket, a new watch, close), a move, a
 * reclaim to report, or, when ``period`` >= 0, every ``period`` seconds while it watches
 * or holds anything (``always``: even when not), so that Python can look for requests
 * whose event loop is gone. While this process holds or watches anything it keeps the
 * host's sweep going (R-A5): where the platform has timed semaphore waits the doorbell
 * wait times out every SWEEP_S, in C, without the GIL; elsewhere (macOS) a ticker posts.
 * Returns the tickets of ``watched`` whose records are not WAITING any more (granted,
 * freed), or all of them when closing or moved. */
static PyObject *Core_dispatch(Core *c, PyObject *args)
{
    double period;
    PyObject *watched;
    int always = 0;
    if (!PyArg_ParseTuple(args, "dO|p", &period, &watched, &always))
        return NULL;
    if (!usable(c))
        return NULL;
    if (c->own_bell == NULL) {
        PyErr_SetString(CoreError, "not registered");
        return NULL;
    }
    PyObject *seq = PySequence_Tuple(watched);
    if (!seq)
        return NULL;
    int nwatched = (int)PyTuple_Size(seq);
    sem_t *bell = c->own_bell;
    int posts = 0;
    uint32_t reclaimed = 0;
    int timed = HAVE_TIMEDWAIT && !(c->flags & F_NO_SEM_TIMEOUT);
    BUSY_ADD(c, 1);
    Py_BEGIN_ALLOW_THREADS
    double started = deadline_clock();
    for (;;) {
        int rc;
#if HAVE_TIMEDWAIT
        if (timed) {
            struct timespec ts;
#if HAVE_CLOCKWAIT
            to_timespec(clock_read(CLOCK_MONOTONIC) + SWEEP_S, &ts);
            rc = sem_clockwait(bell, CLOCK_MONOTONIC, &ts);
#else
            to_timespec(clock_read(CLOCK_REALTIME) + SWEEP_S, &ts);
            rc = sem_timedwait(bell, &ts);
#endif
        } else
#endif
            rc = sem_wait(bell);
        if (rc == 0)
            posts++;
        while (sem_trywait(bell) == 0)
            posts++;
        if (c->closing)
            break;
        if (c->held > 0 || nwatched > 0) {
            reclaimed += sweep_if_due(c);
            if (nwatched > 0 || c->held > 0)
                name_moved(c); /* a process that only waits or holds notices a move too */
        }
        if (posts || reclaimed || lost(c) || c->moved || !timed)
            break;
        if (period >= 0 && (always || nwatched > 0 || c->held > 0) &&
            deadline_clock() - started >= period)
            break;
    }
    Py_END_ALLOW_THREADS
    BUSY_ADD(c, -1);
    PyObject *changed = PyList_New(0);
    for (Py_ssize_t i = 0; changed && i < nwatched; i++) {
        PyObject *o = PyTuple_GetItem(seq, i);
        if (!PyObject_TypeCheck(o, TicketType))
            continue;
        Ticket *tk = (Ticket *)o;
        if (c->closing || c->moved || ticket_state(c, tk) != WAITING)
            if (PyList_Append(changed, o) < 0)
                Py_CLEAR(changed);
    }
    Py_DECREF(seq);
    if (!changed)
        return NULL;
    return Py_BuildValue("NIi", changed, reclaimed, posts);
}

/* post_own(): wake this process's dispatcher (a new watch, close, a move). */
static PyObject *Core_post_own(Core *c, PyObject *unused)
{
    if (c->own_bell && c->fork_gen == fork_generation)
        sem_post(c->own_bell);
    Py_RETURN_NONE;
}

/* Wake every thread of ours that waits on a record of this core (close, move). */
static void wake_own_waiters(Core *c)
{
#if HAVE_FUTEX
    if (c->member < 0)
        return;
    for (int p = 0; p < PROVIDER_COUNT; p++) {
        if (!ld32(c, pbase(c, p) + PROVIDER_IN_USE))
            continue;
        for (int h = 0; h < HOLDERS_PER_PROVIDER; h++) {
            long hb = hbase(c, p, h);
            if (ld32(c, hb + HOLDER_STATE) == WAITING && ldi32(c, hb + HOLDER_MEMBER) == c->member &&
                ld32(c, hb + HOLDER_WAKER) == WAKE_FUTEX)
                futex_op(AT(c, hb + HOLDER_STATE), FUTEX_WAKE, INT32_MAX, NULL);
        }
    }
#else
    (void)c;
#endif
}

/* begin_close(now) -> waiting records freed: refuse every arrival from now on, free this
 * registration's WAITING records (no grant can reach them after this), and tell every
 * waiter of ours; running records stay until their bodies end or close() cuts them. */
static PyObject *Core_begin_close(Core *c, PyObject *args)
{
    double given;
    if (!PyArg_ParseTuple(args, "d", &given))
        return NULL;
    c->closing = 1;
    if (c->closed || c->fork_gen != fork_generation || c->member < 0)
        return PyLong_FromLong(0);
    int rc;
    uint32_t freed = 0;
    Rings rings;
    memset(&rings, 0, sizeof rings);
    Py_BEGIN_ALLOW_THREADS
    wake_own_waiters(c); /* before the records are freed: they are still WAITING here */
    Py_END_ALLOW_THREADS
    LOCKED(c, 1, 0.0, rc, { freed = cancel_own_waiting(c, section_now(given), &rings); });
    if (rc < 0 || rc == E_DAMAGED_LOCK)
        return lock_error(c, rc);
    Py_BEGIN_ALLOW_THREADS
    if (c->own_bell)
        sem_post(c->own_bell);
    Py_END_ALLOW_THREADS
    DELIVER(c, &rings);
    return PyLong_FromUnsignedLong(freed);
}

/* retire(): the segment's name leads elsewhere now; waiters here move (R-A15). */
static PyObject *Core_retire(Core *c, PyObject *unused)
{
    c->moved = 1;
    if (c->closed || c->fork_gen != fork_generation)
        Py_RETURN_NONE;
    BUSY_ADD(c, 1); /* the retired attachment's dispatcher may close it meanwhile: not under us */
    Py_BEGIN_ALLOW_THREADS
    if (!lost(c)) /* lost: its waiters look at lost() themselves */
        wake_own_waiters(c);
    if (c->own_bell)
        sem_post(c->own_bell);
    Py_END_ALLOW_THREADS
    BUSY_ADD(c, -1);
    Py_RETURN_NONE;
}

/* still_named() -> 1 the name leads to the object we mapped, 0 it does not, -1 unknown. */
static PyObject *Core_still_named(Core *c, PyObject *unused)
{
    int answer;
    Py_BEGIN_ALLOW_THREADS
    answer = name_leads_here(c);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(answer);
}

/* sweep(now, *, blocking=True) and reap(now, *, blocking=True): one step that frees dead
 * holders' records (the sweep also checks for damage), -> reclaimed, -1 busy. */
static PyObject *reclaim_step(Core *c, PyObject *args, PyObject *kwds, uint32_t (*step)(Core *, Now, Rings *))
{
    static char *kwlist[] = {"now", "blocking", NULL};
    double given;
    int blocking = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "d|$p", kwlist, &given, &blocking))
        return NULL;
    if (!usable(c))
        return NULL;
    int rc;
    uint32_t reclaimed = 0;
    Rings rings;
    memset(&rings, 0, sizeof rings);
    LOCKED(c, blocking, 0.0, rc, { reclaimed = step(c, section_now(given), &rings); });
    if (rc < 0 || rc == E_DAMAGED_LOCK)
        return lock_error(c, rc);
    if (rc == 1)
        return PyLong_FromLong(-1);
    DELIVER(c, &rings);
    return PyLong_FromUnsignedLong(reclaimed);
}

static PyObject *Core_sweep(Core *c, PyObject *args, PyObject *kwds) { return reclaim_step(c, args, kwds, sweep); }
static PyObject *Core_reap(Core *c, PyObject *args, PyObject *kwds) { return reclaim_step(c, args, kwds, reap); }

static PyObject *Core_pump_all(Core *c, PyObject *args)
{
    double given;
    if (!PyArg_ParseTuple(args, "d", &given))
        return NULL;
    if (!usable(c))
        return NULL;
    int rc;
    Rings rings;
    memset(&rings, 0, sizeof rings);
    LOCKED(c, 1, 0.0, rc, { pump_all(c, section_now(given), &rings); });
    if (rc < 0 || rc == E_DAMAGED_LOCK)
        return lock_error(c, rc);
    DELIVER(c, &rings);
    Py_RETURN_NONE;
}

/* register(pid, start, label, major, minor, now, bell) -> (member, serial); -1 when full.
 * ``bell`` is the id of the doorbell the caller created for this registration. */
static PyObject *Core_register(Core *c, PyObject *args)
{
    unsigned int pid;
    double start, given;
    const char *label;
    Py_ssize_t label_len;
    int major, minor;
    unsigned long long bell = 0;
    if (!PyArg_ParseTuple(args, "Idy#iid|K", &pid, &start, &label, &label_len, &major, &minor, &given, &bell))
        return NULL;
    if (!usable(c))
        return NULL;
    if (c->member >= 0) {
        PyErr_SetString(CoreError, "already registered");
        return NULL;
    }
    if (label_len > LABEL_BYTES)
        label_len = LABEL_BYTES;
    sem_t *own = NULL;
    if (bell) {
        char name[40];
        snprintf(name, sizeof name, BELL_FORMAT, bell);
        own = sem_open(name, 0);
        if (own == SEM_FAILED)
            return PyErr_Format(CoreError, "cannot open this process's doorbell %s: %s", name, strerror(errno));
    }
    int rc, got = -1;
    uint64_t serial = 0;
    Rings rings;
    memset(&rings, 0, sizeof rings);
    LOCKED(c, 1, 0.0, rc, {
        got = register_locked(c, pid, start, label, label_len, major, minor, bell, section_now(given), &rings,
                              &serial);
    });
    if (rc < 0 || rc == E_DAMAGED_LOCK) {
        if (own)
            sem_close(own);
        return lock_error(c, rc);
    }
    if (got >= 0) {
        c->own_bell = own;
    } else if (own)
        sem_close(own);
    DELIVER(c, &rings);
    return Py_BuildValue("iK", got, (unsigned long long)serial);
}

/* unregister(now) -> running records it freed: every record of this registration, the
 * member row and its lock byte go, in one section; from its start no arrival of ours can
 * write a record (R-A14). */
static PyObject *Core_unregister(Core *c, PyObject *args)
{
    double given;
    if (!PyArg_ParseTuple(args, "d", &given))
        return NULL;
    if (!usable(c))
        return NULL;
    if (c->member < 0)
        return PyLong_FromLong(0);
    int m = c->member, rc;
    uint64_t serial = c->member_serial;
    uint32_t cut = 0;
    Rings rings;
    memset(&rings, 0, sizeof rings);
    LOCKED(c, 1, 0.0, rc, { cut = unregister_locked(c, m, serial, section_now(given), &rings); });
    if (rc < 0 || rc == E_DAMAGED_LOCK)
        return lock_error(c, rc);
    c->held = 0;
    c->held_running = 0;
    DELIVER(c, &rings);
    return PyLong_FromUnsignedLong(cut);
}

/* ensure_provider(id, fallback, source, flags, queue_bound, reason, classes=b"",
 * default_class=0) -> (index, created); index -1 when the table is full. ``id`` is
 * matched in full, never by a prefix. ``classes``: the class rows a claimed row starts
 * with (writer.class_table), written with it in one step. */
static PyObject *Core_ensure_provider(Core *c, PyObject *args)
{
    const char *id, *reason, *classes = "";
    Py_ssize_t id_len, reason_len, classes_len = 0;
    int fallback, source, flags, bound;
    unsigned int default_class = 0;
    if (!PyArg_ParseTuple(args, "y#iiiiy#|y#I", &id, &id_len, &fallback, &source, &flags, &bound, &reason,
                          &reason_len, &classes, &classes_len, &default_class))
        return NULL;
    if (!usable(c))
        return NULL;
    if (id_len < 1 || id_len > ID_BYTES || memchr(id, 0, id_len)) {
        PyErr_SetString(PyExc_ValueError, "a provider id is 1 to ID_BYTES bytes without NUL");
        return NULL;
    }
    if (classes_len % CLASS_SPEC_BYTES || classes_len / CLASS_SPEC_BYTES > CLASS_COUNT) {
        PyErr_SetString(PyExc_ValueError, "classes: at most CLASS_COUNT rows of the class spec");
        return NULL;
    }
    int nclasses = (int)(classes_len / CLASS_SPEC_BYTES);
    if (reason_len > REASON_BYTES)
        reason_len = REASON_BYTES;
    char padded[256];
    if (ID_BYTES > (long)sizeof padded) {
        PyErr_SetString(PyExc_ValueError, "ID_BYTES too large");
        return NULL;
    }
    memset(padded, 0, sizeof padded);
    memcpy(padded, id, id_len);
    int rc, index = -1, created = 0;
    LOCKED(c, 1, 0.0, rc, {
        index = ensure_provider_locked(c, padded, fallback, source, flags, bound, reason, reason_len, classes,
                                       nclasses, default_class, &created);
    });
    if (rc < 0 || rc == E_DAMAGED_LOCK)
        return lock_error(c, rc);
    return Py_BuildValue("ii", index, created);
}

/* transact(guards, writes, pump, now) -> bool. Under the lock: when every guard
 * (offset, bytes) matches, apply every write (offset, bytes) in order, then grant what
 * the new limits allow. Python's slow paths (the sidecar's publishing) decide on a
 * snapshot and commit here, so Python never holds the lock (R-A11). */
static int parse_patches(Core *c, PyObject *seq, Patch **out, Py_ssize_t *n, PyObject **keep)
{
    PyObject *tuple = PySequence_Tuple(seq);
    if (!tuple)
        return -1;
    *keep = tuple;
    *n = PyTuple_Size(tuple);
    *out = PyMem_Calloc(*n ? *n : 1, sizeof(Patch));
    if (!*out)
        return -1;
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *item = PyTuple_GetItem(tuple, i);
        long off;
        const char *src;
        Py_ssize_t len;
        if (!PyArg_ParseTuple(item, "ly#", &off, &src, &len))
            return -1;
        if (off < 0 || len < 0 || off + len > TOTAL_SIZE) {
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
    int do_pump, do_sweep = 0;
    double given;
    if (!PyArg_ParseTuple(args, "OOpd|p", &guards, &writes, &do_pump, &given, &do_sweep))
        return NULL;
    if (!usable(c))
        return NULL;
    Patch *g = NULL, *w = NULL;
    Py_ssize_t ng = 0, nw = 0;
    PyObject *kg = NULL, *kw = NULL, *result = NULL;
    if (parse_patches(c, guards, &g, &ng, &kg) == 0 && parse_patches(c, writes, &w, &nw, &kw) == 0) {
        int rc, ok = 1;
        Rings rings;
        memset(&rings, 0, sizeof rings);
        LOCKED(c, 1, 0.0, rc, {
            ok = transact_locked(c, g, ng, w, nw, do_pump, do_sweep, section_now(given), &rings);
        });
        if (rc < 0 || rc == E_DAMAGED_LOCK)
            lock_error(c, rc);
        else {
            DELIVER(c, &rings);
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
    PyObject *out = PyBytes_FromStringAndSize(NULL, TOTAL_SIZE);
    if (!out)
        return NULL;
    char *dst = PyBytes_AsString(out);
    int rc;
    LOCKED(c, 1, 0.0, rc, { memcpy(dst, c->base, TOTAL_SIZE); });
    if (rc < 0 || rc == E_DAMAGED_LOCK) {
        Py_DECREF(out);
        return lock_error(c, rc);
    }
    return out;
}

/* own_records() -> (running, waiting): this registration's records, read lock-free
 * (close() waits for the running to end). */
static PyObject *Core_own_records(Core *c, PyObject *unused)
{
    if (!usable(c))
        return NULL;
    long running = 0, waiting = 0;
    if (c->member >= 0)
        for (int p = 0; p < PROVIDER_COUNT; p++) {
            if (!ld32(c, pbase(c, p) + PROVIDER_IN_USE))
                continue;
            for (int h = 0; h < HOLDERS_PER_PROVIDER; h++) {
                long hb = hbase(c, p, h);
                uint32_t s = ld32(c, hb + HOLDER_STATE);
                if (s != FREE && ldi32(c, hb + HOLDER_MEMBER) == c->member &&
                    ld64(c, hb + HOLDER_MEMBER_SERIAL) == c->member_serial) {
                    if (s == RUNNING)
                        running++;
                    else if (s == WAITING)
                        waiting++;
                }
            }
        }
    return Py_BuildValue("ll", running, waiting);
}

/* take_events() -> (lock repairs, damage repairs, damage note): since the last call. */
static PyObject *Core_take_events(Core *c, PyObject *unused)
{
    uint64_t repaired = c->repaired, damage = c->damage;
    c->repaired = 0;
    c->damage = 0;
    return Py_BuildValue("KKs", (unsigned long long)repaired, (unsigned long long)damage, c->damage_note);
}

static PyObject *Core_get_member(Core *c, void *closure)
{
    return Py_BuildValue("iK", c->member, (unsigned long long)c->member_serial);
}

static PyObject *Core_get_busy(Core *c, void *closure) { return PyLong_FromLong(__atomic_load_n(&c->busy, __ATOMIC_RELAXED)); }
static PyObject *Core_get_held(Core *c, void *closure) { return PyLong_FromLong(c->held); }
static PyObject *Core_get_held_running(Core *c, void *closure) { return PyLong_FromLong(c->held_running); }
static PyObject *Core_get_closing(Core *c, void *closure) { return PyBool_FromLong(c->closing); }
static PyObject *Core_get_moved(Core *c, void *closure) { return PyBool_FromLong(c->moved); }
static PyObject *Core_get_lost(Core *c, void *closure) { return PyBool_FromLong(lost(c)); }

/* ===== 8. Ticket =========================================================================
 * One holder record's handle, filled in by the core before the lock is let go (R-A12).
 * It is also the slot context manager: ``with Ticket(core, p, timeout)`` and ``async
 * with`` run the fast path here, in C, with no Python frame (admitted at once, released
 * at once); anything else (waiting, refusals, a busy lock on the event loop) goes to
 * the Python callables the core was given (Core.set_slow_paths). A ticket dropped while
 * its record lives frees the record in its deallocator: the last line of R-A12. */

static PyObject *Ticket_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    Ticket *t = (Ticket *)alloc(type, 0);
    if (t) {
        t->provider = -1;
        t->holder = -1;
        t->cls = -1;
        t->timeout = -1.0;
    }
    return (PyObject *)t;
}

/* Ticket(core=None, provider=-1, timeout=None, *, cls=-1) */
static int Ticket_init(Ticket *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"core", "provider", "timeout", "cls", "tokens", NULL};
    PyObject *core = Py_None, *timeout = Py_None, *tokens = Py_None;
    int provider = -1, cls = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OiO$iO", kwlist, &core, &provider, &timeout, &cls, &tokens))
        return -1;
    if (t->live) {
        PyErr_SetString(PyExc_ValueError, "a live ticket");
        return -1;
    }
    if (core != Py_None) {
        if (!PyObject_TypeCheck(core, CoreType)) {
            PyErr_SetString(PyExc_TypeError, "core must be a Core");
            return -1;
        }
        set_core(t, (Core *)core);
    }
    t->provider = provider;
    t->cls = cls;
    t->tokens = 0;
    if (tokens != Py_None && set_tokens(t, tokens) < 0)
        return -1;
    if (timeout == Py_None)
        t->timeout = -1.0;
    else {
        t->timeout = PyFloat_AsDouble(timeout);
        if (t->timeout == -1.0 && PyErr_Occurred())
            return -1;
        if (t->timeout < 0)
            t->timeout = 0.0;
    }
    return 0;
}

static void Ticket_dealloc(Ticket *t)
{
    PyTypeObject *tp = Py_TYPE((PyObject *)t);
    Core *c = t->core;
    if (t->live && !t->busy && c && !c->closed && t->fork_gen == fork_generation &&
        c->fork_gen == fork_generation) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (do_leave(t, OUT_CANCELLED, 0.0, 1) == -2)
            PyErr_Clear();
        PyErr_Restore(et, ev, tb);
    }
    t->live = 0;
    PyObject *core_ref = (PyObject *)t->core;
    t->core = NULL;
    Py_XDECREF(core_ref);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(t);
    Py_DECREF(tp);
}

static PyObject *Ticket_enter(Ticket *t, PyObject *unused)
{
    Core *c = t->core;
    if (c == NULL) {
        PyErr_SetString(PyExc_ValueError, "a ticket without a core");
        return NULL;
    }
    t->started = deadline_clock();
    int code = do_arrive(c, t, t->provider, c->pid, 0.0, 1, 1, t->timeout, 1);
    if (code < 0)
        return NULL;
    if (code == R_ADMIT)
        Py_RETURN_NONE;
    if (c->slow_enter == NULL) {
        PyErr_Format(CoreError, "no slow path for decision %d", code);
        return NULL;
    }
    return PyObject_CallFunction(c->slow_enter, "Oi", (PyObject *)t, code);
}

static PyObject *Ticket_exit(Ticket *t, PyObject *args)
{
    if (t->live && do_leave(t, OUT_RELEASED, 0.0, 1) == -2)
        return NULL;
    Py_RETURN_FALSE;
}

static PyObject *Ticket_aenter(Ticket *t, PyObject *unused)
{
    Core *c = t->core;
    if (c == NULL) {
        PyErr_SetString(PyExc_ValueError, "a ticket without a core");
        return NULL;
    }
    /* one try-lock step on the loop (microseconds, R-A11); never waits here */
    t->started = deadline_clock();
    int code = do_arrive(c, t, t->provider, c->pid, 0.0, 1, 0, -1.0, 0);
    if (code < 0)
        return NULL;
    if (code == R_ADMIT)
        return Py_NewRef(DONE);
    if (c->slow_aenter == NULL) {
        PyErr_Format(CoreError, "no slow path for decision %d", code);
        return NULL;
    }
    return PyObject_CallFunction(c->slow_aenter, "Oi", (PyObject *)t, code);
}

static PyObject *Ticket_aexit(Ticket *t, PyObject *args)
{
    if (!t->live)
        return Py_NewRef(DONE);
    int was = do_leave(t, OUT_RELEASED, 0.0, 0);
    if (was == -2)
        return NULL;
    if (was != -1)
        return Py_NewRef(DONE);
    Core *c = t->core; /* the lock is busy: leave off the loop */
    if (c == NULL || c->slow_aexit == NULL)
        return Py_NewRef(DONE);
    return PyObject_CallFunction(c->slow_aexit, "O", (PyObject *)t);
}

/* leave(outcome, *, blocking) -> as Core.leave, on the ticket's own core. */
static PyObject *Ticket_leave(Ticket *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"outcome", "blocking", NULL};
    int outcome, blocking = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|$p", kwlist, &outcome, &blocking))
        return NULL;
    if (named(blocking, "leave", "blocking") < 0)
        return NULL;
    int was = do_leave(t, outcome, 0.0, blocking);
    return was == -2 ? NULL : PyLong_FromLong(was);
}

/* rebind(core, provider): a ticket that is not live moves to another core, where its
 * provider may have another row (R-A15). */
static PyObject *Ticket_rebind(Ticket *t, PyObject *args)
{
    PyObject *core;
    int provider;
    if (!PyArg_ParseTuple(args, "O!i", CoreType, &core, &provider))
        return NULL;
    if (t->live || t->busy) {
        PyErr_SetString(PyExc_ValueError, "a live ticket stays with its core");
        return NULL;
    }
    set_core(t, (Core *)core);
    t->provider = provider;
    Py_RETURN_NONE;
}

static PyObject *Ticket_get_provider(Ticket *t, void *x) { return PyLong_FromLong(t->provider); }
static PyObject *Ticket_get_cls(Ticket *t, void *x) { return PyLong_FromLong(t->cls); }
static PyObject *Ticket_get_tokens(Ticket *t, void *x) { return PyLong_FromUnsignedLong(t->tokens); }
static PyObject *Ticket_get_holder(Ticket *t, void *x) { return PyLong_FromLong(t->holder); }
static PyObject *Ticket_get_serial(Ticket *t, void *x) { return PyLong_FromUnsignedLongLong(t->serial); }
static PyObject *Ticket_get_live(Ticket *t, void *x) { return PyBool_FromLong(t->live); }
static PyObject *Ticket_get_futex(Ticket *t, void *x) { return PyBool_FromLong(t->futex); }
static PyObject *Ticket_get_core(Ticket *t, void *x) { return Py_NewRef(t->core ? (PyObject *)t->core : Py_None); }
static PyObject *Ticket_get_started(Ticket *t, void *x) { return PyFloat_FromDouble(t->started); }
static PyObject *Ticket_get_timeout(Ticket *t, void *x)
{
    if (t->timeout < 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(t->timeout);
}

static PyObject *Ticket_repr(Ticket *t)
{
    return PyUnicode_FromFormat("<Ticket provider=%d holder=%d serial=%llu%s>", t->provider, t->holder,
                                (unsigned long long)t->serial, t->live ? " live" : "");
}

/* ===== 9. tests only ======================================================================
 * What a test needs to play a process frozen or killed inside the lock, and a death that
 * drops a registration's lock byte. Nothing in the product calls these: they are compiled
 * only into a test build (GWCAP_TEST_HOOKS, set by setup.py when
 * GATEWAY_CAPACITY_TEST_HOOKS=1, as `make test` builds); _core.TEST_HOOKS says which. */
#ifdef GWCAP_TEST_HOOKS

/* hold_lock(dirty=False): take the lock and never let it go, as a process frozen inside
 * a section would. */
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
        return lock_error(c, rc);
    if (dirty) /* as if killed mid-write: counters that disagree with the records */
        for (int p = 0; p < PROVIDER_COUNT; p++)
            if (ld32(c, pbase(c, p) + PROVIDER_IN_USE))
                st32(c, pbase(c, p) + PROVIDER_RUNNING, 999);
    Py_RETURN_NONE;
}

/* abandon(): what the kernel does to a registration when its process dies: the member's
 * lock byte is dropped; the row and the records stay as they were. This object is
 * unusable afterwards. */
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

/* die_in_section(running): enter the lock, write ``running`` over every provider's
 * counter, and let the lock go with ``dirty`` still set, as the kernel does when a
 * holder dies in the middle of a section. */
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
        for (int p = 0; p < PROVIDER_COUNT; p++)
            if (ld32(c, pbase(c, p) + PROVIDER_IN_USE))
                st32(c, pbase(c, p) + PROVIDER_RUNNING, running);
        if (c->kind == KIND_ROBUST) {
#if HAVE_ROBUST
            pthread_mutex_unlock((pthread_mutex_t *)AT(c, MUTEX_OFFSET));
#endif
        } else {
            byte_lock(targets[c->target].fd, c->kind, 0, F_UNLCK, 0);
            pthread_mutex_unlock(&targets[c->target].mu);
        }
    }
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return lock_error(c, rc);
    Py_RETURN_NONE;
}
#define TEST_HOOKS 1
#else
#define TEST_HOOKS 0
#endif /* GWCAP_TEST_HOOKS */

static PyMethodDef Core_methods[] = {
    {"arrive", (PyCFunction)(void (*)(void))Core_arrive, METH_VARARGS | METH_KEYWORDS,
     "arrive(ticket, provider, pid, now, *, may_wait, blocking, timeout=-1.0, futex=False) -> code"},
    {"leave", (PyCFunction)(void (*)(void))Core_leave, METH_VARARGS | METH_KEYWORDS,
     "leave(ticket, outcome, now, *, blocking) -> -1 busy, 0 stale, 1 running, 2 waiting"},
    {"state", (PyCFunction)Core_state, METH_O, "state(ticket) -> record state (lock-free)"},
    {"displaced", (PyCFunction)Core_displaced, METH_O,
     "displaced(ticket) -> its record was displaced from a full queue (lock-free)"},
    {"wait", (PyCFunction)Core_wait, METH_VARARGS, "wait(ticket, timeout) -> (W_*, reclaimed): sleep on the record (Linux)"},
    {"dispatch", (PyCFunction)Core_dispatch, METH_VARARGS, "dispatch(period, watched, always=False) -> (changed, reclaimed, posts)"},
    {"post_own", (PyCFunction)Core_post_own, METH_NOARGS, "wake this process's dispatcher"},
    {"begin_close", (PyCFunction)Core_begin_close, METH_VARARGS, "begin_close(now) -> waiting records freed"},
    {"retire", (PyCFunction)Core_retire, METH_NOARGS, "the name leads elsewhere: waiters move"},
    {"still_named", (PyCFunction)Core_still_named, METH_NOARGS, "1 same object, 0 replaced or gone, -1 unknown"},
    {"sweep", (PyCFunction)(void (*)(void))Core_sweep, METH_VARARGS | METH_KEYWORDS,
     "sweep(now, *, blocking=True) -> reclaimed, -1 busy"},
    {"reap", (PyCFunction)(void (*)(void))Core_reap, METH_VARARGS | METH_KEYWORDS,
     "reap(now, *, blocking=True) -> reclaimed, -1 busy"},
    {"pump_all", (PyCFunction)Core_pump_all, METH_VARARGS, "pump_all(now)"},
    {"register", (PyCFunction)Core_register, METH_VARARGS, "register(pid, start, label, major, minor, now, bell=0) -> (member, serial)"},
    {"unregister", (PyCFunction)Core_unregister, METH_VARARGS, "unregister(now) -> running records cut"},
    {"ensure_provider", (PyCFunction)Core_ensure_provider, METH_VARARGS, "ensure_provider(id, fallback, source, flags, bound, reason, classes=b'', default_class=0) -> (index, created)"},
    {"transact", (PyCFunction)Core_transact, METH_VARARGS, "transact(guards, writes, pump, now, sweep=False) -> bool"},
    {"snapshot", (PyCFunction)Core_snapshot, METH_NOARGS, "snapshot() -> bytes"},
    {"own_records", (PyCFunction)Core_own_records, METH_NOARGS, "(running, waiting) records of this registration"},
    {"take_events", (PyCFunction)Core_take_events, METH_NOARGS, "(lock repairs, damage repairs, note) since the last call"},
    {"set_slow_paths", (PyCFunction)Core_set_slow_paths, METH_VARARGS, "set_slow_paths(enter, aenter, aexit)"},
    {"close", (PyCFunction)Core_close, METH_NOARGS, "release the buffer and the lock target"},
#ifdef GWCAP_TEST_HOOKS
    {"hold_lock", (PyCFunction)Core_hold_lock, METH_VARARGS, "tests only: take the lock and keep it"},
    {"abandon", (PyCFunction)Core_abandon, METH_NOARGS, "tests only: drop the member lock as death does"},
    {"die_in_section", (PyCFunction)Core_die_in_section, METH_VARARGS, "tests only: a holder's death mid-section"},
#endif
    {NULL}
};

static PyGetSetDef Core_getset[] = {
    {"member", (getter)Core_get_member, NULL, "(member, serial) of this registration", NULL},
    {"held", (getter)Core_get_held, NULL, "live tickets of this object (running or waiting)", NULL},
    {"held_running", (getter)Core_get_held_running, NULL, "of them running, as far as this process knows", NULL},
    {"busy", (getter)Core_get_busy, NULL, "calls of other threads inside the core now", NULL},
    {"closing", (getter)Core_get_closing, NULL, "close() began", NULL},
    {"moved", (getter)Core_get_moved, NULL, "retired: the name leads elsewhere", NULL},
    {"lost", (getter)Core_get_lost, NULL, "the segment was truncated under us (moved too)", NULL},
    {NULL}
};

static PyType_Slot Core_slots[] = {
    {Py_tp_new, Core_new},
    {Py_tp_init, Core_init},
    {Py_tp_dealloc, Core_dealloc},
    {Py_tp_methods, Core_methods},
    {Py_tp_getset, Core_getset},
    {Py_tp_doc, "One attachment of this process to one segment (see _core.c)."},
    {0, NULL},
};

static PyType_Spec Core_spec = {"shm_layout._core.Core", sizeof(Core), 0, Py_TPFLAGS_DEFAULT, Core_slots};

static PyMethodDef Ticket_methods[] = {
    {"__enter__", (PyCFunction)Ticket_enter, METH_NOARGS, "arrive; wait if it must (the slow path)"},
    {"__exit__", (PyCFunction)Ticket_exit, METH_VARARGS, "release"},
    {"__aenter__", (PyCFunction)Ticket_aenter, METH_NOARGS, "arrive without blocking the loop"},
    {"__aexit__", (PyCFunction)Ticket_aexit, METH_VARARGS, "release without blocking the loop"},
    {"leave", (PyCFunction)(void (*)(void))Ticket_leave, METH_VARARGS | METH_KEYWORDS, "leave(outcome, *, blocking)"},
    {"rebind", (PyCFunction)Ticket_rebind, METH_VARARGS, "rebind(core, provider): move a ticket that is not live"},
    {NULL}
};

static PyGetSetDef Ticket_getset[] = {
    {"provider", (getter)Ticket_get_provider, NULL, NULL, NULL},
    {"cls", (getter)Ticket_get_cls, NULL, NULL, NULL},
    {"tokens", (getter)Ticket_get_tokens, NULL, NULL, NULL},
    {"holder", (getter)Ticket_get_holder, NULL, NULL, NULL},
    {"serial", (getter)Ticket_get_serial, NULL, NULL, NULL},
    {"live", (getter)Ticket_get_live, NULL, NULL, NULL},
    {"futex", (getter)Ticket_get_futex, NULL, NULL, NULL},
    {"core", (getter)Ticket_get_core, NULL, NULL, NULL},
    {"timeout", (getter)Ticket_get_timeout, NULL, NULL, NULL},
    {"started", (getter)Ticket_get_started, NULL, "deadline clock when the slot was entered", NULL},
    {NULL}
};

static PyType_Slot Ticket_slots[] = {
    {Py_tp_new, Ticket_new},
    {Py_tp_init, Ticket_init},
    {Py_tp_dealloc, Ticket_dealloc},
    {Py_tp_methods, Ticket_methods},
    {Py_tp_getset, Ticket_getset},
    {Py_tp_repr, Ticket_repr},
    {Py_tp_doc, "One holder record's handle, and the slot context manager."},
    {0, NULL},
};

static PyType_Spec Ticket_spec = {"shm_layout._core.Ticket", sizeof(Ticket), 0, Py_TPFLAGS_DEFAULT, Ticket_slots};

/* Done: ``await`` on it returns None at once (the fast path of __aenter__/__aexit__). */
static PyObject *Done_await(PyObject *self) { return Py_NewRef(self); }
static PyObject *Done_next(PyObject *self) { return NULL; /* exhausted: StopIteration(None) */ }

static PyType_Slot Done_slots[] = {
    {Py_am_await, Done_await},
    {Py_tp_iter, Done_await},
    {Py_tp_iternext, Done_next},
    {0, NULL},
};

static PyType_Spec Done_spec = {"shm_layout._core.Done", sizeof(PyObject), 0, Py_TPFLAGS_DEFAULT, Done_slots};

/* ===== 10. module ========================================================================= */
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

/* mutex_state(buffer, offset) -> (sane, locked, owner_tid, owner_exists): what a reader
 * can tell of the robust mutex without touching it (inspect --check, attach). */
static PyObject *mod_mutex_state(PyObject *self, PyObject *args)
{
    Py_buffer view;
    long off;
    if (!PyArg_ParseTuple(args, "y*l", &view, &off))
        return NULL;
#if HAVE_ROBUST && defined(__GLIBC__)
    if (off < 0 || off + (long)sizeof(pthread_mutex_t) > view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "mutex offset outside the buffer");
        return NULL;
    }
    const pthread_mutex_t *mu = (const pthread_mutex_t *)((const char *)view.buf + off);
    int sane = mutex_sane(mu);
    int word = __atomic_load_n(&mu->__data.__lock, __ATOMIC_RELAXED);
    int tid = word & FUTEX_TID_MASK;
    int exists = tid == 0 ? 0 : (kill(tid, 0) == 0 || errno == EPERM);
    PyBuffer_Release(&view);
    return Py_BuildValue("OOii", sane ? Py_True : Py_False, word != 0 ? Py_True : Py_False, tid, exists);
#else
    PyBuffer_Release(&view);
    return Py_BuildValue("OOii", Py_True, Py_False, 0, 0);
#endif
}

/* probe(target, is_shm, kind, [(m, serial), ...], stamp=b"") -> [bool, ...]: is each
 * member's process alive, by the kernel's word, for readers that hold no Core (views).
 * Goes through the per-process table, so it never closes a descriptor this process locks
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
    PyObject *tuple = PySequence_Tuple(seq);
    if (!tuple)
        return NULL;
    int t;
    Py_BEGIN_ALLOW_THREADS
    t = target_open(target, is_shm);
    Py_END_ALLOW_THREADS
    if (t < 0) {
        Py_DECREF(tuple);
        return PyErr_Format(CoreError, "cannot open the lock target %s: %s", target, strerror(errno));
    }
    int unknown = 0; /* not the segment's lock file: nothing it says is known (alive) */
    if (stamp_len > 0)
        unknown = !stamp_matches(t, stamp, stamp_len);
    Py_ssize_t n = PyTuple_Size(tuple);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        int m;
        unsigned long long serial;
        if (!PyArg_ParseTuple(PyTuple_GetItem(tuple, i), "iK", &m, &serial)) {
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
        PyList_SetItem(out, i, PyBool_FromLong(alive));
    }
    target_release(t);
    Py_DECREF(tuple);
    return out;
}

static PyObject *mod_fields(PyObject *self, PyObject *unused)
{
    PyObject *t = PyTuple_New(NLAYOUT);
    for (int i = 0; t && i < NLAYOUT; i++)
        PyTuple_SetItem(t, i, PyUnicode_FromString(LAYOUT[i].key));
    return t;
}

static PyObject *mod_deadline_now(PyObject *self, PyObject *unused)
{
    return PyFloat_FromDouble(deadline_clock());
}

/* guard(buffer, writable) -> slot: register a mapping of a segment with the SIGBUS
 * handler (_guard.h); -1 when the table is full (the mapping is then unguarded). */
static PyObject *mod_guard(PyObject *self, PyObject *args)
{
    PyObject *buffer;
    int writable;
    if (!PyArg_ParseTuple(args, "Op", &buffer, &writable))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE) != 0)
        return NULL;
    uintptr_t start = (uintptr_t)view.buf;
    size_t len = (size_t)view.len;
    PyBuffer_Release(&view);
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0)
        page = 4096;
    if (start == 0 || len == 0 || start % (uintptr_t)page != 0) {
        PyErr_SetString(PyExc_ValueError, "guard() takes a whole mapping");
        return NULL;
    }
    len = (len + (size_t)page - 1) / (size_t)page * (size_t)page;
    return PyLong_FromLong(guard_add(start, len, writable));
}

/* unguard(slot): the mapping is about to be unmapped (or was). */
static PyObject *mod_unguard(PyObject *self, PyObject *arg)
{
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (i >= 0 && i < MAX_GUARDS)
        guard_remove((int)i);
    Py_RETURN_NONE;
}

/* damaged(slot) -> bool: the handler replaced the mapping's pages with zeros. */
static PyObject *mod_damaged(PyObject *self, PyObject *arg)
{
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(i >= 0 && i < MAX_GUARDS && guard_damaged((int)i));
}

/* guard_armed() -> bool: the core's SIGBUS handler is the process's disposition now (a
 * disposition set after the first mapping replaces it: the guard is gone, _guard.h). */
static PyObject *mod_guard_armed(PyObject *self, PyObject *noargs)
{
    int armed = guard_armed();
    if (armed < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong(armed);
}

static PyMethodDef module_methods[] = {
    {"guard", mod_guard, METH_VARARGS, "guard(buffer, writable) -> slot: survive a truncation of it"},
    {"guard_armed", mod_guard_armed, METH_NOARGS, "guard_armed() -> bool: ours handles SIGBUS now"},
    {"unguard", mod_unguard, METH_O, "unguard(slot): before the mapping goes"},
    {"damaged", mod_damaged, METH_O, "damaged(slot) -> bool: its pages were replaced by zeros"},
    {"init_mutex", mod_init_mutex, METH_VARARGS, "init_mutex(buffer, offset): a process-shared robust mutex"},
    {"mutex_state", mod_mutex_state, METH_VARARGS, "mutex_state(buffer, offset) -> (sane, locked, tid, tid_exists)"},
    {"fields", mod_fields, METH_NOARGS, "the offsets Core needs"},
    {"probe", mod_probe, METH_VARARGS, "probe(target, is_shm, kind, [(m, serial)]) -> [bool]"},
    {"deadline_now", mod_deadline_now, METH_NOARGS, "the deadline clock the core reads"},
    {NULL}
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "shm_layout._core", "The admission core (see _core.c).", -1, module_methods,
};

static int add_int(PyObject *m, const char *name, long v)
{
    return PyModule_AddIntConstant(m, name, v);
}

PyMODINIT_FUNC PyInit__core(void)
{
    main_thread = PyThread_get_thread_ident(); /* the importer's, unless threading says */
    PyObject *threading = PyImport_ImportModule("threading");
    if (threading) {
        PyObject *main = PyObject_CallMethod(threading, "main_thread", NULL);
        PyObject *ident = main ? PyObject_GetAttrString(main, "ident") : NULL;
        if (ident && PyLong_Check(ident))
            main_thread = PyLong_AsUnsignedLong(ident);
        Py_XDECREF(ident);
        Py_XDECREF(main);
        Py_DECREF(threading);
    }
    PyErr_Clear();
    /* The exceptions are the Python classes of shm_layout.errors (the one exception module) */
    PyObject *errors = PyImport_ImportModule("shm_layout.errors");
    if (!errors)
        return NULL;
    CoreError = PyObject_GetAttrString(errors, "CoreError");
    DamagedLock = CoreError ? PyObject_GetAttrString(errors, "DamagedLock") : NULL;
    Py_DECREF(errors);
    if (!CoreError || !DamagedLock)
        return NULL;
    CoreType = (PyTypeObject *)PyType_FromSpec(&Core_spec);
    TicketType = (PyTypeObject *)PyType_FromSpec(&Ticket_spec);
    DoneType = (PyTypeObject *)PyType_FromSpec(&Done_spec);
    if (!CoreType || !TicketType || !DoneType)
        return NULL;
    DONE = PyObject_CallNoArgs((PyObject *)DoneType);
    if (!DONE)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "Core", (PyObject *)CoreType) < 0 ||
        PyModule_AddObjectRef(m, "Ticket", (PyObject *)TicketType) < 0 ||
        PyModule_AddObjectRef(m, "CoreError", CoreError) < 0 ||
        PyModule_AddObjectRef(m, "DamagedLock", DamagedLock) < 0 ||
        PyModule_AddObjectRef(m, "DONE", DONE) < 0 ||
        add_int(m, "HAVE_ROBUST", HAVE_ROBUST) < 0 || add_int(m, "HAVE_FUTEX", HAVE_FUTEX) < 0 ||
        add_int(m, "TEST_HOOKS", TEST_HOOKS) < 0 ||
        add_int(m, "KIND_ROBUST", KIND_ROBUST) < 0 || add_int(m, "KIND_FILE", KIND_FILE) < 0 ||
        add_int(m, "BUSY", R_BUSY) < 0 || add_int(m, "ADMIT", R_ADMIT) < 0 || add_int(m, "WAIT", R_WAIT) < 0 ||
        add_int(m, "FULL", R_FULL) < 0 || add_int(m, "WAIT_REFUSED", R_WAIT_REFUSED) < 0 ||
        add_int(m, "CLOSED", R_CLOSED) < 0 || add_int(m, "MOVED", R_MOVED) < 0 || add_int(m, "TOO_LARGE", R_TOO_LARGE) < 0 || add_int(m, "RELEASED", OUT_RELEASED) < 0 ||
        add_int(m, "TIMEOUT", OUT_TIMEOUT) < 0 || add_int(m, "CANCELLED", OUT_CANCELLED) < 0 ||
        add_int(m, "W_GRANTED", W_GRANTED) < 0 || add_int(m, "W_GONE", W_GONE) < 0 ||
        add_int(m, "W_DISPLACED", W_DISPLACED) < 0 ||
        add_int(m, "W_TIMEOUT", W_TIMEOUT) < 0 || add_int(m, "W_CLOSED", W_CLOSED) < 0 ||
        add_int(m, "W_MOVED", W_MOVED) < 0 || add_int(m, "WAKE_DOORBELL", WAKE_DOORBELL) < 0 ||
        add_int(m, "WAKE_FUTEX", WAKE_FUTEX) < 0 ||
        add_int(m, "MUTEX_SIZE", HAVE_ROBUST ? (long)sizeof(pthread_mutex_t) : 0) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    static int atfork_done = 0;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, after_fork_child);
        atfork_done = 1;
    }
    return m;
}
