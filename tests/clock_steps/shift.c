/*
 * Shifts the wall clock of a process by the number of milliseconds written in the file
 * named by RETRYSAFE_CLOCK_SHIFT_FILE (for example "30000" or "-30000"), re-read on
 * every call, so that a test can step the clock of a running server forward and back.
 * Preloaded (LD_PRELOAD) into the private redis-server of tests/clock_steps.rs.
 *
 * libfaketime does the same for the private PostgreSQL of that test; Debian's
 * redis-server cannot run under it (libfaketime's initialisation recurses through
 * jemalloc's, and the server does not start). This shim allocates nothing and looks
 * nothing up: raw system calls only.
 *
 * Only CLOCK_REALTIME (what Redis's TIME, key expiry and the scripts' clock read) is
 * shifted; the monotonic clock is not, as with a real step of the system clock.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long shift_ms(void) {
    const char *path = getenv("RETRYSAFE_CLOCK_SHIFT_FILE");
    if (path == NULL) {
        return 0;
    }
    int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY);
    if (fd < 0) {
        return 0;
    }
    char buf[32];
    long n = syscall(SYS_read, fd, buf, sizeof buf - 1);
    syscall(SYS_close, fd);
    long long value = 0;
    int negative = 0;
    long i = 0;
    if (n > 0 && (buf[0] == '-' || buf[0] == '+')) {
        negative = buf[0] == '-';
        i = 1;
    }
    for (; i < n && buf[i] >= '0' && buf[i] <= '9'; i++) {
        value = value * 10 + (buf[i] - '0');
    }
    return negative ? -value : value;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    long r = syscall(SYS_clock_gettime, clock, ts);
    if (r == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec
                       + shift_ms() * 1000000LL;
        ts->tv_sec = ns / 1000000000LL;
        ts->tv_nsec = ns % 1000000000LL;
    }
    return (int)r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    (void)tz;
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) {
        return -1;
    }
    if (tv != NULL) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t != NULL) {
        *t = ts.tv_sec;
    }
    return ts.tv_sec;
}
