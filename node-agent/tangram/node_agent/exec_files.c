/*
 * The exec server's file operations: the files API of a trajectory, done by the
 * environment's own exec server (included by exec_server.c, one static binary).
 *
 * They run in the forked handler, so with the container's namespaces, user and mounts:
 * a file can be written exactly where the environment's commands could write it, and is
 * owned by the environment's user. No `docker cp`, no API-server round trip, no core.
 *
 * Request: an 'F' frame (NUL-terminated strings: op, path, argument), where path is
 * absolute inside the environment's root. Every path is resolved by openat2(2) from the
 * root's descriptor: in a container (the listening server) with RESOLVE_IN_ROOT, so a
 * symlink resolves as the environment sees it and never above its root; in a directory
 * of the host (`--files ROOT`, the process runtime) with RESOLVE_BENEATH, so a symlink
 * that leads out of the directory is refused (EXDEV). /proc magic links are refused in
 * both (RESOLVE_NO_MAGICLINKS), and a ".." component is refused before any lookup. In a
 * container, a change at or under /.tangram (this server's binary and socket) is refused
 * (EPERM), by its path up front and by identity through a symlink.
 *
 *   read PATH          'S' entry of the opened file, '1' data of exactly the entry's size,
 *                      'X' "0". A file whose size stat cannot tell (0, as /proc's are, or
 *                      of sysfs and its like, 4096 whatever they hold) is read whole first,
 *                      at most 16 MiB (more: EFBIG), and its entry says the size read. A
 *                      file that shrinks while it is read fails midway (ESTALE), never
 *                      ends short of its entry's size; one that grows is sent as it was.
 *                      A device, FIFO or socket is refused (EINVAL).
 *   write PATH MODE    'S' once a temporary file beside PATH is open; then the agent
 *                      sends 'I' data... and 'E'; the file is renamed over PATH (atomic:
 *                      readers see the old file or the whole new one), 'X' bytes written.
 *                      If the agent goes before 'E', the temporary file is removed. A
 *                      device, FIFO or socket at PATH is refused (EINVAL) before any
 *                      temporary is made: it is never replaced.
 *                      MODE "644:keep" (E2B's writes, as envd's): a symlink at PATH is
 *                      written through, to the file it leads to (resolved as any path is:
 *                      one leading out is refused), and a file replaced keeps its mode and,
 *                      where the server may set it, its owner; 644 is a new file's mode.
 *                      (An older server reads "644:keep" as 644.)
 *   list PATH          '1' an entry per directory member, 'X' "0"
 *   stat PATH          '1' the entry of PATH itself (a symlink is not followed)
 *   mkdir PATH         with its parents; 'X' "1" made, "0" it was a directory already
 *   remove PATH        a file, a symlink or a whole tree (never following symlinks)
 *   rename PATH TO     'X' "0"; a device, FIFO or socket at TO is refused (EINVAL)
 *   tar PATH, untar PATH: a directory as one tar stream (exec_tar.c)
 * An entry is 8 NUL-terminated strings: type (f d l o), mode (octal), size, mtime (ns),
 * uid, gid, name, symlink target. A failure is a 'Z' frame: "<errno> <message>".
 */
#include <linux/openat2.h>
#include <sys/statfs.h>
#include <sys/syscall.h>

#define MAX_DEPTH 256 /* directory levels a remove or a tar descends */
/* Said of a tree past MAX_DEPTH, with E2BIG (a limit of the server's, as a listing's
 * entries are), not ELOOP, which callers read as a symlink loop. */
#define TOO_DEEP "the tree is deeper than 256 directory levels"

static int files_root = -1;
static unsigned long long files_resolve;

static int fail_why(int sock, int err, const char *what, const char *path, const char *why) {
    char msg[4200];
    snprintf(msg, sizeof msg, "%d %s %s: %s", err, what, path, why);
    send_text(sock, 'Z', msg);
    return -1;
}

static int fail(int sock, int err, const char *what, const char *path) {
    return fail_why(sock, err, what, path, strerror(err));
}

/* What a file of MODE is, if it is one that a write or a tar must never replace: a device,
 * FIFO or socket is used through its name (a "> /dev/null" of every command), and a
 * regular file renamed over it would take its place. NULL for any other. */
static const char *special(mode_t mode) {
    return S_ISCHR(mode)    ? "a character device"
           : S_ISBLK(mode)  ? "a block device"
           : S_ISFIFO(mode) ? "a FIFO"
           : S_ISSOCK(mode) ? "a socket"
                            : NULL;
}

/* Why NAME in DIRFD may not be replaced, into WHY (LEADS: it was named through a symlink),
 * or NULL when it may be (or is not there). */
static const char *not_replaced(int dirfd, const char *name, int leads, char *why, size_t n) {
    struct stat st;
    const char *kind = fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 ? special(st.st_mode) : NULL;
    if (kind == NULL) return NULL;
    snprintf(why, n, "not a regular file: it %s %s, which the files API never replaces (a "
             "command can write to it)", leads ? "leads to" : "is", kind);
    return why;
}

/* Refuses (EINVAL, said as WHAT PATH) replacing NAME in DIRFD when not_replaced says so. */
static int refuse_special(int sock, int dirfd, const char *name, const char *what,
                          const char *path, int leads) {
    char why[200];
    if (not_replaced(dirfd, name, leads, why, sizeof why) == NULL) return 0;
    return fail_why(sock, EINVAL, what, path, why);
}

/* The root-relative form of an absolute path, or NULL (errno EPERM) if it has "..". */
static const char *relative(const char *path) {
    for (const char *p = path; *p;) {
        while (*p == '/') p++;
        const char *end = strchr(p, '/');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.') {
            errno = EPERM;
            return NULL;
        }
        p += n;
    }
    while (*path == '/') path++;
    return *path ? path : ".";
}

/* Said of a change at or under /.tangram (the exec server's binary and socket directory,
 * mounts of the runtime's): a remove there took the socket, then met the mount (EBUSY). */
#define RESERVED "/.tangram is reserved for the exec server (its binary and socket): the " \
                 "files API changes nothing in it"

/* Whether PATH (absolute, no "..") is /.tangram or beneath it, in a container's root (the
 * process runtime's directory reserves nothing). */
static int reserved(const char *path) {
    if (!(files_resolve & RESOLVE_IN_ROOT)) return 0;
    for (const char *p = path; *p;) {
        while (*p == '/') p++;
        const char *end = strchr(p, '/');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == 1 && p[0] == '.') { /* "/./.tangram" is /.tangram */
            p += n;
            continue;
        }
        return n == 8 && memcmp(p, ".tangram", 8) == 0;
    }
    return 0;
}

/* /.tangram, /.tangram/run and (pods) /.tangram/bin as the server found them at start (a
 * container's), so that a change reached through a symlink (a link to /.tangram/run) is
 * refused too. */
static struct { dev_t dev; ino_t ino; } reserved_dirs[3];
static int nreserved;

static int is_reserved(const struct stat *st) {
    for (int i = 0; i < nreserved; i++)
        if (st->st_dev == reserved_dirs[i].dev && st->st_ino == reserved_dirs[i].ino) return 1;
    return 0;
}

/* Whether NAME in the directory DIRFD is one of reserved_dirs or in one. */
static int in_reserved(int dirfd, const char *name) {
    struct stat st;
    if (nreserved == 0) return 0;
    if (fstat(dirfd, &st) == 0 && is_reserved(&st)) return 1;
    return fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && is_reserved(&st);
}

/* REL (no "..") opened from the directory AT, resolved as RESOLVE says. */
static int open_at(int at, unsigned long long resolve, const char *rel, int flags) {
    struct open_how how = {.flags = (unsigned long long)(flags | O_CLOEXEC), .resolve = resolve};
    int fd, tries = 0;
    /* EAGAIN: a ".." (in a symlink's target) resolved while something anywhere renamed or
     * mounted, so the kernel could not vouch it stayed inside; trying again is the cure. */
    do fd = (int)syscall(SYS_openat2, at, rel, &how, sizeof how);
    while (fd < 0 && errno == EAGAIN && ++tries < 1000);
    if (fd < 0 && errno == ENOSYS) errno = EOPNOTSUPP; /* a kernel before 5.6 */
    return fd;
}

static int open_in(const char *path, int flags) {
    const char *rel = relative(path);
    return rel == NULL ? -1 : open_at(files_root, files_resolve, rel, flags);
}

/* Makes the directory REL (no "..") and its missing parents, each resolved from AT as
 * RESOLVE says, and opens it (O_PATH: a directory that is there need not be readable to
 * be made or to make, write and link in, as for a command); *made tells whether any was
 * made. A file in the way is ENOTDIR. */
static int make_dirs(int at, unsigned long long resolve, const char *rel, int *made) {
    char prefix[4096];
    size_t n = strlen(rel);
    if (n >= sizeof prefix) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(prefix, rel, n + 1);
    int fd = open_at(at, resolve, prefix, O_PATH | O_DIRECTORY);
    if (fd >= 0 || errno != ENOENT) return fd; /* the common case: it is there already */
    /* From the top: each component is made in its parent, opened afresh from AT. */
    for (size_t i = 1; i <= n; i++) {
        if (i < n && rel[i] != '/') continue;
        prefix[i] = '\0';
        char *slash = strrchr(prefix, '/');
        const char *base = slash ? slash + 1 : prefix;
        if (*base != '\0' && strcmp(base, ".") != 0) {
            if (slash) *slash = '\0';
            int pfd = open_at(at, resolve, slash ? prefix : ".", O_PATH | O_DIRECTORY);
            if (slash) *slash = '/';
            if (pfd < 0) return -1;
            int rc = mkdirat(pfd, base, 0755), err = errno;
            close(pfd);
            if (rc == 0) *made = 1;
            else if (err != EEXIST) return errno = err, -1;
        }
        prefix[i] = rel[i];
    }
    return open_at(at, resolve, rel, O_PATH | O_DIRECTORY); /* ENOTDIR: a file in the way */
}

/* Splits PATH into its parent directory (opened) and its last component. */
static int open_parent(const char *path, char *dir, size_t dirlen, const char **base) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--; /* "a/b/" names b */
    if (n >= dirlen) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(dir, path, n);
    dir[n] = '\0';
    char *slash = strrchr(dir, '/');
    *base = slash ? slash + 1 : dir;
    if (**base == '\0' || strcmp(*base, ".") == 0 || strcmp(*base, "..") == 0) {
        errno = EBUSY; /* the root itself, or not a name: nothing to replace or remove */
        return -1;
    }
    static char parent[4096];
    size_t plen = slash ? (size_t)(slash - dir) : 0;
    memcpy(parent, dir, plen);
    parent[plen] = '\0';
    return open_in(plen ? parent : "/", O_RDONLY | O_DIRECTORY);
}

/* An entry in a frame of type KIND: NAME in DIRFD, sent as SHOWN. */
static int send_entry_as(int sock, char kind, int dirfd, const char *name, const char *shown,
                         const struct stat *st) {
    char target[4096] = "";
    char type = S_ISREG(st->st_mode) ? 'f' : S_ISDIR(st->st_mode) ? 'd' : S_ISLNK(st->st_mode) ? 'l' : 'o';
    if (type == 'l') {
        ssize_t n = readlinkat(dirfd, name, target, sizeof target - 1);
        target[n > 0 ? n : 0] = '\0';
    }
    char head[160];
    int len = snprintf(head, sizeof head, "%c%c%o%c%lld%c%lld%c%u%c%u%c", type, 0,
                       (unsigned)(st->st_mode & 07777), 0, (long long)st->st_size, 0,
                       (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec, 0,
                       (unsigned)st->st_uid, 0, (unsigned)st->st_gid, 0);
    size_t nlen = strlen(shown) + 1, tlen = strlen(target) + 1;
    char *buf = malloc((size_t)len + nlen + tlen);
    if (buf == NULL) return -1;
    memcpy(buf, head, (size_t)len);
    memcpy(buf + len, shown, nlen);
    memcpy(buf + len + nlen, target, tlen);
    int rc = send_frame(sock, kind, buf, (uint32_t)((size_t)len + nlen + tlen));
    free(buf);
    return rc;
}

static int send_entry(int sock, int dirfd, const char *name, const struct stat *st) {
    return send_entry_as(sock, '1', dirfd, name, name, st);
}

/* The first ``size`` bytes of ``fd`` as '1' frames. A file that grows meanwhile is sent as
 * it was (a reader may count on the size it was told). One that shrinks is, with ``pad``,
 * filled with zeros to the size (a tar member must have the size its header said), and
 * otherwise a failure (ESTALE): the reader was told a size that no longer holds, and gets
 * no silently short file. -1 once a read failed (said as ``what`` ``shown``) or a send did. */
static int send_contents(int sock, int fd, off_t size, int pad, const char *what,
                         const char *shown) {
    static char buf[1 << 20]; /* a chunk of the agent link (STREAM_CHUNK) */
    off_t left = size;
    while (left > 0) {
        size_t want = left < (off_t)sizeof buf ? (size_t)left : sizeof buf;
        ssize_t n = read(fd, buf, want);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return fail(sock, errno, what, shown);
        if (n == 0) {
            if (!pad) {
                char why[160];
                snprintf(why, sizeof why, "it shrank while it was read (it ended after %lld "
                         "of its %lld bytes): read it again", (long long)(size - left),
                         (long long)size);
                return fail_why(sock, ESTALE, what, shown, why);
            }
            memset(buf, 0, want);
            n = (ssize_t)want;
        }
        if (send_frame(sock, '1', buf, (uint32_t)n) < 0) return -1;
        left -= n;
    }
    return 0;
}

/* The most a read takes of a file whose size stat cannot tell (size_known): such a file
 * is read whole before its entry is sent, so that the entry says the size it has. */
#define MAX_UNSIZED (16u << 20)

/* Whether ST's size is what reading FD gives. Not for a file of size 0 (/proc's, cgroupfs's:
 * they have content all the same) nor for any of a file system whose sizes are made up
 * (sysfs says 4096, whatever an attribute holds). */
static int size_known(int fd, const struct stat *st) {
    struct statfs fs;
    if (st->st_size == 0) return 0;
    if (fstatfs(fd, &fs) < 0) return 1;
    switch ((unsigned long)fs.f_type) {
    case 0x9fa0UL:     /* proc */
    case 0x62656572UL: /* sysfs */
    case 0x27e0ebUL:   /* cgroup */
    case 0x63677270UL: /* cgroup2 */
    case 0x64626720UL: /* debugfs */
    case 0x74726163UL: /* tracefs */
    case 0x73636673UL: /* securityfs */
    case 0x62656570UL: /* configfs */
        return 0;
    default:
        return 1;
    }
}

/* Reads FD to its end, at most MAX_UNSIZED bytes, into *OUT (malloc'd), its length in
 * *LEN; -1 with errno (EFBIG: it holds more; EAGAIN: reading it would block). Reads ask
 * for whole pages (/proc's pagemap reads only in 8-byte steps). */
static int read_whole(int fd, char **out, size_t *len) {
    size_t cap = 64 << 10, got = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (buf == NULL) return errno = ENOMEM, -1;
        if (got > MAX_UNSIZED) {
            free(buf);
            return errno = EFBIG, -1;
        }
        if (got == cap) {
            cap = cap < MAX_UNSIZED ? cap * 2 : MAX_UNSIZED + 4096; /* room to see it is more */
            char *more = realloc(buf, cap);
            if (more == NULL) free(buf);
            buf = more;
            continue;
        }
        ssize_t n = read(fd, buf + got, cap - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            int err = errno;
            free(buf);
            return errno = err, -1;
        }
        if (n == 0) {
            *out = buf, *len = got;
            return 0;
        }
        got += (size_t)n;
    }
}

/* A file whose size stat cannot tell: read whole first, then sent with the size it had. */
static int read_unsized(int sock, int fd, const char *path, struct stat *st) {
    char *data;
    size_t len;
    if (read_whole(fd, &data, &len) < 0) {
        if (errno == EFBIG)
            return fail_why(sock, EFBIG, "read", path, "its size is not known ahead (0, or "
                            "a file of /proc or /sys) and it holds over 16 MiB: read it with "
                            "a command");
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return fail_why(sock, EINVAL, "read", path, "reading it would block (a stream, "
                            "not a file): read it with a command");
        return fail(sock, errno, "read", path);
    }
    st->st_size = (off_t)len;
    const char *slash = strrchr(path, '/');
    int rc = send_entry(sock, fd, slash ? slash + 1 : path, st);
    for (size_t at = 0; rc == 0 && at < len; at += 1u << 20) {
        size_t n = len - at < (1u << 20) ? len - at : 1u << 20;
        rc = send_frame(sock, '1', data + at, (uint32_t)n);
    }
    free(data);
    return rc < 0 ? -1 : send_text(sock, 'X', "0");
}

static int op_read(int sock, const char *path) {
    int fd = open_in(path, O_RDONLY | O_NOCTTY | O_NONBLOCK);
    struct stat st;
    if (fd < 0 && errno == ENXIO) /* what open(2) says of a socket */
        return fail_why(sock, EINVAL, "read", path, "not a regular file: it is a socket (or a "
                        "device with no driver): read it with a command");
    if (fd < 0 || fstat(fd, &st) < 0) return fail(sock, errno, "read", path);
    if (S_ISDIR(st.st_mode)) return fail(sock, EISDIR, "read", path);
    if (!S_ISREG(st.st_mode)) { /* a FIFO or a device could block or never end */
        char why[200];
        snprintf(why, sizeof why, "not a regular file: it is %s, whose read may block or never "
                 "end: read it with a command", special(st.st_mode) ? special(st.st_mode) : "no file");
        return fail_why(sock, EINVAL, "read", path, why);
    }
    if (!size_known(fd, &st)) return read_unsized(sock, fd, path, &st);
    const char *slash = strrchr(path, '/');
    if (send_entry(sock, fd, slash ? slash + 1 : path, &st) < 0) return -1;
    if (send_contents(sock, fd, st.st_size, 0, "read", path) < 0) return -1;
    return send_text(sock, 'X', "0");
}

/* The parent directory of PATH (absolute; ".." components allowed: they are a symlink
 * target's, resolved by openat2 within the root as the kernel resolves them), opened, and
 * its last component, in DIR; like open_parent otherwise. */
static int open_parent_raw(const char *path, char *dir, size_t dirlen, const char **base) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    if (n >= dirlen) return errno = ENAMETOOLONG, -1;
    memcpy(dir, path, n);
    dir[n] = '\0';
    char *slash = strrchr(dir, '/');
    *base = slash ? slash + 1 : dir;
    if (**base == '\0' || strcmp(*base, ".") == 0 || strcmp(*base, "..") == 0)
        return errno = EISDIR, -1; /* a directory, not a file to write */
    if (slash) *slash = '\0';
    const char *rel = dir;
    while (*rel == '/') rel++;
    int fd = open_at(files_root, files_resolve, *rel ? rel : ".", O_RDONLY | O_DIRECTORY);
    if (slash) *slash = '/';
    return fd;
}

/* Follows a symlink at *BASE in *DFD (PATH's last component, PATH in DIR) to what it leads
 * to, hop by hop, until what is there is no symlink or nothing: *DFD and *BASE then name
 * it. A target is resolved as the link's directory followed by the target (what the
 * kernel does), from the root with the server's RESOLVE flags: in a container it stays in
 * the container's root, in the process runtime's directory a target leading out of it is
 * refused (EXDEV), an absolute one too (as RESOLVE_BENEATH refuses it). The symlinks
 * followed, or -1. */
static int follow_last(int *dfd, const char **base, char *dir, size_t dirlen) {
    for (int hops = 0;; hops++) {
        struct stat st;
        if (fstatat(*dfd, *base, &st, AT_SYMLINK_NOFOLLOW) < 0) return errno == ENOENT ? hops : -1;
        if (!S_ISLNK(st.st_mode)) return hops;
        if (hops >= 40) return errno = ELOOP, -1; /* as the kernel's limit */
        char target[4096], next[8200];
        ssize_t n = readlinkat(*dfd, *base, target, sizeof target - 1);
        if (n <= 0) return n == 0 ? (errno = ENOENT, -1) : -1;
        target[n] = '\0';
        if (target[n - 1] == '/') return errno = EISDIR, -1; /* a directory's name */
        if (target[0] == '/') {
            if (files_resolve & RESOLVE_BENEATH) return errno = EXDEV, -1;
            snprintf(next, sizeof next, "%s", target);
        } else {
            size_t keep = (size_t)(*base - dir); /* the link's directory, with its '/' */
            snprintf(next, sizeof next, "%.*s%s", (int)keep, dir, target);
        }
        close(*dfd);
        if ((*dfd = open_parent_raw(next, dir, dirlen, base)) < 0) return -1;
    }
}

static int op_write(int sock, const char *path, const char *mode_text) {
    char dir[4096];
    const char *base;
    char *rest;
    mode_t mode = (mode_t)(strtoul(mode_text, &rest, 8) & 07777);
    int keep = strcmp(rest, ":keep") == 0;
    int dfd = open_parent(path, dir, sizeof dir, &base);
    if (dfd < 0) return fail(sock, errno, "write", path);
    struct stat old;
    int replaces = 0, hops = keep ? follow_last(&dfd, &base, dir, sizeof dir) : 0;
    if (hops < 0) return fail(sock, errno, "write", path);
    if (in_reserved(dfd, base)) return fail_why(sock, EPERM, "write", path, RESERVED);
    /* Before the temporary is made: its rename would put a file in the device's place,
     * and where the user may not make one (/dev) the refusal would be EACCES instead. */
    if (refuse_special(sock, dfd, base, "write", path, hops > 0) < 0) return -1;
    if (keep && fstatat(dfd, base, &old, AT_SYMLINK_NOFOLLOW) == 0) {
        if (S_ISDIR(old.st_mode)) return fail(sock, EISDIR, "write", path);
        replaces = S_ISREG(old.st_mode);
        if (replaces) mode = old.st_mode & 07777;
    }
    char tmp[600];
    if (snprintf(tmp, sizeof tmp, ".%.200s.tangram-%d", base, (int)getpid()) >= (int)sizeof tmp)
        return fail(sock, ENAMETOOLONG, "write", path);
    int fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return fail(sock, errno, "write", path);
    send_text(sock, 'S', "ready");
    long long total = 0;
    int err = 0;
    for (;;) {
        char type, *data;
        uint32_t len;
        if (recv_frame(sock, &type, &data, &len) < 0) { /* the agent went: nothing lands */
            unlinkat(dfd, tmp, 0);
            return -1;
        }
        if (type == 'I' && !err && write_all(fd, data, len) < 0) err = errno;
        total += len;
        free(data);
        if (type == 'E') break;
    }
    /* The owner first: a chown clears set-id bits, which the mode then sets again. Not
     * permitted (the file was another user's): the writer's, as any new file is. */
    if (!err && replaces && fchown(fd, old.st_uid, old.st_gid) < 0 && errno != EPERM) err = errno;
    if (!err && fchmod(fd, mode) < 0) err = errno;
    if (close(fd) < 0 && !err) err = errno; /* a full disk may show only here */
    if (!err && renameat(dfd, tmp, dfd, base) < 0) err = errno;
    if (err) {
        unlinkat(dfd, tmp, 0);
        return fail(sock, err, "write", path);
    }
    char text[32];
    snprintf(text, sizeof text, "%lld", total);
    return send_text(sock, 'X', text);
}

static int op_list(int sock, const char *path) {
    int fd = open_in(path, O_RDONLY | O_DIRECTORY);
    DIR *d = fd < 0 ? NULL : fdopendir(fd);
    if (d == NULL) return fail(sock, errno, "list", path);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        struct stat st;
        if (fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue; /* just removed */
        if (send_entry(sock, fd, e->d_name, &st) < 0) return -1;
    }
    closedir(d);
    return send_text(sock, 'X', "0");
}

static int op_stat(int sock, const char *path) {
    char dir[4096];
    const char *base;
    struct stat st;
    int dfd = open_parent(path, dir, sizeof dir, &base);
    if (dfd < 0 && errno == EBUSY) { /* the root */
        dfd = open_in("/", O_RDONLY | O_DIRECTORY);
        base = ".";
    }
    if (dfd < 0 || fstatat(dfd, base, &st, AT_SYMLINK_NOFOLLOW) < 0)
        return fail(sock, errno, "stat", path);
    if (send_entry(sock, dfd, strcmp(base, ".") ? base : "/", &st) < 0) return -1;
    return send_text(sock, 'X', "0");
}

static int op_mkdir(int sock, const char *path) {
    int made = 0, fd = -1;
    const char *rel = relative(path);
    if (rel == NULL || (fd = make_dirs(files_root, files_resolve, rel, &made)) < 0)
        return fail(sock, errno, "mkdir", path);
    close(fd);
    return send_text(sock, 'X', made ? "1" : "0");
}

/* Removes NAME in DIRFD, descending into directories without following symlinks. */
static int remove_tree(int dirfd, const char *name, int depth) {
    if (unlinkat(dirfd, name, 0) == 0) return 0;
    int first = errno;
    if (first != EISDIR && first != EPERM) return -1;
    if (depth >= MAX_DEPTH) {
        errno = E2BIG;
        return -1;
    }
    int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    DIR *d = fd < 0 ? NULL : fdopendir(fd);
    if (d == NULL) { /* not a directory after all: why the unlink failed is the answer */
        if (errno == ENOTDIR || errno == ELOOP) errno = first;
        return -1;
    }
    struct dirent *e;
    int rc = 0;
    while (rc == 0 && (e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
            rc = remove_tree(fd, e->d_name, depth + 1);
    int err = errno;
    closedir(d);
    if (rc < 0) {
        errno = err;
        return -1;
    }
    return unlinkat(dirfd, name, AT_REMOVEDIR);
}

static int op_remove(int sock, const char *path) {
    char dir[4096];
    const char *base;
    int dfd = open_parent(path, dir, sizeof dir, &base);
    if (dfd < 0) return fail(sock, errno, "remove", path);
    if (in_reserved(dfd, base)) return fail_why(sock, EPERM, "remove", path, RESERVED);
    if (remove_tree(dfd, base, 0) < 0)
        return errno == E2BIG /* (unlinkat never says it) */
                   ? fail_why(sock, E2BIG, "remove", path, TOO_DEEP ": remove its depths first")
                   : fail(sock, errno, "remove", path);
    return send_text(sock, 'X', "0");
}

static int op_rename(int sock, const char *path, const char *to) {
    char dir[4096], todir[4096];
    const char *base, *tobase;
    int dfd = open_parent(path, dir, sizeof dir, &base);
    if (dfd < 0) return fail(sock, errno, "rename", path);
    if (in_reserved(dfd, base)) return fail_why(sock, EPERM, "rename", path, RESERVED);
    int tfd = open_parent(to, todir, sizeof todir, &tobase);
    if (tfd < 0) return fail(sock, errno, "rename to", to);
    if (in_reserved(tfd, tobase)) return fail_why(sock, EPERM, "rename to", to, RESERVED);
    if (refuse_special(sock, tfd, tobase, "rename to", to, 0) < 0) return -1;
    if (renameat(dfd, base, tfd, tobase) == 0) return send_text(sock, 'X', "0");
    int err = errno;
    char both[8300];
    snprintf(both, sizeof both, "%s to %s", path, to);
    switch (err) {
    case ENOENT: /* the source: the target's directory was opened */
        return fail(sock, err, "rename", path);
    case EISDIR: case ENOTDIR: case ENOTEMPTY: case EEXIST: case EINVAL:
        return fail(sock, err, "rename to", to); /* what it would replace, or land in */
    case EXDEV: /* not a symlink leading out (the directories were opened beneath) */
        return fail_why(sock, err, "rename", both,
                        "they are on different file systems (a volume): copy, then remove");
    default: /* EACCES, EPERM, EBUSY: either of them */
        return fail(sock, err, "rename", both);
    }
}

#include "exec_tar.c"

static void handle_files(int sock, char *data, uint32_t len) {
    signal(SIGPIPE, SIG_IGN); /* an agent that goes mid-answer is a failed send, not a kill */
    char *f[3] = {NULL, NULL, NULL};
    int n = split(data, len, f, 3);
    if (n < 2) {
        send_text(sock, 'Z', "22 request: a file operation needs an op and a path");
        return;
    }
    const char *op = f[0], *path = f[1], *arg = n > 2 ? f[2] : "";
    int renaming = strcmp(op, "rename") == 0;
    int changes = renaming || strcmp(op, "write") == 0 || strcmp(op, "mkdir") == 0 ||
                  strcmp(op, "remove") == 0 || strcmp(op, "untar") == 0;
    /* Absolute, no ".." anywhere, and no change in /.tangram: refused before any lookup,
     * the target too. */
    for (const char *p = path; p != NULL; p = renaming && p == path ? arg : NULL) {
        if (p[0] != '/') {
            fail(sock, EINVAL, op, p);
            return;
        }
        if (relative(p) == NULL) {
            fail(sock, errno, op, p);
            return;
        }
        if (changes && reserved(p)) {
            fail_why(sock, EPERM, renaming && p == arg ? "rename to" : op, p, RESERVED);
            return;
        }
    }
    if (strcmp(op, "read") == 0) op_read(sock, path);
    else if (strcmp(op, "write") == 0) op_write(sock, path, arg[0] ? arg : "644");
    else if (strcmp(op, "list") == 0) op_list(sock, path);
    else if (strcmp(op, "stat") == 0) op_stat(sock, path);
    else if (strcmp(op, "mkdir") == 0) op_mkdir(sock, path);
    else if (strcmp(op, "remove") == 0) op_remove(sock, path);
    else if (renaming) op_rename(sock, path, arg);
    else if (strcmp(op, "tar") == 0) op_tar(sock, path);
    else if (strcmp(op, "untar") == 0) op_untar(sock, path);
    else fail(sock, EINVAL, "request: no such file operation:", op);
}

/* Where file operations resolve: the container's root, or ROOT of --files. Not through a
 * link: a command may replace its directory with one leading out of it. */
static int files_at(const char *root, int beneath) {
    files_root = open(root, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    files_resolve = RESOLVE_NO_MAGICLINKS | (beneath ? RESOLVE_BENEATH : RESOLVE_IN_ROOT);
    static const char *const dirs[] = {".tangram", ".tangram/run", ".tangram/bin"};
    struct stat st;
    for (int i = 0; !beneath && files_root >= 0 && i < 3; i++)
        if (fstatat(files_root, dirs[i], &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)) {
            reserved_dirs[nreserved].dev = st.st_dev;
            reserved_dirs[nreserved++].ino = st.st_ino;
        }
    return files_root;
}
