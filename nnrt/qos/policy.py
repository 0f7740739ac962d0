"""The operator's QoS policy: per-app weights, priority caps, limits and
deadline kinds, read from TOML.

A policy is a list of rules tried in order and a default. A rule matches an
app by any of ``uid``, ``user`` (name), ``exe`` (the executable the kernel
reports for the peer pid, ``/proc/PID/exe``), ``cgroup`` (its control group,
``/proc/PID/cgroup``: a systemd unit, a container; a rule's cgroup matches
that group and every group below it), and what the app declares when it
connects (:class:`~nnrt.hal.AppDeclaration`): ``script`` (the file its
Python runs) and ``app`` (the name it gives, ``Runtime(app=...)`` or
``NNRT_APP_NAME``); and an app on another host by ``remote``, the name its
gRPC transport verified (its TLS client certificate's common name, or its
token's name: ``nnrt driver serve --listen``). Every key a rule gives must match; ``name`` is the
rule's own name (status shows it). The first matching rule gives the app's
:class:`~nnrt.qos.scheduler.AppSettings`; keys it leaves out come from
``[default]``, and what that leaves out from the device (its queue and
memory limits).

The kernel reports uid, exe and cgroup; an app can declare any script or
name, so a rule that matches ``script`` or ``app`` must also give ``uid``
or ``user``: another user's process cannot claim it (the uid stays the
security boundary; within it, apps are told apart as they declare).

Example (``docs/operators/policy.md``)::

    [default]
    weight = 1
    queue_limit = 32           # executions in an app's queue
    when_full = "wait"         # or "fail": RESOURCE_EXHAUSTED_TRANSIENT
    deadlines = "hard"         # or "soft": run late and report the miss

    [[app]]
    name = "camera"
    exe = "/usr/bin/camera-app"
    weight = 3
    max_priority = "high"

    [[app]]
    name = "batch"
    user = "builder"
    weight = 1
    max_priority = "low"
    memory_limit = "256MiB"
    when_full = "fail"

Identity. A driver service keys an app by peer pid (the default: each
process its own share) or uid (``--app-key``); for a pid key the scheduler
looks up that process's uid, user name, executable and cgroup, and takes
its declaration, when it first sees the app; for a uid key only the uid and
user name are known (several processes share the queue), so ``exe``,
``cgroup``, ``script`` and ``app`` rules never match them. Reading another user's ``/proc/PID/exe`` needs the right to
trace it; when that fails the exe is unknown and ``exe`` rules do not match.
In process (``Runtime(policy=...)``) the app is this process.
"""
from __future__ import annotations

import os
import pwd
import re
import stat
import tomllib
from dataclasses import dataclass, field
from typing import Callable, Hashable

from ..errors import NnrtError, invalid
from ..hal.types import AppDeclaration, Priority
from .scheduler import AppSettings

# A policy is a few rules: a file larger than this is a mistake or an
# attack, refused before it is read into the service.
MAX_POLICY_BYTES = 1 << 20

_PRIORITIES = {"low": Priority.LOW, "medium": Priority.MEDIUM, "high": Priority.HIGH}
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3}
_SETTING_KEYS = {"weight", "max_priority", "queue_limit", "memory_limit", "deadlines",
                 "when_full", "connections", "models", "bursts"}
_KERNEL_KEYS = ("uid", "user", "exe", "cgroup")
_DECLARED_KEYS = ("script", "app")
# What a remote transport verified: the TLS client certificate's common name
# or the token's name (nnrt/service/remote). Like the kernel's keys, the app
# cannot choose it.
_TRANSPORT_KEYS = ("remote",)
_MATCH_KEYS = {*_KERNEL_KEYS, *_DECLARED_KEYS, *_TRANSPORT_KEYS}


@dataclass(frozen=True)
class AppIdentity:
    """What is known about the process(es) behind an app key: what the
    kernel reports (uid, user, exe, cgroup, pid) and what a process app
    declared (script, name)."""

    uid: int | None = None
    user: str | None = None
    exe: str | None = None
    pid: int | None = None
    cgroup: str | None = None
    script: str | None = None
    name: str | None = None
    remote: str | None = None     # a remote app's verified name (certificate or token)

    def describe(self) -> str:
        """How ``nnrt driver status`` names the app: its declared name, the
        script or executable, the pid (or uid); a remote app by its name."""
        if self.remote is not None:
            return f"remote {self.remote}"
        what = self.script or self.exe
        parts = [p for p in (self.name, what and os.path.basename(what),
                             f"pid {self.pid}" if self.pid is not None
                             else f"uid {self.uid}" if self.uid is not None else None) if p]
        return " ".join(parts) or "unknown"


def identify_pid(pid: int, declaration: AppDeclaration | None = None) -> AppIdentity:
    """The uid, user name, executable and cgroup of process ``pid`` (None
    where the kernel will not tell: the process is gone, or belongs to
    another user), with what it declared."""
    uid = exe = None
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        pass
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        pass
    d = declaration or AppDeclaration()
    return AppIdentity(uid, _user(uid), exe, pid, _cgroup(pid), d.script or None, d.name or None)


def identify_uid(uid: int) -> AppIdentity:
    return AppIdentity(uid, _user(uid), None, None)


def identify(key: Hashable, declaration: AppDeclaration | None = None) -> AppIdentity:
    """The identity behind an app key: a service's ``("pid", n)`` or
    ``("uid", n)``, or an int pid (the in-process default key); a
    declaration counts for a process key only (a uid key's processes could
    each declare another)."""
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], int):
        if key[0] == "pid":
            return identify_pid(key[1], declaration)
        if key[0] == "uid":
            return identify_uid(key[1])
    if isinstance(key, int) and not isinstance(key, bool):
        return identify_pid(key, declaration)
    if isinstance(key, tuple) and len(key) == 2 and key[0] == "remote" \
            and isinstance(key[1], str):
        return AppIdentity(remote=key[1])
    return AppIdentity()


def _cgroup(pid: int) -> str | None:
    """The cgroup v2 path of ``pid`` (the ``0::`` line of /proc/PID/cgroup),
    or on a v1-only system the systemd hierarchy's; None when unreadable."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 16).splitlines()
    except OSError:
        return None
    paths = dict(line.split(":", 2)[1:] for line in lines if line.count(":") >= 2)
    return paths.get("") or paths.get("name=systemd")


def _under(group: str, rule: str) -> bool:
    """Whether cgroup ``group`` is ``rule`` or below it."""
    rule = rule.rstrip("/") or "/"
    return group == rule or group.startswith(rule if rule == "/" else rule + "/")


def _user(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


@dataclass(frozen=True)
class Rule:
    name: str
    uid: int | None = None
    user: str | None = None
    exe: str | None = None
    cgroup: str | None = None
    script: str | None = None
    app: str | None = None        # the name the app declared
    remote: str | None = None     # a remote app's certificate or token name
    settings: dict = field(default_factory=dict)   # the keys this rule sets

    def matches(self, who: AppIdentity) -> bool:
        return ((self.uid is None or self.uid == who.uid)
                and (self.user is None or self.user == who.user)
                and (self.exe is None or (who.exe is not None
                                          and os.path.realpath(self.exe) == who.exe))
                and (self.cgroup is None or (who.cgroup is not None
                                             and _under(who.cgroup, self.cgroup)))
                and (self.script is None or (who.script is not None
                                             and os.path.realpath(self.script) == who.script))
                and (self.app is None or self.app == who.name)
                and (self.remote is None or self.remote == who.remote))


@dataclass(frozen=True)
class Policy:
    """Rules tried in order, then the default. ``Policy()`` is the default
    policy: every app weight 1, any priority, the device's limits, hard
    deadlines, waiting at a full queue."""

    rules: tuple[Rule, ...] = ()
    default: dict = field(default_factory=dict)
    source: str | None = None      # the file it was read from

    @classmethod
    def from_toml(cls, text: str, source: str | None = None) -> "Policy":
        where = source or "the policy"
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise invalid(f"{where} is not valid TOML: {e}") from None
        unknown = set(doc) - {"default", "app"}
        if unknown:
            raise invalid(f"{where}: unknown table(s) {sorted(unknown)} (expected [default] "
                          f"and [[app]])")
        default = _settings(doc.get("default", {}), f"{where} [default]")
        rules = []
        apps = doc.get("app", [])
        if not isinstance(apps, list):
            raise invalid(f"{where}: 'app' must be an array of tables ([[app]])")
        for i, entry in enumerate(apps):
            what = f"{where} [[app]] #{i + 1}"
            if not isinstance(entry, dict):
                raise invalid(f"{what} is not a table")
            unknown = set(entry) - _SETTING_KEYS - _MATCH_KEYS - {"name"}
            if unknown:
                raise invalid(f"{what}: unknown key(s) {sorted(unknown)}")
            match = {k: entry[k] for k in _MATCH_KEYS if k in entry}
            if not match:
                raise invalid(f"{what} matches nothing: give uid, user, exe, cgroup, script, "
                              f"app or remote")
            if "uid" in match and (isinstance(match["uid"], bool)
                                   or not isinstance(match["uid"], int)):
                raise invalid(f"{what}: uid must be an integer")
            for k in ("user", "exe", "cgroup", "script", "app", "remote"):
                if k in match and not isinstance(match[k], str):
                    raise invalid(f"{what}: {k} must be a string")
            declared = [k for k in _DECLARED_KEYS if k in match]
            if declared and "uid" not in match and "user" not in match:
                raise invalid(f"{what} matches {' and '.join(declared)}, which an app declares "
                              f"itself: give uid or user too, so another user's app cannot "
                              f"claim the rule")
            name = entry.get("name", f"app#{i + 1}")
            if not isinstance(name, str):
                raise invalid(f"{what}: name must be a string")
            settings = _settings({k: v for k, v in entry.items() if k in _SETTING_KEYS}, what)
            rules.append(Rule(name, settings=settings, **match))
        return cls(tuple(rules), default, source)

    @classmethod
    def load(cls, path: str) -> "Policy":
        """The policy in the file at ``path``: a regular file of at most
        MAX_POLICY_BYTES, not empty. Opened without blocking, so a FIFO (or a
        device) planted at the path is refused instead of stalling the
        service's loop until someone writes to it; an empty file (an editor
        truncating before it writes) is refused instead of read as "no rules",
        which would lift every cap."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise invalid(f"cannot read the policy file {path}: {e.strerror or e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise invalid(f"the policy file {path} is not a regular file")
            if st.st_size > MAX_POLICY_BYTES:
                raise invalid(f"the policy file {path} has {st.st_size} bytes, more than "
                              f"{MAX_POLICY_BYTES}")
            data = os.read(fd, MAX_POLICY_BYTES + 1)
        except OSError as e:
            raise invalid(f"cannot read the policy file {path}: {e.strerror or e}") from None
        finally:
            os.close(fd)
        if len(data) > MAX_POLICY_BYTES:      # it grew between fstat and read
            raise invalid(f"the policy file {path} has more than {MAX_POLICY_BYTES} bytes")
        try:
            text = data.decode()
        except UnicodeDecodeError as e:
            raise invalid(f"the policy file {path} is not UTF-8: {e}") from None
        if not text.strip():
            raise invalid(f"the policy file {path} is empty (write [default] for a policy "
                          f"with no rules)")
        return cls.from_toml(text, path)

    def rule_for(self, who: AppIdentity) -> Rule | None:
        return next((r for r in self.rules if r.matches(who)), None)

    def settings_for(self, who: AppIdentity) -> AppSettings:
        rule = self.rule_for(who)
        merged = dict(self.default)
        if rule is not None:
            merged.update(rule.settings)
        return AppSettings(name=None if rule is None else rule.name, who=who.describe(),
                           **merged)

    def resolver(self, declarations: Callable[[Hashable], AppDeclaration | None] = lambda k: None):
        """A ``Scheduler(settings=...)`` callable: app key -> AppSettings;
        ``declarations`` gives what an app key's process declared."""
        return lambda key: self.settings_for(identify(key, declarations(key)))


def _settings(table: dict, what: str) -> dict:
    """AppSettings keyword arguments from one TOML table (checked)."""
    if not isinstance(table, dict):
        raise invalid(f"{what} is not a table")
    unknown = set(table) - _SETTING_KEYS
    if unknown:
        raise invalid(f"{what}: unknown key(s) {sorted(unknown)}")
    out = {}
    if "weight" in table:
        out["weight"] = table["weight"]
    if "max_priority" in table:
        value = table["max_priority"]
        if not isinstance(value, str) or value.lower() not in _PRIORITIES:
            raise invalid(f"{what}: max_priority must be low, medium or high, got {value!r}")
        out["max_priority"] = _PRIORITIES[value.lower()]
    for key in ("queue_limit", "connections", "models", "bursts"):
        if key in table:
            out[key] = table[key]
    if "memory_limit" in table:
        out["memory_limit"] = _bytes(table["memory_limit"], what)
    if "deadlines" in table:
        if table["deadlines"] not in ("hard", "soft"):
            raise invalid(f"{what}: deadlines must be \"hard\" or \"soft\"")
        out["soft_deadlines"] = table["deadlines"] == "soft"
    if "when_full" in table:
        if table["when_full"] not in ("wait", "fail"):
            raise invalid(f"{what}: when_full must be \"wait\" or \"fail\"")
        out["fail_when_full"] = table["when_full"] == "fail"
    try:
        AppSettings(**out)   # checks the values now, not when an app first shows up
    except NnrtError as e:
        raise invalid(f"{what}: {e.message}") from None
    return out


def _bytes(value, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(m.group(1)) * _UNITS[m.group(2).lower()]
    raise invalid(f"{what}: memory_limit must be a byte count like 268435456 or \"256MiB\", "
                  f"got {value!r}")

