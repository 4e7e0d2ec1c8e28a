/*
 * tangram-execd: the in-container exec server of the fast allocate-on-execution path.
 *
 * Runs as the container's PID 1 (bind-mounted read-only from the host, static, no
 * dependencies) and listens on a Unix socket in a directory the node agent shares with
 * the container. The agent writes the container's cgroup files itself and then asks
 * this server to start the command, so an action costs one connect and one fork instead
 * of Docker's update + exec round trips. Commands inherit everything the container was
 * given: namespaces, cgroup, user, dropped capabilities, no-new-privileges.
 *
 * One forked handler per connection. Frames both ways: type (1 byte), length (4 bytes,
 * big endian), payload.
 *   agent -> server: 'R' request (NUL-terminated strings: mode "pipe"|"pty", cwd, argc,
 *                    argv..., envc, "K=V"...), 'I' stdin bytes (held until the command
 *                    reads them; past 16 MiB held, no frame is read till it does; once
 *                    it closed its stdin, the rest is dropped), 'E' stdin EOF (after what
 *                    is held),
 *                    'K' signal number (decimal): signal the command's process group;
 *                    SIGKILL also kills every descendant it left behind.
 *   server -> agent: 'S' started (pid), '1' stdout, '2' stderr, 'X' exit status
 *                    (decimal; negative = killed by that signal), 'Z' error message.
 * If the agent disconnects before the command ends, the command's tree is killed: a
 * command nobody waits for holds cores nobody accounts for. When the command ends, so
 * does every process it left behind (the handler is their subreaper): nothing outlives
 * its action, and a session's processes live as long as the session's own process.
 *
 * The agent checks that the socket it reaches is this process's (SO_PEERCRED: the pid
 * that called listen()), so a command that plants its own server over the socket's name
 * is refused. This process is made non-dumpable so that no command of the same user can
 * ptrace it or take its listening socket. As a container's PID 1, it serves only
 * connections from outside its PID namespace (the agent's: SO_PEERCRED gives pid 0 for a
 * peer this namespace cannot see): a command that connected to the socket itself could
 * otherwise start processes no action owns, which outlive it (and could tamper with the
 * next action's run, a grading run say).
 *
 * `tangram-execd --install DEST` copies the binary to DEST (mode 0555) and exits: how a
 * pod's init container, from the node agent's image, puts it into a volume the sandbox
 * container then runs it from.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define MAX_FRAME (1u << 20)
#define MAX_ARGS 4096

static int write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int read_all(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n == 0) return -1;
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int send_frame(int fd, char type, const void *data, uint32_t len) {
    unsigned char head[5] = {(unsigned char)type, (unsigned char)(len >> 24),
                             (unsigned char)(len >> 16), (unsigned char)(len >> 8),
                             (unsigned char)len};
    if (write_all(fd, head, 5) < 0) return -1;
    return len ? write_all(fd, data, len) : 0;
}

static int send_text(int fd, char type, const char *text) {
    return send_frame(fd, type, text, (uint32_t)strlen(text));
}

/* Reads one frame; the payload is malloc'd and NUL-terminated (free it). */
static int recv_frame(int fd, char *type, char **data, uint32_t *len) {
    unsigned char head[5];
    if (read_all(fd, head, 5) < 0) return -1;
    *type = (char)head[0];
    *len = ((uint32_t)head[1] << 24) | ((uint32_t)head[2] << 16) | ((uint32_t)head[3] << 8) |
           (uint32_t)head[4];
    if (*len > MAX_FRAME) return -1;
    *data = malloc(*len + 1);
    if (*data == NULL) return -1;
    if (read_all(fd, *data, *len) < 0) {
        free(*data);
        return -1;
    }
    (*data)[*len] = '\0';
    return 0;
}

/* Splits a request payload into its NUL-terminated strings. */
static int split(char *data, uint32_t len, char **out, int max) {
    int n = 0;
    uint32_t i = 0;
    while (i < len && n < max) {
        out[n++] = data + i;
        i += (uint32_t)strlen(data + i) + 1;
    }
    return i >= len ? n : -1;
}

#include "exec_files.c"

/* The command this handler runs, and its wait status once reaped. */
static pid_t cmd_pid;
static int cmd_exited, cmd_status;

static void reap(void) {
    pid_t w;
    int st;
    while ((w = waitpid(-1, &st, WNOHANG)) > 0)
        if (w == cmd_pid) cmd_exited = 1, cmd_status = st;
}

/* A list of pids, grown as needed. */
struct pids {
    pid_t *v;
    size_t n, cap;
};

static int pids_has(const struct pids *s, pid_t p) {
    for (size_t i = 0; i < s->n; i++)
        if (s->v[i] == p) return 1;
    return 0;
}

static int pids_add(struct pids *s, pid_t p) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 64;
        pid_t *v = realloc(s->v, cap * sizeof *v);
        if (v == NULL) return -1;
        s->v = v, s->cap = cap;
    }
    s->v[s->n++] = p;
    return 0;
}

static void pids_remove(struct pids *s, pid_t p) {
    for (size_t i = 0; i < s->n; i++)
        if (s->v[i] == p) {
            s->v[i] = s->v[--s->n];
            return;
        }
}

/* A set of pids: the list of its members and a hash table over them (open addressing, at
 * most half full), so that a tree of thousands is walked in linear time. */
struct pidset {
    struct pids all;
    pid_t *slot; /* 0: empty */
    size_t cap;
};

/* Adds `p`: 1 when it is new, 0 when it was there, -1 when memory ran out. */
static int pidset_add(struct pidset *s, pid_t p) {
    if ((s->all.n + 1) * 2 > s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 256;
        pid_t *slot = calloc(cap, sizeof *slot);
        if (slot == NULL) return -1;
        for (size_t i = 0; i < s->all.n; i++) {
            size_t h = ((size_t)s->all.v[i] * 2654435761u) & (cap - 1);
            while (slot[h]) h = (h + 1) & (cap - 1);
            slot[h] = s->all.v[i];
        }
        free(s->slot);
        s->slot = slot, s->cap = cap;
    }
    size_t h = ((size_t)p * 2654435761u) & (s->cap - 1);
    for (; s->slot[h]; h = (h + 1) & (s->cap - 1))
        if (s->slot[h] == p) return 0;
    if (pids_add(&s->all, p) < 0) return -1;
    s->slot[h] = p;
    return 1;
}

/* Appends the children of every thread of `pid` to `out`. */
static void children_of(pid_t pid, struct pids *out) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (d == NULL) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        char file[300]; /* (d_name: 256 bytes at most) */
        snprintf(file, sizeof file, "/proc/%d/task/%s/children", (int)pid, e->d_name);
        FILE *f = fopen(file, "r");
        if (f == NULL) continue;
        int child;
        while (fscanf(f, "%d", &child) == 1)
            if (pids_add(out, child) < 0) kill(child, SIGKILL); /* unwalkable: killed now */
        fclose(f);
    }
    closedir(d);
}

#define MAX_TREE (1u << 16)
#define MAX_WALK_NS 2000000000LL /* a kill's walks stop after 2 s (then the rounds go on) */

/* Stops every descendant of `root` but the subtrees of `spare`, those stopped before
 * again (a process not stopped yet may have continued one), and adds them to `stopped`;
 * how many were new. */
static size_t stop_below(pid_t root, const struct pids *spare, struct pidset *stopped) {
    struct pids walk = {0};
    size_t fresh = 0;
    children_of(root, &walk);
    for (size_t i = 0; i < walk.n && i < MAX_TREE; i++) {
        pid_t p = walk.v[i];
        if (spare != NULL && pids_has(spare, p)) continue;
        kill(p, SIGSTOP);
        int added = pidset_add(stopped, p);
        if (added < 0) kill(p, SIGKILL); /* no room to remember it: killed now */
        fresh += added > 0;
        children_of(p, &walk);
    }
    free(walk.v);
    return fresh;
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Kills every descendant of `root` but the subtrees of `spare`: all of it stopped first,
 * then killed. Killing a generation at a time loses to a tree that respawns as fast as it
 * dies (a loop of setsid children holding the pids limit: each death frees the pid its
 * deepest one forks again); a stopped process forks no more, so walks until two find
 * nothing new, a millisecond apart, have the whole tree. Nothing below (the common case):
 * one walk, no wait. */
static void kill_below(pid_t root, const struct pids *spare) {
    struct pidset stopped = {0};
    long long start = now_ns();
    for (int walk = 0, quiet = 0; quiet < 2 && walk < 1000; walk++) {
        if (stop_below(root, spare, &stopped) > 0) {
            quiet = 0;
        } else if (stopped.all.n == 0) {
            break;
        } else if (++quiet < 2) {
            usleep(1000); /* one that was still forking as it was stopped has forked now */
        }
        if (now_ns() - start > MAX_WALK_NS) break;
    }
    for (size_t i = 0; i < stopped.all.n; i++) kill(stopped.all.v[i], SIGKILL);
    free(stopped.all.v);
    free(stopped.slot);
}

/* Descendants orphaned by the command are re-parented to this handler (a subreaper), so
 * killing "the tree" means: the command's process group, then every descendant we have
 * (kill_below), then reaping until no child is left (a process that will not die, stuck
 * in the kernel, ends the rounds). No process can leave this tree: setsid and double
 * forks only re-parent to us. */
static void kill_tree(pid_t group, int sig) {
    if (group > 0) kill(-group, sig);
    if (sig != SIGKILL) return; /* an interrupt is for the command, delivered once */
    for (int round = 0; round < 1000; round++) {
        char path[64]; /* (this handler has one thread: its children are all here) */
        snprintf(path, sizeof path, "/proc/self/task/%d/children", (int)getpid());
        FILE *f = fopen(path, "r");
        if (f == NULL) return;
        int pid, found = 0;
        while (!found && fscanf(f, "%d", &pid) == 1) found = 1;
        fclose(f);
        if (!found) return; /* (an action that left nothing: one read, its usual end) */
        kill_below(getpid(), NULL); /* all of it, and what re-parented to us since */
        usleep(1000);
        reap(); /* dead children leave the list once reaped */
    }
}

struct child {
    pid_t pid;
    int in, out, err; /* our ends; in pty mode all three are the master */
    int pty;
};

/* Forks the command. On failure returns -1 with a message in msg. */
static int spawn(char **fields, int nfields, struct child *c, char *msg, size_t msglen) {
    if (nfields < 3) {
        snprintf(msg, msglen, "request: too few fields");
        return -1;
    }
    const char *mode = fields[0], *cwd = fields[1];
    int argc = atoi(fields[2]);
    if (argc < 1 || argc > MAX_ARGS || 4 + argc > nfields) {
        snprintf(msg, msglen, "request: bad argv count");
        return -1;
    }
    int envc = atoi(fields[3 + argc]);
    if (envc < 0 || envc > MAX_ARGS || 4 + argc + envc > nfields) {
        snprintf(msg, msglen, "request: bad env count");
        return -1;
    }
    char **argv = calloc((size_t)argc + 1, sizeof *argv);
    for (int i = 0; i < argc; i++) argv[i] = fields[3 + i];
    char **envs = fields + 4 + argc;
    c->pty = strcmp(mode, "pty") == 0;

    int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1}, status[2];
    int master = -1;
    char slave[128] = "";
    if (c->pty) {
        master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (master < 0 || grantpt(master) < 0 || unlockpt(master) < 0 ||
            ptsname_r(master, slave, sizeof slave) != 0) {
            snprintf(msg, msglen, "pty: %s", strerror(errno));
            return -1;
        }
    } else if (pipe2(in, O_CLOEXEC) < 0 || pipe2(out, O_CLOEXEC) < 0 ||
               pipe2(err, O_CLOEXEC) < 0) {
        snprintf(msg, msglen, "pipe: %s", strerror(errno));
        return -1;
    }
    if (pipe2(status, O_CLOEXEC) < 0) {
        snprintf(msg, msglen, "pipe: %s", strerror(errno));
        return -1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(msg, msglen, "fork: %s", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        setsid(); /* its own process group and session: killed as a whole */
        /* Ignored signals survive exec: a server started in the background (SIGINT and
         * SIGQUIT ignored) or by Python (SIGPIPE) would pass them on, and the command
         * could then not be interrupted. It starts with every default (glibc refuses 32
         * and 33, its own), then unblocked: a signal sent meanwhile is delivered now. */
        for (int sig = 1; sig < NSIG; sig++)
            if (sig != SIGKILL && sig != SIGSTOP) signal(sig, SIG_DFL);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        int fail = 0;
        if (c->pty) {
            int s = open(slave, O_RDWR);
            struct termios t;
            if (s < 0 || ioctl(s, TIOCSCTTY, 0) < 0) fail = errno;
            if (!fail && tcgetattr(s, &t) == 0) {
                t.c_lflag &= ~(tcflag_t)(ECHO | ECHONL); /* the agent knows what it sent */
                t.c_oflag &= ~(tcflag_t)ONLCR;           /* output bytes as written */
                tcsetattr(s, TCSANOW, &t);
            }
            dup2(s, 0), dup2(s, 1), dup2(s, 2);
        } else {
            dup2(in[0], 0), dup2(out[1], 1), dup2(err[1], 2);
        }
        for (int i = 0; !fail && i < envc; i++)
            if (putenv(envs[i]) != 0) fail = errno;
        if (!fail && cwd[0] && chdir(cwd) < 0) fail = errno;
        if (!fail) {
            execvp(argv[0], argv);
            fail = errno;
        }
        (void)!write(status[1], &fail, sizeof fail);
        _exit(127);
    }
    close(status[1]);
    int child_errno = 0;
    ssize_t got = read(status[0], &child_errno, sizeof child_errno);
    close(status[0]);
    free(argv);
    c->pid = pid;
    if (c->pty) {
        c->in = c->out = master;
        c->err = -1;
    } else {
        close(in[0]), close(out[1]), close(err[1]);
        c->in = in[1], c->out = out[0], c->err = err[0];
    }
    if (got == (ssize_t)sizeof child_errno) {
        snprintf(msg, msglen, "tangram-execd: %s: %s\n", fields[3], strerror(child_errno));
        return 1; /* started, but exec failed: reported as exit 127 with the reason */
    }
    return 0;
}

/* Stdin the agent sent that the command has not read yet. It is written from the poll
 * loop as the command reads it, never blocking: a command that does not read its stdin
 * must not stop the handler from relaying output or hearing the agent's kill. Past
 * MAX_FEED held, the agent's socket is not read until the command takes some (TCP-like
 * backpressure; only its hang-up is watched, which kills the command). */
#define MAX_FEED (16u << 20)
struct feed {
    char *buf;
    size_t len, off;
    int eof;     /* close the command's stdin once what is held is written */
    int dropped; /* the command closed its stdin (or memory ran out): no more */
};

static void feed_add(struct feed *f, const char *data, size_t len) {
    if (f->dropped || len == 0) return;
    if (f->off > 0) { /* keep only what is still to write */
        memmove(f->buf, f->buf + f->off, f->len - f->off);
        f->len -= f->off, f->off = 0;
    }
    char *grown = realloc(f->buf, f->len + len);
    if (grown == NULL) {
        f->dropped = 1;
        return;
    }
    memcpy(grown + f->len, data, len);
    f->buf = grown, f->len += len;
}

static void feed_clear(struct feed *f) {
    free(f->buf);
    f->buf = NULL, f->len = f->off = 0;
}

static void feed_close(struct feed *f, struct child *c) {
    feed_clear(f);
    if (!c->pty && c->in >= 0) { /* a terminal's master is its output too: kept */
        close(c->in);
        c->in = -1;
    }
}

/* Writes what the command can take now; closes its stdin when asked and all is written,
 * or when it will take no more (EPIPE: it closed its end or exited). */
static void feed_write(struct feed *f, struct child *c) {
    while (f->off < f->len) {
        ssize_t n = write(c->in, f->buf + f->off, f->len - f->off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) return;
        if (n < 0) {
            f->dropped = 1;
            feed_close(f, c);
            return;
        }
        f->off += (size_t)n;
    }
    feed_clear(f);
    if (f->eof) feed_close(f, c);
}

static int relay(int from, int sock, char type) {
    char buf[65536];
    ssize_t n = read(from, buf, sizeof buf);
    if (n > 0) return send_frame(sock, type, buf, (uint32_t)n) < 0 ? -2 : 1;
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return 1;
    return 0; /* EOF (or EIO: the pty's other side is gone) */
}

static void handle(int sock) {
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    /* A write to an agent that went away, or to a command that closed its stdin, is an
     * EPIPE to handle, not a signal that ends the handler before it kills what the
     * command left and says how it ended. (The command starts with every default.) */
    signal(SIGPIPE, SIG_IGN);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);

    char type = 0, *data = NULL;
    uint32_t len;
    int got = recv_frame(sock, &type, &data, &len); /* on failure data is not ours */
    if (got == 0 && type == 'F') {
        handle_files(sock, data, len);
        return;
    }
    if (got < 0 || type != 'R') {
        send_text(sock, 'Z', "protocol: the first frame must be a request");
        return;
    }
    char **fields = calloc(4 + MAX_ARGS * 2, sizeof *fields);
    int nfields = split(data, len, fields, 4 + MAX_ARGS * 2);
    struct child c = {0};
    char msg[512] = "";
    int rc = nfields < 0 ? -1 : spawn(fields, nfields, &c, msg, sizeof msg);
    if (rc < 0) {
        send_text(sock, 'Z', nfields < 0 ? "request: malformed" : msg);
        return;
    }
    char pidtext[32];
    snprintf(pidtext, sizeof pidtext, "%d", (int)c.pid);
    send_text(sock, 'S', pidtext);
    if (rc == 1) send_frame(sock, c.pty ? '1' : '2', msg, (uint32_t)strlen(msg));

    cmd_pid = c.pid;
    if (c.in >= 0) fcntl(c.in, F_SETFL, fcntl(c.in, F_GETFL) | O_NONBLOCK);
    struct feed feed = {0};
    int out_open = 1, err_open = c.err >= 0, sock_open = 1;
    while (!cmd_exited || out_open || err_open) {
        int feeding = c.in >= 0 && feed.off < feed.len;
        short from_agent = feeding && feed.len - feed.off >= MAX_FEED ? 0 : POLLIN;
        struct pollfd p[5] = {{sfd, POLLIN, 0},
                              {out_open ? c.out : -1, POLLIN, 0},
                              {err_open ? c.err : -1, POLLIN, 0},
                              {sock_open ? sock : -1, from_agent, 0},
                              {feeding ? c.in : -1, POLLOUT, 0}};
        /* Once the command has exited, take what its pipes already hold and stop: a
         * background process that inherited them must not hold the action open. */
        int ready = poll(p, 5, cmd_exited ? 0 : -1);
        if (ready < 0 && errno != EINTR) break;
        if (cmd_exited && ready == 0) break;
        if (p[0].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == sizeof si) {
            }
            reap();
        }
        if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
            int r = relay(c.out, sock, '1');
            if (r == -2) sock_open = 0, kill_tree(c.pid, SIGKILL);
            if (r == 0) out_open = 0;
        }
        if (p[2].revents & (POLLIN | POLLHUP | POLLERR)) {
            int r = relay(c.err, sock, '2');
            if (r == -2) sock_open = 0, kill_tree(c.pid, SIGKILL);
            if (r == 0) err_open = 0;
        }
        if (p[3].revents & (POLLIN | POLLHUP | POLLERR)) {
            if (recv_frame(sock, &type, &data, &len) < 0) {
                sock_open = 0; /* the agent is gone: nobody waits for this command */
                kill_tree(c.pid, SIGKILL);
                continue;
            }
            if (type == 'I' && c.in >= 0) {
                feed_add(&feed, data, len);
                feed_write(&feed, &c);
            } else if (type == 'E' && c.in >= 0 && !c.pty) {
                feed.eof = 1;
                feed_write(&feed, &c);
            } else if (type == 'E' && c.pty) {
                /* A terminal has no end of input to close: its EOF is the VEOF character
                 * (^D) at the start of a line, as a person would type it. */
                struct termios t;
                char eof = tcgetattr(c.in, &t) == 0 ? (char)t.c_cc[VEOF] : 4;
                feed_add(&feed, &eof, 1);
                feed_write(&feed, &c);
            } else if (type == 'K') {
                int sig = atoi(data);
                kill_tree(c.pid, sig > 0 ? sig : SIGKILL);
            }
            free(data);
        }
        if (p[4].revents & (POLLOUT | POLLERR | POLLHUP)) feed_write(&feed, &c);
    }
    free(feed.buf);
    while (!cmd_exited && waitpid(c.pid, &cmd_status, 0) < 0 && errno == EINTR) {
    }
    /* No process outlives its action: what the command left running (in the background,
     * setsid, double-forked: all our descendants) is killed before the action's end is
     * told, so nothing of it runs on the idle cores or into the next action. A session is
     * one long action: its background jobs live until its shell or driver ends. The
     * command itself is reaped, so its pid (a process group id no more) is not used. */
    kill_tree(0, SIGKILL);
    int st = cmd_status;
    char code[32];
    snprintf(code, sizeof code, "%d", WIFSIGNALED(st) ? -WTERMSIG(st) : WEXITSTATUS(st));
    if (sock_open) send_text(sock, 'X', code);
}

static int install(const char *dest) {
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", dest) >= (int)sizeof tmp) {
        fprintf(stderr, "tangram-execd: %s: path too long\n", dest);
        return 2;
    }
    int in = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    if (in < 0) {
        fprintf(stderr, "tangram-execd: install %s: /proc/self/exe: %s\n", dest, strerror(errno));
        return 1;
    }
    int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0555);
    if (out < 0) {
        fprintf(stderr, "tangram-execd: install %s: %s\n", dest, strerror(errno));
        close(in);
        return 1;
    }
    char buf[65536];
    ssize_t n;
    while ((n = read(in, buf, sizeof buf)) > 0)
        if (write_all(out, buf, (size_t)n) < 0) break;
    int failed = n != 0 || fchmod(out, 0555) < 0;
    int saved = errno;
    /* Closed on every path (a failed write may only show at close), then renamed into
       place only when whole: DEST is never half a binary. */
    if (close(out) < 0 && !failed) failed = 1, saved = errno;
    close(in);
    if (failed || rename(tmp, dest) < 0) {
        fprintf(stderr, "tangram-execd: install %s: %s\n", dest, strerror(failed ? saved : errno));
        unlink(tmp);
        return 1;
    }
    return 0;
}

/* Closes a connection whose last frames (the exit status) the agent may not have read,
 * once it has: a socket closed with input unread (stdin the command never took) resets
 * the connection, and the agent's reader then drops what it had not read yet, the exit
 * status with it. So the server stops writing, discards what still comes until the
 * agent, having read it all, hangs up; for at most two seconds. */
static void drain_then_close(int sock) {
    shutdown(sock, SHUT_WR);
    char buf[65536];
    for (int waited_ms = 0; waited_ms < 2000;) {
        struct pollfd p = {.fd = sock, .events = POLLIN};
        int ready = poll(&p, 1, 100);
        if (ready < 0 && errno == EINTR) continue;
        if (ready == 0) {
            waited_ms += 100;
            continue;
        }
        if (ready < 0 || read(sock, buf, sizeof buf) <= 0) break; /* its end, or an error */
    }
    close(sock);
}

/* Whether the peer of `conn` is a process this PID namespace does not see (pid 0). */
static int from_outside(int conn) {
    struct ucred cred;
    socklen_t len = sizeof cred;
    return getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid == 0;
}

/* A process of the sandbox asked: its request is read (so that the answer is not lost to
 * a reset) and refused. */
static void refuse_insider(int conn) {
    static const char why[] = "a process of the sandbox may not ask for commands";
    char type, *data;
    uint32_t len;
    if (recv_frame(conn, &type, &data, &len) == 0) free(data);
    send_frame(conn, 'Z', why, sizeof why - 1);
}

/* The handlers this server forked and that still run. */
static struct pids handlers;

/* Reaps ended children; whether a handler ended (what it leaves is killed by the caller,
 * as init). A handler that stopped was stopped by its command (a handler has no terminal
 * to stop it; the command runs as the same user and may signal its parent): it would
 * never answer the agent's kill, so the command's cores would stay held. It is killed:
 * its connection's end tells the agent. */
static int reap_handlers(void) {
    pid_t w;
    int st, ended = 0;
    while ((w = waitpid(-1, &st, WNOHANG | WUNTRACED)) > 0) {
        if (WIFSTOPPED(st)) {
            kill(w, SIGKILL);
        } else if (pids_has(&handlers, w)) {
            pids_remove(&handlers, w);
            ended = 1;
        }
    }
    return ended;
}

/* As a container's init, once a handler has ended: kills every process re-parented to it
 * that no handler owns. A handler killed by its own command (`kill -9 $PPID`, or stopped
 * and killed above) left the command running, and one whose kill a process of the tree
 * outlasted left that; either would run on between actions and into the next, on cores
 * nobody accounts for. (A command run without a handler, a Docker exec, leaves its
 * orphans here too.) Nothing re-parented (the common case): one read. */
static void sweep_orphans(void) {
    do kill_below(getpid(), &handlers);
    while (reap_handlers());
}

/* Whether a stop signal came from the container's runtime (docker stop, the kubelet): it
 * is outside this PID namespace, so its pid reads 0 here, and a kill() or the kernel
 * sent it. A process of the sandbox may queue a signal saying pid 0, but only with a
 * negative code (SI_QUEUE), never SI_USER or SI_KERNEL. */
static int from_runtime(const struct signalfd_siginfo *si) {
    return si->ssi_pid == 0 && (si->ssi_code == SI_USER || si->ssi_code == SI_KERNEL);
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--install") == 0) return install(argv[2]);
    if (argc == 3 && strcmp(argv[1], "--files") == 0) {
        /* One file operation on the connected socket at fd 0, beneath ROOT. The request is
         * read first: an answer sent with it unread would be lost to the reset. */
        char type, *data;
        uint32_t len;
        if (recv_frame(0, &type, &data, &len) < 0 || type != 'F') return 2;
        if (files_at(argv[2], 1) < 0) {
            fail(0, errno, "files: the environment's directory", argv[2]);
            return 1;
        }
        handle_files(0, data, len);
        return 0;
    }
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET | --install DEST | --files ROOT\n", argv[0]);
        return 2;
    }
    if (files_at("/", 0) < 0) {
        fprintf(stderr, "tangram-execd: /: %s\n", strerror(errno));
        return 1;
    }
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); /* no ptrace, no pidfd_getfd by commands */
    int as_init = getpid() == 1; /* a container's: its sandbox's processes share its namespace */
    /* Bind under a temporary name, listen, then rename into place: the final name appears
     * only once connections are accepted, so a client that waits for it never races
     * bind() against listen() (ECONNREFUSED). */
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (snprintf(addr.sun_path, sizeof addr.sun_path, "%s.new", argv[1]) >= (int)sizeof addr.sun_path) {
        fprintf(stderr, "tangram-execd: socket path too long\n");
        return 2;
    }
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    unlink(argv[1]); /* a restarted container finds its old socket file */
    unlink(addr.sun_path);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(lfd, 64) < 0 ||
        rename(addr.sun_path, argv[1]) < 0) {
        fprintf(stderr, "tangram-execd: %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    for (;;) {
        struct pollfd p[2] = {{sfd, POLLIN, 0}, {lfd, POLLIN, 0}};
        if (poll(p, 2, -1) < 0 && errno != EINTR) return 1;
        if (p[0].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == sizeof si)
                /* As init, a stop comes from the runtime: a command's `kill 1` does not
                 * end its sandbox. */
                if ((si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) &&
                    (!as_init || from_runtime(&si)))
                    return 0;
            if (reap_handlers() && as_init) sweep_orphans();
        }
        if (p[1].revents & POLLIN) {
            int conn = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
            if (conn < 0) continue;
            pid_t pid = fork();
            if (pid == 0) {
                close(lfd);
                close(sfd);
                if (as_init && !from_outside(conn)) refuse_insider(conn);
                else handle(conn);
                drain_then_close(conn);
                _exit(0);
            }
            if (pid > 0 && pids_add(&handlers, pid) < 0)
                kill(pid, SIGKILL); /* a handler no sweep would spare: not served */
            close(conn);
        }
    }
}
