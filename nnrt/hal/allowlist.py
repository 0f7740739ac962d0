"""Which apps may use vendor extensions and OEM operations.

NNAPI lets only allowlisted apps use extensions. Here an operator lists
them in a file, one entry per line:

* an entry starting with ``/`` is an executable path: an app whose
  executable (``/proc/PID/exe``, as the kernel reports it) is that file;
* any other entry is an app name: an executable with that file name, or
  (in process only) an app that calls itself so (``NNRT_APP_NAME``, else the
  file name of ``sys.argv[0]``);
* blank lines and lines starting with ``#`` are ignored.

The files read, in this order, are ``$XDG_CONFIG_HOME/nnrt/extensions-allowlist``
(``~/.config/...`` without ``XDG_CONFIG_HOME``) and the system-wide
``/etc/nnrt/extensions-allowlist``; an app listed in either may use
extensions. No file means no app may.

nnrt's own extensions (``nnrt.extensions.OWN``: ``com.nnrt.mediapipe``)
ship with nnrt and need no entry; the allowlist is for third-party vendors'.

The runtime checks the calling app when it compiles a model that uses an
extension (``nnrt.runtime.partition``); a driver service checks again from
the peer's kernel-reported executable (SO_PEERCRED pid -> ``/proc/PID/exe``),
because an app's own claims are not to be trusted by another process.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ErrorStatus, NnrtError
from ..extensions import OWN

FILE_NAME = "extensions-allowlist"
SYSTEM_FILE = Path("/etc/nnrt") / FILE_NAME


def allowlist_files() -> list[Path]:
    """The files that make up the allowlist, user file first."""
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return [Path(config) / "nnrt" / FILE_NAME, SYSTEM_FILE]


@dataclass(frozen=True)
class Allowlist:
    executables: frozenset[str]
    names: frozenset[str]

    @classmethod
    def parse(cls, text: str) -> "Allowlist":
        exes, names = set(), set()
        for line in text.splitlines():
            entry = line.strip()
            if not entry or entry.startswith("#"):
                continue
            if entry.startswith("/"):
                exes.add(os.path.realpath(entry))
            else:
                names.add(entry)
        return cls(frozenset(exes), frozenset(names))

    @classmethod
    def load(cls, files: list[Path] | None = None) -> "Allowlist":
        """The union of the allowlist files that exist (read afresh each time:
        an operator may edit them while apps run)."""
        exes, names = set(), set()
        for path in allowlist_files() if files is None else files:
            try:
                text = path.read_text()
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as e:
                raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                                f"cannot read the extensions allowlist {path}: {e}") from None
            part = cls.parse(text)
            exes |= part.executables
            names |= part.names
        return cls(frozenset(exes), frozenset(names))

    def allows(self, executable: str | None, names: tuple[str, ...] = ()) -> bool:
        if executable is not None:
            if os.path.realpath(executable) in self.executables:
                return True
            if os.path.basename(executable) in self.names:
                return True
        return any(n in self.names for n in names)


def peer_executable(pid: int) -> str | None:
    """The executable of process ``pid`` as the kernel reports it, None when
    it cannot be read (the process is gone, or another user's)."""
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def current_app_names() -> tuple[str, ...]:
    names = []
    if os.environ.get("NNRT_APP_NAME"):
        names.append(os.environ["NNRT_APP_NAME"])
    if sys.argv and sys.argv[0]:
        names.append(os.path.basename(sys.argv[0]))
    return tuple(names)


def _refusal(who: str, used: set[str]) -> NnrtError:
    what = ", ".join(sorted(used))
    return NnrtError(ErrorStatus.INVALID_ARGUMENT,
                     f"{who} is not allowed to use vendor extensions ({what}): add its "
                     f"executable path or name to {allowlist_files()[0]} or {SYSTEM_FILE}")


def check_current_app(used: set[str]) -> None:
    """Refuse this process the extensions ``used`` unless it is allowlisted."""
    used = set(used) - OWN
    if not used:
        return
    exe = peer_executable(os.getpid())
    if not Allowlist.load().allows(exe, current_app_names()):
        raise _refusal(f"this app ({exe}, {' / '.join(current_app_names()) or 'no name'})", used)


def check_peer(pid: int, used: set[str]) -> None:
    """Refuse peer ``pid`` (from SO_PEERCRED) the extensions ``used`` unless
    its kernel-reported executable is allowlisted (by path or file name)."""
    used = set(used) - OWN
    if not used:
        return
    exe = peer_executable(pid)
    if exe is None or not Allowlist.load().allows(exe):
        raise _refusal(f"the app of pid {pid} (executable {exe})", used)
