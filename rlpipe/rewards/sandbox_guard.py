"""Runs one candidate program inside the sandbox: `python -I sandbox_guard.py LIMITS_JSON`, in the
candidate's throwaway directory (rlpipe.rewards.sandbox starts it and reads its MEMORY_EXIT).

Before the candidate runs, it sets hard resource limits (address space, CPU seconds, file size, open
files) and installs an audit hook (PEP 578), which cannot be removed, that refuses: creating or
connecting sockets, fork/exec/spawn/subprocess, signals to other processes, ctypes, raising the
limits, and writing, deleting or renaming anything outside the directory. Each refusal is recorded
in .violations (so a program that catches the PermissionError still scores 0). Standard library
only: the candidate's interpreter imports nothing of rlpipe.
"""

import json
import os
import resource
import sys

BLOCKED_EVENTS = {
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen",
    "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
    "resource.setrlimit", "resource.prlimit", "os.setuid", "os.setgid", "os.chroot",
}  # fmt: skip
BLOCKED_IMPORTS = {"_posixsubprocess", "_ctypes"}  # subprocess and ctypes without their audit events
PATH_EVENTS = {
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
    "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "os.chdir",
}  # fmt: skip
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
MEMORY_EXIT = 99  # the exit code of an uncaught MemoryError: rlpipe.rewards.sandbox reads it as the memory limit


def main() -> None:
    limits = json.loads(sys.argv[1])
    memory = limits["memory_mb"] * 1024 * 1024
    for limit, value in (
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_DATA, memory),
        (resource.RLIMIT_CPU, limits["cpu_s"]),
        (resource.RLIMIT_FSIZE, limits["file_mb"] * 1024 * 1024),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, (value, value))
    root = os.path.realpath(os.getcwd())
    record = os.open(".violations", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with open("candidate.py") as f:
        code = compile(f.read(), "candidate.py", "exec")

    def inside(path: object) -> bool:
        if isinstance(path, int):
            return True  # a file descriptor the process already holds
        if isinstance(path, bytes):
            path = path.decode(errors="replace")
        full = os.path.realpath(os.path.join(root, str(path)))
        return full == root or full.startswith(root + os.sep) or full == os.devnull

    def refuse(event: str) -> None:
        os.write(record, f"{event}\n".encode())
        raise PermissionError(f"sandbox: {event} is not allowed")

    def audit(event: str, args: tuple) -> None:
        if event in BLOCKED_EVENTS:
            refuse(event)
        elif event == "import" and args[0] in BLOCKED_IMPORTS:
            refuse(f"import {args[0]}")
        elif event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2]
            writes = (isinstance(flags, int) and flags & WRITE_FLAGS) or (
                isinstance(mode, str) and any(ch in mode for ch in "wax+")
            )
            if writes and not inside(path):
                refuse(f"write outside its directory ({path})")
        elif event in PATH_EVENTS and args and not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
            refuse(f"{event} outside its directory")

    sys.addaudithook(audit)
    sys.argv = ["candidate.py"]
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:  # the address-space limit: said by the exit code, not by the text on stderr
        sys.stderr.write("MemoryError: the sandbox's memory limit\n")
        os._exit(MEMORY_EXIT)


if __name__ == "__main__":
    main()
