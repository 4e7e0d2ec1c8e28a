/*
 * A directory as one tar stream, both ways (included by exec_files.c, whose helpers it
 * uses): the files API's `files/tar` routes.
 *
 *   tar PATH     'S' the entry of the directory PATH; then, for each member beneath it
 *                (depth first, a directory before its members, names sorted, symlinks
 *                never followed): 'S' its entry, named by its path relative to PATH,
 *                and for a file '1' data of exactly the entry's size; 'X' "0". The agent
 *                writes the tar headers (Python's tarfile: ustar, pax for what ustar
 *                cannot hold), so this side knows nothing of the format.
 *   untar PATH   'S' once PATH is a directory or can be one (what is in its way fails
 *                at once); then the agent sends a tar as 'I' data... and 'E', and the
 *                server extracts it beneath PATH, made with its parents once the body's
 *                first header (or its end blocks) shows a tar: a body that is no tar at
 *                all changes nothing. '1' "<members> <bytes>", 'X' "0". A body that is
 *                not a tar, or is cut short, fails with EBADMSG (the body's fault, not
 *                PATH's: the service names the body).
 *
 * Extraction stays beneath PATH whatever the tar says: each member is resolved from
 * PATH's descriptor with RESOLVE_BENEATH, so a ".." member name (refused up front), an
 * absolute symlink or one climbing above PATH (judged by its directory's real depth,
 * with ".." allowed only ahead of names; a hard link to a symlink is judged so where it
 * lands), and a member written through a symlink out are all refused, never followed. Each file lands whole (a temporary beside
 * it, then a rename), directory modes are set once their members are in, set-id bits
 * are dropped and devices and FIFOs refused, as is a member that would replace a device,
 * FIFO or socket. A tar that fails midway keeps the members
 * before the failure: the answer names the member that failed.
 *
 * Formats: ustar (with its name prefix), pax extended headers (path, linkpath, size)
 * and GNU long names ('L', 'K'), as Python's tarfile and GNU tar write them.
 */

#define TAR_BLOCK 512
#define TAR_META_MAX (1u << 20) /* a pax header's bytes at most */
#define BENEATH (RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
#define MAX_MEMBER (1ULL << 62) /* bytes a member may say it holds: no sum overflows */

/* ---- tar: the walk ------------------------------------------------------------------- */

static int skip_dots(const struct dirent *e) {
    return strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
}

/* Sends the file NAME in DIRFD (an 'S' entry as REL, then exactly its size in data). */
static int tar_file(int sock, int dirfd, const char *name, const char *rel) {
    int fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 && errno == ENOENT) return 0; /* removed since the listing: left out */
    if (fd < 0 || fstat(fd, &st) < 0) return fail(sock, errno, "tar", rel);
    int rc = send_entry_as(sock, 'S', dirfd, name, rel, &st) < 0
                 ? -1
                 : send_contents(sock, fd, st.st_size, 1, "tar", rel);
    close(fd);
    return rc;
}

/* The members of the directory DIRFD, whose path relative to the tar's root is REL. */
static int tar_walk(int sock, int dirfd, char *rel, size_t rlen, int depth) {
    if (depth >= MAX_DEPTH) return fail_why(sock, E2BIG, "tar", rel, TOO_DEEP);
    struct dirent **names;
    int n = scandirat(dirfd, ".", &names, skip_dots, alphasort);
    if (n < 0) return fail(sock, errno, "tar", rlen ? rel : ".");
    int rc = 0;
    for (int i = 0; i < n; i++) {
        const char *name = names[i]->d_name;
        size_t nlen = strlen(name);
        struct stat st;
        if (rc == 0 && rlen + 1 + nlen >= 4096) rc = fail(sock, ENAMETOOLONG, "tar", rel);
        if (rc == 0 && fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
            size_t at = rlen ? rlen + 1 : 0;
            if (rlen) rel[rlen] = '/';
            memcpy(rel + at, name, nlen + 1);
            if (S_ISREG(st.st_mode)) {
                rc = tar_file(sock, dirfd, name, rel);
            } else if (S_ISLNK(st.st_mode)) {
                rc = send_entry_as(sock, 'S', dirfd, name, rel, &st);
            } else if (S_ISDIR(st.st_mode)) {
                int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                if (fd < 0) rc = fail(sock, errno, "tar", rel);
                else {
                    rc = send_entry_as(sock, 'S', dirfd, name, rel, &st);
                    if (rc == 0) rc = tar_walk(sock, fd, rel, at + nlen, depth + 1);
                    close(fd);
                }
            } /* a FIFO, socket or device has no content a tar could carry: left out */
            rel[rlen] = '\0';
        } /* (a member removed since the listing is left out too) */
        free(names[i]);
    }
    free(names);
    return rc;
}

static int op_tar(int sock, const char *path) {
    int fd = open_in(path, O_RDONLY | O_DIRECTORY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) return fail(sock, errno, "tar", path);
    const char *slash = strrchr(path, '/');
    if (send_entry_as(sock, 'S', fd, ".", slash && slash[1] ? slash + 1 : path, &st) < 0) return -1;
    static char rel[4096];
    rel[0] = '\0';
    if (tar_walk(sock, fd, rel, 0, 0) < 0) return -1;
    close(fd);
    return send_text(sock, 'X', "0");
}

/* ---- untar: the agent's 'I' frames as one byte stream ---------------------------------- */

static struct {
    int sock;
    char *data;
    uint32_t len, off;
    unsigned long long total; /* bytes taken */
    int ended; /* 'E' came, or the agent went */
    int gone;  /* the agent went: nobody to answer */
} in;

/* Up to MAX bytes of the stream at *P, without copying; 0 at its end. */
static size_t in_take(const char **p, size_t max) {
    while (in.off == in.len) {
        free(in.data);
        in.data = NULL;
        in.len = in.off = 0;
        if (in.ended) return 0;
        char type;
        if (recv_frame(in.sock, &type, &in.data, &in.len) < 0) {
            in.data = NULL;
            in.ended = in.gone = 1;
            return 0;
        }
        if (type == 'E') in.ended = 1;
        if (type != 'I') in.len = 0;
    }
    size_t k = in.len - in.off < max ? in.len - in.off : max;
    *p = in.data + in.off;
    in.off += (uint32_t)k;
    in.total += k;
    return k;
}

static size_t in_read(char *buf, size_t n) {
    size_t got = 0, k;
    const char *p;
    while (got < n && (k = in_take(&p, n - got)) > 0) {
        memcpy(buf + got, p, k);
        got += k;
    }
    return got;
}

/* Reads and drops N bytes; whether they were all there. */
static int in_skip(unsigned long long n) {
    const char *p;
    size_t k;
    while (n > 0 && (k = in_take(&p, n < (1u << 30) ? (size_t)n : (1u << 30))) > 0) n -= k;
    return n == 0;
}

static unsigned long long padding(unsigned long long size) {
    return (TAR_BLOCK - size % TAR_BLOCK) % TAR_BLOCK;
}

/* ---- untar: the headers ------------------------------------------------------------- */

struct member {
    char type;
    char name[4096], link[4096];
    unsigned long long size;
    mode_t mode;
};

/* Overrides from a pax header or GNU long name, for the next member only. */
static struct {
    char name[4096], link[4096];
    unsigned long long size;
    int has_name, has_link, has_size;
} next;

/* A numeric field: octal (NUL or space ended), or base-256 if its first bit is set. */
static int number(const unsigned char *f, size_t n, unsigned long long *out) {
    unsigned long long v = 0;
    if (f[0] & 0x80) {
        v = f[0] & 0x3f;
        if (f[0] & 0x40) return -1; /* negative */
        for (size_t i = 1; i < n; i++) {
            if (v >> 55) return -1;
            v = (v << 8) | f[i];
        }
    } else {
        size_t i = 0;
        while (i < n && f[i] == ' ') i++;
        for (; i < n && f[i] >= '0' && f[i] <= '7'; i++) {
            if (v >> 60) return -1;
            v = v * 8 + (unsigned)(f[i] - '0');
        }
        if (i < n && f[i] != '\0' && f[i] != ' ') return -1;
    }
    *out = v;
    return 0;
}

static int checksum_ok(const unsigned char *h) {
    unsigned long long want;
    if (number(h + 148, 8, &want) < 0) return 0;
    unsigned long sum = 0, ssum = 0; /* some old tars summed signed chars */
    for (int i = 0; i < TAR_BLOCK; i++) {
        unsigned char c = i >= 148 && i < 156 ? ' ' : h[i];
        sum += c;
        ssum += (unsigned long)(long)(signed char)c;
    }
    return want == sum || want == ssum;
}

static void field(char *to, const unsigned char *f, size_t n) {
    size_t k = strnlen((const char *)f, n);
    memcpy(to, f, k);
    to[k] = '\0';
}

/* Applies a pax extended header's records ("<len> <key>=<value>\n") to `next`. */
static int pax(char *data, size_t len) {
    size_t at = 0;
    while (at < len) {
        char *end;
        if (data[at] < '0' || data[at] > '9') return -1; /* (strtoul would skip spaces) */
        unsigned long n = strtoul(data + at, &end, 10);
        if (n == 0 || n > len - at || data[at + n - 1] != '\n') return -1;
        char *last = data + at + n - 1; /* the record's newline */
        if (end >= last || *end != ' ') return -1;
        char *key = end + 1, *eq = memchr(key, '=', (size_t)(last - key));
        if (eq == NULL) return -1;
        *eq = '\0';
        char *value = eq + 1;
        size_t vlen = (size_t)(data + at + n - 1 - value);
        if (strcmp(key, "path") == 0 || strcmp(key, "linkpath") == 0) {
            if (vlen >= sizeof next.name || memchr(value, '\0', vlen)) return -1;
            int is_path = key[0] == 'p';
            char *to = is_path ? next.name : next.link;
            memcpy(to, value, vlen);
            to[vlen] = '\0';
            *(is_path ? &next.has_name : &next.has_link) = 1;
        } else if (strcmp(key, "size") == 0) {
            next.size = strtoull(value, &end, 10);
            if (end != value + vlen || vlen == 0 || next.size > MAX_MEMBER) return -1;
            next.has_size = 1;
        } /* the rest (times, owners, charset) is not applied: the environment's user owns it all */
        at += n;
    }
    return 0;
}

/* Reads a member's data (a pax header, a GNU long name) into a fresh buffer. */
static char *in_meta(unsigned long long size) {
    if (size > TAR_META_MAX) return NULL;
    char *buf = malloc((size_t)size + 1);
    if (buf == NULL) return NULL;
    if (in_read(buf, (size_t)size) != size || !in_skip(padding(size))) {
        free(buf);
        return NULL;
    }
    buf[size] = '\0';
    return buf;
}

/* The next member (0), the tar's end (1), or -1 with *why. */
static int header(struct member *m, const char **why) {
    for (;;) {
        unsigned char h[TAR_BLOCK];
        size_t got = in_read((char *)h, TAR_BLOCK);
        if (got == 0) return 1; /* no end-of-archive blocks: the end all the same */
        if (got < TAR_BLOCK) return *why = "the tar ends inside a header", errno = EBADMSG, -1;
        int zero = 1;
        for (int i = 0; i < TAR_BLOCK && zero; i++) zero = h[i] == 0;
        if (zero) return 1;
        if (!checksum_ok(h))
            return *why = "not a tar: a header's checksum is wrong", errno = EBADMSG, -1;
        unsigned long long size, mode;
        if (number(h + 124, 12, &size) < 0 || number(h + 100, 8, &mode) < 0 || size > MAX_MEMBER)
            return *why = "not a tar: a header's size or mode is not a number in range",
                   errno = EBADMSG, -1;
        char type = (char)h[156];
        if (type == 'x' || type == 'g' || type == 'L' || type == 'K') {
            char *data = in_meta(size);
            if (data == NULL)
                return *why = "an extended header is too long or cut short", errno = EBADMSG, -1;
            int bad = 0;
            if (type == 'x') bad = pax(data, (size_t)size);
            else if (type == 'L' || type == 'K') {
                char *to = type == 'L' ? next.name : next.link;
                if (strnlen(data, (size_t)size) >= sizeof next.name) bad = 1;
                else strcpy(to, data);
                *(type == 'L' ? &next.has_name : &next.has_link) = 1;
            }
            free(data);
            if (bad) return *why = "an extended header is malformed", errno = EBADMSG, -1;
            continue;
        }
        m->type = type;
        m->mode = (mode_t)(mode & 07777);
        m->size = next.has_size ? next.size : size;
        if (next.has_name) {
            strcpy(m->name, next.name);
        } else if (memcmp(h + 257, "ustar\0", 6) == 0 && h[345]) { /* POSIX: prefix/name */
            field(m->name, h + 345, 155);
            strcat(m->name, "/");
            field(m->name + strlen(m->name), h, 100);
        } else {
            field(m->name, h, 100);
        }
        if (next.has_link) strcpy(m->link, next.link);
        else field(m->link, h + 157, 100);
        memset(&next, 0, sizeof next);
        return 0;
    }
}

/* ---- untar: the members ------------------------------------------------------------- */

/* NAME as a path beneath the destination, into OUT (4096 bytes, as NAME): no leading "/"
 * or "./", no "//"; a ".." component is refused (EPERM). */
static int clean(const char *name, char *out) {
    char *start = out;
    for (const char *p = name; *p;) {
        while (*p == '/') p++;
        const char *end = strchr(p, '/');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.') return errno = EPERM, -1;
        if (n > 0 && !(n == 1 && p[0] == '.')) {
            if (out != start) *out++ = '/';
            memcpy(out, p, n);
            out += n;
        }
        p += n;
    }
    *out = '\0';
    return 0;
}

/* How many levels DIRFD lies beneath ROOT (it does: it was opened beneath it), or -1: with
 * E2BIG past MAX_DEPTH, else why a step up failed (EACCES: a directory on the way that may
 * not be searched, where nothing could be made anyway). */
static int depth_below(int root, int dirfd) {
    struct stat top, at;
    if (fstat(root, &top) < 0) return -1;
    int fd = dup(dirfd), depth = 0;
    while (fd >= 0 && fstat(fd, &at) == 0) {
        if (at.st_dev == top.st_dev && at.st_ino == top.st_ino) {
            close(fd);
            return depth;
        }
        if (depth >= MAX_DEPTH) {
            close(fd);
            return errno = E2BIG, -1;
        }
        int up = openat(fd, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
        close(fd);
        fd = up;
        depth++;
    }
    int err = errno;
    if (fd >= 0) close(fd);
    return errno = err, -1;
}

/* Whether a symlink to TARGET, in a directory DEPTH levels beneath the destination,
 * stays beneath it. Judged on the text: relative, its ".." components all leading (a
 * ".." after a name could climb out of a symlink that name is) and no more of them than
 * DEPTH. (Symlinks the destination held before are not re-examined.) */
static int stays_beneath(int depth, const char *target) {
    if (target[0] == '/' || target[0] == '\0' || depth < 0) return 0;
    int named = 0;
    for (const char *p = target; *p;) {
        const char *end = strchr(p, '/');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.') {
            if (named || --depth < 0) return 0;
        } else if (n > 0 && !(n == 1 && p[0] == '.')) {
            named = 1;
        }
        p += n;
        while (*p == '/') p++;
    }
    return 1;
}

struct untar {
    int root; /* the destination */
    long long members, bytes;
    struct dirmode { char *name; mode_t mode; } *dirs;
    size_t ndirs, cap;
};

/* The directory that will hold NAME (made with its parents if missing), opened. */
static int parent_of(struct untar *u, char *name, const char **base) {
    char *slash = strrchr(name, '/');
    *base = slash ? slash + 1 : name;
    if (slash == NULL) return open_at(u->root, BENEATH, ".", O_RDONLY | O_DIRECTORY);
    *slash = '\0';
    int made = 0, fd = make_dirs(u->root, BENEATH, name, &made);
    *slash = '/';
    return fd;
}

/* Puts what `create` makes at BASE in DIRFD through a temporary name and a rename, so
 * that it replaces what was there at once; never a device, FIFO or socket (EINVAL, *WHY
 * saying so), before anything is made. */
static int land(int dirfd, const char *base, int (*create)(int, const char *, void *), void *arg,
                const char **why) {
    static char special_why[200];
    if ((*why = not_replaced(dirfd, base, 0, special_why, sizeof special_why)) != NULL)
        return errno = EINVAL, -1;
    char tmp[600];
    if (snprintf(tmp, sizeof tmp, ".%.200s.tangram-%d", base, (int)getpid()) >= (int)sizeof tmp)
        return errno = ENAMETOOLONG, -1;
    if (create(dirfd, tmp, arg) < 0) {
        int err = errno;
        unlinkat(dirfd, tmp, 0);
        return errno = err, -1;
    }
    int rc = renameat(dirfd, tmp, dirfd, base), err = errno;
    /* Gone if the rename moved it; still there if it failed, or if BASE was the same
     * inode already (a hard link to itself), when rename(2) does nothing. */
    unlinkat(dirfd, tmp, 0);
    return rc < 0 ? (errno = err, -1) : 0;
}

struct file_data { const struct member *m; int short_read; };

static int write_member(int dirfd, const char *tmp, void *arg) {
    struct file_data *f = arg;
    int fd = openat(dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return -1;
    unsigned long long left = f->m->size;
    const char *p;
    size_t k;
    int err = 0;
    while (left > 0 && (k = in_take(&p, left < (1u << 30) ? (size_t)left : (1u << 30))) > 0) {
        if (!err && write_all(fd, p, k) < 0) err = errno; /* the rest is still taken */
        left -= k;
    }
    if (left > 0) f->short_read = 1, err = err ? err : EBADMSG;
    if (!err && fchmod(fd, f->m->mode & 01777) < 0) err = errno; /* no set-id bits */
    if (close(fd) < 0 && !err) err = errno; /* a full disk may show only here */
    return err ? (errno = err, -1) : 0;
}

static int symlink_member(int dirfd, const char *tmp, void *target) {
    return symlinkat((const char *)target, dirfd, tmp);
}

struct hard_link { int fd; const char *base; int depth, depth_err, out, deep; };

/* A hard link to a symlink is that symlink again, in a new place: judged there as a
 * symlink member is (on what was linked, so a source swapped meanwhile changes nothing),
 * or a symlink that stayed beneath where it was would lead out from where it lands. */
static int link_member(int dirfd, const char *tmp, void *arg) {
    struct hard_link *from = arg;
    if (linkat(from->fd, from->base, dirfd, tmp, 0) < 0) return -1;
    struct stat st;
    if (fstatat(dirfd, tmp, &st, AT_SYMLINK_NOFOLLOW) < 0) return -1;
    if (!S_ISLNK(st.st_mode)) return 0;
    char target[4096];
    ssize_t n = readlinkat(dirfd, tmp, target, sizeof target - 1);
    if (n < 0) return -1;
    target[n] = '\0';
    if (from->depth < 0) { /* too deep to judge where it leads, or not to be entered */
        from->deep = from->depth_err == E2BIG;
        return errno = from->depth_err, -1;
    }
    if (stays_beneath(from->depth, target)) return 0;
    from->out = 1;
    return errno = EXDEV, -1;
}

/* Extracts member M (its header read, its data next); *why for what is not an errno. */
static int extract(struct untar *u, struct member *m, const char **why) {
    static const char *const dotdot = "a '..' component is refused (members stay beneath the destination)";
    char name[4096];
    if (clean(m->name, name) < 0) return *why = dotdot, -1;
    size_t raw = strlen(m->name);
    int is_dir = m->type == '5' || ((m->type == '0' || m->type == '\0') && raw && m->name[raw - 1] == '/');
    if (name[0] == '\0') { /* the destination itself ("./") */
        if (is_dir) return 0;
        return *why = "it names the destination directory itself", errno = EINVAL, -1;
    }
    if (is_dir) {
        int made = 0, fd = make_dirs(u->root, BENEATH, name, &made);
        if (fd < 0) return -1;
        close(fd);
        if (u->ndirs == u->cap) { /* its mode is set at the end: it may be read-only */
            u->cap = u->cap ? u->cap * 2 : 64;
            struct dirmode *more = realloc(u->dirs, u->cap * sizeof *more);
            if (more == NULL) return -1;
            u->dirs = more;
        }
        if ((u->dirs[u->ndirs].name = strdup(name)) == NULL) return -1;
        u->dirs[u->ndirs++].mode = m->mode & 01777;
        u->members++;
        return 0;
    }
    const char *base;
    int rc = -1, dirfd;
    switch (m->type) {
    case '0': case '\0': case '7': {
        struct file_data f = {m, 0};
        if ((dirfd = parent_of(u, name, &base)) < 0) return -1;
        rc = land(dirfd, base, write_member, &f, why);
        if (rc == 0) u->bytes += (long long)m->size;
        else if (f.short_read) *why = "the tar ends inside this file";
        m->size = 0; /* its data is taken */
        break;
    }
    case '2': {
        if ((dirfd = parent_of(u, name, &base)) < 0) return -1;
        int depth = depth_below(u->root, dirfd);
        if (depth < 0) { /* too deep to judge where its target leads, or not to be entered */
            int err = errno;
            close(dirfd);
            if (err == E2BIG) *why = TOO_DEEP;
            return errno = err, -1;
        }
        if (!stays_beneath(depth, m->link)) {
            close(dirfd);
            return *why = "it is a symlink that leads out of the destination", errno = EXDEV, -1;
        }
        rc = land(dirfd, base, symlink_member, m->link, why);
        break;
    }
    case '1': {
        struct hard_link from = {.out = 0, .deep = 0};
        char target[4096];
        if (clean(m->link, target) < 0) return *why = dotdot, -1;
        char *slash = strrchr(target, '/');
        from.base = slash ? slash + 1 : target;
        if (slash) *slash = '\0';
        from.fd = open_at(u->root, BENEATH, slash ? target : ".", O_RDONLY | O_DIRECTORY);
        if (from.fd < 0) return -1;
        if ((dirfd = parent_of(u, name, &base)) >= 0) {
            from.depth = depth_below(u->root, dirfd);
            from.depth_err = errno;
            rc = land(dirfd, base, link_member, &from, why);
            if (rc < 0 && from.out)
                *why = "it is a hard link to a symlink that leads out of the destination from here";
            else if (rc < 0 && from.deep)
                *why = TOO_DEEP;
        }
        int err = errno;
        close(from.fd);
        errno = err;
        break;
    }
    default:
        return *why = "only files, directories and links are extracted (not devices or FIFOs)",
               errno = EINVAL, -1;
    }
    if (rc == 0) u->members++;
    int err = errno;
    if (dirfd >= 0) close(dirfd);
    errno = err;
    return rc;
}

static void set_dir_modes(struct untar *u) {
    for (size_t i = u->ndirs; i-- > 0;) { /* deepest last-listed first */
        int fd = open_at(u->root, BENEATH, u->dirs[i].name, O_RDONLY | O_DIRECTORY);
        if (fd >= 0) {
            fchmod(fd, u->dirs[i].mode);
            close(fd);
        }
        free(u->dirs[i].name);
    }
    free(u->dirs);
}

static int op_untar(int sock, const char *path) {
    const char *rel = relative(path);
    /* The destination as it is; made (with its parents) only once the body shows a tar,
     * so that a body that is none leaves no directory behind. What is in its way (a
     * file, a symlink leading out, a directory not to be searched) fails at once. */
    struct untar u = {.root = -1};
    if (rel != NULL) u.root = open_at(files_root, files_resolve, rel, O_RDONLY | O_DIRECTORY);
    if (u.root < 0 && (rel == NULL || errno != ENOENT)) return fail(sock, errno, "untar", path);
    send_text(sock, 'S', "ready");
    in.sock = sock;
    static struct member m;
    const char *why = NULL;
    int err = 0, got = header(&m, &why);
    if (u.root < 0 && (got == 0 || (got == 1 && in.total > 0))) { /* a tar, if an empty one */
        int made = 0;
        if ((u.root = make_dirs(files_root, files_resolve, rel, &made)) < 0)
            err = errno, m.name[0] = '\0';
    }
    while (got == 0 && !err) {
        why = NULL;
        unsigned long long pad = padding(m.size);
        if (extract(&u, &m, &why) < 0) {
            err = errno;
            break;
        }
        if (!in_skip(m.size + pad)) { /* what extract left of its data, and the padding */
            why = "the tar ends inside a member's data";
            err = EBADMSG;
            break;
        }
        got = header(&m, &why);
    }
    if (got < 0) err = EBADMSG, m.name[0] = '\0';
    if (got == 1 && in.total == 0) { /* not even the end blocks an empty tar has */
        why = "the body is empty, not a tar";
        err = EBADMSG;
    }
    set_dir_modes(&u);
    if (u.root >= 0) close(u.root);
    while (!in.ended) in_skip(1u << 30); /* what is left unread: the agent still sends it */
    if (in.gone) return -1;
    char msg[8400];
    if (err == EXDEV && why == NULL && m.name[0])
        why = "it leads out of the destination through a symlink";
    if (err) {
        snprintf(msg, sizeof msg, "%d untar %s: %s%s%s%s", err, path,
                 m.name[0] ? "member " : "", m.name, m.name[0] ? ": " : "",
                 why ? why : strerror(err));
        return send_text(sock, 'Z', msg);
    }
    snprintf(msg, sizeof msg, "%lld %lld", u.members, u.bytes);
    send_text(sock, '1', msg);
    return send_text(sock, 'X', "0");
}
