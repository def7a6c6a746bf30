"""Starts one container: ``python -I -S launcher.py SPEC.json`` (as root, from the kubelet).

Joins the pod's network namespace, enters a new mount namespace (private propagation) and, with a
``hostname``, a new UTS namespace with the pod's hostname (names.py), mounts a
private tmpfs at /tmp and the pod's volumes (bind mounts; read-only where asked), then becomes
the container's process: setpriv drops to the container's user, groups and capabilities and
execs its command, so the container's PID is this process's PID. If the command cannot start,
the reason goes to SPEC's ``error_file`` and the launcher exits 128 (the runtime's StartError).

Standard library only: it runs before the container's environment exists.
"""
import ctypes
import json
import os
import shutil
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18

libc = ctypes.CDLL(None, use_errno=True)


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount {source} on {target}")


def enter_namespaces(netns: str | None, hostname: str | None) -> None:
    if netns:
        with open(netns) as f:
            check(libc.setns(f.fileno(), CLONE_NEWNET), f"setns {netns}")
    check(libc.unshare(CLONE_NEWNS), "unshare mount namespace")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    if hostname:
        check(libc.unshare(CLONE_NEWUTS), "unshare UTS namespace")
        name = hostname.encode()
        check(libc.sethostname(name, ctypes.c_size_t(len(name))), f"sethostname {hostname}")


def ensure_mountpoint(target: str, is_file: bool) -> None:
    if os.path.lexists(target):
        return
    if is_file:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    else:
        os.makedirs(target, exist_ok=True)


def bind(fd: int, target: str, read_only: bool = False) -> None:
    """Bind-mounts what ``fd`` (an O_PATH descriptor taken before any mount) refers to."""
    ensure_mountpoint(target, stat.S_ISREG(os.fstat(fd).st_mode))
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    if read_only:
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def capture(spec: dict) -> dict[str, int]:
    """O_PATH descriptors of every mount source and exposed path, taken in the new mount
    namespace while the host's /tmp and the directories that mounts will cover are visible."""
    paths = [m["source"] for m in spec["mounts"]] + list(spec.get("keep") or [])
    paths += [keep for e in spec.get("expose") or [] for keep in e["keep"]]
    return {p: os.open(p, os.O_PATH) for p in paths}


def keep_visible(target: str, spec: dict, fds: dict[str, int]) -> None:
    """Binds again each path the image runs from (``keep``: the checkout, Python) that the mount
    just made at ``target`` covers, e.g. a checkout under /tmp under the private /tmp."""
    for keep in spec.get("keep") or []:
        if keep.startswith(target.rstrip("/") + "/"):
            bind(fds[keep], keep)


def mount_all(spec: dict, fds: dict[str, int]) -> None:
    """The /tmp tmpfs; each ``expose`` entry (a directory that the container's user cannot
    traverse, e.g. /root holding pyenv's Python) becomes a tmpfs that shows only the paths it
    must keep; then each bind mount, parents before children. What the image runs from stays
    visible under each of them."""
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    keep_visible("/tmp", spec, fds)
    for entry in spec.get("expose") or []:
        mount("tmpfs", entry["dir"], "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
        for keep in entry["keep"]:
            bind(fds[keep], keep)
    for m in sorted(spec["mounts"], key=lambda m: m["target"].rstrip("/").count("/")):
        bind(fds[m["source"]], m["target"], m.get("read_only", False))
        keep_visible(m["target"], spec, fds)


def resolve(argv0: str, path: str) -> str | None:
    if "/" in argv0:
        return argv0 if os.access(argv0, os.X_OK) else None
    return shutil.which(argv0, path=path)


def exec_container(spec: dict) -> None:
    env, argv = spec["env"], spec["argv"]
    if resolve(argv[0], env.get("PATH", "")) is None:
        raise FileNotFoundError(f'exec: "{argv[0]}": executable file not found in $PATH')
    workdir = spec.get("workdir") or "/"
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    prefix = setpriv_args(spec)
    os.execvpe(prefix[0] if prefix else argv[0], prefix + argv, env)


def setpriv_args(spec: dict) -> list[str]:
    """``setpriv …  --`` for the user, groups, no_new_privs and capabilities; [] for plain root."""
    args = []
    if spec["uid"] != 0 or spec["gid"] != 0 or spec.get("groups"):
        groups = ",".join(str(g) for g in spec.get("groups") or [])
        args += [f"--reuid={spec['uid']}", f"--regid={spec['gid']}",
                 f"--groups={groups}" if groups else "--clear-groups"]
    if spec.get("no_new_privs"):
        args.append("--no-new-privs")
    if spec.get("drop_all_caps"):
        args += ["--inh-caps=-all", "--bounding-set=-all"]
    return ["/usr/bin/setpriv", *args, "--"] if args else []


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    error_file = open(spec["error_file"], "w")
    try:
        enter_namespaces(spec.get("netns"), spec.get("hostname"))
        fds = capture(spec)
        mount_all(spec, fds)
        exec_container(spec)
    except OSError as err:
        error_file.write(f"failed to create containerd task: failed to create shim task: "
                         f"OCI runtime create failed: {err.strerror or err}")
        error_file.close()
        sys.exit(128)


if __name__ == "__main__":
    main()
