/*
 * m3lua.c — the m3lua host: a LuaJIT interpreter shaped like the standalone `luajit`
 * binary (script and args, -e, -l, -i, -j, -O, -v, -h, --, -) with libm3 and libedit
 * linked in, so the Lua module `m3` reaches the engine through ffi.C and the REPL
 * (lua/m3/repl.lua) reaches libedit the same way.
 *
 * Module path, put in front of package.path: $M3LUA_PATH, then for the binary in the build
 * tree its lua/ (generated files such as m3/cdef.lua), the source tree's lua/ and the install
 * location (M3LUA_LUA_DIR, where `meson install` puts m3/ with its cdef.lua), so that the
 * tree's sources win over an older install; any other binary (an installed one) searches the
 * install location first and the two trees after it (a binary copied out of the build tree
 * still runs; an installed one needs neither, and a removed tree is skipped).
 * package.loaded["m3.host"] describes the host and offers the interrupt controls used by
 * the REPL.
 *
 * Interrupts: SIGINT, SIGTERM, SIGHUP (the terminal closed: a run started from it saves its
 * checkpoint as on SIGTERM; one started with nohup, which ignores it, is left alone) and SIGPIPE
 * (the reader of our output went away: a run piped into `head` saves its checkpoint as on
 * SIGTERM) set the engine's flag (m3_interrupt: a
 * running step stops between layers with M3_ERR_INTERRUPTED) and, while Lua code runs under
 * the host's protection, set a Lua hook that raises "interrupted!" in interpreted code. A
 * second signal kills a hung program (one that caught the first error and went on), except
 * the same signal again within DUPLICATE_MS (one event delivered twice: GNU timeout signals
 * the child, then its process group) and SIGPIPE again (the writes after the first fail
 * with EPIPE instead).
 * JIT-compiled loops never look at hooks: a watchdog timer checks, after a grace period
 * without the hook having run, whether the main thread is executing machine code that
 * belongs to no loaded object (code made by the JIT); if so it ends the process with the
 * signal. A script that dies while a signal is pending exits with 128 + signo; after SIGPIPE
 * without a message when it dies of the interrupt itself (the hook's error or the watchdog), as
 * luajit, which that signal kills, would.
 * At exit (main's return or os.exit), status 0 becomes 1 when the standard output could not be
 * written (141 after SIGPIPE).
 *
 * Job control: libedit's own signal handling stays off (rl_catch_signals = 0: it would send each
 * signal on to the whole process group), so the host stops the process itself on SIGTSTP (Ctrl-Z).
 * When that comes while the terminal is in character-at-a-time mode (libedit editing a line), the
 * terminal gets back the modes it had as the line began before the process stops, and its editing
 * modes when it continues (`fg`; the shell does not put them back), after which the line being
 * edited is drawn again: typed text is not echoed by the terminal, and keys keep their editing
 * meaning.
 *
 * Characters: the REPL takes the locale's character set from the environment (LC_CTYPE alone: numbers
 * keep their C format; plain C or POSIX, ASCII alone, becomes C.UTF-8), and read_key decodes the
 * terminal's bytes in it, so that libedit, which edits wide characters, gets "é" as one character
 * instead of two meaningless ones (or, past 0x7f, keys bound to Meta commands).
 */

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <locale.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>
#include <wchar.h>

#include <editline/readline.h>
#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>

#include "m3.h"

#ifndef sigev_notify_thread_id
#define sigev_notify_thread_id _sigev_un._tid
#endif

enum { WATCHDOG_MS = 500, DUPLICATE_MS = 100 };
enum { REPLACEMENT_CHARACTER = 0xFFFD }; /* what read_key gives for bytes that decode to nothing */

#define INTERRUPTED "interrupted!" /* the error the interrupt hook raises */

static const char usage_text[] =
  "usage: m3lua [options]... [script [args]...]\n"
  "Runs a Lua script (or the REPL) with the m3 training engine loaded.\n"
  "Options:\n"
  "  -e chunk      execute the string 'chunk'\n"
  "  -l name       require library 'name' (and set the global 'name')\n"
  "  -j cmd        perform a LuaJIT control command (-jon, -joff, -jflush, -jv, -jdump, ...)\n"
  "  -O[opt]       control LuaJIT optimizations\n"
  "  -i            enter the REPL after running 'script'\n"
  "  -v, --version show version information\n"
  "  -h, --help    show this help\n"
  "  --            stop handling options\n"
  "  -             execute stdin and stop handling options\n"
  "Without a script the REPL opens when stdin is a terminal; otherwise stdin runs.\n"
  "Environment: M3LUA_PATH (Lua module path templates, searched first),\n"
  "  M3LUA_HISTORY (REPL history file, default ~/.m3lua_history).\n";

/* ---- interrupts ---------------------------------------------------------------------- */

static lua_State *main_state;
static volatile sig_atomic_t pending_sig; /* first interrupting signal since the last clear */
static volatile long pending_ms;          /* when it came (monotonic_ms) */
static volatile sig_atomic_t sig_count;   /* interrupting signals ever received */
static volatile sig_atomic_t hook_armed;  /* a signal should raise an error in Lua code */
static volatile sig_atomic_t hook_set;    /* the Lua hook is set and has not run yet */
static volatile sig_atomic_t resized;     /* SIGWINCH: the terminal changed size */
static sig_atomic_t line_ended_at;        /* sig_count when read_key last ended a line */
static volatile sig_atomic_t redraw;      /* continued after a stop while a line was edited */
static struct termios line_start_modes;   /* the terminal as libedit's last line began */
static volatile sig_atomic_t have_line_start_modes;
static int ignored_at_start;              /* bit i: caught[i] was ignored, leave it so */
static timer_t watchdog;
static int have_watchdog;

static const int caught[] = { SIGINT, SIGTERM, SIGHUP, SIGPIPE };
#define N_CAUGHT ((int)(sizeof caught / sizeof caught[0]))

static void watchdog_set(long ms)
{
  struct itimerspec t = { .it_value = { ms / 1000, (ms % 1000) * 1000000L } };
  if (have_watchdog)
    timer_settime(watchdog, 0, &t, NULL);
}

static void on_hook(lua_State *L, lua_Debug *ar)
{
  (void)ar;
  lua_sethook(L, NULL, 0, 0);
  hook_set = 0;
  watchdog_set(0);
  /* no position: the hook fires wherever the interpreter is, often inside the library; the
   * traceback shows where the program was */
  lua_pushliteral(L, INTERRUPTED);
  lua_error(L);
}

/* Removes a hook that a signal set but that has not run yet. */
static void drop_hook(void)
{
  watchdog_set(0);
  if (hook_set) {
    hook_set = 0;
    lua_sethook(main_state, NULL, 0, 0);
  }
}

/* Milliseconds of CLOCK_MONOTONIC (async-signal-safe). */
static long monotonic_ms(void)
{
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Puts back the default action of every caught signal, so that sig (blocked while its handler runs) kills as
 * the handler returns (sigaction is async-signal-safe). */
static void die_of(int sig)
{
  struct sigaction dfl = { .sa_handler = SIG_DFL };
  sigemptyset(&dfl.sa_mask);
  for (int i = 0; i < N_CAUGHT; i++)
    if (!(ignored_at_start & (1 << i)))
      sigaction(caught[i], &dfl, NULL);
  raise(sig);
}

static void on_signal(int sig)
{
  int saved_errno = errno;
  const long now = monotonic_ms();
  if (pending_sig) { /* a second signal since the last clear (see the header) */
    if (sig != SIGPIPE && !(sig == pending_sig && now - pending_ms < DUPLICATE_MS))
      die_of(sig);
    errno = saved_errno;
    return;
  }
  pending_sig = sig;
  pending_ms = now;
  sig_count++;
  m3_interrupt();
  if (hook_armed && !hook_set) {
    hook_set = 1;
    lua_sethook(main_state, on_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
    watchdog_set(WATCHDOG_MS);
  }
  errno = saved_errno;
}

/* Installs the handlers. No SA_RESTART: a blocking read ends with EINTR. */
static void catch_signals(void)
{
  struct sigaction sa = { .sa_handler = on_signal };
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < N_CAUGHT; i++)
    sigaddset(&sa.sa_mask, caught[i]);
  for (int i = 0; i < N_CAUGHT; i++)
    if (!(ignored_at_start & (1 << i)))
      sigaction(caught[i], &sa, NULL);
}

/* Whether the interrupted thread was running code outside every loaded object. dladdr
 * is not async-signal-safe in theory; it only reads the loader's list here. */
static int in_jit_code(const void *context)
{
#if defined(__x86_64__) || defined(__aarch64__)
  const ucontext_t *uc = context;
  Dl_info info;
#if defined(__x86_64__)
  return dladdr((const void *)uc->uc_mcontext.gregs[REG_RIP], &info) == 0;
#else
  return dladdr((const void *)uc->uc_mcontext.pc, &info) == 0;
#endif
#else
  (void)context;
  return 1; /* no program counter to look at: assume the worst */
#endif
}

static void on_watchdog(int sig, siginfo_t *si, void *context)
{
  static const char msg[] =
    "m3lua: interrupted inside JIT-compiled code that cannot stop; exiting\n";
  int fatal = pending_sig ? pending_sig : SIGINT;
  ssize_t written;
  (void)sig;
  (void)si;
  if (!hook_set)
    return;
  if (!in_jit_code(context)) {
    watchdog_set(WATCHDOG_MS);
    return;
  }
  if (fatal != SIGPIPE) { /* the reader of our output went away: end as its default action would */
    written = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)written;
  }
  signal(fatal, SIG_DFL);
  raise(fatal);
}

static void on_winch(int sig)
{
  (void)sig;
  resized = 1;
}

/* rl_pre_input_hook: notes the terminal's modes before libedit switches it to editing (a stop
 * since the last line, in a program's own character-at-a-time mode, leaves nothing to redraw). */
static int note_line_start_modes(void)
{
  redraw = 0;
  have_line_start_modes = tcgetattr(STDIN_FILENO, &line_start_modes) == 0;
  return 0;
}

/* SIGTSTP: stops the process as the default action would; a terminal in editing mode (no ICANON)
 * is in line mode while stopped and back in editing mode, marked for read_key to redraw, after. */
static void on_stop(int sig)
{
  int saved_errno = errno;
  struct sigaction dfl = { .sa_handler = SIG_DFL }, self = { .sa_handler = on_stop, .sa_flags = SA_RESTART };
  struct termios editing;
  sigset_t just_sig;
  const int editing_line = have_line_start_modes && tcgetattr(STDIN_FILENO, &editing) == 0 &&
                           !(editing.c_lflag & ICANON);
  if (editing_line)
    tcsetattr(STDIN_FILENO, TCSADRAIN, &line_start_modes);
  sigemptyset(&dfl.sa_mask);
  sigemptyset(&self.sa_mask);
  sigemptyset(&just_sig);
  sigaddset(&just_sig, sig);
  sigaction(sig, &dfl, NULL);
  raise(sig);
  sigprocmask(SIG_UNBLOCK, &just_sig, NULL); /* stops here until SIGCONT */
  sigprocmask(SIG_BLOCK, &just_sig, NULL);
  sigaction(sig, &self, NULL);
  if (editing_line) {
    tcsetattr(STDIN_FILENO, TCSADRAIN, &editing);
    redraw = 1;
  }
  errno = saved_errno;
}

/* The watchdog's timer signals the main thread, whose program counter it inspects.
 * SIGWINCH only marks the terminal as resized for read_key. SIGTSTP, unless ignored (a shell
 * without job control), stops through on_stop; SA_RESTART, so that a script's reads and writes
 * go on after `fg` as without the handler (read_key waits in poll, which a handler always ends). */
static void init_interrupts(lua_State *L)
{
  struct sigaction sa = { .sa_sigaction = on_watchdog, .sa_flags = SA_SIGINFO | SA_RESTART };
  struct sigaction winch = { .sa_handler = on_winch, .sa_flags = SA_RESTART };
  struct sigaction stop = { .sa_handler = on_stop, .sa_flags = SA_RESTART }, old_stop;
  struct sigevent ev = { .sigev_notify = SIGEV_THREAD_ID, .sigev_signo = SIGRTMIN };
  main_state = L;
  for (int i = 0; i < N_CAUGHT; i++) {
    struct sigaction old;
    if (sigaction(caught[i], NULL, &old) == 0 && old.sa_handler == SIG_IGN)
      ignored_at_start |= 1 << i;
  }
  catch_signals();
  sigemptyset(&winch.sa_mask);
  sigaction(SIGWINCH, &winch, NULL);
  sigemptyset(&stop.sa_mask);
  if (sigaction(SIGTSTP, NULL, &old_stop) == 0 && old_stop.sa_handler != SIG_IGN)
    sigaction(SIGTSTP, &stop, NULL);
  sigemptyset(&sa.sa_mask);
  ev.sigev_notify_thread_id = gettid();
  have_watchdog = sigaction(SIGRTMIN, &sa, NULL) == 0 &&
                  timer_create(CLOCK_MONOTONIC, &ev, &watchdog) == 0;
}

/* libedit's key reader (rl_getc_function): the next character (a wide character: libedit
 * takes the result as one) of the terminal's bytes in the locale's encoding, U+FFFD for
 * bytes that are none (a byte that cuts a sequence short starts the next). An interrupting
 * signal ends the line being edited, once per signal (the REPL sees the pending signal and
 * drops that line); a resized terminal is measured again, and the line drawn again after a
 * stop, before the next key is handled. Signals are looked at just before each read (again
 * after drawing), not only when one ends it: one that comes while libedit handles a key or
 * while the line is drawn again is acted on at once, not after the next key. */
static int read_key(FILE *in)
{
  static mbstate_t decoding;
  static int held = -1; /* a byte read that starts the next character */
  const int fd = in ? fileno(in) : STDIN_FILENO;
  for (;;) {
    char byte;
    wchar_t wc;
    if (line_ended_at != sig_count) {
      line_ended_at = sig_count;
      memset(&decoding, 0, sizeof decoding);
      return '\n';
    }
    if (resized) {
      resized = 0;
      rl_resize_terminal();
      continue;
    }
    if (redraw) {
      redraw = 0;
      rl_forced_update_display();
      continue;
    }
    if (held >= 0) {
      byte = (char)held;
      held = -1;
    } else {
      struct pollfd ready = { .fd = fd, .events = POLLIN };
      if (poll(&ready, 1, -1) < 0) { /* a signal's handler ran (poll is never restarted): look again */
        if (errno == EINTR)
          continue;
        return EOF;
      }
      const ssize_t n = read(fd, &byte, 1);
      if (n < 0 && errno == EINTR)
        continue;
      if (n != 1)
        return EOF;
    }
    const int inside_sequence = !mbsinit(&decoding);
    const size_t len = mbrtowc(&wc, &byte, 1, &decoding);
    if (len == (size_t)-2)
      continue;
    if (len != (size_t)-1)
      return (int)wc;
    memset(&decoding, 0, sizeof decoding);
    if (inside_sequence)
      held = (unsigned char)byte;
    return REPLACEMENT_CHARACTER;
  }
}

/* ---- protected calls and error reports ----------------------------------------------- */

/* Message handler: any error value becomes a string with a traceback; the hook's own error after
 * SIGPIPE becomes nil, which report() leaves out: the reader of our output went away, and a program
 * that does not catch that ends silently with 141, as one that the signal kills. */
static int traceback(lua_State *L)
{
  const char *msg = lua_tostring(L, 1);
  if (pending_sig == SIGPIPE && lua_type(L, 1) == LUA_TSTRING && strcmp(msg, INTERRUPTED) == 0) {
    lua_pushnil(L);
    return 1;
  }
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_isstring(L, -1))
      msg = lua_tostring(L, -1);
    else
      msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

/* lua_pcall with signals raising "interrupted!" in the called Lua code. */
static int pcall_interruptible(lua_State *L, int narg, int nres, int errfunc)
{
  int was_armed = hook_armed;
  int status;
  hook_armed = 1;
  status = lua_pcall(L, narg, nres, errfunc);
  hook_armed = was_armed;
  if (!was_armed)
    drop_hook();
  return status;
}

/* Calls the function below the narg arguments on top of the stack, interruptibly, with
 * the traceback handler. */
static int docall(lua_State *L, int narg, int nres)
{
  int base = lua_gettop(L) - narg;
  int status;
  lua_pushcfunction(L, traceback);
  lua_insert(L, base);
  status = pcall_interruptible(L, narg, nres, base);
  lua_remove(L, base);
  return status;
}

static int report(lua_State *L, int status)
{
  if (status != 0 && !lua_isnil(L, -1)) {
    const char *msg = lua_tostring(L, -1);
    fprintf(stderr, "m3lua: %s\n", msg ? msg : "(error object is not a string)");
    fflush(stderr);
    lua_pop(L, 1);
  }
  return status;
}

/* ---- the m3.host table --------------------------------------------------------------- */

/* host.pcall(f, handler, ...): like xpcall with arguments; an interrupting signal (SIGINT,
 * SIGTERM, SIGHUP, SIGPIPE) raises "interrupted!" inside f. */
static int host_pcall(lua_State *L)
{
  int status;
  luaL_checkany(L, 2);
  lua_pushvalue(L, 2);
  lua_remove(L, 2);
  lua_insert(L, 1);
  status = pcall_interruptible(L, lua_gettop(L) - 2, LUA_MULTRET, 1);
  lua_pushboolean(L, status == 0);
  lua_replace(L, 1);
  return lua_gettop(L);
}

/* host.clear_interrupt(): forgets a pending signal (also the engine's flag): the next one
 * interrupts again instead of killing. */
static int host_clear_interrupt(lua_State *L)
{
  (void)L;
  drop_hook();
  pending_sig = 0;
  line_ended_at = sig_count;
  m3_interrupt_clear();
  return 0;
}

/* host.drop_interrupt_hook(): the engine has reported the signal as an error, which the binding raises now;
 * the hook the signal set must not raise it a second time, least of all inside the caller's error handler
 * (JIT-compiled code runs no hooks, so it can still be set when the handler starts: "error in error
 * handling"). The pending signal stays, for the exit status. */
static int host_drop_interrupt_hook(lua_State *L)
{
  (void)L;
  drop_hook();
  return 0;
}

/* host.pending_signal(): the number of the signal received since the last clear, or nil. */
static int host_pending_signal(lua_State *L)
{
  if (pending_sig)
    lua_pushinteger(L, pending_sig);
  else
    lua_pushnil(L);
  return 1;
}

static void register_host(lua_State *L)
{
  static const luaL_Reg fns[] = {
    { "pcall", host_pcall },
    { "clear_interrupt", host_clear_interrupt },
    { "drop_interrupt_hook", host_drop_interrupt_hook },
    { "pending_signal", host_pending_signal },
    { NULL, NULL },
  };
  lua_getfield(L, LUA_REGISTRYINDEX, "_LOADED");
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  lua_pushliteral(L, "m3lua");
  lua_setfield(L, -2, "name");
  lua_pushstring(L, m3_version());
  lua_setfield(L, -2, "version");
  lua_pushboolean(L, m3_has_cuda_build());
  lua_setfield(L, -2, "cuda_build");
  lua_pushliteral(L, M3LUA_SOURCE_DIR);
  lua_setfield(L, -2, "source_dir");
  lua_pushliteral(L, M3LUA_BUILD_DIR);
  lua_setfield(L, -2, "build_dir");
  lua_pushliteral(L, M3LUA_LUA_DIR);
  lua_setfield(L, -2, "lua_dir");
  lua_setfield(L, -2, "m3.host");
  lua_pop(L, 1);
}

/* ---- module path ----------------------------------------------------------------------- */

#define TEMPLATES(dir) dir "/?.lua;" dir "/?/init.lua;"
#define TREE_PATH TEMPLATES(M3LUA_BUILD_DIR "/lua") TEMPLATES(M3LUA_SOURCE_DIR "/lua")
#define INSTALL_PATH TEMPLATES(M3LUA_LUA_DIR)

/* Whether this executable lives in the build tree (then the tree's modules come first). */
static int running_from_build_tree(void)
{
  char exe[PATH_MAX], build[PATH_MAX];
  size_t n;
  if (realpath("/proc/self/exe", exe) == NULL || realpath(M3LUA_BUILD_DIR, build) == NULL)
    return 0;
  n = strlen(build);
  return strncmp(exe, build, n) == 0 && exe[n] == '/';
}

static void set_path(lua_State *L)
{
  const char *env = getenv("M3LUA_PATH");
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "path");
  lua_pushfstring(L, "%s%s%s%s", env ? env : "", env && *env ? ";" : "",
                  running_from_build_tree() ? TREE_PATH INSTALL_PATH : INSTALL_PATH TREE_PATH,
                  lua_tostring(L, -1));
  lua_setfield(L, -3, "path");
  lua_pop(L, 2);
}

/* ---- options ------------------------------------------------------------------------- */

enum { OPT_EXEC = 1, OPT_INTERACTIVE = 2, OPT_VERSION = 4, OPT_HELP = 8 };

/* Index in argv of the script (argc when there is none), or -1 on a bad option, with
 * *bad its index and *missing set when it lacks its argument. */
static int collect_args(char **argv, int *flags, int *bad, int *missing)
{
  int i;
  for (i = 1; argv[i] != NULL; i++) {
    *bad = i;
    const char *a = argv[i];
    if (a[0] != '-')
      return i;
    if (strcmp(a, "--help") == 0) {
      *flags |= OPT_HELP;
      continue;
    }
    if (strcmp(a, "--version") == 0) {
      *flags |= OPT_VERSION;
      continue;
    }
    switch (a[1]) {
    case '-':
      if (a[2] != '\0')
        return -1;
      return i + 1;
    case '\0':
      return i;
    case 'i':
    case 'v':
    case 'h':
      if (a[2] != '\0')
        return -1;
      *flags |= a[1] == 'i' ? OPT_INTERACTIVE : a[1] == 'v' ? OPT_VERSION : OPT_HELP;
      break;
    case 'e':
      *flags |= OPT_EXEC;
      /* fall through */
    case 'l':
    case 'j':
      if (a[2] == '\0' && argv[++i] == NULL) {
        *missing = 1;
        return -1;
      }
      break;
    case 'O':
      break;
    default:
      return -1;
    }
  }
  return i;
}

/* Calls the function on top of the stack with the comma-separated words of opt; an error is
 * reported as its message alone (as luajit does: a bad -j or -O value, not a program's failure). */
static int call_with_words(lua_State *L, const char *opt)
{
  int n = 0;
  while (opt != NULL && *opt != '\0') {
    const char *comma = strchr(opt, ',');
    lua_pushlstring(L, opt, comma ? (size_t)(comma - opt) : strlen(opt));
    n++;
    opt = comma ? comma + 1 : NULL;
  }
  return report(L, pcall_interruptible(L, n, 0, 0));
}

static int no_jit_command(const char *cmd, size_t len)
{
  fprintf(stderr, "m3lua: unknown LuaJIT command or jit.* module not installed: %.*s\n",
          (int)len, cmd);
  return 1;
}

/* -j cmd[=arg,...]: jit.on/off/flush/... or require("jit.cmd").start(arg, ...). */
static int jit_command(lua_State *L, const char *cmd)
{
  const char *eq = strchr(cmd, '=');
  size_t len = eq ? (size_t)(eq - cmd) : strlen(cmd);
  lua_getglobal(L, "jit");
  lua_pushlstring(L, cmd, len);
  lua_gettable(L, -2);
  lua_remove(L, -2);
  if (!lua_isfunction(L, -1)) {
    lua_pop(L, 1);
    lua_getglobal(L, "require");
    lua_pushliteral(L, "jit.");
    lua_pushlstring(L, cmd, len);
    lua_concat(L, 2);
    if (lua_pcall(L, 1, 1, 0) != 0) {
      const char *msg = lua_tostring(L, -1);
      if (msg == NULL || strncmp(msg, "module ", 7) != 0)
        return report(L, 1);
      lua_pop(L, 1);
      return no_jit_command(cmd, len);
    }
    lua_getfield(L, -1, "start");
    lua_remove(L, -2);
    if (!lua_isfunction(L, -1)) {
      lua_pop(L, 1);
      return no_jit_command(cmd, len);
    }
  }
  return call_with_words(L, eq ? eq + 1 : NULL);
}

/* -O[opt,...]: require("jit.opt").start(opt, ...). */
static int jit_optimize(lua_State *L, const char *opt)
{
  lua_getglobal(L, "require");
  lua_pushliteral(L, "jit.opt");
  if (report(L, lua_pcall(L, 1, 1, 0)) != 0)
    return 1;
  lua_getfield(L, -1, "start");
  lua_remove(L, -2);
  return call_with_words(L, opt);
}

/* -l name: require it; a plain name also becomes a global. */
static int require_library(lua_State *L, const char *name)
{
  lua_getglobal(L, "require");
  lua_pushstring(L, name);
  if (report(L, docall(L, 1, 1)) != 0)
    return 1;
  if (strchr(name, '.') == NULL)
    lua_setglobal(L, name);
  else
    lua_pop(L, 1);
  return 0;
}

/* Runs -e, -l, -j and -O in order. */
static int run_options(lua_State *L, char **argv, int script)
{
  for (int i = 1; i < script; i++) {
    const char *a = argv[i];
    int status = 0;
    if (a[0] != '-' || a[1] == '-' || a[1] == '\0')
      continue;
    const char *value = a[2] != '\0' ? a + 2 : argv[i + 1];
    switch (a[1]) {
    case 'e':
      status = luaL_loadbuffer(L, value, strlen(value), "=(command line)");
      status = report(L, status != 0 ? status : docall(L, 0, 0));
      break;
    case 'l':
      status = require_library(L, value);
      break;
    case 'j':
      status = jit_command(L, value);
      break;
    case 'O':
      status = jit_optimize(L, a + 2);
      break;
    default:
      continue;
    }
    if (status != 0)
      return status;
    if (a[2] == '\0' && a[1] != 'O')
      i++;
  }
  return 0;
}

/* The global arg: script at 0, its arguments after, the interpreter and options before. */
static void create_arg_table(lua_State *L, char **argv, int argc, int script)
{
  lua_createtable(L, argc - script, script);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i - script);
  }
  lua_setglobal(L, "arg");
}

/* Runs argv[script] ("-" is stdin unless after "--") with arg[1..n] as its `...`; past what Lua's stack
 * holds (about 8000), the arguments are in `arg` only. */
static int run_script(lua_State *L, char **argv, int script)
{
  const char *name = argv[script];
  int narg = 0;
  if (strcmp(name, "-") == 0 && strcmp(argv[script - 1], "--") != 0)
    name = NULL;
  if (report(L, luaL_loadfile(L, name)) != 0)
    return 1;
  lua_getglobal(L, "arg");
  if (lua_istable(L, -1)) {
    int n = (int)lua_objlen(L, -1);
    if (!lua_checkstack(L, n + 1))
      n = 0;
    for (narg = 1; narg <= n; narg++)
      lua_rawgeti(L, -narg, narg);
    narg = n;
    lua_remove(L, -narg - 1);
  } else {
    lua_pop(L, 1);
  }
  return report(L, docall(L, narg, 0));
}

/* The locale's character set, for the line editor (see the header). */
static void use_locale_characters(void)
{
  const char *ctype = setlocale(LC_CTYPE, "");
  if (ctype == NULL || strcmp(ctype, "C") == 0 || strcmp(ctype, "POSIX") == 0)
    setlocale(LC_CTYPE, "C.UTF-8");
}

/* require("m3.repl").run(); its result is the exit status. Signals are the REPL's
 * business between its commands, so this call is not interruptible. */
static int run_repl(lua_State *L, int *code)
{
  int status;
  use_locale_characters();
  lua_pushcfunction(L, traceback);
  lua_getglobal(L, "require");
  lua_pushliteral(L, "m3.repl");
  status = lua_pcall(L, 1, 1, -3);
  if (status == 0) {
    lua_getfield(L, -1, "run");
    lua_remove(L, -2);
    status = lua_pcall(L, 0, 1, -2);
  }
  if (status == 0)
    *code = lua_isnumber(L, -1) ? (int)lua_tointeger(L, -1) : 0;
  report(L, status);
  lua_settop(L, 0);
  return status;
}

static void print_version(void)
{
  printf("m3lua %s (%s, CUDA backend %s)\n", m3_version(), LUAJIT_VERSION,
         m3_has_cuda_build() ? "built" : "not built");
  fflush(stdout);
}

/* ---- main ------------------------------------------------------------------------------ */

struct run {
  int argc;
  char **argv;
  int code; /* exit status */
};

static int exit_code(int status)
{
  return status == 0 ? 0 : pending_sig ? 128 + pending_sig : 1;
}

static int pmain(lua_State *L)
{
  struct run *r = lua_touserdata(L, 1);
  char **argv = r->argv;
  int flags = 0, bad = 0, missing = 0;
  int script = collect_args(argv, &flags, &bad, &missing);
  int status;
  lua_settop(L, 0);
  if (script < 0)
    fprintf(stderr, missing ? "m3lua: option %s needs an argument\n" : "m3lua: unknown option %s\n", argv[bad]);
  if (script < 0 || (flags & OPT_HELP)) {
    fputs(usage_text, script < 0 ? stderr : stdout);
    r->code = script < 0;
    return 0;
  }
  lua_gc(L, LUA_GCSTOP, 0);
  luaL_openlibs(L);
  lua_gc(L, LUA_GCRESTART, -1);
  set_path(L);
  register_host(L);
  create_arg_table(L, argv, r->argc, script);
  if (flags & OPT_VERSION)
    print_version();
  status = run_options(L, argv, script);
  if (status == 0 && script < r->argc)
    status = run_script(L, argv, script);
  r->code = exit_code(status);
  if (status != 0)
    return 0;
  if ((flags & OPT_INTERACTIVE) ||
      (script == r->argc && !(flags & (OPT_EXEC | OPT_VERSION)) && isatty(STDIN_FILENO))) {
    if (run_repl(L, &r->code) != 0)
      r->code = 1;
  } else if (script == r->argc && !(flags & (OPT_EXEC | OPT_VERSION))) {
    status = luaL_loadfile(L, NULL);
    r->code = exit_code(report(L, status != 0 ? status : docall(L, 0, 0)));
  }
  return 0;
}

/* OpenBLAS 0.3.21 (Debian 12) does not know some newer x86 cores (seen: Sapphire Rapids
 * in a VM) and falls back to its Prescott kernels, several times slower for sgemm. It
 * reads OPENBLAS_CORETYPE only while loading, so when that happened on a CPU with AVX-512
 * or AVX2, run again naming the best kernel set the CPU can execute. */
static void reexec_for_blas(char **argv)
{
#if defined(__x86_64__)
  const char *core = NULL;
  if (getenv("OPENBLAS_CORETYPE") || strcmp(m3_cpu_blas_core(), "Prescott") != 0)
    return;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    core = "SkylakeX";
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    core = "Haswell";
  if (core && setenv("OPENBLAS_CORETYPE", core, 1) == 0)
    execv("/proc/self/exe", argv); /* returns only on failure: carry on as we are */
#else
  (void)argv;
#endif
}

/* Runs as the process exits with status, from main or os.exit: output lost to a full disk or a
 * closed pipe is a failure, not a clean exit; after SIGPIPE (the reader went away) the status its
 * default action would have given, and no message. */
static void check_stdout_at_exit(int status, void *unused)
{
  (void)unused;
  if (status != 0)
    return;
  const int flushed = fflush(stdout) == 0, flush_errno = errno;
  if (flushed && !ferror(stdout))
    return;
  if (pending_sig != SIGPIPE)
    fprintf(stderr, "m3lua: writing the standard output failed%s%s\n", flushed ? "" : ": ",
            flushed ? "" : strerror(flush_errno));
  fflush(NULL); /* the other streams, which exit flushes after this handler */
  _exit(pending_sig == SIGPIPE ? 128 + SIGPIPE : 1);
}

int main(int argc, char **argv)
{
  static char *no_args[] = { "m3lua", NULL };
  struct run r = { argc, argv, 0 };
  lua_State *L;
  if (argc == 0 || argv[0] == NULL) {
    r.argc = 1;
    r.argv = no_args;
  }
  reexec_for_blas(r.argv);
  /* Keeps libm3 linked under --as-needed; the binding checks the version itself. */
  if (m3_abi_version() <= 0) {
    fputs("m3lua: libm3 reports no ABI version\n", stderr);
    return 1;
  }
  rl_catch_signals = 0;        /* libedit leaves SIGINT, SIGTERM and SIGTSTP to the host */
  rl_getc_function = read_key; /* and Ctrl-C ends the line being edited */
  rl_pre_input_hook = note_line_start_modes;
  L = luaL_newstate();
  if (L == NULL) {
    fputs("m3lua: cannot create the Lua state: not enough memory\n", stderr);
    return 1;
  }
  init_interrupts(L);
  on_exit(check_stdout_at_exit, NULL);
  if (lua_cpcall(L, pmain, &r) != 0) {
    report(L, 1);
    r.code = 1;
  }
  lua_close(L);
  return r.code;
}
