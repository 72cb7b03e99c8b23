"""The local container runtime the container tests, the demo and the benchmark run on,
installed by the project itself, once per machine and idempotently (``ensure``).

What it sets up (Debian 12, as root):

- podman, runc and conmon from apt; crun is not used (it fails on hybrid cgroups);
  catatonit, the init process ``podman run --init`` (NeMo Gym's default) runs, which
  Debian 12's podman does not pull in;
- CRIU 4.x for process checkpoints: the system's ``criu`` when ``criu check`` passes,
  else CRIU 4.1.1 built from Debian trixie's source package (fetched through a temporary
  apt configuration that leaves the system's sources alone, its hash checked against the
  signed source index) into ``/usr/local/lib/nemo-ckpt/criu-4.1.1``. Debian 12's CRIU
  3.17 fails ``criu check`` on newer kernels ("Unexpected rt vDSO area bounds"). When no
  CRIU passes, the setup says why and the backend captures filesystems only;
- a project-local containers configuration (runc, the cgroupfs manager, the file events
  logger, the ulimits podman needs here), in ``.venv/containers/containers.conf``;
- a busybox image, ``localhost/nemo-ckpt-busybox:1``, imported from a rootfs tar made of
  busybox-static's binary and its links (no registry is reachable here);
- a ``docker`` command that runs ``podman "$@"``, in ``.venv/containers/bin`` (on the
  runtime's ``PATH``, nowhere else), for NeMo Gym's ``docker`` sandbox provider, which
  drives the ``docker`` command line.

As a command: ``python -m tests.container_runtime [--json]`` installs what is missing and
prints the setup; ``python -m tests.container_runtime -- COMMAND ...`` then runs COMMAND
with the runtime's environment (``make demo-containers``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nemo_ckpt.containers.podman import criu_check_problem

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / ".venv" / "containers"
SHIM_DIR = CONF_DIR / "bin"
_DOCKER_SHIM = """#!/bin/sh
# Written by tests/container_runtime.py: NeMo Gym's docker provider drives podman.
exec podman "$@"
"""
IMAGE = "localhost/nemo-ckpt-busybox:1"
CRIU_VERSION = "4.1.1"
CRIU_DIR = Path("/usr/local/lib/nemo-ckpt") / f"criu-{CRIU_VERSION}"
_APT_PACKAGES = ("podman", "runc", "conmon", "catatonit", "busybox-static", "iptables")
# The binary podman's --init mounts: catatonit itself, not podman's default path, which
# Debian makes a link to it (CRIU cannot restore a bind mount of a link).
INIT_PATH = "/usr/bin/catatonit"
_CRIU_BUILD_DEPS = ("build-essential", "pkgconf", "libbsd-dev", "libcap-dev",
                    "libgnutls28-dev", "libnet1-dev", "libnl-3-dev", "libnftables-dev",
                    "libprotobuf-c-dev", "libprotobuf-dev", "protobuf-c-compiler",
                    "protobuf-compiler", "uuid-dev", "xz-utils")
_CONF = f"""\
# Written by tests/container_runtime.py for nemo-ckpt's tests and demo.
[containers]
# podman's defaults exceed this host's limits.
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
# `--init`'s binary: the file, not podman's default path (a link: CRIU's restore
# cannot bind-mount it).
init_path = "{INIT_PATH}"

[engine]
# crun fails on this host's hybrid cgroups; runc with the cgroupfs manager works.
cgroup_manager = "cgroupfs"
runtime = "runc"
events_logger = "file"
"""


@dataclass
class Setup:
    """What ``ensure`` found or made: the environment to run podman with, the image,
    and CRIU's state (``criu`` is None when no CRIU passes ``criu check``)."""

    env: dict[str, str]
    image: str
    podman: str
    criu: str | None
    criu_problem: str | None
    steps: list[str] = field(default_factory=list)


def _log(msg: str) -> None:
    print(f"container runtime: {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, text=True, capture_output=True, **kw)  # type: ignore[call-overload]


def _apt_install(packages: tuple[str, ...]) -> None:
    missing = [p for p in packages
               if _run(["dpkg-query", "-W", "-f=${Status}", p]).stdout.strip()
               != "install ok installed"]
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise RuntimeError(f"the container runtime needs {' '.join(missing)}: install them "
                           f"(as root: apt-get install {' '.join(missing)})")
    _log(f"apt-get install {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]
    done = _run(cmd, env=env)
    if done.returncode != 0:  # stale or absent package lists
        _log("apt-get update")
        _run(["apt-get", "update", "-qq"], env=env)
        done = _run(cmd, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"apt-get install {' '.join(missing)} failed:\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _trixie_sources_hash(apt_dir: Path) -> str:
    """The sha256 of CRIU's orig tarball as trixie's signed source index states it."""
    for index in (apt_dir / "lists").glob("*trixie*Sources*"):
        raw = index.read_bytes()
        if index.suffix == ".lz4":
            raw = _run(["lz4cat", str(index)]).stdout.encode()
        elif index.suffix == ".xz":
            raw = lzma.decompress(raw)
        text = raw.decode("utf-8", "replace")
        start = text.find("\nPackage: criu\n")
        if start < 0:
            continue
        stanza = text[start:text.find("\n\n", start + 1)]
        in_sha = False
        for line in stanza.splitlines():
            if line.startswith("Checksums-Sha256:"):
                in_sha = True
            elif in_sha and line.startswith(" "):
                digest, _, name = line.split()
                if name == f"criu_{CRIU_VERSION}.orig.tar.xz":
                    return digest
            else:
                in_sha = False
    raise RuntimeError("trixie's source index names no criu orig tarball")


def _build_criu(steps: list[str]) -> None:
    """CRIU 4.x from Debian trixie's source package, into ``CRIU_DIR``."""
    _apt_install(_CRIU_BUILD_DEPS + ("lz4",))
    with tempfile.TemporaryDirectory(prefix="nemo-ckpt-criu-") as tmp:
        apt = Path(tmp) / "apt"
        for d in ("lists/partial", "cache/archives/partial"):
            (apt / d).mkdir(parents=True)
        (apt / "sources.list").write_text(
            "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
            "http://deb.debian.org/debian trixie main\n")
        opts = [f"-oDir::Etc::SourceList={apt}/sources.list",
                "-oDir::Etc::SourceParts=/dev/null", f"-oDir::State::Lists={apt}/lists",
                f"-oDir::Cache={apt}/cache"]
        _log("fetching CRIU's trixie source package (a temporary apt configuration)")
        done = _run(["apt-get", *opts, "update", "-qq"])
        if done.returncode != 0:
            raise RuntimeError(f"apt-get update (trixie sources) failed: {done.stderr[-500:]}")
        src = Path(tmp) / "src"
        src.mkdir()
        # Only the upstream tarball is needed (`make criu`, not the Debian packaging).
        _run(["apt-get", *opts, "source", "--download-only", "criu"], cwd=src)
        tarball = src / f"criu_{CRIU_VERSION}.orig.tar.xz"
        if not tarball.exists():
            raise RuntimeError(f"trixie's criu source is not {CRIU_VERSION}: "
                               f"{sorted(p.name for p in src.iterdir())}")
        want = _trixie_sources_hash(apt)
        got = hashlib.sha256(tarball.read_bytes()).hexdigest()
        if got != want:
            raise RuntimeError(f"{tarball.name}: sha256 {got}, the signed index says {want}")
        with tarfile.open(tarball) as tar:
            tar.extractall(src, filter="tar")  # hash-checked; it links to /usr/include
        tree = src / f"criu-{CRIU_VERSION}"
        _log(f"building CRIU {CRIU_VERSION} (make criu; a minute or so)")
        done = _run(["make", f"-j{os.cpu_count() or 2}", "criu"], cwd=tree)
        if done.returncode != 0:
            raise RuntimeError(f"building CRIU failed:\n{done.stdout[-1500:]}"
                               f"{done.stderr[-1500:]}")
        CRIU_DIR.mkdir(parents=True, exist_ok=True)
        part = CRIU_DIR / "criu.partial"
        shutil.copy2(tree / "criu" / "criu", part)
        os.replace(part, CRIU_DIR / "criu")
        steps.append(f"built CRIU {CRIU_VERSION} into {CRIU_DIR}")


def _find_criu(steps: list[str]) -> tuple[str | None, str | None]:
    """(criu's path, None) or (None, why no CRIU passes ``criu check``)."""
    ours = CRIU_DIR / "criu"
    if ours.exists() and criu_check_problem(str(ours)) is None:
        return str(ours), None
    system = shutil.which("criu")
    problem = None
    if system is not None:
        problem = criu_check_problem(system)
        if problem is None:
            return system, None
    try:
        _build_criu(steps)
    except (RuntimeError, OSError) as exc:
        return None, f"{problem + '; ' if problem else ''}CRIU {CRIU_VERSION}: {exc}"
    problem_ours = criu_check_problem(str(ours))
    return (str(ours), None) if problem_ours is None else (None, problem_ours)


def _busybox_image(env: dict[str, str], podman: str, steps: list[str]) -> None:
    if _run([podman, "image", "exists", IMAGE], env=env).returncode == 0:
        return
    busybox = shutil.which("busybox") or "/bin/busybox"
    with tempfile.TemporaryDirectory(prefix="nemo-ckpt-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        for d in ("bin", "tmp", "proc", "sys", "dev", "etc", "work", "root"):
            (rootfs / d).mkdir(parents=True)
        (rootfs / "tmp").chmod(0o1777)
        shutil.copy2(busybox, rootfs / "bin" / "busybox")
        applets = _run([busybox, "--list"]).stdout.split()
        for name in applets:
            if name != "busybox" and "/" not in name:
                (rootfs / "bin" / name).symlink_to("busybox")
        (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        (rootfs / "etc" / "group").write_text("root:x:0:\n")
        tar_path = Path(tmp) / "rootfs.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(rootfs, arcname=".")
        done = _run([podman, "import", "-q", "--change", "CMD=/bin/sh", str(tar_path),
                     IMAGE], env=env)
        if done.returncode != 0:
            raise RuntimeError(f"podman import failed: {done.stderr.strip()}")
    steps.append(f"imported {IMAGE}")


def docker_shim() -> Path:
    """The project's ``docker`` command, which runs ``podman "$@"``: written (again) when
    missing or changed. Returns its path."""
    shim = SHIM_DIR / "docker"
    if not shim.is_file() or shim.read_text() != _DOCKER_SHIM:
        SHIM_DIR.mkdir(parents=True, exist_ok=True)
        shim.write_text(_DOCKER_SHIM)
    shim.chmod(0o755)
    return shim


def runtime_env(criu: str | None) -> dict[str, str]:
    """The environment variables podman runs with here (beside the process's own): the
    project's ``docker`` first on ``PATH``, and CRIU's folder (runc runs ``criu`` from
    ``PATH``)."""
    env = {"CONTAINERS_CONF": str(CONF_DIR / "containers.conf")}
    path = [str(SHIM_DIR)] + ([] if criu is None else [str(Path(criu).parent)])
    env["PATH"] = ":".join([*path, os.environ.get("PATH", "/usr/bin:/bin")])
    return env


def ensure() -> Setup:
    """Install and configure what is missing (idempotent; seconds when all is there)."""
    steps: list[str] = []
    _apt_install(_APT_PACKAGES)
    CONF_DIR.mkdir(parents=True, exist_ok=True)
    conf = CONF_DIR / "containers.conf"
    if not conf.exists() or conf.read_text() != _CONF:
        conf.write_text(_CONF)
        steps.append(f"wrote {conf}")
    criu, problem = _find_criu(steps)
    docker_shim()
    extra = runtime_env(criu)
    env = {**os.environ, **extra}
    podman = shutil.which("podman") or "/usr/bin/podman"
    _busybox_image(env, podman, steps)
    return Setup(env=extra, image=IMAGE, podman=podman, criu=criu, criu_problem=problem,
                 steps=steps)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in args:
        at = args.index("--")
        args, command = args[:at], args[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m tests.container_runtime",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the setup as JSON")
    opts = parser.parse_args(args)
    setup = ensure()
    for step in setup.steps:
        _log(step)
    if opts.json:
        print(json.dumps(asdict(setup), indent=2))
    else:
        _log(f"podman {setup.podman}, image {setup.image}, "
             + (f"CRIU {setup.criu}" if setup.criu else f"no CRIU ({setup.criu_problem})"))
    if command:
        return subprocess.call(command, env={**os.environ, **setup.env})
    return 0


if __name__ == "__main__":
    sys.exit(main())
