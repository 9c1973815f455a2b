"""compose.yaml run for real with podman and podman-compose (rootful, runc), on a machine whose
container registries are unreachable: a Debian base image made here with debootstrap, the ktserve
image built on it from the repo's Dockerfile (a CPU-only torch from what pip here resolves),
and compose projects with names of their own that leave nothing behind.

What stays between runs, on purpose: the base image (BASE_IMAGE, a minute of debootstrap) and the
Dockerfile's build stage (BUILD_CACHE: the venv with torch, most of a build's time), so a run
rebuilds only what changed; the build stage a run replaces is removed. What a run builds beyond
that (its image) and starts (containers, their network and volume) goes when it ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.watched_process import REPO

BASE_IMAGE = "localhost/ktserve-base:bookworm"
BUILD_CACHE = "localhost/ktserve-build-cache:latest"
TORCH_SPEC = "torch==2.13.0+cpu"  # NOTE: a +cpu local version exists in no CUDA index
TOOLS = ("podman", "podman-compose", "debootstrap", "runc", "prometheus")
# NOTE: .ci/run installs the same list
PACKAGES = ("podman podman-compose runc catatonit golang-github-containernetworking-plugin-dnsname "
            "debootstrap prometheus")  # fmt: skip
NEEDED_FILES = {
    "catatonit": Path("/usr/libexec/podman/catatonit"),  # compose's `init: true`
    "golang-github-containernetworking-plugin-dnsname": Path("/usr/lib/cni/dnsname"),  # names
}
# runc: crun rejects this machine's cgroup setup; the ulimits: the host's nproc limit is more
# than a container may set here (runc fails "error setting rlimit type 7")
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
[engine]
runtime = "runc"
"""
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")  # NOTE: lent to pip in the build


class Podman:
    """podman and podman-compose with this module's containers.conf (the host's is untouched)."""

    def __init__(self, workdir: Path) -> None:
        conf = workdir / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def run(self, *args: str, check: bool = True, timeout: float = 600, env: dict | None = None,
            program: str = "podman") -> subprocess.CompletedProcess:  # fmt: skip
        done = subprocess.run([program, *args], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout, env={**self.env, **(env or {})})  # fmt: skip
        if check and done.returncode != 0:
            raise RuntimeError(f"{program} {' '.join(args)} failed ({done.returncode}):\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")  # fmt: skip
        return done

    def image_id(self, name: str) -> str | None:
        done = self.run("image", "inspect", "--format", "{{.Id}}", name, check=False)
        return done.stdout.strip() if done.returncode == 0 else None

    def inspect(self, container: str, template: str) -> str:
        return self.run("inspect", "--format", template, container).stdout.strip()


def missing_prerequisites() -> str | None:
    """Why compose cannot be tried here (None: it can)."""
    if os.geteuid() != 0:
        return "rootful podman needs root (the CI runs as root)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    missing += [package for package, path in NEEDED_FILES.items() if not path.exists()]
    if missing:
        return f"{', '.join(missing)} missing: apt-get install -y {PACKAGES} (.ci/run does)"
    return None


def ensure_base_image(podman: Podman) -> None:
    """BASE_IMAGE: Debian bookworm with python3, venv and headers, from this machine's apt mirror
    (debootstrap), unless it is there already."""
    if podman.image_id(BASE_IMAGE):
        return
    mirror = "http://deb.debian.org/debian"
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        uris = [ln.split()[1] for ln in sources.read_text().splitlines() if ln.startswith("URIs:")]
        mirror = uris[0] if uris else mirror
    with tempfile.TemporaryDirectory(prefix="ktserve-rootfs-") as rootfs:
        subprocess.run(["debootstrap", "--variant=minbase",
                        "--include=python3,python3-venv,python3-dev,ca-certificates",
                        "bookworm", rootfs, mirror], check=True, capture_output=True,
                       timeout=1200)  # fmt: skip
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["podman", "import", "--change", 'CMD ["/bin/bash"]', "-",
                                   BASE_IMAGE], stdin=tar.stdout, capture_output=True,
                                  env=podman.env, timeout=600)  # fmt: skip
        tar.stdout.close()
        tar.wait()
        if imported.returncode != 0:
            raise RuntimeError(f"podman import failed: {imported.stderr.decode()[-2000:]}")


def container_refusal(podman: Podman) -> str | None:
    """Why a container cannot run here (None: one ran)."""
    done = podman.run("run", "--rm", "--init", BASE_IMAGE, "python3", "-c", "print('ok')",
                      check=False, timeout=300)  # fmt: skip
    if done.returncode != 0 or done.stdout.strip() != "ok":
        return f"podman cannot run a container here: {done.stderr.strip()[-1500:]}"
    return None


def build_image(podman: Podman, tag: str, workdir: Path) -> None:
    """The repo's Dockerfile on BASE_IMAGE with a CPU-only torch, as `tag`; BUILD_CACHE is its
    build stage, kept for the next run (the one it replaces is removed)."""
    wheels = workdir / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest",
                    str(wheels), TORCH_SPEC], check=True, capture_output=True,
                   timeout=1200)  # fmt: skip
    args = ["build", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
            "--build-arg", f"TORCH_SPEC={TORCH_SPEC}", "--volume", f"{wheels}:/wheels:ro",
            "--build-arg", "PIP_ARGS=--find-links /wheels"]  # fmt: skip
    if CA_BUNDLE.exists():
        args += ["--volume", f"{CA_BUNDLE}:/run/host-ca.crt:ro",
                 "--build-arg", "PIP_CERT=/run/host-ca.crt"]  # fmt: skip
    old_cache = podman.image_id(BUILD_CACHE)
    try:
        podman.run(*args, "--target", "build", "-t", BUILD_CACHE, ".", timeout=2400)
        podman.run(*args, "-t", tag, ".", timeout=1200)
    finally:
        shutil.rmtree(wheels)  # NOTE: torch's wheel, 183 MB
    if old_cache and old_cache != podman.image_id(BUILD_CACHE):
        podman.run("rmi", old_cache, check=False)


class ComposeProject:
    """`podman-compose -p NAME -f compose.yaml [-f override]` with its own network and ktshm
    volume; down() removes its containers, network and volume."""

    def __init__(self, podman: Podman, name: str, files: list[Path], env: dict[str, str]):
        self.podman = podman
        self.name = name
        self.files = files
        self.env = env
        self.volume = f"{name}_ktshm"
        self.network = f"{name}_default"

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        files = [a for f in self.files for a in ("-f", str(f))]
        return self.podman.run("-p", self.name, *files, *args, timeout=timeout, env=self.env,
                               program="podman-compose")  # fmt: skip

    def up(self, *services: str) -> None:
        # NOTE: podman-compose 1.0 ignores a volume's driver_opts: the tmpfs is made here (podman
        # reads o=size as an XFS quota, so it keeps tmpfs's default size; uid/gid: the containers'
        # user, else the mount is root's 0755)
        self.podman.run("volume", "create", "--opt", "type=tmpfs", "--opt", "device=tmpfs",
                        "--opt", "o=mode=1777,uid=1000,gid=1000", self.volume)  # fmt: skip
        self.compose("up", "-d", "--no-build", *services)

    def container(self, service: str) -> str:
        return f"{self.name}_{service}_1"

    def restarts(self, service: str) -> int:
        return int(self.podman.inspect(self.container(service), "{{.RestartCount}}"))

    def main_pid(self, service: str) -> int:
        """The host pid of the container's command (its init's one child)."""
        init = self.podman.inspect(self.container(service), "{{.State.Pid}}")
        return int(Path(f"/proc/{init}/task/{init}/children").read_text().split()[0])

    def logs(self, service: str) -> str:
        done = self.podman.run("logs", self.container(service), check=False)
        return done.stdout + done.stderr

    def leftovers(self) -> list[str]:
        """What of this project is still there (nothing, after down())."""
        label = f"label=io.podman.compose.project={self.name}"
        left = self.podman.run("ps", "-a", "--filter", label, "--format", "{{.Names}}").stdout
        out = left.split()
        for kind, name in (("volume", self.volume), ("network", self.network)):
            if self.podman.run(kind, "exists", name, check=False).returncode == 0:
                out.append(f"{kind} {name}")
        return out

    def down(self) -> None:
        self.compose("down", "-t", "5", timeout=300)
        for kind, name in (("volume", self.volume), ("network", self.network)):
            self.podman.run(kind, "rm", "-f", name, check=False)


def wait_for(predicate, timeout: float, what: str, poll_s: float = 1.0):
    """predicate()'s first truthy value, polled until timeout seconds (errors count as false)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception:  # noqa: BLE001 - not there yet
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll_s)
