/* Native fast path of the fmq ring (see ring.py, "theory of operation").
 *
 * Pure Python cannot emit a memory fence, so a pure-Python ring must write the
 * peer's eventfd after every frame. With real atomics the ring can do what a
 * futex does: a waiter announces itself in shared memory and fences, the
 * other side fences after publishing and writes the eventfd only if it sees
 * the announcement (a Dekker handshake, correct because both sides issue a
 * full store->load fence). This module gives the ring exactly that: the
 * frame copy with acquire/release counters, and announce/retire of a waiter.
 *
 * The layout constants are passed in from Python; this file knows only
 * offsets, not the format's history. The module is optional: without it the
 * ring falls back to the always-signal protocol, which interoperates with
 * this one (a pure-Python waiter keeps its flag set forever).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sys/uio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;         /* the whole mapping, held for the object's life */
    int has_view;
    uint8_t *base;          /* NULL once released */
    uint64_t capacity, mask, max_frame;
    uint64_t w, r;          /* our copies of the counters: we trust only these */
    uint64_t frames_written, frames_read;
    Py_ssize_t data;        /* offset of the data area */
    Py_ssize_t wpos, rpos;  /* offsets of the write and read counters */
    Py_ssize_t wflag, rflag;/* producer's space-waiter flag, consumer's data-waiter flag */
    int data_efd, space_efd;
    int producing, consuming;
    /* A spinning waiter reads the mapping without the GIL: release() raises
     * ``releasing`` and waits for ``spinning`` to drop before it lets the
     * mapping go (the spinner checks the flag at every turn). */
    int spinning, releasing;
} Shared;

#define PREFIX 8u
#define CHECK 0xFFFFFFFFu
enum { FULL = -1, CORRUPT_COUNTER = -2, CORRUPT_PREFIX = -3, TOO_LARGE = -5, RELEASED = -6,
       ALSO = -7 };

static inline uint64_t pad(uint64_t n) { return PREFIX + ((n + 7u) & ~(uint64_t)7u); }

static inline uint64_t *word(Shared *s, Py_ssize_t off) { return (uint64_t *)(s->base + off); }

/* Add 1 to an eventfd, the GIL released: should a peer have cleared
 * O_NONBLOCK on the (shared) description and saturated the counter, only
 * this thread waits -- until anyone drains it (Ring.drain_eventfds) --
 * never the whole process. */
static int signal_fd(int fd) {
    uint64_t one = 1;
    for (;;) {
        ssize_t n;
        Py_BEGIN_ALLOW_THREADS
        n = write(fd, &one, sizeof one);
        Py_END_ALLOW_THREADS
        /* EAGAIN (the eventfd is non-blocking): the counter is saturated,
         * i.e. readable until drained -- "already signalled". */
        if (n == (ssize_t)sizeof one || (n < 0 && errno == EAGAIN))
            return 0;
        if (n < 0 && errno == EINTR)
            continue;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
}

/* Read (reset) an eventfd without ever blocking, whatever its flags: the
 * peer shares the description and could clear O_NONBLOCK. RWF_NOWAIT is
 * honoured by eventfds since Linux 5.12 (read_iter); older kernels say
 * EOPNOTSUPP and get a plain read of the (non-blocking) fd. */
static ssize_t drain(int fd, uint64_t *count) {
    struct iovec iov = {.iov_base = count, .iov_len = sizeof *count};
    ssize_t n = preadv2(fd, &iov, 1, -1, RWF_NOWAIT);
    if (n < 0 && (errno == EOPNOTSUPP || errno == EINVAL))
        n = read(fd, count, sizeof *count);
    return n;
}

/* A waiter's flag: set = "signal my eventfd". The store must be visible
 * before the caller's re-check of the ring, hence the full fence. */
static inline void announce(Shared *s, Py_ssize_t flag) {
    __atomic_store_n(word(s, flag), 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static inline void retire(Shared *s, Py_ssize_t flag) {
    __atomic_store_n(word(s, flag), 0, __ATOMIC_RELEASE);
}

/* After publishing our counter: signal the peer only if it announced. */
static inline int wake_if_waiting(Shared *s, Py_ssize_t flag, int efd) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* Dekker: counter store before flag load */
    if (__atomic_load_n(word(s, flag), __ATOMIC_RELAXED))
        return signal_fd(efd);
    return 0;
}

static int Shared_init(Shared *self, PyObject *args, PyObject *kw) {
    PyObject *mem;
    unsigned long long capacity, max_frame;
    Py_ssize_t data, wpos, rpos, wflag, rflag;
    int data_efd, space_efd;
    if (!PyArg_ParseTuple(args, "OKKnnnnnii", &mem, &capacity, &max_frame, &data, &wpos, &rpos,
                          &wflag, &rflag, &data_efd, &space_efd))
        return -1;
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        self->base = NULL;
    }
    if (PyObject_GetBuffer(mem, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->has_view = 1;
    Py_ssize_t offs[4] = {wpos, rpos, wflag, rflag};
    int bad = capacity < 64 || (capacity & (capacity - 1)) || data < 0 || data % 8
              || (uint64_t)self->view.len < (uint64_t)data + capacity
              || ((uintptr_t)self->view.buf % 8) || pad(max_frame) > capacity / 2;
    for (int i = 0; i < 4; i++)
        bad |= offs[i] < 0 || offs[i] % 8 || offs[i] + 8 > data;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "mapping does not hold the ring's layout");
        return -1;
    }
    self->base = self->view.buf;
    self->capacity = capacity;
    self->mask = capacity - 1;
    self->max_frame = max_frame;
    self->data = data;
    self->wpos = wpos;
    self->rpos = rpos;
    self->wflag = wflag;
    self->rflag = rflag;
    self->data_efd = data_efd;
    self->space_efd = space_efd;
    self->w = __atomic_load_n(word(self, wpos), __ATOMIC_ACQUIRE);
    self->r = __atomic_load_n(word(self, rpos), __ATOMIC_ACQUIRE);
    self->frames_written = self->frames_read = 0;
    self->producing = self->consuming = 0;
    self->spinning = self->releasing = 0;
    return 0;
}

static void Shared_dealloc(Shared *self) {
    if (self->has_view)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Shared_release(Shared *self, PyObject *unused) {
    __atomic_store_n(&self->releasing, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&self->spinning, __ATOMIC_SEQ_CST))
        ;   /* a spinner sees ``releasing`` within one turn of its loop */
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    self->base = NULL;
    Py_RETURN_NONE;
}

/* put(frame) -> 0 published, FULL, CORRUPT_COUNTER, TOO_LARGE or RELEASED. */
static PyObject *Shared_put(Shared *self, PyObject *arg) {
    Py_buffer p;
    if (!self->base)
        return PyLong_FromLong(RELEASED);
    if (PyObject_GetBuffer(arg, &p, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    uint64_t n = (uint64_t)p.len, need = pad(n);
    long rc = 0;
    if (n > self->max_frame) {
        rc = TOO_LARGE;
        goto done;
    }
    if (!self->producing) {   /* create() left our flag at "always wake me" */
        self->producing = 1;
        retire(self, self->wflag);
    }
    uint64_t w = self->w;
    uint64_t used = w - __atomic_load_n(word(self, self->rpos), __ATOMIC_ACQUIRE);
    if (used > self->capacity || (used & 7u)) {
        rc = CORRUPT_COUNTER;
        goto done;
    }
    if (self->capacity - used < need) {
        rc = FULL;
        goto done;
    }
    uint8_t *data = self->base + self->data;
    uint64_t pos = w & self->mask;
    uint64_t prefix = n | ((n ^ CHECK) << 32);
    memcpy(data + pos, &prefix, PREFIX);
    uint64_t start = (pos + PREFIX) & self->mask;
    uint64_t first = n < self->capacity - start ? n : self->capacity - start;
    memcpy(data + start, p.buf, first);
    if (first < n)
        memcpy(data, (uint8_t *)p.buf + first, n - first);
    self->w = w + need;
    __atomic_store_n(word(self, self->wpos), self->w, __ATOMIC_RELEASE);   /* publish */
    self->frames_written++;
    if (wake_if_waiting(self, self->rflag, self->data_efd) < 0) {
        PyBuffer_Release(&p);
        return NULL;
    }
done:
    PyBuffer_Release(&p);
    return PyLong_FromLong(rc);
}

/* The next frame: bytes, None when empty, or an error code. */
static PyObject *take(Shared *self) {
    if (!self->consuming) {
        self->consuming = 1;
        retire(self, self->rflag);
    }
    uint64_t r = self->r;
    uint64_t avail = __atomic_load_n(word(self, self->wpos), __ATOMIC_ACQUIRE) - r;
    if (!avail)
        Py_RETURN_NONE;
    if (avail > self->capacity || (avail & 7u))
        return PyLong_FromLong(CORRUPT_COUNTER);
    uint8_t *data = self->base + self->data;
    uint64_t pos = r & self->mask, prefix;
    memcpy(&prefix, data + pos, PREFIX);
    uint64_t n = prefix & CHECK;
    if ((prefix >> 32) != (n ^ CHECK) || n > self->max_frame || pad(n) > avail)
        return PyLong_FromLong(CORRUPT_PREFIX);
    PyObject *frame = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (!frame)
        return NULL;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(frame);
    uint64_t start = (pos + PREFIX) & self->mask;
    uint64_t first = n < self->capacity - start ? n : self->capacity - start;
    memcpy(out, data + start, first);
    if (first < n)
        memcpy(out + first, data, n - first);
    self->r = r + pad(n);
    /* release: the copy above completes before the producer may reuse the bytes */
    __atomic_store_n(word(self, self->rpos), self->r, __ATOMIC_RELEASE);
    self->frames_read++;
    if (wake_if_waiting(self, self->wflag, self->space_efd) < 0) {
        Py_DECREF(frame);
        return NULL;
    }
    return frame;
}

static PyObject *Shared_take(Shared *self, PyObject *unused) {
    if (!self->base)
        return PyLong_FromLong(RELEASED);
    return take(self);
}

static inline uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Watch the write counter for up to ``spin_ns`` with the GIL released (other
 * threads of the process run meanwhile): 1 when a frame was published. No
 * announcement: the producer does not signal a spinning consumer, so a frame
 * caught here costs the producer no eventfd write and us no wake-up. The
 * caller decides whether a core is free for it (ring.py). */
static int spin_for_frame(Shared *self, uint64_t spin_ns) {
    int got = 0;
    if (!self->base)
        return 0;
    /* Raised with the GIL held, so never while release() runs (it holds the
     * GIL throughout); dropped before the GIL is taken back, or release()
     * would wait for us while we wait for the GIL it holds. */
    __atomic_store_n(&self->spinning, 1, __ATOMIC_SEQ_CST);
    uint64_t *wpos = word(self, self->wpos);
    uint64_t r = self->r;
    Py_BEGIN_ALLOW_THREADS
    uint64_t end = now_ns() + spin_ns;
    for (unsigned turn = 1;; turn++) {
        if (__atomic_load_n(wpos, __ATOMIC_ACQUIRE) != r) {
            got = 1;
            break;
        }
        if (__atomic_load_n(&self->releasing, __ATOMIC_SEQ_CST))
            break;
        cpu_relax();
        if (!(turn & 31) && now_ns() >= end)
            break;
    }
    __atomic_store_n(&self->spinning, 0, __ATOMIC_SEQ_CST);
    Py_END_ALLOW_THREADS
    return got;
}

/* take_blocking() -> bytes or an error code: check, announce, re-check, sleep
 * in poll(2) on the data eventfd with the GIL released, drain it, retire,
 * repeat. The eventfd is non-blocking (ring.py creates it so and attach
 * refuses anything else), so the drain cannot block even if another holder
 * emptied the counter after poll returned: EAGAIN there means "already 0".
 * With ``also`` >= 0 the poll watches that fd too, and ALSO is returned once
 * it is readable while no frame is ready (a frame wins): the whole wait of a
 * burst's serving thread (its stop eventfd) in one call, with no Python
 * between the wake-up and the frame. */
static PyObject *take_waiting(Shared *self, int also, uint64_t spin_ns) {
    for (int spun = 0;; spun = 1) {
        if (!self->base)
            return PyLong_FromLong(RELEASED);
        PyObject *frame = take(self);
        if (frame != Py_None)
            return frame;
        Py_DECREF(frame);
        if (spin_ns && !spun) {
            if (spin_for_frame(self, spin_ns))
                continue;     /* (take() at the top copies it out) */
            if (!self->base)  /* released by close() in another thread meanwhile */
                return PyLong_FromLong(RELEASED);
        }
        announce(self, self->rflag);
        frame = take(self);
        if (frame != Py_None) {
            retire(self, self->rflag);
            return frame;
        }
        Py_DECREF(frame);
        uint64_t count;
        int n, err;
        struct pollfd pfd[2] = {{.fd = self->data_efd, .events = POLLIN},
                                {.fd = also, .events = POLLIN}};
        Py_BEGIN_ALLOW_THREADS
        n = poll(pfd, also >= 0 ? 2 : 1, -1);
        err = errno;
        if (n > 0 && (pfd[0].revents & POLLIN) && drain(pfd[0].fd, &count) < 0
                && errno != EAGAIN)
            n = -1, err = errno;
        Py_END_ALLOW_THREADS
        if (!self->base)     /* released by close() in another thread meanwhile */
            return PyLong_FromLong(RELEASED);
        retire(self, self->rflag);
        if (n < 0) {
            if (err == EINTR) {
                if (PyErr_CheckSignals() < 0)
                    return NULL;
                continue;
            }
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if ((pfd[0].revents | (also >= 0 ? pfd[1].revents : 0)) & (POLLNVAL | POLLERR)) {
            errno = EBADF;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (also >= 0 && (pfd[1].revents & (POLLIN | POLLHUP))) {
            frame = take(self);           /* a ready frame wins over ``also`` */
            if (frame != Py_None)
                return frame;
            Py_DECREF(frame);
            return PyLong_FromLong(ALSO);
        }
    }
}

static PyObject *Shared_take_blocking(Shared *self, PyObject *unused) {
    return take_waiting(self, -1, 0);
}

static PyObject *Shared_take_blocking_or(Shared *self, PyObject *arg) {
    long also = PyLong_AsLong(arg);    /* (public API: _PyLong_AsInt left in 3.13) */
    if (also == -1 && PyErr_Occurred())
        return NULL;
    if (also < 0 || also > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "also must be a file descriptor");
        return NULL;
    }
    return take_waiting(self, (int)also, 0);
}

/* take_spinning_or(also, spin_ns): take_blocking_or, first watching the ring
 * for ``spin_ns`` nanoseconds (GIL released) before announcing and sleeping. */
static PyObject *Shared_take_spinning_or(Shared *self, PyObject *args) {
    int also;
    unsigned long long spin_ns;
    if (!PyArg_ParseTuple(args, "iK", &also, &spin_ns))
        return NULL;
    if (also < 0) {
        PyErr_SetString(PyExc_ValueError, "also must be a file descriptor");
        return NULL;
    }
    return take_waiting(self, also, (uint64_t)spin_ns);
}

static PyObject *Shared_announce(Shared *self, PyObject *arg) {
    int space = PyObject_IsTrue(arg);
    if (space < 0)
        return NULL;
    if (self->base)
        announce(self, space ? self->wflag : self->rflag);
    Py_RETURN_NONE;
}

static PyObject *Shared_retire(Shared *self, PyObject *arg) {
    int space = PyObject_IsTrue(arg);
    if (space < 0)
        return NULL;
    if (self->base)
        retire(self, space ? self->wflag : self->rflag);
    Py_RETURN_NONE;
}

/* frame_ready() -> bool: has the producer published past our read counter? */
static PyObject *Shared_frame_ready(Shared *self, PyObject *unused) {
    if (!self->base)
        Py_RETURN_FALSE;
    return PyBool_FromLong(__atomic_load_n(word(self, self->wpos), __ATOMIC_ACQUIRE) != self->r);
}

/* space_free() -> bytes free as the producer sees them. */
static PyObject *Shared_space_free(Shared *self, PyObject *unused) {
    if (!self->base)
        return PyLong_FromLong(0);
    uint64_t used = self->w - __atomic_load_n(word(self, self->rpos), __ATOMIC_ACQUIRE);
    return PyLong_FromUnsignedLongLong(used > self->capacity ? 0 : self->capacity - used);
}

/* stats() -> (w, r, frames_written, frames_read) of this end. */
static PyObject *Shared_stats(Shared *self, PyObject *unused) {
    return Py_BuildValue("KKKK", (unsigned long long)self->w, (unsigned long long)self->r,
                         (unsigned long long)self->frames_written,
                         (unsigned long long)self->frames_read);
}

static PyMethodDef Shared_methods[] = {
    {"put", (PyCFunction)Shared_put, METH_O, "publish a frame"},
    {"take", (PyCFunction)Shared_take, METH_NOARGS, "take a frame"},
    {"take_blocking", (PyCFunction)Shared_take_blocking, METH_NOARGS, "take a frame, sleeping"},
    {"take_blocking_or", (PyCFunction)Shared_take_blocking_or, METH_O,
     "take a frame, sleeping until one comes or the fd given is readable (-7)"},
    {"take_spinning_or", (PyCFunction)Shared_take_spinning_or, METH_VARARGS,
     "take_blocking_or(also), watching the ring for spin_ns first (GIL released)"},
    {"announce", (PyCFunction)Shared_announce, METH_O, "announce a waiter (True: for space)"},
    {"retire", (PyCFunction)Shared_retire, METH_O, "withdraw the announcement"},
    {"frame_ready", (PyCFunction)Shared_frame_ready, METH_NOARGS, "a frame is published"},
    {"space_free", (PyCFunction)Shared_space_free, METH_NOARGS, "free bytes"},
    {"stats", (PyCFunction)Shared_stats, METH_NOARGS, "counters of this end"},
    {"release", (PyCFunction)Shared_release, METH_NOARGS, "release the mapping"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SharedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nnrt.fmq._native.Shared",
    .tp_basicsize = sizeof(Shared),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "atomics and the frame copy over a ring's mapping",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Shared_init,
    .tp_dealloc = (destructor)Shared_dealloc,
    .tp_methods = Shared_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "fmq ring fast path: atomics, fences, frame copy", -1, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&SharedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&SharedType);
    if (PyModule_AddObject(m, "Shared", (PyObject *)&SharedType) < 0) {
        Py_DECREF(&SharedType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
